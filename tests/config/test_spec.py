"""RunSpec: each layout fact in its Layout alone; the params a run logs and the worker's copy lose nothing."""
from __future__ import annotations

from dataclasses import fields, replace

import pytest

from tests.conftest import compose
from xpar.config.layout import Layout
from xpar.config.schema import ParallelConfig
from xpar.config.spec import ParallelSettings, RunSpec, layout_fields
from xpar.config.validate import to_schema, validate

LINES = (
    ("parallel=dp",),
    ("parallel=pp", "parallel.schedule=zbv", "parallel.zero_stage=3"),  # zero 3 runs as 2: the one that runs is logged
    ("parallel=3d", "model=70b"),
    ("run.mode=estimate", "hardware=h100_80gb_64gpu", "model=mixtral_8x7b", "parallel.ep=8", "parallel.etp=1",
     "parallel.tp=2", "parallel.zero_stage=2", "parallel.zero_shard_size=4", "parallel.recompute=full",
     "parallel.recompute_layers=2", "train.micro_batch_size=1"),
    ("run.mode=estimate", "hardware=h100_80gb_64gpu", "model=70b", "parallel.tp=8", "parallel.pp=4", "parallel.cp=2",
     "parallel.sequence_parallel=true", "parallel.first_stage_layers=18", "parallel.micro_batches=8",
     "train.global_batch_size=auto", "train.seq_len=8192"),
)


def test_every_parallel_field_is_the_layouts_or_a_setting_never_both():
    owned = set(layout_fields(Layout(1, 1, 1, 1, 1, 1, (1,))))
    settings = {f.name for f in fields(ParallelSettings)}
    assert not owned & settings
    assert owned | settings == {f.name for f in fields(ParallelConfig)}
    assert owned - {"virtual_stages"} <= {f.name for f in fields(Layout)}  # v: the split's stages per rank


@pytest.mark.parametrize("line", LINES, ids=lambda line: " ".join(line)[:60])
def test_logged_parallel_group_is_the_resolved_group(line):
    """The params (``parallel.*``) are what the run's resolved copy of the group was: the user's group
    with dp, micro-batches, virtual stages, the ZeRO stage that runs and the layer split resolved."""
    c = to_schema(compose("tracking=off", "run.progress=false", *line))
    spec = validate(c, local_devices=2)
    lay = spec.layout
    resolved = replace(c.parallel, dp=lay.dp, micro_batches=lay.micro_batches, virtual_stages=lay.virtual_stages,
                       zero_stage=lay.zero_stage, layer_split=list(lay.layer_split))
    assert spec.parallel_config() == resolved
    assert "auto" not in (spec.parallel_config().dp, spec.parallel_config().micro_batches)


@pytest.mark.parametrize("line", LINES, ids=lambda line: " ".join(line)[:60])
def test_to_dict_from_dict_round_trips(line):
    spec = validate(to_schema(compose("tracking=off", "run.progress=false", *line)), local_devices=2)
    back = RunSpec.from_dict(spec.to_dict())
    assert back == spec and back.layout == spec.layout and back.parallel_config() == spec.parallel_config()
    assert not hasattr(back.parallel, "zero_stage")  # the layout's fact lives in the layout alone
