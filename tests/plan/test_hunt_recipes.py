"""benchmarks/hunt_recipes.py: the benchmark recipes' settings that held-out hunt rows' typed commands leave out
(issue 44), applied by plan_heldout.py and hunt_score.py with --recipe."""
from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.hunt_recipes import RECIPES, checked_sets, recipe_overrides, with_overrides
from benchmarks.hunt_score import runs_table
from xpar.plan.verify import compose_line

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def test_every_recipe_names_a_moe_row_of_its_hunt():
    """A typo in a hunt name or row number would silently apply nothing: each entry is a row with a command that
    command names a model with experts (the gate only routes experts), with a source line."""
    for (hunt, row), (overrides, source) in RECIPES.items():
        rows = {num: command for num, _, command in runs_table(BENCH / hunt)}
        assert row in rows, (hunt, row)
        assert overrides and source
        assert "n_experts" in rows[row] or "qwen3_30b_a3b" in rows[row] or "deepseek_v3" in rows[row], (hunt, row)


def test_recipe_overrides_by_file_name_and_none_elsewhere():
    assert recipe_overrides(BENCH / "refusal_hunt3.md", 23) == ("model.moe_routing=round_robin",)
    assert recipe_overrides(Path("elsewhere") / "refusal_hunt2.md", 9) == ("model.moe_routing=round_robin",)
    assert recipe_overrides(BENCH / "refusal_hunt2.md", 5) == ()  # Megatron-Core: random logits, learned spread
    assert recipe_overrides(BENCH / "refusal_hunt.md", 9) == ()
    assert recipe_overrides(BENCH / "refusal_hunt4.md", 10) == ("model.moe_routing=round_robin",)  # torchtitan's


def test_an_appended_override_wins_over_the_typed_command():
    """Hydra takes the last value of a key: the recipe's routing replaces the typed (default) one."""
    command = dict((num, c) for num, _, c in runs_table(BENCH / "refusal_hunt3.md"))[22]
    typed, recipe = compose_line(command), compose_line(with_overrides(command, recipe_overrides(
        BENCH / "refusal_hunt3.md", 22)))
    assert typed.model.moe_routing == "learned" and recipe.model.moe_routing == "round_robin"
    assert with_overrides(command, ()) == command


def test_set_values_are_dotted_key_value_pairs(capsys):
    assert checked_sets(["model.moe_routing=round_robin", "framework.ep_a2a_overlap=0.3"], "x") == (
        "model.moe_routing=round_robin", "framework.ep_a2a_overlap=0.3")
    assert checked_sets(None, "x") == ()
    for bad in ("foo", "moe_routing=round_robin", "model.moe routing=x"):
        with pytest.raises(SystemExit) as e:
            checked_sets([bad], "plan_heldout")
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("plan_heldout: --set") and "model.moe_routing" in err


def test_the_megatron_bridge_deepseek_v3_row_runs_its_recipe_overlap_and_recompute():
    """hunt1 row 31 (Megatron-Bridge 25.09, DeepSeek-V3 on 1024 H100): its recipe's 1F1B all-to-all overlap at the
    value tests/data prices Megatron-Bridge's overlapped rows with, and its MLA up-projection recompute."""
    from xpar.calibrate.cp_fp8 import MOE_A2A_OVERLAP

    command = dict((num, c) for num, _, c in runs_table(BENCH / "refusal_hunt.md"))[31]
    cfg = compose_line(with_overrides(command, recipe_overrides(BENCH / "refusal_hunt.md", 31)))
    assert cfg.framework.ep_a2a_overlap == MOE_A2A_OVERLAP and cfg.parallel.recompute == "mla_up_proj"
    assert compose_line(command).framework.ep_a2a_overlap == 0.0
