"""The measurements of ``xpar calibrate`` (what each one times and why is in
:mod:`xpar.calibrate.command`): GEMMs, memory bandwidth, the optimizer step, a transformer block,
host time per operator, and collectives on local worker processes."""
from __future__ import annotations

import json
import os
import resource
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import parallelize_module

from xpar.config.schema import ModelConfig
from xpar.run.fidelity import cpu_share, task_cpu_ns
from xpar.models.transformer import Block, Transformer
from xpar.parallel.tensor import apply_tp, block_plan, loss_context, parallel_cross_entropy
from xpar.parallel.torch_internals import dispatch_mode_base
from xpar.run.exits import ServerDied, exit_worker
from xpar.run.host_memory import keep_large_tensors_on_the_heap
from xpar.run.forkserver import WORKER_PRELOAD
from xpar.run.launch import exit_reason, free_port, start_workers

GEMM_SIDES = (64, 128, 256, 384, 512)


MESSAGE_BYTES = tuple(2 ** k for k in range(10, 29, 2))  # 1 KiB .. 256 MiB


QUICK_BYTES = (2 ** 12, 2 ** 18, 2 ** 22, 2 ** 26)


LARGE_BYTES = 2 ** 23


"""Messages above this many bytes are timed :data:`LARGE_REPS` times (one call: tens to hundreds
of milliseconds), smaller ones :data:`COLLECTIVE_REPS` times."""


LARGE_REPS = 7


"""Calls timed per large message (their median kept): with 3, the 64 MiB all-reduce of back-to-back
quick calibrations here moved the estimate of GPT-2 small's dp gradient all-reduce between 0.33 and
0.67 s (measured in the runs: ~0.7 s, 26 buckets of 25 MB at ~27 ms)."""


SETTLED_FAULTS = 0.01


"""A large call counts only when no rank took page faults over more than this fraction of the
message's 4 KiB pages during it (:func:`settled_time`). gloo's all-gather allocates a temporary
the size of the message in each call; on a heap that has just grown (a calibration's fresh
buffers) it lands on fresh pages again and again, one fault per page, and such calls take several
times longer than settled ones, which runs see once settled (benchmarks/README.md). Where
transparent huge pages are 'always', a fresh region faults once per 2 MiB and passes: the
check then keeps what the calls cost as they came."""


COLLECTIVES = ("allreduce", "allgather", "reduce_scatter", "broadcast", "send_recv")


"""Measured by :func:`collective_worker`; broadcast as ZeRO-1's ZeroRedundancyOptimizer issues it
(each parameter tensor from its owner after the step; gloo: 64 MiB in ~0.1 s here, where an
all-gather of it takes ~0.2 s)."""


COLLECTIVE_REPS = 12


"""Calls timed per collective and size; their median is kept: the time of a collective on the
machine as it is without other load (on a shared CPU a call's time has a long tail, a woken gloo
thread waiting for a core that another process holds; what a run's step pays for that load is
its workers' CPU share, measured during the run: benchmarks/fidelity.py)."""


HOST_REPS = 21


"""Samples of each host-time figure, --quick included (~0.4 s each): with 5, three back-to-back
quick calibrations here gave op_overhead_us 2.4-4.1, dtensor_op_overhead_us 8.3-15.7 and
fsdp_unit_overhead_us 456-1287 (a difference of two timings)."""


STEP_WINDOW_S = 0.02


"""Seconds of one compute sample (matmul, memory, host time): about a tiny-model step here."""


def median_time(fn: Callable[[], object], reps: int, sync: Callable[[], None] = lambda: None,
                window: float = 0.0, average: Callable[[list], float] = statistics.median,
                clock: Callable[[], float] = time.perf_counter) -> float:
    """Median seconds per call of ``fn`` over ``reps`` samples after one warm-up call; a sample
    calls ``fn`` until ``window`` seconds of ``clock`` have passed (at least once) and divides by
    the calls. ``clock``: wall time (default), or :func:`time.process_time` for what a call costs
    the cores it runs on, whatever else runs beside (:func:`compute_clock`). ``sync`` waits for
    the device (``torch.cuda.synchronize`` on GPUs) before each clock read; ``average``: of the
    samples (``statistics.fmean`` for what many calls cost on average)."""
    fn()
    sync()
    times = []
    for _ in range(reps):
        t0, calls = clock(), 0
        while True:
            fn()
            sync()
            calls += 1
            elapsed = clock() - t0
            if elapsed >= window:
                break
        times.append(elapsed / calls)
    return average(times)


def compute_clock(device: str, threads: int = 1) -> Callable[[], float]:
    """The clock of compute samples: on a CPU with one torch thread per worker the process's CPU
    seconds (:func:`time.process_time`: what the work costs the core, not the time other
    processes held it -- a shared machine's load changes by the minute, and the cost model
    stretches a step for the share of the cores its workers get,
    xpar.estimate.compute.host.oversubscription); wall time on a GPU, or with several threads (their CPU
    seconds add up: not a worker's rate)."""
    return time.process_time if device == "cpu" and threads == 1 else time.perf_counter


def _sync(device: str) -> Callable[[], None]:
    return torch.cuda.synchronize if device == "cuda" else (lambda: None)


def measure_matmul(sides=GEMM_SIDES, threads: int = 1, reps: int = 5, device: str = "cpu") -> dict[int, float]:
    """FLOP/s of an n x n matmul per side n: fp32 with ``threads`` torch threads on CPU,
    bf16 on CUDA (the dtype of the GPU presets' dense peak)."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    try:
        out = {}
        for n in sides:
            a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
            out[n] = 2 * n ** 3 / median_time(lambda: a @ b, reps, _sync(device), STEP_WINDOW_S,
                                              clock=compute_clock(device, threads))
        return out
    finally:
        torch.set_num_threads(old)


def measure_memory_bandwidth(mib: int = 64, reps: int = 5, device: str = "cpu") -> float:
    """Bytes/s of ``dst.copy_(src)`` for ``mib`` MiB fp32 tensors (read + write counted)."""
    src = torch.ones(mib * 2 ** 18, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / median_time(lambda: dst.copy_(src), reps, _sync(device), STEP_WINDOW_S,
                                             clock=compute_clock(device, torch.get_num_threads()))


def measure_optimizer(elements: int = 2 ** 24, tensors: int = 4, reps: int = 5, device: str = "cpu") -> float:
    """Nanoseconds per parameter element of torch's single-tensor AdamW step (``foreach=False``,
    xpar.parallel.data_parallel.build_optimizer) over ``tensors`` fp32 tensors of ``elements`` /
    ``tensors`` each (16 MiB, with their grads and states past the L3 cache as a model's are); CPU seconds on CPU."""
    params = [torch.nn.Parameter(torch.randn(elements // tensors, device=device)) for _ in range(tensors)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-4, foreach=False)
    opt.step()  # allocate the states
    t = median_time(opt.step, reps, _sync(device), STEP_WINDOW_S, clock=compute_clock(device, torch.get_num_threads()))
    return t / elements * 1e9


REFERENCE_BLOCK = dict(name="reference", n_layers=1, hidden=512, n_heads=8, n_kv_heads=8, ffn_hidden=1536,
                       vocab_size=256, seq_len=128, activation="swiglu", norm="rmsnorm", position="rope", bias=False)


REFERENCE_BATCH = 2


"""The transformer block whose forward and backward fit a CPU's ``matmul_efficiency``
(:func:`fit_block_efficiency`): Llama-style, between the mini and GPT-2 small presets in width,
at 2 x 128 tokens: on a CPU, real blocks reach a similar share of the best square GEMM's rate
whatever their shape (element-wise work, GEMMs on transposed operands, weights that leave the
cache: benchmarks/README.md)."""


def measure_block(reps: int = 5, device: str = "cpu") -> float:
    """Seconds of one forward and backward of :data:`REFERENCE_BLOCK` at :data:`REFERENCE_BATCH`
    sequences (its input requiring grad, as every block's in a model; gradients set to None
    before each, as xpar's step does: accumulation is priced apart,
    xpar.estimate.cost.gradient_time), CPU seconds on a CPU (:func:`compute_clock`)."""
    cfg = ModelConfig(**REFERENCE_BLOCK)
    block = Block(cfg).to(device)
    x = torch.randn(REFERENCE_BATCH, cfg.seq_len, cfg.hidden, device=device, requires_grad=True)

    def step() -> None:  # fresh gradients each call, as a step after zero_grad(set_to_none=True)
        block.zero_grad(set_to_none=True)
        x.grad = None
        block(x).sum().backward()
    return median_time(step, reps, _sync(device), STEP_WINDOW_S, clock=compute_clock(device, torch.get_num_threads()))


def _collective(name: str, nbytes: int, world: int, rank: int) -> Callable[[], None]:
    """One call of collective ``name`` with a payload of ``nbytes`` (the all-reduced buffer,
    the gathered output, the reduce-scattered input, the broadcast or sent message)."""
    n = max(world, nbytes // 4 // world * world)
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    full, part = torch.ones(n, device=device), torch.ones(n // world, device=device)
    if name == "allreduce":
        return lambda: dist.all_reduce(full)
    if name == "allgather":  # the single-tensor forms (all_gather_into_tensor before torch 2.13)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return lambda: gather(full, part)
    if name == "reduce_scatter":
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return lambda: scatter(part, full)
    if name == "broadcast":
        return lambda: dist.broadcast(full, 0)
    peer = 1 - rank if rank < 2 else None

    def ping_pong() -> None:  # one message each way between ranks 0 and 1
        if peer is None:
            return
        if rank == 0:
            dist.send(full, peer), dist.recv(full, peer)
        else:
            dist.recv(full, peer), dist.send(full, peer)
    return ping_pong


def timed_share(measure: Callable[[], float], device: str) -> tuple[float, float]:
    """(what ``measure()`` returns, the CPU share of this process's main thread while it ran:
    xpar.run.fidelity.cpu_share, 1.0 on a GPU or without schedstat): how loaded the machine was."""
    if device != "cpu":
        return measure(), 1.0

    before = task_cpu_ns([os.getpid()], main_only=True)
    seconds = measure()
    return seconds, cpu_share(before, task_cpu_ns([os.getpid()], main_only=True))


def settled_time(call: Callable[[], None], reps: int, nbytes: int, sync: Callable[[], None] = lambda: None,
                 max_calls: int = 0) -> float:
    """Median wall seconds of a collective ``call`` of ``nbytes`` over ``reps`` calls during which
    no rank page-faulted on more than :data:`SETTLED_FAULTS` of the message's pages (the state a
    run's steps reach; a call with faults is timed but left out), at most ``max_calls`` calls
    (default 3 x ``reps``; the median of all when too few qualify). Every rank calls it at once:
    the ranks' fault counts are all-reduced (max) after each call, which also lines them up."""
    faults = torch.zeros(1, device="cuda" if dist.get_backend() == "nccl" else "cpu")
    pages, every, settled = max(1, nbytes // 4096), [], []
    call()
    sync()
    for _ in range(max_calls or 3 * reps):
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        call()
        sync()
        every.append(time.perf_counter() - t0)
        faults.fill_(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
        dist.all_reduce(faults, op=dist.ReduceOp.MAX)
        if faults.item() <= SETTLED_FAULTS * pages:
            settled.append(every[-1])
            if len(settled) == reps:
                break
    return statistics.median(settled if len(settled) >= max(1, reps // 2) else every)


def collective_worker(payload: dict) -> dict:
    """On every rank: median seconds of each collective per message size (:data:`COLLECTIVE_REPS`
    calls at least, :data:`LARGE_REPS` settled calls above :data:`LARGE_BYTES`, :func:`settled_time`;
    send/recv: one way, half a
    ping-pong), in wall time: ``times``, and the CPU share of the main thread they were measured
    at (:func:`timed_share`): ``shares``; collectives the backend does not offer are left out."""
    world, rank, out, shares = dist.get_world_size(), dist.get_rank(), {}, {}
    for name in payload["collectives"]:
        try:
            times, shares[name] = {}, {}
            for nbytes in payload["sizes"]:
                call = _collective(name, nbytes, world, rank)
                dist.barrier()
                sync = _sync(payload["device"])
                timed = ((lambda: settled_time(call, LARGE_REPS, nbytes, sync)) if nbytes > LARGE_BYTES else
                         (lambda: median_time(call, max(payload["reps"], COLLECTIVE_REPS), sync)))
                t, shares[name][nbytes] = timed_share(timed, payload["device"])
                times[nbytes] = t / (2 if name == "send_recv" else 1)
            out[name] = times
        except (RuntimeError, ValueError) as e:  # e.g. a collective gloo does not implement
            out[name] = {"unsupported": str(e).splitlines()[0][:200]}
    return {"times": out, "shares": shares}


SYNC_WORK_S = 0.01


"""Seconds of compute between the collectives :func:`measure_sync_wait` issues. The wait grows with
the compute before the collective (the later peer's lead grows with it) and levels off: measured
here, 1.3 ms after 2 ms of compute, 2.2-2.4 after 5, 3.2-5.9 after 20, 3.4-5.2 after 50. xpar's
CPU runs of the benchmark sizes compute 3-50 ms between syncs (mini tp: 3-6 ms per all-reduce;
GPT-2 small tp 8-16; FSDP units 10-40; pipeline stages 35+), so the one figure is taken at 10 ms
(the tiny model's 0.2-3 ms intervals pay about half of it)."""


def measure_sync_wait(reps: int = 120, device: str = "cpu") -> float:
    """Mean seconds a small all-reduce issued right after :data:`SYNC_WORK_S` of compute takes
    beyond the same all-reduce issued alone (every rank at once, wall time: the later peer and the
    wake-up of a waiting thread, what a run's blocking collectives pay); >= 0. Each sample starts
    at a barrier, as a run's ranks leave their previous collective together, and times the
    all-reduce alone after its own compute (the difference of two separately timed means moved
    by +-1 ms here)."""
    a, g = torch.randn(128, 128, device=device), torch.ones(16, device=device)
    sync = _sync(device)
    calls = max(1, int(SYNC_WORK_S / max(median_time(lambda: a @ a, 5, sync, 0.01), 1e-7)))
    alone = median_time(lambda: dist.all_reduce(g), reps, sync)
    after = []
    for _ in range(reps):
        dist.barrier()
        for _ in range(calls):
            a @ a
        sync()
        t0 = time.perf_counter()
        dist.all_reduce(g)
        sync()
        after.append(time.perf_counter() - t0)
    return max(0.0, statistics.fmean(after) - alone)


def _rank_entry(rank: int, world: int, port: int, payload: dict, out: str) -> None:
    """A calibration worker; Ctrl-C or SIGTERM (to the process group) ends it quietly: the parent says what happened."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _measure_rank(rank, world, port, payload, out)


def _measure_rank(rank: int, world: int, port: int, payload: dict, out: str) -> None:
    torch.set_num_threads(payload["threads"])
    if payload["device"] == "cuda":
        torch.cuda.set_device(rank)
    else:  # as a run's workers allocate (xpar.run.worker.run_rank)
        keep_large_tensors_on_the_heap()
    backend = "nccl" if payload["device"] == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        result = {"compute": compute_worker(payload)}
        stage(payload, "collectives")
        result.update(collective_worker(payload))
        stage(payload, "wait at a blocking collective")
        result["sync_wait_s"] = measure_sync_wait(device=payload["device"])
        if rank == 0:
            Path(out).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()
    exit_worker()


STAGES = ("matmul", "memory bandwidth", "optimizer step", "host time per operator", "reference block",
          "collectives", "wait at a blocking collective")
"""What ``xpar calibrate`` measures, in order: one progress line each on stderr (:func:`stage`)."""


def stage(payload: dict, what: str) -> None:
    """Rank 0 says on stderr which of :data:`STAGES` starts (``payload['progress']``): a calibration
    takes about a minute, under SLURM or in a log file as well."""
    if payload.get("progress") and dist.get_rank() == 0:
        print(f"xpar calibrate: [{STAGES.index(what) + 1}/{len(STAGES)}] {what} ...", file=sys.stderr, flush=True)


def compute_worker(payload: dict) -> dict:
    """On every rank at once, as a run's workers compute side by side (sharing cores, caches and
    memory bandwidth, and the machine's other load): matmul rates per GEMM side, memory
    bandwidth and (CPU) :func:`host_worker`'s figures on a 1-rank mesh of this rank; rank 0's."""
    device, reps = payload["device"], payload["reps"]
    dist.barrier()
    stage(payload, "matmul")
    matmul = measure_matmul(threads=payload["threads"], reps=reps, device=device)
    dist.barrier()
    stage(payload, "memory bandwidth")
    bandwidth = measure_memory_bandwidth(reps=reps, device=device)
    dist.barrier()
    stage(payload, "optimizer step")
    optimizer = measure_optimizer(reps=reps, device=device)
    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]  # every rank creates every group
    dist.barrier()
    host = {}
    if device == "cpu":
        stage(payload, "host time per operator")
        host = host_worker(max(reps, HOST_REPS), DeviceMesh.from_group(groups[dist.get_rank()], "cpu"))
    dist.barrier()
    if device == "cpu":
        stage(payload, "reference block")
    block = measure_block(reps, device) if device == "cpu" else None  # only a CPU's efficiency is fitted to it
    return {"matmul": matmul, "memory_bandwidth": bandwidth, "optimizer_ns_per_element": optimizer, "host": host,
            "block_s": block}


def measure_workers(world: int, sizes, reps: int, threads: int = 1, device: str = "cpu",
                    progress: bool = False) -> dict:
    """:func:`compute_worker` then :func:`collective_worker` on ``world`` local processes (gloo
    on CPU, nccl with one GPU each on CUDA); rank 0's figures: ``compute`` (``matmul``: FLOP/s
    per side, ``memory_bandwidth``: bytes/s, ``host``: microseconds), ``collectives`` (seconds
    per collective and size) and ``collective_shares`` (the CPU shares they were measured at);
    ``progress``: a line per stage on stderr (:func:`stage`)."""
    payload = {"collectives": COLLECTIVES, "sizes": list(sizes), "reps": reps, "threads": threads, "device": device,
               "progress": progress}
    with tempfile.TemporaryDirectory() as d:
        out = str(Path(d) / "collectives.json")
        _run_workers(start_workers(_rank_entry, (world, free_port(), payload, out), world,
                                   (*WORKER_PRELOAD, "xpar.calibrate.measure")))
        raw = json.loads(Path(out).read_text())
    compute = dict(raw["compute"], matmul={int(n): r for n, r in raw["compute"]["matmul"].items()})
    return {"compute": compute, "collective_shares": raw["shares"], "sync_wait_s": raw["sync_wait_s"],
            "collectives": {k: ({int(s): t for s, t in v.items()} if "unsupported" not in v else v)
                            for k, v in raw["times"].items()}}


class CalibrationFailed(RuntimeError):
    """A calibration worker raised or died; the message names its rank and why."""


def _run_workers(ctx) -> None:
    """Wait for the workers of ``ctx`` (torch.multiprocessing's context); end them all whatever
    happens here (an error, Ctrl-C, SIGTERM raised in the parent).

    Raises:
        CalibrationFailed: a worker raised (its last error line) or exited non-zero."""
    try:
        while not ctx.join(timeout=1.0):
            pass
    except mp.ProcessRaisedException as e:
        lines = [ln for ln in e.msg.strip().splitlines() if ln.strip()]
        raise CalibrationFailed(f"worker rank {e.error_index}: {lines[-1] if lines else 'unknown error'}") from None
    except mp.ProcessExitedException as e:
        try:
            why = exit_reason(ctx, e.exit_code)
        except ServerDied as died:
            raise CalibrationFailed(str(died)) from None
        raise CalibrationFailed(f"worker rank {e.error_index} {why}") from None
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
            p.join(5)


def _count_ops(fn: Callable[[], object]) -> int:
    """Aten operators that ``fn()`` dispatches (``TorchDispatchMode``)."""
    class Count(dispatch_mode_base()):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.n


def _probe_config():
    """The tiny preset's architecture at hidden 8 and one token: compute negligible beside the host
    time of its operators."""
    return ModelConfig(name="probe", n_layers=1, hidden=8, n_heads=2, n_kv_heads=1, ffn_hidden=8, vocab_size=16,
                       seq_len=1, activation="swiglu", norm="rmsnorm", position="rope", bias=False)


def _tiny_block():
    """A transformer block of :func:`_probe_config` and its input of one token."""
    return Block(_probe_config()), torch.randn(1, 1, 8)


def tp_worker(mesh, timed: Callable[[Callable], float], plain_block_s: float) -> dict:
    """Extra host microseconds under tensor parallelism on a 1-rank ``mesh`` (DTensor dispatch,
    sharding propagation, redistributions that move nothing), forward and backward per
    micro-batch: a block under the Megatron plan (xpar.parallel.tensor.block_plan) against the
    plain block (``plain_block_s``, seconds), the first stage's embedding and the last stage's
    norm, output and vocabulary-parallel loss under xpar.parallel.tensor.apply_tp against plain
    ones. ``timed(fn)``: seconds per call."""
    block, x = _tiny_block()
    parallelize_module(block, mesh, block_plan(block, False))
    tokens, h = torch.zeros(1, 1, dtype=torch.long), torch.randn(1, 1, 8)

    def last_step(m, tp: int):
        def step():
            with loss_context(tp):
                parallel_cross_entropy(m(h), tokens).backward()
        return step
    extra = {}
    for name, make, step in (("first", lambda: Transformer(_probe_config(), [], True, False),
                              lambda m, tp: lambda: m(tokens).sum().backward()),
                             ("last", lambda: Transformer(_probe_config(), [], False, True), last_step)):
        plain = timed(step(make(), 1))
        extra[f"tp_{name}_overhead_us"] = max(0.0, timed(step(apply_tp(make(), mesh, False), 2)) - plain) * 1e6
    return {"tp_block_overhead_us": max(0.0, timed(lambda: block(x).sum().backward()) - plain_block_s) * 1e6, **extra}


def host_worker(reps: int, mesh) -> dict:
    """On a 1-rank device ``mesh`` (no communication): host microseconds per aten operator (a
    tiny block's forward and backward / its operators), the extra per operator on DTensors
    (AdamW's update of 20 DTensor parameters against plain ones, 9 operators per tensor + 2),
    FSDP2's hooks per unit (the tiny block under ``fully_shard`` against the plain block), and
    tensor parallelism's per block and stage end (:func:`tp_worker`): xpar.estimate.compute.host."""
    block, x = _tiny_block()
    step = (lambda m: lambda: m(x).sum().backward())
    ops = _count_ops(step(block))
    timed = (lambda fn: median_time(fn, reps, window=STEP_WINDOW_S, clock=compute_clock("cpu", torch.get_num_threads())))
    plain = timed(step(block))
    sharded, _ = _tiny_block()
    fully_shard(sharded, mesh=mesh)
    unit = timed(step(sharded)) - plain
    per_op = {}
    for kind in ("plain", "dtensor"):
        make = (lambda t: t) if kind == "plain" else (lambda t: distribute_tensor(t, mesh, [Shard(0)]))
        params = [torch.nn.Parameter(make(torch.randn(8, 8))) for _ in range(20)]
        for p in params:
            p.grad = torch.ones_like(p)
        opt = torch.optim.AdamW(params, lr=1e-3, foreach=False)
        per_op[kind] = timed(opt.step) / (9 * len(params) + 2)
    return {"op_overhead_us": plain / ops * 1e6, "dtensor_op_overhead_us": max(0.0, per_op["dtensor"] - per_op["plain"]) * 1e6,
            "fsdp_unit_overhead_us": max(0.0, unit) * 1e6, "block_ops": ops, **tp_worker(mesh, timed, plain)}
