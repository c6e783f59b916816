"""Pipeline bubble ratio, measured against the replay simulation and the closed form.

pp = 2 local gloo workers, one thread each, a model where compute dominates communication
(8 layers of hidden 512: ~12.6M parameters per stage; sequence 128, micro-batch 1), GPipe
and 1F1B at m = 1, 2, 4, 8 micro-batches (1F1B needs m >= pp, so no m = 1). Each run goes
through xpar's real path (launcher, engine factory, PipelineStage, torch schedule, per-action
timers) and its per-rank records are read back: per timed step (warm-up excluded)

    measured   1 - sum_ranks busy / (pp * step time)    (xpar.track.bubble.step_bubbles)
    simulated  the executed action order replayed with the measured action times, free comm
    theory     (p - 1) / (m + p - 1)

Target: the median measured bubble within 0.05 of the simulated one and within 0.1 of
theory. Not a timed test; takes ~2-4 minutes on 2 vCPUs.

    python benchmarks/bubble.py [--steps 8] [--micro-batches 1 2 4 8] [--schedules gpipe 1f1b]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

MODEL = ["model=tiny", "model.n_layers=8", "model.hidden=512", "model.n_heads=8", "model.n_kv_heads=8",
         "model.ffn_hidden=1376", "model.vocab_size=256", "model.seq_len=128"]


def _spec(schedule: str, m: int, steps: int):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    import xpar.config.schema  # noqa: F401
    from xpar.config.presets import conf_dir
    from xpar.config.validate import validate

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        cfg = compose("config", overrides=[
            "parallel=pp", f"parallel.schedule={schedule}", f"parallel.micro_batches={m}", "parallel.dp=1",
            "tracking=off", "run.progress=false", f"train.steps={steps}", "train.warmup_steps=2",
            "train.micro_batch_size=1", "train.threads_per_worker=1", *MODEL])
    return validate(cfg, local_devices=2)


def measure(schedule: str, m: int, steps: int) -> dict:
    from xpar.track.bubble import pipelines, step_bubbles
    from xpar.estimate.schedule import bubble_theory as theory
    from xpar.models.shapes import param_count
    from xpar.run.launch import launch_local

    spec = _spec(schedule, m, steps)
    with tempfile.TemporaryDirectory() as out:
        stats = launch_local(spec, Path(out))
    pipeline = pipelines(stats, spec.pp)[0]
    per_step = [step_bubbles(pipeline, i) for i in range(spec.train.warmup_steps, spec.train.steps)]
    measured = [b["measured"] for b in per_step]
    simulated = [b["simulated"] for b in per_step]
    return {"schedule": schedule, "m": m, "measured": measured, "simulated": simulated,
            "theory": theory(schedule, spec.pp, m, 1),
            "step_s": statistics.median(b["step_time_s"] for b in per_step),
            "params_per_stage": param_count(spec.model).total / spec.pp}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=8, help="steps per run, 2 of them warm-up")
    ap.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b"])
    a = ap.parse_args()
    from xpar.config.layout import microbatch_ok

    rows = []
    t0 = time.perf_counter()
    for schedule in a.schedules:
        for m in a.micro_batches:
            if not microbatch_ok(schedule, 2, m):
                print(f"{schedule} m={m}: not a valid micro-batch count for pp=2, skipped")
                continue
            r = measure(schedule, m, a.steps)
            rows.append(r)
            print(f"{schedule} m={m}: done ({r['step_s']:.2f} s/step)", flush=True)
    print(f"\npp=2, {rows[0]['params_per_stage'] / 1e6:.1f}M parameters per stage, "
          f"{a.steps - 2} timed steps per row, {time.perf_counter() - t0:.0f} s in all\n")
    head = (f"{'schedule':<9} {'m':>2}  {'step s':>6}  {'measured median (min-max)':<26} {'simulated':>9} "
            f"{'theory':>6}  {'meas-sim':>8} {'meas-theory':>11}  target")
    print(head)
    print("-" * len(head))
    ok_all = True
    for r in rows:
        med, sim = statistics.median(r["measured"]), statistics.median(r["simulated"])
        ok = abs(med - sim) <= 0.05 and abs(med - r["theory"]) <= 0.1
        ok_all &= ok
        rng = f"{med:.3f} ({min(r['measured']):.3f}-{max(r['measured']):.3f})"
        print(f"{r['schedule']:<9} {r['m']:>2}  {r['step_s']:>6.2f}  {rng:<26} {sim:>9.3f} {r['theory']:>6.3f}  "
              f"{med - sim:>+8.3f} {med - r['theory']:>+11.3f}  {'ok' if ok else 'MISSED'}")
    print(f"\ntarget (|measured - simulated| <= 0.05 and |measured - theory| <= 0.1): "
          f"{'met on every row' if ok_all else 'missed on some rows'}")


if __name__ == "__main__":
    main()
