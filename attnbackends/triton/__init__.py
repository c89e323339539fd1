"""Triton unified paged attention."""
