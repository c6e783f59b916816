"""A plan keeps memory headroom by default on a GPU (xpar.plan.inputs.GPU_HEADROOM: what the cost model
does not count), none on a CPU, the preset's or plan.memory_headroom's where given, and its table shows
memory per device against the usable memory."""
from __future__ import annotations

from xpar.plan.inputs import GPU_HEADROOM, memory_headroom


def test_default_headroom_on_a_gpu_and_what_overrides_it():
    assert 0.05 <= GPU_HEADROOM <= 0.10
    assert memory_headroom(None, {"device": "cuda", "memory_headroom": 0.0}) == GPU_HEADROOM
    assert memory_headroom(None, {"device": "cuda", "memory_headroom": 0.15}) == 0.15
    assert memory_headroom(0.0, {"device": "cuda", "memory_headroom": 0.0}) == 0.0
    assert memory_headroom(None, {"device": "cpu", "memory_headroom": 0.0}) == 0.0


def test_plan_table_shows_memory_against_usable_memory():
    from rich.console import Console

    from tests.plan.test_plan import plan_of
    from xpar.plan.show import ranked_table

    plan = plan_of("model=7b", "hardware=h100_80gb_8gpu", "plan.global_batch_size=64", "plan.schedules=[1f1b]")
    assert plan.ctx.hardware["memory_headroom"] == GPU_HEADROOM
    usable = plan.res["memory_usable"]
    device = float(plan.ctx.hardware["device_memory_gb"]) * 1e9
    assert abs(usable[plan.best] - device * (1 - GPU_HEADROOM)) < 1e3
    assert (plan.res["memory_total"][plan.ranked] <= usable[plan.ranked]).all()
    console = Console(width=400, record=True)
    console.print(ranked_table(plan))
    assert f"GB/device of {device * (1 - GPU_HEADROOM) / 1e9:.1f} usable (8 % kept free)" in console.export_text()
    tight = plan_of("model=7b", "hardware=h100_80gb_8gpu", "plan.global_batch_size=64", "plan.schedules=[1f1b]",
                    "plan.memory_headroom=0")
    assert len(tight.ranked) >= len(plan.ranked) and tight.res["memory_usable"][tight.best] == device
