"""Mixture-of-experts models (issue 30): published parameter counts, the model's parameters as the
cost model writes them out, routing, FLOPs of the active parameters, and the config checks."""
from dataclasses import replace

import pytest
import torch

from tests.conftest import spec_for
from xpar.calibrate.published import preset
from xpar.config.schema import ModelConfig
from xpar.estimate.compute.flops import forward_flops_per_token
from xpar.estimate.memory.model_states import _meta_shapes, _model_key
from xpar.models.shapes import param_count
from xpar.models.transformer import MoE, Transformer, group_limited


def model(name: str) -> ModelConfig:
    return ModelConfig(**preset("model", name))


@pytest.mark.parametrize("name, total, active, rel_total, rel_active", [
    ("mixtral_8x7b", 46.7e9, 12.9e9, 0.001, 0.005),  # Jiang et al. 2024: 46.7B, 12.9B active
    ("deepseek_v3", 671e9, 37e9, 0.005, 0.05),  # DeepSeek-AI 2024: 671B, 37B active (MLA as MHA: +1.2B)
])
def test_published_parameter_counts(name, total, active, rel_total, rel_active):
    count = param_count(model(name))
    assert count.total == pytest.approx(total, rel=rel_total)
    assert count.active == pytest.approx(active, rel=rel_active)


@pytest.mark.parametrize("name", ["moe_tiny", "tiny"])
def test_the_cost_models_shapes_are_the_models(name):
    """The estimate writes the parameters out without torch (xpar.estimate.memory.model_states._meta_shapes,
    experts in the blocks after first_dense_layers): equal to the model built on the meta device, and
    to the analytic count."""
    cfg = model(name)
    with torch.device("meta"):
        real = [(k, tuple(p.shape)) for k, p in Transformer(cfg).named_parameters()]
    from xpar.config.layout import Layout
    from xpar.estimate.memory.model_states import _param_shapes, _shapes_layout
    layout = _shapes_layout(Layout(dp=1, tp=1, pp=1, micro_batch_size=1, micro_batches=1, seq_len=cfg.seq_len,
                                   layer_split=(cfg.n_layers,)))
    written = [(k.split(":", 1)[1], sh) for k, sh in _param_shapes(_model_key(cfg), layout, 1, 0)]
    assert written == real
    assert sum(torch.Size(sh).numel() for _, sh in real) == param_count(cfg).total
    assert _meta_shapes(_model_key(cfg), 0, True, True)  # the ends alone


def test_routing_is_each_tokens_top_k_weighted_by_their_softmax_plus_the_shared_expert():
    cfg = model("moe_tiny")
    torch.manual_seed(0)
    moe = MoE(cfg)
    x = torch.randn(2, 5, cfg.hidden)
    got = moe(x)
    for b in range(2):
        for s in range(5):
            t = x[b, s]
            scores, idx = moe.router(t).topk(cfg.moe_top_k)
            gates = scores.softmax(-1)
            want = sum(g * moe.experts[str(int(e))](t) for g, e in zip(gates, idx)) + moe.shared(t)
            torch.testing.assert_close(got[b, s], want, rtol=1e-5, atol=1e-6)


def test_group_limited_routing_takes_each_tokens_experts_from_its_best_groups():
    """model.moe_router_groups / moe_router_group_topk (DeepSeek-V3's node-limited routing): a token's k experts
    lie in the M groups with the highest top-(k // M) logit sums, the forward routes so; with every group open,
    the plain top k."""
    cfg = replace(model("moe_tiny"), n_experts=8, moe_top_k=4, moe_router_groups=4, moe_router_group_topk=3)
    torch.manual_seed(0)
    moe = MoE(cfg)
    x = torch.randn(64, cfg.hidden)
    logits = moe.router(x)
    picked = group_limited(logits, 4, 3, 4).topk(4, dim=-1).indices
    best = logits.view(64, 4, 2).max(dim=-1).values.topk(3, dim=-1).indices  # top (4 // 3) = 1 logit per group
    assert all(set((p // 2).tolist()) <= set(b.tolist()) for p, b in zip(picked, best))
    plain = logits.topk(4, dim=-1).indices
    assert torch.equal(group_limited(logits, 4, 4, 4).topk(4, dim=-1).indices, plain)
    assert any(set(p.tolist()) != set(q.tolist()) for p, q in zip(picked, plain))  # the limit changes some tokens
    got = moe(x.view(8, 8, -1)).view(64, -1)
    for t in range(0, 64, 9):
        scores, idx = group_limited(logits[t:t + 1], 4, 3, 4)[0].topk(4)
        want = sum(g * moe.experts[str(int(e))](x[t]) for g, e in zip(scores.softmax(-1), idx)) + moe.shared(x[t])
        torch.testing.assert_close(got[t], want, rtol=1e-5, atol=1e-6)


def test_router_groups_that_do_not_fit_the_experts_are_refused_in_one_line_naming_the_fix():
    from xpar.config.checks import ConfigError
    for bad in (["model.moe_router_groups=3", "model.moe_router_group_topk=1"],  # 3 does not divide 4 experts
                ["model.moe_router_groups=4", "model.moe_router_group_topk=0"],
                ["model.moe_router_groups=4", "model.moe_router_group_topk=1"]):  # 1 group of 1 < top 2
        with pytest.raises(ConfigError) as e:
            spec_for("model=moe_tiny", *bad)
        assert "e.g. [2, 4]" in str(e.value) and "model.moe_router_groups=0 model.moe_router_group_topk=0" in str(e.value)
        assert len(e.value.problems) == 1 and "(pairs that work: 2:1, 4:2)" in str(e.value)
        fix = str(e.value).split("; e.g. ")[1].split(" (pairs")[0].split()  # the limit that works, followed
        assert fix[0].startswith("model.moe_router_groups=") and spec_for("model=moe_tiny", *fix).model.moe_router_groups
    with pytest.raises(ConfigError) as e:  # a groups value that divides the experts is kept
        spec_for("model=moe_tiny", "model.moe_router_groups=4", "model.moe_router_group_topk=1")
    assert "e.g. model.moe_router_groups=4 model.moe_router_group_topk=2 (" in str(e.value)
    assert spec_for("model=moe_tiny", "model.moe_router_groups=0", "model.moe_router_group_topk=0").model.n_experts == 4
    assert spec_for("model=moe_tiny", "model.moe_router_groups=2", "model.moe_router_group_topk=1").model.moe_router_groups == 2


def test_flops_count_the_active_parameters():
    """Forward matmul FLOPs per token (attention scores aside) are 2 x the active parameters that
    multiply the token: every matrix but the embedding and the norms. DeepSeek-V3 is out: its FLOPs
    count MLA's low-rank projections (tests/estimate/test_attention_flops.py), its parameter count still
    multi-head attention's matrices (issue 42, left)."""
    for name in ("mixtral_8x7b", "moe_tiny", "7b"):
        cfg = model(name)
        count, f = param_count(cfg), forward_flops_per_token(cfg, cfg.seq_len)
        norms = (2 * cfg.n_layers + 1) * cfg.hidden
        assert f["matmul"] + f["logits"] == 2 * (count.active - count.embedding - norms), name


def test_moe_checks_name_what_works():
    from xpar.config.checks import ConfigError
    with pytest.raises(ConfigError) as e:
        spec_for("model=moe_tiny", "model.moe_top_k=5")
    assert "model.moe_top_k must be between 1 and model.n_experts=4" in str(e.value)
    with pytest.raises(ConfigError) as e:
        spec_for("model=moe_tiny", "parallel=tp", "parallel.sequence_parallel=true")
    assert "parallel.sequence_parallel=false" in str(e.value) and "run.mode=estimate" in str(e.value)
    assert spec_for("model=moe_tiny", "parallel=tp").tp == 2  # experts replicated over tp: executed
    ran = spec_for("model=moe_tiny", "parallel.dp=2", "parallel.ep=2")  # executed (tests/parallel/test_expert_parallel.py)
    assert ran.layout.ep == 2 and ran.layout.expert_dp == 1
    with pytest.raises(ConfigError) as e:
        spec_for("model=moe_tiny", "parallel.dp=2", "parallel.ep=3")
    assert "ep values that work: [1, 2]" in str(e.value)
    est = spec_for("model=mixtral_8x7b", "hardware=h100_80gb_64gpu", "parallel.tp=8", "parallel.dp=8",
                   "parallel.zero_stage=3", "train=cluster", "train.seq_len=4096", "run.mode=estimate")
    assert est.model.n_experts == 8 and est.tp == 8


MAVERICK = dict(name="llama4_maverick", n_layers=48, hidden=5120, n_heads=40, n_kv_heads=8, head_dim=128,
                ffn_hidden=16384, n_experts=128, moe_top_k=1, n_shared_experts=1, expert_ffn_hidden=8192,
                vocab_size=202048, seq_len=8192, moe_layer_freq=2)
"""Llama 4 Maverick's text model (Hugging Face meta-llama/Llama-4-Maverick-17B-128E config.json: hidden 5120, 48
layers, 40 heads of 128, 8 kv heads, intermediate_size 8192 (each expert and the shared one),
intermediate_size_mlp 16384 (the dense blocks), 128 experts, top 1, interleave_moe_layer_step 2, vocab 202048)."""


def test_every_other_block_holds_experts_as_llama4_maverick_and_its_published_counts():
    """model.moe_layer_freq=2: blocks 1, 3, ..., 47 hold experts (transformers' Llama4TextConfig moe_layers =
    range(step - 1, n_layers, step)), the others the 16384-wide dense MLP; 400B parameters, 17B active (Meta's
    model card: 17B active, 400B total)."""
    cfg = ModelConfig(**MAVERICK)
    assert [i for i in range(48) if cfg.is_moe_layer(i)] == list(range(1, 48, 2)) and cfg.moe_layers == 24
    count = param_count(cfg)
    assert count.total == pytest.approx(400e9, rel=0.01) and count.active == pytest.approx(17e9, rel=0.02)
    every = param_count(replace(cfg, moe_layer_freq=1))  # every block with 128 experts: twice the experts
    assert every.total > 1.9 * count.total
    after = replace(cfg, first_dense_layers=3, n_layers=9)  # the dense leading blocks first, then one in two
    assert [i for i in range(9) if after.is_moe_layer(i)] == [4, 6, 8] and after.moe_layers == 3


def test_interleaved_moe_blocks_are_what_the_model_builds_and_the_estimate_writes_out():
    """The executed model puts experts where ``is_moe_layer`` says; the estimate's parameter shapes (written
    without torch) equal the model built on the meta device."""
    cfg = replace(model("moe_tiny"), n_layers=4, first_dense_layers=0, moe_layer_freq=2)
    with torch.device("meta"):
        built = Transformer(cfg)
    kinds = [isinstance(block.feed_forward, MoE) for block in built.layers.values()]
    assert kinds == [False, True, False, True]
    from xpar.config.layout import Layout
    from xpar.estimate.memory.model_states import _param_shapes, _shapes_layout
    layout = _shapes_layout(Layout(dp=1, tp=1, pp=1, micro_batch_size=1, micro_batches=1, seq_len=cfg.seq_len,
                                   layer_split=(cfg.n_layers,)))
    real = [(k, tuple(p.shape)) for k, p in built.named_parameters()]
    assert [(k.split(":", 1)[1], sh) for k, sh in _param_shapes(_model_key(cfg), layout, 1, 0)] == real
    assert sum(torch.Size(sh).numel() for _, sh in real) == param_count(cfg).total


def test_a_moe_layer_freq_leaving_no_expert_block_is_one_line():
    from xpar.config.checks.config import check_experts
    msgs = check_experts(ModelConfig(**{**MAVERICK, "moe_layer_freq": 49}))
    assert len(msgs) == 1 and "model.moe_layer_freq=49" in msgs[0] and "values that work: 1-48" in msgs[0]
