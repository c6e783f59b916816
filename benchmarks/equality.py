"""Every figure of the cost model, saved and compared: the refactor check of issue 41.

    python benchmarks/equality.py --save benchmarks/baselines/equality.json
    python benchmarks/equality.py --compare benchmarks/baselines/equality.json [--tol 1e-9]

Figures: for every row of the published corpus (tests/data/*.csv, the cases of
:func:`xpar.calibrate.published.load_cases`, estimated as built there) every number of its
:class:`~xpar.estimate.cost.Estimate` (step time, rates, bubble, time terms, memory terms,
communication issued and bytes); for the top 20 layouts of ``xpar plan`` for three presets (175B
on 1024 A100, 70B on 64 H100, DeepSeek-V3 on 2048 H800 under hai_llm) every column the planner
reports, plus the space's size and the count of layouts that fit. ``--compare`` prints the
figures that differ by more than ``--tol`` (relative, absolute below 1) and exits 1 if any does.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

from xpar.calibrate.published import load_cases
from xpar.estimate.cost import estimate
from xpar.plan.command import search
from xpar.plan.explain import label
from xpar.plan.inputs import plan_argv, plan_inputs
from xpar.plan.verify import compose_line

DATA = Path(__file__).resolve().parents[1] / "tests" / "data"
PRESETS = {"175b_a100_1024": ["model=175b", "hardware=a100_80gb_1024gpu"],
           "70b_h100_64": ["model=70b", "hardware=h100_80gb_64gpu"],
           "deepseek_v3_h800_2048": ["model=deepseek_v3", "hardware=h800_80gb_2048gpu", "framework=hai_llm"]}
"""The plans compared (benchmarks/plan.py's MOE_COMMAND for DeepSeek-V3)."""
TOP = 20


def _flat(prefix: str, value, out: dict) -> None:
    """Numbers of ``value`` (nested dicts, dataclass-like objects) as ``prefix.key`` -> float."""
    if isinstance(value, dict):
        for k, v in value.items():
            _flat(f"{prefix}.{k}", v, out)
    elif isinstance(value, (bool, np.bool_)):
        out[prefix] = float(value)
    elif isinstance(value, (int, float, np.integer, np.floating)):
        out[prefix] = float(value)


def corpus_figures() -> dict[str, float]:
    """Every number of the estimate of every corpus row, keyed ``corpus.<source>.<row>.<figure>``."""
    out: dict[str, float] = {}
    for name, cases in load_cases(DATA).items():
        for i, (_, spec, assume, _, _) in enumerate(cases):
            e = estimate(spec, assume)
            p = f"corpus.{name}.{i}"
            for k, v in vars(e).items():
                if k != "memory":
                    _flat(f"{p}.{k}", v, out)
            m = e.memory
            for k, v in vars(m).items():
                if k != "detail":
                    _flat(f"{p}.memory.{k}", v, out)
            _flat(f"{p}.memory.detail", {k: v for k, v in m.detail.items() if k != "notes"}, out)
    return out


def plan_figures(name: str, overrides: list[str]) -> dict[str, float]:
    """Every numeric column of the top :data:`TOP` layouts of ``xpar plan <overrides>``, keyed
    ``plan.<name>.<rank>.<column>``, with the layout's label and the space's counts."""
    argv = plan_argv([*overrides, "tracking=off"])
    inputs, problems = plan_inputs(compose_line("python -m xpar " + " ".join(argv)), argv)
    if problems:
        raise SystemExit(f"{name}: {problems}")
    plan = search(inputs)
    res = plan.res
    out = {f"plan.{name}.layouts": float(len(res["tp"])), f"plan.{name}.fit": float(len(plan.ranked))}
    for rank, i in enumerate(plan.ranked[:TOP].tolist()):
        out[f"plan.{name}.{rank}.label={label(res, i)}"] = 0.0
        for k, col in res.items():
            x = np.asarray(col)
            if x.dtype.kind in "biuf":
                out[f"plan.{name}.{rank}.{k}"] = float(x[i])
    return out


def figures() -> dict[str, float]:
    out = corpus_figures()
    for name, overrides in PRESETS.items():
        out.update(plan_figures(name, overrides))
    return out


def differences(old: dict, new: dict, tol: float) -> list[tuple[str, object, object]]:
    """(key, old, new) of every figure missing on one side or differing by more than ``tol``
    (relative to the larger magnitude, absolute below 1)."""
    bad = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if a is None or b is None:
            bad.append((k, a, b))
        elif not (a == b or (math.isnan(a) and math.isnan(b))
                  or abs(a - b) <= tol * max(1.0, abs(a), abs(b))):
            bad.append((k, a, b))
    return bad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--save", type=Path)
    ap.add_argument("--compare", type=Path)
    ap.add_argument("--tol", type=float, default=1e-9)
    a = ap.parse_args(argv)
    new = figures()
    if a.save:
        a.save.parent.mkdir(parents=True, exist_ok=True)
        a.save.write_text(json.dumps(new, indent=0, sort_keys=True))
        print(f"{len(new)} figures saved to {a.save}")
    if a.compare:
        old = json.loads(a.compare.read_text())
        bad = differences(old, new, a.tol)
        print(f"{len(old)} figures in {a.compare}, {len(new)} now; {len(bad)} differ by more than {a.tol:g}")
        groups: dict[str, int] = {}
        for k, x, y in bad:
            g = ".".join(k.split(".")[:2]) + (" (new key)" if x is None else " (gone)" if y is None else "")
            groups[g] = groups.get(g, 0) + 1
        print("by source or plan: " + ", ".join(f"{g} {n}" for g, n in sorted(groups.items())))
        print(f"{'figure':<90} {'before':>22} {'after':>22}")
        for k, x, y in bad[:200]:
            print(f"{k:<90} {x!s:>22} {y!s:>22}")
        return 1 if bad else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
