"""Figures of an estimate (matplotlib, Agg backend): memory per device by pipeline rank and
the step-time breakdown. Both are titled as estimates."""
from __future__ import annotations

from pathlib import Path

from xpar.estimate.cost import TIME_TERMS
from xpar.estimate.memory.per_device import MemoryEstimate
from xpar.estimate.memory.model_states import MEMORY_TERMS

MEMORY_FILE = "estimate_memory.png"
TIME_FILE = "estimate_step_time.png"
GIB = 2 ** 30
"""Memory is shown in GiB everywhere (console, compare, figures); metrics stay in bytes."""
COLORS = ("#4C72B0", "#55A868", "#C44E52", "#8172B3", "#CCB974", "#64B5CD", "#937860", "#DA8BC3")
"""One per term of :data:`xpar.estimate.cost.TIME_TERMS`, in order."""
TERM_COLORS = dict(zip(MEMORY_TERMS, COLORS))
"""The colour of each memory term, in the estimate's figure and in ``xpar compare``'s."""


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def memory_figure(per_rank: list[MemoryEstimate], title: str):
    """Stacked bars of the memory terms (GiB, 2**30 bytes) of each pipeline rank's most loaded
    device, with the device memory as a dashed line."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(6.0, 0.45 * len(per_rank) + 3), 4.2))
    x = list(range(len(per_rank)))
    bottom = [0.0] * len(per_rank)
    for term, color in TERM_COLORS.items():
        vals = [getattr(mem, term) / GIB for mem in per_rank]
        ax.bar(x, vals, bottom=bottom, color=color, label=term, width=0.7)
        bottom = [b + v for b, v in zip(bottom, vals)]
    dev = per_rank[0].device_memory / GIB
    if dev:
        ax.axhline(dev, color="black", linestyle="--", linewidth=1, label=f"device memory {dev:.1f} GiB")
    for i, total in enumerate(bottom):
        if len(per_rank) <= 16:
            ax.text(i, total, f"{total:.1f}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(x)
    ax.set_xticklabels([str(mem.pp_rank) for mem in per_rank], fontsize=7 if len(per_rank) > 16 else 9)
    ax.set_xlabel("pipeline rank (its most loaded dp rank)")
    ax.set_ylabel("GiB per device (2^30 bytes)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    fig.tight_layout()
    return fig


def time_figure(breakdown: dict[str, float], title: str):
    """One horizontal stacked bar: the step time of the slowest pipeline rank by term."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, 3.2))
    total = sum(breakdown.get(k, 0.0) for k in TIME_TERMS) or 1.0
    left = 0.0
    for term, color in zip(TIME_TERMS, COLORS):
        v = breakdown.get(term, 0.0)
        ax.barh(0, v, left=left, color=color, height=0.5,
                label=f"{term}: {v:.3g} s ({v / total:.0%})")
        if v / total > 0.06:
            ax.text(left + v / 2, 0, f"{v / total:.0%}", ha="center", va="center", fontsize=8, color="white")
        left += v
    ax.set_yticks([])
    ax.set_xlabel("seconds per step (estimated)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.32), ncol=4, frameon=False)
    fig.tight_layout()  # the legend below the axis is kept by savefig's tight bounding box
    return fig


def write_figures(per_rank: list[MemoryEstimate], breakdown: dict[str, float], label: str,
                  out_dir: Path) -> list[Path]:
    """Write both figures into ``out_dir``; return their paths."""
    plt = _plt()
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for fig, name in ((memory_figure(per_rank, f"ESTIMATE (cost model): peak memory per device\n{label}"), MEMORY_FILE),
                      (time_figure(breakdown, f"ESTIMATE (cost model): step time, slowest pipeline rank\n{label}"), TIME_FILE)):
        path = out_dir / name
        fig.savefig(path, dpi=110, bbox_inches="tight", pad_inches=0.15)  # nothing cut
        plt.close(fig)
        paths.append(path)
    return paths
