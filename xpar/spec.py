"""RunSpec: the validated, fully resolved run (no 'auto' left), built by :mod:`xpar.validate`."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional

from xpar.config import DataConfig, HardwareConfig, ModelConfig, ParallelConfig, TrackingConfig, TrainConfig


@dataclass
class RunSpec:
    """Everything a worker, the estimator or the report needs, with derived values resolved.

    ``parallel.dp`` and ``parallel.micro_batches`` are ints, ``train.global_batch_size`` and
    ``train.seq_len`` are ints, ``hardware`` figures are filled in (detected for 'local').
    """

    model: ModelConfig
    parallel: ParallelConfig
    hardware: HardwareConfig
    train: TrainConfig
    data: DataConfig
    tracking: TrackingConfig
    mode: str
    """'execute' (real workers) or 'estimate' (cost model + fake-PG dry run)."""
    world_size: int
    device: str
    """'cpu' or 'cuda' (execute), 'cuda' for an estimated cluster."""
    layer_split: list[int] = field(default_factory=list)
    """Blocks per pipeline stage, len = pp * virtual_stages (stage order)."""
    launcher: str = "local"
    """'local' (xpar spawns workers) or 'torchrun' (this process is one rank)."""
    progress: bool = True
    """Show a progress bar on rank 0."""
    fail_rank: Optional[int] = None
    """Fault injection (run.fail_rank): this rank raises after building its engine."""
    notes: list[str] = field(default_factory=list)
    """Decisions taken for the user (e.g. a setting changed for correctness), logged as a tag."""
    dry_run: bool = True
    """Estimate mode: run the fake-process-group dry run (run.dry_run)."""

    @property
    def dp(self) -> int:
        return int(self.parallel.dp)

    @property
    def tp(self) -> int:
        return self.parallel.tp

    @property
    def pp(self) -> int:
        return self.parallel.pp

    @property
    def micro_batches(self) -> int:
        return int(self.parallel.micro_batches)

    @property
    def global_batch(self) -> int:
        return int(self.train.global_batch_size)

    @property
    def seq_len(self) -> int:
        return int(self.train.seq_len)

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "RunSpec":
        groups = dict(model=ModelConfig, parallel=ParallelConfig, hardware=HardwareConfig,
                      train=TrainConfig, data=DataConfig, tracking=TrackingConfig)
        kw = {k: (groups[k](**v) if k in groups else v) for k, v in d.items()}
        return cls(**kw)


def stage_layers(layer_split: list[int]) -> list[list[int]]:
    """Global block indices of each stage, e.g. [2, 3] -> [[0, 1], [2, 3, 4]]."""
    out, start = [], 0
    for n in layer_split:
        out.append(list(range(start, start + n)))
        start += n
    return out


def optional_int(x) -> Optional[int]:
    return None if x in (None, "auto") else int(x)
