"""Every routed expert takes part in every step, tokens or none (issue 40; pytorch#158719,
torchtitan#2747): an expert that received no tokens still runs on its empty slice, so its
parameters get zero gradients and every dp rank reduces the same set of gradients.

In one process: experts forced empty get zero (not missing) gradients and the output is unchanged.
Executed: ``model=moe_tiny`` at dp 2 with one sequence per micro-batch (experts left without
tokens on one rank but not the other) under ZeRO 0-3 and under pp 2 trains 20 steps equal to the
single-process reference (loss and pre-clip gradient norm, rel 1e-4 as tests/parallel/test_parity.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from tests.conftest import spawn, spec_for
from tests.parallel.test_clipping import _norms as _train  # worker: every rank's (losses, grad_norms, lrs) per spec
from xpar.calibrate.published import preset
from xpar.config.schema import ModelConfig
from xpar.models.transformer import MoE, run_experts
from xpar.run.launch import hung_run
from xpar.run.reference import reference_run

STEPS = 20
BASE = ("model=moe_tiny", "parallel.dp=2", "train.micro_batch_size=1", "train.seq_len=8",
        f"train.steps={STEPS}", "train.warmup_steps=1")
ZERO = {f"zero{z}": (f"parallel.zero_stage={z}", "parallel.micro_batches=1") for z in range(4)}
PIPE = {"pp2_1f1b": ("parallel.pp=2", "parallel.schedule=1f1b", "parallel.micro_batches=2")}


def _moe(seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    return MoE(ModelConfig(**preset("model", "moe_tiny")))


def test_an_expert_without_tokens_gets_zero_gradients_not_none():
    """Tokens all routed to experts 0 and 1: experts 2 and 3 run on no rows, their gradients are
    zeros (so a dp reduction sees them), and the output equals the routed sum of experts 0 and 1."""
    moe = _moe()
    x_TH = torch.randn(6, moe.router.in_features)
    experts_TK = torch.tensor([[0, 1]] * 6)
    gates_TK = torch.full((6, 2), 0.5)
    out = run_experts(moe.experts, x_TH, gates_TK, experts_TK)
    want = 0.5 * moe.experts["0"](x_TH) + 0.5 * moe.experts["1"](x_TH)
    torch.testing.assert_close(out, want)
    out.sum().backward()
    for key in ("2", "3"):
        grads = [p.grad for p in moe.experts[key].parameters()]
        assert all(g is not None for g in grads), key
        assert all(torch.count_nonzero(g) == 0 for g in grads), key
    assert all(torch.count_nonzero(p.grad) > 0 for p in moe.experts["0"].parameters())


def test_every_expert_is_in_the_graph_whatever_the_router_picks():
    """Through the whole MoE block, a router forced to one expert pair leaves no parameter without
    a gradient."""
    moe = _moe(1)
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[0].fill_(1.0)
        moe.router.weight[1].fill_(0.5)
    x = torch.rand(1, 4, moe.router.in_features) + 0.1  # positive: experts 0 and 1 score highest
    moe(x).sum().backward()
    assert [n for n, p in moe.named_parameters() if p.grad is None] == []


@pytest.fixture(scope="module")
def results():
    specs = {k: spec_for(*BASE, *v, local_devices=2) for k, v in ZERO.items()}
    specs |= {k: spec_for(*BASE, *v, local_devices=4) for k, v in PIPE.items()}
    out = dict(zip(ZERO, spawn(_train, 2, [specs[k].to_dict() for k in ZERO])))
    out |= dict(zip(PIPE, spawn(_train, 4, [specs[k].to_dict() for k in PIPE])))
    return specs, out


@pytest.mark.slow
@pytest.mark.parametrize("name", [*ZERO, *PIPE])
def test_one_sequence_per_micro_batch_trains_like_the_reference(results, name):
    specs, out = results
    spec = specs[name]
    torch.manual_seed(0)
    ref = reference_run(spec)
    seen = [r[0] for r in out[name] if r[0][0] is not None]
    assert len(seen) == 2  # the dp ranks holding the (last stage's) loss
    for step in range(STEPS):
        got = sum(r[step] for r in seen) / len(seen)
        assert got == pytest.approx(ref["losses"][step], rel=1e-4), (name, step, got, ref["losses"][step])
    for rank, (_, norms, _) in enumerate(out[name]):
        assert norms == pytest.approx(ref["grad_norms"], rel=1e-4), (name, rank)


def test_hung_run_is_named_when_every_rank_beats_but_none_progresses(tmp_path):
    """Fast: heartbeats fresh, progress older than the timeout on every rank -> the rank furthest
    behind is named; one rank progressing, or a rank not yet started, -> None."""
    d = tmp_path / "heartbeat"
    d.mkdir()
    now = time.time()

    def beat(rank, step, progress_age):
        (d / f"rank{rank}.json").write_text(json.dumps({"pid": os.getpid(), "t": now, "step": step,
                                                        "progress_t": now - progress_age}))
    beat(0, 3, 50)
    assert hung_run(tmp_path, 2, 30, now) is None  # rank 1 has not started
    beat(1, -2, 40)
    assert hung_run(tmp_path, 2, 30, now) is None  # rank 1 still builds its engine
    beat(1, 2, 40)
    rank, why = hung_run(tmp_path, 2, 30, now)
    assert rank == 1 and "no rank finished a step for 40 s (run.collective_timeout_s=30)" in why
    assert "rank 0: 4, rank 1: 3" in why
    beat(0, 4, 1)
    assert hung_run(tmp_path, 2, 30, now) is None


@pytest.mark.slow
def test_a_stuck_pipeline_is_named_within_the_collective_timeout(tmp_path):
    """A real pp 2 run whose rank 1 is stuck (run.hang_rank) while rank 0 waits in the pipeline's
    send/recv (gloo does not time it out; heartbeats keep beating): ended within the timeout plus start-up,
    exit 1, one line naming the hang."""
    t0 = time.time()
    r = subprocess.run([sys.executable, "-m", "xpar", "parallel=pp", "parallel.dp=1", "run.hang_rank=1",
                        "run.collective_timeout_s=8", "tracking=off", "train.steps=3", "train.warmup_steps=1",
                        "run.progress=false"], cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert r.returncode == 1, r.stderr[-2000:]
    assert "hung: no rank finished a step for" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert time.time() - t0 < 200
