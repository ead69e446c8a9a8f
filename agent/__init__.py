"""The Palisade agent: enrols a host, keeps its `table inet palisade` in step with the control plane."""

__version__ = "0.1.0"
