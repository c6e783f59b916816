"""Global gradient-norm clipping (xpar.parallel.optim): the pre-clip norm every rank reports equals
the single-process norm on dp, zero3, tp, pp and 3D (pp2 x dp2 x tp2, ZeRO-3), and training
with clipping active keeps the single-process losses. Also the lr schedule's shape.

One spawn of 2 workers and one of 8 (3D).
"""
import math

import pytest

from tests.conftest import run_specs, spawn, spec_for

LAYOUTS = {"dp": ["parallel=dp"], "zero3": ["parallel=zero3"], "tp": ["parallel=tp"],
           "pp": ["parallel=pp", "model=tiny", "parallel.schedule=1f1b"]}
CLIP = ["train.max_grad_norm=0.3", "train.steps=3", "train.warmup_steps=1", "parallel.micro_batches=2",
        "train.lr_schedule=cosine", "train.lr_warmup_steps=1"]
"""0.3 is below every step's norm (0.6-0.9 on tiny), so each step is clipped."""


def _norms(spec_dicts: list[dict]) -> list:
    """Worker: train each spec; every rank's (losses, grad_norms, lrs)."""
    import tempfile
    from pathlib import Path

    from xpar.config.spec import RunSpec
    from xpar.run.worker import run_rank

    out = []
    for d in spec_dicts:
        with tempfile.TemporaryDirectory() as tmp:
            stats = run_rank(RunSpec.from_dict(d), Path(tmp))
        if stats is not None:
            out.append([[s["losses"], s["grad_norms"], s["lrs"]] for s in stats])
    return out


@pytest.fixture(scope="module")
def results():
    specs = {k: spec_for(*v, *CLIP) for k, v in LAYOUTS.items()}
    out = dict(zip(specs, spawn(_norms, 2, [s.to_dict() for s in specs.values()])))
    specs["3d"] = spec_for("parallel=3d_local", *CLIP, local_devices=8)
    specs["3d_bf16"] = spec_for("parallel=3d_local", "train.dtype=bf16", *CLIP, local_devices=8)
    out["3d"], out["3d_bf16"] = spawn(_norms, 8, [specs["3d"].to_dict(), specs["3d_bf16"].to_dict()])
    return specs, out


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS) + ["3d"])
def test_clipped_global_norm_equals_single_process(results, layout):
    from xpar.run.reference import reference_run

    specs, out = results
    ref = reference_run(specs[layout])
    assert min(ref["grad_norms"]) > specs[layout].train.max_grad_norm  # clipping was active
    for losses, norms, _ in out[layout]:  # every rank
        assert norms == pytest.approx(ref["grad_norms"], rel=1e-5), layout
    per_rank = [r[0] for r in out[layout] if r[0][0] is not None]
    for step in range(3):
        got = sum(r[step] for r in per_rank) / len(per_rank)
        assert got == pytest.approx(ref["losses"][step], rel=1e-5), (layout, step)


@pytest.mark.slow
def test_bf16_3d_matches_the_mixed_precision_reference(results):
    """3D (pp2 x dp2 x tp2, ZeRO-3) in bf16 mixed precision against the single-process run of
    the same recipe (FSDP2 policy: bf16 compute, fp32 master and reduction); tolerance as in
    tests/parallel/test_precision.py (relative 2e-4)."""
    from xpar.run.reference import reference_run

    specs, out = results
    ref = reference_run(specs["3d_bf16"])
    for losses, norms, _ in out["3d_bf16"]:
        assert norms == pytest.approx(ref["grad_norms"], rel=2e-3)
    per_rank = [r[0] for r in out["3d_bf16"] if r[0][0] is not None]
    for step in range(3):
        got = sum(r[step] for r in per_rank) / len(per_rank)
        assert got == pytest.approx(ref["losses"][step], rel=2e-4), step


def test_lr_schedule_warms_up_then_decays():
    from xpar.parallel.optim import lr_factor

    f = [lr_factor(k, "cosine", steps=10, warmup=2, min_ratio=0.1) for k in range(10)]
    assert f[:3] == [0.5, 1.0, 1.0] and f[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(f[1:], f[2:]))
    assert f[5] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 3 / 7)))
    # constant: the warm-up is honoured too (it was silently ignored), then lr stays fixed
    assert [lr_factor(k, "constant", 10, 2, 0.1) for k in range(4)] == [0.5, 1.0, 1.0, 1.0]
    assert [lr_factor(k, "constant", 10, 0, 0.1) for k in range(2)] == [1.0, 1.0]


@pytest.mark.slow
def test_runs_follow_the_schedule(results):
    from xpar.parallel.optim import lr_factor

    specs, out = results
    t = specs["dp"].train
    lrs = out["dp"][0][2]  # lr after each step's scheduler update
    assert lrs == pytest.approx([t.lr * lr_factor(k + 1, "cosine", 3, 1, t.min_lr_ratio) for k in range(3)])
