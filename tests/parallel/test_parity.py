"""The parity matrix: every executable layout equals the single-process reference.

The matrix is the product of six axes (:data:`AXES`): pipeline schedule (``none``: pp = 1)
x ZeRO stage 0-3 x dp in {1, 2} x tp in {1, 2, 2 with sequence parallelism} x recompute
none/full/selective x fp32/bf16: 1,152 combinations. Every one is validated here (no worker):
a combination that cannot run must be refused by validation with a message, and the test
asserts the refusal. Executing all of them would take hours on 2 cores, so the executed rows
are

- every schedule x ZeRO stage at dp = 2 (fp32, tp = 1, no recompute): the dp wrappers under
  each schedule, the zero-bubble x DDP case of pytorch#144530 among them;
- a pairwise covering array over all six axes: every pair of values of any two axes appears
  in at least one executed row (greedy, smallest world first, so few rows need 8 workers);
- :data:`UNEVEN`: pipelines whose first or last stage holds fewer or no blocks (the embedding
  or the head alone), under several schedules, ZeRO stages, tp and recompute;
- :data:`FIVE_D`: context and expert parallelism composed with pp, dp, tp, ZeRO and bf16 on the
  mixture-of-experts model (pp x tp x cp x ep on 8 workers).

Each executed row trains 2 steps and its loss (mean over the ranks holding the last stage)
and pre-clip global gradient norm (every rank) are compared with the single-process reference
of the same recipe (:func:`xpar.run.reference.reference_run`): relative 1e-4 in fp32 (as
tests/parallel/test_pipeline.py), 2e-4 for bf16's loss and 1e-2 for its norm (tests/parallel/test_precision.py's
loss tolerance; the norm of bf16 gradients carries bf16's 2^-8 resolution).

One spawn per world size (2, 4, 8 workers) runs all of its rows in a row.
"""
from __future__ import annotations

import itertools
import math

import pytest

from tests.conftest import spawn, spec_for
from tests.parallel.test_clipping import (
    _norms as _train,  # worker: every rank's (losses, grad_norms, lrs) per spec
)
from xpar.config.layout import EXECUTABLE, SCHEDULES

AXES = {
    "schedule": ["none", *EXECUTABLE],  # the estimate-only zb_h1 / zb_h2: refused, tests/config/test_config.py
    "zero": [0, 1, 2, 3],
    "dp": [1, 2],
    "tp": ["1", "2", "2sp"],
    "recompute": ["none", "full", "selective"],
    "dtype": ["fp32", "bf16"],
}
STEPS = 2  # the second step's loss shows the first update; a missing dp reduction shows in the first step's norms


def settings(row: dict) -> dict:
    """The config fields one matrix row sets, as ``group.key: value``."""
    pp = 1 if row["schedule"] == "none" else 2
    out = {"parallel.pp": pp, "parallel.dp": row["dp"], "parallel.zero_stage": row["zero"],
           "parallel.tp": int(row["tp"][0]), "parallel.sequence_parallel": row["tp"] == "2sp",
           "parallel.recompute": row["recompute"], "train.dtype": row["dtype"],
           "parallel.micro_batches": 4 if pp > 1 else 2}
    if pp > 1:
        out.update({"parallel.schedule": row["schedule"], "parallel.virtual_stages": "auto"})
    if "split" in row:  # an uneven pipeline (UNEVEN)
        out["parallel.layer_split"] = row["split"]
    out.update({f"parallel.{k}": row[k] for k in ("cp", "ep") if k in row})  # FIVE_D
    return out


BASE = ["model=tiny", f"train.steps={STEPS}", "train.warmup_steps=1"]

UNEVEN = [  # stages with fewer or no blocks (Megatron's --decoder-first/last-pipeline-num-layers), executed too
    {"schedule": "1f1b", "zero": 0, "dp": 1, "tp": "1", "recompute": "none", "dtype": "fp32", "split": [0, 4]},
    {"schedule": "gpipe", "zero": 1, "dp": 2, "tp": "1", "recompute": "none", "dtype": "fp32", "split": [3, 1]},
    {"schedule": "interleaved_1f1b", "zero": 2, "dp": 2, "tp": "1", "recompute": "none", "dtype": "fp32",
     "split": [0, 2, 2, 0]},
    {"schedule": "zbv", "zero": 0, "dp": 2, "tp": "1", "recompute": "full", "dtype": "fp32", "split": [0, 2, 2, 0]},
    {"schedule": "1f1b", "zero": 3, "dp": 1, "tp": "2sp", "recompute": "full", "dtype": "bf16", "split": [4, 0]},
]


FIVE_D = [  # context and expert parallelism composed with the others (issue 30), model=moe_tiny
    {"schedule": "1f1b", "zero": 0, "dp": 1, "tp": "2", "recompute": "none", "dtype": "fp32", "cp": 2, "ep": 2,
     "model": "moe_tiny"},
    {"schedule": "none", "zero": 2, "dp": 2, "tp": "1", "recompute": "full", "dtype": "bf16", "cp": 2, "ep": 2,
     "model": "moe_tiny"},
]
"""pp x dp x tp x cp x ep on 8 workers (pp2 tp2 cp2, ep2 inside dp x cp) and dp2 x cp2 with ep2 under
ZeRO-2 in bf16 with full recompute (zero-bubble pipelines with cp, and with ep, are rows of
tests/parallel/test_context_parallel.py and tests/parallel/test_expert_parallel.py)."""


def key(row: dict) -> str:
    """The row as the command line that runs it (a failing row can be pasted)."""
    model = [f"model={row['model']}"] if "model" in row else []
    return "python -m xpar " + " ".join(BASE + model + [f"{k}={str(v).lower() if isinstance(v, bool) else v}"
                                                        for k, v in settings(row).items()])


def world(row: dict) -> int:
    return (1 if row["schedule"] == "none" else 2) * row["dp"] * int(row["tp"][0]) * row.get("cp", 1)


def classify(base, row: dict):
    """(the validated RunSpec, None) or (None, the refusal's text). ``base``: the typed config
    of :data:`BASE` (composing each row with Hydra would cost ~0.1 s a row)."""
    from dataclasses import replace

    from xpar.config.checks import ConfigError
    from xpar.estimate.preflight.check import check_run

    groups = {"parallel": {}, "train": {}}
    for k, v in settings(row).items():
        group, field = k.split(".")
        groups[group][field] = v
    cfg = replace(base, parallel=replace(base.parallel, **groups["parallel"]),
                  train=replace(base.train, **groups["train"]))
    if "model" in row:
        from xpar.calibrate.published import preset
        from xpar.config.schema import ModelConfig
        cfg = replace(cfg, model=ModelConfig(**preset("model", row["model"])))
    try:
        return check_run(cfg, local_devices=world(row)), None
    except ConfigError as e:
        return None, str(e)


def all_rows() -> list[dict]:
    return [dict(zip(AXES, values)) for values in itertools.product(*AXES.values())]


def _pairs(row: dict) -> set:
    return {((a, row[a]), (b, row[b])) for a, b in itertools.combinations(AXES, 2)}


def executed_rows(runnable: list[dict]) -> list[dict]:
    """The core product (every schedule x ZeRO stage at dp 2) and a greedy pairwise cover of
    the runnable rows: each pick covers the most pairs not yet covered, smaller worlds first
    among equals (a pair no runnable row holds cannot be covered and is left out)."""
    core = [r for r in runnable if r["dp"] == 2 and r["tp"] == "1" and r["recompute"] == "none"
            and r["dtype"] == "fp32" and r["schedule"] != "none"]
    picked = list(core)
    todo = set().union(*(_pairs(r) for r in runnable)) - set().union(*(_pairs(r) for r in picked))
    while todo:
        best = max(runnable, key=lambda r: (len(_pairs(r) & todo), -world(r)))
        picked.append(best)
        todo -= _pairs(best)
    return picked


@pytest.fixture(scope="module")
def matrix():
    from tests.conftest import compose
    from xpar.config.validate import to_schema

    base = to_schema(compose("tracking=off", "run.progress=false", *BASE))
    classified = [(r, *classify(base, r)) for r in all_rows()]
    runnable = [r for r, spec, _ in classified if spec is not None]
    uneven = [(r, *classify(base, r)) for r in UNEVEN + FIVE_D]
    assert all(spec is not None for _, spec, _ in uneven), [refusal for _, _, refusal in uneven]
    picked = executed_rows(runnable) + UNEVEN + FIVE_D
    specs = {key(r): spec for r, spec, _ in classified + uneven if spec is not None}
    results = {}
    for n in sorted({world(r) for r in picked}):
        batch = [r for r in picked if world(r) == n]
        for r, res in zip(batch, spawn(_train, n, [specs[key(r)].to_dict() for r in batch])):
            results[key(r)] = res
    return classified, picked, specs, results


@pytest.mark.slow
def test_every_combination_runs_or_is_refused_with_a_reason(matrix):
    classified, _, _, _ = matrix
    assert len(classified) == math.prod(len(v) for v in AXES.values())
    for row, spec, refusal in classified:
        assert (spec is None) != (refusal is None), key(row)
        if refusal is not None:
            assert len(refusal) > 40 and "parallel." in refusal, (key(row), refusal)


@pytest.mark.slow
def test_refusals_are_the_known_ones(matrix):
    """Only selective recompute under a zero-bubble schedule is refused: everything else runs."""
    classified, _, _, _ = matrix
    refused = [r for r, spec, _ in classified if spec is None]
    assert refused and all(r["recompute"] == "selective" and SCHEDULES.get(r["schedule"]) is not None
                           and SCHEDULES[r["schedule"]].zero_bubble for r in refused), [key(r) for r in refused]


@pytest.mark.slow
def test_executed_rows_cover_every_pair_and_the_core(matrix):
    classified, picked, _, results = matrix
    runnable = [r for r, spec, _ in classified if spec is not None]
    assert set().union(*(_pairs(r) for r in runnable)) <= set().union(*(_pairs(r) for r in picked))
    zb_ddp = [r for r in picked if r["schedule"] in ("zero_bubble", "zbv", "dualpipev") and r["dp"] == 2
              and r["zero"] == 0 and r["tp"] == "1"]
    assert len(zb_ddp) >= 3
    assert set(results) == {key(r) for r in picked}


def _recipe(spec) -> tuple:
    """What the single-process reference of a row depends on (:func:`xpar.run.reference.reference_run`:
    the model, the training recipe and data with the global batch, and the precision kind), not the layout."""
    from xpar.parallel.precision import mixed_precision_kind
    return (repr(spec.model), repr(spec.train), repr(spec.data), spec.global_batch, spec.seq_len,
            mixed_precision_kind(spec.train.dtype, spec.layout.zero_stage))


@pytest.mark.slow
def test_every_executed_row_equals_the_reference(matrix):
    from xpar.run.reference import reference_run

    _, picked, specs, results = matrix
    bad, references = [], {}
    for row in picked:
        spec = specs[key(row)]
        ref = references.get(_recipe(spec)) or references.setdefault(_recipe(spec), reference_run(spec))
        loss_rel, norm_rel = (1e-4, 1e-4) if row["dtype"] == "fp32" else (2e-4, 1e-2)
        per_rank = results[key(row)]
        for step in range(STEPS):
            seen = [r[0][step] for r in per_rank if r[0][step] is not None]
            got = sum(seen) / len(seen)
            if got != pytest.approx(ref["losses"][step], rel=loss_rel):
                bad.append(f"{key(row)}: step {step} loss {got} vs {ref['losses'][step]}")
        for rank, (_, norms, _) in enumerate(per_rank):
            if norms != pytest.approx(ref["grad_norms"], rel=norm_rel):
                bad.append(f"{key(row)}: rank {rank} norms {norms} vs {ref['grad_norms']}")
    assert not bad, "\n".join(bad[:20])


@pytest.mark.parametrize("schedule", ["zero_bubble", "zbv", "dualpipev"])
def test_zero_bubble_under_ddp_says_xpar_reduces(schedule):
    """The explicit dp all-reduce (xpar.parallel.pipeline.split_backward_needs_reduce) is in the run's notes."""
    spec = spec_for("parallel=pp", "parallel.dp=2", "parallel.zero_stage=0", f"parallel.schedule={schedule}",
                    *BASE, local_devices=4)
    assert any("pytorch#144530" in n for n in spec.notes), spec.notes
    assert not any("pytorch#144530" in n for n in spec_for("parallel=pp", "parallel.schedule=1f1b", "parallel.dp=2",
                                                              *BASE, local_devices=4).notes)
