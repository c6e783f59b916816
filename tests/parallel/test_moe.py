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
