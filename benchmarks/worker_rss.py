"""Resident memory (RSS) of one spawned process that imported torch and built model=tiny, as a
local CPU worker does before it trains: the per-process baseline that the cost model's
per-worker figure does not count (xpar.estimate.preflight.check.WORKER_BASELINE_BYTES).

    python benchmarks/worker_rss.py [--repeat 3]
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics


def _worker(queue) -> None:
    import psutil
    import torch
    from xpar.config.schema import ModelConfig
    from xpar.models.transformer import Transformer

    before = psutil.Process().memory_info().rss
    model = Transformer(ModelConfig())
    loss = model(torch.randint(0, 256, (1, 64))).float().mean()
    loss.backward()
    torch.optim.AdamW(model.parameters()).step()
    queue.put((before, psutil.Process().memory_info().rss))


def rss_of_a_worker() -> tuple[int, int]:
    """(RSS after ``import torch``, RSS after building and stepping model=tiny) of one spawned process, bytes."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    p = ctx.Process(target=_worker, args=(queue,))
    p.start()
    out = queue.get()
    p.join()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    after = []
    for i in range(max(1, args.repeat)):
        imported, built = rss_of_a_worker()
        after.append(built)
        print(f"repeat {i}: RSS after import torch {imported / 2**30:.3f} GiB, after model=tiny + one AdamW step "
              f"{built / 2**30:.3f} GiB ({built / 1e9:.3f} GB)", flush=True)
    print(f"median {statistics.median(after) / 1e9:.3f} GB, max {max(after) / 1e9:.3f} GB")


if __name__ == "__main__":
    main()
