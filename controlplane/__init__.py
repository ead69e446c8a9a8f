"""The Palisade control plane: the Django project, its service and the operator API conventions."""

__version__ = "0.1.0"
