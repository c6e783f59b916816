"""Token batches: seeded synthetic sequences or byte-level tokens of a local text file.

Every layout sees the same global batch at every step: the batch is a pure function of
(seed, step), and each dp rank takes its contiguous slice of b*m rows, split into m
micro-batches of b rows. Under context parallelism each cp rank then keeps its S / cp tokens of
every row, inputs and targets alike (causal load balancing, xpar.parallel.context.shard_sequence).
Shapes: global ``[B, S+1]`` int64; inputs/targets ``[b, S / cp]``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from xpar.config.spec import RunSpec
from xpar.parallel.context import shard_sequence


class TokenSource:
    """Global batches for a run."""

    def __init__(self, spec: RunSpec):
        self.spec = spec
        self.text: Optional[torch.Tensor] = None
        if spec.data.kind == "text":
            raw = Path(spec.data.path).expanduser().read_bytes()
            self.text = torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()

    def global_batch(self, step: int) -> torch.Tensor:
        """``[B, S+1]`` tokens of step ``step``."""
        B, S, V = self.spec.global_batch, self.spec.seq_len, self.spec.model.vocab_size
        g = torch.Generator().manual_seed(self.spec.train.seed * 100_003 + step)
        if self.text is not None:
            starts = torch.randint(0, len(self.text) - S - 1 + 1, (B,), generator=g)
            return torch.stack([self.text[s:s + S + 1] for s in starts.tolist()])
        # Learnable synthetic sequences: arithmetic progressions mod V with a random start
        # and stride per row, so the loss falls as the model trains.
        start = torch.randint(0, V, (B, 1), generator=g)
        stride = torch.randint(1, 8, (B, 1), generator=g)
        return (start + stride * torch.arange(S + 1)) % V

    def micro_batches(self, step: int, dp_rank: int, device: str,
                      cp_rank: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """This (dp, cp) rank's m micro-batches of step ``step``: (inputs, targets), each
        ``[b, S / cp]`` (the cp rank's load-balanced chunks of each row)."""
        b, m, cp = self.spec.train.micro_batch_size, self.spec.micro_batches, self.spec.cp
        rows = self.global_batch(step)[dp_rank * b * m:(dp_rank + 1) * b * m].to(device)
        xs = [shard_sequence(rows[i * b:(i + 1) * b, :-1], cp, cp_rank) for i in range(m)]
        ys = [shard_sequence(rows[i * b:(i + 1) * b, 1:], cp, cp_rank) for i in range(m)]
        return xs, ys
