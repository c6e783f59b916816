"""The one registry of the cost model's figures (xpar.estimate.terms): every figure the planner
reports, with and without cp/ep axes, and every term the scalar estimate breaks its step into,
is a key of the registry. Fast: small samples of two plan spaces, no workers."""
from __future__ import annotations

import numpy as np

from xpar.estimate import terms
from xpar.estimate.cost import estimate
from xpar.plan.context import COLUMNS, OPTIONAL_COLUMNS, spec_of
from xpar.plan.evaluate import evaluate
from xpar.plan.space import Constraints

from tests.plan.test_plan_five import _sample, context, space_of


def _reported(ctx, constraints: Constraints, pick, n: int) -> tuple[dict, dict]:
    space = space_of(ctx, constraints)
    sub = _sample(space.cols, pick(space.cols), n, 0)
    return sub, evaluate(ctx, sub)


def test_every_figure_the_planner_reports_is_a_registry_key():
    dense = context("7b", "a100_80gb_8gpu", 2048)
    moe = context("mixtral_8x7b", "h100_80gb_64gpu", 4096)
    cases = [(dense, Constraints(global_batch=(64, 64)), lambda c: np.ones(len(c["tp"]), bool)),
             (moe, Constraints(global_batch=(64, 64), cp=(1, 2), ep=(1, 2, 4, 8)), lambda c: (c["ep"] > 1) & (c["cp"] > 1))]
    for ctx, constraints, pick in cases:
        sub, res = _reported(ctx, constraints, pick, 6)
        figures = set(res) - set(COLUMNS) - set(OPTIONAL_COLUMNS)
        assert figures <= terms.figure_keys(), figures - terms.figure_keys()
        assert set(terms.PLAN_TIME_KEYS) | set(terms.PLAN_MEMORY_KEYS) <= figures
        est = estimate(spec_of(ctx, sub, 0))
        assert set(est.time_breakdown) <= set(terms.TIME_TERMS) | set(terms.AXIS_TIME_TERMS)


def test_key_lists_derive_from_the_term_records():
    assert terms.TIME_TERMS + terms.AXIS_TIME_TERMS + terms.SETTING_TIME_TERMS == tuple(t.name for t in terms.TIME)
    assert set(terms.TERM_WORDS) == set(terms.TIME_TERMS) | set(terms.AXIS_TIME_TERMS) | set(terms.SETTING_TIME_TERMS)
    assert set(terms.COLUMN_MEMORY_KEYS) == set(terms.PLAN_MEMORY_KEYS) | {"memory_pp_rank"}
    assert set(terms.COLUMN_TIME_KEYS) == set(terms.PLAN_TIME_KEYS) | set(terms.COMM_ISSUED_KEYS)
