"""Presentation shared by the web app and the CLI: how a dead letter's payload, key and
headers read on a page or a terminal (payloads.py).

May import: core.
"""
