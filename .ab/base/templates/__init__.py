"""Jinja templates of the generated kernels (installed as maskc._templates)."""
