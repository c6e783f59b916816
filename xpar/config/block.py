"""Tensor-parallel collectives of one transformer block, sequential or parallel (model.block).

A Megatron tp block has input-side collectives (each column-parallel linear's input: all-gathered under
sequence parallelism, its gradient reduce-scattered or all-reduced in backward) and output-side ones (each
row-parallel linear's output: reduce-scattered or all-reduced in forward, all-gathered in backward under
sequence parallelism). A sequential block has two of each (attention, then MLP: Korthikanti et al. 2022
Sec. 4.2.2). A parallel block (GPT-J; PaLM, Chowdhery et al. 2022 Sec. 2 "Parallel Layers") sums the
attention and MLP outputs before one reduction: GPT-NeoX megatron/model/transformer.py
ParallelTransformerLayer (gpt_j_residual: attention and MLP built with parallel_output=True, then one
``reduce_from_model_parallel_region``, ``reduce_scatter_to_sequence_parallel_region`` with sequence parallelism).
Its input side has one collective per distinct input: one with a single norm (``gpt_j_tied``: x1 = x2), two
where two norms each feed one branch (GPT-NeoX-20B's untied norms; Falcon-40B/180B's ln_attn and ln_mlp,
HF modeling_falcon.py FalconDecoderLayer with new_decoder_architecture). Pure; no torch."""
from __future__ import annotations

BLOCKS = {"sequential": (2, 2), "parallel": (1, 1), "parallel_two_norms": (2, 1)}
"""model.block -> (input-side, output-side) tp collectives of one block in each direction."""


def block_collectives(block: str) -> tuple[int, int]:
    """(input-side, output-side) tp collectives per block and direction for ``model.block`` (module docstring).

    Raises KeyError for a block not in :data:`BLOCKS` (validation refuses it first: xpar.config.checks.config)."""
    return BLOCKS[block]


def forward_share(block: str, sequence_parallel: bool) -> float:
    """The block's forward tp collectives over a sequential block's (1.0 for 'sequential'): without sequence
    parallelism only the output side communicates in forward; with it both sides do, each an all-gather or a
    reduce-scatter of the same size (counted alike). Scales the forward collectives a recompute replays."""
    n_in, n_out = block_collectives(block)
    return (n_in + n_out) / 4 if sequence_parallel else n_out / 2
