"""``train.profile=true``: a torch.profiler Chrome trace of a few steps on every rank, as torchtitan's
``--profiling.enable_profiling`` writes, into ``<run folder>/profile/rank<r>_trace.json`` (Chrome /
Perfetto JSON; each step a ``ProfilerStep#<k>`` span around its operators and collectives). The
recording process logs the files as MLflow artifacts under ``profile/`` (xpar.run.job)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

PROFILE_DIR = "profile"
PROFILE_STEPS = 2
"""Steps traced: the run's last ones (its timed steps where it has them)."""


def trace_path(out_dir: Path, rank: int) -> Path:
    """Where rank ``rank`` writes its trace."""
    return Path(out_dir) / PROFILE_DIR / f"rank{rank}_trace.json"


class StepProfiler:
    """``after_step`` hook of :func:`xpar.run.train.train` that runs torch.profiler over steps
    ``steps - PROFILE_STEPS`` .. ``steps - 1`` (``first``: the first step this process runs), each
    inside a ``ProfilerStep#<k>`` span (k: the 0-based step), and exports the Chrome trace after the
    last; ``then``: another hook (e.g. the step line), run outside the traced steps."""

    def __init__(self, spec, out_dir: Path, rank: int, first: int = 0, then=None):
        from torch.profiler import ProfilerActivity, profile

        self.path, self.then, self.last = trace_path(out_dir, rank), then, spec.train.steps - 1
        self.start = max(first, spec.train.steps - PROFILE_STEPS)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if spec.device == "cuda" else [])
        self.prof: Optional[profile] = profile(activities=activities)
        self.span = None
        if self.start == first:
            self._open(first)

    def _open(self, step: int) -> None:
        from torch.profiler import record_function

        if step == self.start:
            self.prof.start()
        self.span = record_function(f"ProfilerStep#{step}")
        self.span.__enter__()

    def __call__(self, step: int, losses: list, times: list, lrs: list):
        if self.span is not None:  # the traced step ends here
            self.span.__exit__(None, None, None)
            self.span = None
        if step == self.last and self.prof is not None:
            self.prof.stop()
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.prof.export_chrome_trace(str(self.path))
            self.prof = None
        if self.then is not None:
            self.then(step, losses, times, lrs)
        if self.prof is not None and self.start <= step + 1 <= self.last:
            self._open(step + 1)
