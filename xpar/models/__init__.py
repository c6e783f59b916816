"""Models: a decoder-only transformer and its analytic parameter count. Models know nothing of
parallelism: the strategies of :mod:`xpar.parallel` wrap them.

May import :mod:`xpar.config` only (tests/config/test_layout.py). The package imports nothing itself, so
that the torch-free cost model reads :mod:`xpar.models.shapes` without importing torch
(:mod:`xpar.models.transformer` does)."""
