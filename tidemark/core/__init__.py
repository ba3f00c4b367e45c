"""Foundations every layer uses: errors, process settings, DSN masking and connection
resolution, PostgreSQL connections, and the fault points the crash tests arm.

May import: nothing of tidemark.
"""
