"""The cost model over columns of layouts (numpy arrays, one entry per layout), as the planner
evaluates it: every figure equals :func:`xpar.estimate.cost.estimate` on each layout's RunSpec
(tests/plan/test_plan_vector.py, tests/plan/test_plan_memory.py, tests/plan/test_plan_five.py, relative 1e-9).

- :mod:`~xpar.estimate.columns.step_time`: step time, its terms and the rates.
- :mod:`~xpar.estimate.columns.peak_memory`: peak memory per device by term.
- :mod:`~xpar.estimate.columns.cp_ep`: context- and expert-parallel layouts, by group.
- :mod:`~xpar.estimate.columns.stage_split`: the pipeline split of a candidate (blocks per rank).
- :mod:`~xpar.estimate.columns.mixed_blocks`: FSDP unit times where dense and MoE blocks differ.
- :mod:`~xpar.estimate.columns.one_layout`, :mod:`~xpar.estimate.columns.layout_memory`: one layout as a
  column of length one, every pipeline rank a slot (the estimate's step time and memory).

Sub-results that depend on a few columns come from the scalar functions once per distinct key;
the rest is the scalar model's own array-polymorphic arithmetic. No torch import.
"""
