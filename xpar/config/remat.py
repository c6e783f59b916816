"""Rematerialisation (activation recompute) policies as the frameworks define them: what one
transformer block keeps for backward besides its input, and which forward work its backward
runs again. Pure (no torch), in the config layer so that validation, execution
(xpar.parallel.recompute), the memory model (:mod:`xpar.estimate.memory.activations`), the time model
(:func:`xpar.estimate.cost.layer_costs`, :func:`xpar.estimate.cost.tp_times`) and the planner
(xpar.plan) read the same table.

``parallel.recompute`` names a policy; ``selective`` is the framework's own selective
recompute (``framework.selective_recompute``: xpar's 'op', torchtitan's 'torchtitan_op',
Megatron's 'attention'), so configs written before the named policies mean what they meant.

Design notes (what each step does and why, with sources): docs/concepts/design-notes.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from xpar.config.attention import attention_core_flops, attention_projection_flops, mla_up_projection_flops

SELECTIVE_POLICIES = ("op", "torchtitan_op", "attention")
"""The meanings of ``parallel.recompute=selective`` (``framework.selective_recompute``)."""
RECOMPUTE = ("none", "selective", "full", "attention", "op", "torchtitan_op", "save_dot_except_mlp", "save_qkv_proj",
             "moe", "mla_up_proj", "mla_up_proj_norm", "mla_up_proj_norm_moe_act")
"""Every value of ``parallel.recompute``."""
PLAN_RECOMPUTE = ("none", "selective", "full")
"""What ``xpar plan`` searches by default: none, the framework's own selective, full. The MaxText
policies (and the other selective meanings) by name through ``plan.recompute``, or as a profile
lists them (``framework.recompute``: conf/framework/maxtext.yaml): searching all five by default
made the 175B plan on 1024 A100 1.8x larger and 8 s with its MLflow record (target 5 s;
benchmarks/plan.py)."""


MODULE_POLICIES = {
    "mla_up_proj": ("mla_up_proj",),
    "mla_up_proj_norm": ("mla_up_proj", "layernorm"),
    "mla_up_proj_norm_moe_act": ("mla_up_proj", "layernorm", "moe_act"),
}
"""Megatron-Core's output-discarding recompute modules (``--recompute-granularity selective --recompute-modules``,
megatron/core/transformer/transformer_config.py ``recompute_modules``: "moe_act", "layernorm" and "mla_up_proj" use
output-discarding checkpointing) as named policies, each the modules it recomputes: 'mla_up_proj' (MLA's q and kv
up-projections and RoPE, megatron/core/transformer/multi_latent_attention.py ``qkv_up_checkpoint``); with
'layernorm' (input_layernorm and pre_mlp_layernorm) the DeepSeek-V3 report's "Recomputation of RMSNorm and MLA
Up-Projection" (arXiv:2412.19437 Sec. 3.2.3) and Megatron-MoE-ModelZoo's DeepSeek-V3 example
(``--recompute-modules mla_up_proj layernorm``); with 'moe_act' (the routed experts' SwiGLU) Megatron-Core's MoE
README "Fine-grained Recomputation" (megatron/core/transformer/moe/README.md). MLA models only; moe_act with experts.
Their memory: :mod:`xpar.estimate.memory.mla`."""


def model_policies(policies, n_experts: int, mla: bool = False) -> list[str]:
    """The recompute ``policies`` that apply to a model with ``n_experts`` routed experts (0: dense) and MLA
    attention or not (``mla``): ``moe`` (Megatron-Core's ``--recompute-modules moe``, which reruns the MoE
    layers only) needs experts; the :data:`MODULE_POLICIES` need MLA, and 'moe_act' experts too."""
    return [r for r in policies if (r != "moe" or n_experts) and module_policy_applies(r, n_experts, mla)]


def module_policy_applies(policy: str, n_experts: int, mla: bool) -> bool:
    """Whether a :data:`MODULE_POLICIES` entry applies (every other policy does): MLA, and experts for moe_act."""
    modules = MODULE_POLICIES.get(policy)
    if modules is None:
        return True
    return mla and (n_experts > 0 or "moe_act" not in modules)

SAC_POLICIES = ("op", "torchtitan_op", "attention", "save_dot_except_mlp", "save_qkv_proj")
"""Policies run by selective activation checkpointing (one backward per block: not with the
split backward of zero-bubble schedules, xpar.config.checks.layout.check_recompute)."""


@dataclass(frozen=True)
class Policy:
    """One policy: the projections whose outputs its blocks keep (``keeps``: wq wk wv wo w1 w3
    w2, 'context' for SDPA's output and log-sum-exp), the forward matmuls its backward reruns
    (``reruns``), whether it reruns the attention core (``attention``), the tp collectives of
    the forward its backward reruns (``tp_rerun``: in units of one all-reduce, or with sequence
    parallelism one all-gather + reduce-scatter pair), and whether xpar executes it."""

    keeps: tuple
    reruns: tuple
    attention: bool
    tp_rerun: float
    executes: bool
    source: str


ALL = ("wq", "wk", "wv", "wo", "w1", "w3", "w2")
POLICIES = {
    "none": Policy(ALL, (), False, 0.0, True, "no recompute"),
    "full": Policy((), ALL + ("router",), True, 2.0, True,
                   "Chen et al. 2016; Megatron --recompute-granularity full; MaxText full"),
    "attention": Policy(ALL + ("context",), (), True, 0.0, False, "Megatron --recompute-granularity selective"),
    "op": Policy(ALL, (), True, 0.0, True, "xpar SAC (xpar.parallel.recompute); MaxText minimal"),
    "torchtitan_op": Policy(("wq", "wv", "w1", "w2", "context"), ("wk", "wo", "w3"), False, 0.0, False,
                            "torchtitan selective_ac_option=op"),
    "save_dot_except_mlp": Policy(("wq", "wk", "wv", "wo"), ("w1", "w3"), True, 1.0, True,
                                  "MaxText remat_policy=save_dot_except_mlp"),
    "save_qkv_proj": Policy(("wq", "wk", "wv"), ("wo", "w1", "w3"), True, 1.0, True,
                            "MaxText remat_policy=save_qkv_proj"),
    "moe": Policy(("wq", "wk", "wv", "wo", "context"), ("w1", "w3"), False, 0.0, False,
                  "Megatron-Core --recompute-modules moe (megatron/core/transformer/moe/moe_layer.py)"),
    **{name: Policy(ALL, ("mla_up",), False, 0.0, False,
                    f"Megatron-Core --recompute-modules {' '.join(mods)} (MODULE_POLICIES)")
       for name, mods in MODULE_POLICIES.items()},
}
"""The policies (module docstring). ``tp_rerun``: full reruns both collectives of the forward;
the MaxText policies rerun the attention output's (to rebuild the MLP's input), not the MLP's."""


def policy_name(recompute: str, selective: str = "op") -> str:
    """The policy ``parallel.recompute`` names: ``selective`` is the framework's
    (``framework.selective_recompute``); the others are themselves.

    Raises:
        KeyError: a name that is no policy."""
    name = selective if recompute == "selective" else recompute
    if name not in POLICIES:
        raise KeyError(f"parallel.recompute={recompute!r}; expected one of {RECOMPUTE}")
    return name


def policy_of(recompute: str, selective: str = "op") -> Policy:
    """:class:`Policy` of ``parallel.recompute`` (:func:`policy_name`)."""
    return POLICIES[policy_name(recompute, selective)]


def token_ffn(cfg) -> float:
    """The MLP inner width one token goes through, the mean over the blocks: ffn_hidden in a
    dense block; in a block with experts, its top k and shared experts' (k + shared) x expert
    width (the active parameters, as xpar.estimate.compute.flops counts them)."""
    if not cfg.n_experts:
        return cfg.ffn_hidden
    moe = (cfg.moe_top_k + cfg.n_shared_experts) * cfg.expert_ffn
    return ((cfg.n_layers - cfg.moe_layers) * cfg.ffn_hidden + cfg.moe_layers * moe) / cfg.n_layers


def projection_flops(cfg) -> dict[str, float]:
    """Forward FLOPs per token of each projection of one block, the mean over the blocks (2 per
    multiply-add; wq, wk, wv, wo: :func:`xpar.config.attention.attention_projection_flops`, h x q and
    h x kv, or MLA's low-rank projections; ``mla_up`` the part of MLA's wq, wk, wv that its up-projections are,
    :func:`xpar.config.attention.mla_up_projection_flops`, not a further projection; w1 and w2 h x f, w3 h x f with SwiGLU else 0, f the width a token goes through
    (:func:`token_ffn`: its top k and shared experts in a MoE block); ``router`` the MoE router's
    h x E). Units: FLOP per token."""
    h, f = cfg.hidden, token_ffn(cfg)
    router = 2 * h * cfg.n_experts * cfg.moe_layers / cfg.n_layers if cfg.n_experts else 0.0
    return {**attention_projection_flops(cfg), "w1": 2 * h * f, "w3": 2 * h * f if cfg.activation == "swiglu" else 0.0,
            "w2": 2 * h * f, "router": router, "mla_up": mla_up_projection_flops(cfg)}


def extra_forward_flops_per_layer(cfg, seq_len: int, recompute: str, selective: str = "op",
                                  causal: bool = False, early_stop: bool = False) -> float:
    """Forward FLOPs per token one block's backward runs again under the policy (Narayanan et
    al. 2021 convention, :func:`xpar.estimate.compute.flops.forward_flops_per_token`: matmuls and the
    attention core's scores and context, 4 s h; element-wise ops not counted). full: the whole
    block's forward (Megatron's and DeepSpeed's checkpoint functions), without the MLP's down
    projection w2 with ``early_stop`` (torch's non-reentrant checkpoint stops at the last saved
    tensor, w2's input; JAX's remat prunes it: :func:`reruns`); save_dot_except_mlp: attention core
    + w1 (+ w3); Megatron's selective: the attention core. Units: FLOP per token."""
    p = policy_of(recompute, selective)
    proj = projection_flops(cfg)
    attention = attention_core_flops(cfg, seq_len, causal)
    return sum(proj[k] for k in reruns(p, early_stop)) + (attention if p.attention else 0.0)


def reruns(p: "Policy", early_stop: bool) -> tuple:
    """The projections policy ``p`` reruns; with ``early_stop`` never w2, whose output no backward
    needs (measured on xpar's engine, torch's checkpoint(use_reentrant=False): tests/config/test_remat.py)."""
    return tuple(k for k in p.reruns if not (early_stop and k == "w2"))


def tp_reruns(p: "Policy", early_stop: bool, sequence_parallel: bool) -> float:
    """tp collectives of a block's forward that policy ``p`` reruns (Policy.tp_rerun); under full
    recompute with ``early_stop`` not the one after w2: 1 all-reduce without sequence parallelism,
    with it 1.5 all-gather + reduce-scatter pairs (the MLP's all-gather before w1 is rerun)."""
    if early_stop and "w2" in p.reruns and p.tp_rerun:
        return p.tp_rerun - (0.5 if sequence_parallel else 1.0)
    return p.tp_rerun


def stage_share(recompute: str, layers_in_stage: int, recompute_layers: Optional[int], fraction: float) -> float:
    """Fraction of a stage's blocks the policy applies to: ``recompute_layers`` of them when
    set (the first ones, Megatron's --recompute-num-layers with --recompute-method block; a
    stage with fewer blocks recomputes all of its), else ``framework.recompute_layer_fraction``;
    0 without recompute or blocks."""
    if recompute == "none" or layers_in_stage <= 0:
        return 0.0
    if recompute_layers is None:
        return fraction
    return min(recompute_layers, layers_in_stage) / layers_in_stage


def model_share(recompute: str, layer_split, recompute_layers: Optional[int], fraction: float) -> float:
    """Fraction of the model's blocks recomputed: :func:`stage_share` weighted by each stage's
    blocks (``layer_split``); equal to every stage's share when the split is balanced."""
    total = sum(layer_split)
    if not total:
        return 0.0
    return sum(n * stage_share(recompute, n, recompute_layers, fraction) for n in layer_split) / total


def spec_share(spec, fraction: float) -> float:
    """:func:`model_share` of a RunSpec (its layout's recompute policy and split,
    ``parallel.recompute_layers``), with the framework's ``recompute_layer_fraction`` ``fraction``."""
    lay = spec.layout
    return model_share(lay.recompute, lay.layer_split, spec.parallel.recompute_layers, fraction)


def spec_recompute(spec, selective: Optional[str] = None, fraction: Optional[float] = None) -> tuple[str, float]:
    """(The policy a RunSpec runs, the share of its blocks recomputed): ``selective`` and
    ``fraction`` default to the spec's framework profile (framework.selective_recompute,
    framework.recompute_layer_fraction); the estimate passes its assumptions' values."""
    fw = spec.framework if selective is None or fraction is None else None  # a bare spec (calibrate) passes both
    name = policy_name(spec.layout.recompute, fw.selective_recompute if selective is None else selective)
    return name, spec_share(spec, fw.recompute_layer_fraction if fraction is None else fraction)


def replayed_share(spec, fw, policies: tuple) -> float:
    """Share of a RunSpec's blocks whose backward replays the forward's ep or cp collectives: the share
    recomputed (:func:`spec_recompute` with ``fw``'s selective_recompute and recompute_layer_fraction)
    where its policy is one of ``policies`` and ``fw.recompute_replays_comm``, else 0. ``fw``: a
    FrameworkConfig or the estimate's Assumptions."""
    if not fw.recompute_replays_comm:
        return 0.0
    name, share = spec_recompute(spec, fw.selective_recompute, fw.recompute_layer_fraction)
    return share if name in policies else 0.0


def extra_forward_flops_per_token(cfg, seq_len: int, policy: str, share: float, causal: bool = False) -> float:
    """Forward FLOPs per token the whole model's backward reruns: ``share`` of the blocks times
    :func:`extra_forward_flops_per_layer` (``policy`` a resolved name). Units: FLOP per token."""
    return share * cfg.n_layers * extra_forward_flops_per_layer(cfg, seq_len, policy, causal=causal)
