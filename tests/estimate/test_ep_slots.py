"""Each pipeline rank's all-to-alls in its own micro-batches (xpar.estimate.columns.ep_slots, issue 43): the pipeline's
fill and drain carry them, and the slowest rank is the one whose compute and all-to-alls together are longest."""
from __future__ import annotations

import pytest

from tests.conftest import spec_for
from xpar.estimate.cost import estimate
from xpar.estimate.expert_parallel import ep_layer_times


def mixtral(*overrides: str):
    """Mixtral 8x7B, every block MoE, 8 per rank over pp 4, ep 8 inside a node, 1F1B with m = 8."""
    return spec_for("model=mixtral_8x7b", "model.seq_len=4096", "run.mode=estimate", "hardware=h100_80gb_64gpu",
                    "framework=megatron_core", "train.dtype=bf16", "parallel.tp=2", "parallel.pp=4", "parallel.dp=8",
                    "parallel.ep=8", "parallel.etp=1", "parallel.sequence_parallel=true", "parallel.zero_stage=1",
                    "parallel.recompute=full", "train.micro_batch_size=1", "train.global_batch_size=64",
                    "run.dry_run=false", *overrides, local_devices=64)


def test_the_bubble_carries_the_other_ranks_all_to_alls():
    """Hiding half of every rank's all-to-alls (framework.ep_a2a_overlap 0.5 under 1F1B) shortens the exposed
    all-to-alls by m x the slowest rank's and the bubble by beta / (1 - beta) x m x the fill ranks' (equal blocks:
    the same seconds), beta = (pp - 1) / (m + pp - 1) = 3 / 11."""
    spec = mixtral()
    assert spec.micro_batches == 8 and spec.layout.layer_split == (8, 8, 8, 8)
    a, b = (estimate(mixtral(f"framework.ep_a2a_overlap={o}", "framework.ep_a2a_overlap_schedules=[1f1b]"))
            for o in (0.0, 0.5))
    cut = a.time_breakdown["ep_comm"] - b.time_breakdown["ep_comm"]
    assert cut == pytest.approx(0.5 * a.time_breakdown["ep_comm"], rel=1e-9) and cut > 0
    assert a.time_breakdown["bubble"] - b.time_breakdown["bubble"] == pytest.approx(3 / 8 * cut, rel=1e-9)
    assert a.time_breakdown["matmul"] == b.time_breakdown["matmul"]


def test_the_all_to_alls_are_the_busiest_ranks_and_priced_per_block():
    """No overlap (Megatron-Core's default): m micro-batches x 8 MoE blocks x one block's dispatch and combine
    forward, again in the recomputed forward, and their gradients (ep_layer_times)."""
    spec = mixtral()
    est = estimate(spec)
    one = ep_layer_times(spec, "alltoall")
    assert est.time_breakdown["ep_comm"] == pytest.approx(8 * 8 * (2 * one["f"] + one["b"]), rel=1e-9)
    assert est.comm_time["ep"] == pytest.approx(est.time_breakdown["ep_comm"], rel=1e-9)


def qwen3_b200(dispatcher: str, *overrides: str):
    """Qwen3-30B-A3B on one B200 node, ep 8 (refusal_hunt3.md row 22's layout, torchtitan)."""
    return spec_for("model=qwen3_30b_a3b", "model.seq_len=4096", "run.mode=estimate", "hardware=b200_180gb_node",
                    "framework=torchtitan", f"framework.ep_dispatcher={dispatcher}", "train.dtype=bf16",
                    "parallel.dp=8", "parallel.ep=8", "parallel.zero_stage=3", "parallel.recompute=full",
                    "train.micro_batch_size=8", "train.global_batch_size=64", "run.dry_run=false", *overrides,
                    local_devices=8)


def test_deepep_on_b200_moves_its_nvlink_copies_at_deepeps_own_rate_not_nccls():
    """torchtitan's DeepEP (V1) is tuned on B200 at ep 8 to 516.71 / 485.75 GB/s dispatch / combine
    (hardware.deepep_nvl_gb_per_s 500.8, their harmonic mean), not 0.8 x 900: on one node every copy is on NVLink,
    so its all-to-alls take 720 / 500.8 as long less the latency. Null restores NCCL's rate; the plain all-to-all
    keeps it either way."""
    hw = qwen3_b200("deepep").hardware
    lat = (hw.collective_latency_us + hw.intra_node_latency_us) * 1e-6
    null = ("hardware.deepep_nvl_gb_per_s=null",)
    own, nccl = (ep_layer_times(qwen3_b200("deepep", *o), "deepep")["f"] for o in ((), null))
    assert hw.deepep_nvl_gb_per_s == pytest.approx(2 / (1 / 516.71 + 1 / 485.75), rel=1e-3)
    assert own - 2 * lat == pytest.approx((nccl - 2 * lat) * 0.8 * 900 / 500.8, rel=1e-9)
    plain = [ep_layer_times(qwen3_b200("alltoall", *o), "alltoall")["f"] for o in ((), null)]
    assert plain[0] == plain[1] > 0
