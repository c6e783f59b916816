"""Checks of the composed config alone (no layout resolved yet). Each returns violations."""
from __future__ import annotations

import math
from pathlib import Path

from xpar.config.checks import divisors
from xpar.config.layout import SCHEDULES
from xpar.config.attention import is_mla
from xpar.config.remat import MODULE_POLICIES, RECOMPUTE, model_policies
from xpar.config.schema import XparConfig, SUMMARY_METRICS

CHOICES = {
    "model.activation": ("swiglu", "gelu", "relu", "squared_relu"),
    "model.norm": ("rmsnorm", "layernorm"),
    "model.position": ("rope", "learned", "alibi"),
    "model.block": ("sequential", "parallel", "parallel_two_norms"),  # xpar.config.block
    "model.moe_routing": ("learned", "round_robin"),  # xpar.estimate.expert_parallel.unit_reach
    "parallel.zero_stage": (0, 1, 2, 3),
    "parallel.schedule": tuple(SCHEDULES),
    "parallel.recompute": RECOMPUTE,  # xpar.config.remat
    "train.dtype": ("fp32", "bf16", "fp8"),
    "train.fp8_recipe": ("delayed", "current", "mxfp8", "blockwise"),  # xpar.estimate.compute.fp8_recipes
    "train.on_nonfinite": ("stop", "skip", "ignore"),
    "sweep.goal": ("max", "min"),
    "data.kind": ("synthetic", "text"),
    "run.mode": ("auto", "execute", "estimate", "plan"),
    "hardware.device": ("auto", "cpu", "cuda"),
    "framework.sink_attention": (None, "fused", "unfused"),  # xpar.estimate.compute.kernel_block.sink_bytes
}


def check_choices(c: XparConfig) -> list[str]:
    """Every enumerated field holds one of its values."""
    out = []
    for key, allowed in CHOICES.items():
        group, name = key.split(".")
        value = getattr(getattr(c, group), name)
        if value not in allowed:
            near = next((a for a in allowed if isinstance(value, str) and str(a).lower() == value.lower()), None)
            out.append(f"{key} must be one of {list(allowed)}, got {value!r}"
                       + (f"; did you mean {key}={near}?" if near is not None else "."))
    return out


def check_model(c: XparConfig) -> list[str]:
    """Positive sizes; whole heads; GQA groups; an even head dim for RoPE."""
    model = c.model
    out = [f"model.{name} must be >= 1, got {getattr(model, name)}."
           for name in ("n_layers", "hidden", "n_heads", "ffn_hidden", "vocab_size", "seq_len")
           if getattr(model, name) < 1]
    if model.n_heads >= 1 and model.hidden >= 1 and model.head_dim is None and model.hidden % model.n_heads:
        out.append(f"model.hidden must be divisible by model.n_heads: {model.hidden} % {model.n_heads} != 0; "
                   f"{_heads_that_work(model)}; or give the heads' width, model.head_dim.")
    if model.head_dim is not None and (isinstance(model.head_dim, bool) or model.head_dim < 1):
        out.append(f"model.head_dim must be >= 1 or null (hidden / n_heads), got {model.head_dim}.")
    if model.kv_heads < 1 or (model.n_heads % model.kv_heads):
        out.append(f"model.n_heads must be divisible by model.n_kv_heads (grouped-query attention): "
                   f"n_heads={model.n_heads}, n_kv_heads={model.kv_heads}; n_kv_heads values that work: "
                   f"{divisors(max(model.n_heads, 1))}.")
    elif model.position == "rope" and model.n_heads >= 1 and model.head_size >= 1 and model.head_size % 2 and (
            model.head_dim is not None or model.hidden % model.n_heads == 0):
        given = f"model.head_dim = {model.head_dim}" if model.head_dim is not None else \
            f"hidden/n_heads = {model.head_size}"
        out.append(f"rope needs an even head dim: {given}; e.g. model.head_dim={model.head_size + 1}.")
    return (out + check_experts(model) + check_mla(model) + check_window(model)
            + check_module_recompute(model, c.parallel.recompute))


def _heads_that_work(model) -> str:
    """For a hidden size that n_heads does not divide: the n_heads values that pass every head check when
    followed (divide hidden, a multiple of an explicit n_kv_heads, an even head dim under RoPE), else the
    hidden sizes next to it that n_heads does. model.hidden=65 offered n_heads [1, 5, 13, 65], each refused
    again (tiny's n_kv_heads=2; an odd head dim under RoPE)."""
    kv, rope = model.n_kv_heads, model.position == "rope"
    ok = [d for d in divisors(model.hidden) if d <= 256 and (not kv or d % kv == 0)
          and not (rope and (model.hidden // d) % 2)]
    needs = (f", n_kv_heads={kv}" if kv else "") + (" and RoPE's even head dim" if rope else "")
    if ok:
        return f"n_heads values that work with hidden={model.hidden}{needs}: {ok}"
    step = model.n_heads * (2 if rope else 1)
    below, above = model.hidden // step * step, (model.hidden // step + 1) * step
    sizes = " or ".join(f"model.hidden={h}" for h in (below, above) if h >= 1)
    return f"no n_heads works with hidden={model.hidden}{needs}; hidden values that work with n_heads={model.n_heads}: {sizes}"


def check_window(model) -> list[str]:
    """Sliding-window attention: a pattern needs a window, and a window's pattern k leaves some layers local
    (k != 1) and some full (k <= n_layers; 0: every layer local). Negative values: xpar.config.checks.ranges."""
    w, k, n = model.sliding_window, model.sliding_window_pattern, model.n_layers
    if w < 0 or k < 0:
        return []
    if k and not w:
        return [f"model.sliding_window_pattern={k} needs model.sliding_window > 0 (the window in tokens, e.g. gpt-oss "
                f"128); or set model.sliding_window_pattern=0."]
    if w and k == 1:
        return [f"model.sliding_window_pattern=1 makes every layer full attention, so model.sliding_window={w} is "
                f"never used: set model.sliding_window_pattern=0 (every layer local), 2 (gpt-oss, Gemma 2) or 6 "
                f"(Gemma 3), or model.sliding_window=0."]
    if w and k > n >= 1:
        return [f"model.sliding_window_pattern={k} (every {k}-th layer full) leaves no full layer among "
                f"model.n_layers={n}: set model.sliding_window_pattern="
                + (f"2 (any of 2..{n}), or 0 for every layer local." if n >= 2 else "0 (every layer local).")]
    return []


def check_module_recompute(model, recompute: str) -> list[str]:
    """MLA's module recompute policies (xpar.config.remat.MODULE_POLICIES) need MLA (model.kv_lora_rank), and
    moe_act needs routed experts: the module they recompute is not in the model otherwise."""
    if recompute not in MODULE_POLICIES or model_policies([recompute], model.n_experts, is_mla(model)):
        return []
    need = "multi-head latent attention (model.kv_lora_rank)" + (" and routed experts" if "moe_act" in recompute else "")
    return [f"parallel.recompute={recompute} recomputes modules of {need}, which model={model.name} does not have; "
            f"use parallel.recompute=selective, full or none."]


MLA_DIMS = ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def check_mla(model) -> list[str]:
    """MLA (model.kv_lora_rank set) needs its head dims; q_lora_rank or the head dims without
    kv_lora_rank describe no attention xpar knows."""
    given = {k: getattr(model, k, None) for k in ("q_lora_rank",) + MLA_DIMS}
    if getattr(model, "kv_lora_rank", None) is None:
        set_ = [k for k, v in given.items() if v is not None]
        return [f"model.{set_[0]}={given[set_[0]]} is an MLA field but model.kv_lora_rank is null; set "
                f"model.kv_lora_rank (DeepSeek-V3: 512) or set {', '.join('model.' + k for k in set_)} to null."] if set_ else []
    missing = [k for k in MLA_DIMS if given[k] is None]
    return [f"MLA (model.kv_lora_rank={model.kv_lora_rank}) needs {', '.join('model.' + k for k in missing)}; "
            f"DeepSeek-V3: qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128."] if missing else []


def check_experts(model) -> list[str]:
    """A mixture of experts: E >= 0; with experts, 1 <= top k <= E, shared experts >= 0, an expert
    width >= 1, 0 <= first dense blocks <= n_layers with at least one block of experts after them
    (model.moe_layer_freq), a capacity factor > 0 or null (dropless)."""
    if model.n_experts < 0:
        return [f"model.n_experts must be >= 0 (0: a dense model), got {model.n_experts}."]
    if not model.n_experts:
        return []
    out = []
    if not 1 <= model.moe_top_k <= model.n_experts:
        out.append(f"model.moe_top_k must be between 1 and model.n_experts={model.n_experts}, got {model.moe_top_k}; "
                   f"e.g. model.moe_top_k={min(2, model.n_experts)}.")
    if model.n_shared_experts < 0 or model.expert_ffn < 1:
        out.append(f"model.n_shared_experts must be >= 0 and the expert width >= 1, got {model.n_shared_experts} "
                   f"and {model.expert_ffn} (model.expert_ffn_hidden, null: ffn_hidden).")
    if not 0 <= model.first_dense_layers <= model.n_layers:
        out.append(f"model.first_dense_layers must be between 0 and model.n_layers={model.n_layers}, "
                   f"got {model.first_dense_layers}.")
    elif model.moe_layers < 1:
        most = max(1, model.n_layers - model.first_dense_layers)
        out.append(f"model.moe_layer_freq={model.moe_layer_freq} leaves no block with experts after "
                   f"model.first_dense_layers={model.first_dense_layers} of model.n_layers={model.n_layers}; "
                   f"values that work: 1-{most}, e.g. model.moe_layer_freq=1 (every block) or model.n_experts=0 (dense).")
    if model.capacity_factor is not None and not model.capacity_factor > 0:
        out.append(f"model.capacity_factor must be > 0, or null for dropless routing, got {model.capacity_factor}.")
    if not model.moe_imbalance >= 1:
        out.append(f"model.moe_imbalance must be >= 1 (busiest ep rank's tokens over the mean; 1: balanced), "
                   f"got {model.moe_imbalance}.")
    return out + check_router_groups(model)


def check_router_groups(model) -> list[str]:
    """Group-limited routing: the groups split the experts evenly, 1 <= M <= groups, and the M groups hold at
    least the k experts a token takes (as Megatron-Core's router asserts)."""
    g, m, e, k = model.moe_router_groups, model.moe_router_group_topk, model.n_experts, model.moe_top_k
    if not g and not m:
        return []
    ok = [d for d in range(2, e + 1) if e % d == 0][:6]
    if not g or e % g or not 1 <= m <= min(g, k) or m * (e // g) < k:
        pairs = router_group_pairs(e, k)
        near = [p for p in pairs if p[0] == g] or pairs
        fix = (f"model.moe_router_groups={near[0][0]} model.moe_router_group_topk={near[0][1]} (pairs that work: "
               f"{', '.join(f'{a}:{b}' for a, b in pairs[:8])}), or " if pairs else "")
        return [f"model.moe_router_groups={g} and model.moe_router_group_topk={m} do not fit model.n_experts={e}, "
                f"moe_top_k={k}: the groups must divide the experts (e.g. {ok}), 1 <= group_topk <= min(groups, "
                f"moe_top_k), and the group_topk groups must hold >= moe_top_k experts; e.g. {fix}"
                f"model.moe_router_groups=0 model.moe_router_group_topk=0 (no group limit)."]
    return []


def router_group_pairs(experts: int, top_k: int) -> list[tuple[int, int]]:
    """(groups, group_topk) that limit the routing of ``experts`` experts at ``top_k`` (:func:`check_router_groups`'s
    rule, fewer groups open than there are: a limit), by groups then group_topk."""
    return [(g, m) for g in range(2, experts + 1) if experts % g == 0
            for m in range(1, min(g - 1, top_k) + 1) if m * (experts // g) >= top_k]


def _int_or_auto(key: str, value, minimum: int = 1) -> list[str]:
    if value == "auto":
        return []
    try:
        ok = int(value) == value and int(value) >= minimum
    except (TypeError, ValueError):
        ok = False
    return [] if ok else [f"{key} must be an integer >= {minimum} or 'auto', got {value!r}; e.g. {key}=auto."]


def check_degrees(c: XparConfig) -> list[str]:
    """tp, pp, cp, ep >= 1; dp, micro_batches and virtual_stages whole numbers >= 1 or 'auto'."""
    par = c.parallel
    out = [f"parallel.{name} must be >= 1, got {getattr(par, name)}; e.g. parallel.{name}=1." for name in ("tp", "pp", "cp", "ep")
           if getattr(par, name) < 1]
    for name in ("dp", "micro_batches", "virtual_stages"):
        out += _int_or_auto(f"parallel.{name}", getattr(par, name))
    out += _int_or_auto("train.global_batch_size", c.train.global_batch_size)
    return out


def check_train(c: XparConfig) -> list[str]:
    """Sequence length within the model's positions, b >= 1, lr > 0, steps and warm-up."""
    model, tr = c.model, c.train
    out = []
    seq = tr.seq_len if tr.seq_len is not None else model.seq_len
    if model.position == "learned" and not 1 <= seq <= model.seq_len:
        out.append(f"train.seq_len must be in [1, {model.seq_len}] for model={model.name} (learned positions cover "
                   f"{model.seq_len}), got {seq}; e.g. train.seq_len={model.seq_len}.")
    elif seq < 1:  # rope: any length >= 1 runs
        out.append(f"train.seq_len must be >= 1, got {seq}; e.g. train.seq_len={model.seq_len}.")
    if tr.micro_batch_size < 1:
        out.append(f"train.micro_batch_size must be >= 1, got {tr.micro_batch_size}; e.g. train.micro_batch_size=1.")
    if not (tr.lr > 0 and math.isfinite(tr.lr)):
        finite = "" if math.isfinite(tr.lr) else " and finite"
        out.append(f"train.lr must be > 0{finite}, got {tr.lr}; e.g. train.lr=3e-4.")
    if not (tr.weight_decay >= 0 and math.isfinite(tr.weight_decay)):
        finite = "" if math.isfinite(tr.weight_decay) else " and finite"
        out.append(f"train.weight_decay must be >= 0{finite}, got {tr.weight_decay}; e.g. train.weight_decay=0.1.")
    if tr.steps <= 0:
        out.append(f"train.steps must be > 0, got {tr.steps}; e.g. train.steps=10.")
    if tr.steps > 0 and not 0 <= tr.warmup_steps < tr.steps:
        out.append(f"train.warmup_steps must satisfy 0 <= warmup_steps < steps, got warmup_steps="
                   f"{tr.warmup_steps}, steps={tr.steps}; e.g. train.warmup_steps={min(2, tr.steps - 1)}.")
    if tr.log_every < 1:
        out.append(f"train.log_every must be >= 1 (steps between live points), got {tr.log_every}; e.g. train.log_every=10.")
    return out


def _text_example(seq: int) -> str:
    """Values that work for data=text: README.md where the command runs from a clone (a text file of at least
    ``seq`` + 1 bytes there), and data=synthetic anywhere."""
    readme = Path("README.md")
    near = readme.is_file() and readme.stat().st_size > seq
    return ("e.g. data.path=README.md (any text file of at least " f"{seq + 1} bytes), or " if near else "e.g. ") + \
        "data=synthetic (no file)"


def check_data(c: XparConfig) -> list[str]:
    """A text corpus exists, holds one sequence, and fits the byte vocabulary."""
    if c.data.kind != "text":
        return []
    out = []
    path, seq = c.data.path, c.train.seq_len if c.train.seq_len is not None else c.model.seq_len
    if not path or not Path(path).expanduser().is_file():
        out.append(f"data.path must be an existing text file for data=text, got {path!r}; {_text_example(seq)}.")
    elif Path(path).expanduser().stat().st_size < seq + 1:
        out.append(f"data.path={path} holds fewer than seq_len+1={seq + 1} bytes.")
    if c.model.vocab_size < 256:
        out.append(f"data=text uses byte tokens (0..255): model.vocab_size must be >= 256, "
                   f"got {c.model.vocab_size}.")
    return out


SWEEP_METRIC_FAMILIES = ("pipeline/", "comm/", "estimate/", "fidelity/", "plan/", "train/", "throughput/step_time_")
"""Families of the metrics a run logs besides the summary ones (xpar.track.report.Report.metrics: its
``extra``, memory terms ``memory/<term>_bytes``, the step-time spread)."""


def check_sweep(c: XparConfig) -> list[str]:
    """``sweep.metric`` names a metric xpar logs (a name no run logs picked no best job and gave
    Optuna nothing, silently)."""
    import difflib

    metric = c.sweep.metric
    if metric in SUMMARY_METRICS or metric.startswith(SWEEP_METRIC_FAMILIES) or \
            (metric.startswith("memory/") and metric.endswith("_bytes")):
        return []
    close = difflib.get_close_matches(metric, SUMMARY_METRICS, n=1, cutoff=0.0) or [SUMMARY_METRICS[0]]
    return [f"sweep.metric={metric} is not a metric xpar logs; e.g. sweep.metric={close[0]} "
            f"(summary metrics: {', '.join(SUMMARY_METRICS)})."]
