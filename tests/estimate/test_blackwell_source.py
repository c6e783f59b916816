"""tests/data/blackwell_published.csv: Megatron-Bridge's published B200 and GB200 runs (with same-release H100
controls), a check-only source for the Blackwell presets (issue 42). Its rows build as cp_fp8_case reads
cp_fp8_h100.csv once given the new GPUs' presets, no fit reads the file, and an NVL72 job of 256 GPUs is priced in
NVLink domains that divide it."""
from __future__ import annotations

from pathlib import Path

import pytest

from xpar.calibrate.cp_fp8 import NEW_GPU_PRESETS, cp_fp8_case, sized_hardware
from xpar.calibrate.published import SOURCES, load_cases, preset, read_table

DATA = Path(__file__).resolve().parents[1] / "data"
ROWS = read_table(DATA / "blackwell_published.csv")
REPO = DATA.parents[1]


def test_every_row_builds_a_case_with_its_published_layout_on_its_gpus_preset():
    """Each row's spec holds the row's degrees, batch and GPU count, on the preset of its GPU (nothing defaulted)."""
    assert len(ROWS) >= 20 and {r["gpu"] for r in ROWS} >= {"B200", "GB200", "H200"}
    for row in ROWS:
        spec, _, metric, value = cp_fp8_case(row, NEW_GPU_PRESETS)
        lay = spec.layout
        got = (lay.tp, lay.pp, lay.cp, lay.ep, lay.dp, spec.train.micro_batch_size, spec.train.global_batch_size)
        want = tuple(int(row[k] or 1) for k in ("tp", "pp", "cp", "ep", "dp", "micro_batch", "global_batch"))
        assert got == want and lay.world_size == int(row["gpus"]), row["id"]
        assert spec.hardware.gpu.split("-")[0] == row["gpu"] and value == float(row["value"]), row["id"]


def test_the_default_presets_price_only_h100_and_h800_rows():
    """cp_fp8_case without ``gpu_presets`` returns None for a B200 or GB200 row, as before (estimate_five.py and the
    planner's published checks keep their rows)."""
    assert all(cp_fp8_case(r) is None for r in ROWS if r["gpu"] != "H100")
    assert all(cp_fp8_case(r) is not None for r in ROWS if r["gpu"] == "H100")


def test_the_source_is_check_only():
    """No fit or accuracy page reads the file: SOURCES does not name it, nor does any module's path literal but its
    benchmark's."""
    assert "blackwell_published.csv" not in {fname for fname, _, _ in SOURCES.values()}
    assert all("blackwell" not in name for name in load_cases(DATA))
    readers = [p for p in [*(REPO / "xpar").rglob("*.py"), *(REPO / "benchmarks").glob("*.py")]
               if '"blackwell_published.csv"' in p.read_text()]
    assert [p.name for p in readers] == ["estimate_blackwell.py"]


def test_a_256_gpu_nvl72_job_is_four_nvlink_domains_of_64_each_gpu_with_its_nic():
    """72 does not divide 256: the largest divisor that fits one rack (64) is the domain; one NIC per GPU kept."""
    hw = sized_hardware(preset("hardware", "gb200_nvl72_node"), 256)
    assert (hw["devices_per_node"], hw["nodes"], hw["nics_per_node"]) == (64, 4, 64)
    assert (sized_hardware(preset("hardware", "b200_180gb_node"), 128)["nodes"],
            sized_hardware(preset("hardware", "gb200_nvl72_node"), 8)["devices_per_node"]) == (16, 8)
    with pytest.raises(ValueError, match="gpus must be >= 1"):
        sized_hardware(preset("hardware", "b200_180gb_node"), 0)


def test_a_rows_recipe_dispatcher_is_the_profiles_dispatcher():
    """A note naming the recipe's HybridEP or DeepEP dispatcher prices it (framework.ep_dispatcher); else alltoall."""
    by_id = {r["id"]: r for r in ROWS}
    got = {k: cp_fp8_case(by_id[k], NEW_GPU_PRESETS)[1].ep_dispatcher for k in
           ("mbridge_260401_b200_dsv3_mxfp8_256", "mbridge_260401_b200_qwen3_30b_mxfp8_8",
            "mbridge_260401_h100_gptoss_bf16_64")}
    assert list(got.values()) == ["deepep", "hybridep", "alltoall"]
