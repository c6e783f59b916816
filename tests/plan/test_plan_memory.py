"""The planner's vectorised peak memory (xpar.estimate.columns.peak_memory) equals the scalar estimate's on
random valid layouts: every model size, cluster, framework profile, schedule, ZeRO stage,
sequence parallelism and recompute policy."""
from __future__ import annotations

import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

from xpar.config.layout import EXECUTABLE, SCHEDULES, microbatch_ok, zero_stage_run
from xpar.config.presets import conf_dir, preset_dict
from xpar.config.remat import MODULE_POLICIES, RECOMPUTE
from xpar.estimate.cost import estimate, peak_memory
from xpar.plan.context import COLUMNS, PlanContext, spec_of
from xpar.plan.space import Constraints, enumerate_layouts
from xpar.estimate.columns.peak_memory import KEYS, memory_columns

FIELDS = {"memory_params": "params", "memory_grads": "grads", "memory_optimizer": "optimizer",
          "memory_activations": "activations", "memory_comm_buffers": "comm_buffers",
          "memory_framework_overhead": "framework_overhead", "memory_total": "total", "memory_pp_rank": "pp_rank",
          "memory_usable": "usable", "fits": "fits"}
FRAMEWORK_VARIANT = {"name": "xpar", "count_buffers": False, "fused_rmsnorm": False, "recompute_layer_fraction": 0.5,
                     "cpu_offload_optimizer": True}
"""Memory options no preset sets: the CPU accounting's uncounted buffers and composite norm,
recompute on half the blocks, optimizer in host memory."""




def context(model: str, hardware: str, framework, dtype: str = "bf16") -> PlanContext:
    fw = framework if isinstance(framework, dict) else preset_dict("framework", framework)
    train = {**preset_dict("train", "default"), **preset_dict("train", "cluster"), "dtype": dtype}
    return PlanContext(model=preset_dict("model", model), hardware=preset_dict("hardware", hardware), train=train,
                       framework={k: v for k, v in fw.items() if k != "terms"})


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _row(rng: np.random.Generator, ctx: PlanContext) -> dict:
    """One random valid layout of ``ctx``: tp dividing heads, kv heads, ffn and vocabulary
    inside a node or over whole nodes; pp x v dividing n_layers; m the schedule accepts; the
    schedule and ZeRO stage among the framework's (framework.schedules, zero_stages, pp_zero_stages)."""
    mdl, hw = ctx.model, ctx.hardware
    n, node = hw["nodes"] * hw["devices_per_node"], hw["devices_per_node"]
    dims = (mdl["n_heads"], mdl["n_kv_heads"] or mdl["n_heads"], mdl["ffn_hidden"], mdl["vocab_size"])
    tps = [t for t in _divisors(n) if t <= 16 and all(d % t == 0 for d in dims) and (node % t == 0 or t % node == 0)]
    tp = int(rng.choice(tps))
    pp = int(rng.choice([p for p in _divisors(n // tp) if mdl["n_layers"] % p == 0 and p <= 16]))
    sched, v, fw = "1f1b", 1, ctx.framework  # what the framework runs (its lists; all where it has none)
    if pp > 1:
        sched = str(rng.choice(list(fw.get("schedules", EXECUTABLE))))
        kind = SCHEDULES[sched].stages_per_rank
        vs = [1] if kind == "1" else [2] if kind == "2" else [d for d in _divisors(mdl["n_layers"] // pp) if d >= 2]
        if not vs or mdl["n_layers"] % (pp * vs[0]):
            sched, vs = "1f1b", [1]
        v = int(rng.choice(vs))
    m = int(rng.choice([k for k in range(1, 3 * pp + 3) if microbatch_ok(sched, pp, k)]))
    zb = pp > 1 and SCHEDULES[sched].zero_bubble
    runs = [p for p in RECOMPUTE if p not in MODULE_POLICIES or mdl.get("kv_lora_rank")]  # MLA's: MLA models only
    rec = str(rng.choice(["none", "full"] if zb else runs))
    seq = ctx.train.get("seq_len") or mdl["seq_len"]
    return dict(tp=tp, pp=pp, dp=n // (tp * pp), b=int(rng.integers(1, 5)), m=m, v=v, schedule=sched,
                zero=zero_stage_run(sched, pp, int(rng.choice(fw.get("pp_zero_stages" if pp > 1 else "zero_stages",
                                                                     [0, 1, 2, 3])))),
                sp=bool(tp > 1 and seq % tp == 0 and rng.random() < 0.5), recompute=rec)


def _framework_runs(ctx: PlanContext, r: dict) -> bool:
    """Megatron-LM's interleaving rules (framework.interleaved_min_pp, interleaved_m_per_pp); torchtitan's DDP alone
    (framework.ddp_alone) and sp with every tp (framework.sequence_parallel [true])."""
    fw, pp = ctx.framework, r["pp"]
    if fw.get("ddp_alone") and r["zero"] == 0 and r["dp"] > 1 and r["tp"] * pp > 1:
        return False
    if r["tp"] > 1 and r["sp"] not in [bool(x) for x in fw.get("sequence_parallel", [False, True])]:
        return False
    if r["schedule"] != "interleaved_1f1b" or pp == 1:
        return True
    return pp >= fw.get("interleaved_min_pp", 2) and not (fw.get("interleaved_m_per_pp") and r["m"] % pp)


def candidates(rng: np.random.Generator, ctx: PlanContext, n: int) -> dict[str, np.ndarray]:
    rows: list[dict] = []
    while len(rows) < n:
        r = _row(rng, ctx)
        if _framework_runs(ctx, r):
            rows.append(r)
    return {k: np.array([r[k] for r in rows]) for k in COLUMNS}


def scalar(ctx: PlanContext, cols: dict, i: int) -> dict:
    mem = peak_memory(spec_of(ctx, cols, i))
    return {k: getattr(mem, f) for k, f in FIELDS.items()}


def assert_equal(ctx: PlanContext, cols: dict, idx) -> None:
    base = spec_of(ctx, cols, 0)
    got = memory_columns(base, cols)
    assert set(got) == set(KEYS) and all(len(got[k]) == len(cols["tp"]) for k in KEYS)
    for i in idx:
        want = scalar(ctx, cols, i)
        for k, w in want.items():
            assert got[k][i] == pytest.approx(w, rel=1e-9, abs=1e-6), (k, {c: cols[c][i] for c in COLUMNS})


CONTEXTS = [("tiny", "a100_80gb_8gpu", "xpar", "bf16"), ("tiny", "h100_80gb_64gpu", "torchtitan", "fp32"),
            ("7b", "a100_80gb_8gpu", "xpar", "bf16"), ("7b", "h100_80gb_8gpu", "deepspeed", "bf16"),
            ("7b", "a100_80gb_64gpu", "megatron", "bf16"), ("70b", "a100_80gb_64gpu", "torchtitan", "bf16"),
            ("70b", "h100_80gb_64gpu", "xpar", "bf16"), ("70b", "a100_80gb_8gpu", FRAMEWORK_VARIANT, "bf16"),
            ("175b", "a100_80gb_1024gpu", "megatron", "bf16"), ("175b", "a100_80gb_1024gpu", "xpar", "bf16"),
            ("175b", "h100_80gb_64gpu", "deepspeed", "bf16"), ("tiny", "a100_80gb_64gpu", FRAMEWORK_VARIANT, "fp32")]


@pytest.mark.slow  # integration-sized (conftest.INTEGRATION): runs in the full suite, not the fast loop
@pytest.mark.parametrize("model,hardware,framework,dtype", CONTEXTS,
                         ids=[f"{c[0]}-{c[1]}-{c[2] if isinstance(c[2], str) else 'variant'}-{c[3]}" for c in CONTEXTS])
def test_vector_memory_equals_scalar(model, hardware, framework, dtype):
    """Random layouts (40 evaluated together, 16 compared) per context: every field equal to
    estimate(spec).memory's (rel 1e-9)."""
    ctx = context(model, hardware, framework, dtype)
    rng = np.random.default_rng(zlib.crc32(f"{model}{hardware}{dtype}{framework}".encode()))
    cols = candidates(rng, ctx, 40)
    assert_equal(ctx, cols, rng.choice(40, 16, replace=False))


@pytest.mark.slow  # integration-sized (conftest.INTEGRATION): runs in the full suite, not the fast loop
@pytest.mark.parametrize("k", [0, 2])
def test_vector_memory_equals_scalar_with_recompute_layers(k):
    """parallel.recompute_layers = k blocks per stage (the rest keep everything): each stage's
    share differs by its blocks; the vectorised memory still equals the scalar, layout by layout."""
    from dataclasses import replace

    ctx = context("70b", "a100_80gb_64gpu", "xpar")
    cols = candidates(np.random.default_rng(17 + k), ctx, 20)
    cols["recompute"] = np.where(cols["recompute"] == "none", "full", cols["recompute"])

    def staged(spec):
        return replace(spec, parallel=replace(spec.parallel, recompute_layers=k))
    got = memory_columns(staged(spec_of(ctx, cols, 0)), cols)
    for i in range(20):
        mem = peak_memory(staged(spec_of(ctx, cols, i)))
        for key, f in FIELDS.items():
            assert got[key][i] == pytest.approx(getattr(mem, f), rel=1e-9, abs=1e-6), (key, i)


UNEVEN = [("7b", 30, "a100_80gb_64gpu", "xpar"), ("7b", 30, "a100_80gb_64gpu", "megatron"),
          ("70b", 78, "h100_80gb_64gpu", "torchtitan"), ("tiny", 7, "a100_80gb_8gpu", FRAMEWORK_VARIANT),
          ("7b", 27, "h100_80gb_8gpu", "deepspeed_bloom")]
"""Contexts whose blocks (model.n_layers changed) many pp x v stages do not divide: 30 over 4 stages
is 7, 8, 8, 7; over 12, 0, 10 x 3, 0 (xpar.estimate.columns.stage_split)."""


def framework_constraints(fw: dict, batch: int) -> Constraints:
    """The plan's constraints at global batch ``batch`` under framework profile ``fw``: what it
    runs (the schema's defaults where the profile is silent), micro-batches of 1 or 2."""
    from dataclasses import fields

    from xpar.config.schema import FrameworkConfig
    fw = {**{f.name: getattr(FrameworkConfig(), f.name) for f in fields(FrameworkConfig)}, **fw}
    return Constraints(global_batch=(batch, batch), zero_stages=tuple(fw["zero_stages"]),
                       pp_zero_stages=tuple(fw["pp_zero_stages"]), schedules=tuple(fw["schedules"]),
                       interleaved_min_pp=fw["interleaved_min_pp"], interleaved_m_per_pp=fw["interleaved_m_per_pp"],
                       recompute=tuple(fw["recompute"] or ("none", "selective", "full")),
                       sequence_parallel=tuple(fw["sequence_parallel"]), max_micro_batch_size=2,
                       ddp_alone=bool(fw["ddp_alone"]))


def uneven_candidates(ctx: PlanContext, per_schedule: int, seed: int, batch: int = 64) -> dict[str, np.ndarray]:
    """Up to ``per_schedule`` layouts of each schedule among the plan's space whose pp x v stages
    do not divide the blocks (split with lighter ends), seeded; every candidate column."""
    hw = ctx.hardware
    seq = ctx.train.get("seq_len") or ctx.model["seq_len"]
    cols = enumerate_layouts(ctx.model, hw["nodes"] * hw["devices_per_node"], hw["devices_per_node"], seq,
                             framework_constraints(ctx.framework, batch)).cols
    uneven = ctx.model["n_layers"] % (cols["pp"] * cols["v"]) != 0
    rng, pick = np.random.default_rng(seed), []
    for sched in np.unique(cols["schedule"][uneven]):
        idx = np.flatnonzero(uneven & (cols["schedule"] == sched))
        pick += rng.choice(idx, min(per_schedule, len(idx)), replace=False).tolist()
    return {k: v[np.sort(pick)] for k, v in cols.items()}


def uneven_context(model: str, n_layers: int, hardware: str, framework, dtype: str = "bf16") -> PlanContext:
    from dataclasses import replace
    ctx = context(model, hardware, framework, dtype)
    return replace(ctx, model=dict(ctx.model, n_layers=n_layers))


@pytest.mark.slow  # integration-sized (conftest.INTEGRATION): runs in the full suite, not the fast loop
@pytest.mark.parametrize("model,n_layers,hardware,framework", UNEVEN,
                         ids=[f"{c[0]}-{c[1]}-{c[3] if isinstance(c[3], str) else 'variant'}" for c in UNEVEN])
def test_vector_memory_equals_scalar_on_lighter_ends(model, n_layers, hardware, framework):
    """pp x v stages that do not divide the blocks, split with lighter ends (xpar.estimate.columns.stage_split):
    every schedule the framework runs (interleaved and looped ones pruned on middle chunks,
    xpar.estimate.columns.stage_split.prune_modes), every field equal to the scalar's (rel 1e-9)."""
    ctx = uneven_context(model, n_layers, hardware, framework)
    cols = uneven_candidates(ctx, 4, n_layers)
    assert len(cols["tp"]) >= 4 and (n_layers % (cols["pp"] * cols["v"]) != 0).all()
    assert_equal(ctx, cols, range(len(cols["tp"])))


@pytest.mark.slow  # integration-sized (conftest.INTEGRATION): runs in the full suite, not the fast loop
@pytest.mark.parametrize("k", [1, 4])
def test_vector_memory_equals_scalar_on_lighter_ends_with_recompute_layers(k):
    """parallel.recompute_layers = k blocks per stage under lighter ends: the end stages' shares
    differ from the middle ones' (7 blocks against 8); still equal, layout by layout."""
    from dataclasses import replace

    ctx = uneven_context("7b", 30, "a100_80gb_64gpu", "xpar")
    cols = uneven_candidates(ctx, 2, k)
    cols["recompute"] = np.where(cols["recompute"] == "none", "full", cols["recompute"])

    def staged(spec):
        return replace(spec, parallel=replace(spec.parallel, recompute_layers=k))
    got = memory_columns(staged(spec_of(ctx, cols, 0)), cols)
    for i in range(len(cols["tp"])):
        mem = peak_memory(staged(spec_of(ctx, cols, i)))
        for key, f in FIELDS.items():
            assert got[key][i] == pytest.approx(getattr(mem, f), rel=1e-9, abs=1e-6), (key, i)


def test_lighter_ends_put_the_peak_on_the_second_stage():
    """BLOOM 176B as tr11 ran it (tp 4, pp 12 as 5, 10 x 6, 5 blocks, dp 8, b 2, ZeRO-1, the
    deepspeed_bloom profile) without recompute: the second stage holds a block more than the first
    and 11 micro-batches in flight against its 12 (1F1B), and is the most loaded rank (pp rank 1);
    with full recompute (as trained) the first is. Both equal to the scalar estimate."""
    from tests.estimate.test_estimate_memory import KNOWN
    from tests.plan.test_plan import corpus_inputs

    ctx = corpus_inputs(next(r for r in KNOWN if r["id"] == "bloom_176b_tr11")).ctx
    rows = [{"tp": 4, "pp": 12, "dp": 8, "b": 2, "m": 128, "v": 1, "schedule": "1f1b", "zero": 1, "sp": False,
             "recompute": rc} for rc in ("none", "full")]
    cols = {k: np.array([r[k] for r in rows]) for k in COLUMNS}
    assert spec_of(ctx, cols, 0).layout.layer_split == (5,) + (6,) * 10 + (5,)
    assert memory_columns(spec_of(ctx, cols, 0), cols)["memory_pp_rank"].tolist() == [1, 0]
    assert_equal(ctx, cols, range(2))


def test_middle_basis_keeps_every_maximum_of_the_walk():
    """The interleaved closed forms pruned on (all - first - last, first, last) chunks
    (_closed_entries(by_middle=True)) give each rank class the walk's largest peak, at the same first
    rank, for any bytes >= 0 per middle, first and last chunk and per transient, also with the
    first stage lighter than a middle one (a negative first - middle coefficient)."""
    from xpar.estimate.columns.peak_memory import _closed_entries, _walk_entries

    rng, checked = np.random.default_rng(5), 0
    for sched, pp, m, v in (("interleaved_1f1b", 2, 4, 2), ("interleaved_1f1b", 4, 8, 3), ("interleaved_1f1b", 4, 12, 2),
                            ("zero_bubble", 4, 8, 2), ("zero_bubble", 3, 6, 3), ("looped_bfs", 4, 5, 2)):
        closed, walk = _closed_entries(sched, pp, m, v, by_middle=True), _walk_entries(sched, pp, m, v, False)
        for _ in range(40):
            mid, first, last = rng.random(3) * rng.choice([0.1, 1, 10], 3)
            w, add = np.array([mid, first - mid, last - mid]), rng.random(6)
            assert _class_peaks(closed, w, add) == _class_peaks(walk, w, add), (sched, pp, m, v, w)
            checked += 1
    assert checked == 240


def _class_peaks(entries: list, w: np.ndarray, add: np.ndarray) -> dict:
    """{rank class: (largest peak, the first rank with it)} of rank entries for coefficients ``w`` of
    (all, first, last) live chunks and transients ``add`` per event type."""
    peaks: dict = {}
    for r, rc, f, a, types in entries:
        top = max(float((f @ w).max()), float((a @ w + add[types]).max()))
        if top > peaks.get(rc, (-1.0, 0))[0] + 1e-12:
            peaks[rc] = (top, r)
    return {rc: (round(p, 9), r) for rc, (p, r) in peaks.items()}


def test_estimate_memory_is_peak_memory():
    """The scalar the test compares with is estimate's own memory figure."""
    ctx = context("7b", "a100_80gb_8gpu", "xpar")
    cols = candidates(np.random.default_rng(1), ctx, 3)
    for i in range(3):
        spec = spec_of(ctx, cols, i)
        assert estimate(spec).memory.total == peak_memory(spec).total


@pytest.mark.slow  # integration-sized (conftest.INTEGRATION): runs in the full suite, not the fast loop
def test_every_schedule_and_rank_choice():
    """Every schedule at pp 2 and 4 with m around pp, where the most loaded rank differs by
    schedule (first, last or a middle one)."""
    rows = []
    for sched, rec in SCHEDULES.items():
        for pp in (2, 4):
            v = {"1": 1, "2": 2, "v": 2}[rec.stages_per_rank]
            for m in [k for k in (1, pp - 1, pp, 2 * pp, 3 * pp + 1) if k >= 1 and microbatch_ok(sched, pp, k)]:
                for zero, recompute in ((0, "none"), (1, "full")):
                    rows.append(dict(tp=8 // pp, pp=pp, b=1, m=m, v=v, schedule=sched,
                                     zero=zero, sp=False, recompute=recompute))
    for r in rows:
        r["dp"] = 64 // (r["tp"] * r["pp"])
    ranks = set()
    for framework, executable in (("xpar", True), ("megatron_zb", False)):  # zb_h1 / zb_h2: megatron_zb's
        ctx = context("70b", "a100_80gb_64gpu", framework)
        some = [r for r in rows if SCHEDULES[r["schedule"]].executable == executable]
        cols = {k: np.array([r[k] for r in some]) for k in COLUMNS}
        ranks |= set(memory_columns(spec_of(ctx, cols, 0), cols)["memory_pp_rank"].tolist())
        assert_equal(ctx, cols, range(len(some)))
    assert len(ranks) > 2  # several ranks are the most loaded somewhere


def test_empty_and_unknown():
    ctx = context("tiny", "a100_80gb_8gpu", "xpar")
    cols = candidates(np.random.default_rng(2), ctx, 2)
    base = spec_of(ctx, cols, 0)
    empty = memory_columns(base, {k: v[:0] for k, v in cols.items()})
    assert all(len(empty[k]) == 0 for k in KEYS)
    with pytest.raises(ValueError, match="unknown value 'bogus'"):
        memory_columns(base, dict(cols, schedule=np.array(["bogus", "1f1b"])))


@pytest.mark.slow
def test_peak_memory_columns_import_no_torch():
    code = "import sys, xpar.estimate.columns.peak_memory; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def _as_sets(entries) -> list:
    return [(r, rc, {tuple(x) for x in f.tolist()}, {(int(t), tuple(x)) for t, x in zip(types, rows.tolist())})
            for r, rc, f, rows, types in entries]


@pytest.mark.slow  # integration-sized (conftest.INTEGRATION): runs in the full suite, not the fast loop
def test_closed_form_peaks_equal_the_walk():
    """The schedules whose peaks the column memory model takes without walking give, rank by rank (ranks that can
    be the first maximum), the maximal
    live-chunk rows of the walk over their action lists (torch's for looped BFS, zero bubble,
    zbv, dualpipev; xpar's own for interleaved 1F1B)."""
    from xpar.estimate.columns.peak_memory import _closed_entries, _prune_ranks, _walk_entries

    checked = 0
    for sched, vs in (("gpipe", [1]), ("1f1b", [1]), ("looped_bfs", [2, 3]), ("zbv", [2]), ("dualpipev", [2]),
                      ("interleaved_1f1b", [2, 3]), ("zero_bubble", [2, 3])):
        for pp in (2, 3, 4, 8):
            for v in vs:
                for m in sorted({1, 2, pp - 1, pp, pp + 1, 2 * pp - 1, 2 * pp, 3 * pp, 3 * pp + 2} - {0}):
                    if microbatch_ok(sched, pp, m):
                        closed = _prune_ranks(_closed_entries(sched, pp, m, v))
                        walk = _prune_ranks(_walk_entries(sched, pp, m, v, True))
                        assert _as_sets(closed) == _as_sets(walk), (sched, pp, m, v)
                        checked += 1
    assert checked > 100
    for sched, pp, m, v in (("zbv", 16, 20, 2), ("dualpipev", 16, 40, 2), ("zero_bubble", 16, 32, 2),
                            ("looped_bfs", 16, 24, 3), ("interleaved_1f1b", 16, 48, 3)):  # a large pp too
        assert _as_sets(_prune_ranks(_closed_entries(sched, pp, m, v))) == \
            _as_sets(_prune_ranks(_walk_entries(sched, pp, m, v, True))), (sched, pp, m, v)


def test_parameter_shapes_are_the_models():
    """The torch-free parameter list the memory model uses equals named_parameters() of the
    model built on the meta device, for every model preset and stage kind (also with biases,
    LayerNorm, learned positions and tied embeddings: the 175b preset)."""
    import dataclasses

    import torch

    from xpar.config.schema import ModelConfig
    from xpar.estimate.memory.model_states import _meta_shapes, _model_key
    from xpar.models.transformer import Transformer

    names = sorted(p.stem for p in (conf_dir() / "model").glob("*.yaml"))
    assert "175b" in names and "tiny" in names
    for name in names:
        d = preset_dict("model", name)
        cfg = ModelConfig(**{k: v for k, v in d.items() if k in {f.name for f in dataclasses.fields(ModelConfig)}})
        for n_blocks, first, last in ((0, True, True), (0, True, False), (0, False, True), (1, False, False),
                                      (2, True, True)):
            with torch.device("meta"):
                model = Transformer(cfg, layers=list(range(n_blocks)), first=first, last=last)
            want = tuple((n, tuple(p.shape)) for n, p in model.named_parameters())
            moe = [cfg.is_moe_layer(i) for i in range(n_blocks)]
            if len(set(moe)) > 1:  # blocks of both kinds: tests/parallel/test_moe.py checks the stage list
                continue
            got = _meta_shapes(_model_key(cfg), n_blocks, first, last, bool(moe and moe[0]))
            assert got == want, (name, n_blocks, first, last)


@pytest.mark.slow
def test_memory_columns_imports_no_torch():
    """The whole evaluation (shapes, every schedule's peaks) runs without importing torch."""
    code = ("import sys; sys.path.insert(0, '.'); import numpy as np; from tests.plan.test_plan_memory import context, candidates;"
            "from xpar.plan.context import spec_of; from xpar.estimate.columns.peak_memory import memory_columns;"
            "ctx = context('70b', 'a100_80gb_64gpu', 'xpar'); cols = candidates(np.random.default_rng(0), ctx, 30);"
            "memory_columns(spec_of(ctx, cols, 0), cols); assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])


def test_megatrons_interleaved_warm_up_at_m_equal_pp():
    """Megatron-LM's interleaved 1F1B at m == pp runs every forward first on every rank
    (get_num_warmup_microbatches), where torch's warms rank k up with (v - 1) pp + 2 (pp - 1 - k):
    a middle rank holds all m micro-batches under framework=megatron, fewer under xpar; the planner
    equals the scalar estimate for both."""
    from xpar.estimate.memory.activations import microbatches_in_flight, memory_schedule
    pp, v = 4, 2
    assert memory_schedule("interleaved_1f1b", pp, pp, True) == "looped_bfs"
    assert memory_schedule("interleaved_1f1b", pp, 2 * pp, True) == "interleaved_1f1b"
    assert microbatches_in_flight(memory_schedule("interleaved_1f1b", pp, pp, True), pp, pp, v, rank=2) == pp
    assert microbatches_in_flight("interleaved_1f1b", pp, pp, v, rank=2) < pp
    rows = [dict(tp=2, pp=pp, dp=8, b=1, m=m, v=v, schedule="interleaved_1f1b", zero=1, sp=False, recompute=rc)
            for m in (pp, 2 * pp) for rc in ("none", "full")]
    cols = {k: np.array([r[k] for r in rows]) for k in COLUMNS}
    for framework in ("megatron", "xpar"):
        assert_equal(context("70b", "a100_80gb_64gpu", framework), cols, range(len(rows)))
