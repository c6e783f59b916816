"""``xpar compare``: a table and plots of recorded runs (a sweep, an experiment, a filter).

    xpar compare                        # the newest sweep in ./mlflow.db
    xpar compare --sweep 1a2b3c4d       # one sweep (tag xpar.sweep_id)
    xpar compare --experiment xpar --filter "params.\\`parallel.pp\\` = '2'"
    python -m xpar.compare --uri http://127.0.0.1:5000 --sweep 1a2b3c4d --out plots/

Numbers are cast from MLflow's strings. Plots: bubble ratio against micro-batches with the
theory curve (p-1)/(m+p-1), and throughput and memory per device by layout, estimates
hatched beside measurements.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

import pandas as pd

COLUMNS = {  # table column -> MLflow column
    "job": "tags.xpar.job_num",
    "layout": "tags.xpar.layout",
    "model": "tags.xpar.model",
    "mode": "tags.xpar.mode",
    "status": "status",
    "pp": "params.parallel.pp",
    "schedule": "params.parallel.schedule",
    "micro_batches": "params.parallel.micro_batches",
    "tokens_per_s": "metrics.throughput/tokens_per_s",
    "tflops_per_device": "metrics.throughput/tflops_per_device",
    "mfu": "metrics.throughput/mfu",
    "peak_gib_per_device": "metrics.memory/peak_bytes_per_device",
    "model_states_gib": "metrics.memory/model_states_bytes",
    "zero_paper_gib": "metrics.memory/zero_paper_model_states_bytes",
    "bubble": "metrics.pipeline/bubble_ratio",
    "bubble_sim": "metrics.pipeline/bubble_ratio_sim",
    "bubble_theory": "metrics.pipeline/bubble_ratio_theory",
}
NUMERIC = ("pp", "micro_batches", "tokens_per_s", "tflops_per_device", "mfu", "peak_gib_per_device",
           "model_states_gib", "zero_paper_gib",
           "bubble", "bubble_sim", "bubble_theory")


def headline_table(runs: pd.DataFrame) -> pd.DataFrame:
    """One row per run with the headline figures, numbers as floats (NaN where absent)."""
    out = pd.DataFrame(index=runs.index)
    out["run_id"] = runs["run_id"] if "run_id" in runs else []
    for name, col in COLUMNS.items():
        out[name] = runs[col] if col in runs else None
    for name in NUMERIC:
        out[name] = pd.to_numeric(out[name], errors="coerce")
    for col in ("peak_gib_per_device", "model_states_gib", "zero_paper_gib"):
        out[col] = out[col] / 2 ** 30
    if out["job"].notna().any():
        out = out.assign(_j=pd.to_numeric(out["job"], errors="coerce")).sort_values("_j").drop(columns="_j")
    return out.reset_index(drop=True)


def select_runs(uri: str, experiment: str, sweep: Optional[str], filter_string: Optional[str]) -> tuple[pd.DataFrame, Optional[str]]:
    """Runs of ``experiment`` matching the sweep id ('latest' = the newest sweep) and filter.
    Sweep parents are left out. Returns (runs, sweep id)."""
    import mlflow

    mlflow.set_tracking_uri(uri)
    if sweep == "latest":
        parents = mlflow.search_runs(experiment_names=[experiment], filter_string="tags.`xpar.role` = 'sweep'",
                                     order_by=["start_time DESC"], max_results=1)
        if parents.empty:
            raise SystemExit(f"xpar compare: no sweep found in experiment {experiment!r} at {uri}")
        sweep = parents.iloc[0]["tags.xpar.sweep_id"]
    clauses = [f"tags.`xpar.sweep_id` = '{sweep}'"] if sweep else []
    if filter_string:
        clauses.append(filter_string)
    runs = mlflow.search_runs(experiment_names=[experiment], filter_string=" and ".join(clauses))
    if "tags.xpar.role" in runs:
        runs = runs[runs["tags.xpar.role"] != "sweep"]
    return runs, sweep


def write_plots(runs: pd.DataFrame, out_dir: Path) -> list[Path]:
    """The comparison plots that the runs support; returns the PNG paths written.

    bubble_vs_microbatches.png: measured (solid), simulated (dotted) and theory (dashed)
    bubble ratio per schedule against m; throughput_by_layout.png and memory_by_layout.png:
    bars per run, estimates hatched."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = headline_table(runs) if len(runs) else pd.DataFrame()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    piped = t[t["bubble"].notna()] if len(t) else t
    if len(piped):
        fig, ax = plt.subplots(figsize=(6, 4))
        for sched, g in piped.groupby(piped["schedule"].fillna("?")):
            g = g.sort_values("micro_batches")
            line, = ax.plot(g["micro_batches"], g["bubble"], "o-", label=f"{sched} measured")
            if g["bubble_sim"].notna().any():
                ax.plot(g["micro_batches"], g["bubble_sim"], "x:", color=line.get_color(), label=f"{sched} simulated")
            if g["bubble_theory"].notna().any():  # (p-1)/(m+p-1), (p-1)/(v*m+p-1), or the action list
                ax.plot(g["micro_batches"], g["bubble_theory"], "--", lw=1, color=line.get_color(),
                        label=f"{sched} theory")
        ax.set_xlabel("micro-batches m")
        ax.set_ylabel("bubble ratio")
        ax.set_xscale("log", base=2)
        ax.legend(fontsize=7)
        ax.set_title("Pipeline bubble vs micro-batches")
        paths.append(_save(fig, out_dir / "bubble_vs_microbatches.png"))
    if len(t):
        for col, label, name in (("tokens_per_s", "tokens/s (global)", "throughput_by_layout.png"),
                                 ("peak_gib_per_device", "peak memory per device (GiB)", "memory_by_layout.png")):
            d = t[t[col].notna()]
            if d.empty:
                continue
            fig, ax = plt.subplots(figsize=(max(5, 0.6 * len(d) + 2), 4))
            names = [f"{r.model}\n{r.layout}" for r in d.itertuples()]
            hatches = ["//" if mode == "estimate" else "" for mode in d["mode"]]
            bars = ax.bar(range(len(d)), d[col], color=["tab:orange" if mode == "estimate" else "tab:blue" for mode in d["mode"]])
            for b, h in zip(bars, hatches):
                b.set_hatch(h)
            ax.set_xticks(range(len(d)), names, rotation=60, ha="right", fontsize=6)
            ax.set_ylabel(label)
            ax.set_title(f"{label} by layout (blue measured, hatched orange estimated)", fontsize=9)
            paths.append(_save(fig, out_dir / name))
    return paths


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt
    plt.close(fig)
    return path


def print_table(t: pd.DataFrame, title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    cols = ["job", "model", "layout", "mode", "status", "tokens_per_s", "tflops_per_device", "mfu",
            "peak_gib_per_device", "model_states_gib", "zero_paper_gib", "bubble", "bubble_sim", "bubble_theory"]
    cols = [c for c in cols if t[c].notna().any()]  # leave out what no run has (e.g. bubble without pp)
    for c in cols:
        table.add_column(c, justify="right")
    for r in t.itertuples():
        cells = []
        for c in cols:
            v = getattr(r, c)
            if isinstance(v, float):
                cells.append("" if pd.isna(v) else (f"{v:.3f}" if abs(v) < 10 else f"{v:,.0f}"))
            else:
                cells.append("" if v is None or (isinstance(v, float) and pd.isna(v)) else str(v))
        table.add_row(*cells)
    console = Console()
    if not console.is_terminal:
        console = Console(width=220)
    console.print(table)


def main(argv: Optional[list[str]] = None) -> int:
    from xpar.tracking import default_uri

    ap = argparse.ArgumentParser(prog="xpar compare", description="Compare runs recorded by xpar.")
    ap.add_argument("--uri", default=None, help="tracking URI (default: sqlite ./mlflow.db)")
    ap.add_argument("--experiment", default="xpar")
    ap.add_argument("--sweep", default=None, help="sweep id, or 'latest' (default when no --filter)")
    ap.add_argument("--filter", default=None, help="an MLflow search filter, e.g. \"tags.`xpar.mode` = 'estimate'\"")
    ap.add_argument("--out", default=None, help="directory for plots (default ./xpar_compare/<sweep>)")
    args = ap.parse_args(argv)
    uri = args.uri or default_uri(Path.cwd())
    sweep = args.sweep or (None if args.filter else "latest")
    runs, sweep = select_runs(uri, args.experiment, sweep, args.filter)
    if runs.empty:
        print(f"xpar compare: no runs match (experiment {args.experiment!r}, sweep {sweep}, filter {args.filter})",
              file=sys.stderr)
        return 1
    t = headline_table(runs)
    print_table(t, f"{len(t)} runs" + (f" of sweep {sweep}" if sweep else ""))
    out = Path(args.out or Path("xpar_compare") / (sweep or "selection"))
    out.mkdir(parents=True, exist_ok=True)
    t.to_csv(out / "table.csv", index=False)
    for p in write_plots(runs, out):
        print(f"wrote {p}")
    print(f"wrote {out / 'table.csv'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
