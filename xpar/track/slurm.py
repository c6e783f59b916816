"""``hydra/launcher=slurm``: hydra-submitit-launcher's SLURM launcher, saying what it did. After
sbatch took the sweep's job array, one line per job: its SLURM job id, its overrides and its log
files with the id filled in (submitit's folder pattern ``%j``); when sbatch refuses, one line with
its reason and exit status 2, not submitit's traceback (:func:`announce_submissions`, installed by
the sweep's callback, xpar.track.sweep, before the launcher submits)."""
from __future__ import annotations

import subprocess
import sys
from typing import Any, Sequence

SUBMISSION_REFUSED = 2
"""Exit status when sbatch refuses the job array."""


def job_lines(jobs: Sequence[Any], job_overrides: Sequence[Sequence[str]], first: int) -> list[str]:
    """One line per submitted job (``jobs``: submitit jobs, ``.job_id`` and ``.paths.stdout``): the
    sweep's job number, the SLURM job id, its overrides and its first task's log file."""
    return [f"xpar: job {first + i} submitted as SLURM job {job.job_id} ({' '.join(ov) or 'defaults'}); "
            f"log: {job.paths.stdout}" for i, (job, ov) in enumerate(zip(jobs, job_overrides))]


def refusal_line(e: BaseException) -> str:
    """The line for sbatch's refusal ``e`` (CalledProcessError with its output, or submitit's error)."""
    out = getattr(e, "output", None) or getattr(e, "stderr", None) or str(e)
    out = out.decode(errors="replace") if isinstance(out, bytes) else str(out)
    lines = [ln.strip() for ln in out.splitlines() if ln.strip()]
    reason = next((ln for ln in lines if "error" in ln.lower()), lines[-1] if lines else type(e).__name__)
    return (f"xpar: sbatch refused the sweep ({reason[:300]}); nothing was submitted. Check hydra.launcher.partition, "
            f"account, qos and the resources asked (sinfo shows the partitions).")


def announce_submissions() -> None:
    """From now on in this process, each submitit job array is announced on stderr once sbatch took
    it (:func:`job_lines`) and sbatch's refusal is one line and exit 2: a wrapper around
    ``submitit.AutoExecutor.map_array``, which hydra-submitit-launcher calls with the jobs'
    override lists and numbers as its first and third iterables. Idempotent."""
    import submitit
    from submitit.core.utils import FailedJobError, FailedSubmissionError

    original = submitit.AutoExecutor.map_array
    if getattr(original, "xpar_announces", False):
        return

    def map_array(executor, fn, *iterables):
        try:
            jobs = original(executor, fn, *iterables)
        except (subprocess.CalledProcessError, FailedSubmissionError, FailedJobError, OSError) as e:
            print(refusal_line(e), file=sys.stderr, flush=True)
            raise SystemExit(SUBMISSION_REFUSED) from None
        overrides, numbers = list(iterables[0]), list(iterables[2])
        print("\n".join(job_lines(jobs, overrides, numbers[0] if numbers else 0)), file=sys.stderr, flush=True)
        return jobs

    map_array.xpar_announces = True
    submitit.AutoExecutor.map_array = map_array
