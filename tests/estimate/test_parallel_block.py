"""Parallel attention/MLP blocks (model.block, xpar.config.block): the summed output reduced once over tp
(GPT-NeoX megatron/model/transformer.py gpt_j_residual; PaLM Sec. 2), an input-side collective per distinct
input (two norms: GPT-NeoX-20B, Falcon-40B/180B); the block input kept once. Same matmuls; estimated, not executed."""
from __future__ import annotations

import pytest

from xpar.config.block import block_collectives, forward_share
from xpar.config.checks import ConfigError
from xpar.estimate.comm import volume as comm
from xpar.estimate.comm.collectives import collective_time, group_of
from xpar.estimate.cost import estimate
from xpar.estimate.memory.activations import layer_activation_bytes
from xpar.estimate.memory.model_states import BYTES
from xpar.estimate.step_parts import tp_times
from tests.conftest import spec_for

FALCON_LIKE = ("run.mode=estimate", "parallel.micro_batches=auto", "hardware=p4d_24xlarge_node", "hardware.nodes=4",
               "model.name=falcon_like", "model.n_layers=8", "model.hidden=8192", "model.n_heads=128",
               "model.n_kv_heads=8", "model.ffn_hidden=32768", "model.vocab_size=65024", "model.seq_len=2048",
               "model.activation=gelu", "model.norm=layernorm", "parallel.tp=8", "parallel.pp=2", "parallel.dp=2",
               "parallel.zero_stage=1", "parallel.sequence_parallel=true", "parallel.recompute=selective",
               "train.dtype=bf16", "train.micro_batch_size=1", "train.global_batch_size=16", "framework=megatron",
               "framework.flash_attention=true", "framework.dropout=false")
"""Falcon-40B's block (tp 8 with sequence parallelism, 8 K/V heads) on 8 of its layers, 4 p4d nodes."""


def test_block_counts_input_and_output_side_collectives():
    assert block_collectives("sequential") == (2, 2)  # attention, then MLP: Korthikanti et al. 2022 Sec. 4.2.2
    assert block_collectives("parallel") == (1, 1) and block_collectives("parallel_two_norms") == (2, 1)
    assert forward_share("sequential", True) == forward_share("sequential", False) == 1.0
    assert forward_share("parallel_two_norms", True) == 0.75 and forward_share("parallel_two_norms", False) == 0.5


def test_tp_layer_bytes_of_a_parallel_block():
    b, s, h, t, e = 1, 2048, 8192, 8, 2
    one = (t - 1) / t * b * s * h * e  # one all-gather or reduce-scatter
    seq = comm.tp_layer_bytes(b, s, h, t, e, sp=True)
    assert seq["tp_allgather"] == pytest.approx(4 * one) and seq["tp_reduce_scatter"] == pytest.approx(4 * one)
    par = comm.tp_layer_bytes(b, s, h, t, e, sp=True, block="parallel")
    assert par["tp_allgather"] == pytest.approx(2 * one) and par["tp_reduce_scatter"] == pytest.approx(2 * one)
    # two norms, full recompute: forward 2 gathers + 1 reduce-scatter, run twice; backward 2 reduce-scatters + 1 gather
    two = comm.tp_layer_bytes(b, s, h, t, e, sp=True, recompute="full", block="parallel_two_norms")
    assert two["tp_allgather"] == pytest.approx(5 * one) and two["tp_reduce_scatter"] == pytest.approx(4 * one)
    # no sequence parallelism: 1 all-reduce forward (the summed output), 2 backward (one per norm's input)
    ar = comm.tp_layer_bytes(b, s, h, t, e, block="parallel_two_norms")["tp_allreduce"]
    assert ar == pytest.approx(3 * 2 * one)


def test_a_parallel_block_keeps_its_input_once_and_with_one_norm_one_projection_input():
    """Korthikanti et al. 2022 Sec. 4.1's replicated terms (fused norm, no dropout, FlashAttention): a sequential
    block keeps 2 norm inputs and 2 projection inputs (q/k/v, MLP in), 2 bytes x h each; a parallel block's
    norms both read x (one kept); with one norm the q/k/v and MLP inputs are one tensor."""
    s, b, h, a, t = 2048, 1, 8192, 64, 8
    kw = dict(sp=True, ffn=4 * h, dropout=False, flash=True)
    seq, par, two = (layer_activation_bytes(s, b, h, a, t, block=k, **kw)
                     for k in ("sequential", "parallel", "parallel_two_norms"))
    assert seq - two == pytest.approx(s * b * 2 * h / t) and seq - par == pytest.approx(s * b * 4 * h / t)
    full = [layer_activation_bytes(s, b, h, a, t, recompute="full", block=k, **kw) for k in ("sequential", "parallel")]
    assert full[0] == full[1]  # full recompute keeps the block input alone either way


def test_tp_times_of_a_parallel_block_count_its_collectives():
    seq, par = spec_for(*FALCON_LIKE), spec_for(*FALCON_LIKE, "model.block=parallel")
    two = spec_for(*FALCON_LIKE, "model.block=parallel_two_norms")
    g = group_of(seq.hardware, 8, 1)
    size = 1 * 2048 * 8192 * BYTES["bf16"]
    ag, rs = collective_time(seq.hardware, "allgather", size, g), collective_time(seq.hardware, "reduce_scatter", size, g)
    t_seq, t_par, t_two = tp_times(seq), tp_times(par), tp_times(two)
    assert t_seq["f"] == pytest.approx(2 * (ag + rs)) and t_par["f"] == pytest.approx(ag + rs)
    assert t_two["f"] == pytest.approx(2 * ag + rs) and t_two["b"] == pytest.approx(2 * rs + ag)
    assert t_par["b_async"] == pytest.approx(rs) and t_two["b_async"] == pytest.approx(2 * rs)
    assert t_seq["end"] == t_par["end"]  # the embedding's and the output layer's collectives are not the block's


def test_a_parallel_block_changes_the_tp_communication_and_activations_of_the_estimate_not_its_matmuls():
    seq, par, two = (estimate(spec_for(*FALCON_LIKE, f"model.block={b}"))
                     for b in ("sequential", "parallel", "parallel_two_norms"))
    assert par.time_breakdown["matmul"] == pytest.approx(seq.time_breakdown["matmul"], rel=1e-12)
    # the block input kept once (the peak pp rank may differ: its parameters by a norm's weight)
    assert par.memory.activations < two.memory.activations < seq.memory.activations
    assert par.memory.total < seq.memory.total
    assert seq.time_breakdown["tp_comm"] > two.time_breakdown["tp_comm"] > par.time_breakdown["tp_comm"] > 0
    assert par.time_per_step_s < two.time_per_step_s < seq.time_per_step_s
    # the blocks' gathers halve; the embedding's (stage 0) and output layer's (last stage) are not the block's
    assert seq.comm_bytes["tp_allgather"] / 2 < par.comm_bytes["tp_allgather"] < 0.6 * seq.comm_bytes["tp_allgather"]


def test_a_parallel_block_is_estimated_not_executed_and_an_unknown_block_refused():
    with pytest.raises(ConfigError, match="model.block=parallel .*estimated, not executed.*model.block=sequential"):
        spec_for("run.mode=execute", "model.block=parallel")
    with pytest.raises(ConfigError, match="model.block must be one of"):
        spec_for("run.mode=estimate", "model.block=gptj")
