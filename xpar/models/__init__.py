"""Models: a decoder-only transformer and its analytic parameter count."""
from xpar.models.shapes import ParamCount, param_count
from xpar.models.transformer import Transformer

__all__ = ["Transformer", "ParamCount", "param_count"]
