"""xpar's training step against a hand-written torch loop building the same wrapper.

For each layout (dp = DDP, zero3 = FSDP2 fully_shard per block then root, tp = tensor
parallel over the 2 workers with torch's Megatron styles and loss_parallel, pp = two
PipelineStages under Schedule1F1B with 4 micro-batches), run xpar's worker body
(:func:`xpar.run.worker.run_rank`: mesh, engine factory, live step records, the train loop with
its accounting) and a plain torch loop, in the same two gloo workers (one thread each),
alternating which side goes first, ROUNDS times each; print the steps/s of both and their
ratio (xpar / plain; 1.0 = no overhead). Goal: >= 0.98. Same processes for both sides: the
comparison is of the step, not of where the OS placed two separate launches (measured here:
separate launches differed by up to 5 % run to run with identical code).

Both sides do the same work and are timed the same way: the plain loop clips the global
gradient norm as torchtitan does (``get_total_norm`` + ``clip_grads_with_norm_``) when xpar's
config clips (train.max_grad_norm, on by default; pipeline stages sum their squares over the
pp group by hand), and a step's time is the slowest rank's, as xpar reports it.

    python benchmarks/overhead.py [--rounds 3] [--steps 12] [--layouts dp zero3 tp pp]
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

MODEL = ["model=tiny", "model.n_layers=4", "model.hidden=256", "model.n_heads=8", "model.n_kv_heads=8",
         "model.ffn_hidden=704", "model.vocab_size=4096", "model.seq_len=128"]


EXTRA: list[str] = []
"""Extra overrides for xpar's side (--overrides)."""


def _spec(layout: str, steps: int):
    from hydra import compose, initialize_config_dir

    import xpar.config.schema  # noqa: F401  (registers the structured configs with Hydra)
    from xpar.config.presets import conf_dir
    from xpar.config.validate import validate

    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        extra = ["parallel.schedule=1f1b", "parallel.micro_batches=4"] if layout == "pp" else []
        cfg = compose("config", overrides=[f"parallel={layout}", *extra, "tracking=off", "run.progress=false",
                                           f"train.steps={steps}", "train.warmup_steps=2",
                                           "train.micro_batch_size=4", *MODEL, *EXTRA])
    return validate(cfg, local_devices=2)


def plain_times(rank: int, world: int, spec) -> list[float]:
    """This rank's step times of the same layout written by hand: model, wrapper, AdamW,
    clipping, loop, perf_counter (the default process group is initialised)."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    from xpar.models.transformer import Transformer
    from xpar.run.data import TokenSource

    if spec.pp > 1:
        return _pp_by_hand(rank, world, spec)
    model = Transformer(spec.model)
    model.init_weights(spec.train.seed)
    tp = spec.tp
    if tp > 1:  # dp = 1: no data-parallel wrapper, the Megatron plan written out by hand
        model = _tp_by_hand(model, dist.device_mesh.init_device_mesh("cpu", (world,)))
    elif spec.layout.zero_stage == 3:
        mesh = dist.device_mesh.init_device_mesh("cpu", (world,))
        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        model = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.train.lr, foreach=False)
    data, b, times = TokenSource(spec), spec.train.micro_batch_size, []
    for step in range(spec.train.steps):
        dp_rank = rank // tp
        rows = data.global_batch(step)[dp_rank * b:(dp_rank + 1) * b]
        opt.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        with _loss_parallel(tp):
            logits = model(rows[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten())
            loss.backward()
        if spec.train.max_grad_norm:
            _clip(list(model.parameters()), spec.train.max_grad_norm)
        opt.step()
        float(loss.detach())
        times.append(time.perf_counter() - t0)
    return times


def xpar_times(spec, out_dir: Path) -> list[float]:
    """Step times of xpar's worker body (:func:`xpar.run.worker.run_rank`: mesh, engine factory,
    live step records, train loop with its accounting) on this rank: the slowest rank's per
    step, as xpar reports it (run_rank gathers every rank's stats on rank 0)."""
    from xpar.run.worker import run_rank

    stats = run_rank(spec, out_dir)
    return [max(s["step_times_s"][i] for s in stats) for i in range(spec.train.steps)] if stats else []


def slowest(times: list[float]) -> list[float]:
    """Per step, the slowest rank's time (all ranks call this)."""
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, times)
    return [max(t[i] for t in every) for i in range(len(times))]


def ab_worker(rank: int, world: int, port: int, spec_dict: dict, rounds: int, out: str) -> None:
    """Both sides in the same two processes, alternating which goes first each round."""
    from xpar.config.spec import RunSpec

    spec = RunSpec.from_dict(spec_dict)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    result: dict[str, list] = {"xpar": [], "plain": []}
    for r in range(rounds):
        for side in (("xpar", "plain") if r % 2 == 0 else ("plain", "xpar")):
            dist.barrier()
            if side == "xpar":
                with tempfile.TemporaryDirectory() as d:
                    times = xpar_times(spec, Path(d))
            else:
                times = slowest(plain_times(rank, world, spec))
            result[side].append(times)
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def _pp_by_hand(rank: int, world: int, spec) -> list[float]:
    """Two pipeline stages with torch's PipelineStage and Schedule1F1B (no xpar code)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from xpar.models.transformer import Transformer
    from xpar.run.data import TokenSource

    cfg, b, m, S = spec.model, spec.train.micro_batch_size, spec.micro_batches, spec.seq_len
    per = cfg.n_layers // world
    first, last = rank == 0, rank == world - 1
    stage_mod = Transformer(cfg, layers=range(rank * per, (rank + 1) * per), first=first, last=last)
    stage_mod.init_weights(spec.train.seed)
    x_in = torch.zeros(b, S, dtype=torch.long) if first else torch.zeros(b, S, cfg.hidden, requires_grad=True)
    x_out = torch.zeros(b, S, cfg.vocab_size if last else cfg.hidden, requires_grad=True)
    stage = PipelineStage(stage_mod, rank, world, torch.device("cpu"), input_args=(x_in,), output_args=x_out)
    schedule = Schedule1F1B(stage, n_microbatches=m,
                            loss_fn=lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten()))
    opt = torch.optim.AdamW(stage_mod.parameters(), lr=spec.train.lr, foreach=False)
    data = TokenSource(spec)
    times = []
    for step in range(spec.train.steps):
        rows = data.global_batch(step)
        opt.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        if first:
            schedule.step(rows[:, :-1])
        elif last:
            schedule.step(target=rows[:, 1:], losses=[])
        else:
            schedule.step()
        if spec.train.max_grad_norm:
            _clip_pipeline(list(stage_mod.parameters()), spec.train.max_grad_norm)
        opt.step()
        times.append(time.perf_counter() - t0)
    return times


def _clip(params: list, max_norm: float) -> None:
    """torch's global-norm clipping as torchtitan writes it: the norm of DTensor gradients
    (FSDP2, TP) is a DTensor, made whole with full_tensor()."""
    from torch.distributed.tensor import DTensor

    norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None], foreach=False)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=False)


def _clip_pipeline(params: list, max_norm: float) -> None:
    """Global-norm clipping over pipeline stages by hand: local squares, one all-reduce."""
    grads = [p.grad for p in params if p.grad is not None]
    square = torch.stack([g.pow(2).sum() for g in grads]).sum()
    dist.all_reduce(square)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, square.sqrt(), foreach=False)


def _tp_by_hand(model, mesh):
    """Megatron tensor parallelism with torch's styles (no xpar code): q/k/v, w1/w3 column,
    wo/w2 row, vocabulary-parallel embedding and output, logits left vocab-sharded."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        parallelize_module,
    )

    for block in model.layers.values():
        parallelize_module(block, mesh, {
            "attention": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),),
                                            use_local_output=False),
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),),
                                               use_local_output=False),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel()})
    return parallelize_module(model, mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
        "output": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)})


def _loss_parallel(tp: int):
    from contextlib import nullcontext

    from torch.distributed.tensor.parallel import loss_parallel
    return loss_parallel() if tp > 1 else nullcontext()


def run_ab(spec, rounds: int) -> dict[str, list]:
    """Step times per round of xpar and plain: {"xpar": [[s, ...] per round], "plain": ...}."""
    from xpar.run.launch import free_port

    with tempfile.TemporaryDirectory() as d:
        out = str(Path(d) / "t.json")
        mp.start_processes(ab_worker, args=(spec.world_size, free_port(), spec.to_dict(), rounds, out),
                           nprocs=spec.world_size, start_method="spawn")
        return json.loads(Path(out).read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--layouts", nargs="+", default=["dp", "zero3", "tp", "pp"])
    ap.add_argument("--overrides", nargs="*", default=[], help="extra xpar overrides, e.g. train.max_grad_norm=null")
    args = ap.parse_args()
    EXTRA[:] = args.overrides
    from rich.console import Console
    from rich.table import Table

    table = Table(title="xpar step vs hand-written torch (2 gloo workers, 1 thread each, median of timed steps)")
    for col in ("layout", "xpar steps/s", "plain steps/s", "ratio xpar/plain", "per-round ratios"):
        table.add_column(col, justify="right")
    for layout in args.layouts:
        spec = _spec(layout, args.steps)
        runs, warm = run_ab(spec, args.rounds), spec.train.warmup_steps
        xs = [statistics.median(t[warm:]) for t in runs["xpar"]]
        ps = [statistics.median(t[warm:]) for t in runs["plain"]]
        ratios = [p / x for p, x in zip(ps, xs)]
        table.add_row(layout, f"{1 / statistics.median(xs):.2f}", f"{1 / statistics.median(ps):.2f}",
                      f"{statistics.median(ratios):.3f}", " ".join(f"{r:.3f}" for r in ratios))
    Console().print(table)


if __name__ == "__main__":
    main()
