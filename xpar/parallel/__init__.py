"""Parallel strategies: each a small function over (module, mesh); composed in factory.py, with
the optimizer (ZeRO-1), recompute, precision and the memory accounting of the built engine.
:mod:`~xpar.parallel.torch_internals` holds every use of torch's private APIs.

May import :mod:`xpar.config` and :mod:`xpar.models` only (tests/config/test_layout.py).
"""
