"""What ``xpar plan`` is asked: the composed config's groups as a :class:`PlanContext`, the
``plan.*`` constraints resolved and checked (each violation one line: the constraint, the values
given, values that work), and the device counts to search."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any, Optional

from xpar.config.checks import config as checks
from xpar.config.checks.environment import check_hardware_values
from xpar.config.checks.framework import check_framework, hydra_text, not_booleans
from xpar.config.hardware import is_this_machine, resolve_hardware
from xpar.config.layout import SCHEDULES
from xpar.config.overrides import refuse
from xpar.config.presets import conf_dir, load_preset
from xpar.config.remat import model_policies
from xpar.config.schema import HardwareConfig
from xpar.config.validate import fp8_recipe_problems, to_schema
from xpar.estimate.memory.offload import offload_figures_known
from xpar.plan.axes import resolve_axes
from xpar.plan.context import PlanContext
from xpar.plan.space import Constraints, PLAN_RECOMPUTE, RECOMPUTE, ZERO_STAGES, batch_values

GPU_HEADROOM = 0.08
"""Fraction of a GPU's memory a plan keeps free by default (plan.memory_headroom null and no
hardware.memory_headroom): the memory model's own error, beyond the CUDA context, workspaces and allocator
slack that ``hardware.framework_overhead_gb`` counts. On the published peaks of benchmarks/memory_published.py
the estimate is below the published figure in 13 of 23, by 0.4-12.6 % (median 7 %). 8 % is 6.4 GB of an 80 GB
device: docs/guides/plan.md (the trade-off against published layouts near the device's size)."""

TOKENS_PER_BATCH = 2 ** 22
"""Default global batch in tokens (4M: Llama 2 and Llama 3 pre-training; GPT-3 175B used 3.2M,
Brown et al. 2020 Table 2.1)."""


@dataclass(frozen=True)
class PlanInputs:
    """A checked plan request. ``ctx``: the context at ``device_counts[0]`` devices (its
    hardware carries the user's memory headroom); ``overrides``: the user's command-line
    overrides (for the reproducing command line)."""

    ctx: PlanContext
    constraints: Constraints
    device_counts: tuple[int, ...]
    min_tokens_per_s: Optional[float]
    top_k: int
    execute_top: int
    overrides: tuple[str, ...] = ()
    tie_within: float = 0.05

    @property
    def devices_per_node(self) -> int:
        return int(self.ctx.hardware["devices_per_node"])

    def at(self, devices: int) -> PlanContext:
        """The context on ``devices`` devices: whole nodes of the preset, or one node holding
        ``devices`` when fewer than a node."""
        n = self.devices_per_node
        hw = dict(self.ctx.hardware, nodes=devices // n) if devices >= n else \
            dict(self.ctx.hardware, nodes=1, devices_per_node=devices)
        return replace(self.ctx, hardware=hw)


def memory_headroom(given: Optional[float], hw: dict) -> float:
    """The plan's memory headroom: plan.memory_headroom where given, else hardware.memory_headroom where it
    is above 0, else :data:`GPU_HEADROOM` on a GPU (hardware.device cuda) and 0 on a CPU."""
    if given is not None:
        return float(given)
    own = float(hw.get("memory_headroom") or 0.0)
    return own if own > 0 or hw.get("device", "cuda") != "cuda" else GPU_HEADROOM


def _plain(node) -> Any:
    from omegaconf import OmegaConf
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node


def _hardware(cfg) -> dict:
    """The hardware group; 'local' resolved (device count, memory, measured peak: imports torch)."""
    hw = _plain(cfg.hardware)
    if not is_this_machine(hw):
        return hw
    return asdict(resolve_hardware(HardwareConfig(**hw), threads=cfg.train.threads_per_worker or 1))


def _range(value, key: str) -> tuple[Optional[tuple[int, int]], list[str]]:
    """(lo, hi) of a number or a [lo, hi] list, or a problem line."""
    vals = list(value) if isinstance(value, (list, tuple)) else [value]
    ok = len(vals) in (1, 2) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in vals)
    if not ok or vals[0] > vals[-1]:
        lo, hi = (vals[-1], vals[0]) if ok else (1024, 2048)  # [512, 8]: the same range, in order
        also = " plan.min_tokens_per_s=100000" if key == "plan.devices" else ""  # a device range searches for it
        single = f"{key}={hi} or " if not ok else ""
        return None, [f"{key}={value} must be a whole number >= 1 or a range [lo, hi] with 1 <= lo <= hi; "
                      f"e.g. {single}{key}=[{lo},{hi}]{also}."]
    return (vals[0], vals[-1]), []


def global_batch(cfg, devices: int, seq_len: int, local: bool) -> tuple[Optional[tuple[int, int]], list[str]]:
    """plan.global_batch_size resolved to (lo, hi) sequences (see PlanConfig's doc)."""
    value = cfg.plan.global_batch_size
    if value == "auto":
        if isinstance(cfg.train.global_batch_size, int):
            value = cfg.train.global_batch_size
        elif stated := stated_global_batch(cfg, devices):
            value = stated
        elif local:
            value = devices * cfg.train.micro_batch_size
        else:
            value = max(devices, 2 ** round(math.log2(TOKENS_PER_BATCH / seq_len)))
    return _range(_plain(value), "plan.global_batch_size")


def auto_batch_notes(cfg, inputs: PlanInputs) -> list[str]:
    """A note where ``plan.global_batch_size=auto`` gave one sequence per device on a cluster past the default of
    :data:`TOKENS_PER_BATCH` (4M tokens): at 100,000 H100s a 7B plan ran at 100,000 sequences of 4,096 tokens (410M
    tokens per step) and its title said 'global batch 100000' only. [] for one stated batch, a range of device
    counts, hardware=local, or a cluster whose default batch has a sequence for every device."""
    seq, devices = int(inputs.ctx.train["seq_len"]), inputs.device_counts[0]
    lo, hi = inputs.constraints.global_batch
    default = 2 ** round(math.log2(TOKENS_PER_BATCH / seq))
    if (cfg.plan.global_batch_size != "auto" or len(inputs.device_counts) > 1 or lo != hi or lo != devices
            or devices <= default or is_this_machine(inputs.ctx.hardware)
            or isinstance(cfg.train.global_batch_size, int) or stated_global_batch(cfg, devices)):
        return []
    return [f"global batch: plan.global_batch_size=auto gave {devices:,} sequences of {seq:,} tokens "
            f"({devices * seq / 1e6:,.1f}M tokens per step), one per device: the 4M-token default ({default:,} sequences, "
            f"Llama 2 and 3 pre-training) would leave devices idle; the figures rest on that batch: set "
            f"plan.global_batch_size=<sequences> for the batch you train with."]


def stated_global_batch(cfg, devices: int) -> Optional[int]:
    """The global batch (sequences) a command's layout fixes: micro-batch size x parallel.micro_batches x dp where
    the micro-batch count is a number (a cluster preset's, e.g. 120 x 128 = 15,360 for DeepSeek-V3 on 2048 H800);
    dp auto = devices / (tp pp cp). None where the layout leaves the batch open (micro_batches auto) or dp does not
    come out whole."""
    par = cfg.parallel
    if not isinstance(par.micro_batches, int) or not isinstance(cfg.train.micro_batch_size, int):
        return None
    model_parallel = par.tp * par.pp * (par.cp or 1)
    dp = par.dp if isinstance(par.dp, int) else (devices // model_parallel if devices % model_parallel == 0 else 0)
    return cfg.train.micro_batch_size * par.micro_batches * dp if dp > 0 else None


def _choice_problems(p, framework: dict) -> list[str]:
    """Allowed schedules, ZeRO stages (within the framework's) and recompute policies."""
    out = []
    runs = list(framework.get("zero_stages", ZERO_STAGES))
    scheds = list(framework.get("schedules", SCHEDULES))
    offload = [bool(x) for x in framework.get("offload", [False])]
    policies = list(framework.get("recompute") or RECOMPUTE)
    for key, given, valid in (("schedules", p.schedules, scheds), ("zero_stages", p.zero_stages, runs),
                              ("recompute", p.recompute, policies),
                              ("sequence_parallel", p.sequence_parallel,
                               [bool(x) for x in framework.get("sequence_parallel", [False, True])]),
                              ("offload", p.offload, offload)):
        boolean = key in ("sequence_parallel", "offload")  # 'maybe' or 1 are not booleans
        bad = [v for v in (given or []) if v not in valid or (boolean and not_booleans([v]))]
        if given is not None and (bad or not given):
            why = {"zero_stages": f" (framework={framework.get('name')} runs ZeRO stages {runs})",
                   "schedules": f" (framework={framework.get('name')} runs schedules {scheds})",
                   "sequence_parallel": f" (framework={framework.get('name')} runs sequence parallelism "
                                        f"{_hydra([bool(x) for x in framework.get('sequence_parallel', [False, True])])})",
                   "offload": f" (framework={framework.get('name')} runs optimizer offload {_hydra(offload)})",
                   "recompute": f" (framework={framework.get('name')} runs recompute {_hydra(policies)})"
                   if framework.get("recompute") else ""}.get(key, "")
            out.append(f"plan.{key}={_hydra(list(given))}: {_hydra(bad) if bad else 'empty'} not allowed{why}; "
                       f"values that work: {_hydra(valid)}, e.g. plan.{key}=[{_hydra(valid[0])}].")
    return out


_hydra = hydra_text


def _number_problems(p, local: bool) -> list[str]:
    out = [f"plan.{k}={getattr(p, k)} must be >= 1 (or null); e.g. plan.{k}=8." for k in ("max_tp", "pp")
           if getattr(p, k) is not None and getattr(p, k) < 1]
    out += [f"plan.{k}={getattr(p, k)} must be >= {lo}; e.g. plan.{k}={eg}."
            for k, lo, eg in (("max_micro_batch_size", 1, 8), ("top_k", 1, 10), ("execute_top", 0, 3 if local else 0))
            if getattr(p, k) < lo]
    if not 0 <= p.tie_within < 1:
        out.append(f"plan.tie_within={p.tie_within} must be a fraction in [0, 1); e.g. plan.tie_within=0.05.")
    if p.memory_headroom is not None and not 0 <= p.memory_headroom < 1:
        out.append(f"plan.memory_headroom={p.memory_headroom} must be in [0, 1); e.g. plan.memory_headroom=0.05.")
    if p.min_tokens_per_s is not None and not 0 < p.min_tokens_per_s < math.inf:
        out.append(f"plan.min_tokens_per_s={p.min_tokens_per_s} must be > 0 tokens/s and finite; e.g. "
                   f"plan.min_tokens_per_s=10000.")
    if p.execute_top > 0 and not local:
        out.append(f"plan.execute_top={p.execute_top} runs layouts for real, which needs hardware=local; "
                   f"e.g. hardware=local plan.execute_top={p.execute_top}, or plan.execute_top=0.")
    return out


def _request_problems(cfg) -> list[str]:
    """Constraints that would be silently ignored: min_tokens_per_s without a device range,
    execute_top without tracking (the comparison reads the sweep's runs back from MLflow), and
    parallel.activation_offload_layers under a framework that does not run it (xpar.plan.offload_fit searches it
    where the framework does: the fewest blocks that fit, for layouts that do not fit without)."""
    p, out = cfg.plan, []
    if p.min_tokens_per_s is not None and (p.devices is None or len(set(_plain_list(p.devices))) < 2):
        out.append(f"plan.min_tokens_per_s={p.min_tokens_per_s} picks the smallest cluster of a range of "
                   f"plan.devices, but none is given; e.g. plan.devices=[8,512], or drop plan.min_tokens_per_s.")
    offload = cfg.parallel.get("activation_offload_layers") if "parallel" in cfg else None
    if offload and not cfg.framework.get("activation_offload"):  # searched where the framework runs it (offload_fit)
        out.append(f"parallel.activation_offload_layers={offload}: framework={cfg.framework.name} runs no activation "
                   f"offload (framework.activation_offload=false), so xpar plan does not search it; drop "
                   f"parallel.activation_offload_layers, or framework=megatron_core.")
    if p.execute_top > 0 and not cfg.tracking.enabled:
        out.append(f"plan.execute_top={p.execute_top} compares the runs it records in MLflow, and tracking is "
                   f"off; drop tracking=off, or plan.execute_top=0.")
    return out


def _plain_list(value) -> list:
    v = _plain(value)
    return list(v) if isinstance(v, (list, tuple)) else [v]


def _devices(p, hw: dict) -> tuple[tuple[int, ...], list[str]]:
    """Device counts to search: the preset's, plan.devices (whole nodes), or a range's whole-node counts."""
    n = int(hw["devices_per_node"])
    if p.devices is None:
        return (n * int(hw["nodes"]),), []
    span, bad = _range(_plain(p.devices), "plan.devices")
    if bad:
        return (), bad
    counts = tuple(d for d in batch_values(*span) if d % n == 0)  # whole nodes: a command line runs whole nodes
    if span[0] == span[1] and span[0] % n:
        d, lo = span[0], max(n, span[0] // n * n)
        devices = "device" if d == 1 else "devices"
        fix = (f"plan.devices={n}, or nodes of {d} {devices}: hardware.devices_per_node={d} plan.devices={d}" if d < n
               else f"plan.devices={lo} or plan.devices={lo + n}")
        return (), [f"plan.devices={d} is not a whole number of hardware={hw['name']}'s {n}-device nodes: a plan "
                    f"runs on whole nodes (hardware.nodes); e.g. {fix}."]
    if span[0] != span[1] and p.min_tokens_per_s is None:
        return (), [f"plan.devices={list(span)} is a range: give plan.min_tokens_per_s (the smallest cluster "
                    f"reaching it is searched), e.g. plan.min_tokens_per_s=100000, or one device count."]
    if not counts:
        return (), [f"plan.devices={list(span)} holds no whole-node count of {n}-device nodes; e.g. "
                    f"plan.devices=[{n},{8 * n}]."]
    return counts, []


def config_problems(cfg) -> list[str]:
    """The run's own checks that a plan rests on (as ``python -m xpar`` refuses them): choices,
    model sizes, hardware values, the framework profile, the sequence length, the FP8 recipe where fp8 is
    searched (plan.dtype, else train.dtype)."""
    c = to_schema(cfg)
    out = checks.check_choices(c) + checks.check_model(c) + check_hardware_values(c) + check_framework(c.framework)
    if not out:
        fp8 = "fp8" in (_plain_list(cfg.plan.dtype) if cfg.plan.dtype else [c.train.dtype])
        out = fp8_recipe_problems("fp8" if fp8 else c.train.dtype, c.train.fp8_recipe, c.hardware)
    return out or [p for p in checks.check_train(c) if p.startswith("train.seq_len")]


def plan_inputs(cfg, overrides: Optional[list[str]] = None) -> tuple[Optional[PlanInputs], list[str]]:
    """The checked request of a composed config (``run.mode=plan``), or the problem lines.
    ``overrides``: the command line's (default: Hydra's task overrides of the running app)."""
    if problems := config_problems(cfg):
        return None, problems
    p, model, framework = cfg.plan, _plain(cfg.model), _plain(cfg.framework)
    hw = _hardware(cfg)
    hw["memory_headroom"] = memory_headroom(p.memory_headroom, hw)
    local = is_this_machine(hw)
    counts, problems = _devices(p, hw)
    problems += _choice_problems(p, framework) + _number_problems(p, local) + _request_problems(cfg)
    seq = cfg.train.seq_len or model["seq_len"]
    batch, bad = global_batch(cfg, counts[0] if counts else 1, seq, local)
    axes, bad_axes = resolve_axes(p, model, int(seq), str(cfg.train.dtype), framework)
    if problems or bad or bad_axes:
        return None, problems + bad + bad_axes
    moe_tp = framework.get("moe_max_tp") if model.get("n_experts") else None  # framework.moe_max_tp: experts' tp
    tp_limits = [x for x in (p.max_tp, framework.get("max_tp"), moe_tp) if x is not None]
    c = Constraints(global_batch=batch, max_tp=min(tp_limits) if tp_limits else None, pp=p.pp,
                    max_pp=framework.get("max_pp"), max_cp=framework.get("max_cp"), max_ep=framework.get("max_ep"),
                    even_split=bool(framework.get("even_layer_split", False)),
                    ddp_alone=bool(framework.get("ddp_alone", False)),
                    tp_ep_needs_sp=bool(framework.get("tp_ep_needs_sp", False)),
                    schedules=tuple(p.schedules or framework.get("plan_schedules") or framework.get("schedules", SCHEDULES)),
                    zero_stages=tuple(p.zero_stages or framework.get("zero_stages", ZERO_STAGES)),
                    pp_zero_stages=tuple(framework.get("pp_zero_stages", ZERO_STAGES)),
                    recompute=tuple(p.recompute or model_policies(framework.get("recompute") or PLAN_RECOMPUTE,
                                                                  model.get("n_experts") or 0,
                                                                  model.get("kv_lora_rank") is not None)),
                    max_micro_batch_size=p.max_micro_batch_size,
                    sequence_parallel=tuple(bool(x) for x in (p.sequence_parallel or framework.get("sequence_parallel",
                                                                                                   (False, True)))),
                    interleaved_min_pp=int(framework.get("interleaved_min_pp", 2)),
                    interleaved_m_per_pp=bool(framework.get("interleaved_m_per_pp", False)),
                    microbatch_rule=str(framework.get("microbatch_rule", "torch")),
                    vocab_multiple=framework.get("make_vocab_size_divisible_by"),
                    kv_replicate=framework.get("kv_heads_over_tp") == "replicate",
                    offload=tuple(bool(x) for x in (p.offload or framework.get("offload", [False]))),
                    offload_hardware=offload_figures_known(hw), fp8_hardware=bool(hw.get("peak_tflops_fp8")), **axes)
    train = {k: v for k, v in _plain(cfg.train).items() if k not in ("global_batch_size", "micro_batch_size")}
    ctx = PlanContext(model=model, hardware=hw, train=dict(train, seq_len=seq), framework=framework)
    inputs = PlanInputs(ctx, c, counts, p.min_tokens_per_s, p.top_k, p.execute_top,
                        tuple(_task_overrides() if overrides is None else overrides), tie_within=float(p.tie_within))
    return replace(inputs, ctx=inputs.at(counts[0])), []


def _task_overrides() -> list[str]:
    """The command line's overrides (Hydra's task overrides; none outside a Hydra app)."""
    try:
        from hydra.core.hydra_config import HydraConfig
        return list(HydraConfig.get().overrides.task)
    except Exception:  # not inside a Hydra app (tests call the planner directly)
        return []


def plan_argv(args: list[str]) -> list[str]:
    """``xpar plan <overrides>`` as a run's overrides (exit 2 on a ``run.mode`` other than
    plan, which would be overridden silently): ``run.mode=plan``, and ``train=cluster``
    (bf16, micro-batch 1) for a GPU cluster preset (its ``device`` is cuda) unless a train
    preset is given; local (device auto) and a CPU ``calibrated_*`` preset keep the default train (fp32)."""
    modes = [a.split("=", 1)[1] for a in args if a.lstrip("+").startswith("run.mode=")]
    if modes and modes[-1] != "plan":
        refuse([f"xpar plan searches layouts (run.mode=plan); run.mode={modes[-1]} is not taken with it: drop it, "
                f"or run the best layouts it finds with plan.execute_top=1."])
    train_given = any(a.lstrip("+").startswith("train=") for a in args)
    names = [a.split("=", 1)[1] for a in args if a.startswith("hardware=")]
    cluster = bool(names) and _preset_device(names[-1]) == "cuda"
    return list(args) + ([] if train_given or not cluster else ["train=cluster"]) + ["run.mode=plan"]


def _preset_device(name: str) -> str:
    """The ``device`` of hardware preset ``name`` (cuda when the preset or its field is missing)."""
    path = conf_dir() / "hardware" / f"{name}.yaml"
    return str(load_preset("hardware", name).get("device", "cuda")) if path.is_file() else "cuda"
