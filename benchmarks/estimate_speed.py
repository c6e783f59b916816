"""Time of one cost-model estimate (step time, memory, communication) at three scales.

    python benchmarks/estimate_speed.py

7B on 8 GPUs, 70B on 64 and 175B on 1024 with ZeRO-3 (FSDP over every device, full
recompute so that it fits). Each layout is estimated once cold (caches cleared: the model's
parameter shapes built on the meta device; torch imported beforehand, as in any xpar
process) and then REPEATS times warm (memoised shapes, shard sizes and schedule walks, as in
a planner's or a sweep's repeated calls). Both must stay under 50 ms whatever the world size.
Before issue 10 the 175B/1024 ZeRO-3 estimate took ~0.5-1 s: fsdp_shard_numel was called for
every parameter of every one of the 1024 dp ranks (1.58 M calls); it is now called for one
rank (:func:`xpar.estimate.memory.per_device.held_numel`).
"""
from __future__ import annotations

import statistics
import time

LAYOUTS = {
    "7B on 8 GPUs (ZeRO-3)": ("parallel=zero3", "model=7b", "hardware=a100_80gb_8gpu", "train=cluster",
                              "parallel.micro_batches=4"),
    "70B on 64 GPUs (ZeRO-3)": ("parallel=zero3", "model=70b", "hardware=a100_80gb_64gpu", "train=cluster",
                                "parallel.recompute=full"),
    "175B on 1024 GPUs (ZeRO-3)": ("parallel=zero3", "model=175b", "hardware=a100_80gb_1024gpu", "train=cluster",
                                   "parallel.recompute=full"),
}
REPEATS = 20


def spec_of(overrides: tuple):
    """A validated estimate-mode RunSpec (the fit check included) for ``overrides``."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    import xpar.config.schema  # noqa: F401
    from xpar.config.presets import conf_dir
    from xpar.estimate.preflight.check import check_run

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        cfg = compose(config_name="config", overrides=["tracking=off", "run.progress=false", *overrides])
    return check_run(cfg)


def main() -> dict[str, float]:
    """Print one estimate's time per layout; return the slower of cold and warm (seconds)."""
    import torch  # noqa: F401  (imported once, as in any xpar process; not part of an estimate)

    from xpar.estimate.memory import per_device as mem
    from xpar.estimate.cost import assumptions_for, estimate

    out = {}
    for label, overrides in LAYOUTS.items():
        spec = spec_of(overrides)  # validation + fit check, not timed
        for cache in [getattr(mem, name) for name in dir(mem)]:  # every memo of the memory model: cold
            if hasattr(cache, "cache_clear"):
                cache.cache_clear()
        t = time.perf_counter()
        estimate(spec, assumptions_for(spec))
        cold = time.perf_counter() - t
        times = []
        for _ in range(REPEATS):
            t = time.perf_counter()
            est = estimate(spec, assumptions_for(spec))
            times.append(time.perf_counter() - t)
        out[label] = max(cold, statistics.median(times))
        print(f"{label:28s} world {spec.world_size:5d}  one estimate: cold {cold * 1e3:6.1f} ms (shapes built on meta), "
              f"warm {statistics.median(times) * 1e3:5.2f} ms (median of {REPEATS})   "
              f"peak {est.memory.total / 1e9:5.1f} GB/device, {est.time_per_step_s:.3g} s/step")
    return out


if __name__ == "__main__":
    main()
