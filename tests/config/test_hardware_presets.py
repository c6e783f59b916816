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
                 "attention_efficiency", "attention_bwd_efficiency", "kernel_launch_us", "sustained_efficiency", "sharp",
                 "mxfp8", "attention_efficiency_fa2", "attention_bwd_efficiency_fa2", "attention_efficiency_cudnn_2024",
                 "attention_bwd_efficiency_cudnn_2024", "gemm_tile_fixed_us_fp8", "attention_half_seq"}
"""Schema fields added after the snapshot: the kernel model's (issue 42, its FP8 recipes: mxfp8; FlashAttention-2's
and 2024 cuDNN's fractions; an FP8 GEMM tile's fixed cost; the attention's key-length curve) and SHARP (issue 43)."""


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


A100_40GB = ["a100_40gb_node", "a100_40gb_64gpu", "p4d_24xlarge_node"]


@pytest.mark.parametrize("name", A100_40GB)
def test_a100_40gb_presets_are_the_a100_with_the_40gb_parts_memory_and_keep_its_fits(name):
    """NVIDIA A100 datasheet: A100 40GB SXM, 40 GB HBM2 at 1,555 GB/s; the same GA100 as the 80 GB part, so every
    fitted field (matmul_efficiency, sustained_efficiency, the kernel model's fractions) is inherited."""
    hw, a100 = load_hardware_preset(name), load_hardware_preset("a100_80gb_node")
    assert hardware_value_problems(hw) == {}
    assert (hw.gpu, hw.device_memory_gb, hw.hbm_tb_per_s) == ("A100-SXM4-40GB", 42.3, 1.555)
    same = ("peak_tflops", "sm_count", "intra_node_gb_per_s", "matmul_efficiency", "sustained_efficiency",
            "gemm_efficiency", "attention_efficiency", "attention_bwd_efficiency", "framework_overhead_gb")
    assert {k: getattr(hw, k) for k in same} == {k: getattr(a100, k) for k in same}
    own = OmegaConf.load(conf_dir() / "hardware" / f"{name}.yaml")
    assert own.defaults[-1] == "_self_" and len(own) <= 10  # states what differs, inherits the rest


def test_the_p4d_node_has_four_100_gbps_efa_cards_and_a_cluster_of_them_is_nodes():
    """AWS p4d.24xlarge: 400 Gbps EFA over 4 network cards: 12.5 GB/s each, 50 GB/s a node (DGX A100: 200)."""
    p4d, dgx = load_hardware_preset("p4d_24xlarge_node"), load_hardware_preset("a100_40gb_64gpu")
    assert (p4d.nics_per_node, p4d.inter_node_gb_per_s, p4d.devices_per_node) == (4, 12.5, 8)
    assert p4d.nics_per_node * p4d.inter_node_gb_per_s * 4 == dgx.nics_per_node * dgx.inter_node_gb_per_s
    assert (dgx.nodes, p4d.nodes) == (8, 1)


def _rate(*overrides: str) -> float:
    return estimate(spec_for("model=7b", "parallel.dp=64", "parallel.zero_stage=3", "parallel.recompute=full",
                             "train=cluster", "train.micro_batch_size=1", "run.mode=estimate", *overrides)
                    ).tokens_per_s_per_device


def test_the_40gb_preset_prices_what_the_80gb_preset_with_its_memory_and_hbm_overridden_priced():
    """The refusal hunt's workaround (hardware.device_memory_gb=40 on an 80GB preset) kept the 80 GB part's HBM
    bandwidth; the preset is that workaround done right, and a cluster of p4d nodes is slower across nodes."""
    forty = _rate("hardware=a100_40gb_64gpu")
    assert forty == _rate("hardware=a100_80gb_64gpu", "hardware.device_memory_gb=42.3", "hardware.hbm_tb_per_s=1.555")
    assert forty < _rate("hardware=a100_80gb_64gpu")  # memory-bound passes at 1.555 TB/s, not 2.039
    assert _rate("hardware=p4d_24xlarge_node", "hardware.nodes=8") < forty  # ZeRO-3 gathers over 50, not 200, GB/s


def test_device_memory_changed_on_a_preset_says_which_figures_it_kept_and_names_the_part():
    """The hunt's trap: hardware.device_memory_gb=40 on an 80 GB A100 preset kept the 80 GB part's name and HBM."""
    seven = ("model=7b", "parallel.dp=64", "parallel.zero_stage=3", "parallel.recompute=full", "train=cluster",
             "run.mode=estimate")
    note = [n for n in spec_for(*seven, "hardware=a100_80gb_64gpu", "hardware.device_memory_gb=40").notes
            if n.startswith("hardware.device_memory_gb=40 ")]
    assert len(note) == 1 and "gpu=A100-SXM4-80GB" in note[0] and "hbm_tb_per_s=2.039" in note[0]
    assert "hardware=a100_40gb_node" in note[0] and "hardware=p4d_24xlarge_node" in note[0]
    quiet = [spec_for(*seven, *o).notes for o in (["hardware=a100_40gb_64gpu"],  # the part itself
             ["hardware=a100_80gb_64gpu", "hardware.device_memory_gb=80"],  # within 10 %: the same part
             ["hardware=a100_80gb_64gpu", "hardware.device_memory_gb=40", "hardware.hbm_tb_per_s=1.555"])]  # said
    assert not [n for notes in quiet for n in notes if n.startswith("hardware.device_memory_gb")]
    h100 = [n for n in spec_for(*seven, "hardware=h100_80gb_64gpu", "hardware.device_memory_gb=40").notes
            if n.startswith("hardware.device_memory_gb")]
    assert len(h100) == 1 and "set hardware.gpu and hardware.hbm_tb_per_s" in h100[0]  # no 40 GB H100 preset
    renamed = [n for n in spec_for(*seven, "hardware=a100_80gb_64gpu", "hardware.device_memory_gb=40",
                                   "hardware.gpu=A100-SXM4-40GB").notes if n.startswith("hardware.device_memory_gb")]
    assert len(renamed) == 1 and "keeps the preset's hbm_tb_per_s=2.039" in renamed[0]  # the name alone changed
    assert "though hardware.gpu=A100-SXM4-40GB" in renamed[0] and "hardware=a100_40gb_node" in renamed[0]


def test_the_500w_h100_runs_its_compute_at_the_clock_its_power_limit_leaves():
    """torchtitan's 500 W H100 (96 GB HBM2e): compute rates at (500 / 700)^(1/3) of the SXM node's (power ~ f^3),
    its HBM at its own 2.4 TB/s."""
    sxm, capped = (load_preset("hardware", n) for n in ("h100_80gb_node", "h100_96gb_500w_node"))
    assert capped.sustained_efficiency / sxm.sustained_efficiency == pytest.approx((500 / 700) ** (1 / 3), abs=1e-3)
    assert capped.peak_tflops == sxm.peak_tflops and capped.hbm_tb_per_s == 2.4
