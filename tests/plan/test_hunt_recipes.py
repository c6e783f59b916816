"""benchmarks/hunt_recipes.py: the benchmark recipes' settings that held-out hunt rows' typed commands leave out
(issue 44), applied by plan_heldout.py and hunt_score.py with --recipe."""
from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.hunt_recipes import RECIPES, checked_sets, recipe_overrides, with_overrides
from benchmarks.hunt_score import runs_table
from xpar.plan.verify import compose_line

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def test_every_recipe_names_a_row_of_its_hunt_and_routing_ones_a_moe_row():
    """A typo in a hunt name or row number would silently apply nothing: each entry is a row with a command, with a
    source line; a routing recipe's command names a model with experts (the gate only routes experts)."""
    for (hunt, row), (overrides, source) in RECIPES.items():
        rows = {num: command for num, _, command in runs_table(BENCH / hunt)}
        assert row in rows, (hunt, row)
        assert overrides and source
        if any(o.startswith("model.moe_routing=") for o in overrides):
            assert "n_experts" in rows[row] or "qwen3_30b_a3b" in rows[row] or "deepseek_v3" in rows[row], (hunt, row)


def test_the_small_model_recipes_compose_to_their_sources_kernels():
    """hunt4 rows 20-24 (llm.c) under framework=llmc, the 124M run's reduction after the backward; row 25 (TinyLlama)
    at one element-wise pass."""
    rows = {num: command for num, _, command in runs_table(BENCH / "refusal_hunt4.md")}
    got = {r: compose_line(with_overrides(rows[r], recipe_overrides(BENCH / "refusal_hunt4.md", r))).framework
           for r in (20, 23, 25)}
    assert (got[20].name, got[20].dp_overlap, got[23].name, got[23].dp_overlap) == ("llmc", False, "llmc", True)
    assert got[25].name == "llmfoundry" and got[25].elementwise_passes == 1.0


TITAN_DEEPEP = ("model.moe_routing=round_robin", "framework.checkpoint_early_stop=false",
                "framework.moe_recompute_graph_kept=true")


def test_recipe_overrides_by_file_name_and_none_elsewhere():
    assert recipe_overrides(BENCH / "refusal_hunt3.md", 23) == TITAN_DEEPEP
    assert recipe_overrides(Path("elsewhere") / "refusal_hunt2.md", 9) == ("model.moe_routing=round_robin",)
    assert recipe_overrides(BENCH / "refusal_hunt2.md", 5) == ()  # Megatron-Core: random logits, learned spread
    assert recipe_overrides(BENCH / "refusal_hunt.md", 9) == ()
    assert recipe_overrides(BENCH / "refusal_hunt4.md", 10) == TITAN_DEEPEP  # torchtitan's DeepEP recipe again


def test_an_appended_override_wins_over_the_typed_command():
    """Hydra takes the last value of a key: the recipe's routing replaces the typed (default) one."""
    command = dict((num, c) for num, _, c in runs_table(BENCH / "refusal_hunt3.md"))[22]
    typed, recipe = compose_line(command), compose_line(with_overrides(command, recipe_overrides(
        BENCH / "refusal_hunt3.md", 22)))
    assert typed.model.moe_routing == "learned" and recipe.model.moe_routing == "round_robin"
    # torchtitan's ActivationCheckpoint.early_stop defaults to False since its PR 1580: the whole forward reruns
    assert typed.framework.checkpoint_early_stop is True and recipe.framework.checkpoint_early_stop is False
    assert with_overrides(command, ()) == command


def test_the_deepep_branch_rows_keep_their_recompute_graphs():
    """The rows torchtitan's DeepEP README published ran its deepep branch, whose manager keeps token_probs: their
    recipe prices the kept graphs (framework.moe_recompute_graph_kept); the AutoModel rows' dispatcher does not."""
    for hunt, row in (("refusal_hunt3.md", 22), ("refusal_hunt3.md", 25), ("refusal_hunt4.md", 11)):
        command = dict((num, c) for num, _, c in runs_table(BENCH / hunt))[row]
        typed = compose_line(command)
        recipe = compose_line(with_overrides(command, recipe_overrides(BENCH / hunt, row)))
        assert not typed.framework.moe_recompute_graph_kept and recipe.framework.moe_recompute_graph_kept, (hunt, row)
    assert "framework.moe_recompute_graph_kept=true" not in recipe_overrides(BENCH / "refusal_hunt2.md", 10)


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
