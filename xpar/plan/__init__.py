"""``xpar plan``: every valid layout of a model on a cluster, ranked by the cost model.

Candidates are columns of numpy arrays over layouts (:mod:`xpar.plan.context` documents them);
the cost model is evaluated on all of them at once and equals :func:`xpar.estimate.cost.estimate`
on each (tests/plan/test_plan_vector.py).

May import :mod:`xpar.config`, :mod:`xpar.models`, :mod:`xpar.parallel`, :mod:`xpar.estimate` and
:mod:`xpar.track` (to record a plan); never :mod:`xpar.run` or :mod:`xpar.calibrate` (tests/config/test_layout.py).
"""
