"""Vocabulary padding as Megatron-LM and NeMo do it (megatron/training/tokenizer
``_vocab_size_with_padding``): the tokenizer's V rows padded to the next multiple of
``make_vocab_size_divisible_by`` x tp (128 x tp by default), so that every tensor-parallel rank of
the vocabulary-parallel embedding and output layer holds the same whole number of rows; GPT-3's
50,257 at tp 4 becomes 50,688. The padded size is the model that runs: its parameters, logits
FLOPs and memory. Torch trainers (xpar, torchtitan) pad nothing (``framework.make_vocab_size_divisible_by``
null). Imports nothing from torch.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

from xpar.config.schema import FrameworkConfig, ModelConfig


def padded_vocab(vocab: int, multiple: Optional[int], tp: int) -> int:
    """The vocabulary rows that run: ``vocab`` rounded up to a multiple of ``multiple`` x ``tp``;
    ``vocab`` itself where ``multiple`` is None (no padding)."""
    if not multiple:
        return vocab
    step = multiple * max(1, tp)
    return -(-vocab // step) * step


def padded_model(model: ModelConfig, fw: FrameworkConfig, tp: int) -> ModelConfig:
    """``model`` with the vocabulary the framework pads it to at ``tp`` (a copy; ``model`` unchanged)."""
    return replace(model, vocab_size=padded_vocab(model.vocab_size, fw.make_vocab_size_divisible_by, tp))


def padding_notes(model: ModelConfig, fw: FrameworkConfig, tp: int) -> list[str]:
    """The line said to the user where the framework pads the vocabulary, else none."""
    v = padded_vocab(model.vocab_size, fw.make_vocab_size_divisible_by, tp)
    if v == model.vocab_size:
        return []
    return [f"model.vocab_size={model.vocab_size} padded to {v} rows (framework.make_vocab_size_divisible_by="
            f"{fw.make_vocab_size_divisible_by} x tp={tp}, as {fw.name} pads it): the padded rows are in the "
            f"parameters, the logits' FLOPs and the memory."]


def tp_padding_hint(vocab: int, tp: int, multiple: int = 128) -> str:
    """The suggestion for a vocabulary that ``tp`` does not divide: Megatron's padding."""
    return (f"pad it as Megatron-LM does with framework.make_vocab_size_divisible_by={multiple} ({vocab} -> "
            f"{padded_vocab(vocab, multiple, tp)}, the next multiple of {multiple} x tp), or set "
            f"model.vocab_size={padded_vocab(vocab, 1, tp)}")
