"""The layout of a run: the one owner of its rules. Imports nothing from torch.

A :class:`Layout` is fully resolved (no 'auto'): degrees, micro-batching, the pipeline
stages and their layers, the ZeRO stage that runs. Validation builds it once
(:mod:`xpar.config.validate`); the engine factory, the mesh, the cost model, the dry run, the
reports and the planner read it.

Design notes (what each step does and why, with sources): docs/concepts/design-notes.md.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable, Optional

AXES = ("pp", "dp", "cp", "tp")
"""Mesh axes, outermost first."""


def _gpipe_bubble(pp: int, m: int, v: int) -> Optional[float]:
    """(p - 1) / (m + p - 1): GPipe and 1F1B with uniform stage times (Huang et al. 2019;
    Narayanan et al. 2021 Sec. 2.2, as a fraction of the step)."""
    return (pp - 1) / (m + pp - 1)


def _interleaved_bubble(pp: int, m: int, v: int) -> Optional[float]:
    """(p - 1) / (v m + p - 1) (Narayanan et al. 2021 Sec. 2.2); None for m < p, where the
    chunks cannot interleave (torch's action list gives 0.50 at p = 2, m = 1, measured)."""
    return (pp - 1) / (v * m + pp - 1) if m >= pp else None


def _zb_h1_bubble(pp: int, m: int, v: int) -> Optional[float]:
    """ZB-H1 (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", Sec. 3.1 and Table 2): idle
    (p - 1)(T_F + T_B - T_W) per rank, with T_F = T_B = T_W (xpar's uniform F = 1, B = 2 split
    into I = W = 1): (p - 1) of a step of 3 m + (p - 1), a third of 1F1B's idle."""
    return (pp - 1) / (3 * m + pp - 1)


def _zb_h2_bubble(pp: int, m: int, v: int) -> Optional[float]:
    """ZB-H2 (Qi et al. 2024 Sec. 3.1, Table 2): idle (p - 1)(T_F + T_B - 2 T_W) per rank, zero
    with T_F = T_B = T_W, as published: the paper's optimizer post-validation (Sec. 4) removes
    the step's synchronisation; a framework without it pays ZB-H1's (p - 1) more."""
    return 0.0


def _any_m(pp: int, m: int) -> bool:
    return m >= 1


def _at_least_pp(pp: int, m: int) -> bool:
    return m >= pp


def _at_least_2pp(pp: int, m: int) -> bool:
    return m >= 2 * pp


def _whole_rounds(pp: int, m: int) -> bool:
    return m >= 1 and m % max(1, m // pp) == 0


def _any_m_text(pp: int, m: int) -> str:
    return "micro-batches >= 1"


def _at_least_pp_text(pp: int, m: int) -> str:
    return f"micro-batches >= pp = {pp} (at least one per stage)"


def _at_least_2pp_text(pp: int, m: int) -> str:
    return f"micro-batches >= 2*pp = {2 * pp} (at least one per stage, 2 stages per rank)"


def _whole_rounds_text(pp: int, m: int) -> str:
    return (f"micro-batches divisible by its number of rounds max(1, m // pp) = {max(1, m // pp)} "
            f"(pp={pp}; any m < {2 * pp} works)")


@dataclass(frozen=True)
class Schedule:
    """Facts of one pipeline schedule (torch 2.13; micro-batch rules measured there by
    tests/parallel/test_pipeline.py against the schedule classes themselves)."""

    name: str
    torch_name: str
    """Name for ``get_schedule_class`` (class ``Schedule<torch_name>``)."""
    stages_per_rank: str
    """'1' (one stage per rank), 'v' (parallel.virtual_stages >= 2) or '2' (V-shaped: two)."""
    microbatches_ok: Callable[[int, int], bool]
    """(pp, m) -> whether torch accepts m micro-batches."""
    microbatch_rule: Callable[[int, int], str]
    """(pp, m) -> the rule in words, for messages."""
    closed_form: Optional[Callable[[int, int, int], Optional[float]]] = None
    """(pp, m, v) -> bubble ratio as a fraction of the step, or None where no closed form holds."""
    zero_bubble: bool = False
    """Separate input- and weight-gradient actions (I, W; Qi et al. 2024)."""
    executable: bool = True
    """Whether xpar runs it (a torch schedule class); False: estimated and planned only, refused
    in execute mode (:func:`xpar.config.checks.layout.check_pipeline`)."""

    @property
    def torch_class(self) -> str:
        return f"Schedule{self.torch_name}"

    @property
    def v_shaped(self) -> bool:
        """Rank r holds stages r and 2p - 1 - r (Qi et al. 2024 Sec. 6); else loop placement
        r, r + p, ... (Narayanan et al. 2021)."""
        return self.stages_per_rank == "2"

    def default_virtual_stages(self) -> int:
        return 1 if self.stages_per_rank == "1" else 2


SCHEDULES: dict[str, Schedule] = {s.name: s for s in (
    Schedule("gpipe", "GPipe", "1", _any_m, _any_m_text, _gpipe_bubble),
    Schedule("1f1b", "1F1B", "1", _at_least_pp, _at_least_pp_text, _gpipe_bubble),
    Schedule("interleaved_1f1b", "Interleaved1F1B", "v", _whole_rounds, _whole_rounds_text, _interleaved_bubble),
    Schedule("looped_bfs", "LoopedBFS", "v", _any_m, _any_m_text),
    Schedule("zero_bubble", "InterleavedZeroBubble", "v", _whole_rounds, _whole_rounds_text, zero_bubble=True),
    Schedule("zbv", "ZBVZeroBubble", "2", _any_m, _any_m_text, zero_bubble=True),
    Schedule("dualpipev", "DualPipeV", "2", _at_least_2pp, _at_least_2pp_text, zero_bubble=True),
    # Qi et al. 2024's handcrafted schedules, one stage per rank: torch 2.13 has no class for them
    # (InterleavedZeroBubble refuses one stage per rank, measured in tests/parallel/test_pipeline.py)
    Schedule("zb_h1", "ZBH1", "1", _at_least_pp, _at_least_pp_text, _zb_h1_bubble, zero_bubble=True,
             executable=False),
    Schedule("zb_h2", "ZBH2", "1", _at_least_pp, _at_least_pp_text, _zb_h2_bubble, zero_bubble=True,
             executable=False),
)}


EXECUTABLE = tuple(name for name, rec in SCHEDULES.items() if rec.executable)
"""The schedules xpar runs (a torch class each); the others are estimated and planned only."""


MICROBATCH_RULES = ("torch", "megatron")
"""Whose micro-batch rules a framework's pipeline follows (``framework.microbatch_rule``): 'torch'
(torch.distributed.pipelining's classes, :data:`SCHEDULES`); 'megatron': its 1F1B runs any m >= 1,
rank r starting with min(pp - r - 1, m) warm-up forwards (Megatron-LM/Core
``forward_backward_pipelining_without_interleaving``; DeepSpeed's PipelineEngine ``TrainSchedule``,
2 (m + pp - 1) steps), the other schedules as torch's."""


def microbatch_ok(schedule: str, pp: int, m: int, rule: str = "torch") -> bool:
    """Whether ``schedule`` runs ``m`` micro-batches at ``pp`` ranks under ``rule``
    (:data:`MICROBATCH_RULES`; 'torch': torch's schedule class accepts them)."""
    if rule == "megatron" and schedule == "1f1b":
        return m >= 1
    return SCHEDULES[schedule].microbatches_ok(pp, m)


def cp_world_rule(dp, tp: int, pp: int, world: Optional[int]) -> Callable[[int], bool]:
    """Whether a cp degree keeps the world size: any on a local run (None), one that tp x cp x pp
    divides with dp='auto', else dp x tp x cp x pp = world."""
    if world is None:
        return lambda c: True
    if dp == "auto":
        return lambda c: world % (tp * c * pp) == 0
    return lambda c: int(dp) * tp * c * pp == world


def cp_values(seq_len: int, tp: int, sequence_parallel: bool, fits: Callable[[int], bool] = lambda c: True,
              max_cp: int = 16) -> list[int]:
    """The cp degrees (<= ``max_cp``) that split ``seq_len`` into 2 cp equal chunks (and each cp
    rank's share over tp under sequence parallelism) and keep the world size (``fits``,
    :func:`cp_world_rule`)."""
    ok = [c for c in range(1, max_cp + 1) if c == 1 or seq_len % (2 * c) == 0]
    if sequence_parallel and tp > 1:
        ok = [c for c in ok if c == 1 or (seq_len // c) % tp == 0]
    return [c for c in ok if fits(c)]


def microbatch_problem(schedule: str, pp: int, m: int, rule: str = "torch",
                       works: Optional[str] = None) -> Optional[str]:
    """The message for a micro-batch count ``m`` that ``schedule`` refuses at ``pp`` under ``rule``
    (:data:`MICROBATCH_RULES`), or None. ``works``: what to say instead of the nearby counts (a
    fixed global batch allows one count per micro-batch size)."""
    rec = SCHEDULES[schedule]
    if microbatch_ok(schedule, pp, m, rule):
        return None
    if works is None:
        near = [k for k in range(max(1, m - 2 * pp), m + 2 * pp + 1) if microbatch_ok(schedule, pp, k, rule)]
        near = sorted(sorted(near, key=lambda k: (abs(k - m), k))[:3])
        works = f"micro_batches that work: {near}" + (" or parallel.schedule=gpipe." if schedule != "gpipe" else ".")
    return (f"schedule {schedule} ({rec.torch_class}) needs {rec.microbatch_rule(pp, m)}, got "
            f"parallel.micro_batches={m}; {works}")


def zero_stage_run(schedule: str, pp: int, zero_stage: int) -> int:
    """The ZeRO stage xpar runs for a requested one.

    Zero-bubble schedules (zero_bubble, zbv, dualpipev) with FSDP2
    ``reshard_after_forward=True`` (xpar's ZeRO-3) give wrong gradients without any error
    in torch 2.13: measured 56 of 75 parameters wrong for zero_bubble and zbv, 20 of 75 for
    dualpipev (tests/parallel/test_pipeline.py keeps a test that fails once torch fixes it). They
    are correct with ``reshard_after_forward=False``, xpar's ZeRO-2, which is run instead
    and said in the run's notes.
    """
    if pp > 1 and SCHEDULES[schedule].zero_bubble and SCHEDULES[schedule].executable and zero_stage == 3:
        return 2
    return zero_stage


def even_split(n_layers: int, n_stages: int) -> Optional[list[int]]:
    """Equal layers per stage, or None when ``n_stages`` does not divide ``n_layers``."""
    return [n_layers // n_stages] * n_stages if n_layers % n_stages == 0 else None


def requested_split(n_layers: int, par, n_stages: int, uneven_ok: bool) -> Optional[list[int]]:
    """The layer split a run asks for: ``parallel.layer_split``, or the one of ``first_stage_layers`` /
    ``last_stage_layers`` (:func:`edge_split`); where neither is given and the stages do not divide the layers,
    with ``uneven_ok`` (an estimate under a framework that splits unevenly: framework.even_layer_split false) the
    lighter ends ``xpar plan`` prices (:func:`lighter_ends`, Megatron-LM's --decoder-first/last-pipeline-num-layers).
    None otherwise (validation then asks for a split)."""
    given = par.layer_split or edge_split(n_layers, n_stages, par.first_stage_layers, par.last_stage_layers)
    if given or not uneven_ok or n_stages < 2 or n_layers % n_stages == 0:
        return given
    ends = lighter_ends(n_layers, n_stages)
    return edge_split(n_layers, n_stages, *ends) if ends else None


def edge_split(n_layers: int, n_stages: int, first: Optional[int], last: Optional[int]) -> Optional[list[int]]:
    """Megatron-LM's uneven pipeline (``--decoder-first/last-pipeline-num-layers``): ``first`` blocks
    on the first stage and ``last`` on the last (either may be None), the rest split evenly over
    the stages between, the earlier ones taking any extra. None when neither is given or the rest
    cannot give each middle stage a block (:func:`xpar.config.checks.layout.check_edge_stages` says why)."""
    if (first is None and last is None) or n_stages < 2:
        return None
    ends = [x for x in (first, last) if x is not None]
    middle = n_stages - len(ends)
    rest = n_layers - sum(ends)
    if any(x < 0 for x in ends) or rest < 0 or (middle == 0 and rest != 0) or (middle > 0 and rest < middle):
        return None
    mid = balanced_split(rest, middle) if middle else []
    return ([first] if first is not None else []) + mid + ([last] if last is not None else [])


def lighter_ends(n_layers: int, n_stages: int) -> tuple[int, int] | None:
    """(first, last): blocks on the first and the last of ``n_stages`` pipeline stages in the split
    with lighter ends that Megatron-LM (``--decoder-first/last-pipeline-num-layers``) and BLOOM
    (BigScience tr11-176B: 70 blocks over 12 stages as 5, 10 x 6, 5) train with: ceil(n_layers /
    n_stages) blocks on every stage between, the first and the last sharing the rest, the first
    taking the odd block (the last also computes the logits). (n_layers / n_stages,) x 2 where
    the stages divide the blocks; None for one stage, or where the stages between would take
    more than every block (e.g. 96 blocks over 64 stages)."""
    if n_stages < 2:
        return None
    rest = n_layers - (n_stages - 2) * -(-n_layers // n_stages)
    return ((rest + 1) // 2, rest // 2) if rest >= 0 else None


def balanced_split(n_layers: int, n_stages: int) -> list[int]:
    """Layers per stage differing by at most one, the first stages taking the extra."""
    return [n_layers // n_stages + (1 if i < n_layers % n_stages else 0) for i in range(n_stages)]


@lru_cache(maxsize=4096)
def _stage_owners(v_shaped: bool, pp: int, n_stages: int) -> tuple[int, ...]:
    """Pipeline rank of each stage: V placement (stages s and n - 1 - s on rank s) for V-shaped
    schedules under pp, else loop placement (s mod pp)."""
    if v_shaped and pp > 1:
        return tuple(s if s < pp else n_stages - 1 - s for s in range(n_stages))
    return tuple(s % pp for s in range(n_stages))


@dataclass(frozen=True)
class Layout:
    """A resolved parallel layout. Degrees dp, tp, pp; ``layer_split``: blocks per stage in
    stage order (len = pp x virtual stages); micro-batch size b (sequences), m micro-batches
    per step, sequence length s (tokens); global batch B = b m dp sequences."""

    dp: int
    tp: int
    pp: int
    micro_batch_size: int
    micro_batches: int
    seq_len: int
    layer_split: tuple[int, ...]
    schedule: str = "gpipe"
    zero_stage: int = 0
    """The ZeRO stage that runs (:func:`zero_stage_run`)."""
    sequence_parallel: bool = False
    recompute: str = "none"
    cp: int = 1
    """Context-parallel degree: cp ranks share each sequence, s / cp tokens each (Llama 3 paper Sec.
    3.3.2; torchtitan, Megatron-Core); inside dp in the rank order (pp, dp, cp, tp, as both order
    theirs). Executed by all-gathering K and V per layer (:mod:`xpar.parallel.context`); the
    seq_len must split into 2 cp chunks (xpar.config.checks.layout.check_cp)."""
    ep: int = 1
    """Expert-parallel degree: the experts of each MoE layer split over ep ranks taken inside dp x cp
    (consecutive dp x cp ranks, as Megatron-Core's and torchtitan's); adds no ranks. Expert
    states are replicated over the dp x cp / ep ranks left (their gradients reduced there).
    Executed with ZeRO 0-3 and pp (xpar.parallel.expert, groups built from the flattened dp x cp
    index d cp + c; ZeRO-2/3 shard each expert over expert-dp)."""
    etp: int = 0
    """Expert tensor-parallel degree (Megatron-Core's --expert-tensor-parallel-size); 0: tp. With etp < tp the
    expert layers fold the tp ranks into ep ("MoE parallel folding", Liu et al. 2025, Megatron-Core):
    ep x etp must divide tp x cp x dp, the ranks of a pipeline stage. Estimated only."""
    _owners: tuple[int, ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_split", tuple(int(x) for x in self.layer_split))
        object.__setattr__(self, "_owners", _stage_owners(SCHEDULES[self.schedule].v_shaped, self.pp, self.n_stages))

    # --- sizes ---------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def expert_tp(self) -> int:
        """Ranks splitting one expert's matrices: etp, or tp when etp is 0."""
        return self.etp or self.tp

    @property
    def expert_dp(self) -> int:
        """Ranks sharing one expert's states: tp x cp x dp / (ep x etp), the expert-data-parallel
        degree (dp x cp / ep when etp = tp)."""
        return max(1, self.tp * self.cp * self.dp // (self.ep * self.expert_tp))

    @property
    def global_batch(self) -> int:
        """B = b m dp, in sequences."""
        return self.micro_batch_size * self.micro_batches * self.dp

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    @property
    def n_stages(self) -> int:
        return len(self.layer_split)

    @property
    def virtual_stages(self) -> int:
        """Stages per pipeline rank (v)."""
        return self.n_stages // self.pp

    @property
    def n_layers(self) -> int:
        return sum(self.layer_split)

    # --- ranks ---------------------------------------------------------------------------
    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pp, dp, tp) coordinates of a global rank (tp fastest, then cp, dp, pp); the cp
        coordinate is :meth:`cp_rank` (callers that predate cp keep their 3-tuple)."""
        return rank // (self.dp * self.cp * self.tp), (rank // (self.cp * self.tp)) % self.dp, rank % self.tp

    def cp_rank(self, rank: int) -> int:
        """The cp coordinate of a global rank: (rank // tp) % cp."""
        return (rank // self.tp) % self.cp

    def rank(self, pp: int, dp: int, tp: int, cp: int = 0) -> int:
        """Global rank at mesh coordinates (pp, dp, cp, tp); inverse of :meth:`coords` and
        :meth:`cp_rank` (``cp`` last as a keyword so callers that predate cp keep working)."""
        return ((pp * self.dp + dp) * self.cp + cp) * self.tp + tp

    # --- pipeline stages -----------------------------------------------------------------

    def stage_owner(self, stage: int) -> int:
        """Pipeline rank holding ``stage``: loop placement, or V placement for V-shaped schedules."""
        return self._owners[stage]

    def stages_of(self, pp_rank: int) -> list[int]:
        """Stage indices held by pipeline rank ``pp_rank``, increasing."""
        return [s for s, r in enumerate(self._owners) if r == pp_rank]

    def stage_layers(self, stage: int) -> list[int]:
        """Global block indices of ``stage``, e.g. split (2, 3): stage 1 -> [2, 3, 4]."""
        start = sum(self.layer_split[:stage])
        return list(range(start, start + self.layer_split[stage]))

    def layers_of(self, pp_rank: int) -> int:
        """Blocks held by pipeline rank ``pp_rank``."""
        return sum(self.layer_split[s] for s in self.stages_of(pp_rank))

    def has_first_stage(self, pp_rank: int) -> bool:
        return self._owners[0] == pp_rank

    def has_last_stage(self, pp_rank: int) -> bool:
        return self._owners[-1] == pp_rank

    @property
    def schedule_info(self) -> Schedule:
        return SCHEDULES[self.schedule]
