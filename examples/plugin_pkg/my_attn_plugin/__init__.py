"""Example attnbackends plugin; the backend lives in :mod:`my_attn_plugin.backend` and is found by entry point."""
