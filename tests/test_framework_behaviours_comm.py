"""Framework behaviours of 2024-26 runs (issue 43), second part: memory refusals that name the nearest
settings that fit; Megatron-Core's per-chunk dp overlap; SHARP; FP8 parameter gathers; Transformer
Engine's FP8 weight copies. Each with its source in the profile (conf/framework/*.yaml). Pure CPU."""
from __future__ import annotations

import pytest

from tests.conftest import spec_for
from xpar.config.checks import ConfigError

GPT3 = ("model=175b", "parallel=175b_1024gpu", "hardware=a100_80gb_1024gpu", "framework=megatron_core")


def test_a_memory_refusal_names_the_nearest_settings_that_fit_and_each_works_when_followed():
    """GPT-3 175B under Megatron-Core with the source's recompute unstated (none) and micro-batch 2:
    refused, its first line names the nearest setting that fits; the list holds Megatron's partial
    full recompute (--recompute-num-layers: fewer blocks than a chunk holds), and every line estimates."""
    given = (*GPT3, "parallel.recompute=none", "train.micro_batch_size=2")
    with pytest.raises(ConfigError) as e:
        spec_for(*given)
    [msg] = e.value.problems
    first = msg.splitlines()[0]
    assert "does not fit device memory" in first and "Nearest settings that fit: " in first
    nearest = first.split("Nearest settings that fit: ")[1].split(" (estimated")[0]
    listed = [line.strip().split(":")[0] for line in msg.splitlines() if line.startswith("      ")]
    assert listed[0] == nearest
    partial = [x for x in listed if "parallel.recompute_layers=" in x]
    assert partial and "parallel.recompute=full" in partial[0]
    for overrides in listed:
        followed = spec_for(*given, *overrides.split())
        assert followed.mode == "estimate"
    k = int(partial[0].split("parallel.recompute_layers=")[1].split()[0])
    assert 0 < k < max(followed.layout.layer_split)
