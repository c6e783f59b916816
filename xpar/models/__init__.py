"""Models: a decoder-only transformer and its analytic parameter count. Models know nothing of
parallelism: the strategies of :mod:`xpar.parallel` wrap them.

May import :mod:`xpar.config` only (tests/test_layout.py)."""
from xpar.models.shapes import ParamCount, param_count
from xpar.models.transformer import Transformer

__all__ = ["Transformer", "ParamCount", "param_count"]
