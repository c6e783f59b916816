"""torch's single-tensor AdamW step (xpar's) over GPT-2 small's parameter shapes, 2 processes
stepping at once (as 2 dp workers do), with and without xpar.run.host_memory's heap policy: the
median step of each and their ratio, per repeat. Not a timed test: ~1 minute on 2 vCPUs.

    python benchmarks/host_memory.py [--repeat 3]

Measured here (2026-12-02, torch 2.13, 2 vCPUs): x2.17 median (x2.11-x2.86), 622-721 ms -> 252-294 ms.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

STEP = """
import statistics, sys, time
import torch
from xpar.run.host_memory import keep_large_tensors_on_the_heap
torch.set_num_threads(1)
if sys.argv[1] == 'heap':
    keep_large_tensors_on_the_heap()
h, v, layers = 768, 50304, 12
block = [3 * h * h, 3 * h, h * h, h, 4 * h * h, 4 * h, 4 * h * h, h, h, h, h, h]
params = [torch.nn.Parameter(torch.randn(n)) for n in [v * h, 1024 * h] + block * layers]
for p in params:
    p.grad = torch.randn_like(p)
opt = torch.optim.AdamW(params, lr=1e-4, foreach=False)
opt.step()
times = []
for _ in range(5):
    t0 = time.perf_counter(); opt.step(); times.append(time.perf_counter() - t0)
print(statistics.median(times))
"""


def pair(mode: str) -> float:
    """Median AdamW step (s) of two processes stepping at once, the slower of the two."""
    procs = [subprocess.Popen([sys.executable, "-c", STEP, mode], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    return max(float(p.communicate()[0]) for p in procs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    if args.repeat < 1:
        ap.error(f"--repeat must be >= 1, got {args.repeat}")
    ratios = []
    for i in range(args.repeat):
        mmap, heap = pair("mmap"), pair("heap")
        ratios.append(mmap / heap)
        print(f"repeat {i}: AdamW step over GPT-2 small's parameters, 2 processes at once: glibc's default "
              f"{mmap * 1e3:.0f} ms, large tensors on the heap {heap * 1e3:.0f} ms, x{ratios[-1]:.2f}", flush=True)
    print(f"speed-up of the heap policy (xpar.run.host_memory): median x{statistics.median(ratios):.2f}, "
          f"min x{min(ratios):.2f}, max x{max(ratios):.2f}")


if __name__ == "__main__":
    main()
