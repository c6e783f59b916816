"""Multi-token prediction (``model.mtp_layers``, D): what its modules add to the last pipeline stage.

DeepSeek-V3 (DeepSeek-AI 2024, Sec. 2.2, Fig. 3) trains D sequential MTP modules, each a projection M (h x 2h) of
the previous depth's hidden state and the next token's embedding, one Transformer block and the shared output head
with its own cross-entropy loss. Megatron-Core builds them all on the last pipeline stage
(megatron/core/transformer/multi_token_prediction.py ``get_mtp_num_layers_to_build``, core_v0.12), each block with
the decoder's last layer spec (megatron/core/models/gpt/gpt_layer_specs.py ``get_gpt_mtp_block_spec``: a MoE block
in DeepSeek-V3). NeMo 25.04 (v2.3) trains one by default (nemo/collections/llm/recipes/deepseek_v3.py
``pretrain_recipe(use_mtp=True)``), which its scripts/performance/llm/pretrain_deepseek_v3.py keeps.
Priced: :func:`last_stage_work`. Not priced: M and its two norms (2 h^2 weights, about a fifth of a DeepSeek-V3 MoE
block's active GEMMs); the modules' states and activations in the memory model; their FLOPs in MFU.
"""
from __future__ import annotations

from typing import Any


def last_stage_work(model, blocks: Any, last: Any) -> tuple[Any, Any]:
    """(blocks a rank computes, output-head passes) of a rank holding ``blocks`` decoder blocks, and the last
    stage where ``last`` (a bool or an array of them): blocks + D x last (their compute, host issue and tp
    collectives; their all-to-alls where the decoder's last block is MoE:
    xpar.estimate.expert_parallel.moe_blocks_on), (1 + D) x last (the logits GEMM and fp32 cross-entropy again).
    Floats or arrays."""
    return blocks + model.mtp_layers * last, last * (1 + model.mtp_layers)
