"""torchtitan's H100 FP8 and context-parallel rows (tests/data/cp_fp8_h100.csv; pytorch/torchtitan
benchmarks/llama3_h100_202412_torchtitan.md, issue 42): each row gets the global batch its source implies (dp x local
batch: torchtitan's training.batch_size is per data-parallel rank, cp ranks share its sequences), Table 6's micro-batches
(torchtitan's default pipeline micro-batch count, the pp degree), and the GPU it ran on (96 GB of HBM2e at 2.4 TB/s,
conf/hardware/h100_96gb_500w_node.yaml); the accuracy page prices them; torchtitan's SDPA attention runs at
FlashAttention-2's H100 rates (framework.attention_kernel sdpa), which A100 presets leave at their own."""
from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest

from xpar.calibrate.cp_fp8 import cp_fp8_case
from xpar.calibrate.published import framework_assumptions, preset, read_table
from xpar.config.schema import HardwareConfig
from xpar.estimate.compute.kernel_costs import attention_fractions, kernel_layer_costs

ROOT = Path(__file__).resolve().parents[2]
ROWS = {r["id"]: r for r in read_table(ROOT / "tests" / "data" / "cp_fp8_h100.csv")}
TITAN = [k for k in ROWS if k.startswith("torchtitan")]


@pytest.mark.parametrize("row_id, dp, local_batch, micro_batches", [
    ("torchtitan_llama31_8b_fp8_8_cp1", 8, 1, 1),  # Table 2: FSDP 8, CP 1, local batch 1
    ("torchtitan_llama31_8b_fp8_8_cp8", 1, 1, 1),  # FSDP 1, CP 8: one sequence of 262,144 tokens a step
    ("torchtitan_llama31_405b_fp8_512_cp1", 8, 8, 8),  # Table 6: local batch 8 over pp 8 micro-batches of 1
    ("torchtitan_llama31_405b_fp8_512_cp4", 2, 8, 8),
    ("torchtitan_llama31_8b_fp8_8_fsdp", 8, 2, 1),  # Table 1 states global batch 16
])
def test_a_row_gets_its_global_batch_and_micro_batches(row_id, dp, local_batch, micro_batches):
    spec = cp_fp8_case(ROWS[row_id])[0]
    assert spec.layout.dp == dp and spec.train.global_batch_size == dp * local_batch
    assert spec.micro_batches == micro_batches and spec.train.micro_batch_size == local_batch // micro_batches
    assert spec.layout.dp * spec.layout.cp * spec.tp * spec.pp == int(ROWS[row_id]["gpus"])


def test_the_rows_are_priced_on_the_96gb_hbm2e_part_not_the_80gb_preset():
    """Every torchtitan row: 96 GB at 2.4 TB/s (the source's "Hardware"); an 80 GB H100 row stays on the SXM preset."""
    for row_id in TITAN:
        hw = cp_fp8_case(ROWS[row_id])[0].hardware
        assert (hw.device_memory_gb, hw.hbm_tb_per_s, hw.gpu) == (96, 2.4, "H100-SXM-96GB-HBM2e-500W"), row_id
    assert len(TITAN) == 9
    other = cp_fp8_case(ROWS["mlm_llama3_405b_fp8_1024"])[0].hardware
    assert (other.device_memory_gb, other.hbm_tb_per_s) == (85.0, 3.35)


def test_the_accuracy_page_prices_every_row_the_case_builds():
    """docs/accuracy/five_dimensions.md: the torchtitan line has its 9 rows, and the pooled count is every row
    cp_fp8_case prices (46: 37 before these)."""
    page = (ROOT / "docs" / "accuracy" / "five_dimensions.md").read_text()
    priced = sum(cp_fp8_case(r) is not None for r in ROWS.values())
    assert priced == 46 and f"over {priced} rows" in page
    assert re.search(r"^\| torchtitan \| 9 \| 0 \|", page, re.M)
    assert sum(int(m) for m in re.findall(r"^\| [a-z0-9]+ \| (\d+) \|", page, re.M)) == priced


def test_torchtitans_attention_runs_at_flashattention2s_h100_rates():
    """On H100 the attention core of torchtitan (SDPA: FlashAttention-2) is slower than Megatron-Core's (cuDNN) by the
    preset's FA2/cuDNN fractions, forward and backward; the GEMMs are the same."""
    spec, titan, _, _ = cp_fp8_case(ROWS["torchtitan_llama31_8b_fp8_8_cp2"])
    costs = {name: kernel_layer_costs(spec, replace(titan, attention_kernel=name)) for name in ("sdpa", "cudnn")}
    assert titan.attention_kernel == "sdpa" and framework_assumptions("megatron_core").attention_kernel == "cudnn"
    assert costs["sdpa"]["mm_f"] > 1.3 * costs["cudnn"]["mm_f"] and costs["sdpa"]["mm_b"] > 1.3 * costs["cudnn"]["mm_b"]
    assert costs["sdpa"]["mem_f"] == costs["cudnn"]["mem_f"]


def test_each_attention_kernel_reads_its_own_h100_fractions_and_a100_keeps_its_own():
    """H100: FlashAttention-3 and cuDNN from 9.5 (the device's own), 2024's cuDNN and FlashAttention-2 (sdpa: torch
    SDPA's flash backend) at the preset's fractions from Shah et al. 2024 Fig. 5-6; A100's attention_efficiency is
    FlashAttention-2's already: no per-kernel fields, the same fractions for every kernel. An unknown kernel is refused."""
    h100 = HardwareConfig(**preset("hardware", "h100_80gb_node"))
    a100 = HardwareConfig(**preset("hardware", "a100_80gb_node"))
    assert attention_fractions(h100, "sdpa") == attention_fractions(h100, "fa2") == (0.35, 0.33)
    assert attention_fractions(h100, "fa3") == attention_fractions(h100, "cudnn") == (0.65, 0.52)
    assert attention_fractions(h100, "cudnn_2024") == (0.545, 0.522)
    assert {attention_fractions(a100, k) for k in ("fa3", "cudnn", "cudnn_2024", "fa2", "sdpa")} == {(0.68, 0.58)}
    with pytest.raises(ValueError, match="attention_kernel"):
        attention_fractions(h100, "fa4")
