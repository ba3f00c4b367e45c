"""Tidemark: exactly-once batch replay of offset-addressed logs into PostgreSQL."""

__version__ = "0.1.0"
