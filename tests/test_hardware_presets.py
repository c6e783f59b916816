"""Hardware presets inherit from node presets (issue 41 point 4) and read the same as before.

tests/data/hardware_presets.json holds every preset as the tree before inheritance composed it
(Hydra, the schema loader, the published-run loader: benchmarks/hardware_presets.py --write)."""
import json

import pytest
from omegaconf import OmegaConf

from benchmarks.hardware_presets import SNAPSHOT, differences, snapshot
from xpar.config.presets import conf_dir, load_preset

KERNEL_FIELDS = {"sm_count", "gemm_tile_m", "gemm_tile_n", "gemm_efficiency", "gemm_efficiency_fp8",
                 "attention_efficiency", "attention_bwd_efficiency", "kernel_launch_us"}


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
