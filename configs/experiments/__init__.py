"""Gin configs (no code): see configs/__init__.py."""
