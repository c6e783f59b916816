"""Dry run: the real engine factory at the layout's full world size, on a fake process group.

Each representative rank (first, middle and last pipeline rank x first and last dp rank) is built
in this process by :func:`xpar.parallel.factory.build_engine` with ``materialize_model=False``:
fake process group -> DeviceMesh "cpu" -> the model or this rank's stages on the meta device ->
TP -> DDP / FSDP2 -> PipelineStage + schedule. No memory is allocated, no collective moves data;
local shard sizes are read with ``DTensor.to_local()`` and times the dtype's bytes per element
(xpar.estimate.memory.model_states.STATE_BYTES) checked against the cost model's parameter bytes.

Units: bytes, seconds. Errors: torch's exceptions while building become a :class:`PlanError`
naming the rank and its coordinates.
"""
from __future__ import annotations

import sys
import time
import warnings
from dataclasses import asdict, dataclass, field, replace
from typing import Optional

from xpar.config.layout import SCHEDULES, microbatch_ok
from xpar.config.remat import POLICIES
from xpar.config.spec import RunSpec
from xpar.estimate.context_parallel import fold_cp
from xpar.estimate.memory.model_states import (
    STATE_BYTES,
    grads_deferred,
    model_state_bytes_per_rank,
    replicated_embedding_grad_numel,
)
from xpar.parallel.torch_internals import fake_store
from xpar.track.report import format_bytes


class PlanError(RuntimeError):
    """The engine factory failed for one rank of the dry run."""


@dataclass
class RankCheck:
    """One rank of the dry run, and the cost model's figures for the same rank. Bytes."""

    rank: int
    coords: dict[str, int]
    """pp, dp, tp coordinates (dp: the index in the dp x cp replica group under cp, :func:`dry_run`)."""
    local_numel: int
    """Elements of this rank's parameter storage (DTensor local shards)."""
    dryrun: dict[str, int]
    """params and grads as held during the step, bytes: params dp-unsharded under ZeRO-2;
    grads dp-sharded under ZeRO-2/3 without pp, whole where the reduction is deferred
    (xpar.estimate.memory.per_device.grads_deferred)."""
    analytic: dict[str, int]
    """The same from xpar.estimate.memory.per_device.model_state_bytes_per_rank."""
    build_s: float

    @property
    def diff(self) -> int:
        """Largest |dry run - analytic| over params and grads, bytes."""
        return max(abs(self.dryrun[k] - self.analytic[k]) for k in self.dryrun)


@dataclass
class DryRun:
    ranks: list[RankCheck] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def max_diff(self) -> int:
        return max((r.diff for r in self.ranks), default=0)

    def to_dict(self) -> dict:
        return {"seconds": self.seconds, "max_diff_bytes": self.max_diff,
                "ranks": [asdict(r) | {"diff": r.diff} for r in self.ranks]}


def representative_ranks(spec: RunSpec) -> list[tuple[int, int, int]]:
    """(pp, dp, tp) of the ranks whose parameter sets differ: first, middle and last pipeline
    rank x first and last dp rank (uneven FSDP shards differ at the end), tp rank 0."""
    pps = sorted({0, spec.pp // 2, spec.pp - 1})
    dps = sorted({0, spec.dp - 1})
    return [(p, d, 0) for p in pps for d in dps]


def dry_run(spec: RunSpec, coords: Optional[list[tuple[int, int, int]]] = None) -> DryRun:
    """Build ``coords`` (default :func:`representative_ranks`) through the engine factory on a
    fake process group of ``spec.world_size`` ranks; compare parameter bytes with the cost model.

    Under context parallelism the engine is built as it runs (mesh (pp, dp, cp, tp), the dp
    wrappers over dp x cp) and the cost model's side is priced folded
    (:func:`xpar.estimate.context_parallel.fold_cp`): ``coords``' dp is then the index in the
    dp x cp replica group, dp' = dp cp + c, the rank at (pp, dp' // cp, c = dp' % cp, tp).

    Raises:
        PlanError: torch refused to build a rank's engine.
        RuntimeError: a process group is already initialised in this process.
    """
    import torch.distributed as dist

    from xpar.parallel.factory import build_engine  # lazy: torch (xpar.LAZY_IMPORTS)
    from xpar.parallel.mesh import build_mesh  # lazy: torch (xpar.LAZY_IMPORTS)

    if dist.is_initialized():
        raise RuntimeError("xpar.run.dryrun needs a process without a default process group")
    build_spec = buildable(replace(spec, device="cpu"))  # the mesh must be "cpu"; parameters stay on meta
    out, folded, cp = DryRun(), fold_cp(spec), spec.layout.cp
    t_all = time.perf_counter()
    for pp, dp, tp in coords or representative_ranks(folded):
        rank = spec.layout.rank(pp, dp // cp, tp, cp=dp % cp)
        t0 = time.perf_counter()
        hook = sys.excepthook  # init_process_group chains a "[rank r]:" prefix onto it
        dist.init_process_group("fake", rank=rank, world_size=spec.world_size, store=fake_store())
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                mesh = build_mesh("cpu", spec.pp, spec.dp, spec.tp, cp)
                engine = build_engine(build_spec, mesh, materialize_model=False)
            numel = _param_numel(engine.chunks, spec.layout.zero_stage)
        except Exception as e:  # torch's own refusal of the plan
            raise PlanError(
                f"the dry run could not build rank {rank} (pp={pp}, dp={dp}, tp={tp}) of {spec.world_size} through "
                f"the engine factory on a fake process group: {type(e).__name__}: {e}".rstrip()
                + "\n    torch refuses this layout as configured; the same error would stop a real run.") from e
        finally:
            dist.destroy_process_group()
            sys.excepthook = hook
        out.ranks.append(_rank_check(folded, rank, (pp, dp, tp), numel, time.perf_counter() - t0))
    out.seconds = time.perf_counter() - t_all
    return out


def _rank_check(folded: RunSpec, rank: int, coords: tuple[int, int, int], numel: tuple[int, int, int],
                build_s: float) -> RankCheck:
    """One rank's :class:`RankCheck` from its built ``numel`` (local, held, dp-unsharded elements,
    :func:`_param_numel`) against the cost model on the cp-folded spec ``folded``."""
    (pp, dp, tp), (local, held, dp_full) = coords, numel
    bp, bg, _ = STATE_BYTES[folded.train.dtype]
    # gradients as held during the step: shards under ZeRO-2/3 without pp; whole where the
    # dp reduction is deferred (pp: torch's PipelineStage; ZeRO-0/1: no_sync), the tp
    # embedding's Replicate gradient included (a meta build runs no backward: that part
    # is the cost model's rule, xpar.estimate.memory.per_device.replicated_embedding_grad_numel)
    if grads_deferred(folded):
        grads = dp_full + replicated_embedding_grad_numel(folded, pp)
    else:
        grads = local if folded.layout.zero_stage >= 2 else dp_full
    analytic = model_state_bytes_per_rank(folded, pp)[dp]
    return RankCheck(rank=rank, coords={"pp": pp, "dp": dp, "tp": tp}, local_numel=local,
                     dryrun={"params": held * bp, "grads": grads * bg},
                     analytic={"params": int(analytic["params"]), "grads": int(analytic["grads"])}, build_s=build_s)


def gap_note(spec: RunSpec, d: DryRun) -> Optional[str]:
    """The note of a dry run whose engine holds other parameter or gradient bytes than the cost model
    counts on a built rank (``d.max_diff`` > 0), naming the rank, both figures (bytes, in MiB/GiB) and, for
    experts under tp, why: the engine replicates each expert over the tp ranks
    (xpar.parallel.tensor.block_plan) where the estimate splits it over etp ranks as Megatron-Core's
    --expert-tensor-parallel-size does. None when every built rank agrees."""
    if not d.ranks or d.max_diff == 0:
        return None
    r = max(d.ranks, key=lambda r: r.diff)
    kind = max(r.dryrun, key=lambda k: abs(r.dryrun[k] - r.analytic[k]))
    why = ""
    if spec.model.n_experts and spec.layout.tp > 1 and spec.layout.expert_tp > 1:
        why = (f": xpar's engine replicates each expert over the tp={spec.layout.tp} ranks "
               f"(xpar.parallel.tensor.block_plan), the estimate splits it over etp={spec.layout.expert_tp} ranks as "
               f"Megatron-Core's expert tensor parallelism; the estimate's memory is not what run.mode=execute of "
               f"this layout holds")
    return (f"dry run: xpar's engine holds {format_bytes(r.dryrun[kind])} of {kind} on rank {r.rank} "
            f"(pp={r.coords['pp']}, dp={r.coords['dp']}, tp={r.coords['tp']}) where the estimate counts "
            f"{format_bytes(r.analytic[kind])} (estimate/dryrun_param_bytes_diff, dryrun.json){why}.")


DRY_RUN_MAX_WORLD = 131_072
"""Largest world size (2^17 ranks) the dry run builds: torch's ``init_device_mesh`` walks every rank of every mesh
dimension on each build (torch/distributed/device_mesh.py ``_init_process_groups``), a cost linear in the world size
(its times: docs/guides/estimate.md); above it the estimate is given without the dry run, with a note."""


def not_buildable(spec: RunSpec) -> Optional[str]:
    """Why the engine factory cannot build ``spec``'s layout for the dry run, or None where it can.

    The executed engine takes its ep groups inside dp x cp (xpar.parallel.expert.group_ranks); a
    layout whose ep exceeds dp x cp folds tp ranks into ep (MoE parallel folding, etp < tp: Liu et al.
    2025, arXiv 2504.14960; Megatron-Core's --expert-tensor-parallel-size), which xpar estimates but does not
    run (xpar.config.checks.layout.check_ep). Such a layout trained (e.g. DeepSeek-V3 on 512 H100 at tp 2,
    ep 64, dp 32: NVIDIA/dgxc-benchmarking deepseek_v3/pretraining/README.md @1f6d9f4); its dry run is
    skipped rather than reported as torch's refusal. Above :data:`DRY_RUN_MAX_WORLD` ranks it is skipped too (8
    million ranks took minutes in torch's mesh and looked like a hang)."""
    if spec.world_size > DRY_RUN_MAX_WORLD:
        return (f"dry run skipped: {spec.world_size:,} ranks, above the {DRY_RUN_MAX_WORLD:,} it builds (torch's device "
                f"mesh of fake ranks takes time linear in them, minutes at millions); the estimate stands on the cost "
                f"model alone.")
    dp_cp = spec.layout.dp * spec.layout.cp
    if spec.layout.ep > dp_cp:
        return (f"dry run skipped: ep={spec.layout.ep} over tp x cp x dp (etp={spec.layout.expert_tp} < "
                f"tp={spec.layout.tp}, MoE parallel folding) is estimated only; the executed engine takes ep inside "
                f"dp x cp = {dp_cp}, so no rank of this layout can be built to check its parameter bytes.")
    return None


def buildable(spec: RunSpec) -> RunSpec:
    """The spec the dry run builds: an estimate-only schedule (zb_h1, zb_h2: one stage per rank, no
    torch class) as 1F1B, train.dtype=fp8 as bf16 (bf16 storage: the same wrappers and parameters).
    Context parallelism is built as it runs (xpar.parallel.context): its micro-batch stays whole
    (a folded b / cp could be fractional, which a pipeline stage's shapes cannot take). A recompute policy xpar
    estimates only (xpar.config.remat.Policy.executes) as none: it moves no parameter. A micro-batch count torch's
    schedule class refuses but the framework runs (framework.microbatch_rule=megatron: 1F1B with m < pp) as the
    fewest torch takes: the count moves no parameter either."""
    lay = spec.layout
    rec = SCHEDULES[lay.schedule]
    rule = getattr(spec.framework, "microbatch_rule", "torch")
    if rec.executable and microbatch_ok(lay.schedule, lay.pp, lay.micro_batches, rule) \
            and not rec.microbatches_ok(lay.pp, lay.micro_batches):
        m = next(k for k in range(lay.micro_batches, lay.micro_batches + 4 * lay.pp * lay.pp + 1)
                 if rec.microbatches_ok(lay.pp, k))
        spec = replace(spec, layout=replace(lay, micro_batches=m))
    if spec.train.dtype == "fp8":
        spec = replace(spec, train=replace(spec.train, dtype="bf16"))
    if spec.layout.recompute in POLICIES and not POLICIES[spec.layout.recompute].executes:
        spec = replace(spec, layout=replace(spec.layout, recompute="none"))
    if SCHEDULES[spec.layout.schedule].executable:
        return spec
    return replace(spec, layout=replace(spec.layout, schedule="1f1b"))


def _param_numel(chunks, zero_stage: int) -> tuple[int, int, int]:
    """(local storage elements, elements held during the step, dp-unsharded elements) of this
    rank's parameters. Held = local, except ZeRO-2 (FSDP2 reshard_after_forward=False), which
    holds each parameter unsharded along dp from forward to backward -- as xpar.parallel.memory_accounting
    counts it. dp-unsharded: the whole parameters (still tp-sharded)."""
    from xpar.parallel.memory_accounting import dp_full_param_bytes  # lazy: torch (xpar.LAZY_IMPORTS)

    local = held = dp_full = 0
    for p in (p for c in chunks for p in c.parameters()):
        n = p.to_local().numel() if hasattr(p, "to_local") else p.numel()
        full = dp_full_param_bytes(p) // p.element_size()
        local += n
        dp_full += full
        held += full if zero_stage == 2 else n
    return local, held, dp_full
