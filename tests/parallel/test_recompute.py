"""Activation recompute (xpar.parallel.recompute): full, selective and MaxText's
save_dot_except_mlp give the losses of no recompute (fp32, relative 1e-6) on dp, zero3, tp (its
attention all-reduce rerun in backward) and pp, and the measured activations drop.

One spawn of 2 gloo workers runs the 16 cases in a row.
"""
import pytest

from tests.conftest import run_specs, spawn, spec_for

LAYOUTS = {"dp": ["parallel=dp"], "zero3": ["parallel=zero3"], "tp": ["parallel=tp"],
           "pp": ["parallel=pp", "model=tiny", "parallel.schedule=1f1b"]}
MODES = ["none", "full", "selective", "save_dot_except_mlp"]
RUN = ["train.steps=3", "train.warmup_steps=1", "parallel.micro_batches=2"]


@pytest.fixture(scope="module")
def results():
    cases = [(lay, mode) for lay in LAYOUTS for mode in MODES]
    specs = [spec_for(*LAYOUTS[lay], f"parallel.recompute={mode}", *RUN) for lay, mode in cases]
    out = spawn(run_specs, 2, [s.to_dict() for s in specs])
    return dict(zip(cases, out))


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_recompute_keeps_losses_and_saves_activations(results, layout):
    none_losses, none_mem = results[(layout, "none")][:2]  # (losses, memory, timing)
    for mode in ("full", "selective", "save_dot_except_mlp"):
        losses, mem = results[(layout, mode)][:2]
        for r_none, r in zip(none_losses, losses):
            assert r == pytest.approx(r_none, rel=1e-6) if r[0] is not None else r == r_none, (layout, mode)
        for m_none, m in zip(none_mem, mem):  # every rank
            assert 0 < m["activations"] < m_none["activations"], (layout, mode, m, m_none)
    full = [m["activations"] for m in results[(layout, "full")][1]]
    selective = [m["activations"] for m in results[(layout, "selective")][1]]
    assert all(f < s for f, s in zip(full, selective))  # selective keeps the matmul outputs
    dots = [m["activations"] for m in results[(layout, "save_dot_except_mlp")][1]]
    assert all(f < d < s for f, d, s in zip(full, dots, selective))  # q, k, v, wo outputs: fewer than all


def test_full_recompute_keeps_the_block_inputs():
    """Single process: under full recompute the tracker counts each block's input
    ([b, s, h] fp32, saved by checkpoint) -- the accounting sees checkpoint's own saved
    tensors -- and selective adds what its cache keeps (the matmul outputs)."""
    import torch

    from xpar.models.transformer import Transformer
    from xpar.parallel.memory_accounting import ActivationTracker
    from xpar.parallel.recompute import apply_recompute
    from xpar.run.data import TokenSource

    spec = spec_for("train.steps=1", "train.warmup_steps=0")
    rows = TokenSource(spec).global_batch(0)
    peaks = {}
    for mode in ("none", "full", "selective"):
        model = apply_recompute(Transformer(spec.model), mode)
        model.init_weights(0)
        with torch.no_grad():
            head = ActivationTracker(list(model.parameters()))
            h = model.tok_embeddings(rows[:, :-1])
        with ActivationTracker(list(model.parameters())) as tracker:
            model(rows[:, :-1]).sum().backward()
        peaks[mode] = tracker.peak
    b_s, c = rows[:, :-1].numel(), spec.model
    block_input = b_s * c.hidden * 4
    # full: the l block inputs + what the final norm and output keep (norm input, rms, norm output)
    assert peaks["full"] >= c.n_layers * block_input
    assert peaks["full"] < peaks["selective"] < peaks["none"]
    kv = c.kv_heads * c.head_dim
    matmul_out = b_s * (2 * c.hidden + 2 * kv + 2 * c.ffn_hidden + c.hidden) * 4  # q k v o, w1 w3 w2 outputs
    assert peaks["selective"] - peaks["full"] == c.n_layers * matmul_out  # measured: exactly
