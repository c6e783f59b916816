"""Model variants of published runs that xpar refused (issue 43): OPT's ReLU and Nemotron-4's squared ReLU
(accepted, priced as GELU's two matrices, executed as their functions) and ALiBi positions (BLOOM, MPT,
BloombergGPT: estimated without position parameters, refused in execute mode)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import compose
from xpar.config.checks import ConfigError
from xpar.config.schema import ModelConfig
from xpar.config.validate import validate
from xpar.estimate.cost import estimate
from xpar.models.shapes import param_count
from xpar.models.transformer import MLP

GPT3 = ("parallel=175b_1024gpu", "hardware=a100_80gb_1024gpu")  # GELU, tp8 x pp16 on 1024 A100


def _spec(*overrides: str):
    return validate(compose("tracking=off", "run.progress=false", *overrides), local_devices=2)


@pytest.mark.parametrize("act", ["relu", "squared_relu"])
def test_non_gated_activation_is_accepted_and_priced_as_gelu(act):
    """The 175B preset under ReLU / squared ReLU: the same step time and peak memory as under GELU
    (same matmuls, the same activations kept), where validation refused the value before."""
    gelu, other = estimate(_spec(*GPT3)), estimate(_spec(*GPT3, f"model.activation={act}"))
    assert other.time_per_step_s == gelu.time_per_step_s
    assert other.memory.total == gelu.memory.total


@pytest.mark.parametrize("act, fn", [("relu", F.relu), ("squared_relu", lambda x: F.relu(x) ** 2),
                                     ("gelu", lambda x: F.gelu(x, approximate="tanh"))])
def test_non_gated_mlp_executes_its_function(act, fn):
    """The executed MLP is w2(act(w1 x)) with two matrices."""
    torch.manual_seed(0)
    mlp = MLP(ModelConfig(hidden=8, n_heads=2, ffn_hidden=16, activation=act))
    x = torch.randn(2, 3, 8)
    assert mlp.w3 is None
    torch.testing.assert_close(mlp(x), mlp.w2(fn(mlp.w1(x))))


def test_alibi_is_estimated_without_position_parameters_and_refused_in_execute_mode():
    """ALiBi adds no parameters (the 175B preset's learned table of 2048 x 12288 goes) and no matmul; the
    executed model has no ALiBi, so a run on the local workers is refused with the way to run or estimate it."""
    learned, alibi = _spec(*GPT3), _spec(*GPT3, "model.position=alibi")
    assert param_count(learned.model).total - param_count(alibi.model).total == 2048 * 12288
    assert estimate(alibi).time_per_step_s == pytest.approx(estimate(learned).time_per_step_s, rel=1e-3)
    with pytest.raises(ConfigError, match="model.position=alibi is estimated, not executed"):
        _spec("model.position=alibi")  # the tiny model on 2 local workers: execute mode


def test_qk_norm_is_refused_in_execute_mode_where_the_model_has_no_qk_norm():
    """model.qk_norm=true ran the tiny model on the local workers without any q/k norm (the executed attention has
    none; the key is read by the estimate alone): a run of something the user did not ask for. Refused with the
    setting that runs it; the estimate takes it."""
    with pytest.raises(ConfigError, match=r"model.qk_norm=true \(Qwen3's QK-norm\) is estimated, not executed") as e:
        _spec("model.qk_norm=true")
    assert "run it with model.qk_norm=false" in str(e.value) and len(str(e.value).splitlines()) == 1
    assert _spec("model.qk_norm=false").model.qk_norm is False
    assert _spec(*GPT3, "model.qk_norm=true").model.qk_norm is True


@pytest.mark.parametrize("overrides, line", [
    (("model.sliding_window_pattern=2",), "model.sliding_window_pattern=2 needs model.sliding_window > 0"),
    (("model.sliding_window=16", "model.sliding_window_pattern=1"), "makes every layer full attention"),
    (("model.sliding_window=16", "model.sliding_window_pattern=5"), "leaves no full layer among model.n_layers=4: "
                                                                    "set model.sliding_window_pattern=2 (any of 2..4)"),
    (("model.sliding_window=-8",), "model.sliding_window must be an integer >= 0, got -8"),
])
def test_sliding_window_refusals_are_one_line_each(overrides, line):
    """A pattern without a window, a pattern that leaves no local layer or no full one, a negative window: one
    line each, with values that work."""
    with pytest.raises(ConfigError) as e:
        _spec("run.mode=estimate", *overrides)
    lines = [x for x in str(e.value).splitlines() if "sliding_window" in x]
    assert len(lines) == 1 and line in lines[0], str(e.value)


def test_sliding_window_is_accepted_and_executed_locally():
    """gpt-oss's pattern on the tiny model is accepted in execute mode: layers 0 and 2 local, 1 and 3 full."""
    spec = _spec("model.sliding_window=8", "model.sliding_window_pattern=2")
    assert [spec.model.is_local_layer(i) for i in range(4)] == [True, False, True, False]


def test_an_estimate_says_when_the_kept_graph_and_qk_norm_settings_price_nothing():
    """framework.moe_recompute_graph_kept=true without full recompute (or on a dense model), and model.qk_norm=true
    outside such a kept graph (its memory; its time is priced), were accepted silently; the estimate now says so in a note.
    Where they are priced (a MoE model under full recompute with the kept graph), no such note."""
    est = ("run.mode=estimate", "hardware=h100_80gb_8gpu", "model=moe_tiny", "framework.moe_recompute_graph_kept=true",
           "model.qk_norm=true")
    unused = [n for n in _spec(*est).notes if "prices nothing here" in n or "saved inputs are not in the memory estimate" in n]
    assert len(unused) == 2 and "got recompute=none, model.n_experts=4" in unused[0], unused
    dense = _spec(*est, "model=tiny", "parallel.recompute=full").notes
    assert any("moe_recompute_graph_kept=true prices nothing here" in n for n in dense)
    priced = _spec(*est, "parallel.recompute=full").notes
    assert not any("prices nothing here" in n or "saved inputs are not in the memory estimate" in n for n in priced), priced
    assert not any("prices nothing here" in n for n in _spec("run.mode=estimate", "hardware=h100_80gb_8gpu").notes)
