"""Public layouts for calibration and what-if studies: configs built through validation.

The cost model (:mod:`xpar.estimate.cost`) is a pure function of a RunSpec; this module
builds RunSpecs of published layouts (Narayanan et al. 2021 Table 1) with
:func:`xpar.config.validate.validate`, so the cost model never imports validation.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

from xpar.config.presets import conf_dir
from xpar.config.schema import FrameworkConfig
from xpar.config.spec import RunSpec
from xpar.config.validate import validate
from xpar.estimate.columns.stage_split import plan_split
from xpar.estimate.cost import Assumptions, estimate, with_hardware
from xpar.estimate.compute.kernel_costs import fitted_field


def preset(group: str, name: str) -> dict:
    """A config-group preset from conf/ as a plain dict, over the presets of its group that its
    ``defaults`` list names (conf/framework/megatron_zb.yaml: megatron's, then its own)."""
    from omegaconf import OmegaConf

    own = OmegaConf.to_container(OmegaConf.load(conf_dir() / group / f"{name}.yaml"))
    out: dict = {}
    for base in own.pop("defaults", None) or []:
        if base != "_self_":
            out.update(preset(group, base))
    return {**out, **own}


def make_spec(model: dict, parallel: dict, hardware: dict, train: dict, framework: Optional[dict] = None) -> RunSpec:
    """A validated estimate-mode RunSpec from plain group dicts (through xpar.config.validate; what-if
    studies: a layout that does not fit device memory is returned, not refused); ``framework``: fields over the
    default profile's (None: none)."""
    cfg = {"model": model, "parallel": parallel, "hardware": hardware, "train": train,
           "tracking": {"enabled": False}, "run": {"mode": "estimate", "progress": False}}
    if framework:
        cfg["framework"] = framework
    return validate(cfg)


def megatron_2021_spec(row: dict, micro_batch_size: int = 1, hardware: str = "a100_80gb_1024gpu") -> RunSpec:
    """RunSpec of one row of Narayanan et al. 2021 Table 1 (keys as in
    megatron_2021_table1.csv): GPT (GELU, LayerNorm, learned positions, tied embeddings,
    biases), s = 2048, V = 51200, bf16 mixed precision, interleaved 1F1B with v = smallest
    divisor > 1 of the layers per rank where pp > 2 (Megatron-LM interleaves only there: 1F1B at
    pp = 2), full recompute, on ``hardware`` resized to the row's
    GPU count (8 per node)."""
    h, l, t, pp, gpus = (int(row[k]) for k in ("hidden", "layers", "tp", "pp", "gpus"))
    model = dict(name=f"gpt_{row['params_b']}b", n_layers=l, hidden=h, n_heads=int(row["heads"]), n_kv_heads=None,
                 ffn_hidden=4 * h, vocab_size=51200, seq_len=2048, activation="gelu", norm="layernorm",
                 position="learned", tied_embeddings=True, bias=True)
    per_rank = l // pp
    v = next((d for d in range(2, per_rank + 1) if per_rank % d == 0), 1) if pp > 2 else 1  # Megatron: pp > 2
    parallel = dict(name="megatron", dp=int(row["dp"]), tp=t, pp=pp, zero_stage=0, micro_batches="auto",
                    schedule="interleaved_1f1b" if v > 1 else "1f1b", virtual_stages=v, recompute="full")
    hw = preset("hardware", hardware)
    hw["nodes"] = gpus // int(hw["devices_per_node"])
    train = dict(micro_batch_size=micro_batch_size, global_batch_size=int(row["global_batch"]), dtype="bf16",
                 seq_len=2048)
    return make_spec(model, parallel, hw, train)


def read_table(path) -> list[dict]:
    """Rows of a reference CSV (lines starting with # are comments)."""
    import csv
    with open(path) as f:
        return list(csv.DictReader(line for line in f if not line.startswith("#")))


def megatron_errors(rows: list[dict]) -> list[tuple[dict, float, float]]:
    """(row, predicted hardware TFLOP/s per GPU, relative error) for each Table 1 row."""
    out = []
    for row in rows:
        est = estimate(megatron_2021_spec(row), Assumptions.megatron_2021())
        ref = float(row["tflops_per_gpu"])
        out.append((row, est.hw_tflops_per_device, est.hw_tflops_per_device / ref - 1))
    return out


# --- calibration across public sources, leave-one-source-out --------------------------------

def framework_assumptions(name: str, **changes):
    """A framework profile (conf/framework/<name>.yaml) as Assumptions, with ``changes``."""
    from dataclasses import replace

    return replace(Assumptions.from_config(FrameworkConfig(**preset("framework", name))), **changes)


def megatron_row(row: dict):
    """(spec, assumptions, published hardware TFLOP/s per GPU) of a Table 1 row, under the profile of the
    Megatron-LM that ran it (conf/framework/megatron_2021.yaml: :meth:`Assumptions.megatron_2021`'s costs, the
    layouts of 2021)."""
    return megatron_2021_spec(row), framework_assumptions("megatron_2021"), float(row["tflops_per_gpu"]), "hw_tflops"


TORCHTITAN_AC = {"none": ("none", 1.0), "full": ("full", 1.0), "selective_op": ("selective", 1.0),
                 "selective_layer": ("full", 0.5)}
"""torchtitan's activation checkpointing as xpar's recompute: selective_layer = full
recompute on every other block (recompute_layer_fraction 0.5)."""


def torchtitan_row(row: dict):
    """(spec, assumptions, published tokens/s per GPU) of a torchtitan FSDP2 run on 64 A100s."""
    h, heads = int(row["hidden"]), int(row["heads"])
    model = dict(name=row["model"], n_layers=int(row["layers"]), hidden=h, n_heads=heads,
                 n_kv_heads=int(row["kv_heads"]), ffn_hidden=int(row["ffn"]), vocab_size=int(row["vocab"]),
                 seq_len=int(row["seq"]), activation="swiglu", norm="rmsnorm", position="rope",
                 tied_embeddings=False, bias=False)
    recompute, frac = TORCHTITAN_AC[row["ac"]]
    parallel = dict(name="fsdp2", dp=int(row["dp"]), tp=1, pp=1, zero_stage=3, micro_batches=1, recompute=recompute)
    hw = preset("hardware", "a100_80gb_64gpu")
    train = dict(micro_batch_size=int(row["local_batch"]), global_batch_size="auto", dtype="bf16")
    a = framework_assumptions("torchtitan", recompute_layer_fraction=frac)
    return make_spec(model, parallel, hw, train), a, float(row["wps_per_gpu"]), "tokens_per_s_per_device"


def llama3_row(row: dict):
    """(spec, assumptions, published model TFLOP/s per GPU) of a Llama 3 405B row (H100): tp 8, pp 16
    interleaved with V = 8 and one layer per virtual stage, the first holding only the embedding and the
    last only the head (Dubey et al. 2024 Sec. 3.3.2; why V = 8: tests/data/llama3_2024_table4.csv)."""
    gpus, pp, dp = int(row["gpus"]), int(row["pp"]), int(row["dp"])
    hw = preset("hardware", "h100_80gb_64gpu")
    hw["nodes"] = gpus // 8
    split = [0] + [1] * 126 + [0]
    parallel = dict(name="llama3", dp=dp, tp=int(row["tp"]), pp=pp, zero_stage=1, schedule="interleaved_1f1b",
                    virtual_stages=8, micro_batches=int(row["batch_per_dp"]), layer_split=split,
                    sequence_parallel=True, recompute="none")
    train = dict(micro_batch_size=1, global_batch_size="auto", dtype="bf16", seq_len=int(row["seq"]))
    a = framework_assumptions("megatron", flash_attention=True, dropout=False, dp_overlap=True, param_gather_overlap=True)
    return make_spec(preset("model", "405b"), parallel, hw, train), a, float(row["tflops_per_gpu"]), "tflops"


def torchtitan_h100_row(row: dict):
    """(spec, assumptions, published tokens/s per GPU) of a torchtitan Llama 3.1 8B FSDP run on
    H100 (96 GB HBM2e, 2.4 TB/s; torchtitan_h100_2024.csv)."""
    model = dict(name="llama31_8b", n_layers=32, hidden=4096, n_heads=32, n_kv_heads=8, ffn_hidden=14336,
                 vocab_size=128256, seq_len=8192, activation="swiglu", norm="rmsnorm", position="rope",
                 tied_embeddings=False, bias=False)
    gpus = int(row["gpus"])
    recompute, frac = TORCHTITAN_AC[row["ac"]]
    parallel = dict(name="fsdp2", dp=gpus, tp=1, pp=1, zero_stage=3, micro_batches=1, recompute=recompute)
    hw = dict(preset("hardware", "h100_80gb_64gpu"), nodes=max(1, gpus // 8), hbm_tb_per_s=2.4, device_memory_gb=96)
    train = dict(micro_batch_size=int(row["local_batch"]), global_batch_size="auto", dtype="bf16")
    a = framework_assumptions("torchtitan", recompute_layer_fraction=frac)
    return make_spec(model, parallel, hw, train), a, float(row["tps_per_gpu"]), "tokens_per_s_per_device"


def table2_ptdp_row(row: dict):
    """(spec, assumptions, published hardware TFLOP/s per GPU) of a PTD-P row of Narayanan et
    al. 2021 Table 2: built as a Table 1 row (:func:`megatron_2021_spec`)."""
    return megatron_row(row)


def gpt_2021_model(row: dict) -> dict:
    """The GPT of Narayanan et al. 2021 (GELU, LayerNorm, learned positions, tied embeddings,
    biases, s = 2048, V = 51200) with the row's layers, hidden and heads."""
    h = int(row["hidden"])
    return dict(name=f"gpt_{row['params_b']}b", n_layers=int(row["layers"]), hidden=h, n_heads=int(row["heads"]),
                n_kv_heads=None, ffn_hidden=4 * h, vocab_size=51200, seq_len=2048, activation="gelu",
                norm="layernorm", position="learned", tied_embeddings=True, bias=True)


def table2_zero3_row(row: dict):
    """(spec, assumptions, published hardware TFLOP/s per GPU) of a ZeRO-3 row of Narayanan et
    al. 2021 Table 2: DeepSpeed ZeRO-3 over every GPU, one micro-batch per step, full recompute,
    on the Megatron GPT of 2021 (its kernels: no flash attention, dropout) with DeepSpeed's
    communication as of 2021 (conf/framework/deepspeed_2021.yaml)."""
    gpus = int(row["gpus"])
    parallel = dict(name="zero3", dp=gpus, tp=1, pp=1, zero_stage=3, micro_batches=1, recompute="full")
    hw = preset("hardware", "a100_80gb_1024gpu")
    hw["nodes"] = gpus // int(hw["devices_per_node"])
    train = dict(micro_batch_size=int(row["micro_batch"]), global_batch_size=int(row["global_batch"]),
                 dtype="bf16", seq_len=2048)
    a = framework_assumptions("deepspeed_2021")
    return make_spec(gpt_2021_model(row), parallel, hw, train), a, float(row["tflops_per_gpu"]), "hw_tflops"


GPU_PRESETS = {"A100": "a100_80gb_64gpu", "H100": "h100_80gb_64gpu"}
"""The hardware preset of each GPU family of the FSDP sources (resized to the row's GPUs)."""
MPT_SHARDING = {"FULL_SHARD": 3, "SHARD_GRAD_OP": 2}
"""torch FSDP sharding strategies as ZeRO stages (SHARD_GRAD_OP keeps the gathered parameters
from the forward to the backward: FSDP2's reshard_after_forward=False, xpar's stage 2)."""
MPT_REDUCE_BYTES = {"PURE": 2, "DEFAULT": 4}
"""Bytes per gradient element reduce-scattered under Composer's FSDP mixed-precision modes
(composer get_mixed_precision: PURE reduces in the bf16 precision, DEFAULT in fp32)."""


def mpt_row(row: dict):
    """(spec, assumptions, published tokens/s per GPU) of an llm-foundry MPT row
    (llmfoundry_mpt_a100.csv, llmfoundry_mpt_h100.csv): Composer's torch FSDP over every GPU, no
    tp/pp, ZeRO stage by ``sharding`` (:data:`MPT_SHARDING`; FULL_SHARD where the file has no
    such column), ``grad_accum`` micro-batches per step, full recompute or none; the GPT shape of
    MPT as benchmarked (GELU, LayerNorm, biases, learned positions, tied embeddings, V = 50368,
    s = 2048). Hardware: the 64-GPU preset of the row's GPU (A100 where the file has no ``gpu``
    column) resized to the row's GPUs, fabric as the preset (8 NICs per node); A100 40 GB rows take
    its HBM (1.555 TB/s, datasheet). Profile: llm-foundry (conf/framework/llmfoundry.yaml: torchtitan's
    FSDP timing with FSDP1's copies and the fused cross entropy) with the reduce-scatter width of the
    row's MP mode (:data:`MPT_REDUCE_BYTES`; PURE by default)."""
    h, gpus = int(row["hidden"]), int(row["gpus"])
    model = dict(name=f"mpt_{row['model']}", n_layers=int(row["layers"]), hidden=h, n_heads=int(row["heads"]),
                 n_kv_heads=None, ffn_hidden=4 * h, vocab_size=50368, seq_len=2048, activation="gelu",
                 norm="layernorm", position="learned", tied_embeddings=True, bias=True)
    parallel = dict(name="fsdp", dp=gpus, tp=1, pp=1, zero_stage=MPT_SHARDING[row.get("sharding", "FULL_SHARD")],
                    micro_batches=int(row["grad_accum"]), recompute="full" if row["ac"] == "true" else "none")
    hw = dict(preset("hardware", GPU_PRESETS[row.get("gpu", "A100")]), nodes=gpus // 8)
    if row.get("gpu_memory_gb") == "40":
        hw.update(device_memory_gb=42.3, hbm_tb_per_s=1.555)  # 42.3e9 bytes as the 40 GB device reports
    train = dict(micro_batch_size=int(row["micro_batch"]), global_batch_size=int(row["global_batch"]), dtype="bf16",
                 seq_len=2048)
    a = framework_assumptions("llmfoundry", grad_reduce_bytes=MPT_REDUCE_BYTES[row.get("mp_mode", "PURE")])
    return make_spec(model, parallel, hw, train), a, float(row["tps_per_gpu"]), "tokens_per_s_per_device"


def ibm_fsdp_row(row: dict):
    """(spec, assumptions, published tokens/s per GPU) of a row of the IBM/Meta FSDP blog
    (ibm_fms_fsdp_2024.csv): Llama 2 34B/70B, FSDP FULL_SHARD over every GPU, one micro-batch of
    ``local_batch`` per step, full recompute; the GPU's preset with the published inter-node
    bandwidth per node (``fabric_gbps_per_node`` Gb/s over 4 NICs: only the node total enters
    the cross-node ring). Profile: torchtitan's FSDP with bf16 reduce-scatters (fms-fsdp's
    bfSixteen mixed precision) and FSDP1's copies (fms-fsdp wraps torch's FSDP1)."""
    gpus = int(row["gpus"])
    model = dict(name=row["model"], n_layers=int(row["layers"]), hidden=int(row["hidden"]), n_heads=int(row["heads"]),
                 n_kv_heads=int(row["kv_heads"]), ffn_hidden=int(row["ffn"]), vocab_size=int(row["vocab"]),
                 seq_len=int(row["seq"]), activation="swiglu", norm="rmsnorm", position="rope",
                 tied_embeddings=False, bias=False)
    parallel = dict(name="fsdp", dp=gpus, tp=1, pp=1, zero_stage=3, micro_batches=1, recompute=row["ac"])
    nics = 4
    hw = dict(preset("hardware", GPU_PRESETS[row["gpu"]]), nodes=gpus // 8, nics_per_node=nics,
              inter_node_gb_per_s=float(row["fabric_gbps_per_node"]) / 8 / nics)
    train = dict(micro_batch_size=int(row["local_batch"]), global_batch_size="auto", dtype="bf16")
    a = framework_assumptions("torchtitan", grad_reduce_bytes=2, fsdp_copies="fsdp1", head_unit_last=False,
                              fsdp_head_units=False)  # fms-fsdp wraps the blocks only: the root holds embedding and output
    return make_spec(model, parallel, hw, train), a, float(row["tps_per_gpu"]), "tokens_per_s_per_device"


def gpt_3d_spec(row: dict, zero_stage: int = 0) -> RunSpec:
    """RunSpec of a Megatron GPT row with a ``mode`` column (korthikanti_2022_table5.csv,
    smith_2022_mtnlg.csv): the GPT of :func:`gpt_2021_model`, s = 2048, the row's tp, pp, dp,
    micro-batch and global batch on the 1024-GPU A100 preset resized to the row's GPUs; ``mode``
    full = full recompute without sequence parallelism, present = sequence parallelism with
    selective recompute; interleaved 1F1B with the row's v where v > 1."""
    gpus, pp, v = int(row["gpus"]), int(row["pp"]), int(row["virtual_stages"])
    present = row["mode"] == "present"
    parallel = dict(name="megatron_3d", dp=int(row["dp"]), tp=int(row["tp"]), pp=pp, zero_stage=zero_stage,
                    micro_batches="auto", schedule="interleaved_1f1b" if v > 1 else "1f1b", virtual_stages=v,
                    sequence_parallel=present, recompute="selective" if present else "full")
    hw = dict(preset("hardware", "a100_80gb_1024gpu"), nodes=max(1, gpus // 8))
    train = dict(micro_batch_size=int(row["micro_batch"]), global_batch_size=int(row["global_batch"]), dtype="bf16",
                 seq_len=2048)
    return make_spec(gpt_2021_model(row), parallel, hw, train)


def _tokens_per_s_per_gpu(row: dict) -> float:
    """Published tokens/s per GPU of a row with global_batch, iteration_s and gpus (s = 2048)."""
    return int(row["global_batch"]) * 2048 / (float(row["iteration_s"]) * int(row["gpus"]))


def korthikanti_row(row: dict):
    """(spec, assumptions, published tokens/s per GPU) of a row of Korthikanti et al. 2022
    (korthikanti_2022_table5.csv; :func:`gpt_3d_spec`): DDP (no distributed optimizer),
    gradients all-reduced after the flush. Profile: Megatron-LM as calibrated on Narayanan et al.
    2021 (:meth:`Assumptions.megatron_2021`: fused softmax, not flash attention, dropout,
    blocking p2p) with the Megatron-LM of 2022's asynchronous tp backward (``tp_async_backward``:
    the paper overlaps the input-gradient all-reduce / reduce-scatter of the column-parallel linears
    with their weight-gradient GEMMs, and Megatron-LM's ``--async-tensor-model-parallel-allreduce``
    was on by default by then): conf/framework/megatron_2022.yaml, the layouts of that version.
    Published value: global batch x s / (iteration time x GPUs)."""
    a = framework_assumptions("megatron_2022")
    return gpt_3d_spec(row), a, _tokens_per_s_per_gpu(row), "tokens_per_s_per_device"


def mtnlg_row(row: dict):
    """(spec, assumptions, published tokens/s per GPU) of an MT-NLG 530B row (smith_2022_mtnlg.csv;
    :func:`gpt_3d_spec` with full recompute): ZeRO-1 over dp, 1F1B, under Megatron-DeepSpeed's profile
    (conf/framework/megatron_deepspeed.yaml: the 2021 Megatron kernels in DeepSpeed's PipelineEngine, blocking p2p,
    ZeRO-1 after the flush), whose cost per layer and micro-batch is the one fitted on BLOOM's runs
    (deepspeed_bloom's ``layer_overhead_ms``; this source checks it, never fits it)."""
    return gpt_3d_spec(row, zero_stage=1), framework_assumptions("megatron_deepspeed"), _tokens_per_s_per_gpu(row), \
        "tokens_per_s_per_device"


def bloom_row(row: dict):
    """(spec, assumptions, published hardware TFLOP/s per GPU) of a BLOOM run (bigscience_bloom_2022.csv):
    the GPT shapes of the row (ffn 4 h, V 250880, s 2048, biases, LayerNorm, tied embeddings; ALiBi as
    learned positions: the same matmuls), ZeRO-1 over dp, 1F1B, full recompute, the end stages one block
    fewer (Megatron-DeepSpeed's 'type:transformer|embedding' split: :func:`xpar.estimate.columns.stage_split.plan_split`);
    Megatron-DeepSpeed as BLOOM ran it (conf/framework/deepspeed_bloom.yaml: Megatron's fused softmax,
    not flash attention; dropout 0.1 as Megatron's defaults, the tr11 README); Jean Zay's nodes: 8 A100 80GB, four Omni-Path
    100 Gb/s links (BLOOM paper, arXiv 2211.05100, Sec. 3.4.1)."""
    h, pp, layers = int(row["hidden"]), int(row["pp"]), int(row["layers"])
    model = dict(name=row["id"], n_layers=layers, hidden=h, n_heads=int(row["heads"]), n_kv_heads=None, ffn_hidden=4 * h,
                 vocab_size=250880, seq_len=2048, activation="gelu", norm="layernorm", position="learned",
                 tied_embeddings=True, bias=True)
    dp, tp = int(row["dp"]), int(row["tp"])
    parallel = dict(name="megatron_deepspeed", dp=dp, tp=tp, pp=pp, zero_stage=1, micro_batches="auto", schedule="1f1b",
                    virtual_stages=1, layer_split=plan_split(layers, pp), recompute="full", sequence_parallel=False)
    hw = dict(preset("hardware", "a100_80gb_1024gpu"), nodes=dp * tp * pp // 8, nics_per_node=4, inter_node_gb_per_s=12.5)
    train = dict(micro_batch_size=int(row["micro_batch"]), global_batch_size=int(row["global_batch"]), dtype="bf16",
                 seq_len=2048)
    a = framework_assumptions("deepspeed_bloom")
    return make_spec(model, parallel, hw, train), a, float(row["tflops_per_gpu"]), "hw_tflops"


DGXC_TP_OVERLAP = 0.8
"""Share of the tp all-gathers/reduce-scatters that NeMo's userbuffer overlap (ub_tp_comm_overlap,
Transformer Engine) hides behind the GEMMs: not published; 0.8 as the torchtitan profile's
example for async TP. The diagnosis in tests/estimate/test_estimate_throughput.py brackets it with 0 and 1."""


def dgxc_model(row: dict) -> dict:
    """The model of a dgxc_nemo_h100_bf16.csv row: GPT-3 (GELU, learned positions, tied
    embeddings, biases) or Nemotron-4 (squared ReLU = 2 MLP matrices as gelu, RoPE, GQA, untied,
    no biases); LayerNorm for both."""
    kv = row["kv_heads"]
    return dict(name=row["model"], n_layers=int(row["layers"]), hidden=int(row["hidden"]), n_heads=int(row["heads"]),
                n_kv_heads=int(kv) if kv else None, ffn_hidden=int(row["ffn"]), vocab_size=int(row["vocab"]),
                seq_len=int(row["seq"]), activation="gelu", norm="layernorm", position=row["position"],
                tied_embeddings=row["tied"] == "true", bias=row["bias"] == "true")


def dgxc_row(row: dict, tp_overlap: float = DGXC_TP_OVERLAP):
    """(spec, assumptions, published tokens/s per GPU) of a NeMo BF16 recipe row on H100
    (dgxc_nemo_h100_bf16.csv): tp x pp x dp with sequence parallelism, the distributed optimizer
    (ZeRO-1, Megatron semantics) with gradient reduce-scatters overlapping the backward
    (overlap_grad_sync) and parameter all-gathers the next forward (overlap_param_sync) in
    ``bucket_mb`` buckets of bf16 (empty: Megatron-Core's default bucket, the profile's ``bucket_rule``), interleaved 1F1B with the row's vp, recompute as the row, the
    recipe's optimizer states (``optimizer_bytes`` per element: apex's or Megatron-Core's optimizer as its config).
    Profile: Megatron-Core (conf/framework/megatron_core.yaml: Transformer Engine's flash attention,
    overlapped gradient and parameter collectives), dropout and bucket size as the recipe, ``tp_overlap``
    of the tp collectives hidden (:data:`DGXC_TP_OVERLAP`), pp sends hidden where vp > 1 (overlap_p2p_comm). Hardware: the H100 preset resized to the
    row's GPUs (8 per node, 8 x 400 Gb/s)."""
    gpus, tp, pp, v = (int(row[k]) for k in ("gpus", "tp", "pp", "vp"))
    parallel = dict(name="nemo", dp=gpus // (tp * pp), tp=tp, pp=pp, zero_stage=1, micro_batches="auto",
                    schedule="interleaved_1f1b" if v > 1 else "1f1b", virtual_stages=v, sequence_parallel=True,
                    recompute=row["recompute"])
    hw = dict(preset("hardware", "h100_80gb_64gpu"), nodes=gpus // 8)
    train = dict(micro_batch_size=int(row["micro_batch"]), global_batch_size=int(row["global_batch"]), dtype="bf16",
                 seq_len=int(row["seq"]))
    bucket = dict(bucket_rule="fixed", bucket_mb=float(row["bucket_mb"])) if row["bucket_mb"] else {}  # else the profile's
    a = framework_assumptions("megatron_core", dropout=row["dropout"] == "true", tp_overlap=tp_overlap,
                              pp_overlap=1.0 if v > 1 else 0.0, optimizer_bytes=int(row["optimizer_bytes"]), **bucket)
    ref = float(row["tokens_per_s"]) / gpus
    return make_spec(dgxc_model(row), parallel, hw, train), a, ref, "tokens_per_s_per_device"


SOURCES = {
    "megatron_2021_table1": ("megatron_2021_table1.csv", "A100", megatron_row),
    "torchtitan_fsdp2_a100": ("torchtitan_fsdp2_a100.csv", "A100", torchtitan_row),
    "llama3_2024_table4": ("llama3_2024_table4.csv", "H100", llama3_row),
    "torchtitan_h100_2024": ("torchtitan_h100_2024.csv", "H100-96GB-500W", torchtitan_h100_row),
    "narayanan_2021_table2_ptdp": ("narayanan_2021_table2_ptdp.csv", "A100", table2_ptdp_row),
    "narayanan_2021_table2_zero3": ("narayanan_2021_table2_zero3.csv", "A100", table2_zero3_row),
    "llmfoundry_mpt_a100": ("llmfoundry_mpt_a100.csv", "A100", mpt_row),
    "llmfoundry_mpt_h100": ("llmfoundry_mpt_h100.csv", "H100", mpt_row),
    "ibm_fms_fsdp_2024": ("ibm_fms_fsdp_2024.csv", None, ibm_fsdp_row),
    "korthikanti_2022_table5": ("korthikanti_2022_table5.csv", "A100", korthikanti_row),
    "dgxc_nemo_h100_bf16": ("dgxc_nemo_h100_bf16.csv", "H100", dgxc_row),
    "smith_2022_mtnlg": ("smith_2022_mtnlg.csv", "A100", mtnlg_row),
    "bigscience_bloom_2022": ("bigscience_bloom_2022.csv", "A100", bloom_row),
}
"""Public sources: file in tests/data, GPU family (one matmul efficiency each; None: the row's
``gpu`` column), row builder. The
torchtitan H100 runs are their own family: a 500 W, HBM2e part whose peak its authors do not
know (between SXM and NVL), so the SXM datasheet peak does not describe it."""


def load_cases(data_dir) -> dict[str, list]:
    """Per source, the (spec, assumptions, published value, metric) of each row."""
    from pathlib import Path
    out = {}
    for name, (fname, gpu, build) in SOURCES.items():
        out[name] = [(gpu or r["gpu"],) + build(r) for r in read_table(Path(data_dir) / fname)]
    return out


def predicted(case, efficiency: float) -> float:
    """The estimate of a case's metric with ``efficiency`` as the hardware's fitted constant
    (xpar.estimate.compute.kernel_costs.fitted_field: sustained_efficiency or matmul_efficiency)."""
    _, spec, assume, _, metric = case
    e = estimate(with_fitted(spec, efficiency), assume)
    return {"hw_tflops": e.hw_tflops_per_device, "tflops": e.tflops_per_device,
            "tokens_per_s_per_device": e.tokens_per_s_per_device}[metric]


def with_fitted(spec: RunSpec, efficiency: float) -> RunSpec:
    """``spec`` with its hardware's fitted constant (:func:`xpar.estimate.compute.kernel_costs.fitted_field`) at ``efficiency``."""
    return with_hardware(spec, **{fitted_field(spec.hardware, spec.train.dtype): efficiency})


def errors(cases: list, efficiency: float) -> list[float]:
    """Relative errors (predicted / published - 1) of ``cases`` at ``efficiency``."""
    return [predicted(c, efficiency) / c[3] - 1 for c in cases]


def fit_efficiency(cases: list, lo: float = 0.4, hi: float = 0.95) -> float:
    """The matmul efficiency minimising the median |error| of ``cases`` (:func:`golden_min`, 14
    steps, to 0.001; the median |error| is flat near its minimum and not always unimodal: H100's has
    a second, lower minimum near 0.623)."""
    import statistics
    return round(golden_min(lambda x: statistics.median(abs(e) for e in errors(cases, x)), lo, hi, 14), 3)


def golden_min(cost, lo: float, hi: float, steps: int) -> float:
    """The middle of the bracket that a golden-section search for the minimum of ``cost`` over
    [lo, hi] keeps after ``steps`` steps (one new point per step: the kept inner point is the next
    step's other)."""
    g = (5 ** 0.5 - 1) / 2
    a, b = lo, hi
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = cost(c), cost(d)
    for _ in range(steps):
        if fc <= fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = cost(c)
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = cost(d)
    return (a + b) / 2


CHECK_ONLY = frozenset({"llmfoundry_mpt_a100", "llmfoundry_mpt_h100", "ibm_fms_fsdp_2024", "korthikanti_2022_table5",
                        "smith_2022_mtnlg", "bigscience_bloom_2022", "narayanan_2021_table2_zero3"})
"""Sources no fit uses: FSDP / ZeRO-3 runs at scale and Megatron-style tp x pp x dp runs
(Korthikanti et al. 2022 and MT-NLG on A100) added as checks after the constants were fitted
(issue 9), held out from every fit so that they cannot move the constants; their
'calibration' and 'held out' errors are both at the constants fitted without them. DeepSpeed
2021's ZeRO-3 rows of Narayanan et al. Table 2 are checks too: 26-78 % of their steps is dp
communication, whose pricing turns on a setting the paper does not publish; BLOOM's runs
(Megatron-DeepSpeed) fit the one constant of their own (layer_overhead_ms,
:func:`fit_layer_overhead`), not the efficiency. Why each source sits where it does:
docs/accuracy/fit_history.md."""


def breakdown(case, efficiency: float) -> dict[str, float]:
    """Share of the estimated step time by term (:data:`xpar.estimate.cost.TIME_TERMS`, those
    above zero) of a case at ``efficiency``, with ``error`` (predicted / published - 1)."""
    _, spec, assume, ref, _ = case
    e = estimate(with_fitted(spec, efficiency), assume)
    out = {k: v / e.time_per_step_s for k, v in e.time_breakdown.items() if v > 0}
    out["error"] = predicted(case, efficiency) / ref - 1
    return out


def fit_layer_overhead(cases: list, efficiency: float, lo: float = 0.0, hi: float = 50.0) -> float:
    """The ``layer_overhead_ms`` (Assumptions) minimising the median |error| of ``cases`` at the matmul
    ``efficiency`` (:func:`golden_min` over [lo, hi] ms, 16 steps, to 0.1 ms): Megatron-DeepSpeed's cost
    per layer and micro-batch, fitted on BLOOM's runs (benchmarks/estimate_calibration.py)."""
    import statistics

    def cost(x: float) -> float:
        moved = [(g, spec, replace(a, layer_overhead_ms=x), ref, metric) for g, spec, a, ref, metric in cases]
        return statistics.median(abs(e) for e in errors(moved, efficiency))
    return round(golden_min(cost, lo, hi, 16), 1)


def fit(cases_by_source: dict, exclude: str = "", fitted: Optional[dict] = None) -> dict[str, float]:
    """One matmul efficiency per GPU family from every source but ``exclude`` and the
    :data:`CHECK_ONLY` sources; a family with no source left takes the A100 value (the
    transfer the held-out check measures). ``fitted``: a cache of family fits by their cases
    (leave-one-source-out refits only the family of the source it leaves out)."""
    fams: dict[str, list] = {}
    for name, cases in cases_by_source.items():
        if name != exclude and name not in CHECK_ONLY:
            for c in cases:
                fams.setdefault(c[0], []).append(c)
    fitted = {} if fitted is None else fitted
    eff = {}
    for gpu, cs in fams.items():
        key = (gpu, tuple(map(id, cs)))
        eff[gpu] = fitted[key] = fitted[key] if key in fitted else fit_efficiency(cs)
    for gpu in {c[0] for cs in cases_by_source.values() for c in cs}:
        eff.setdefault(gpu, eff.get("A100", 0.66))
    return eff


def leave_one_source_out(cases_by_source: dict) -> dict[str, dict]:
    """Per source: the efficiencies fitted on all sources and on all but this one, and the
    relative errors of its rows under each ('calibration' and 'held_out')."""
    fitted: dict = {}
    everything = fit(cases_by_source, fitted=fitted)
    out = {}
    for name, cases in cases_by_source.items():
        without = fit(cases_by_source, exclude=name, fitted=fitted)
        out[name] = {"fit_all": everything, "fit_without": without,
                     "calibration": [errors([c], everything[c[0]])[0] for c in cases],
                     "held_out": [errors([c], without[c[0]])[0] for c in cases]}
    return out
