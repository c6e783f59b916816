"""Figures (matplotlib, Agg backend: no display needed)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

TIMELINE_FILE = "pipeline_timeline.png"
COLORS = {"F": "#4C72B0", "B": "#55A868", "I": "#DD8452", "W": "#8172B3"}
LABEL_AXIS_PX = 880
"""Approximate width of the time axis in pixels (10 in at 100 dpi, less the margins)."""
NAMES = {"F": "forward", "B": "backward", "I": "backward (inputs)", "W": "backward (weights)"}


def timeline_figure(timeline: dict):
    """Gantt chart of one pipeline step: measured (top) and simulated (bottom), on one time axis.

    One row per pp rank (rank 0 on top), one box per compute action, coloured by kind
    (F, B, I, W) and labelled with its micro-batch (``stage:mb`` when a rank holds several
    stages); grey inside the step is idle time (the bubble). Sized for MLflow's artifact
    viewer (1000 px wide at the saved 100 dpi). ``timeline`` is the dict built by
    :func:`xpar.track.bubble.summarize`.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pp = timeline["pp"]
    panels = [("measured", timeline["actions"], timeline["step_time_s"], timeline["measured"]),
              ("simulated: measured action times, free communication", timeline["sim_actions"],
               timeline["sim_step_time_s"], timeline["simulated"])]
    end = max(p[2] for p in panels) * 1e3
    fig, axes = plt.subplots(2, 1, figsize=(10, 2.2 + 0.9 * pp), sharex=True, squeeze=False)
    kinds: set = set()
    for ax, (title, per_rank, span, bubble) in zip(axes[:, 0], panels):
        kinds |= _draw_ranks(ax, per_rank, span * 1e3, end, timeline["v"], pp)
        ax.set_title(f"{title}: bubble {bubble:.3f}, step {span * 1e3:.1f} ms", fontsize=9, loc="left")
        ax.set_yticks(range(pp), [f"rank {r}" for r in range(pp)], fontsize=8)
        ax.set_ylim(pp - 0.5, -0.5)  # rank 0 on top
        ax.set_xlim(0, end * 1.01)
    axes[1, 0].set_xlabel("time in step (ms)")
    _legend(fig, kinds, timeline["v"])
    v = timeline["v"]
    fig.suptitle(f"{timeline['schedule']}, pp={pp}, m={timeline['m']}" + (f", v={v}" if v > 1 else "")
                 + f": step {timeline['step']}, theory bubble {timeline['theory']:.3f}", fontsize=10)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return fig


def _draw_ranks(ax, per_rank: list, span_ms: float, end_ms: float, v: int, pp: int) -> set:
    """One row per rank: the step as an idle (grey) bar, the compute actions over it."""
    kinds = set()
    for r, acts in enumerate(per_rank):
        ax.barh(r, span_ms, left=0, height=0.8, color="#F2F2F2", edgecolor="#BBBBBB", linewidth=0.5)
        for kind, stage, mb, t0, t1 in acts:
            kinds.add(kind)
            w = (t1 - t0) * 1e3
            ax.barh(r, w, left=t0 * 1e3, height=0.8, color=COLORS.get(kind, "grey"),
                    edgecolor="white", linewidth=0.5, alpha=1.0 if v == 1 or stage < pp else 0.6)
            label = f"{mb}" if v == 1 else f"{stage}:{mb}"
            if w / end_ms * LABEL_AXIS_PX > 6 * len(label) + 4:  # ~6 px per character at fontsize 7
                ax.text(t0 * 1e3 + w / 2, r, label, ha="center", va="center", fontsize=7, color="white")
    return kinds


def _legend(fig, kinds: set, v: int) -> None:
    from matplotlib.patches import Patch

    handles = [Patch(color=COLORS[k], label=NAMES[k]) for k in "FBIW" if k in kinds]
    handles.append(Patch(facecolor="#F2F2F2", edgecolor="#BBBBBB", label="idle (bubble)"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False,
               title="box label: micro-batch" if v == 1 else
               "box label: stage:micro-batch (paler boxes: the rank's later stages)",
               title_fontsize=8)


def record_timeline(timeline: Optional[dict], out_dir: Path) -> Optional[Path]:
    """Save the timeline PNG in ``out_dir`` and log it to the active MLflow run, if any."""
    if not timeline:
        return None
    return save_and_log(timeline_figure(timeline), out_dir, TIMELINE_FILE)


def save_and_log(fig, out_dir: Path, name: str) -> Path:
    """Save ``fig`` as ``out_dir/name`` (100 dpi), log that file to the active MLflow run if any
    (the same artifact ``mlflow.log_figure`` writes, without drawing the figure a second time),
    close it."""
    import matplotlib.pyplot as plt

    path = Path(out_dir) / name
    try:
        fig.savefig(path, dpi=100)
        import mlflow
        if mlflow.active_run() is not None:
            mlflow.log_artifact(str(path))
    finally:
        plt.close(fig)
    return path


STEP_SPLIT_FILE = "step_split.png"


def step_split_terms(extra: dict, step_time_s: float) -> dict[str, float]:
    """A measured step by where it went, seconds (from a run's metrics): ``compute`` (the ranks'
    thread CPU time, ``time/compute_cpu_s``), each logged collective's exposed time
    (``time/comm_<axis>_<kind>_exposed_s``), ``waiting for a core`` (``time/core_wait_s``) and
    ``other`` (the rest of the step: pipeline waits, collectives not logged); empty when the run has
    no split."""
    if "time/compute_cpu_s" not in extra:
        return {}
    out = {"compute": extra["time/compute_cpu_s"]}
    out.update({k[len("time/comm_"):-len("_exposed_s")]: v for k, v in sorted(extra.items())
                if k.startswith("time/comm_") and k.endswith("_exposed_s") and k != "time/comm_exposed_s"})
    out["waiting for a core"] = extra.get("time/core_wait_s", 0.0)
    out["other"] = max(0.0, step_time_s - sum(out.values()))
    return out


def step_split_figure(bars: list[tuple[str, dict[str, float]]], title: str):
    """Horizontal stacked bars, one per (name, {term: seconds}), in ms; terms in a shared legend."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    terms = list(dict.fromkeys(t for _, split in bars for t in split))
    fig, ax = plt.subplots(figsize=(9, 1.6 + 0.45 * len(bars)))
    left = [0.0] * len(bars)
    for term in terms:
        vals = [split.get(term, 0.0) * 1e3 for _, split in bars]
        ax.barh(range(len(bars)), vals, left=left, label=term)
        left = [a + b for a, b in zip(left, vals)]
    ax.set_yticks(range(len(bars)), [name for name, _ in bars], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms per step")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    return fig


def record_step_split(extra: dict, step_time_s: float, out_dir: Path) -> Optional[Path]:
    """Save ``step_split.png`` (the measured step by :func:`step_split_terms`, the estimate's terms
    ``fidelity/estimate_time_*`` beside it) in ``out_dir`` and log it to the active MLflow run."""
    measured = step_split_terms(extra, step_time_s)
    if not measured:
        return None
    estimated = {k[len("fidelity/estimate_time_"):-2]: v for k, v in extra.items()
                 if k.startswith("fidelity/estimate_time_") and v}
    bars = [("measured", measured)] + ([("estimated", estimated)] if estimated else [])
    fig = step_split_figure(bars, "where one step went (measured: thread CPU and blocked collectives)")
    return save_and_log(fig, out_dir, STEP_SPLIT_FILE)
