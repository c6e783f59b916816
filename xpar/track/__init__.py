"""What a run leaves behind: MLflow runs and their journal, sweeps and their parent run,
``xpar compare``'s tables and plots, run names.

May import :mod:`xpar.config`, :mod:`xpar.models`, :mod:`xpar.parallel` and :mod:`xpar.estimate`;
never :mod:`xpar.plan`, :mod:`xpar.run` or :mod:`xpar.calibrate` (tests/config/test_layout.py).
"""
