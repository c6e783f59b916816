"""Executing a run on this machine or a cluster: the job (one run of ``python -m xpar``), the
launch of local workers, the worker and its training loop, data, checkpoints and resume,
host memory, and the single-process reference every layout is checked against. ``run.mode=estimate``
(:mod:`~xpar.run.estimate_mode`, with the fake-process-group :mod:`~xpar.run.dryrun`) and an executed
run's own estimate (:mod:`~xpar.run.fidelity`) live here too.

May import every layer below it (config, models, parallel, estimate, track, plan); never
:mod:`xpar.calibrate` (tests/config/test_layout.py).
"""
