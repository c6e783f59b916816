"""Before a run, not the model: ``check`` (does a layout fit memory: :func:`check_run`, the layouts
that would fit), ``nearest_fit`` (the nearest memory settings that fit, for a refusal), ``duration``
(how long a local run will take). Here and not in :mod:`xpar.run` because :mod:`xpar.track.sweep`
and :mod:`xpar.plan.execute` check each job before it runs (tests/config/test_layout.py's layers)."""
