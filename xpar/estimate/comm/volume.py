"""Communication volume per device per step, by collective. Units: bytes sent per device.

Ring collectives over n ranks (Patarasuk & Yuan 2009; NCCL's bus-bandwidth convention), buffer
of S bytes: all-reduce 2 (n-1)/n S; reduce-scatter and all-gather (n-1)/n S each.

- dp (Rajbhandari et al. 2020, Sec. 7): what each ZeRO stage issues per step and micro-batch,
  with torch's FSDP2 and pipelining behaviour (gathers m, 2 m or m + 1 times; counted in real
  runs, tests/parallel/test_pipeline.py).
- tp (Shoeybi et al. 2019; Korthikanti et al. 2022 Sec. 4.2.2): 2 all-reduces of b s h per layer
  each way (all-gather + reduce-scatter with sequence parallelism); full recompute repeats 2.
- pp (Narayanan et al. 2021, Sec. 4.1): b s h per micro-batch and stage boundary each way,
  / t with sequence parallelism or scatter/gather.

Keys: :data:`KEYS`. Derivation: docs/concepts/cost-model-derivations.md.
"""
from __future__ import annotations

from typing import Optional

from xpar.config.attention import kv_replica_elements
from xpar.config.block import block_collectives
from xpar.config.remat import POLICIES, spec_recompute
from xpar.config.spec import RunSpec
from xpar.estimate.memory.model_states import BYTES, expert_dp_size, expert_numel, param_numel, root_elements
from xpar.parallel.ring import ring_factor  # noqa: F401  (re-exported: the cost model's formulas use it)

KEYS = ("dp_allreduce", "dp_reduce_scatter", "dp_allgather", "tp_allreduce", "tp_allgather",
        "tp_reduce_scatter", "pp_send_recv")
EXPERT_KEYS = ("edp_allreduce", "edp_reduce_scatter", "edp_allgather")
"""Keys of the routed experts' gradient reduction and gathers over the expert-dp ranks, present only where
that group is not dp (:func:`comm_bytes_rank`)."""


def allreduce_bytes(nbytes: float, n: int) -> float:
    """Ring all-reduce of S bytes: bytes each device sends."""
    return ring_factor("allreduce", n) * nbytes


def allgather_bytes(nbytes: float, n: int) -> float:
    """Ring all-gather (or reduce-scatter) of a full buffer of S bytes: bytes each device sends."""
    return ring_factor("allgather", n) * nbytes


reduce_scatter_bytes = allgather_bytes


def dp_reductions(spec: RunSpec) -> int:
    """Gradient reductions over dp per step: m for ZeRO-2/3 without pp (a reduce-scatter
    after every micro-batch), else 1 (DDP/ZeRO-1 after the last micro-batch; torch
    pipelining after the stage's last backward)."""
    return spec.micro_batches if spec.layout.zero_stage >= 2 and spec.pp == 1 else 1


def tp_layer_bytes(b: int, s: int, h: int, t: int, elem: int = 2, sp: bool = False,
                   recompute: str = "none", rerun: Optional[float] = None,
                   block: str = "sequential") -> dict[str, float]:
    """TP bytes per device of one transformer layer, one micro-batch, forward + backward:
    2 all-reduces of b s h elements forward, 2 backward, plus the forward's that the backward
    reruns (``rerun``, xpar.estimate.cost.tp_rerun, in a sequential block's forward pairs; default 2 with
    full recompute); with sequence parallelism the same number of all-gathers and reduce-scatters.
    A parallel ``block`` (xpar.config.block): n_in input-side and n_out output-side collectives each way
    (forward: n_in all-gathers, n_out reduce-scatters or all-reduces; backward the transposes)."""
    r = ((2 if recompute == "full" else 0) if rerun is None else rerun) / 2  # forwards rerun
    n_in, n_out = block_collectives(block)
    size = b * s * h * elem
    if sp:
        return {"tp_allreduce": 0.0, "tp_allgather": (n_in * (1 + r) + n_out) * allgather_bytes(size, t),
                "tp_reduce_scatter": (n_out * (1 + r) + n_in) * reduce_scatter_bytes(size, t)}
    return {"tp_allreduce": (n_out * (1 + r) + n_in) * allreduce_bytes(size, t), "tp_allgather": 0.0,
            "tp_reduce_scatter": 0.0}


def kv_replica_bytes(spec: RunSpec, grad_bytes: int) -> dict[str, float]:
    """tp bytes per device and step of one layer whose K/V heads its tp ranks keep whole
    (xpar.config.attention.kv_replica_elements; xpar.estimate.step_parts.kv_replica_times): the K/V output's
    gradient all-reduced each micro-batch, or with sequence parallelism the output all-gathered (again where
    recompute reruns wk) and its gradient reduce-scattered, and the weight gradients (``grad_bytes`` each)
    all-reduced once; {} otherwise."""
    output, weights = kv_replica_elements(spec)
    if not output:
        return {}
    t, m, size = spec.tp, spec.micro_batches, output * BYTES[spec.train.dtype]
    if not spec.layout.sequence_parallel:
        return {"tp_allreduce": m * allreduce_bytes(size, t)}
    policy, share = spec_recompute(spec)
    gathers = 1 + share * ("wk" in POLICIES[policy].reruns)
    return {"tp_allgather": m * gathers * allgather_bytes(size, t),
            "tp_reduce_scatter": m * reduce_scatter_bytes(size, t), "tp_allreduce": allreduce_bytes(weights * grad_bytes, t)}


def pp_sends(layout, pp_rank: int) -> int:
    """Point-to-point sends per micro-batch of pipeline rank ``pp_rank`` (a
    :class:`xpar.config.layout.Layout`'s): forward from each stage it holds but the last, backward
    from each but the first."""
    split, stages = layout.layer_split, layout.stages_of(pp_rank)
    return sum((st < len(split) - 1) + (st > 0) for st in stages)


def dp_bytes(spec: RunSpec, elements: int, root: int, n: int, zero1: str, grad_bytes: int,
             prefix: str = "dp") -> dict[str, float]:
    """Bytes one device sends per step in the data-parallel collectives of ``elements`` parameters
    reduced (and, ZeRO-1-3, sharded) over ``n`` ranks, keys ``<prefix>_allreduce``, ``_reduce_scatter``,
    ``_allgather``; ``root``: elements of the FSDP root unit among them (ZeRO-3 without pp keeps it
    gathered into the backward). What each ZeRO stage issues: module docstring; ``zero1``,
    ``grad_bytes``: :func:`comm_bytes_rank`. Called once for the dense parameters over dp and once for
    the routed experts over the expert-dp ranks (prefix ``edp``), which reduce an expert's gradient
    among the ranks holding the same experts: Megatron-Core's expert data parallel group
    (megatron/core/parallel_state.py, dp x cp x tp / (ep x etp) ranks), DeepSpeed-MoE's (Rajbhandari et
    al. 2022, DeepSpeed-MoE; deepspeed/moe/utils.py ``split_params_into_different_moe_groups_for_optimizer``),
    xpar's engine (xpar.parallel.expert.reduce_expert_grads, shard_experts)."""
    lay, e, m = spec.layout, BYTES[spec.train.dtype], spec.micro_batches
    psi, grads, z = elements * e, elements * grad_bytes, lay.zero_stage
    out = {f"{prefix}_{k}": 0.0 for k in ("allreduce", "reduce_scatter", "allgather")}
    if z == 1 and zero1 == "distributed_optimizer":
        out[f"{prefix}_reduce_scatter"] = reduce_scatter_bytes(grads, n)
        out[f"{prefix}_allgather"] = allgather_bytes(psi, n)
    elif z <= 1:
        out[f"{prefix}_allreduce"] = allreduce_bytes(grads, n)
        if z == 1:
            out[f"{prefix}_allgather"] = allgather_bytes(psi, n)
    else:
        out[f"{prefix}_reduce_scatter"] = reduce_scatter_bytes(grads, n) * dp_reductions(spec)
        gathers = (m if spec.pp == 1 else m + 1) if z == 3 else (m if spec.pp == 1 else 1)
        out[f"{prefix}_allgather"] = allgather_bytes(psi, n) * gathers
        if z == 3 and spec.pp == 1:  # backward gathers every block again, not the root (xpar.estimate.comm.dp)
            out[f"{prefix}_allgather"] += allgather_bytes(psi - root * e, n) * m
    return out


def comm_bytes_rank(spec: RunSpec, pp_rank: int, scatter_gather: bool = False,
                    zero1: str = "zero_redundancy", grad_bytes: Optional[int] = None) -> dict[str, float]:
    """Bytes sent per step by one device of pipeline rank ``pp_rank``, by collective (see
    module docstring). ``scatter_gather``: Megatron's optimisation that sends 1/t of each
    inter-stage tensor and all-gathers it on the receiving node (counted in pp only).
    ``zero1``: 'zero_redundancy' (torch: all-reduce + broadcast of the updated shards) or
    'distributed_optimizer' (Megatron: reduce-scatter + all-gather, as ZeRO-2, once per step).
    ``grad_bytes``: bytes per gradient element reduced (4 for an fp32 reduction of bf16 training,
    :func:`xpar.estimate.comm.dp.grad_bytes`); None: the training dtype's, as the ZeRO paper counts.
    Where the routed experts are reduced over their own expert-dp ranks (ep > 1 or an etp of their own:
    :func:`xpar.estimate.memory.model_states.expert_dp_size`), the ``dp_*`` keys hold the dense parameters' and
    the ``edp_*`` keys (:data:`EXPERT_KEYS`) the experts' (:func:`dp_bytes`)."""
    lay, e = spec.layout, BYTES[spec.train.dtype]
    out = dict.fromkeys(KEYS, 0.0)
    m, t, sp = spec.micro_batches, spec.tp, lay.sequence_parallel
    gb = e if grad_bytes is None else grad_bytes
    experts = expert_numel(spec, pp_rank) if expert_dp_size(spec) != spec.dp else 0
    root = root_elements(spec, pp_rank)
    out.update(dp_bytes(spec, param_numel(spec, pp_rank) - experts, root, spec.dp, zero1, gb, "dp"))
    if experts:  # the routed experts over expert-dp (:func:`dp_bytes`)
        out.update(dp_bytes(spec, experts, 0, expert_dp_size(spec), zero1, gb, "edp"))
    # tp
    stages, split = spec.layout.stages_of(pp_rank), spec.layer_split
    policy, share = spec_recompute(spec)
    n_layers = spec.layout.layers_of(pp_rank)
    b, s, h = spec.train.micro_batch_size, spec.seq_len, spec.model.hidden
    if t > 1:
        layer = tp_layer_bytes(b, s, h, t, e, sp, lay.recompute, POLICIES[policy].tp_rerun * share, spec.model.block)
        ends = (0 in stages) + (len(split) - 1 in stages)  # embedding fwd / output bwd
        size = b * s * h * e
        for k, v in layer.items():
            out[k] += v * n_layers * m
        if sp:
            out["tp_allgather"] += ends * m * allgather_bytes(size, t)
            out["tp_reduce_scatter"] += ends * m * reduce_scatter_bytes(size, t)
        else:
            out["tp_allreduce"] += ends * m * allreduce_bytes(size, t)
        for k, v in kv_replica_bytes(spec, e if grad_bytes is None else grad_bytes).items():
            out[k] += v * n_layers
    # pp: sends forward from every stage but the last, backward from every stage but the first
    if spec.pp > 1:
        sends = pp_sends(spec.layout, pp_rank)
        out["pp_send_recv"] = sends * m * b * s * h * e / (t if (sp or scatter_gather) else 1)
    return out


def comm_bytes(spec: RunSpec, pp_rank: Optional[int] = None, scatter_gather: bool = False,
               zero1: str = "zero_redundancy") -> dict[str, float]:
    """Bytes per device per step by collective (keys: KEYS) for pipeline rank ``pp_rank``,
    or the rank sending the most in total when None."""
    ranks = range(spec.pp) if pp_rank is None else [pp_rank]
    return max((comm_bytes_rank(spec, r, scatter_gather, zero1) for r in ranks), key=lambda d: sum(d.values()))
