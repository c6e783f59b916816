"""Estimate-mode RunSpecs of the runs in tests/data/known_runs.csv (published layouts known to have trained on
their hardware, some with a published peak memory): the memory-fit tests, the plan's known-run test and
benchmarks/memory_published.py build them here."""
from __future__ import annotations

from dataclasses import replace

from xpar.calibrate.published import make_spec, preset
from xpar.config.layout import balanced_split
from xpar.config.spec import RunSpec
from xpar.estimate.columns.stage_split import plan_split


def known_run_spec(row: dict) -> RunSpec:
    """Estimate-mode RunSpec of a tests/data/known_runs.csv row (Llama shapes for SwiGLU rows, GPT
    shapes otherwise), its hardware sized to the row's GPUs and device memory. ZeRO-1 with tp/pp (the
    framework's distributed optimizer, an estimate-only layout) is validated as ZeRO-0, then set. The ``compile``
    column sets train.compile ('model') and train.compile_loss ('+loss')."""
    llama = row["activation"] == "swiglu"
    model = dict(name=row["id"], n_layers=int(row["layers"]), hidden=int(row["hidden"]), n_heads=int(row["heads"]),
                 n_kv_heads=int(row["kv_heads"]), ffn_hidden=int(row["ffn"]), vocab_size=int(row["vocab"]),
                 seq_len=int(row["seq"]), activation="swiglu" if llama else "gelu",
                 norm="rmsnorm" if llama else "layernorm", position="rope" if llama else "learned",
                 tied_embeddings=False, bias=not llama)
    pp, v = int(row["pp"]), int(row.get("virtual_stages") or 1)
    n_stages, layers = pp * v, int(row["layers"])
    # BLOOM: Megatron-DeepSpeed's --pp-partition-method 'type:transformer|embedding' (tr11-176B-ml.slurm) counts
    # each embedding as a layer, so the first and last stages hold one block fewer (70 = 5 + 10 x 6 + 5)
    bloom = row.get("framework") == "deepspeed_bloom"
    split = (plan_split if bloom else balanced_split)(layers, n_stages)
    par = dict(name=row["id"], dp=int(row["dp"]), tp=int(row["tp"]), pp=pp, zero_stage=int(row["zero"]),
               micro_batches="auto", schedule=row.get("schedule") or "1f1b", virtual_stages=v,
               layer_split=split if pp > 1 else None, recompute=row["recompute"],
               sequence_parallel=row.get("sequence_parallel") == "true")
    hw = preset("hardware", "a100_80gb_8gpu")
    hw.update(name=row["gpu"], gpu=row["gpu"], device_memory_gb=float(row["gpu_memory_gb"]), nodes=int(row["gpus"]) // 8)
    compiled = (row.get("compile") or "").split("+")  # '', 'model' or 'model+loss' (the csv's header)
    tr = dict(micro_batch_size=int(row["micro_batch"]), global_batch_size=int(row["global_batch"]),
              dtype=row["dtype"], seq_len=int(row["seq"]), compile="model" in compiled,
              compile_loss="loss" in compiled)
    if par["zero_stage"] != 1 or (par["tp"] == 1 and par["pp"] == 1):
        return make_spec(model, par, hw, tr)
    s = make_spec(model, dict(par, zero_stage=0), hw, tr)
    return replace(s, layout=replace(s.layout, zero_stage=1))
