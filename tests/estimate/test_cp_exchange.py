"""The cp K/V exchange as each framework runs it (framework.cp_comm, xpar.estimate.cp_exchange, issue 42):
Transformer Engine's p2p ring hides its sends behind each chunk's attention, all-gathers and Ulysses
all-to-alls are exposed, the planner prices each as the scalar estimate does. Pure CPU, no workers."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from tests.conftest import spec_for
from xpar.estimate.context_parallel import cp_layer_times
from xpar.estimate.cost import estimate
from xpar.estimate.cp_exchange import attention_core_times
from xpar.estimate.step_parts import assumptions_for

BASE = ("model=7b", "hardware=h100_80gb_64gpu", "hardware.nodes=8", "parallel.tp=8", "parallel.pp=1",
        "parallel.zero_stage=1", "parallel.sequence_parallel=true", "parallel.micro_batches=auto",
        "train.micro_batch_size=1", "train.dtype=bf16", "run.mode=estimate")


def _spec(seq: int, cp: int, comm: str, framework: str = "megatron_core"):
    dp = 64 // (8 * cp)
    return spec_for(*BASE, f"framework={framework}", f"framework.cp_comm={comm}", f"model.seq_len={seq}",
                    f"parallel.cp={cp}", f"parallel.dp={dp}", f"train.global_batch_size={dp * 4}")


def test_p2p_ring_hides_its_sends_behind_long_attention_but_not_short():
    """A chunk's attention grows as (s / cp)^2, its send as s / cp: at 128k tokens over cp 4 across nodes the
    sends hide whole (less exposed than the all-gather); at 4k over cp 8 almost
    nothing hides. Exposed never exceeds issued."""
    long = _spec(131072, 4, "p2p")
    t = cp_layer_times(long, assumptions_for(long))
    assert t["f"] == t["b"] == 0.0 and 0 < t["f_issued"] < t["b_issued"]
    short = _spec(4096, 8, "p2p")
    s = cp_layer_times(short, assumptions_for(short))
    a_f, _ = attention_core_times(short, assumptions_for(short))
    assert 0 < s["f"] <= s["f_issued"] and 0 < s["b"] <= s["b_issued"]
    assert s["f_issued"] / 7 > a_f / 8  # one send outlasts one step's attention
    assert s["f"] / s["f_issued"] > t["f"] / t["f_issued"]
    gathered = cp_layer_times(long, replace(assumptions_for(long), cp_comm="all_gather"))
    assert t["f"] + t["b"] < gathered["f"] + gathered["b"]


def test_all_gather_and_a2a_are_exposed_and_the_step_adds_them():
    """all_gather and a2a: exposed == issued; the estimate's step is the folded step plus cp_comm, and its note
    names the exchange; Ulysses moves Q and the output beside K and V, so it costs more than K and V alone."""
    for comm, word in (("all_gather", "all-gathers exposed"), ("a2a", "Ulysses")):
        spec = _spec(32768, 4, comm)
        t = cp_layer_times(spec, assumptions_for(spec))
        assert t["f"] == t["f_issued"] > 0 and t["b"] == t["b_issued"] > 0
        est = estimate(spec)
        assert est.time_breakdown["cp_comm"] > 0 and est.comm_time["cp"] == pytest.approx(est.time_breakdown["cp_comm"])
        assert any(word in n for n in est.notes)
    p2p = estimate(_spec(131072, 4, "p2p"))
    assert p2p.time_breakdown["cp_comm"] == 0.0 < p2p.comm_time["cp"]  # the ring hidden, all of it issued
    assert any("ring (p2p)" in n for n in p2p.notes)


def test_megatron_core_runs_the_ring_and_torchtitan_gathers():
    """The profiles' defaults: megatron_core (and hai_llm, built on it) p2p (Megatron-Core's --cp-comm-type),
    torchtitan and xpar all_gather."""
    from tests.conftest import compose
    for fw, comm in (("megatron_core", "p2p"), ("hai_llm", "p2p"), ("torchtitan", "all_gather"),
                     ("xpar", "all_gather")):
        assert compose(f"framework={fw}").framework.cp_comm == comm, fw


def test_unknown_cp_comm_is_refused():
    from xpar.config.checks.framework import check_framework
    from xpar.config.schema import FrameworkConfig
    out = check_framework(FrameworkConfig(cp_comm="ring"))
    assert any("framework.cp_comm='ring'" in line and "p2p" in line for line in out)


def test_llama3_paper_rows_gather_and_nemo_rows_ring():
    """The Llama 3 paper's context parallelism is all-gather based (Sec. 3.3.2: the local queries over the gathered K/V,
    no per-step kernels); NeMo/Megatron rows run the ring."""
    from xpar.calibrate.cp_fp8 import cp_fp8_framework
    assert cp_fp8_framework({"id": "llama3_paper_x", "source": "The Llama 3 Herd of Models, Table 4"}) == (
        "megatron_core", {"cp_comm": "all_gather", "cp_attention_merge": None})
    assert cp_fp8_framework({"id": "dgxc_x", "source": "NVIDIA/dgxc-benchmarking"}) == ("megatron_core", {})


@pytest.mark.parametrize("comm", ["p2p", "all_gather", "a2a"])
def test_plan_prices_cp_layouts_as_the_estimate_under_each_exchange(comm):
    """The planner's cp candidates under megatron_core with each cp_comm: step time, cp_comm and cp_attention (the
    ring's step kernels and merges, recompute included) equal the scalar estimate's (relative 1e-9)."""
    from xpar.config.presets import preset_dict
    from xpar.plan.context import PlanContext, spec_of
    from xpar.plan.evaluate import evaluate
    from xpar.plan.space import Constraints, enumerate_layouts
    hw = dict(preset_dict("hardware", "h100_80gb_64gpu"), nodes=4)
    ctx = PlanContext(model=preset_dict("model", "7b"), hardware=hw,
                      train={"dtype": "bf16", "seq_len": 16384},
                      framework=dict(preset_dict("framework", "megatron_core"), cp_comm=comm))
    space = enumerate_layouts(ctx.model, 32, 8, 16384, Constraints(
        global_batch=(32, 32), cp=(2, 4, 8), schedules=("1f1b", "interleaved_1f1b"), pp_zero_stages=(0, 1),
        recompute=("none", "selective", "full"), microbatch_rule="megatron", interleaved_m_per_pp=True))
    idx = np.flatnonzero(space.cols["cp"] > 1)
    idx = np.sort(np.random.default_rng(1).choice(idx, size=min(6, len(idx)), replace=False))
    sub = {k: v[idx] for k, v in space.cols.items()}
    res = evaluate(ctx, sub)
    for i in range(len(idx)):
        est = estimate(spec_of(ctx, sub, i))
        assert float(res["time_per_step_s"][i]) == pytest.approx(est.time_per_step_s, rel=1e-9)
        assert float(res["time_cp_comm"][i]) == pytest.approx(est.time_breakdown["cp_comm"], rel=1e-9, abs=1e-15)
        assert float(res["time_cp_attention"][i]) == pytest.approx(est.time_breakdown["cp_attention"], rel=1e-9,
                                                                    abs=1e-15)
    assert (res["time_cp_attention"] > 0).all()  # megatron_core runs TE's ring: its step kernels and merges priced


def test_p2p_with_sliding_windows_falls_back_to_the_all_gather():
    """Transformer Engine's ring runs no sliding window: a windowed model under p2p is priced as the all-gather."""
    spec = _spec(32768, 4, "p2p")
    windowed = replace(spec, model=replace(spec.model, sliding_window=4096))
    a = assumptions_for(spec)
    assert cp_layer_times(windowed, a) == cp_layer_times(windowed, replace(a, cp_comm="all_gather"))
    assert cp_layer_times(spec, a) != cp_layer_times(spec, replace(a, cp_comm="all_gather"))
    with pytest.raises(ValueError, match="cp_comm"):
        cp_layer_times(spec, replace(a, cp_comm="ring"))
