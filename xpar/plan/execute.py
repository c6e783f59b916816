"""The closed loop on hardware=local: the plan's top layouts run for real through the normal run
path, as one Hydra multirun (an MLflow sweep: parent run, one child per layout, pre-flight), and
the measured tokens/s set beside the estimate, with the two rank orders.

Each layout is a generated config ``<out>/execute_layouts/plan/top/top<k>.yaml`` (``# @package
_global_``: its parallel.* and train batch values), swept as ``+plan/top=top1,top2,...`` with
``hydra.searchpath`` pointing there. Only layouts whose command line validates in execute mode
are taken (e.g. tied embeddings cannot be split over pp stages for real), walking down the ranking;
layouts with an offloaded optimizer are left out (estimated only: xpar does not execute offload).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from xpar.config.checks import ConfigError
from xpar.config.overrides import refuse
from xpar.estimate.columns.stage_split import split_fields
from xpar.estimate.preflight.check import check_run
from xpar.plan.explain import label
from xpar.plan.verify import compose_line
from xpar.track.sweep import SWEEP_FILE

TIE = 0.005
"""Estimates closer than this (relative) are a tie: their order says nothing."""
MAX_TRIES = 200
"""Ranked layouts tried (validated in execute mode) to find ``execute_top`` that run."""
SKIP = ("plan.", "plan=", "run.mode=", "hydra.", "parallel.", "train.global_batch_size=", "train.micro_batch_size=")


def layout_overrides(plan, i: int) -> dict[str, object]:
    """parallel.* and train batch values of candidate ``i`` (as a nested config dict; cp, ep, etp and train.dtype
    where the plan searched them, as :func:`xpar.plan.show.override_line` names them); its split
    as ``first_stage_layers`` / ``last_stage_layers`` where pp x v does not divide the blocks
    (xpar.estimate.columns.stage_split.split_fields), null otherwise, as ``layer_split``."""
    r = plan.res
    par = dict(dp=int(r["dp"][i]), tp=int(r["tp"][i]), pp=int(r["pp"][i]), zero_stage=int(r["zero"][i]),
               micro_batches=int(r["m"][i]), schedule=str(r["schedule"][i]), virtual_stages=int(r["v"][i]),
               sequence_parallel=bool(r["sp"][i]), recompute=str(r["recompute"][i]), layer_split=None,
               first_stage_layers=None, last_stage_layers=None)
    par.update(split_fields(int(plan.ctx.model["n_layers"]), par["pp"], par["virtual_stages"]))
    par.update({k: int(r[k][i]) for k in ("cp", "ep") if k in r})  # the searched axes (xpar.plan.axes)
    par.update({"etp": int(r["etp"][i]) or None} if "etp" in r else {})
    b = int(r["b"][i])
    train = {"micro_batch_size": b, "global_batch_size": b * par["micro_batches"] * par["dp"]}
    return {"parallel": par, "train": dict(train, **({"dtype": str(r["dtype"][i])} if "dtype" in r else {}))}


def _runs(plan, i: int) -> bool:
    """Whether candidate ``i`` validates and fits in execute mode on this machine."""
    from omegaconf import OmegaConf

    line = "python -m xpar " + " ".join(_base_overrides(plan) + ["run.mode=execute"])
    cfg = OmegaConf.merge(compose_line(line), layout_overrides(plan, i))
    try:
        check_run(cfg)
    except ConfigError:
        return False
    return True


def _base_overrides(plan) -> list[str]:
    return [o for o in plan.inputs.overrides if not o.lstrip("+~").startswith(SKIP)]


def offloads(plan, i: int) -> bool:
    """Whether candidate ``i`` offloads its optimizer (estimated only: execute mode cannot run it)."""
    return bool("offload" in plan.res and plan.res["offload"][i])


def pick(plan, k: int) -> list[int]:
    """The first ``k`` ranked layouts that run here (at most :data:`MAX_TRIES` tried); layouts
    with an offloaded optimizer are left out (xpar does not execute offload, and a run without it
    would be labelled with something it did not do)."""
    out = []
    for i in plan.ranked[:MAX_TRIES]:
        if not offloads(plan, int(i)) and _runs(plan, int(i)):
            out.append(int(i))
            if len(out) == k:
                break
    return out


def write_layouts(plan, rows: list[int], root: Path) -> Path:
    """One ``plan/top/top<k>.yaml`` per layout under ``root`` (a Hydra search path)."""
    from omegaconf import OmegaConf
    group = root / "plan" / "top"
    group.mkdir(parents=True, exist_ok=True)
    for k, i in enumerate(rows, 1):
        (group / f"top{k}.yaml").write_text("# @package _global_\n" + OmegaConf.to_yaml(layout_overrides(plan, i)))
    return root


def execute_top(plan, out_dir: Path, start_dir: Path) -> list[dict]:
    """Run the top ``plan.inputs.execute_top`` layouts as one sweep; return one row per layout:
    its plan rank, estimated and measured tokens/s, measured rank and the sweep's id (printed)."""
    rows = pick(plan, plan.inputs.execute_top)
    if not rows:
        top = plan.ranked[:MAX_TRIES]
        off = sum(offloads(plan, int(i)) for i in top)
        rest = "" if off == len(top) else "; the others do not validate in execute mode"
        why, fix = ((f"{off} offload the optimizer, which xpar estimates only{rest}",
                     f"plan.offload=[false] plan.execute_top={plan.inputs.execute_top}") if off else
                    ("none validates in execute mode", "plan.execute_top=0"))
        refuse([f"plan.execute_top={plan.inputs.execute_top}: none of the top {len(top)} layouts runs for real here "
                f"({why}); e.g. {fix}."])
    root = write_layouts(plan, rows, out_dir / "execute_layouts")
    sweep_dir = out_dir / "execute"
    cmd = [sys.executable, "-m", "xpar", "-m", f"hydra.searchpath=[file://{root.resolve()}]",
           f"hydra.sweep.dir={sweep_dir.resolve()}", "+plan/top=" + ",".join(f"top{k}" for k in range(1, len(rows) + 1)),
           "run.mode=execute", *_base_overrides(plan)]
    print(f"\nExecuting the top {len(rows)} layouts for real (one MLflow sweep):\n  {' '.join(cmd[1:])}", flush=True)
    proc = subprocess.run(cmd, cwd=start_dir, env=dict(os.environ))
    measured, sweep_id = _measured(sweep_dir) if proc.returncode == 0 else ({}, "")
    table = [dict(row, sweep_id=sweep_id) for row in comparison(plan, rows, measured)]
    print_comparison(table, proc.returncode)
    return table


def _measured(sweep_dir: Path) -> tuple[dict[int, float], str]:
    """Measured tokens/s by job number (0-based) of the sweep's child runs, and the sweep's id."""
    from mlflow.tracking import MlflowClient
    info = json.loads(next(sweep_dir.glob(SWEEP_FILE.format("*"))).read_text())  # the one sweep of this folder
    client = MlflowClient(info["uri"])
    runs = client.search_runs([info["experiment_id"]], f"tags.`xpar.sweep_id` = '{info['sweep_id']}'")
    return {int(r.data.tags["xpar.job_num"]): r.data.metrics.get("throughput/tokens_per_s", float("nan"))
            for r in runs if "xpar.job_num" in r.data.tags}, info["sweep_id"]


def comparison(plan, rows: list[int], measured: dict[int, float]) -> list[dict]:
    """Estimated against measured tokens/s, with both rank orders (1 = fastest)."""
    rank_of = {int(i): n for n, i in enumerate(plan.ranked, 1)}
    out = [{"layout": label(plan.res, i), "plan_rank": rank_of[i], "estimated_tokens_per_s": float(plan.res["tokens_per_s"][i]),
            "measured_tokens_per_s": measured.get(k, float("nan"))} for k, i in enumerate(rows)]
    order = sorted(range(len(out)), key=lambda j: -(out[j]["measured_tokens_per_s"] if measured.get(j) else -1))
    for n, j in enumerate(order, 1):
        out[j]["measured_rank"] = n if measured.get(j) else None
    return out


def print_comparison(table: list[dict], returncode: int) -> None:
    """The side-by-side table on the console."""
    if returncode:
        print(f"xpar plan: the sweep of the top layouts exited {returncode}; measured figures missing.", file=sys.stderr)
    print(f"{'plan rank':>9}  {'estimated tok/s':>15}  {'measured tok/s':>14}  {'measured rank':>13}  layout")
    for row in table:
        print(f"{row['plan_rank']:>9}  {row['estimated_tokens_per_s']:>15,.0f}  {row['measured_tokens_per_s']:>14,.0f}  "
              f"{row['measured_rank'] or '-':>13}  {row['layout']}")
    est = [r["estimated_tokens_per_s"] for r in table]
    meas = [r["measured_rank"] for r in table]
    if not all(meas):
        return
    if len(table) == 1:  # plan.execute_top=1: one layout, no order (it said 'the estimates tie')
        row = table[0]
        print(f"One layout executed: measured {row['measured_tokens_per_s'] / row['estimated_tokens_per_s']:.2g}x its "
              f"estimate; plan.execute_top=3 compares the rank order of the top 3.")
        return
    if max(est) <= min(est) * (1 + TIE):
        print(f"Rank order: the estimates tie (within {100 * TIE:g} %): the cost model does not separate these "
              f"layouts on this hardware; measured, the fastest is plan rank {table[meas.index(1)]['plan_rank']}.")
        return
    agree = [r["plan_rank"] for r in sorted(table, key=lambda r: r["measured_rank"])] == sorted(r["plan_rank"] for r in table)
    print("Rank order: " + ("the same, estimated and measured." if agree else "differs, estimated against measured."))
