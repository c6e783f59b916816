"""xpar: declarative experiments for training parallelism."""
__version__ = "0.1.0"
