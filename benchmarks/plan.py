"""xpar plan: the 175B / 1024-A100 command's wall time (imports included) and search rate (target 5 s
with its MLflow record), the same for DeepSeek-V3 on 2048 H800 (a MoE plan over ep; target 15 s), and
the Narayanan et al. 2021 Table 1 layouts against the plan's top for the same model, cluster and
global batch (framework=megatron): unrestricted, and among what Megatron-LM ran in 2021 (full
recompute, no sequence parallelism, no distributed optimizer).

    python benchmarks/plan.py [--skip-megatron] [--repeat 3]
"""
from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMMAND = ["plan", "model=175b", "hardware=a100_80gb_1024gpu"]
MOE_COMMAND = ["plan", "model=deepseek_v3", "hardware=h800_80gb_2048gpu", "framework=hai_llm"]
"""The second command timed: DeepSeek-V3 (256 experts, 61 layers) over plan.ep's default (every divisor of
the experts dividing dp x cp) on the 2048 H800 of conf/parallel/deepseek_v3_2048gpu.yaml. Its 61 layers
split evenly only over pp 1 (61 does not divide 2048), with lighter ends over pp 2-32 (xpar.estimate.columns.stage_split; the
published pp 16 DualPipeV among them): 12,874 valid layouts."""
MOE64_COMMAND = MOE_COMMAND + ["model.n_layers=64", "train.dtype=fp8", "plan.global_batch_size=15360"]
"""The same at 64 layers (pp 1-64, the published pp 16 DualPipeV among them) in FP8 at the published batch:
the DeepSeek-V3-sized search (75,760 layouts)."""


def command_seconds(extra: list[str], cwd: str, command: list[str] = COMMAND) -> tuple[float, str]:
    """Wall time of ``python -m xpar plan ...`` (imports included) and the line with its counts."""
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "xpar", *command, *extra], cwd=cwd, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if p.returncode:
        raise SystemExit(f"xpar plan failed ({p.returncode}):\n{p.stderr[-3000:]}")
    counts = next((ln for ln in p.stdout.splitlines() if "layouts in the space" in ln), "")
    return wall, counts


def speed(repeat: int) -> None:
    with tempfile.TemporaryDirectory() as d:
        for command in (COMMAND, MOE_COMMAND, MOE64_COMMAND):
            for label, extra in (("tracking off", ["tracking=off"]),
                                 ("MLflow run (SQLite)", [f"tracking.uri=sqlite:///{d}/mlflow.db"])):
                runs = [command_seconds(extra, d, command) for _ in range(repeat)]
                walls = [w for w, _ in runs]
                print(f"xpar {' '.join(command)} ({label}): wall {statistics.median(walls):.2f} s median of {repeat} "
                      f"(min {min(walls):.2f}, max {max(walls):.2f}), imports included")
                print("  " + runs[-1][1])


def megatron() -> None:
    sys.path.insert(0, str(REPO / "tests"))
    from test_plan import DATA, best_2021, megatron_inputs, published_row

    from xpar.calibrate.published import read_table
    from xpar.plan.command import search
    from xpar.plan.explain import label
    print(f"{'model':>8} {'rank':>6} {'of':>6} {'vs top':>7} {'vs 2021 top':>11}  top layout (unrestricted)")
    for r in read_table(DATA / "megatron_2021_table1.csv"):
        t = time.perf_counter()
        plan = search(megatron_inputs(r))
        i, res = published_row(plan, r), plan.res
        rank = int((res["tokens_per_s"][plan.ranked] > res["tokens_per_s"][i]).sum()) + 1
        top, old = res["tokens_per_s"][plan.best], res["tokens_per_s"][best_2021(plan)]
        print(f"{r['params_b'] + 'B':>8} {rank:>6} {len(plan.ranked):>6} {res['tokens_per_s'][i] / top:>7.3f} "
              f"{res['tokens_per_s'][i] / old:>11.3f}  {label(res, plan.best)} ({time.perf_counter() - t:.1f} s)",
              flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--skip-megatron", action="store_true")
    ap.add_argument("--skip-speed", action="store_true")
    a = ap.parse_args()
    if not a.skip_speed:
        speed(a.repeat)
    if not a.skip_megatron:
        megatron()


if __name__ == "__main__":
    main()
