"""parallel.pipeline_micro_batches: a step's m micro-batches run as m / k pipeline schedules of k (NeMo AutoModel's
benchmark loop: one ``schedule.step`` per gradient-accumulation step), each with its own fill and drain."""
from __future__ import annotations

import pytest

from tests.conftest import spec_for
from xpar.config.checks import ConfigError
from xpar.estimate.cost import estimate

BASE = ("model=7b", "run.mode=estimate", "hardware=h100_80gb_8gpu", "parallel.pp=4", "parallel.dp=2",
        "parallel.schedule=interleaved_1f1b", "parallel.virtual_stages=2", "train.micro_batch_size=1",
        "parallel.recompute=full", "parallel.zero_stage=1", "train.dtype=bf16", "run.dry_run=false")


def est(*overrides: str):
    return estimate(spec_for(*BASE, *overrides, local_devices=8))


def test_four_runs_of_four_pay_four_bubbles():
    """m = 16 as 4 runs of 4: the bubble of one m = 4 step four times (relative 1e-9), above one run of 16; the
    work is the same; k = m and null agree."""
    runs = est("train.global_batch_size=32", "parallel.pipeline_micro_batches=4")
    one_run = est("train.global_batch_size=8")
    single = est("train.global_batch_size=32")
    assert runs.time_breakdown["bubble"] == pytest.approx(4 * one_run.time_breakdown["bubble"], rel=1e-9)
    assert runs.time_breakdown["bubble"] > 3 * single.time_breakdown["bubble"]
    assert runs.time_breakdown["matmul"] == single.time_breakdown["matmul"]
    assert runs.time_per_step_s == pytest.approx(single.time_per_step_s + runs.time_breakdown["bubble"]
                                                 - single.time_breakdown["bubble"], rel=1e-9)
    same = est("train.global_batch_size=32", "parallel.pipeline_micro_batches=16")
    assert same.time_per_step_s == single.time_per_step_s


def test_pipeline_micro_batches_must_divide_m_and_is_estimated_only():
    with pytest.raises(ConfigError) as e:
        spec_for(*BASE, "train.global_batch_size=32", "parallel.pipeline_micro_batches=3", local_devices=8)
    assert "must divide the step's 16 micro-batches" in str(e.value) and "[1, 2, 4, 8, 16]" in str(e.value)
    with pytest.raises(ConfigError) as e:
        spec_for("model=tiny", "parallel.pp=2", "parallel.dp=1", "train.global_batch_size=8",
                 "train.micro_batch_size=1", "parallel.pipeline_micro_batches=4")
    assert "parallel.pipeline_micro_batches=null" in str(e.value)
