"""What a run leaves behind: its report (measured or estimated: :mod:`~xpar.track.report`, with the
bubble and step-time statistics of measured runs and the figures of an estimate), MLflow runs and
their journal, sweeps and their parent run, ``xpar compare``'s tables and plots, run names.

May import :mod:`xpar.config`, :mod:`xpar.models`, :mod:`xpar.parallel` and :mod:`xpar.estimate`;
never :mod:`xpar.plan`, :mod:`xpar.run` or :mod:`xpar.calibrate` (tests/config/test_layout.py).
"""
