"""Hardware presets inherit from node presets (issue 41 point 4) and read the same as before.

tests/data/hardware_presets.json holds every preset as the tree before inheritance composed it
(Hydra, the schema loader, the published-run loader: benchmarks/hardware_presets.py --write)."""
import json

import pytest
from omegaconf import OmegaConf

from benchmarks.hardware_presets import SNAPSHOT, differences, snapshot
from tests.conftest import spec_for
from xpar.config.checks.hardware import hardware_value_problems, load_hardware_preset
from xpar.config.presets import conf_dir, load_preset
from xpar.estimate.cost import estimate
from xpar.estimate.compute.kernels import device_of

KERNEL_FIELDS = {"sm_count", "gemm_tile_m", "gemm_tile_n", "gemm_efficiency", "gemm_efficiency_fp8",
                 "attention_efficiency", "attention_bwd_efficiency", "kernel_launch_us", "sustained_efficiency", "sharp"}
"""Schema fields added after the snapshot: the kernel model's (issue 42) and SHARP (issue 43)."""


@pytest.mark.slow  # integration-sized (conftest.INTEGRATION): runs in the full suite, not the fast loop
def test_every_preset_reads_as_before_the_inheritance():
    before = json.loads(SNAPSHOT.read_text())
    diff, added = differences(before, snapshot(sorted(before)))
    assert diff == []
    assert {a.split("] ")[1].split(" = ")[0] for a in added} <= KERNEL_FIELDS  # only the new schema fields


@pytest.mark.parametrize("name", ["a100_80gb_64gpu", "h100_80gb_16gpu", "h800_80gb_2048gpu"])
def test_cluster_presets_state_only_what_differs_from_their_node(name):
    own = OmegaConf.load(conf_dir() / "hardware" / f"{name}.yaml")
    assert list(own.defaults) in (["a100_80gb_node", "_self_"], ["h100_80gb_node", "_self_"])
    assert len(own) <= 6  # defaults, name, nodes (+ what the part changes: the H800's NVLink and name)


def test_load_preset_puts_the_file_where_self_stands(tmp_path, monkeypatch):
    (tmp_path / "hardware").mkdir()
    (tmp_path / "hardware" / "base.yaml").write_text("a: 1\nb: 1\n")
    (tmp_path / "hardware" / "last.yaml").write_text("defaults: [base, _self_]\nb: 2\n")
    (tmp_path / "hardware" / "first.yaml").write_text("defaults: [_self_, base]\nb: 2\n")
    (tmp_path / "hardware" / "implicit.yaml").write_text("defaults: [base]\nb: 3\n")
    monkeypatch.setattr("xpar.config.presets.conf_dir", lambda: tmp_path)
    assert dict(load_preset("hardware", "last")) == {"a": 1, "b": 2}
    assert dict(load_preset("hardware", "first")) == {"a": 1, "b": 1}
    assert dict(load_preset("hardware", "implicit")) == {"a": 1, "b": 3}


NEW = ["h200_141gb_64gpu", "b200_180gb_64gpu", "gb200_nvl72_576gpu"]


@pytest.mark.parametrize("train", ["cluster", "cluster_fp8"])
def test_the_existing_estimate_prices_a_70b_layout_on_the_new_presets(train):
    """Llama 2 70B, tp 8 + ZeRO-3 over dp (parallel=70b_64gpu) on H200, B200 and GB200 clusters, bf16 and FP8."""
    rate = {}
    for hw in ["h100_80gb_64gpu"] + NEW:  # check_run refuses a layout that does not fit: these fit
        e = estimate(spec_for("parallel=70b_64gpu", f"hardware={hw}", f"train={train}", "run.mode=estimate"))
        assert e.time_per_step_s > 0 and 0 < e.mfu < 1
        rate[hw] = e.tokens_per_s_per_device
    assert rate["b200_180gb_64gpu"] > 1.4 * rate["h100_80gb_64gpu"]  # 2.3x the peak, 2.4x the HBM
    assert rate["h200_141gb_64gpu"] >= rate["h100_80gb_64gpu"]  # the same compute, faster HBM


def test_new_presets_carry_their_own_fp8_efficiency_and_the_kernel_models_fields():
    fp8 = {}
    for name in NEW + ["h100_80gb_64gpu"]:
        hw = load_hardware_preset(name)
        assert hardware_value_problems(hw) == {}
        fp8[hw.gpu] = hw.fp8_matmul_efficiency
        device = device_of(hw)
        assert device.sms >= 132 and set(device.peak_flops) >= {"bf16", "fp8"}
    assert len(set(fp8.values())) == 4  # one per device, not one factor
    gb200 = load_hardware_preset("gb200_nvl72_576gpu")
    assert (gb200.devices_per_node, gb200.nics_per_node, gb200.intra_node_gb_per_s) == (72, 72, 900)
