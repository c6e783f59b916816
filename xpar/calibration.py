"""Public layouts for calibration and what-if studies: configs built through validation.

The cost model (:mod:`xpar.estimate.cost`) is a pure function of a RunSpec; this module
builds RunSpecs of published layouts (Narayanan et al. 2021 Table 1) with
:func:`xpar.validate.validate`, so the cost model never imports validation.
"""
from __future__ import annotations

from xpar.estimate.cost import Assumptions, estimate
from xpar.spec import RunSpec


def preset(group: str, name: str) -> dict:
    """A config-group preset from conf/ as a plain dict."""
    from omegaconf import OmegaConf

    from xpar.presets import conf_dir
    return OmegaConf.to_container(OmegaConf.load(conf_dir() / group / f"{name}.yaml"))


def make_spec(model: dict, parallel: dict, hardware: dict, train: dict) -> RunSpec:
    """A validated estimate-mode RunSpec from plain group dicts (through xpar.validate; what-if
    studies: a layout that does not fit device memory is returned, not refused)."""
    from xpar.validate import validate

    cfg = {"model": model, "parallel": parallel, "hardware": hardware, "train": train,
           "tracking": {"enabled": False}, "run": {"mode": "estimate", "progress": False}}
    return validate(cfg)


def megatron_2021_spec(row: dict, micro_batch_size: int = 1, hardware: str = "a100_80gb_1024gpu") -> RunSpec:
    """RunSpec of one row of Narayanan et al. 2021 Table 1 (keys as in
    megatron_2021_table1.csv): GPT (GELU, LayerNorm, learned positions, tied embeddings,
    biases), s = 2048, V = 51200, bf16 mixed precision, interleaved 1F1B with v = smallest
    divisor > 1 of the layers per rank, full recompute, on ``hardware`` resized to the row's
    GPU count (8 per node)."""
    h, l, t, pp, gpus = (int(row[k]) for k in ("hidden", "layers", "tp", "pp", "gpus"))
    model = dict(name=f"gpt_{row['params_b']}b", n_layers=l, hidden=h, n_heads=int(row["heads"]), n_kv_heads=None,
                 ffn_hidden=4 * h, vocab_size=51200, seq_len=2048, activation="gelu", norm="layernorm",
                 position="learned", tied_embeddings=True, bias=True)
    per_rank = l // pp
    v = next((d for d in range(2, per_rank + 1) if per_rank % d == 0), 1) if pp > 1 else 1
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
