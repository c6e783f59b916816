"""``hydra/launcher=slurm``: hydra-submitit-launcher's SLURM launcher, saying what it did. After
sbatch took the sweep's job array, one line per job: its SLURM job id, its overrides and its log
files with the id filled in (submitit's folder pattern ``%j``); when sbatch refuses, one line with
its reason and exit status 2, not submitit's traceback. Selected by conf/hydra/launcher/slurm.yaml."""
from __future__ import annotations

import subprocess
import sys
from typing import Any, Sequence

from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher

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


class XparSlurmLauncher(SlurmLauncher):
    """SlurmLauncher that prints each job's SLURM id and log file, and sbatch's refusal in one line."""

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int):
        import submitit
        from submitit.core.utils import FailedSubmissionError

        original = submitit.AutoExecutor.map_array

        def map_array(executor, fn, *iterables):
            try:
                jobs = original(executor, fn, *iterables)
            except (subprocess.CalledProcessError, FailedSubmissionError, OSError) as e:
                print(refusal_line(e), file=sys.stderr, flush=True)
                raise SystemExit(SUBMISSION_REFUSED) from None
            print("\n".join(job_lines(jobs, job_overrides, initial_job_idx)), file=sys.stderr, flush=True)
            return jobs

        submitit.AutoExecutor.map_array = map_array  # the one place where the jobs exist before their results
        try:
            return super().launch(job_overrides, initial_job_idx)
        finally:
            submitit.AutoExecutor.map_array = original
