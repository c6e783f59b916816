"""The plan's top list of distinct choices (xpar.plan.groups): one row per degree group, ties with the
winner marked, the axes that separate a group named, alternatives that differ in their axis."""
import numpy as np

from xpar.estimate.cost import TIME_TERMS
from xpar.plan.explain import alternative_lines
from xpar.plan.groups import differing_axes, group_heads, group_ranks, ties


def _res():
    """Six layouts: three of one degree group (tp 8 pp 4 dp 2, differing in m), two of another."""
    cols = dict(tp=[8, 8, 8, 4, 4, 2], pp=[4, 4, 4, 8, 8, 16], dp=[2, 2, 2, 2, 2, 2], zero=[1, 1, 1, 1, 1, 0],
                m=[8, 16, 32, 8, 16, 8], tokens_per_s=[100.0, 99.9, 99.5, 97.0, 96.0, 80.0])
    return {k: np.array(v) for k, v in cols.items()}


def test_group_heads_keep_the_best_of_each_degree_set_in_rank_order():
    res = _res()
    ranked = np.argsort(-res["tokens_per_s"])
    heads, sizes = group_heads(res, ranked)
    assert heads.tolist() == [0, 3, 5]
    assert sizes.tolist() == [3, 2, 1]
    assert group_ranks(res, ranked).tolist() == [1, 1, 1, 2, 2, 3]


def test_ties_are_within_the_stated_error_and_axes_name_the_difference():
    res = _res()
    assert ties(res, np.array([0, 3, 5]), 0, 0.05).tolist() == [True, True, False]
    assert ties(res, np.array([3]), 0, 0.01).tolist() == [False]
    assert differing_axes(res, 3, 0) == "tp 8->4, pp 4->8"
    assert differing_axes(res, 5, 0) == "tp 8->2, pp 4->16, ZeRO 1->0"
    assert differing_axes(res, 1, 0) == ""


def test_each_alternative_differs_in_its_axis_and_none_is_printed_twice():
    res = _res()
    for k in ("b", "v", "sp", "mfu", "memory_total", "time_per_step_s") + tuple(f"time_{t}" for t in TIME_TERMS):
        res[k] = np.ones(6)
    res["recompute"], res["schedule"] = np.array(["none"] * 6), np.array(["1f1b"] * 6)
    lines = [ln for ln in alternative_lines(res, np.argsort(-res["tokens_per_s"])) if "best with another" in ln]
    tp, pp = lines[0], lines[1]
    assert "another tp (tp4 pp8" in tp  # row 3 differs in tp (and pp)
    assert "another pp (tp2 pp16" in pp  # row 3 is already shown: the next that differs in pp


def test_looped_schedules_try_small_v_that_do_not_divide_the_layers():
    """Llama 3 405B ran v 8 on 126 layers; DeepSeek-V3-style 61 layers at v 4: both in the space now."""
    from xpar.plan.space import schedule_pairs
    pairs = set(schedule_pairs(126))
    assert ("interleaved_1f1b", 8) in pairs and ("interleaved_1f1b", 4) in pairs and ("interleaved_1f1b", 63) in pairs
    assert ("interleaved_1f1b", 4) in set(schedule_pairs(61)) and ("interleaved_1f1b", 9) not in set(schedule_pairs(8))


def test_alternatives_within_the_stated_error_are_marked_as_ties():
    """'best with another X' says 'a tie' where it is within plan.tie_within of the winner, as the table does:
    tp 4 at -3.0 % is a tie at 5 %, tp 2 at -20 % is not; without tie_within nothing is marked."""
    res = _res()
    for k in ("b", "v", "sp", "mfu", "memory_total", "time_per_step_s") + tuple(f"time_{t}" for t in TIME_TERMS):
        res[k] = np.ones(6)
    res["recompute"], res["schedule"] = np.array(["none"] * 6), np.array(["1f1b"] * 6)
    ranked = np.argsort(-res["tokens_per_s"])
    tp, pp = [ln for ln in alternative_lines(res, ranked, 0.05) if "best with another" in ln][:2]
    assert "-3.0 % tokens/s, a tie (within 5 %)" in tp and "tie" not in pp
    assert not any("tie" in ln for ln in alternative_lines(res, ranked))


def test_ties_beyond_the_table_are_counted_with_the_top_k_that_lists_them():
    """Three groups within 5 % of the winner and a table of 2 rows: one more tie is said, with plan.top_k=3;
    a table of 3 rows (or a 1 % tie) says nothing."""
    from types import SimpleNamespace

    from xpar.plan.show import more_ties_line
    res = _res()
    res["tokens_per_s"] = np.array([100.0, 99.9, 99.5, 97.0, 96.0, 96.5])
    ranked = np.argsort(-res["tokens_per_s"])

    def plan(top_k, within=0.05):
        return SimpleNamespace(res=res, ranked=ranked, best=0, inputs=SimpleNamespace(top_k=top_k, tie_within=within))
    assert more_ties_line(plan(2)) == ["1 more degree group ties with the best (within 5 %, closer than the "
                                       "estimate's error) below the table: plan.top_k=3 lists them all."]
    assert more_ties_line(plan(3)) == [] and more_ties_line(plan(2, 0.01)) == []
