"""Draft policy: what a change would do before it is made (docs/architecture.md, "The apps")."""
