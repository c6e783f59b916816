"""``xpar plan``'s wall time against another commit, in one run: the commit's ``xpar/`` and ``conf/``
exported to a temporary folder (``git archive``), then each preset's command run alternately with that
tree and this checkout (same interpreter and packages), tracking off and, with ``--record``, with its
MLflow record (a SQLite store in the temporary folder). Prints, per preset and mode, the median wall
time of each side with its min and max, the CPU time (user + sys) of the runs, the ratio new / base,
and the load average before and after (the machines are shared: compare ratios, not seconds).

    python benchmarks/plan_compare.py --base f2a8d7b [--repeat 3] [--record] [--presets 175b,70b,deepseek_v3]
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PRESETS = {"175b": ["model=175b", "hardware=a100_80gb_1024gpu"],
           "70b": ["model=70b", "hardware=h100_80gb_64gpu"],
           "deepseek_v3": ["model=deepseek_v3", "hardware=h800_80gb_2048gpu", "framework=hai_llm"]}
"""The three plans of issue 41's must-show (benchmarks/equality.py's PRESETS)."""


def export(commit: str, into: Path) -> Path:
    """``xpar/`` and ``conf/`` of ``commit`` under ``into`` (the tree a ``python -m xpar`` run imports)."""
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", commit, "xpar", "conf"], capture_output=True,
                             check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def timed(tree: Path, args: list[str], cwd: Path) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of ``python -m xpar plan <args>`` importing xpar from ``tree``."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "xpar", "plan", *args], cwd=cwd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode:
        raise SystemExit(f"xpar plan {' '.join(args)} failed in {tree} ({p.returncode}):\n{p.stderr[-2000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):6.2f} s ({min(xs):.2f}-{max(xs):.2f})"


def compare(base: Path, presets: list[str], modes: dict[str, list[str]], repeat: int, work: Path) -> None:
    """Each preset and mode: ``repeat`` runs of each side, alternated (base first, then new, ...)."""
    print(f"{'preset':<12} {'mode':<12} {'base wall (min-max)':>24} {'new wall (min-max)':>24} {'new/base':>8} "
          f"{'base cpu':>8} {'new cpu':>8}")
    for name in presets:
        for mode, extra in modes.items():
            runs: dict[str, list[tuple[float, float]]] = {"base": [], "new": []}
            for _ in range(repeat):
                for side, tree in (("base", base), ("new", REPO)):
                    runs[side].append(timed(tree, PRESETS[name] + extra, work))
            walls = {k: [w for w, _ in v] for k, v in runs.items()}
            cpus = {k: statistics.median(c for _, c in v) for k, v in runs.items()}
            ratio = statistics.median(walls["new"]) / statistics.median(walls["base"])
            print(f"{name:<12} {mode:<12} {spread(walls['base']):>24} {spread(walls['new']):>24} {ratio:8.2f} "
                  f"{cpus['base']:8.2f} {cpus['new']:8.2f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the commit to compare with (e.g. f2a8d7b)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--record", action="store_true", help="also time each plan with its MLflow record")
    ap.add_argument("--presets", default=",".join(PRESETS))
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        work = Path(d) / "run"
        work.mkdir()
        base = export(a.base, Path(d) / "base")
        modes = {"tracking off": ["tracking=off"]}
        if a.record:
            modes["with record"] = [f"tracking.uri=sqlite:///{d}/mlflow.db"]
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True).stdout.strip()
        print(f"base {a.base}, new: this checkout ({head}, with its uncommitted changes); {a.repeat} runs each, "
              f"alternated; load average {os.getloadavg()[0]:.1f}")
        compare(base, a.presets.split(","), modes, a.repeat, work)
        print(f"load average after: {os.getloadavg()[0]:.1f} (1 min), {os.getloadavg()[1]:.1f} (5 min)")


if __name__ == "__main__":
    main()
