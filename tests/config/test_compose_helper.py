"""tests/conftest.py's compose() (the group choices composed once, the value overrides applied by
Hydra's own code) gives what Hydra's compose of all the overrides gives, refusals included."""
import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from tests.conftest import _composed, compose

CASES = [
    ("tracking=off", "model=70b", "parallel.tp=8", "train.steps=3"),
    ("parallel.tp=2", "parallel=pp", "parallel.schedule=zbv", "hardware.devices_per_node=1"),  # value before group
    ("model=7b", "hardware=a100_80gb_64gpu", "train=cluster", "framework=megatron", "parallel.zero_stage=3"),
    ("parallel=175b_1024gpu", "train.global_batch_size=1536"),  # a cluster preset overriding /train
    ("train.lr_schedule=cosine", "train.lr_schedule=constant"),  # the last of one key wins
    ("hydra.run.dir=/tmp/x", "model=tiny", "train.steps=2"),  # a hydra.* override goes to Hydra's compose
]


@pytest.mark.parametrize("overrides", CASES)
def test_compose_equals_hydras_compose_of_every_override(overrides):
    got, want = compose(*overrides), _composed(tuple(overrides))
    assert OmegaConf.to_yaml(got) == OmegaConf.to_yaml(want)
    assert OmegaConf.is_struct(got) and OmegaConf.is_struct(want)


@pytest.mark.parametrize("bad", ["train.nope=3", "train.steps=abc", "train.steps=1,2"])
def test_a_refused_value_override_is_refused_as_hydra_refuses_it(bad):
    with pytest.raises(ConfigCompositionException) as ours:
        compose("model=tiny", bad)
    with pytest.raises(ConfigCompositionException) as hydras:
        _composed(("model=tiny", bad))
    assert str(ours.value) == str(hydras.value)
