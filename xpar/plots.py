"""Figures (matplotlib, Agg backend: no display needed)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

TIMELINE_FILE = "pipeline_timeline.png"
COLORS = {"F": "#4C72B0", "B": "#55A868", "I": "#DD8452", "W": "#8172B3"}
NAMES = {"F": "forward", "B": "backward", "I": "backward (inputs)", "W": "backward (weights)"}


def timeline_figure(timeline: dict):
    """Gantt chart of one pipeline step: measured (left) and simulated (right).

    One row per pp rank (rank 0 on top), one box per compute action, coloured by kind
    (F, B, I, W) and labelled with its micro-batch (``stage:mb`` when a rank holds several
    stages); white space inside the step is idle time (the bubble). ``timeline`` is the
    dict built by :func:`xpar.bubble.summarize`.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    pp, v = timeline["pp"], timeline["v"]
    panels = [("measured", timeline["actions"], timeline["step_time_s"], timeline["measured"]),
              ("simulated (measured action times, free communication)", timeline["sim_actions"],
               timeline["sim_step_time_s"], timeline["simulated"])]
    end = max(p[2] for p in panels) * 1e3
    fig, axes = plt.subplots(1, 2, figsize=(14, 1.0 + 0.55 * pp), sharey=True, squeeze=False)
    kinds = set()
    for ax, (title, per_rank, span, bubble) in zip(axes[0], panels):
        for r, acts in enumerate(per_rank):
            ax.barh(r, span * 1e3, left=0, height=0.8, color="#F2F2F2", edgecolor="#BBBBBB", linewidth=0.5)
            for kind, stage, mb, t0, t1 in acts:
                kinds.add(kind)
                w = (t1 - t0) * 1e3
                ax.barh(r, w, left=t0 * 1e3, height=0.8, color=COLORS.get(kind, "grey"),
                        edgecolor="white", linewidth=0.5, alpha=1.0 if v == 1 or stage < pp else 0.6)
                label = f"{mb}" if v == 1 else f"{stage}:{mb}"
                if w > end / 120:
                    ax.text(t0 * 1e3 + w / 2, r, label, ha="center", va="center", fontsize=6, color="white")
        ax.set_title(f"{title}\nbubble {bubble:.3f}, step {span * 1e3:.1f} ms", fontsize=9)
        ax.set_xlabel("time in step (ms)")
        ax.set_xlim(0, end * 1.01)
    ax0 = axes[0][0]
    ax0.set_yticks(range(pp))
    ax0.set_yticklabels([f"rank {r}" for r in range(pp)])
    ax0.invert_yaxis()
    handles = [Patch(color=COLORS[k], label=NAMES[k]) for k in "FBIW" if k in kinds]
    handles.append(Patch(facecolor="#F2F2F2", edgecolor="#BBBBBB", label="idle"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    fig.suptitle(f"{timeline['schedule']}: pp={pp}, m={timeline['m']}, v={v}, step {timeline['step']} "
                 f"(theory bubble {timeline['theory']:.3f}); labels: "
                 f"{'micro-batch' if v == 1 else 'stage:micro-batch'}", fontsize=10)
    fig.tight_layout(rect=(0, 0.08, 1, 0.95))
    return fig


def record_timeline(timeline: Optional[dict], out_dir: Path) -> Optional[Path]:
    """Save the timeline PNG in ``out_dir`` and log it to the active MLflow run, if any."""
    if not timeline:
        return None
    import matplotlib.pyplot as plt

    fig = timeline_figure(timeline)
    path = Path(out_dir) / TIMELINE_FILE
    fig.savefig(path, dpi=120)
    try:
        import mlflow
        if mlflow.active_run() is not None:
            mlflow.log_figure(fig, TIMELINE_FILE)
    finally:
        plt.close(fig)
    return path
