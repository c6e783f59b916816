"""Context parallelism (xpar.parallel.context) against the single-process reference.

The unit tests simulate the cp ranks in one process: the load-balanced chunks, their global
positions and the attention of each rank's queries over the re-ordered K/V must give the rows of
full causal attention. The executed runs train 3 steps through xpar's real path (one spawn per
world size) and compare the reported loss (the mean over the cp group; over the ranks holding
the last stage under pp) and every rank's pre-clip global gradient norm with
:func:`xpar.run.reference.reference_run` of the same recipe: relative 1e-4 in fp32, 2e-4 (loss)
and 1e-2 (norm) in bf16, as tests/parallel/test_parity.py.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import spawn, spec_for
from tests.parallel.test_clipping import (
    _norms as _train,  # worker: every rank's (losses, grad_norms, lrs) per spec
)

BASE = ["model=tiny", "train.steps=3", "train.warmup_steps=1", "parallel.micro_batches=2"]
GPT = ["model.position=learned", "model.norm=layernorm", "model.activation=gelu", "model.bias=true"]
TWO = {  # 2 workers: dp must be 1
    "cp2": ["parallel.dp=1", "parallel.cp=2"],
    "cp2_bf16": ["parallel.dp=1", "parallel.cp=2", "train.dtype=bf16"],
    "cp2_zero3_gpt": ["parallel.dp=1", "parallel.cp=2", "parallel.zero_stage=3", *GPT],  # learned positions
}
FOUR = {  # 4 workers, one launch
    "dp2cp2_zero1": ["parallel.dp=2", "parallel.cp=2", "parallel.zero_stage=1"],
    "cp2tp2_sp": ["parallel.dp=1", "parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true"],
    "cp2tp2_zero2": ["parallel.dp=1", "parallel.cp=2", "parallel.tp=2", "parallel.zero_stage=2"],
    "pp2cp2_1f1b": ["parallel=pp", "model=tiny", "parallel.dp=1", "parallel.cp=2", "parallel.schedule=1f1b"],
    # split backward under DDP: xpar averages the stage's gradients over dp x cp itself (pytorch#144530)
    "pp2cp2_zbv": ["parallel=pp", "model=tiny", "parallel.dp=1", "parallel.cp=2", "parallel.schedule=zbv"],
}


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_load_balanced_chunks_and_gathered_attention_equal_full_causal_attention(cp):
    """Rank r holds chunks r and 2cp-1-r of the sequence; its queries at their global positions
    over the all-gathered (re-ordered) K/V of every rank give its rows of full causal attention,
    grouped-query heads included; RoPE at the global positions equals RoPE of the whole sequence."""
    from xpar.models.transformer import causal_attention, rope
    from xpar.parallel.context import (
        attend_local_queries,
        cp_positions,
        order_chunks,
        shard_sequence,
    )

    g = torch.Generator().manual_seed(cp)
    B, N, K, S, D = 2, 4, 2, 12 * cp, 8
    q, k, v = (torch.randn(B, n, S, D, generator=g) for n in (N, K, K))
    full = causal_attention(q, k, v)
    shard = lambda t: [shard_sequence(t.transpose(1, 2), cp, r).transpose(1, 2) for r in range(cp)]
    qs, ks, vs = shard(q), shard(k), shard(v)
    k_all, v_all = order_chunks(ks, cp), order_chunks(vs, cp)
    assert torch.equal(k_all, k) and torch.equal(v_all, v)
    for r in range(cp):
        pos = cp_positions(S // cp, q.device, cp, r)
        assert pos.tolist() == shard_sequence(torch.arange(S)[None], cp, r)[0].tolist()
        assert sorted(pos.tolist())[:2] == [r * S // (2 * cp), r * S // (2 * cp) + 1]
        got = attend_local_queries(qs[r], k_all, v_all, cp, r)
        torch.testing.assert_close(got, shard(full)[r], rtol=1e-5, atol=1e-6)
        x = torch.randn(B, S, N, D, generator=g)
        torch.testing.assert_close(rope(shard_sequence(x, cp, r), 10000.0, pos),
                                   shard_sequence(rope(x, 10000.0), cp, r), rtol=1e-5, atol=1e-6)
    assert sorted(torch.cat([cp_positions(S // cp, q.device, cp, r) for r in range(cp)]).tolist()) == list(range(S))


def test_chunk_loss_means_average_to_the_sequence_mean():
    """Each cp rank's loss is the mean over its S/cp tokens; as every rank holds as many, their
    mean is the mean over the whole sequence (the reported loss and the dp x cp gradient mean)."""
    from xpar.parallel.context import shard_sequence

    g = torch.Generator().manual_seed(0)
    logits, targets = torch.randn(2, 16, 5, generator=g), torch.randint(0, 5, (2, 16), generator=g)
    whole = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    parts = [F.cross_entropy(shard_sequence(logits, 4, r).flatten(0, 1), shard_sequence(targets, 4, r).flatten())
             for r in range(4)]
    torch.testing.assert_close(sum(parts) / 4, whole)


def test_seq_len_must_split_into_2cp_chunks():
    from xpar.config.checks import ConfigError

    with pytest.raises(ConfigError) as e:
        spec_for("model=tiny", "train.seq_len=30", "parallel.dp=1", "parallel.cp=2")
    msg = str(e.value)
    assert "2 x cp = 4 chunks" in msg and "seq_len=30" in msg and "[1, 3, 5, 15]" in msg and "train.seq_len=28 (or 32)" in msg, msg


def test_cp_with_sequence_parallel_needs_seq_len_over_cp_tp():
    """One line with the constraint, the values given and values that work."""
    from xpar.config.checks import ConfigError

    with pytest.raises(ConfigError) as e:  # 36 splits into 4 chunks, but 36 / 2 = 18 tokens not over tp = 4
        spec_for("model=tiny", "model.n_kv_heads=4", "train.seq_len=36", "parallel.dp=1", "parallel.cp=2",
                 "parallel.tp=4", "parallel.sequence_parallel=true", local_devices=8)
    msg = str(e.value)
    assert "lcm(2 cp, cp tp) = 8, got seq_len=36" in msg and "e.g. train.seq_len=32," in msg, msg  # the one followed below
    spec_for("model=tiny", "model.n_kv_heads=4", "train.seq_len=32", "parallel.dp=1", "parallel.cp=2",
             "parallel.tp=4", "parallel.sequence_parallel=true", local_devices=8)


def test_run_name_and_description_say_cp():
    from xpar.track.report import layout_name
    from xpar.track.naming import description, run_name

    spec = spec_for(*BASE, *TWO["cp2"])
    assert run_name(spec) == "tiny·cp2" and "cp=2" in description(spec)
    assert layout_name(spec) == "dp1-tp1-cp2-pp1-zero0-m2-b4"


def test_compare_counts_cp_in_the_devices():
    """`xpar compare`'s devices are dp x tp x pp x cp (cp = 1 for runs logged before cp was)."""
    import pandas as pd

    from xpar.track.compare import headline_table

    runs = pd.DataFrame([{"run_id": "a", "params.parallel.dp": "1", "params.parallel.tp": "2",
                          "params.parallel.pp": "1", "params.parallel.cp": "2"},
                         {"run_id": "b", "params.parallel.dp": "2", "params.parallel.tp": "1", "params.parallel.pp": "1"}])
    assert list(headline_table(runs)["devices"]) == [4, 2]


@pytest.mark.parametrize("overrides,devices", [
    (("parallel=pp", "parallel.dp=1", "parallel.cp=2"), 4),                          # fractional folded b: crashed
    (("parallel.dp=2", "parallel.cp=2", "parallel.tp=2", "parallel.zero_stage=2"), 8),  # held whole over dp x cp
    (("parallel.dp=2", "parallel.cp=2", "parallel.zero_stage=3", "model.n_layers=3"), 4),
], ids=["pp2-cp2", "dp2-cp2-tp2-z2", "dp2-cp2-z3"])
def test_estimate_dry_run_builds_cp_as_it_runs(overrides, devices):
    """The estimate's fake-process-group dry run builds the cp engine (mesh (pp, dp, cp, tp), dp
    wrappers over dp x cp) for every replica rank; its parameter bytes equal the folded cost model's."""
    from xpar.run.dryrun import dry_run

    spec = spec_for("model=tiny", "run.mode=estimate", *overrides, local_devices=devices)
    d = dry_run(spec, [(0, r, 0) for r in range(spec.dp * spec.cp)])
    assert len(d.ranks) == spec.dp * spec.cp and d.max_diff == 0, d.to_dict()
    assert sorted(r.rank for r in d.ranks) == sorted(spec.layout.rank(0, dp, 0, cp=c) for dp in range(spec.dp)
                                                     for c in range(spec.cp))


@pytest.fixture(scope="module")
def results():
    specs = {k: spec_for(*BASE, *v) for k, v in TWO.items()}
    specs |= {k: spec_for(*BASE, *v, local_devices=4) for k, v in FOUR.items()}
    out = dict(zip(TWO, spawn(_train, 2, [specs[k].to_dict() for k in TWO])))
    out |= dict(zip(FOUR, spawn(_train, 4, [specs[k].to_dict() for k in FOUR])))
    return specs, out


@pytest.mark.slow
@pytest.mark.parametrize("name", [*TWO, *FOUR])
def test_losses_and_grad_norms_equal_the_reference(results, name):
    from xpar.run.reference import reference_run

    specs, out = results
    spec = specs[name]
    assert spec.cp == 2, name
    assert (name == "pp2cp2_zbv") == any("pytorch#144530" in n for n in spec.notes), spec.notes
    ref = reference_run(spec)
    loss_rel, norm_rel = (1e-4, 1e-4) if spec.train.dtype == "fp32" else (2e-4, 1e-2)
    for step in range(3):
        seen = [r[0][step] for r in out[name] if r[0][step] is not None]
        assert seen and sum(seen) / len(seen) == pytest.approx(ref["losses"][step], rel=loss_rel), (name, step)
    for rank, (_, norms, _) in enumerate(out[name]):
        assert norms == pytest.approx(ref["grad_norms"], rel=norm_rel), (name, rank, norms, ref["grad_norms"])


@pytest.mark.slow
def test_the_cp_all_gathers_estimate_stands_beside_the_measured(tmp_path):
    """A cp2 run logs the estimate's K/V all-gather bytes beside the measured ones (issue 45): equal,
    since each layer gathers 2 b s kv_heads head_dim elements per micro-batch whatever the data."""
    import subprocess
    import sys

    import mlflow
    r = subprocess.run([sys.executable, "-m", "xpar", *BASE, *TWO["cp2"], "run.progress=false"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = mlflow.search_runs(experiment_names=["xpar"]).iloc[0]
    measured, est = run["metrics.comm/cp_allgather_bytes"], run["metrics.fidelity/estimate_comm_cp_allgather_bytes"]
    assert measured > 0 and est == pytest.approx(measured, rel=1e-9), (measured, est)
    assert "(estimate" in r.stdout.split("comm/cp_allgather_bytes")[1].split("\n")[0]  # beside it in the table


def test_recompute_replays_the_kv_all_gathers():
    """A recomputed block's attention core needs the gathered K and V again, which no policy keeps: under
    recompute=full each layer gathers them twice per micro-batch (xpar's engine: 4 -> 8 all-gathers),
    so cp_comm = m x layers x (2 all-gathers + 1 reduce-scatter); once where the framework keeps the
    gathered K and V (recompute_replays_comm false) or the policy keeps SDPA's output and does not rerun
    the core (torchtitan's op policy), or without recompute."""
    from dataclasses import replace
    from types import SimpleNamespace

    from xpar.estimate.context_parallel import cp_layer_times, cp_replay
    from xpar.estimate.cost import assumptions_for, estimate
    base = ("model=70b", "hardware=h100_80gb_64gpu", "parallel.tp=8", "parallel.zero_stage=3", "parallel.cp=2",
            "parallel.micro_batches=auto", "train=cluster", "train.seq_len=32768", "train.global_batch_size=16",
            "train.micro_batch_size=1", "run.mode=estimate", "parallel.recompute=full")
    full = spec_for(*base)
    t, m = cp_layer_times(full), full.micro_batches
    assert estimate(full).time_breakdown["cp_comm"] == pytest.approx(m * 80 * (2 * t["f"] + t["b"]), rel=1e-12)
    kept = estimate(full, replace(assumptions_for(full), recompute_replays_comm=False))
    assert kept.time_breakdown["cp_comm"] == pytest.approx(m * 80 * (t["f"] + t["b"]), rel=1e-12)
    fw = dict(recompute_replays_comm=True, recompute_layer_fraction=1.0)
    selective = replace(full, layout=replace(full.layout, recompute="selective"))
    assert cp_replay(selective, SimpleNamespace(selective_recompute="op", **fw)) == 1.0
    assert cp_replay(selective, SimpleNamespace(selective_recompute="torchtitan_op", **fw)) == 0.0
    assert cp_replay(replace(full, layout=replace(full.layout, recompute="none")),
                     SimpleNamespace(selective_recompute="op", **fw)) == 0.0
