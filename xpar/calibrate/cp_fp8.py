"""Rows of tests/data/cp_fp8_h100.csv and moe_layouts_h100.csv (context parallelism, FP8, MoE with expert parallelism
on H100/H800) as RunSpecs and framework assumptions, and the estimate in each source's own figure (issues 42-44).
Specs are built through validation (:func:`xpar.calibrate.published.make_spec`), as every published layout."""
from __future__ import annotations

import re

from xpar.calibrate.published import framework_assumptions, make_spec, preset
from xpar.estimate.compute.flops import model_flops_per_token
from xpar.estimate.compute.fp8_recipes import RECIPES


def cp_fp8_case(row: dict, gpu_presets: dict = None):
    """(spec, assumptions, metric, published value) of an H100 or H800 row of tests/data/cp_fp8_h100.csv
    (context parallelism, FP8, MoE with expert parallelism; Llama shapes, DeepSeek-V3's MLA with the
    paper's ranks and head dims (:data:`DEEPSEEK_V3_MLA`: its FLOPs; its memory as MHA) and its node-limited routing
    (:data:`DEEPSEEK_V3_ROUTING`), Qwen3's heads at
    :data:`HEAD_DIMS` and GeGLU as SwiGLU: the same matmuls; the Llama 3 paper's pipelines with one layer fewer on the first
    and the last stage, as its Sec. 3.3.2 says; an unstated etp of a MoE row is 1, the Megatron-Bridge MoE recipes'
    expert_tensor_parallel_size, which their ep x tp layouts need), or None for another GPU or a row without its layout.
    A row's ``sliding_window``, ``sliding_window_pattern`` and ``attention_sinks`` columns, where the file has them
    (blackwell_published.csv), are the model's (empty: none); FP8 rows at the scaling recipe their source used (:func:`row_fp8_recipe`).
    Framework: :func:`cp_fp8_framework`; an uneven pp x vp split as Megatron balances it, or, where the note names
    :data:`ACCOUNTED_SPLIT`, L + 2 layers split evenly with the embedding and the loss counted as one each; a ``zero``
    of 3 (Megatron-FSDP) as ZeRO-3. ``gpu_presets``: the GPUs priced and their node presets (default
    :data:`GPU_PRESETS`; :data:`NEW_GPU_PRESETS` adds H200, B200 and GB200, resized by :func:`sized_hardware`)."""
    needed = ("gpus", "seq", "dp", "layers", "hidden", "heads", "kv_heads", "ffn", "global_batch", "value")
    presets = gpu_presets or GPU_PRESETS
    gpu = max((g for g in presets if row["gpu"].startswith(g)), key=len, default=None)  # H100-96GB before H100
    if gpu is None or not all(row[k] for k in needed):
        return None
    L, pp, vp = int(row["layers"]), int(row["pp"] or 1), int(row["vp"] or 1)
    n = pp * vp
    model = dict(name=row["id"], n_layers=L, hidden=int(row["hidden"]), n_heads=int(row["heads"]),
                 n_kv_heads=int(row["kv_heads"]), ffn_hidden=int(row["ffn"]), vocab_size=int(row["vocab"] or 128256),
                 seq_len=int(row["seq"]), activation="swiglu", norm="rmsnorm", position="rope",
                 tied_embeddings=False, bias=False, **_moe_fields(row),
                 **(DEEPSEEK_V3_MLA if row["attention"] == "mla" and row["model_name"] == "DeepSeek-V3" else {}),
                 **(DEEPSEEK_V3_ROUTING if row["model_name"] == "DeepSeek-V3" else {}),
                 head_dim=HEAD_DIMS.get(row["model_name"]),
                 sliding_window=int(row.get("sliding_window") or 0),
                 sliding_window_pattern=int(row.get("sliding_window_pattern") or 0),
                 attention_sinks=row.get("attention_sinks") == "true")
    fsdp2 = row["id"].startswith(("torchtitan", "automodel")) or row["zero"] == "3"  # FSDP2 / Megatron-FSDP: ZeRO-3
    recompute = (row["recompute"] or "none").split()[0]
    recompute = "moe" if "moe)" in row["recompute"] else recompute  # Megatron-Core --recompute-modules ... moe
    if "RMSNorm + MLA up-projection" in row["recompute"]:  # DeepSeek-V3 report Sec. 3.2.3
        recompute = "mla_up_proj_norm"
    par = dict(name=row["id"], dp=int(row["dp"]), tp=int(row["tp"] or 1), pp=pp, cp=int(row["cp"] or 1),
               ep=int(row["ep"] or 1), etp=int(row["etp"]) if row["etp"] else (1 if row["moe"] == "true" else None),
               zero_stage=3 if fsdp2 else 1, micro_batches="auto", schedule="interleaved_1f1b" if vp > 1 else "1f1b",
               virtual_stages=vp, recompute=recompute if recompute in ("none", "selective", "full", "moe", "mla_up_proj_norm") else "none",
               sequence_parallel=int(row["tp"] or 1) > 1,
               layer_split=None if L % n == 0 else [L // n + (i < L % n) for i in range(n)])
    if (row["source"].startswith("The Llama 3 Herd") or ACCOUNTED_SPLIT in row["note"]) and n > 2 and (L + 2) % n == 0:
        par["layer_split"] = [(L + 2) // n - 1] + [(L + 2) // n] * (n - 2) + [(L + 2) // n - 1]  # Sec. 3.3.2
    hw = sized_hardware(preset("hardware", presets[gpu]), int(row["gpus"]))
    train = dict(micro_batch_size=int(row["micro_batch"] or 1), global_batch_size=int(row["global_batch"]),
                 dtype=row["dtype"], seq_len=int(row["seq"]), compile=row_compiled(row), **row_fp8_recipe(row))
    overlap = 1.0 if "DualPipe" in row["note"] else MOE_A2A_OVERLAP if MOE_A2A_OVERLAP_FLAGS & set(
        row["note"].replace(";", " ").replace(",", " ").split()) else 0.0
    a2a = dict(ep_dispatcher=_dispatcher(row["note"]), ep_a2a_overlap=overlap)
    metric = row["metric"]
    if metric == "tflops_per_gpu" and row["source"].startswith(CAUSAL_FLOPS_SOURCES):
        metric = "tflops_per_gpu_causal"
    name, changes = cp_fp8_framework(row)
    assume = framework_assumptions(name, **a2a, **changes)
    sinks = {"sink_attention": assume.sink_attention} if model["attention_sinks"] else None  # the profile's sink path
    return make_spec(model, par, hw, train, sinks), assume, metric, float(row["value"])


GPU_PRESETS = {"H100": "h100_80gb_64gpu", "H100-96GB": "h100_96gb_500w_node", "H800": "h800_80gb_2048gpu"}
"""The hardware preset of a row's ``gpu`` column (by its longest matching prefix) that :func:`cp_fp8_case` prices by
default: H100-96GB is torchtitan's Grand Teton part (96 GB HBM2e at 2.4 TB/s, 500 W; its benchmark page's "Hardware")."""
NEW_GPU_PRESETS = {**GPU_PRESETS, "H200": "h200_141gb_node", "B200": "b200_180gb_node", "GB200": "gb200_nvl72_node"}
""":data:`GPU_PRESETS` and the GPUs of 2025-26 (tests/data/blackwell_published.csv;
benchmarks/estimate_blackwell.py)."""


def sized_hardware(hw: dict, gpus: int) -> dict:
    """Hardware preset ``hw`` (a dict) resized to ``gpus`` devices: nodes of the preset's size, or, where ``gpus`` is
    not a multiple of it (256 GPUs of GB200 NVL72 racks of 72), NVLink domains of the largest divisor of ``gpus``
    that fits one (64), each GPU keeping its NIC (the preset's NICs per device). Raises ValueError for ``gpus`` < 1."""
    if gpus < 1:
        raise ValueError(f"gpus must be >= 1, got {gpus}")
    per_node = int(hw["devices_per_node"])
    size = next(d for d in range(min(per_node, gpus), 0, -1) if gpus % d == 0)
    nics = hw.get("nics_per_node")
    return dict(hw, devices_per_node=size, nodes=gpus // size,
                **({"nics_per_node": max(1, int(nics) * size // per_node)} if nics else {}))


MOE_A2A_OVERLAP = 0.3
"""framework.ep_a2a_overlap of a Megatron-Core run with its 1F1B all-to-all overlap (--overlap-moe-expert-parallel-comm;
Megatron-Bridge's moe_a2a_overlap): the share of the exposed expert all-to-alls hidden behind the other micro-batch's
compute. Fitted on the Megatron-MoE ModelZoo Qwen3-235B EP32 pair (tests/data/cp_fp8_h100.csv and
moe_layouts_h100.csv: 19.7 s without, 17.6 s with; at 0.3 both within 3 %), checked on Megatron-Bridge's H100
Qwen3-235B rows, whose recipe sets it (docs/concepts/kernels.md)."""
MOE_A2A_OVERLAP_FLAGS = {"A2A_OVERLAP=1", "moe_a2a_overlap=True"}
"""Words of a row's note that state the overlap: the ModelZoo's run script variable, Megatron-Bridge's recipe field."""

ACCOUNTED_SPLIT = "--account-for-embedding-in-pipeline-split"
"""A row note naming this flag: Megatron-LM's --account-for-embedding-in-pipeline-split and
--account-for-loss-in-pipeline-split, which split L + 2 layers evenly over the pp x vp chunks, the first chunk
holding one decoder layer fewer (the embedding) and the last one fewer (the loss), as the Llama 3 paper's split."""

AUTOMODEL_OPTIMIZER_BYTES = 8
"""Bytes per optimizer-state element of NeMo AutoModel's benchmark recipes: Transformer Engine's FusedAdam over the bf16
parameters keeps its moments in fp32 and no master copy (2 x 4 bytes; the AutoModel docs, "Mixed-Precision Training":
"TE FusedAdam keeps fp32 state regardless"; examples/llm_pretrain/llama3_1_70b_pretrain_benchmark_*.yaml)."""


def row_compiled(row: dict) -> bool:
    """Whether a row's run compiled its blocks (train.compile): its source or note names torch.compile
    (torchtitan's tables and Trainy's H200 page state it per run) and neither says it was off."""
    text = f"{row.get('source', '')} {row.get('note', '')}".lower()
    return "torch.compile" in text and not any(x in text for x in ("no torch.compile", "torch.compile off"))


def row_fp8_recipe(row: dict) -> dict:
    """``{"fp8_recipe": recipe}`` of an fp8 row whose ``fp8_recipe`` column names one (tests/data/cp_fp8_h100.csv: the
    recipe its source's code used at the run's date, with the evidence in the file's header), else {} (train.fp8_recipe
    keeps its default, ``delayed``: bf16 rows, and the files that share these columns without this one:
    moe_layouts_h100.csv, blackwell_published.csv, whose benchmark sets the recipe from the row's precision label).

    Raises:
        ValueError: the column names a recipe train.fp8_recipe does not know (xpar.estimate.compute.fp8_recipes)."""
    recipe = (row.get("fp8_recipe") or "").strip()
    if row["dtype"] != "fp8" or not recipe:
        return {}
    if recipe not in RECIPES:
        raise ValueError(f"row {row['id']}: fp8_recipe={recipe!r}; known: {sorted(RECIPES)}")
    return {"fp8_recipe": recipe}


def cp_fp8_framework(row: dict) -> tuple[str, dict]:
    """The framework profile of a tests/data/cp_fp8_h100.csv row and the changes its recipe states: torchtitan for
    torchtitan's rows, fsdp2_bf16 for NeMo AutoModel's (bf16 parameters, its FusedAdam's fp32 moments:
    :data:`AUTOMODEL_OPTIMIZER_BYTES`), megatron_core (NeMo, Megatron-LM, dgxc) for the others; the Llama 3 paper's
    rows with its all-gather context parallelism (Sec. 3.3.2: K/V all-gathered, not a ring: framework.cp_comm; the
    local queries' attention over the gathered K/V, no per-step kernels: framework.cp_attention_merge null); the
    DeepSeek-V3 paper's run with DeepSeek's own FP8 quantisation, not Transformer Engine's kernels
    (framework.fp8_cast_kernels fused, as conf/framework/hai_llm.yaml)."""
    if row["id"].startswith("torchtitan"):
        return "torchtitan", {}
    if row["id"].startswith("automodel"):
        return "fsdp2_bf16", {"optimizer_bytes": AUTOMODEL_OPTIMIZER_BYTES}
    if row["source"].startswith("The Llama 3 Herd"):  # Sec. 3.3.2: "all-gather based" context parallelism
        return "megatron_core", {"cp_comm": "all_gather", "cp_attention_merge": None}
    if row["id"].startswith("dsv3_paper"):
        return "megatron_core", {"fp8_cast_kernels": "fused"}
    return "megatron_core", {}


HEAD_DIMS = {"Qwen3-235B-A22B": 128, "Qwen3-30B-A3B": 128, "gpt-oss-120b": 64}
"""Heads of cp_fp8_h100.csv's models that are not hidden / n_heads wide (the csv has no head_dim column):
Qwen3's 128 (Qwen/Qwen3-235B-A22B and Qwen3-30B-A3B config.json ``head_dim``; Megatron-MoE-ModelZoo
model_configs/benchmarking/Qwen3-*.yaml ``kv_channels: 128``), against hidden / n_heads = 64: the
attention's projections and core and the sources' own FLOP counts are at 128; gpt-oss-120b's 64 (openai/gpt-oss-120b
config.json ``head_dim``) against 2880 / 64 = 45."""

DEEPSEEK_V3_MLA = dict(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
"""DeepSeek-V3's multi-head latent attention (DeepSeek-AI 2024, Sec. 4.2; conf/model/deepseek_v3.yaml)."""
DEEPSEEK_V3_ROUTING = dict(moe_router_groups=8, moe_router_group_topk=4)
"""DeepSeek-V3's node-limited routing (DeepSeek-AI 2024, Sec. 2.1.2; conf/model/deepseek_v3.yaml)."""

CAUSAL_FLOPS_SOURCES = ("NVIDIA/Megatron-LM", "yanring/Megatron-MoE-ModelZoo")
"""Sources whose model TFLOP/s count causal attention: the score and context matmuls over half the
s x s square (Megatron-LM's ``num_floating_point_operations`` since 2025: ``seq_length / 2  # causal
mask``), where xpar's model FLOPs, as Narayanan et al. 2021, count the whole square. Both ignore a sliding window
(Megatron-LM's count @001b00c2 puts s / 2 on every attention layer); Megatron-Bridge's later ``flop_utils.py`` counts
it (xpar.estimate.compute.flops.model_flops_per_token with ``window``)."""


def published_figure(est, spec, metric: str) -> float:
    """The estimate ``est`` of ``spec`` as a cp_fp8_h100.csv row states its figure: ``step_s``,
    ``tokens_per_s_per_gpu``, ``tflops_per_gpu`` (xpar's FLOPs) or ``tflops_per_gpu_causal`` (the same
    seconds over the causal count of :data:`CAUSAL_FLOPS_SOURCES`)."""
    if metric == "step_s":
        return est.time_per_step_s
    if metric == "tokens_per_s_per_gpu":
        return est.tokens_per_s_per_device
    if metric == "tflops_per_gpu":
        return est.tflops_per_device
    return est.tflops_per_device * model_flops_per_token(spec.model, spec.seq_len, causal=True) / \
        model_flops_per_token(spec.model, spec.seq_len)


def _dispatcher(note: str) -> str:
    """framework.ep_dispatcher of a row whose ``note`` names its recipe's token dispatcher: deepep (DeepEP, or
    DeepSeek's DualPipe runs), hybridep (Megatron-Core's HybridEP, the flex dispatcher's NVLink-domain backend),
    else alltoall."""
    if "DeepEP" in note or "DualPipe" in note:
        return "deepep"
    return "hybridep" if "HybridEP dispatcher" in note else "alltoall"


def _moe_fields(row: dict) -> dict:
    """The model group's MoE fields of a tests/data/cp_fp8_h100.csv row ({} for a dense one); a capacity factor
    where its note says the run pads to capacity (dgxc's Grok-1: "capacity factor 1.0 + pad-to-capacity"), else
    dropless."""
    if row["moe"] != "true":
        return {}
    dense = row["moe_layers"].split("first ")[1].split()[0] if "first" in row["moe_layers"] else "0"
    padded = re.search(r"capacity factor ([0-9.]+) \+ pad-to-capacity", row["note"])
    return dict(n_experts=int(row["experts"]), moe_top_k=int(row["top_k"]), n_shared_experts=int(row["shared_experts"] or 0),
                expert_ffn_hidden=int(row["expert_ffn"]), first_dense_layers=int(dense),
                capacity_factor=float(padded.group(1)) if padded else None)
