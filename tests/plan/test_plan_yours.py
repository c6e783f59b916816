"""``xpar plan`` places the layout its command states (xpar.plan.yours): rank, tokens/s against the winner and what
separates it, or why it is not in the space."""
from __future__ import annotations

import re

import numpy as np
from omegaconf import OmegaConf

from xpar.config.validate import validate
from xpar.estimate.cost import estimate
from xpar.estimate.step_parts import assumptions_for
from xpar.plan.command import run_plan
from tests.plan.test_plan import argv, cfg_of

BASE = ("model=tiny", "hardware=a100_80gb_node", "tracking=off", "plan.global_batch_size=64")


def _plan(tmp_path, capsys, *extra: str):
    given = BASE + extra
    plan = run_plan(cfg_of(*given), tmp_path, tmp_path, argv(*given))
    out = capsys.readouterr().out.split("\nYour layout")
    return plan, ["Your layout" + out[1].split("\n\n")[0]][0].splitlines() if len(out) > 1 else []


def test_a_stated_layout_is_ranked_at_the_estimates_tokens_per_s(tmp_path, capsys):
    """tp 2 pp 2 dp 2 at b 2: its tokens/s in the line is the estimate's of the same layout (run.mode=estimate), its
    rank is its place among the layouts that fit, and the lines say what separates it from the winner."""
    stated = ("parallel.tp=2", "parallel.pp=2", "parallel.dp=2", "parallel.schedule=1f1b", "train.micro_batch_size=2")
    plan, lines = _plan(tmp_path, capsys, *stated)
    assert lines[0].startswith("Your layout (tp2 pp2 dp2 b2 ZeRO-0 recompute=none): "), lines
    tokens = float(re.search(r": ([\d,]+) tokens/s", lines[0]).group(1).replace(",", ""))
    over = {"run": {"mode": "estimate"}, "train": {"global_batch_size": 64}, "parallel": {"micro_batches": "auto"}}
    spec = validate(OmegaConf.merge(cfg_of(*BASE, *stated), over), local_devices=1)
    assert tokens == round(estimate(spec, assumptions_for(spec)).tokens_per_s)
    rank = int(re.search(r"rank ([\d,]+) of", lines[0]).group(1))
    assert round(plan.res["tokens_per_s"][plan.ranked[rank - 1]]) == tokens
    assert rank > 1 and any(x.startswith("  the winner (") and "over its group's best" in x for x in lines[1:])


def test_the_winner_stated_is_rank_one_in_the_winners_group(tmp_path, capsys):
    plan, _ = _plan(tmp_path, capsys)
    r, i = plan.res, plan.best
    stated = (f"parallel.tp={r['tp'][i]}", f"parallel.pp={r['pp'][i]}", f"parallel.dp={r['dp'][i]}",
              f"parallel.zero_stage={r['zero'][i]}", f"train.micro_batch_size={r['b'][i]}",
              f"parallel.recompute={r['recompute'][i]}", f"parallel.sequence_parallel={bool(r['sp'][i])}",
              f"parallel.schedule={r['schedule'][i] if r['pp'][i] > 1 else '1f1b'}", f"parallel.virtual_stages={r['v'][i]}")
    _, lines = _plan(tmp_path, capsys, *stated)
    assert "+0.0 % against the best (a tie); rank 1 of" in lines[0] and "its degree group 1 of" in lines[0], lines
    assert lines[1:] == ["  its degree group is the winner's"]


def test_a_stated_layout_outside_the_space_or_invalid_says_why(tmp_path, capsys):
    _, lines = _plan(tmp_path, capsys, "parallel.tp=2", "parallel.dp=2", "parallel.cp=2", "plan.cp=[1]")
    assert lines == ["Your layout (tp2 pp1 dp2 cp2 b1 ZeRO-0 recompute=none): its degrees are not in the plan's "
                     "space (cp 2 not in plan.cp [1])."], lines
    _, lines = _plan(tmp_path, capsys, "parallel.tp=3")
    assert len(lines) == 1 and lines[0].startswith("Your layout (the command's parallel.*) is not placed: dp=auto needs")


def test_no_stated_layout_no_line_and_a_stated_one_in_plan_txt(tmp_path, capsys):
    plan, lines = _plan(tmp_path, capsys)
    assert lines == [] and plan.yours == ()
    plan, lines = _plan(tmp_path, capsys, "parallel.micro_batches=4")
    assert lines == []
    from xpar.plan.record import write_artifacts
    plan, lines = _plan(tmp_path, capsys, "parallel.tp=2", "parallel.dp=4")
    write_artifacts(plan, "python -m xpar ...", tmp_path)
    assert lines[0] in (tmp_path / "plan.txt").read_text() and np.all(plan.res["tp"] >= 1)


def test_a_stated_layout_that_does_not_fit_says_by_how_much_and_what_its_group_pays_to_fit(tmp_path, capsys):
    """7B on 8 H100 under ZeRO-3 at tp 1, micro-batch 8, no recompute: over the device; its group's best that fits is
    slower and the line says what that best pays, not a gain. No host link figure: the plan offloads no activations
    (with them it would fit: tests/plan/test_plan_act_offload.py)."""
    given = ("model=7b", "hardware=h100_80gb_node", "tracking=off", "plan.global_batch_size=64", "parallel.tp=1",
             "parallel.dp=8", "parallel.zero_stage=3", "train.micro_batch_size=8", "parallel.recompute=none",
             "hardware.pcie_gb_per_s=null")
    run_plan(cfg_of(*given), tmp_path, tmp_path, argv(*given))
    lines = capsys.readouterr().out.split("\nYour layout")[1].split("\n\n")[0].splitlines()
    assert "GB per device does not fit" in lines[0] and "usable" in lines[0], lines
    group = [x for x in lines if x.startswith("  the best of its degree group that fits (")]
    assert group and ", as it pays: +" in group[0] and " -" in group[0].split("tokens/s")[0], lines


def test_a_cluster_preset_plans_at_its_own_global_batch_and_is_placed(tmp_path, capsys):
    """parallel=175b_1024gpu states 192 micro-batches of 1 over dp 8: the plan searches at that global batch (1,536,
    GPT-3's; was 2,048 from 4M tokens, where the preset's own layout does not validate) and places the preset."""
    given = ("parallel=175b_1024gpu", "hardware=a100_80gb_1024gpu", "tracking=off")
    plan = run_plan(cfg_of(*given), tmp_path, tmp_path, argv(*given))
    out = capsys.readouterr().out
    assert "global batch 1536" in out.splitlines()[0] and plan.inputs.constraints.global_batch == (1536, 1536)
    line = out.split("\nYour layout")[1].splitlines()[0]
    assert line.startswith(" (tp8 pp16 dp8 b1 ZeRO-0 recompute=full): ") and "rank " in line, line


def test_a_stated_layout_on_local_hardware_is_placed_on_the_local_devices(tmp_path, capsys):
    """hardware=local plans on this machine's devices: a stated layout was validated on 1 device and not placed."""
    given = ("model=tiny", "hardware=local", "tracking=off", "parallel.dp=auto", "parallel.tp=1")
    plan = run_plan(cfg_of(*given), tmp_path, tmp_path, argv(*given))
    assert plan.yours and plan.yours[0].startswith(f"Your layout (tp1 pp1 dp{plan.devices} "), plan.yours
