"""Checks of the framework profile (conf/framework/): choices and ranges. Returns violations."""
from __future__ import annotations

import math

from omegaconf import OmegaConf

from xpar.config.attention import KV_OVER_TP
from xpar.config.layout import MICROBATCH_RULES, SCHEDULES
from xpar.config.presets import conf_dir, load_preset
from xpar.config.schema import FrameworkConfig
from xpar.config.remat import RECOMPUTE, SELECTIVE_POLICIES

CHOICES = {
    "zero1": ("zero_redundancy", "distributed_optimizer"),
    "bucket_rule": ("fixed", "megatron_core"),  # xpar.estimate.comm.dp.BUCKET_RULES
    "dp_collective": ("nccl", "ring", "tree", "hierarchical"),  # xpar.estimate.comm.collectives.ALGORITHMS
    "fsdp_copies": ("fsdp2", "fsdp1", "none"),  # xpar.estimate.comm.dp.FSDP_COPIES
    "selective_recompute": SELECTIVE_POLICIES,  # xpar.config.remat
    "param_storage": ("fp32", "bf16"),
    "loss_kernel": ("fp32", "fused"),  # xpar.estimate.memory.per_device.MemoryOptions.loss_kernel
    "ep_dispatcher": ("alltoall", "deepep", "hybridep", "ragged"),  # xpar.estimate.moe_dispatch.DISPATCHERS
    "moe_scatter": ("fused", "atomic"),  # xpar.estimate.moe_dispatch.SCATTERS
    "expert_gemm_kernel": ("dense", "torch_grouped_mm"),  # xpar.estimate.compute.kernels.EXPERT_GEMM_KERNELS
    "expert_bias_add": ("fused", "split"),  # xpar.estimate.compute.kernel_block.split_bias_bytes
    "microbatch_rule": MICROBATCH_RULES,
    "kv_heads_over_tp": KV_OVER_TP,  # xpar.config.attention.tp_kv_heads
    "cp_comm": ("all_gather", "p2p", "a2a"),  # xpar.estimate.cp_exchange.CP_COMM_TYPES
    "attention_kernel": ("fa3", "cudnn", "cudnn_2024", "fa2", "sdpa"),
    "fp8_cast_kernels": ("te", "fused"),  # xpar.estimate.compute.fp8_recipes.quantiser  # xpar.estimate.compute.kernel_costs.ATTENTION_KERNELS
    "cp_attention_merge": (None, "bf16", "fp32"),  # xpar.estimate.cp_attention.MERGE_BYTES
    "zero3_gather": ("unit", "tensor"),  # xpar.estimate.memory.per_device.state_buffer_terms  # xpar.estimate.expert_parallel.ep_layer_times
}
FRACTIONS = ("tp_overlap", "pp_overlap", "ep_a2a_overlap", "overlap_slowdown", "recompute_layer_fraction",
             "tp_overlap_across_nodes")
NON_NEGATIVE = ("layer_overhead_ms", "host_op_us", "zero3_host_ops_per_rank", "zero3_reduce_host_ops_per_rank",
                "zero3_persist_numel", "zero3_reuse_distance", "zero3_persist_host_ops_per_rank", "expert_gemm_call_us")


def check_framework(fw: FrameworkConfig) -> list[str]:
    """Each choice among its values, each share in [0, 1], counts and times not negative, gradient bytes 2 or 4 (held: also 6), optimizer bytes 0 or 2-16."""
    out = [f"framework.{k}={getattr(fw, k)!r} is not one of {', '.join(map(_yaml, v))}; e.g. framework.{k}={_yaml(v[0])}."
           for k, v in CHOICES.items() if getattr(fw, k) not in v]
    out += [f"framework.{k}={getattr(fw, k)} must be between 0 and 1." for k in FRACTIONS
            if not 0.0 <= getattr(fw, k) <= 1.0]
    out += [f"framework.{k}={getattr(fw, k)} must be a finite number, 0 or more; e.g. framework.{k}=0." for k in NON_NEGATIVE
            if getattr(fw, k) is not None and not (math.isfinite(getattr(fw, k)) and getattr(fw, k) >= 0)]
    out += [f"framework.grad_reduce_bytes={fw.grad_reduce_bytes} must be 2 or 4 (bytes per gradient element)."
            for _ in [0] if fw.grad_reduce_bytes not in (2, 4)]
    out += [f"framework.grad_bytes={fw.grad_bytes} must be 2, 4 or 6 (bytes per held gradient element; 6: bf16 "
            f"gradients and an unsharded fp32 accumulation buffer)." for _ in [0] if fw.grad_bytes not in (2, 4, 6)]
    out += [f"framework.optimizer_bytes={fw.optimizer_bytes} must be 0 (the precision recipe's) or bytes per optimizer-state "
            f"element, master copy included, 2 to 16; e.g. framework.optimizer_bytes=12 (fp32 master and Adam moments)."
            for _ in [0] if fw.optimizer_bytes != 0 and not 2 <= fw.optimizer_bytes <= 16]
    k = fw.make_vocab_size_divisible_by
    out += [f"framework.make_vocab_size_divisible_by={k} must be a whole number >= 1 or null (no padding); e.g. "
            f"framework.make_vocab_size_divisible_by=128 (Megatron-LM's default)." for _ in [0]
            if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1)]
    return (out + offload_problems(fw) + recompute_list_problems(fw) + pp_overlap_schedule_problems(fw) + etp_problems(fw)
            + plan_schedule_problems(fw))


def _yaml(value) -> str:
    """A choice as a command line types it (None: null)."""
    return "null" if value is None else str(value)


def etp_problems(fw: FrameworkConfig) -> list[str]:
    """framework.etp_degrees null or a non-empty list of whole numbers >= 0 (0: etp = tp)."""
    listed = getattr(fw, "etp_degrees", None)
    if listed is None or (list(listed) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                                               for x in listed)):
        return []
    return [f"framework.etp_degrees={hydra_text(list(listed))} must be a non-empty list of whole numbers >= 0 "
            f"(0: etp = tp); e.g. framework.etp_degrees=[0, 1], or null (etp = tp only)."]


def pp_overlap_schedule_problems(fw: FrameworkConfig) -> list[str]:
    """framework.pp_overlap_schedules and ep_a2a_overlap_schedules: each null or a list of schedule names
    (xpar.config.layout.SCHEDULES)."""
    out = []
    for key, eg in (("pp_overlap_schedules", "interleaved_1f1b"), ("ep_a2a_overlap_schedules", "dualpipev")):
        listed = getattr(fw, key, None)
        bad = [s for s in (listed or []) if s not in SCHEDULES]
        out += [f"framework.{key}={hydra_text(list(listed))}: {hydra_text(bad)} not a schedule; values that work: "
                f"{hydra_text(list(SCHEDULES))}, e.g. framework.{key}=[{eg}], or null (every schedule)."] if bad else []
    return out


def plan_schedule_problems(fw: FrameworkConfig) -> list[str]:
    """framework.plan_schedules null or a non-empty list of schedules the framework runs (framework.schedules)."""
    listed = getattr(fw, "plan_schedules", None)
    if listed is None:
        return []
    runs = list(fw.schedules or SCHEDULES)
    bad = [s for s in listed if s not in runs]
    if bad or not list(listed):
        return [f"framework.plan_schedules={hydra_text(list(listed))}: {hydra_text(bad) if bad else 'empty'} not in "
                f"framework.schedules={hydra_text(runs)}; values that work: a non-empty subset of those, e.g. "
                f"framework.plan_schedules=[{runs[0]}], or null (all of them)."]
    return []


def recompute_list_problems(fw: FrameworkConfig) -> list[str]:
    """framework.recompute null or a non-empty list of policies (xpar.config.remat.RECOMPUTE)."""
    if fw.recompute is None:
        return []
    bad = [p for p in fw.recompute if p not in RECOMPUTE]
    if bad or not list(fw.recompute):
        return [f"framework.recompute={hydra_text(list(fw.recompute))}: {hydra_text(bad) if bad else 'empty'} not a "
                f"recompute policy; values that work: {hydra_text(list(RECOMPUTE))}, "
                f"e.g. framework.recompute=[none, full]."]
    return []


def check_framework_layout(fw: FrameworkConfig, zero_stage: int, pp: int, schedule: str, m: int = 1,
                           sp: bool = False, tp: int = 1, cp: int = 1, ep: int = 1,
                           layer_split: tuple = (), dp: int = 2, moe: bool = False, suggest: bool = True) -> list[str]:
    """The layout among what ``framework.name`` runs (its profile's fields, as ``xpar plan`` reads
    them): parallel.zero_stage in framework.zero_stages (framework.pp_zero_stages with pp > 1),
    parallel.schedule in framework.schedules with pp > 1, an interleaved schedule at pp >=
    framework.interleaved_min_pp and, with framework.interleaved_m_per_pp, m divisible by pp
    (Megatron-LM), sequence parallelism in framework.sequence_parallel, pp, tp, cp and ep up to framework.max_pp,
    max_tp (framework.moe_max_tp too for a model with experts, ``moe``), max_cp and max_ep, and with
    framework.even_layer_split an even ``layer_split`` (blocks per stage), with framework.ddp_alone ZeRO-0 at dp > 1
    beside no other parallelism, with framework.tp_ep_needs_sp sp wherever tp > 1 and ep > 1. The ZeRO stage is not checked at dp = 1
    (nothing is sharded: every stage runs the same). One line each, with the nearest that works (e.g.
    framework=deepspeed: no ZeRO-2/3 under pp, 1F1B only; framework=llmfoundry: FSDP only, no pp or tp)."""
    layout = dict(zero_stage=zero_stage, pp=pp, schedule=schedule, m=m, sp=sp, tp=tp, cp=cp, ep=ep,
                  layer_split=layer_split, dp=dp, moe=moe)
    degrees = _degree_problem(fw, layout, suggest)
    if degrees:
        return degrees  # the pipeline rules below would name a layout it does not run at all
    out = []
    stages = sorted(fw.pp_zero_stages if pp > 1 else fw.zero_stages)
    if stages and zero_stage not in stages and dp > 1:
        key, under = ("pp_zero_stages", " with pp > 1") if pp > 1 else ("zero_stages", "")
        near = max((z for z in stages if z <= zero_stage), default=stages[0])
        out.append(f"framework={fw.name} does not run parallel.zero_stage={zero_stage}{under} (framework.{key}="
                   f"{hydra_text(stages)}); e.g. parallel.zero_stage={near}, or framework=xpar (runs every stage).")
    out += _pairing_problems(fw, layout, stages)
    if pp > 1 and fw.schedules and schedule not in fw.schedules:
        first = fw.schedules[0]
        fix = f"parallel.schedule={first} parallel.virtual_stages={SCHEDULES[first].default_virtual_stages()}"
        others = [n for n in frameworks_running(schedule) if n != fw.name]
        alt = f", or framework={others[0]} (it runs {schedule})" if others else ""
        out.append(f"framework={fw.name} does not run parallel.schedule={schedule} (framework.schedules="
                   f"{hydra_text(list(fw.schedules))}); e.g. {fix}{alt}.")
    if pp > 1 and schedule == "interleaved_1f1b":
        out += _interleaved_problems(fw, pp, m)
    if sp not in list(fw.sequence_parallel) and (sp or tp > 1):  # tp 1: nothing to shard, sp false runs anywhere
        out.append(f"framework={fw.name} does not run parallel.sequence_parallel={hydra_text(sp)} (framework."
                   f"sequence_parallel={hydra_text(list(fw.sequence_parallel))}); e.g. parallel.sequence_parallel="
                   f"{hydra_text(fw.sequence_parallel[0])}, or framework=xpar.")
    return out + _even_split_problem(fw, layer_split)


def _pairing_problems(fw: FrameworkConfig, layout: dict, stages: list) -> list[str]:
    """Degrees a profile runs only together: ZeRO-0 at dp > 1 alone (framework.ddp_alone), tp > 1 with ep > 1 only
    with sequence parallelism (framework.tp_ep_needs_sp)."""
    tp, pp, cp, ep, dp, sp = (layout[k] for k in ("tp", "pp", "cp", "ep", "dp", "sp"))
    out = []
    if fw.ddp_alone and layout["zero_stage"] == 0 and dp > 1 and tp * pp * cp * ep > 1:
        out.append(_ddp_alone_line(fw.name, stages, tp=tp, pp=pp, cp=cp, ep=ep))
    if fw.tp_ep_needs_sp and tp > 1 and ep > 1 and not sp:
        out.append(f"framework={fw.name} does not run parallel.tp={tp} with parallel.ep={ep} without sequence "
                   f"parallelism (framework.tp_ep_needs_sp); e.g. parallel.sequence_parallel=true, or framework=xpar.")
    return out


def _ddp_alone_line(name: str, stages: list, **degrees: int) -> str:
    """ZeRO-0 at dp > 1 beside other parallelism under framework.ddp_alone (torchtitan: DDP on a 1-D mesh only)."""
    given = " ".join(f"{k}={v}" for k, v in degrees.items())
    return (f"framework={name} does not run parallel.zero_stage=0 (DDP) at dp > 1 beside other parallelism "
            f"(framework.ddp_alone: DDP on a 1-D device mesh only), got {given}; e.g. parallel.zero_stage="
            f"{min((z for z in stages if z > 0), default=3)} (FSDP), or framework=xpar.")


def _even_split_problem(fw: FrameworkConfig, layer_split: tuple) -> list[str]:
    """Blocks per stage unequal under framework.even_layer_split (Megatron-LM 2021-22: n_layers divisible by pp x v)."""
    if not fw.even_layer_split or len(set(layer_split)) <= 1:
        return []
    n, stages = sum(layer_split), len(layer_split)
    even = [d for d in range(stages, 0, -1) if n % d == 0][0]
    return [f"framework={fw.name} splits the layers evenly over the pipeline stages only (framework.even_layer_split), "
            f"got {n} blocks over {stages} stages as {hydra_text(list(layer_split))}; e.g. pp x virtual_stages "
            f"dividing {n} (such as {even} stages), or framework=megatron (lighter first and last stages)."]


def _degree_problem(fw: FrameworkConfig, layout: dict, suggest: bool = True) -> list[str]:
    """pp, tp, cp or ep of ``layout`` (check_framework_layout's arguments) above framework.max_pp, max_tp (moe_max_tp
    for a model with experts), max_cp or max_ep: one line naming the framework, the degrees that work and (with
    ``suggest``) a profile that runs the whole layout given (torchtitan first, else xpar)."""
    pp, tp, cp, ep, moe = (layout[k] for k in ("pp", "tp", "cp", "ep", "moe"))
    moe_tp = moe and fw.moe_max_tp is not None and (fw.max_tp is None or fw.moe_max_tp < fw.max_tp)
    max_tp = fw.moe_max_tp if moe_tp else fw.max_tp
    over = [(k, v, lim) for k, v, lim in (("pp", pp, fw.max_pp), ("tp", tp, max_tp), ("cp", cp, fw.max_cp),
                                          ("ep", ep, fw.max_ep)) if lim is not None and v > lim]
    if not over:
        return []
    given = " and ".join(f"parallel.{k}={v}" for k, v, _ in over)
    limits = ", ".join(f"framework.{'moe_' if k == 'tp' and moe_tp else ''}max_{k}={lim}"
                       + (" for a model with experts" if k == "tp" and moe_tp else "") for k, _, lim in over)
    fix = " ".join(f"parallel.{k}={lim}" for k, _, lim in over)
    others = sorted((n for n in frameworks_running(layout["schedule"]) if n not in (fw.name, "xpar")),
                    key=lambda n: n != "torchtitan")  # torchtitan: torch's FSDP with tp and pp
    other = next((n for n in others if suggest and _runs_layout(n, layout)), "xpar")
    return [f"framework={fw.name} does not run {given} ({limits}: the layouts it runs); e.g. {fix} "
            f"parallel.dp=auto parallel.micro_batches=auto (more data parallelism, ZeRO via parallel.zero_stage), "
            f"or framework={other} (it runs {given})."]


def _runs_layout(name: str, layout: dict) -> bool:
    """Whether profile ``name`` (conf/framework/<name>.yaml) runs ``layout`` whole: its ZeRO stage, sequence
    parallelism and schedule too (torchtitan: DDP alone, sp with tp), not only the degrees."""
    fw = FrameworkConfig(**OmegaConf.to_container(load_preset("framework", name), resolve=True))
    return not check_framework_layout(fw, suggest=False, **layout)


def frameworks_running(schedule: str) -> list[str]:
    """The framework profiles (conf/framework/*.yaml) whose ``schedules`` list ``schedule``, xpar first, then
    those whose ``plan_schedules`` (their usual ones) include it."""
    names, secondary = [], set()
    for path in sorted((conf_dir() / "framework").glob("*.yaml")):
        profile = OmegaConf.load(path)
        listed, usual = profile.get("schedules"), profile.get("plan_schedules")
        if schedule in (FrameworkConfig().schedules if listed is None else list(listed)):
            names.append(path.stem)
            if usual is not None and schedule not in list(usual):
                secondary.add(path.stem)
    return sorted(names, key=lambda n: (n != "xpar", n in secondary))


def _interleaved_problems(fw: FrameworkConfig, pp: int, m: int) -> list[str]:
    """Megatron-LM's rules of its interleaved 1F1B (framework.interleaved_min_pp, interleaved_m_per_pp)."""
    if pp < fw.interleaved_min_pp:
        return [f"framework={fw.name} runs interleaved_1f1b only at pp >= {fw.interleaved_min_pp} "
                f"(framework.interleaved_min_pp), got parallel.pp={pp}; e.g. parallel.schedule=1f1b "
                f"parallel.virtual_stages=1, or framework=xpar."]
    if fw.interleaved_m_per_pp and m % pp:
        near = sorted({max(pp, m - m % pp), m - m % pp + pp})
        return [f"framework={fw.name} runs interleaved_1f1b with micro-batches divisible by pp={pp} "
                f"(framework.interleaved_m_per_pp), got {m}; micro-batch counts that work: {near}, "
                f"e.g. parallel.micro_batches={near[0]}, or framework=xpar."]
    return []


def not_booleans(values) -> list:
    """The entries of ``values`` that are not booleans (a list option of booleans: framework.offload,
    plan.offload, plan.sequence_parallel); 'maybe' or 1 are not."""
    return [v for v in values if not isinstance(v, bool)]


def hydra_text(value) -> str:
    """A value as written on the command line (booleans lower-case: [false, true])."""
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(hydra_text(v) for v in value) + "]"
    return str(value).lower() if isinstance(value, bool) else str(value)


def offload_problems(fw: FrameworkConfig) -> list[str]:
    """framework.offload a non-empty list of booleans; framework.cpu_offload_optimizer=true only
    where the profile runs offload (true in framework.offload: megatron and torchtitan do not)."""
    given = list(fw.offload) if isinstance(fw.offload, (list, tuple)) else [fw.offload]
    bad = not_booleans(given)
    if bad or not given:
        return [f"framework.offload={hydra_text(given)}: {hydra_text(bad) if bad else 'empty'} not allowed; it lists "
                f"the optimizer offload choices the framework runs, booleans; values that work: [false], [true], "
                f"[false, true]; e.g. framework.offload=[false,true]."]
    if fw.cpu_offload_optimizer and True not in given:
        return [f"framework.cpu_offload_optimizer=true, but framework={fw.name} runs no optimizer offload "
                f"(framework.offload={hydra_text(given)}); e.g. framework.cpu_offload_optimizer=false, or a profile that "
                f"runs it (framework=deepspeed or framework=xpar, at parallel.zero_stage >= 1)."]
    return []
