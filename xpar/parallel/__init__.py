"""Parallel strategies: each a small function over (module, mesh); composed in factory.py."""
