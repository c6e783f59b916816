"""The analytic cost model (memory, FLOPs, communication, schedule) for layouts beyond this
machine, the fake-process-group dry run that checks it, the fit check that refuses layouts
that do not fit, and the :class:`~xpar.estimate.report.Report` both estimated and measured runs
fill (with its bubble and step-time statistics, and the fidelity of an estimate to a run).

May import :mod:`xpar.config`, :mod:`xpar.models` and :mod:`xpar.parallel` (the dry run builds
the real engine on meta tensors); nothing above (tests/test_layout.py).
"""
