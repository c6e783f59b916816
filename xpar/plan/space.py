"""The layouts a plan considers: every combination of the degrees and choices, minus those that
break a rule, each dropped layout counted under the first rule it breaks.

The raw space is the product of: tp, pp, cp (divisors of the device count N and
``Constraints.cp``; dp = N / (tp pp cp)), ep, etp and the dtype (``Constraints``); the global batch
(fixed, or lo, hi and the powers of two between); micro-batch sizes dividing it; (schedule, v)
pairs of :data:`xpar.config.layout.SCHEDULES`; ZeRO 0-3, sp, the recompute policies and offload.
m = B / (b dp). The pp v stages split evenly or with lighter ends (xpar.estimate.columns.stage_split).

The rules (:data:`RULES`, in order) are those :mod:`xpar.config.validate` enforces for a layout,
the user's constraints, and duplicates (layouts that run the same as one kept:
:func:`xpar.config.layout.zero_stage_run`). numpy only, no torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from xpar.config.layout import EXECUTABLE, SCHEDULES, microbatch_ok, zero_stage_run
from xpar.config.remat import PLAN_RECOMPUTE, RECOMPUTE, SAC_POLICIES, module_policy_applies
from xpar.estimate.columns.stage_split import splittable
from xpar.plan.context import COLUMNS, OPTIONAL_COLUMNS


ZERO_STAGES = (0, 1, 2, 3)
OFFLOAD = (False, True)
SINGLE_SCHEDULE = ("1f1b", 1)
"""The (schedule, v) kept for pp = 1 (no pipeline: the schedule does not matter)."""

RULES = {
    "devices": "tp x pp x cp does not divide the device count",
    "cp_seq": "cp does not split each sequence into 2 x cp equal chunks (seq_len % (2 cp); causal load balancing, "
              "xpar.config.checks.layout.check_cp)",
    "max_cp": "cp above the framework's framework.max_cp (Megatron-LM before 2023: no context parallelism)",
    "ep": "ep does not divide the experts (model.n_experts; none: dense), or ep x etp the tp x cp x dp ranks "
          "that hold them (xpar.config.checks.layout.check_ep)",
    "max_ep": "ep above the framework's framework.max_ep (Megatron-LM before 2023: no expert parallelism)",
    "etp": "etp does not divide tp, or duplicate: etp = tp is the default etp (0) kept",
    "fp8_hw": "train.dtype=fp8 on hardware without an FP8 peak (hardware.peak_tflops_fp8)",
    "tp_split": "tp does not divide n_heads, n_kv_heads (nor is a multiple of them, under framework.kv_heads_over_tp="
                "replicate), ffn_hidden and vocab_size (whole heads per rank)",
    "max_tp": "tp above plan.max_tp (or the framework's framework.max_tp; framework.moe_max_tp for a model with "
              "experts: NeMo AutoModel's MoE models run tp 1)",
    "max_pp": "pp above the framework's framework.max_pp (llm-foundry: no pipeline parallelism)",
    "tp_nodes": "tp group neither inside one node nor whole nodes",
    "pp_fixed": "pp other than plan.pp",
    "pp1_schedule": "duplicate: pp = 1 runs no pipeline schedule (one kept)",
    "schedule": "schedule not in plan.schedules",
    "balanced": "pp x v stages split n_layers neither evenly nor with lighter ends (ceil(n_layers / (pp v)) "
                "blocks on each stage between the first and the last take more than the n_layers blocks; "
                "xpar.estimate.columns.stage_split)",
    "even_split": "pp x v stages do not divide n_layers, and the framework splits the layers evenly only "
                  "(framework.even_layer_split: Megatron-LM 2021-22)",
    "batch": "b x dp does not divide the global batch",
    "microbatches": "micro-batch count m the schedule refuses (xpar.config.layout.microbatch_ok)",
    "interleaved": "interleaved 1F1B the framework refuses: pp below framework.interleaved_min_pp, or m not "
                   "divisible by pp (framework.interleaved_m_per_pp)",
    "zero": "ZeRO stage the framework does not run, or not in plan.zero_stages (at dp > 1: at dp = 1 every stage "
            "runs the same, rule zero_dp1 keeps one)",
    "zero_pp": "ZeRO stage the framework does not run with pipeline parallelism (at dp > 1)",
    "tp_ep_sp": "tp > 1 with ep > 1 without sequence parallelism, which the framework refuses (framework.tp_ep_needs_sp: "
                "Megatron-Core's TransformerConfig)",
    "ddp_alone": "ZeRO-0 (DDP) at dp > 1 beside tp, pp, cp or ep, which the framework refuses (framework.ddp_alone: "
                 "torchtitan's DDP runs on a 1-D device mesh only)",
    "zero_dp1": "duplicate: ZeRO stages at dp = 1 shard nothing (stage 0 kept; stage 1 with optimizer offload)",
    "zero_run": "duplicate: ZeRO-3 runs as ZeRO-2 with zero-bubble schedules",
    "sp_tp1": "duplicate: sequence parallelism needs tp > 1",
    "sp_seq": "sequence parallelism needs seq_len divisible by tp",
    "recompute": "recompute policy not in plan.recompute",
    "recompute_model": "MLA's module recompute policy (xpar.config.remat.MODULE_POLICIES) on a model without MLA, or "
                       "moe_act without routed experts (config validation refuses it)",
    "sequence_parallel": "sequence parallelism (at tp > 1) not in plan.sequence_parallel or the framework's "
                         "framework.sequence_parallel (torchtitan: always on with tp)",
    "selective_zb": "selective (op-level) recompute with a zero-bubble schedule (torch refuses its split backward)",
    "offload": "optimizer offload the framework does not run (framework.offload), or not in plan.offload",
    "offload_hw": "optimizer offload on hardware without PCIe and host-memory figures (hardware.pcie_gb_per_s, "
                  "host_mem_gb_per_s, host_memory_gb)",
    "offload_zero": "optimizer offload at ZeRO-0 (each rank offloads its optimizer partition: DeepSpeed "
                    "offload_optimizer needs ZeRO stage 1-3; at dp = 1 it is kept as stage 1, the same layout)",
}
"""Why a layout is dropped, by key, in the order the rules are applied."""


@dataclass(frozen=True)
class Constraints:
    """What the user allows (``plan.*``, resolved). ``global_batch``: (lo, hi) in sequences,
    lo == hi for a fixed batch."""

    global_batch: tuple[int, int]
    max_tp: Optional[int] = None
    pp: Optional[int] = None
    schedules: tuple[str, ...] = EXECUTABLE
    zero_stages: tuple[int, ...] = ZERO_STAGES
    pp_zero_stages: tuple[int, ...] = ZERO_STAGES
    """ZeRO stages allowed with pp > 1 (the framework's, framework.pp_zero_stages)."""
    interleaved_min_pp: int = 2
    """Smallest pp of an interleaved 1F1B (framework.interleaved_min_pp; Megatron-LM: 3)."""
    interleaved_m_per_pp: bool = False
    """Interleaved 1F1B needs m divisible by pp (framework.interleaved_m_per_pp; Megatron-LM)."""
    microbatch_rule: str = "torch"
    """The framework's micro-batch rule (framework.microbatch_rule; xpar.config.layout.MICROBATCH_RULES)."""
    vocab_multiple: Optional[int] = None
    """framework.make_vocab_size_divisible_by: the vocabulary padded to it x tp (any tp splits it); None: tp divides it."""
    recompute: tuple[str, ...] = PLAN_RECOMPUTE
    """Recompute policies searched (xpar.config.remat: plan.recompute, framework.recompute)."""
    sequence_parallel: tuple[bool, ...] = (False, True)
    max_micro_batch_size: int = 8
    offload: tuple[bool, ...] = (False,)
    """Optimizer offload choices (framework.offload, narrowed by plan.offload)."""
    offload_hardware: bool = True
    """Whether the hardware gives the figures an offloaded step is timed with
    (:func:`xpar.estimate.memory.offload.offload_figures_known`)."""
    cp: tuple[int, ...] = (1,)
    """Context-parallel degrees searched (plan.cp)."""
    ep: tuple[int, ...] = (1,)
    """Expert-parallel degrees searched (plan.ep)."""
    dtypes: tuple[str, ...] = ()
    """Training dtypes searched (plan.dtype); (): the context's train.dtype (no ``dtype`` column)."""
    fp8_hardware: bool = True
    """Whether the hardware has an FP8 peak (hardware.peak_tflops_fp8)."""
    etp: tuple[int, ...] = (0,)
    """Expert tensor-parallel degrees searched (plan.etp; 0: etp = tp, no ``etp`` column when it is the only one)."""
    v: Optional[tuple[int, ...]] = None
    """Virtual stages per rank of looped schedules (plan.virtual_stages); None: :func:`schedule_pairs`'s."""
    max_pp: Optional[int] = None
    """Largest pipeline degree the framework runs (framework.max_pp); None: any."""
    max_cp: Optional[int] = None
    """Largest context-parallel degree the framework runs (framework.max_cp); None: any."""
    max_ep: Optional[int] = None
    """Largest expert-parallel degree the framework runs (framework.max_ep); None: any."""
    tp_ep_needs_sp: bool = False
    """Whether tp > 1 with ep > 1 needs sequence parallelism (framework.tp_ep_needs_sp: Megatron-Core)."""
    ddp_alone: bool = False
    """Whether ZeRO-0 at dp > 1 needs tp = pp = cp = ep = 1 (framework.ddp_alone: torchtitan)."""
    even_split: bool = False
    """Whether the framework splits the layers evenly over the pp x v stages only (framework.even_layer_split)."""
    kv_replicate: bool = False
    """Whether tp may exceed the K/V heads, each rank keeping its K/V head whole (framework.kv_heads_over_tp=replicate:
    xpar.config.attention.tp_kv_heads); False: tp divides them."""


@dataclass
class Space:
    """Candidate columns (:mod:`xpar.plan.context`) and the count of dropped layouts by rule
    (:data:`RULES` keys); ``raw``: layouts in the product before any rule."""

    cols: dict[str, np.ndarray]
    dropped: dict[str, int] = field(default_factory=dict)
    raw: int = 0
    emptied_by: str = ""
    """The rule (a :data:`RULES` key) that dropped the last layouts left; "" while some pass."""
    watch_dropped_by: str = ""
    """With a ``watch`` (:func:`enumerate_layouts`): the rule that dropped the last layouts holding it."""

    def __len__(self) -> int:
        return len(self.cols["tp"])


def divisors(n: int) -> list[int]:
    """Positive divisors of ``n``, increasing."""
    return [d for d in range(1, n + 1) if n % d == 0]


def batch_values(lo: int, hi: int) -> list[int]:
    """Global batches tried for a range [lo, hi]: lo, hi and the powers of two between."""
    pows = [1 << k for k in range(0, 40) if lo < (1 << k) < hi]
    return sorted({lo, hi, *pows})


def micro_batch_sizes(batches: Sequence[int], max_b: int) -> list[int]:
    """Micro-batch sizes b <= ``max_b`` dividing at least one of the global ``batches``: every such b (torchtitan's
    Llama 3 runs b 16, its async-TP runs b 12; memory drops those that do not fit). A power-of-two batch keeps
    the powers of two alone."""
    return [b for b in range(1, max_b + 1) if any(B % b == 0 for B in batches)]


SMALL_V = range(2, 9)
"""Virtual stages per rank tried whether or not they divide n_layers (the split then gives the first and
last stages fewer blocks, rule ``split``): the v that published looped runs use, e.g. v 8 on Llama 3's 126
layers, v 4 on 61 or 94 layers."""


def schedule_pairs(n_layers: int, v: Optional[Sequence[int]] = None) -> list[tuple[str, int]]:
    """(schedule, v) of every schedule: v = 1, 2 (V-shaped), or for looped schedules each of ``v``
    (default: :data:`SMALL_V` and each divisor >= 2 of n_layers) that is >= 2 and <= n_layers."""
    given = v if v is not None else {d for d in divisors(n_layers) if d >= 2} | set(SMALL_V)
    looped = sorted({x for x in given if 2 <= x <= n_layers})
    out = []
    for name, rec in SCHEDULES.items():
        vs = {"1": [1], "2": [2], "v": looped}[rec.stages_per_rank]
        out += [(name, v) for v in vs]
    return out


class _Drops:
    """Applies masks in order and counts what each drops, in raw layouts (``weight`` each); with ``watch``
    (column values), the rule that drops the last rows holding them (``watch_dropped_by``)."""

    def __init__(self, weight: int, watch: Optional[dict] = None):
        self.weight, self.dropped, self.emptied_by = weight, {k: 0 for k in RULES}, ""
        self.watch, self.watch_dropped_by = watch or {}, ""

    def apply(self, table: dict[str, np.ndarray], key: str, keep: np.ndarray) -> dict[str, np.ndarray]:
        self.dropped[key] += int((~keep).sum()) * self.weight
        if len(keep) and not keep.any() and not self.emptied_by:
            self.emptied_by = key
        if self.watch and not self.watch_dropped_by:
            mine = self.watched(table)
            if mine.any() and not (mine & keep).any():
                self.watch_dropped_by = key
        return {k: v[keep] for k, v in table.items()}

    def watched(self, table: dict[str, np.ndarray]) -> np.ndarray:
        """Rows of ``table`` equal to ``watch`` in each of its columns the table holds."""
        mine = np.ones(len(next(iter(table.values()))), dtype=bool)
        for k, v in self.watch.items():
            if k in table:
                mine &= table[k] == v
        return mine


def _product(**axes: Sequence) -> dict[str, np.ndarray]:
    """Every combination of the axes, as columns."""
    grids = np.meshgrid(*[np.arange(len(v)) for v in axes.values()], indexing="ij")
    return {k: np.asarray(v)[g.ravel()] for (k, v), g in zip(axes.items(), grids)}


def _structure(model: dict, devices: int, devices_per_node: int, seq_len: int, c: Constraints, drops: _Drops) -> dict:
    """(tp, pp, cp, ep, dtype, dp, B, b, m, schedule index, v) rows that pass the rules on degrees and batches."""
    pairs = schedule_pairs(model["n_layers"], c.v)
    batches = batch_values(*c.global_batch)
    bs = micro_batch_sizes(batches, c.max_micro_batch_size)
    t = _product(tp=divisors(devices), pp=divisors(devices), cp=c.cp, ep=c.ep, etp=c.etp, dtype=c.dtypes or ("",),
                 B=batches, b=bs, s=range(len(pairs)))
    names = np.array([p[0] for p in pairs])
    t["v"] = np.array([p[1] for p in pairs])[t["s"]]
    t = drops.apply(t, "devices", devices % (t["tp"] * t["pp"] * t["cp"]) == 0)
    t["dp"] = devices // (t["tp"] * t["pp"] * t["cp"])
    t = _five_rules(t, model, seq_len, c, drops)
    kv = model.get("n_kv_heads") or model["n_heads"]
    dims = np.array([model["n_heads"], kv, model["ffn_hidden"], 0 if c.vocab_multiple else model["vocab_size"]])
    split = dims[None, :] % t["tp"][:, None] == 0
    split[:, 1] |= c.kv_replicate & (t["tp"] % kv == 0)  # K/V heads kept whole on each tp rank (tp_kv_heads)
    t = drops.apply(t, "tp_split", split.all(axis=1))
    t = drops.apply(t, "max_tp", t["tp"] <= (c.max_tp or devices))
    t = drops.apply(t, "tp_nodes", (devices_per_node % t["tp"] == 0) | (t["tp"] % devices_per_node == 0))
    t = drops.apply(t, "pp_fixed", t["pp"] == (c.pp or t["pp"]))
    t = drops.apply(t, "max_pp", t["pp"] <= (c.max_pp or devices))
    single = pairs.index(SINGLE_SCHEDULE)
    t = drops.apply(t, "pp1_schedule", (t["pp"] > 1) | (t["s"] == single))
    t = drops.apply(t, "schedule", (t["pp"] == 1) | np.isin(names[t["s"]], c.schedules))
    t = drops.apply(t, "balanced", splittable(model["n_layers"], t["pp"] * t["v"]))
    t = drops.apply(t, "even_split", ~np.bool_(c.even_split) | (model["n_layers"] % (t["pp"] * t["v"]) == 0))
    t = drops.apply(t, "batch", t["B"] % (t["b"] * t["dp"]) == 0)
    t["m"] = t["B"] // (t["b"] * t["dp"])
    t = drops.apply(t, "microbatches", _microbatches_ok(names, t, c.microbatch_rule))
    inter = (t["pp"] > 1) & (names[t["s"]] == "interleaved_1f1b")
    bad = (t["pp"] < c.interleaved_min_pp) | (c.interleaved_m_per_pp & (t["m"] % t["pp"] != 0))
    t = drops.apply(t, "interleaved", ~(inter & bad))
    t["schedule"] = names[t["s"]]
    t["zb"] = np.array([SCHEDULES[str(n)].zero_bubble for n in names], dtype=bool)[t["s"]]
    return t


def _five_rules(t: dict, model: dict, seq_len: int, c: Constraints, drops: _Drops) -> dict:
    """The rules on cp (2 cp chunks per sequence, up to the framework's), etp (divides tp; etp = tp is etp 0), ep
    (divides the experts, ep x etp the tp x cp x dp ranks, up to the framework's) and the dtype (fp8 needs an FP8
    peak)."""
    t = drops.apply(t, "cp_seq", (t["cp"] == 1) | (seq_len % (2 * t["cp"]) == 0))
    t = drops.apply(t, "max_cp", t["cp"] <= (c.max_cp or np.iinfo(np.int64).max))
    same = (t["etp"] == t["tp"]) & (t["etp"] > 0)
    ok = (t["etp"] == 0) | ((t["tp"] % np.maximum(t["etp"], 1) == 0) & ~(same & (0 in c.etp)))
    t = drops.apply(t, "etp", ok)
    t["etp"] = np.where(t["etp"] == t["tp"], 0, t["etp"])
    experts, etp = int(model.get("n_experts") or 0), np.where(t["etp"] == 0, t["tp"], t["etp"])
    ok = (experts % t["ep"] == 0) & (t["tp"] * t["dp"] * t["cp"] % (t["ep"] * etp) == 0) & (experts > 0)
    t = drops.apply(t, "ep", ((t["ep"] == 1) & (t["etp"] == 0)) | ok)
    t = drops.apply(t, "max_ep", t["ep"] <= (c.max_ep or np.iinfo(np.int64).max))
    return drops.apply(t, "fp8_hw", (t["dtype"] != "fp8") | c.fp8_hardware)


def _microbatches_ok(names: np.ndarray, t: dict, rule: str = "torch") -> np.ndarray:
    """Whether each row's schedule accepts its m at its pp (pp = 1: always) under the framework's
    ``rule``, evaluated once per distinct (schedule, pp, m)."""
    keys, inverse = np.unique(np.stack([t["s"], t["pp"], t["m"]]), axis=1, return_inverse=True)
    ok = np.array([pp == 1 or microbatch_ok(str(names[s]), int(pp), int(m), rule) for s, pp, m in keys.T], dtype=bool)
    return ok[inverse.ravel()] if len(ok) else np.zeros(0, dtype=bool)


def _zero_runs(t: dict) -> np.ndarray:
    """The ZeRO stage each row runs (:func:`xpar.config.layout.zero_stage_run`, once per distinct
    (schedule, pp, zero), packed into one integer key)."""
    key = (t["s"].astype(np.int64) * (int(t["pp"].max(initial=0)) + 1) + t["pp"]) * len(ZERO_STAGES) + t["zero"]
    _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
    runs = np.array([zero_stage_run(str(t["schedule"][i]), int(t["pp"][i]), int(t["zero"][i])) for i in first],
                    dtype=np.int64)
    return runs[inverse.ravel()] if len(runs) else np.zeros(0, dtype=np.int64)


def _choices(t: dict, seq_len: int, c: Constraints, drops: _Drops) -> dict:
    """Each structural row times ZeRO stage, sequence parallelism, recompute and optimizer
    offload, less the rules on them."""
    n = len(t["tp"])
    x = _product(row=np.arange(n), zero=ZERO_STAGES, sp=(False, True), recompute=c.recompute, offload=OFFLOAD)
    t = {k: v[x["row"]] for k, v in t.items()}
    t.update(zero=x["zero"], sp=x["sp"], recompute=x["recompute"], offload=x["offload"])
    drops.weight = 1
    t = drops.apply(t, "zero", np.isin(t["zero"], c.zero_stages) | (t["dp"] == 1))
    t = drops.apply(t, "zero_pp", (t["pp"] == 1) | np.isin(t["zero"], c.pp_zero_stages) | (t["dp"] == 1))
    if c.tp_ep_needs_sp:  # rules only some profiles have: no pass over the table without them
        t = drops.apply(t, "tp_ep_sp", t["sp"] | (t["tp"] == 1) | (t["ep"] == 1))
    if c.ddp_alone:
        alone = (t["tp"] * t["pp"] * t["cp"] * t["ep"] == 1) | (t["zero"] > 0) | (t["dp"] == 1)
        t = drops.apply(t, "ddp_alone", alone)
    kept_at_dp1 = np.where(t["offload"], 1, 0)  # offload runs at ZeRO >= 1 (xpar.estimate.memory.offload.offload_problem)
    t = drops.apply(t, "zero_dp1", (t["dp"] > 1) | (t["zero"] == kept_at_dp1) | (t["zero"] == 0))
    zb = t["zb"] & (t["pp"] > 1)
    t = drops.apply(dict(t, zb=zb), "zero_run", _zero_runs(t) == t["zero"])
    t = drops.apply(t, "sp_tp1", (t["tp"] > 1) | ~t["sp"])
    t = drops.apply(t, "sp_seq", ~t["sp"] | (seq_len % t["tp"] == 0))
    t = drops.apply(t, "recompute", np.isin(t["recompute"], c.recompute))
    t = drops.apply(t, "sequence_parallel", np.isin(t["sp"], c.sequence_parallel) | (t["tp"] == 1))
    t = drops.apply(t, "selective_zb", ~(t["zb"] & np.isin(t["recompute"], ("selective",) + SAC_POLICIES)))
    t = drops.apply(t, "offload", ~t["offload"] | bool(True in c.offload))
    t = drops.apply(t, "offload", t["offload"] | bool(False in c.offload))
    t = drops.apply(t, "offload_hw", ~t["offload"] | c.offload_hardware)
    return drops.apply(t, "offload_zero", ~t["offload"] | (t["zero"] >= 1))


def enumerate_layouts(model: dict, devices: int, devices_per_node: int, seq_len: int,
                      c: Constraints, watch: Optional[dict] = None) -> Space:
    """Every layout of ``model`` (a model config dict: n_layers, n_heads, n_kv_heads, ffn_hidden,
    vocab_size) on ``devices`` devices, ``devices_per_node`` per node, at ``seq_len`` tokens per
    sequence, that passes :data:`RULES` under ``c``. Returns the candidate columns
    (:mod:`xpar.plan.context`) and the count of layouts each rule dropped; with ``watch`` (column
    values, e.g. a published layout's degrees) also the rule that dropped the last layouts holding them
    (``Space.watch_dropped_by``; "" where some are kept or none was in the product)."""
    weight = len(ZERO_STAGES) * 2 * len(c.recompute) * len(OFFLOAD)
    drops = _Drops(weight, watch)
    t = _structure(model, devices, devices_per_node, seq_len, c, drops)
    raw = _raw_size(model, devices, c) * weight
    t = _choices(t, seq_len, c, drops)
    mla, experts = model.get("kv_lora_rank") is not None, int(model.get("n_experts") or 0)
    lacking = [p for p in c.recompute if not module_policy_applies(p, experts, mla)]
    t = drops.apply(t, "recompute_model", ~np.isin(t["recompute"], lacking))
    cols = {k: t[k].astype(np.int64) for k in ("tp", "pp", "dp", "b", "m", "v", "zero", "cp", "ep", "etp")}
    cols.update(schedule=t["schedule"].astype(str), sp=t["sp"].astype(bool), recompute=t["recompute"].astype(str),
                offload=t["offload"].astype(bool), dtype=t["dtype"].astype(str))
    keep = [k for k in COLUMNS + OPTIONAL_COLUMNS if (k != "dtype" or c.dtypes) and (k != "etp" or c.etp != (0,))
            and k != "act_offload"]  # set where a layout fits only with it (xpar.plan.offload_fit)
    return Space({k: cols[k] for k in keep}, drops.dropped, raw, drops.emptied_by, drops.watch_dropped_by)


def _raw_size(model: dict, devices: int, c: Constraints) -> int:
    batches = batch_values(*c.global_batch)
    bs = micro_batch_sizes(batches, c.max_micro_batch_size)
    return (len(divisors(devices)) ** 2 * len(batches) * len(bs) * len(schedule_pairs(model["n_layers"], c.v))
            * len(c.cp) * len(c.ep) * len(c.etp) * len(c.dtypes or ("",)))
