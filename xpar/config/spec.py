"""RunSpec: the validated, fully resolved run (no 'auto' left), built by :mod:`xpar.config.validate`.

The layout's facts (degrees, ZeRO stage, schedule, micro-batches, stages and their blocks, sequence
parallelism, recompute policy) live only in its :class:`~xpar.config.layout.Layout`; ``parallel`` holds
the parallel group's settings the layout does not own (:class:`ParallelSettings`). The other config
groups are resolved copies; :meth:`RunSpec.parallel_config` joins the two for the params a run logs."""
from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field, fields
from typing import Optional

from xpar.config.layout import Layout
from xpar.config.schema import (
    DataConfig,
    FrameworkConfig,
    HardwareConfig,
    ModelConfig,
    ParallelConfig,
    TrackingConfig,
    TrainConfig,
)


@dataclass
class ParallelSettings:
    """The parallel group's fields (:class:`~xpar.config.schema.ParallelConfig`, same meaning) that the
    layout does not own: what the layout was built from or is applied with."""

    name: str = "dp"
    zero_shard_size: Optional[int] = None
    first_stage_layers: Optional[int] = None
    last_stage_layers: Optional[int] = None
    recompute_layers: Optional[int] = None
    activation_offload_layers: Optional[int] = None
    pipeline_micro_batches: Optional[int] = None
    reference_hardware: Optional[str] = None


def layout_fields(layout: Layout) -> dict:
    """The parallel group's fields that ``layout`` owns, as the group writes them (etp None: tp)."""
    return dict(dp=layout.dp, tp=layout.tp, pp=layout.pp, cp=layout.cp, ep=layout.ep, etp=layout.etp or None,
                zero_stage=layout.zero_stage, micro_batches=layout.micro_batches, schedule=layout.schedule,
                virtual_stages=layout.virtual_stages, layer_split=list(layout.layer_split),
                sequence_parallel=layout.sequence_parallel, recompute=layout.recompute)


def settings_of(par: ParallelConfig) -> ParallelSettings:
    """The settings of a parallel group (:class:`ParallelSettings`' fields of ``par``)."""
    return ParallelSettings(**{f.name: getattr(par, f.name) for f in fields(ParallelSettings)})


@dataclass
class RunSpec:
    """Everything a worker, the estimator or the report needs, with derived values resolved.

    The layout's facts are read from ``layout`` (or the properties below); ``train.global_batch_size``
    and ``train.seq_len`` are ints, ``hardware`` figures are filled in (detected for 'local').
    """

    model: ModelConfig
    parallel: ParallelSettings
    hardware: HardwareConfig
    train: TrainConfig
    data: DataConfig
    tracking: TrackingConfig
    mode: str
    """'execute' (real workers) or 'estimate' (cost model + fake-PG dry run)."""
    layout: Layout
    device: str
    """'cpu' or 'cuda' (execute), 'cuda' for an estimated cluster."""
    launcher: str = "local"
    """'local' (xpar spawns workers) or 'torchrun' (this process is one rank)."""
    progress: bool = True
    """Show a progress bar on rank 0."""
    fail_rank: Optional[int] = None
    """Fault injection (run.fail_rank): this rank raises after building its engine."""
    hang_rank: Optional[int] = None
    """Fault injection (run.hang_rank): this rank's main thread sleeps after building its engine."""
    notes: list[str] = field(default_factory=list)
    """Decisions taken for the user (e.g. a setting changed for correctness), logged as a tag."""
    dry_run: bool = True
    """Estimate mode: run the fake-process-group dry run (run.dry_run)."""
    collective_timeout_s: float = 300.0
    """Timeout of every collective, seconds (run.collective_timeout_s; init_process_group)."""
    heartbeat_timeout_s: float = 30.0
    """A local worker silent this long is named as stopped and the job ended (run.heartbeat_timeout_s)."""
    framework: FrameworkConfig = field(default_factory=FrameworkConfig)
    vocab_unpadded: Optional[int] = None
    """The model's vocabulary before the framework's padding (xpar.config.vocab; ``model.vocab_size`` is
    the padded one); None where nothing is padded."""
    """The training framework the estimate assumes (conf/framework/; logged as params)."""

    @property
    def dp(self) -> int:
        return self.layout.dp

    @property
    def tp(self) -> int:
        return self.layout.tp

    @property
    def pp(self) -> int:
        return self.layout.pp

    @property
    def cp(self) -> int:
        return self.layout.cp

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def micro_batches(self) -> int:
        return self.layout.micro_batches

    @property
    def global_batch(self) -> int:
        return self.layout.global_batch

    @property
    def seq_len(self) -> int:
        return self.layout.seq_len

    @property
    def tokens_per_step(self) -> int:
        return self.layout.tokens_per_step

    @property
    def layer_split(self) -> list[int]:
        """Blocks per pipeline stage, len = pp * virtual_stages (stage order)."""
        return list(self.layout.layer_split)

    def parallel_config(self) -> ParallelConfig:
        """The parallel group as it runs: the layout's fields (dp, micro-batches, virtual stages and layer
        split as numbers, the ZeRO stage that runs) with the settings; logged as ``parallel.*`` params."""
        return ParallelConfig(**asdict(self.parallel), **layout_fields(self.layout))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "RunSpec":
        groups = dict(model=ModelConfig, parallel=ParallelSettings, hardware=HardwareConfig,
                      train=TrainConfig, data=DataConfig, tracking=TrackingConfig, layout=Layout,
                      framework=FrameworkConfig)
        d = dict(d, layout={k: v for k, v in d["layout"].items() if not k.startswith("_")})
        kw = {k: (groups[k](**v) if k in groups else v) for k, v in d.items()}
        return cls(**kw)


def with_fields(obj, **changes):
    """``dataclasses.replace(obj, **changes)`` for the spec's plain dataclasses (RunSpec and its config
    groups: no ``__post_init__``, no ``init=False`` field): a shallow copy with ``changes`` set, without
    ``replace``'s field walk and ``__init__`` (the planner builds tens of thousands). Not for
    :class:`~xpar.config.layout.Layout`, whose ``__post_init__`` derives its stage owners."""
    new = copy.copy(obj)
    new.__dict__.update(changes)
    return new
