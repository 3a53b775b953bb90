"""Sections of tools/soak.py, one module each."""
