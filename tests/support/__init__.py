"""Helpers the tests share: real processes, namespaces, fake peers, and the schema check."""
