"""Expert parallelism in the cost model: each MoE layer's experts split over ep ranks, tokens sent
to their experts' ranks and back by all-to-all (GShard, Lepikhin et al. 2021; Megatron-Core's
alltoall dispatcher; DeepSeek-AI 2024, "DeepSeek-V3", Sec. 3.2.2).

Per rank, micro-batch and MoE layer: two all-to-alls forward (dispatch, combine) and two backward,
each ``T k h`` elements (T = b s / cp tokens, / t with sequence parallelism), (ep - 1) / ep of them
leaving the rank (:func:`alltoall_time`); a one-copy-per-node dispatcher (DeepEP, HybridEP) sends one copy
per node across and one per rank over NVLink (:func:`ep_shares`; fewer under a round-robin gate,
model.moe_routing: :func:`round_robin_reach`). The busiest rank's load (:func:`busiest_rank_load`:
``model.moe_imbalance`` x the mean, dropless; or ``model.capacity_factor`` x the even share, padded
to capacity) stretches the routed compute and the all-to-alls; the framework's ``ep_a2a_overlap``
share is hidden. Expert states: xpar.estimate.memory.model_states.
Units: seconds.
"""
from __future__ import annotations

import math
from functools import lru_cache
from typing import Optional

from xpar.config.remat import replayed_share
from xpar.config.schema import HardwareConfig
from xpar.config.spec import RunSpec
from xpar.estimate.comm.collectives import Group, group_of, nic_share
from xpar.estimate.compute.flops import model_flops_per_token
from xpar.estimate.memory.model_states import BYTES
from xpar.estimate.compute.kernel_costs import kernel_priced
from xpar.estimate.moe_dispatch import DISPATCHERS


def alltoall_time(hw: HardwareConfig, nbytes: float, group: Group, inter_share: Optional[float] = None,
                  intra_share: Optional[float] = None, intra_gb_per_s: Optional[float] = None) -> float:
    """Seconds of an all-to-all in which each of the ``group.size`` ranks sends ``nbytes`` split
    evenly over all ranks (itself included): ``intra_share`` of it (default (k - 1)/n) over the intra-node
    link, ``inter_share`` of it (default (n - k)/n) across nodes over its share of the node's NICs
    (:func:`nic_share`), both at once; one latency per link class crossed (NCCL issues the sends
    concurrently). 0 for one rank or unknown bandwidths. The shares of a dispatcher: :func:`ep_shares`;
    ``intra_gb_per_s``: the intra-node rate its kernels reach, GB/s (None: the link's x ``link_efficiency``)."""
    n, k = group.size, min(group.per_node, group.size)
    if n <= 1 or nbytes <= 0 or hw.intra_node_gb_per_s is None:
        return 0.0
    intra = (hw.intra_node_gb_per_s * hw.link_efficiency if intra_gb_per_s is None else intra_gb_per_s) * 1e9
    t = ((k - 1) / n if intra_share is None else intra_share) * nbytes / intra
    lat = hw.collective_latency_us + hw.intra_node_latency_us
    if n > k and hw.inter_node_gb_per_s is not None:
        inter = nic_share(hw) * hw.inter_node_gb_per_s * 1e9 * hw.link_efficiency
        share = (n - k) / n if inter_share is None else inter_share
        t, lat = max(t, share * nbytes / inter), lat + hw.inter_node_latency_us
    return lat * 1e-6 + t


def expert_hit(units: int, top_k: int, groups: int = 0, group_topk: int = 0) -> float:
    """Chance that one of ``units`` equal shares of the experts (a node's, a rank's) holds at least one of a
    token's ``top_k`` experts, experts drawn evenly: without a group limit 1 - (1 - 1/units)^k. With
    group-limited routing (``groups`` G, ``group_topk`` M: the k experts come from M of the G expert groups;
    DeepSeek-V3 Sec. 2.1.2, "each token will be sent to at most M nodes"), drawn evenly within the M groups: a
    unit holding G/units whole groups holds x of the M with the hypergeometric chance of drawing x of its
    groups, hit = sum_x P(x) (1 - (1 - x/M)^k); a group spread over units/G units: M/G (1 - (1 - G/(units M))^k);
    other splits as without a limit. 1 for one unit."""
    if units <= 1:
        return 1.0
    if groups and group_topk and group_topk < groups and groups % units == 0:
        g = groups // units
        return sum(math.comb(g, x) * math.comb(groups - g, group_topk - x) / math.comb(groups, group_topk)
                   * (1 - (1 - x / group_topk) ** top_k) for x in range(1, min(g, group_topk) + 1))
    if groups and group_topk and group_topk < groups and units % groups == 0:
        return group_topk / groups * (1 - (1 - groups / (units * group_topk)) ** top_k)
    return 1 - (1 - 1 / units) ** top_k


def deepep_inter_share(top_k: int, nodes: int, groups: int = 0, group_topk: int = 0) -> float:
    """Share of the T k token copies a rank sends that cross nodes when each token crosses to each
    other node holding one of its k experts once (DeepEP's dispatch, DeepSeek-AI 2024 Sec. 3.2.2:
    IB to the node, NVLink to its GPUs): (N - 1) hit / k, hit = :func:`expert_hit` of a node (against
    (N - 1)/N for a plain all-to-all); 0 on one node."""
    return 0.0 if nodes <= 1 else (nodes - 1) * expert_hit(nodes, top_k, groups, group_topk) / top_k


def deepep_intra_share(top_k: int, ranks: int, groups: int = 0, group_topk: int = 0) -> float:
    """Share of the T k token copies that pass a rank's NVLink buffers under DeepEP's normal kernels: a token
    reaches each rank holding one of its experts once, the sending rank's own included, D = ranks x
    :func:`expert_hit` of a rank such ranks a token; by symmetry each rank forwards (across nodes) or sends
    (inside one) T D copies: D / k. Source: DeepEP csrc/kernels/legacy/intranode.cu (dispatch: one sender warp
    group per destination rank, itself included, writing each token once where ``is_token_in_rank``) and
    internode.cu (the RDMA-and-NVL forwarders write a node's received tokens to each local rank whose
    ``is_token_in_nvl_rank`` bit is set, the own node's tokens copied locally, not through the NIC); DeepEP's
    README (docs/legacy.md, H800, 4096 tokens, hidden 7168, top-8) prints these bytes as 'NVL' GB/s and they
    bind at EP 16 on two nodes (benchmarks/ep_alltoall.py)."""
    return ranks * expert_hit(ranks, top_k, groups, group_topk) / top_k


@lru_cache(maxsize=256)
def round_robin_reach(n_experts: int, top_k: int, units: int) -> float:
    """Mean number of distinct ``units`` (equal contiguous shares of the ``n_experts`` experts: a rank's, a node's,
    as ep places them) holding one of a token's ``top_k`` experts under a round-robin gate: token t takes experts
    (t k + j) mod E, j < k (NeMo AutoModel's ``FakeBalancedGate.forward``, nemo_automodel/components/moe/layers.py
    @01926a5c and @037e04a6; ``BackendConfig.fake_balanced_gate: true`` in its examples/benchmark/configs/
    *_te_deepep.yaml, and its docs/performance-summary.md Notes: "Fake balanced gate is enabled to simulate ideal
    expert routing"; torchtitan's ``debug.moe_force_load_balance``, torchtitan/models/moe/moe.py
    ``TokenChoiceTopKRouter._debug_force_load_balance_routing``: ``arange(N k) % E``; not Megatron-Core's
    ``--moe-router-force-load-balancing``, random logits, moe_utils.py ``RandomSTE``), averaged over one period of t
    (E / gcd(E, k) tokens). The k experts are consecutive, so the count is 1 or 2 where a unit holds >= k experts
    (Qwen3-30B-A3B at ep 8: 1), against units x :func:`expert_hit` (about 5.3 of 8) for experts drawn evenly.
    Raises ValueError unless E % units == 0."""
    if units <= 1:
        return 1.0
    if n_experts % units:
        raise ValueError(f"{n_experts} experts do not split over {units} units")
    per, period = n_experts // units, n_experts // math.gcd(n_experts, top_k)
    return sum(len({(t * top_k + j) % n_experts // per for j in range(top_k)}) for t in range(period)) / period


def ep_shares(dispatcher: str, top_k: int, group: Group, groups: int = 0, group_topk: int = 0,
              round_robin_experts: int = 0) -> tuple[Optional[float], Optional[float]]:
    """(intra_share, inter_share) of :func:`alltoall_time` for ``dispatcher`` on ``group``: (None, None), every
    routed copy sent, for a plain all-to-all; for a one-copy-per-node dispatcher (DeepEP, HybridEP)
    :func:`deepep_intra_share` and :func:`deepep_inter_share` (``groups``, ``group_topk``: the router's group
    limit); under a round-robin gate over ``round_robin_experts`` experts (model.moe_routing) the same shares
    with :func:`round_robin_reach` ranks and nodes a token (its destinations the same on every rank, spread
    evenly over the nodes: (N - 1) / N of a node's copies cross). Raises KeyError for a dispatcher not in
    :data:`xpar.estimate.moe_dispatch.DISPATCHERS`."""
    if not DISPATCHERS[dispatcher].one_copy_per_node:
        return None, None
    if round_robin_experts:
        n = group.nodes
        inter = 0.0 if n <= 1 else (n - 1) / n * round_robin_reach(round_robin_experts, top_k, n) / top_k
        return round_robin_reach(round_robin_experts, top_k, group.size) / top_k, inter
    return (deepep_intra_share(top_k, group.size, groups, group_topk),
            deepep_inter_share(top_k, group.nodes, groups, group_topk))


def busiest_rank_load(cfg) -> float:
    """Tokens the busiest ep rank's experts receive and compute, over the even share k T / ep:
    ``model.capacity_factor`` c where set (every expert's buffer padded to c x its even share, the
    tokens beyond it dropped: GShard, Lepikhin et al. 2021; Fedus et al. 2022; Megatron-Core's
    ``--moe-expert-capacity-factor`` with ``--moe-pad-expert-input-to-capacity``), else (dropless)
    ``model.moe_imbalance``."""
    return cfg.moe_imbalance if cfg.capacity_factor is None else cfg.capacity_factor


EP_REPLAY_POLICIES = ("full", "moe", "op", "save_dot_except_mlp", "save_qkv_proj")
"""Recompute policies whose backward reruns a MoE block's dispatch and combine all-to-alls: full (torch's
checkpoint, Megatron's tensor_parallel.checkpoint of the layer), Megatron-Core's --recompute-modules moe
(megatron/core/transformer/moe/moe_layer.py checkpoints router, dispatch, experts and combine together) and
the policies xpar runs by selective checkpointing, which replays every op whose output it does not keep
(xpar's engine: 15 -> 24 all-to-all calls per step, issue 42). Not: Megatron's selective (the attention
core) and torchtitan's op policy (torchtitan PR 1672 saves the all-to-all outputs)."""


def ep_replay(spec: RunSpec, fw) -> float:
    """Share of the blocks whose backward reruns their forward's all-to-alls (:data:`EP_REPLAY_POLICIES`,
    ``fw.recompute_replays_comm``: :func:`xpar.config.remat.replayed_share`); 0 without recompute."""
    return replayed_share(spec, fw, EP_REPLAY_POLICIES)


def moe_blocks_on(layout, model, rank: int) -> int:
    """MoE blocks pipeline rank ``rank`` of ``layout`` computes: ``model.is_moe_layer`` of its stages' blocks, and
    on the rank holding the last stage the multi-token prediction blocks where the decoder's last block is MoE
    (``model.mtp_layers``: xpar.estimate.columns.mtp)."""
    mtp = model.mtp_layers * model.is_moe_layer(model.n_layers - 1) * layout.has_last_stage(rank)
    return sum(model.is_moe_layer(i) for s in layout.stages_of(rank) for i in layout.stage_layers(s)) + mtp


def ep_payload_bytes(spec: RunSpec) -> float:
    """Bytes one rank sends in one all-to-all of one MoE layer and micro-batch: T k h at the
    compute width (T tokens of the rank: b s on a cp-folded spec, / t with sequence parallelism)."""
    cfg = spec.model
    tokens = spec.train.micro_batch_size * spec.seq_len / (spec.tp if spec.layout.sequence_parallel else 1)
    return tokens * cfg.moe_top_k * cfg.hidden * BYTES[spec.train.dtype]


def ep_bytes_per_step(spec: RunSpec) -> float:
    """Bytes the fullest pipeline rank sends in its all-to-alls of one step: per MoE layer and
    micro-batch, dispatch and combine in forward and their gradients in backward (4 x
    :func:`ep_payload_bytes`, plus the forward's 2 again per recomputed layer: :func:`ep_replay` under
    the spec's framework), as xpar.estimate.columns.ep_slots.ep_slot_columns counts them; 0 at ep = 1."""
    if spec.layout.ep == 1:
        return 0.0
    layout = spec.layout
    layers = max(moe_blocks_on(layout, spec.model, r) for r in range(spec.pp))
    return (4.0 + 2.0 * ep_replay(spec, spec.framework)) * layers * spec.micro_batches * ep_payload_bytes(spec)


def deepep_nvl_rate(hw: HardwareConfig, dispatcher: str) -> Optional[float]:
    """GB/s at which ``dispatcher`` moves a rank's intra-node copies where it is DeepEP's and the device has DeepEP's
    own figure (``hardware.deepep_nvl_gb_per_s``); None otherwise (:func:`alltoall_time` then takes the link's rate x
    ``link_efficiency``). The figure counts what DeepEP's tests/test_intranode.py counts: the bytes a rank receives,
    its own copies included, over the kernel's time (:func:`deepep_intra_share`'s bytes). DeepEP's intranode kernels do not reach NCCL's share of NVLink 5: tuned on B200 at ep 8 they
    move 516.71 GB/s dispatching and 485.75 GB/s combining, 0.57 / 0.54 of the 900 GB/s link (pytorch/torchtitan
    torchtitan/distributed/deepep/utils.py, ``turbo_deepep_dispatch_tuned_config`` / ``..._combine_tuned_config``
    comments, 128 SMs, Qwen3-30B-A3B shapes; DeepEP V1, the NVSHMEM-based kernels of 2025), where V1 reaches 153 / 158
    GB/s of H800's "~160 GB/s NVLink maximum" (deepseek-ai/DeepEP docs/legacy.md, intranode EP 8). DeepEP V2
    (2026-04) reaches 726 / 740 GB/s on SM100 at EP 8 (DeepEP README @dd758ca, 'Performance', 64 SMs): a run on V2
    sets ``hardware.deepep_nvl_gb_per_s`` to ~733 (or null: 0.8 of the link)."""
    return hw.deepep_nvl_gb_per_s if dispatcher == "deepep" else None


def ep_layer_times(spec: RunSpec, dispatcher: str = "alltoall") -> dict[str, float]:
    """Seconds of one MoE layer's all-to-alls per micro-batch: ``f`` (dispatch and combine) and
    ``b`` (their gradients); 0 at ep = 1. The ep group is etp-strided (expert ranks etp innermost,
    then ep, as Megatron-Core orders them). DeepEP's NVLink share moves at ``hardware.deepep_nvl_gb_per_s`` where
    the preset has DeepEP's own figure (:func:`deepep_nvl_rate`)."""
    ep = spec.layout.ep
    if ep == 1:
        return {"f": 0.0, "b": 0.0}
    group = group_of(spec.hardware, ep, spec.layout.expert_tp)
    m = spec.model
    intra, inter = ep_shares(dispatcher, m.moe_top_k, group, m.moe_router_groups, m.moe_router_group_topk,
                             m.n_experts if m.moe_routing == "round_robin" else 0)
    one = alltoall_time(spec.hardware, ep_payload_bytes(spec) * busiest_rank_load(spec.model), group, inter, intra,
                        deepep_nvl_rate(spec.hardware, dispatcher))
    return {"f": 2 * one, "b": 2 * one}


def routed_share(spec: RunSpec) -> float:
    """Fraction of a MoE model's matmul FLOPs per token in its routed experts (0 when dense)."""
    cfg = spec.model
    if not cfg.n_experts:
        return 0.0
    n_mlp = 3 if cfg.activation == "swiglu" else 2
    routed = 6 * cfg.moe_layers * n_mlp * cfg.hidden * cfg.expert_ffn * cfg.moe_top_k
    return min(1.0, routed / model_flops_per_token(cfg, spec.seq_len))


def shared_expert_share(spec: RunSpec) -> float:
    """Fraction of a MoE model's matmul FLOPs per token in its shared experts (``n_shared_experts`` MLPs of
    expert_ffn width in every MoE layer, as xpar.estimate.compute.kernel_block prices them): :func:`routed_share`
    x n_shared / k; 0 without shared experts (Qwen3 MoE, gpt-oss) or experts."""
    cfg = spec.model
    return routed_share(spec) * cfg.n_shared_experts / cfg.moe_top_k if cfg.n_experts else 0.0


def imbalance_share(spec: RunSpec) -> float:
    """Of a step's matmul term, what the busiest ep rank's routed experts add beyond the even share:
    :func:`routed_share` x (:func:`busiest_rank_load` - 1); 0 where the kernel model prices compute (its
    expert GEMMs already take the busiest rank's tokens: xpar.estimate.compute.kernel_block.expert_tokens)."""
    if kernel_priced(spec.hardware, spec.train.dtype):
        return 0.0
    return routed_share(spec) * (busiest_rank_load(spec.model) - 1.0)


def ep_note(spec: RunSpec, overlap: float = 0.0, replay: float = 0.0, shared: bool = False) -> str:
    """What ep adds to a step of ``spec`` (cp folded) in words: the fullest rank's all-to-alls per
    micro-batch (``replay``: the share of blocks whose backward reruns them, :func:`ep_replay`), the
    bytes each sends and the share exposed (1 - ``overlap``; ``shared``: less what the shared experts' GEMMs hide,
    framework.ep_shared_expert_overlap). Their seconds: xpar.estimate.columns.ep_slots.ep_slot_columns."""
    layout = spec.layout
    layers = max(moe_blocks_on(layout, spec.model, r) for r in range(spec.pp))
    return (f"expert parallelism ep={layout.ep}: {2 * layers} all-to-alls per micro-batch in forward and as "
            f"many in backward{f' (+{2 * replay:.3g} replayed by recompute)' if replay else ''} "
            f"({ep_payload_bytes(spec) / 2**20:.1f} MiB sent per rank each), {1 - overlap:.0%} exposed"
            + (" less what the shared experts' GEMMs hide on their own stream" if shared else ""))
