"""Expert parallelism in the cost model (issue 30): expert states per rank, the all-to-all's time and
where it runs, the DeepSeek-V3 layout's breakdown, and the checks of ep and etp."""
import pytest

from tests.conftest import spec_for
from xpar.calibrate.published import preset
from xpar.config.schema import HardwareConfig
from xpar.estimate.comm.collectives import Group
from xpar.estimate.cost import estimate
from xpar.estimate.expert_parallel import alltoall_time, deepep_inter_share, ep_payload_bytes
from xpar.estimate.memory.per_device import memory
from xpar.estimate.memory.model_states import expert_state_bytes, held_numel, MemoryOptions

H100 = ("hardware=h100_80gb_64gpu", "train=cluster", "run.mode=estimate")


def mixtral(*overrides: str):
    return spec_for("model=mixtral_8x7b", *H100, "train.seq_len=4096", "parallel.pp=8", "parallel.micro_batches=8",
                    "parallel.recompute=full",
                    "parallel.zero_stage=1", "framework=megatron_core", *overrides)


def test_each_rank_holds_e_over_ep_experts_and_shards_them_over_expert_dp():
    """ep 8 of Mixtral's 8 experts at dp 8: each rank holds 1 expert of 8 per MoE layer (the expert
    elements / 8), its optimizer states over dp / ep = 1 expert-dp rank (1/8 x 1: the same share as
    all 8 sharded over dp 8); the dense parameters are untouched."""
    base, ep = mixtral(), mixtral("parallel.ep=8")
    a, b = held_numel(base, 0, 0, "distributed_optimizer"), held_numel(ep, 0, 0, "distributed_optimizer")
    o = MemoryOptions(zero1="distributed_optimizer")
    ea, eb = expert_state_bytes(base, 0, 0, o), expert_state_bytes(ep, 0, 0, o)
    assert eb["params"] * 8 == pytest.approx(ea["params"]) and eb["expert_dp"] == 1 and ea["expert_dp"] == 8
    assert eb["optimizer"] == pytest.approx(ea["optimizer"], rel=1e-3)
    per_expert = 3 * 4096 * 14336 * 4  # w1, w2, w3 of one expert x the 4 MoE layers of a stage
    assert a["whole"] - b["whole"] == 7 * per_expert
    assert b["whole"] < a["whole"] and memory(ep).params < memory(base).params


def test_the_all_to_all_is_priced_where_its_ranks_are():
    """Inside a node an all-to-all is NVLink-bound, (k - 1)/n of the payload; across nodes the
    off-node share over the NIC dominates; DeepEP's one-copy-per-node dispatch sends less across."""
    hw = HardwareConfig(**{k: v for k, v in preset("hardware", "h100_80gb_64gpu").items()})
    one_node, two_nodes = alltoall_time(hw, 1e9, Group(8, 8)), alltoall_time(hw, 1e9, Group(16, 8))
    assert one_node == pytest.approx(7 / 8 * 1e9 / (450e9 * 0.8) + 11.8e-6, rel=1e-6)
    assert two_nodes == pytest.approx(8 / 16 * 1e9 / (50e9 * 0.8) + 21.4e-6, rel=1e-6)
    assert alltoall_time(hw, 1e9, Group(1, 1)) == 0.0
    assert deepep_inter_share(8, 8) < 7 / 8 and deepep_inter_share(8, 1) == 0.0
    assert deepep_inter_share(1, 4) == pytest.approx(3 / 4)  # one expert: every remote copy crosses


def test_ep_adds_the_all_to_alls_to_the_step():
    """ep_comm = m x MoE layers of the fullest rank x 4 all-to-alls of b s k h bytes, exposed under
    megatron_core, hidden under a framework that overlaps them (hai_llm: DualPipeV; under its 1F1B exposed)."""
    spec = mixtral("parallel.ep=8")
    e = estimate(spec)
    assert e.time_breakdown["ep_comm"] > 0 and e.comm_time["ep"] == pytest.approx(e.time_breakdown["ep_comm"])
    assert ep_payload_bytes(spec) == 4096 * 2 * 4096 * 2
    assert e.time_per_step_s == pytest.approx(sum(e.time_breakdown.values()), rel=1e-9)
    hidden = estimate(mixtral("parallel.ep=8", "framework=hai_llm", "parallel.schedule=dualpipev",
                              "parallel.virtual_stages=2", "parallel.micro_batches=16"))
    assert hidden.time_breakdown["ep_comm"] == 0.0 and hidden.comm_time["ep"] > 0
    exposed = estimate(mixtral("parallel.ep=8", "framework=hai_llm", "parallel.schedule=1f1b"))
    assert exposed.comm_time["ep"] > 0
    assert exposed.time_breakdown["ep_comm"] == pytest.approx(exposed.comm_time["ep"], rel=1e-12)
    skewed = estimate(mixtral("parallel.ep=8", "model.moe_imbalance=1.5"))
    # the kernel model gives the busiest rank's experts their tokens: the skew is in the matmul term itself
    assert skewed.time_breakdown["ep_imbalance"] == 0.0 and skewed.time_per_step_s > e.time_per_step_s
    assert skewed.time_breakdown["matmul"] > 1.2 * e.time_breakdown["matmul"]


def test_deepseek_v3_layout_names_the_all_to_all_and_the_expert_states():
    """The published DeepSeek-V3 layout (parallel=deepseek_v3_2048gpu: pp 16 DualPipe, ep 64, ZeRO-1
    dp 128 on 2048 H800) fits and its estimate names the all-to-all and the expert states."""
    spec = spec_for("parallel=deepseek_v3_2048gpu", "train.dtype=fp8")
    e = estimate(spec)
    assert spec.world_size == 2048 and spec.layout.ep == 64 and e.memory.fits
    assert "ep_comm" in e.time_breakdown and e.comm_time["ep"] > 0
    notes = " ".join(e.notes)
    assert "4 of 256 routed experts" in notes and "all-to-alls" in notes


@pytest.mark.parametrize("overrides, words", [
    (("parallel.ep=3", "parallel.dp=8"), "ep values that work: [1, 2, 4]"),
    (("parallel.ep=2", "parallel.etp=3", "parallel.tp=2"), "etp values that work: [1, 2]"),
])
def test_ep_checks_name_values_that_work(overrides, words):
    from xpar.config.checks import ConfigError
    with pytest.raises(ConfigError) as e:
        spec_for("model=moe_tiny", "run.mode=estimate", "hardware=h100_80gb_8gpu", *overrides, local_devices=8)
    assert words in str(e.value), str(e.value)


def test_ep_on_a_dense_model_is_refused():
    from xpar.config.checks import ConfigError
    with pytest.raises(ConfigError) as e:
        spec_for("model=tiny", "run.mode=estimate", "parallel.ep=2")
    assert "has none" in str(e.value) and "parallel.ep=1" in str(e.value)


def test_etp_folds_tp_into_ep():
    """Megatron-Core's MoE parallel folding (Qwen3-235B's published tp 2, ep 32, etp 1 on dp 16): with
    etp 1, ep x etp = 4 divides tp x dp = 4 although ep does not divide dp; at etp = tp it does not."""
    ok = spec_for("model=moe_tiny", "run.mode=estimate", "hardware=h100_80gb_8gpu", "hardware.devices_per_node=4",
                  "parallel.tp=2", "parallel.dp=2", "parallel.ep=4", "parallel.etp=1", local_devices=4)
    assert ok.layout.expert_dp == 1 and ok.layout.expert_tp == 1
    from xpar.config.checks import ConfigError
    with pytest.raises(ConfigError) as e:
        spec_for("model=moe_tiny", "run.mode=estimate", "hardware=h100_80gb_8gpu", "hardware.devices_per_node=4",
                 "parallel.tp=2", "parallel.dp=2", "parallel.ep=4", local_devices=4)
    assert "ep x etp (4 x 2)" in str(e.value), str(e.value)


def test_capacity_factor_prices_the_padded_expert_buffers_not_the_imbalance():
    """model.capacity_factor c (GShard; Fedus et al. 2022; Megatron-Core's capacity factor with padding):
    every expert's buffer holds c x its even share k T / E, the tokens beyond it dropped, so the busiest
    ep rank computes and receives c x the even share whatever the router's imbalance: its routed
    matmuls priced at c x the even share of tokens (the kernel model's expert GEMMs: in the matmul term,
    xpar.estimate.compute.kernel_block.expert_tokens), its all-to-alls carrying c x the even payload, and its fixed
    shapes need no host synchronisation. null (dropless): model.moe_imbalance, as before."""
    even = estimate(mixtral("parallel.ep=8"))
    skew = estimate(mixtral("parallel.ep=8", "model.moe_imbalance=1.25"))
    padded = mixtral("parallel.ep=8", "model.capacity_factor=1.25", "model.moe_imbalance=2.0")
    cf = estimate(padded)
    assert cf.time_breakdown["ep_imbalance"] == 0.0 and cf.time_breakdown["matmul"] > even.time_breakdown["matmul"]
    assert cf.comm_time["ep"] == pytest.approx(skew.comm_time["ep"], rel=1e-12)
    assert cf.comm_time["ep"] > even.comm_time["ep"]
    sync = skew.time_breakdown["host_overhead"] - cf.time_breakdown["host_overhead"]
    assert sync > 0  # dropless: the dispatcher's host synchronisation per MoE forward (xpar.estimate.moe_dispatch)
    assert cf.time_per_step_s <= skew.time_per_step_s - sync + 1e-12  # and the pipeline bubble, where pp > 1
    assert {k: v for k, v in cf.time_breakdown.items() if k not in ("host_overhead", "bubble")} == pytest.approx(
        {k: v for k, v in skew.time_breakdown.items() if k not in ("host_overhead", "bubble")}, rel=1e-12)
    tight = estimate(mixtral("parallel.ep=8", "model.capacity_factor=1.0", "model.moe_imbalance=2.0"))
    assert tight.time_breakdown["ep_imbalance"] == 0.0 and tight.comm_time["ep"] == pytest.approx(even.comm_time["ep"])


@pytest.mark.slow  # integration-sized (conftest.INTEGRATION): runs in the full suite, not the fast loop
def test_recompute_replays_the_all_to_alls_where_the_framework_does():
    """A recomputed MoE block reruns its forward's dispatch and combine in backward where the framework's
    checkpoint replays them (xpar's engine: torch's checkpoint and selective checkpointing, 15 -> 24
    all-to-all calls per step; Megatron-Core's full and --recompute-modules moe): per layer and
    micro-batch 2 forward + 2 replayed + 2 backward all-to-alls instead of 4, so Mixtral's ep term
    rises by half under recompute=full. Megatron's selective (the attention core) and torchtitan's op
    policy (PR 1672 saves the all-to-all outputs) replay none, nor a framework with
    recompute_replays_comm false."""
    from dataclasses import replace as dc_replace
    from xpar.estimate.cost import assumptions_for
    none, full = (mixtral("parallel.ep=8", "framework=xpar", f"parallel.recompute={r}") for r in ("none", "full"))
    e0, e1 = estimate(none), estimate(full)
    assert e1.time_breakdown["ep_comm"] == pytest.approx(1.5 * e0.time_breakdown["ep_comm"], rel=1e-12)
    assert e1.comm_time["ep"] == pytest.approx(1.5 * e0.comm_time["ep"], rel=1e-12)
    off = estimate(full, dc_replace(assumptions_for(full), recompute_replays_comm=False))
    assert off.time_breakdown["ep_comm"] == pytest.approx(e0.time_breakdown["ep_comm"], rel=1e-12)
    meg = {r: estimate(mixtral("parallel.ep=8", f"parallel.recompute={r}")).time_breakdown["ep_comm"]
           for r in ("none", "selective", "moe", "full")}
    assert meg["selective"] == meg["none"] and meg["moe"] == meg["full"] == pytest.approx(1.5 * meg["none"], rel=1e-12)
    titan = estimate(mixtral("parallel.ep=8", "framework=torchtitan", "parallel.zero_stage=2",
                             "parallel.recompute=selective"))
    assert titan.time_breakdown["ep_comm"] == pytest.approx(e0.time_breakdown["ep_comm"], rel=1e-12)


def test_node_limited_routing_sends_deepseek_v3s_tokens_across_fewer_nodes():
    """DeepSeek-V3's node-limited routing (8 groups, 4 open per token; Sec. 2.1.2) at ep 64 on 8 nodes: a node
    holds one group, open with chance 4/8 and then hit with 1 - (3/4)^8, so DeepEP sends 0.394 of the T k copies
    across nodes, not 0.574; a token reaches at most 4 other nodes where nodes hold whole groups; every group open
    is the unlimited share. The 2048-H800 layout's all-to-alls (DualPipeV, hai_llm) fall by that share; under the
    plain all-to-all dispatcher (one send per copy) nothing changes."""
    assert deepep_inter_share(8, 8, 8, 4) == pytest.approx(7 * 0.5 * (1 - 0.75 ** 8) / 8)
    assert deepep_inter_share(8, 8) == pytest.approx(7 * (1 - (7 / 8) ** 8) / 8)
    assert deepep_inter_share(8, 8, 8, 8) == deepep_inter_share(8, 8) and deepep_inter_share(8, 1, 8, 4) == 0.0
    for nodes in (2, 4, 8, 16, 32):
        limited = deepep_inter_share(8, nodes, 8, 4)
        assert limited < deepep_inter_share(8, nodes)
        assert nodes > 8 or limited * 8 <= 4
    dsv3 = ("parallel=deepseek_v3_2048gpu", "run.mode=estimate")
    open_groups = ("model.moe_router_groups=0", "model.moe_router_group_topk=0")
    limited, unlimited = estimate(spec_for(*dsv3)), estimate(spec_for(*dsv3, *open_groups))
    assert limited.comm_time["ep"] < 0.8 * unlimited.comm_time["ep"]
    plain = ("framework.ep_dispatcher=alltoall",)
    assert estimate(spec_for(*dsv3, *plain)).comm_time["ep"] == estimate(spec_for(*dsv3, *plain, *open_groups)).comm_time["ep"]
