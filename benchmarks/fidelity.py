"""The cost model against this machine: a fixed set of layouts run for real and estimated.

For each layout (dp, zero1, zero2, zero3, tp, pp with gpipe, 1f1b, torch's zero-bubble schedules (zbv,
InterleavedZeroBubble) and 1f1b over uneven stages (first stage 1 block of mini's 4), 3D pp2 x dp2 x tp2;
models mini and small by default), run xpar's real path on local gloo workers (launcher, engine
factory, train loop) and print the estimated and measured step time, peak memory per
device and bubble ratio (xpar.run.fidelity: the run's own estimate on its hardware), then the
median and max |ratio - 1| over the layouts. Targets (issue "xpar calibrate and the closed
loop"): median |step-time ratio - 1| <= 15 %, max <= 35 %; peak memory within 5 %; bubble
within 0.05.

Use a calibrated preset for the estimate to see this machine's links, memory and host time:

    xpar calibrate hardware=local --name here
    python benchmarks/fidelity.py --hardware calibrated_here [--steps N] [--models tiny small] [--repeat 2]

The two sizes are mini (7.5M parameters, 4 x 64 tokens: a 2-worker step of 0.2-0.5 s here) and small
(GPT-2 124M). ``--models tiny`` adds the toy model (0.1M parameters): its 15-60 ms steps are
host time and waits at blocking collectives, and the same layout moved 30-50 % between runs
minutes apart (sessions 6-7); it shows the host-time model, not the compute and communication
model the targets are about.

The small model (GPT-2 124M) runs at micro-batch 1 x 128 tokens (MODEL_OVERRIDES): at its preset
4 x 1024 a dp step takes ~65 s here, the layout set an hour; its vocabulary padded to 50304 (a
multiple of 128, as Megatron-LM pads GPT-2's 50257) so that tp = 2 divides it, and its output
not tied to the embedding (pp > 1 would split the tied pair across stages). ``--repeat k`` runs each layout k
times and keeps the run with the shortest step (the cost model estimates a machine to itself; on
a shared machine the quietest run is the closest to that); the load average (1 min, before the
run) is printed beside each row. A run during which the hypervisor stole more than ``--max-steal``
(5 %) of the machine is measured again, twice at most (``tries``: the runs a row took).
``--calibrate-each`` measures the machine again (``xpar calibrate``, ~30 s) right before every
run, as it is then: the whole calibration, not ``--quick`` (4 message sizes, 5 repetitions),
whose estimates of the same layout moved 10-30 % between back-to-back calibrations (GPT-2
small's 25 MB dp buckets fall between its 4 and 64 MiB points). Not a timed test: 15-25 minutes
on 2 vCPUs.

``xpar calibrate`` measures compute in CPU seconds (what the work costs a core, whatever else the
machine runs); the estimate stretches a step only for its own workers outnumbering the cores
(xpar.estimate.compute.host.oversubscription). A shared machine's other load stretches it too, and by
the minute: each run's workers' CPU share over the timed steps (the main threads' schedstat: ns
on a core / ns runnable, ``share``) and the hypervisor's steal over the same window (``/proc/stat``:
time the VM's vCPUs ran nothing of this guest, which neither counts) give the cores they got
(xpar.run.fidelity.cores_got), and the
estimate on those cores is printed beside the plain one (``est got``, ``got/meas``).
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

LAYOUTS = {
    "dp": ["parallel=dp"], "zero1": ["parallel=zero1"], "zero2": ["parallel=zero2"], "zero3": ["parallel=zero3"],
    "tp": ["parallel=tp"], "pp-gpipe": ["parallel=pp", "parallel.schedule=gpipe"],
    "pp-1f1b": ["parallel=pp", "parallel.schedule=1f1b"], "3d": ["parallel=3d_local"],
    "pp-zbv": ["parallel=pp", "parallel.schedule=zbv"], "pp-zb": ["parallel=pp", "parallel.schedule=zero_bubble"],
    "pp-uneven": ["parallel=pp", "parallel.schedule=1f1b", "parallel.first_stage_layers=1"],
}

STEPS = {"tiny": 40, "mini": 20, "small": 11}
"""Steps per run by model (:data:`WARMUP` of them warm-up): the timed steps span several seconds
(a tiny step takes 15-60 ms here, and the median of 6 such steps moved by 35 % between
back-to-back runs; a mini step 0.2-0.5 s, 2 s in 3D)."""

WARMUP = {"tiny": 2, "mini": 2, "small": 4}
"""Warm-up steps by model, left out of the measured step time. GPT-2 small's FSDP steps here
settle only after 4-5 steps (ZeRO-2, seconds per step: 5.7 5.4 4.3 3.7 3.1 4.1 2.9 3.3; 6.7 5.7
4.1 3.5 2.8 3.2 2.8 3.2 ...; 3D: 26.7 15.2 13.0 13.3 12.8 11.7 11.1), a mini step after 1-2;
the estimate is of the settled step."""

MODEL_OVERRIDES = {"small": ["train.micro_batch_size=1", "train.seq_len=128", "model.vocab_size=50304",
                             "model.tied_embeddings=false"]}
"""Shapes that keep a layout's run under a minute here (module docstring)."""


def _spec(layout: list[str], model: str, hardware: str, steps: int):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    import xpar.config.schema  # noqa: F401
    from xpar.config.presets import conf_dir
    from xpar.estimate.preflight.check import check_run

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        cfg = compose("config", overrides=[*layout, f"model={model}", *MODEL_OVERRIDES.get(model, []),
                                           f"hardware={hardware}", "tracking=off",
                                           "run.progress=false", f"train.steps={steps}",
                                           f"train.warmup_steps={min(WARMUP.get(model, 2), steps - 1)}"])
    return check_run(cfg, local_devices=8 if "parallel=3d_local" in layout else 2)


def _children() -> list[int]:
    """Pids whose parent is this process (the local workers of a run), from /proc."""
    import os

    me, out = os.getpid(), []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == me:
                        out.append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    return out


class ShareSampler:
    """Samples the workers' threads (xpar.run.fidelity.task_cpu_ns) every ``period`` seconds while a
    run goes on, with the machine's steal ticks; :meth:`window` is their CPU share and the steal
    fraction between two wall times (the timed steps)."""

    def __init__(self, period: float = 0.1):
        import threading

        self.period, self.samples, self.stop = period, [], threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import time

        from xpar.run.fidelity import machine_jiffies, task_cpu_ns
        pids: list[int] = []
        while not self.stop.wait(self.period):
            pids = pids if len(self.samples) % 10 else _children()  # the workers: looked up once a second
            self.samples.append((time.time(), task_cpu_ns(pids, main_only=True), machine_jiffies()))

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()

    def window(self, t0: float, t1: float) -> tuple[float, float]:
        """(CPU share of the workers, steal fraction of the machine) between the last sample
        before ``t0`` and the first after ``t1`` (the whole run's where none brackets them);
        (1.0, 0.0) without samples."""
        from xpar.run.fidelity import cpu_share, steal_fraction

        s = [x for x in self.samples if x[1]]
        if len(s) < 2:
            return 1.0, 0.0
        before = max((x for x in s if x[0] <= t0), key=lambda x: x[0], default=s[0])
        after = min((x for x in s if x[0] >= t1), key=lambda x: x[0], default=s[-1])
        return cpu_share(before[1], after[1]), steal_fraction(before[2], after[2])


def _timed_window(out: Path, warmup: int) -> tuple[float, float]:
    """Wall times (s) of the end of the last warm-up step and of the last step, rank 0's step file."""
    import json

    recs = [json.loads(line) for line in (out / "steps" / "rank0.jsonl").read_text().splitlines() if line.strip()]
    ends = {r["step"]: r["ts_ms"] / 1e3 for r in recs}
    return ends.get(warmup - 1, min(ends.values())), max(ends.values())


def measure(name: str, layout: list[str], model: str, hardware: str, steps: int) -> dict:
    """One real run; its measured and estimated figures (xpar.run.fidelity), and the estimate again
    on the cores its workers got (``est_got_s``, ``got_ratio``: xpar.run.fidelity.cores_got from
    their CPU share over the timed steps, ``share``)."""
    from xpar.estimate.cost import estimate, with_hardware
    from xpar.run.fidelity import cores_got
    from xpar.run.job import _summarize
    from xpar.run.launch import launch_local

    spec = _spec(layout, model, hardware, steps)
    with tempfile.TemporaryDirectory() as out, ShareSampler() as sampler:
        stats = launch_local(spec, Path(out))
        window = _timed_window(Path(out), spec.train.warmup_steps)
    report = _summarize(spec, stats)
    x, (share, steal) = report.extra, sampler.window(*window)
    got = None
    if spec.hardware.cpu_cores:
        threads = spec.train.threads_per_worker or 1
        cores = cores_got(share, spec.world_size, threads, spec.hardware.cpu_cores, steal)
        got = estimate(with_hardware(spec, cpu_cores=cores)).time_per_step_s
    return {"layout": name, "model": model, "step_s": report.step_time_s, "est_s": spec_estimate_s(x),
            "time_ratio": x.get("fidelity/step_time_ratio", float("nan")), "share": share, "steal": steal,
            "est_got_s": got, "got_ratio": got / report.step_time_s if got and report.step_time_s else float("nan"),
            "peak_bytes": report.peak_bytes_per_device, "mem_ratio": x.get("fidelity/peak_memory_ratio", float("nan")),
            "bubble_diff": x.get("fidelity/bubble_diff")}


def spec_estimate_s(extra: dict) -> float:
    """The run's estimated step time, seconds: the sum of its ``fidelity/estimate_time_*_s`` terms."""
    return sum(v for k, v in extra.items() if k.startswith("fidelity/estimate_time_"))


def recalibrate(name: str) -> str:
    """``xpar calibrate hardware=local --no-track --name <name>`` (about 30 s here): the machine
    measured as it is now; the preset's name (hardware=calibrated_<name>)."""
    import subprocess
    import sys

    for _ in range(3):  # a quick fit on a busy machine can find no cost per byte (exit 1): measure again
        with tempfile.TemporaryDirectory() as out:
            r = subprocess.run([sys.executable, "-m", "xpar", "calibrate", "hardware=local", "--no-track",
                                "--name", name, "--out", out], capture_output=True, text=True)
        if r.returncode == 0:
            return f"calibrated_{name}"
    raise RuntimeError(f"xpar calibrate failed three times: {r.stderr.strip()[-500:]}")


MAX_STEAL = 0.05
"""A run whose timed steps lost more than this share of the machine to the hypervisor (steal:
another guest on the same cores) is measured again, at most :data:`STEAL_RETRIES` times. The
estimate is of this machine, not of its neighbours' load; measured here in one benchmark run,
ZeRO-2 mini at 33 % steal took 613 ms against 226-330 ms in the runs before (estimate 326)."""
STEAL_RETRIES = 2


def quietest(name: str, layout: list[str], model: str, hardware: str, steps: int, repeat: int,
             calibrate_each: bool = False, max_steal: float = MAX_STEAL) -> dict:
    """:func:`measure` ``repeat`` times (each after :func:`recalibrate` with ``calibrate_each``),
    each measured again while its steal exceeds ``max_steal`` (at most :data:`STEAL_RETRIES`
    times); the run with the least steal past ``max_steal``, then the shortest step, with the
    1-minute load average before it (``load``) and the runs it took (``tries``)."""
    import os

    runs = []
    for _ in range(max(1, repeat)):
        for _ in range(1 + STEAL_RETRIES):
            hw = recalibrate("fidelity_now") if calibrate_each else hardware
            load = os.getloadavg()[0]
            runs.append(dict(measure(name, layout, model, hw, steps), load=load))
            if runs[-1]["steal"] <= max_steal:
                break
    best = min(runs, key=lambda r: (max(r["steal"], max_steal), r["step_s"]))
    return dict(best, tries=len(runs))


def _summary(rows: list[dict]) -> None:
    for key, target in (("time_ratio", "median <= 0.15, max <= 0.35"),
                        ("got_ratio", "the same, estimated on the cores the workers got"),
                        ("mem_ratio", "every |r - 1| <= 0.05")):
        errs = [abs(r[key] - 1) for r in rows if r[key] == r[key]]
        if not errs:
            continue
        print(f"{key}: median |r - 1| {statistics.median(errs):.3f}, max {max(errs):.3f}  (target {target})")
    diffs = [abs(r["bubble_diff"]) for r in rows if r["bubble_diff"] is not None]
    if diffs:
        print(f"bubble: max |estimate - measured| {max(diffs):.3f}  (target <= 0.05)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hardware", default="local")
    ap.add_argument("--steps", type=int, default=None, help="steps per run (default: STEPS by model)")
    ap.add_argument("--models", nargs="+", default=["mini", "small"])
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS))
    ap.add_argument("--repeat", type=int, default=1, help="runs per layout; the shortest step is kept")
    ap.add_argument("--max-steal", type=float, default=MAX_STEAL,
                    help="measure a run again while the hypervisor stole more than this share of the machine")
    ap.add_argument("--calibrate-each", action="store_true",
                    help="xpar calibrate before every run (a shared machine's load changes by the minute); "
                         "overrides --hardware")
    args = ap.parse_args()
    if not args.calibrate_each and not args.hardware.startswith("calibrated_"):
        print(f"note: hardware={args.hardware} holds no measured figures of this machine (links, memory, host time, "
              f"cores), so the estimates and 'est got' say little; measure it first: xpar calibrate hardware=local "
              f"--name here, then --hardware calibrated_here (or --calibrate-each)", flush=True)
    rows = []
    print(f"{'layout':<9} {'model':<6} {'est ms':>8} {'step ms':>8} {'est/meas':>8} {'share':>5} {'steal':>5} {'est got':>8} "
          f"{'got/meas':>8} {'peak MiB':>9} {'est/meas':>8} {'bubble d':>8} {'load':>5} {'tries':>5}")
    for model in args.models:
        for name in args.layouts:
            steps = args.steps or STEPS.get(model, 8)
            r = quietest(name, LAYOUTS[name], model, args.hardware, steps, args.repeat, args.calibrate_each,
                         args.max_steal)
            rows.append(r)
            bd = "" if r["bubble_diff"] is None else f"{r['bubble_diff']:+.3f}"
            got = "" if r["est_got_s"] is None else f"{r['est_got_s'] * 1e3:.1f}"
            print(f"{name:<9} {model:<6} {r['est_s'] * 1e3:>8.1f} {r['step_s'] * 1e3:>8.1f} {r['time_ratio']:>8.3f} "
                  f"{r['share']:>5.2f} {r['steal']:>5.2f} {got:>8} {r['got_ratio']:>8.3f} "
                  f"{r['peak_bytes'] / 2 ** 20:>9.2f} {r['mem_ratio']:>8.3f} {bd:>8} {r['load']:>5.2f} "
                  f"{r['tries']:>5}", flush=True)
    _summary(rows)
    if args.calibrate_each:
        from xpar.config.presets import conf_dir
        (conf_dir() / "hardware" / "calibrated_fidelity_now.yaml").unlink(missing_ok=True)


if __name__ == "__main__":
    main()
