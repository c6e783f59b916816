"""Memory side of the cost model: ZeRO model states, activation formulas, in-flight
micro-batches. Pure CPU, no process groups; reference data under tests/data."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from xpar.estimate import memory as mem
from xpar.calibration import make_spec, preset, read_table
from xpar.estimate.cost import with_hardware
from xpar.estimate.schedule import one_f_one_b_actions, peak_in_flight, torch_actions
from xpar.models.shapes import param_count

DATA = Path(__file__).parent / "data"


def spec(model="tiny", hardware="a100_80gb_8gpu", train=None, model_over=None, **parallel):
    """An estimate-mode RunSpec; the hardware preset is resized to dp * tp * pp devices."""
    par = dict(name="t", dp=1, tp=1, pp=1, zero_stage=0, micro_batches=1, schedule="1f1b")
    par.update(parallel)
    tr = dict(micro_batch_size=2, global_batch_size="auto", dtype="fp32")
    tr.update(train or {})
    hw = preset("hardware", hardware)
    world = par["dp"] * par["tp"] * par["pp"]
    hw["devices_per_node"] = min(world, hw["devices_per_node"])
    hw["nodes"] = world // hw["devices_per_node"]
    return make_spec({**preset("model", model), **(model_over or {})}, par, hw, tr)


# --- ZeRO paper, Table 1 -------------------------------------------------------------------

@pytest.mark.parametrize("row", read_table(DATA / "zero_2020_table1.csv"), ids=lambda r: f"{r['params']}-s{r['stage']}-n{r['n_d']}")
def test_zero_table1_every_row(row):
    """Within 2% at the table's printed precision (it prints 0.12 for 7.5e9 / 1024 * 16 = 0.117)."""
    got = mem.zero_model_state_bytes(float(row["params"]), int(row["stage"]), int(row["n_d"])) / 1e9
    printed = row["gb_per_device"]
    decimals = len(printed.split(".")[1]) if "." in printed else 0
    assert round(got, decimals) == pytest.approx(float(printed), rel=0.02)
    assert got == pytest.approx(float(printed), rel=0.03)


def test_zero_formula_stage_ordering():
    psi = 1e9
    vals = [mem.zero_model_state_bytes(psi, z, 64) for z in range(4)]
    assert vals[0] == 16 * psi and vals == sorted(vals, reverse=True)


# --- exact model states ----------------------------------------------------------------------

@pytest.mark.parametrize("model,pp", [("tiny", 1), ("tiny", 2), ("small", 1), ("small", 3), ("175b", 1)])
def test_stage_param_counts_match_analytic_count(model, pp):
    """The meta-device parameter list equals shapes.py's closed form, stage by stage."""
    s = spec(model, dp=1, pp=pp, micro_batches=max(pp, 1), schedule="1f1b",
             layer_split=None if pp == 1 else mem_split(model, pp))
    pc = param_count(s.model)
    for r in range(pp):
        n = sum(math.prod(sh) for _, sh in mem.param_shapes(s, r))
        layers = s.layer_split[r]
        assert n == pc.stage(layers, first=r == 0, last=r == pp - 1)


def mem_split(model, pp):
    n = preset("model", model)["n_layers"]
    return [n // pp + (1 if i < n % pp else 0) for i in range(pp)]


def test_fsdp_shards_follow_torch_chunk():
    """FSDP2 shards dim 0 like torch.chunk: ceil(d0/dp) rows per rank, trailing ranks short or empty."""
    for shape in [(10, 3), (7,), (64, 16), (3, 5)]:
        for dp in (1, 2, 3, 4, 8):
            chunks = torch.chunk(torch.empty(shape, device="meta"), dp, dim=0)
            want = [c.numel() for c in chunks] + [0] * (dp - len(chunks))
            got = [mem.fsdp_shard_numel(shape, dp, r) for r in range(dp)]
            assert got == want


def test_zero1_partition_is_greedy_largest_first():
    # sorted 10, 7, 5, 4, 3: 10->r0, 7->r1, 5->r1 (12), 4->r0 (14), 3->r1 (15)
    assert mem.zero1_partition([3, 10, 4, 7, 5], 2) == [14, 15]
    assert sum(mem.zero1_partition([5] * 7, 3)) == 35


def test_model_state_bytes_fp32_per_zero_stage():
    numel = param_count(preset_cfg("tiny")).total
    full = {z: mem.model_state_bytes(spec(dp=3, zero_stage=z)) for z in range(4)}
    assert full[0] == {"params": 4 * numel, "grads": 4 * numel, "optimizer": 8 * numel}
    s3 = spec(dp=3, zero_stage=3)
    shapes = [sh for _, sh in mem.param_shapes(s3, 0)]
    rank0 = sum(mem.fsdp_shard_numel(sh, 3, 0) for sh in shapes)
    assert full[3] == {"params": 4 * rank0, "grads": 4 * rank0, "optimizer": 8 * rank0}
    assert full[2] == {"params": 4 * numel, "grads": 4 * rank0, "optimizer": 8 * rank0}
    assert full[1]["params"] == 4 * numel and full[1]["grads"] == 4 * numel
    assert full[1]["optimizer"] == 8 * max(mem.zero1_partition([math.prod(sh) for sh in shapes], 3))
    assert numel * 8 / 3 <= full[1]["optimizer"] < numel * 8 / 3 * 1.1  # /dp is the ideal
    per_rank = mem.model_state_bytes_per_rank(s3)
    assert sum(d["params"] for d in per_rank) == 4 * numel  # shards cover every element once


def preset_cfg(name):
    from xpar.config import ModelConfig
    return ModelConfig(**preset("model", name))


def test_model_state_bytes_bf16_is_2_2_12_and_tp_splits():
    s = spec("small", dp=4, tp=4, zero_stage=0, train={"dtype": "bf16"}, model_over={"vocab_size": 50304})
    d = mem.model_state_bytes(s)
    n = d["params"] // 2
    assert d == {"params": 2 * n, "grads": 2 * n, "optimizer": 12 * n}
    cfg, h = s.model, s.model.hidden
    replicated = cfg.seq_len * h + cfg.n_layers * (2 * 2 * h + 2 * h) + 2 * h  # pos emb, norms, row biases, final norm
    assert n == (param_count(cfg).total - replicated) // 4 + replicated


def test_rank_stages_match_pipeline_placement():
    """The layout's stage placement is the one torch's schedules act on, rank by rank."""
    from xpar.estimate.schedule import torch_actions
    for sched, v in [("interleaved_1f1b", 2), ("zbv", 2), ("1f1b", 1)]:
        s = spec("small", dp=1, pp=2, virtual_stages=v, schedule=sched, micro_batches=4)
        for r in range(2):
            assert s.layout.stages_of(r) == sorted({a.stage for a in torch_actions(sched, 2, 4, v)[r]})


# --- activations (Korthikanti et al. 2022, Table 2) ------------------------------------------

GPT3 = dict(s=2048, b=1, h=12288, a=96)


@pytest.mark.parametrize("t,sp,rc", [(1, False, "none"), (8, False, "none"), (8, True, "none"),
                                     (8, False, "selective"), (8, True, "selective"), (1, False, "full"),
                                     (8, True, "full"), (4, False, "none")])
def test_activation_terms_reproduce_table2(t, sp, rc):
    for shape in (GPT3, dict(s=1024, b=4, h=4096, a=32)):
        got = mem.layer_activation_bytes(**shape, t=t, sp=sp, recompute=rc)
        assert got == pytest.approx(mem.korthikanti_table2(**shape, t=t, sp=sp, recompute=rc), rel=1e-12)


def test_table2_numbers_gpt3_layer():
    # sbh = 2048 * 12288 = 25,165,824; 5as/h = 80
    sbh = 2048 * 12288
    assert mem.korthikanti_table2(**GPT3) == sbh * 114
    assert mem.korthikanti_table2(**GPT3, t=8) == sbh * 23            # 10 + 3 + 10
    assert mem.korthikanti_table2(**GPT3, t=8, sp=True) == sbh * 114 / 8
    assert mem.korthikanti_table2(**GPT3, t=8, sp=True, recompute="selective") == sbh * 34 / 8
    assert mem.korthikanti_table2(**GPT3, recompute="full") == 2 * sbh


def test_activation_generalisation_gqa_swiglu_dropout():
    s, b, h, a, f = 512, 2, 1024, 16, 2816
    base = mem.layer_activation_bytes(s, b, h, a, ffn=f)
    gqa = mem.layer_activation_bytes(s, b, h, a, ffn=f, kv=256)
    assert base - gqa == s * b * 2 * 2 * (h - 256)                   # K and V at kv width
    assert mem.layer_activation_bytes(s, b, h, a, ffn=f, swiglu=True) - base == s * b * 2 * 2 * f
    no_drop = mem.layer_activation_bytes(s, b, h, a, ffn=f, dropout=False)
    assert base - no_drop == s * b * (2 * h + 3 * a * s)              # masks h, a s; dropout output 2 a s
    flash = mem.layer_activation_bytes(s, b, h, a, ffn=f, dropout=False, flash=True)
    assert no_drop - flash == s * b * (2 * a * s - 4 * a)


@pytest.mark.parametrize("p,m,v", [(4, 8, 2), (4, 16, 3), (2, 4, 2), (8, 16, 2)])
def test_interleaved_in_flight_matches_torch_order_and_korthikanti(p, m, v):
    order = torch_actions("interleaved_1f1b", p, m, v)
    for r in range(p):
        assert mem.microbatches_in_flight("interleaved_1f1b", p, m, v, r) == peak_in_flight(order[r]) / v
    assert mem.microbatches_in_flight("interleaved_1f1b", p, m, v, 0) == pytest.approx(p * (1 + (p - 1) / (p * v)))


def test_1f1b_and_gpipe_in_flight():
    order = one_f_one_b_actions(4, 8)
    assert [mem.microbatches_in_flight("1f1b", 4, 8, 1, r) for r in range(4)] == [peak_in_flight(x) for x in order] == [4, 3, 2, 1]
    assert mem.microbatches_in_flight("gpipe", 4, 8) == 8


# --- the whole device --------------------------------------------------------------------------

def test_memory_estimate_terms_and_fits():
    s = spec("7b", "a100_80gb_64gpu", dp=4, tp=8, pp=2, zero_stage=2, micro_batches=8, schedule="1f1b",
             recompute="selective", sequence_parallel=True, train={"dtype": "bf16", "micro_batch_size": 1})
    est = mem.memory(s)
    terms = ("params", "grads", "optimizer", "activations", "comm_buffers", "framework_overhead")
    assert est.total == pytest.approx(sum(getattr(est, k) for k in terms))
    assert est.pp_rank == 0  # 1F1B: the first stage holds pp micro-batches
    assert est.detail["activations"]["microbatches_in_flight"] == 2
    assert est.fits and not mem.memory(with_hardware(s, device_memory_gb=est.total / 2e9)).fits
    gpipe = mem.memory(spec("7b", "a100_80gb_64gpu", dp=4, tp=8, pp=2, zero_stage=2, micro_batches=8, schedule="gpipe",
                            recompute="selective", sequence_parallel=True,
                            train={"dtype": "bf16", "micro_batch_size": 1}))
    assert gpipe.activations > 3 * est.activations  # GPipe holds all m = 8 micro-batches


def test_memory_zero_stages_shrink_states():
    totals = [mem.memory(spec("small", "a100_80gb_8gpu", dp=8, zero_stage=z)) for z in range(4)]
    states = [t.params + t.grads + t.optimizer for t in totals]
    assert states == sorted(states, reverse=True) and states[3] < states[0] / 6
