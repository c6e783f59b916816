"""``xpar compare``: a table and plots of recorded runs (a sweep, an experiment, a filter).

    xpar compare                        # the newest sweep in ./mlflow.db
    xpar compare --sweep 1a2b3c4d       # one sweep (tag xpar.sweep_id)
    xpar compare --experiment xpar --filter "params.\\`parallel.pp\\` = '2'"
    python -m xpar.track.compare --uri http://127.0.0.1:5000 --sweep 1a2b3c4d --out plots/

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

from xpar.track.estimate_figures import TERM_COLORS
from xpar.estimate.memory.model_states import MEMORY_TERMS
from xpar.track.report import memory_unit, format_bytes
from xpar.track.plots import step_split_figure, step_split_terms
from xpar.track.refusals import refuse_compare, selected
from xpar.track.runs import default_uri

COLUMNS = {  # table column -> MLflow column
    "job": "tags.xpar.job_num",
    "name": "tags.mlflow.runName",
    "layout": "tags.xpar.layout",
    "model": "tags.xpar.model",
    "hardware": "tags.xpar.hardware",
    "framework": "params.framework.name",
    "mode": "tags.xpar.mode",
    "status": "status",
    "pp": "params.parallel.pp",
    "schedule": "params.parallel.schedule",
    "micro_batches": "params.parallel.micro_batches",
    "dp": "params.parallel.dp",
    "tp": "params.parallel.tp",
    "cp": "params.parallel.cp",
    "global_batch": "params.train.global_batch_size",
    "step_time_s": "metrics.throughput/step_time_s",
    "tokens_per_s": "metrics.throughput/tokens_per_s",
    "tflops_per_device": "metrics.throughput/tflops_per_device",
    "mfu": "metrics.throughput/mfu",
    "peak_gib_per_device": "metrics.memory/peak_bytes_per_device",
    "model_states_gib": "metrics.memory/model_states_bytes",
    "zero_paper_gib": "metrics.memory/zero_paper_model_states_bytes",
    "fidelity_step_ratio": "metrics.fidelity/step_time_ratio",
    "bubble": "metrics.pipeline/bubble_ratio",
    "bubble_sim": "metrics.pipeline/bubble_ratio_sim",
    "bubble_theory": "metrics.pipeline/bubble_ratio_theory",
    "overrides": "tags.xpar.overrides",
}
NUMERIC = ("pp", "micro_batches", "dp", "tp", "cp", "global_batch", "step_time_s", "fidelity_step_ratio", "tokens_per_s", "tflops_per_device", "mfu", "peak_gib_per_device",
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
    # the world size (NaN where a degree was not logged; cp = 1 for runs from before it was)
    out["devices"] = out["dp"] * out["tp"] * out["pp"] * out["cp"].fillna(1)
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
                                     order_by=["start_time DESC"], max_results=50)
        ids = parents["tags.xpar.sweep_id"].dropna() if "tags.xpar.sweep_id" in parents else []
        if not len(ids):  # none, or sweep-role runs without a sweep id (not xpar's, or damaged)
            raise SystemExit(f"xpar compare: no sweep found in experiment {experiment!r} at {uri}; run one "
                             f"(python -m xpar -m parallel.micro_batches=1,2) or compare single runs: "
                             f"xpar compare --filter \"attributes.status = 'FINISHED'\"")
        sweep = ids.iloc[0]
    clauses = [f"tags.`xpar.sweep_id` = '{sweep}'"] if sweep else []
    if filter_string:
        clauses.append(filter_string)
    runs = mlflow.search_runs(experiment_names=[experiment], filter_string=" and ".join(clauses))
    if "tags.xpar.role" in runs:
        runs = runs[runs["tags.xpar.role"] != "sweep"]
    return runs, sweep


def write_plots(runs: pd.DataFrame, out_dir: Path) -> list[Path]:
    """The comparison plots that the runs support; returns the PNG paths written.

    bubble_vs_microbatches.png: bubble ratio against m (linear ticks at the swept m, axes
    from 0) per schedule: measured (solid), simulated (dotted), theory (dashed), estimated
    (cost model, dash-dot); throughput_by_layout.png and memory_by_layout.png: one bar per
    run, named by its run name, estimates hatched orange beside measured blue."""
    t = headline_table(runs) if len(runs) else pd.DataFrame()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    piped = t[t["bubble"].notna()] if len(t) else t
    if len(piped):
        paths.append(_save(bubble_figure(piped), out_dir / "bubble_vs_microbatches.png"))
    d = t[t["tokens_per_s"].notna()] if len(t) else t
    if len(d):
        paths.append(_save(bar_figure(d, "tokens_per_s", "tokens/s (global)"), out_dir / "throughput_by_layout.png"))
    d = t[t["peak_gib_per_device"].notna()] if len(t) else t
    if len(d):
        paths.append(_save(memory_figure(runs, d), out_dir / "memory_by_layout.png"))
    bars = step_split_bars(runs)
    if bars:
        paths.append(_save(step_split_figure(bars, "where one step went, per run (measured)"),
                           out_dir / "step_split_by_run.png"))
    return paths


def step_split_bars(runs: pd.DataFrame) -> list[tuple[str, dict]]:
    """(run name, measured step split) of each run that logged one
    (:func:`xpar.track.plots.step_split_terms`), in the table's order."""
    if "metrics.time/compute_cpu_s" not in runs:
        return []
    bars = []
    for _, r in runs.iterrows():
        extra = {k[len("metrics."):]: float(v) for k, v in r.items()
                 if k.startswith("metrics.time/") and pd.notna(v)}
        step = pd.to_numeric(r.get("metrics.throughput/step_time_s"), errors="coerce")
        split = step_split_terms(extra, float(step)) if pd.notna(step) else {}
        if split:
            bars.append((str(r.get("tags.mlflow.runName", r.get("run_id"))), split))
    return bars


def memory_figure(runs: pd.DataFrame, d: pd.DataFrame):
    """Peak memory per device by run, stacked by term (params, grads, optimizer, activations, and
    for estimates buffers and framework overhead), measured and estimated runs in separate panels,
    each in the unit of its largest bar (a ZeRO sweep of the tiny model reads in MiB, not 0.009 GiB)."""
    plt = _plt()
    cols = [f"metrics.memory/{k}_bytes" for k in MEMORY_TERMS]
    terms = runs.set_index("run_id").reindex(columns=cols).apply(pd.to_numeric, errors="coerce").fillna(0.0)
    groups = _by_mode(d)
    fig, axes = plt.subplots(1, len(groups), figsize=(max(6.0, 0.8 * len(d) + 3.5 * len(groups)), 4.8), squeeze=False)
    for ax, (mode, g) in zip(axes[0], groups):
        unit, size = memory_unit(float(g["peak_gib_per_device"].max()) * 2 ** 30)
        bottom = [0.0] * len(g)
        for term, col in zip(MEMORY_TERMS, cols):
            vals = [float(terms.loc[r, col]) / size if r in terms.index else 0.0 for r in g["run_id"]]
            if any(vals):  # each term in the estimate figure's colour (xpar.track.estimate_figures), whichever are drawn
                ax.bar(range(len(g)), vals, bottom=bottom, label=term, color=TERM_COLORS[term],
                       hatch="//" if mode != "measured" else None)
                bottom = [b + v for b, v in zip(bottom, vals)]
        names = _bar_names(g)
        ax.set_xticks(range(len(g)), names, rotation=35, ha="right", fontsize=7)
        ax.set_ylabel(f"peak memory per device ({unit})")
        ax.set_title(mode, fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle(f"peak memory per device by term: model {_values(d, 'model')}", fontsize=10)
    return fig


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _values(d: pd.DataFrame, col: str) -> str:
    """'2' or '2, 4': the distinct values of a column, for titles."""
    vals = sorted({str(int(v)) if isinstance(v, float) and v == int(v) else str(v) for v in d[col].dropna()})
    return ", ".join(vals) or "?"


BUBBLE_CURVES = (  # (column, style, label suffix); theory: (p-1)/(m+p-1), (p-1)/(v*m+p-1) or the action list
    ("bubble", "o-", "measured"),
    ("bubble_sim", "x:", "simulated (measured action times, free comm.)"),
    ("bubble_theory", "--", "theory"),
)


def bubble_figure(piped: pd.DataFrame):
    """Bubble ratio against m, one colour per (schedule, mode); estimates drawn once,
    labelled 'estimated'. Title names pp and the model."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for (sched, mode), g in piped.groupby([piped["schedule"].fillna("?"), piped["mode"].fillna("execute")]):
        g = g.sort_values("micro_batches")
        if mode == "estimate":
            ax.plot(g["micro_batches"], g["bubble"], "s-.", label=f"{sched} estimated (cost model)")
            continue
        color = None
        for col, style, what in BUBBLE_CURVES:
            if g[col].notna().any():
                line, = ax.plot(g["micro_batches"], g[col], style, color=color, label=f"{sched} {what}")
                color = line.get_color()
    ms = sorted({int(m) for m in piped["micro_batches"].dropna()})
    ax.set_xticks(ms)
    ax.set_xlim(0, max(ms or [1]) * 1.08)
    ax.set_ylim(0, max(0.55, float(piped[["bubble", "bubble_sim", "bubble_theory"]].max().max()) * 1.1))
    ax.set_xlabel("micro-batches per step m")
    ax.set_ylabel("bubble ratio (idle fraction of the step)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"Pipeline bubble vs micro-batches: pp={_values(piped, 'pp')}, model {_values(piped, 'model')}",
                 fontsize=10)
    return fig


def bar_figure(d: pd.DataFrame, col: str, label: str):
    """One bar per run (x: run name), value printed on the bar, y from 0; measured runs (blue)
    and estimates (orange, hatched) in separate panels, each on its own scale (a CPU
    measurement and a cluster estimate differ by orders of magnitude)."""
    plt = _plt()
    groups = _by_mode(d)
    widths = [max(len(g), 1.5) for _, g in groups]
    fig, axes = plt.subplots(1, len(groups), figsize=(max(6.0, 0.75 * sum(widths) + 2.5 * len(groups)), 4.8),
                             squeeze=False, gridspec_kw={"width_ratios": widths})
    for ax, (mode, g) in zip(axes[0], groups):
        _bars(ax, g, col, estimate=mode != "measured")
        ax.set_title(mode, fontsize=9)
    axes[0][0].set_ylabel(label)
    fig.suptitle(f"{label} by run: model {_values(d, 'model')}", fontsize=10)
    return fig


def _by_mode(d: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    """(panel title, its runs sorted by name) for measured runs and for estimates, where there are any."""
    return [(mode, g.sort_values("name", key=_natural, na_position="last")) for mode, g in
            (("measured", d[d["mode"] != "estimate"]), ("estimated (cost model)", d[d["mode"] == "estimate"]))
            if len(g)]


def _bar_names(g: pd.DataFrame) -> list[str]:
    """A label per bar: the run name (else its layout), cut at 40 characters."""
    return [n if len(n) <= 40 else n[:39] + "…" for n in g["name"].fillna(g["layout"].fillna("?")).astype(str)]


def _natural(names: pd.Series) -> pd.Series:
    """Sort key: digits compared as numbers (m2 before m16)."""
    import re
    return names.fillna("").map(lambda n: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", n)])


def _bars(ax, g: pd.DataFrame, col: str, estimate: bool) -> None:
    from matplotlib.ticker import FuncFormatter

    bars = ax.bar(range(len(g)), g[col], color="tab:orange" if estimate else "tab:blue",
                  hatch="//" if estimate else None)
    ax.bar_label(bars, labels=[_short(v) for v in g[col]], fontsize=7, padding=2)
    names = _bar_names(g)
    ax.set_xticks(range(len(g)), names, rotation=35, ha="right", fontsize=7)
    ax.set_xlim(-0.6, max(len(g), 1.5) - 0.4)
    ax.set_ylim(0, float(g[col].max()) * 1.15 or 1)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: _short(v)))


def _short(v: float) -> str:
    return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"


def _save(fig, path: Path) -> Path:
    """Save at 110 dpi with every label inside the canvas (tight bounding box)."""
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight", pad_inches=0.15)
    _plt().close(fig)
    return path


def print_table(t: pd.DataFrame, title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    cols = ["job", "model", "layout", "hardware", "framework", "devices", "mode", "status", "global_batch",
            "step_time_s", "tokens_per_s", "tflops_per_device", "mfu", "peak_gib_per_device", "fidelity_step_ratio",
            "bubble", "bubble_sim", "bubble_theory"]  # table.csv also holds the model-state terms
    cols = [c for c in cols if t[c].notna().any()]  # leave out what no run has (e.g. bubble without pp)
    for c in cols:
        table.add_column(HEADERS.get(c, c), justify="right")
    for r in t.itertuples():
        table.add_row(*[cell(c, getattr(r, c)) for c in cols])
    console = Console()
    if not console.is_terminal:  # a log file: as wide as the table needs (rich would wrap it at 80 columns)
        console = Console(width=max(80, Console(width=1000).measure(table).maximum))
    console.print(table)


HEADERS = {"step_time_s": "step", "tokens_per_s": "tokens/s", "tflops_per_device": "TFLOP/s", "global_batch": "B",
           "mfu": "MFU", "peak_gib_per_device": "peak mem", "fidelity_step_ratio": "est/meas", "framework": "fw"}
"""The console table's column titles, short (table.csv keeps the raw column names and units): step time
(median), TFLOP/s and peak memory per device, the run's estimate over its measured step time."""


def cell(column: str, v) -> str:
    """A console cell in the unit that reads: memory as 9.07 MiB (not 0.009 GiB), MFU in %, step
    time in ms, counts with thousands separators; '' where absent."""
    if v is None or (isinstance(v, float) and pd.isna(v)):
        return ""
    if not isinstance(v, float):
        return str(v)
    if column in ("devices", "global_batch"):
        return f"{int(v):,}"
    if column == "peak_gib_per_device":
        return format_bytes(v * 2 ** 30)
    if column == "mfu":
        return f"{100 * v:.1f}%"
    if column == "step_time_s":
        return f"{v * 1e3:,.1f} ms"
    return f"{v:.3g}" if abs(v) < 10 else f"{v:,.0f}"


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="xpar compare", description="Compare runs recorded by xpar.")
    ap.add_argument("--uri", default=None, help="tracking URI (default: sqlite ./mlflow.db)")
    ap.add_argument("--experiment", default="xpar")
    ap.add_argument("--sweep", default=None, help="sweep id, or 'latest' (default when no --filter)")
    ap.add_argument("--filter", default=None, help="an MLflow search filter, e.g. \"tags.\\`xpar.mode\\` = 'estimate'\" "
                                                          "(backticks escaped in a shell)")
    ap.add_argument("--out", default=None, help="directory for plots (default ./xpar_compare/<sweep>)")
    args = ap.parse_args(argv)
    uri = args.uri or default_uri(Path.cwd())
    sweep = args.sweep or (None if args.filter else "latest")
    problem = refuse_compare(uri, args.out)
    runs, sweep = (None, sweep) if problem else selected(select_runs, uri, args.experiment, sweep, args.filter)
    if problem or isinstance(runs, str):
        print(f"xpar: invalid configuration: {problem or runs}", file=sys.stderr)
        return 2
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
