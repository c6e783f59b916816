"""Validation as small named checks.

Each check reads a composed config (:mod:`xpar.config.checks.config`) or a resolved
:class:`~xpar.config.layout.Layout` (:mod:`xpar.config.checks.layout`) and returns its violations, one
line each naming the constraint, the values given and values that work. No check changes
what it reads. :func:`xpar.config.validate.validate` runs them all and raises
:class:`ConfigError` with every violation before any worker starts.
"""
from __future__ import annotations


class ConfigError(ValueError):
    """One or more violated constraints; ``problems`` holds one message per constraint."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(f"  - {p}" for p in problems))

    def __reduce__(self):
        """Pickled (submitit, multiprocessing) as its problem list: rebuilt as ``cls(*e.args)`` from
        the joined string it would print one character per line."""
        return type(self), (list(self.problems),)


def divisors(n: int) -> list[int]:
    """Positive divisors of ``n``, increasing."""
    return [d for d in range(1, n + 1) if n % d == 0]


def estimate_only(given: str, why: str, run_with: str) -> str:
    """The one line for a setting xpar prices but its engine does not run, in execute mode: the setting given,
    why (what the executed model or engine does instead), and both ways on (the setting that runs, or
    run.mode=estimate)."""
    return (f"{given} is estimated, not executed, by xpar ({why}); run it with {run_with}, or estimate it with "
            f"run.mode=estimate.")
