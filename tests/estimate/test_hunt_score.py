"""The held-out hunts' scorer (benchmarks/hunt_score.py): the small-model and fresh groups of its medians, and the
fourth and fifth hunts' Runs tables and sidecars (benchmarks/refusal_hunt{4,5}.md, benchmarks/hunt{4,5}_published.csv)
read as the scorer and benchmarks/plan_heldout.py read them."""
from __future__ import annotations

from pathlib import Path

from benchmarks.hunt_score import METRICS, medians, published, runs_table, score_row, sidecar_for
from benchmarks.plan_heldout import hunt_rows, seen_rows

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
PREFIX = "python -m xpar run.mode=estimate tracking=off parallel.micro_batches=auto framework=megatron_core "
GPT2_124M = (PREFIX + "hardware=a100_80gb_8gpu model=175b model.name=gpt2_124m model.n_layers=12 model.hidden=768 "
             "model.n_heads=12 model.ffn_hidden=3072 model.vocab_size=50304 model.seq_len=1024 parallel.dp=8 "
             "parallel.zero_stage=1 train.dtype=bf16 train.micro_batch_size=64 train.global_batch_size=512")
LLAMA3_8B = (PREFIX + "hardware=h100_80gb_8gpu model=llama3_8b model.seq_len=8192 parallel.dp=8 parallel.zero_stage=3 "
             "train.dtype=bf16 train.micro_batch_size=1 train.global_batch_size=64")


def _row(num: int, err: float, small: bool, seen: str | None = None) -> dict:
    return dict(num=num, scores=[("step_s", 1.0, 1.0, err)], moe=False, fp8=False, cp=False, small=small, mem=None,
                seen=seen)


def test_small_group_takes_only_the_small_rows():
    """Rows 1 and 2 small (errors -10 %, +30 %), row 3 not (+90 %): the small line's median is 20 % over rows 1,2;
    the all line's 30 % over the three."""
    lines = medians([_row(1, -0.10, True), _row(2, 0.30, True), _row(3, 0.90, False)])
    small = next(line for line in lines if line.startswith("small"))
    assert "n=2" in small and "20.0 %" in small and small.endswith("rows 1,2")
    assert "30.0 %" in next(line for line in lines if line.startswith("all"))


def test_score_row_marks_a_124m_model_small_and_an_8b_model_not():
    """GPT-2 124M (0.16e9 parameters with its learned positions) is under 2e9, Llama 3 8B is not; both accepted."""
    gpt2 = score_row(1, "gpt2", GPT2_124M, [dict(metric="step_s", published="0.3")])
    llama = score_row(2, "llama", LLAMA3_8B, [])
    assert gpt2["refusal"] is None and gpt2["small"] and gpt2["scores"][0][0] == "step_s"
    assert llama["refusal"] is None and not llama["small"]


def test_fourth_hunt_table_and_sidecar_agree():
    """refusal_hunt4.md: 26 rows with a command; every sidecar row names a table row and a known metric; at least
    10 MoE commands and 4 published peaks; plan_heldout reads the accepted ones (all but row 7, refused for memory)."""
    hunt = BENCH / "refusal_hunt4.md"
    rows = runs_table(hunt)
    nums = {num for num, _, _ in rows}
    assert nums == set(range(1, 27))
    pubs = published(sidecar_for(hunt))
    assert set(pubs) <= nums
    assert all(p["metric"] in METRICS for ps in pubs.values() for p in ps)
    assert sum(1 for ps in pubs.values() if any(p["memory_gib"] for p in ps)) >= 4
    moe = {"qwen3_30b_a3b", "qwen3_235b_a22b", "llama4_scout", "gpt_oss_120b", "deepseek_v3"}
    assert sum(1 for _, _, cmd in rows if any(f"model={m} " in cmd for m in moe)) >= 10
    assert {num for num, _, _ in hunt_rows(hunt)} == nums - {7}


def test_fresh_group_takes_blank_seen_rows_and_needs_a_seen_column():
    """With a seen column: rows 1 and 3 blank (fresh, +10 % and -40 %), row 2 seen (+90 %): the fresh line is over rows
    1,3 (median |error| 25 %). Without one (seen None everywhere): no fresh line."""
    lines = medians([_row(1, 0.10, False, ""), _row(2, 0.90, False, "held elsewhere"), _row(3, -0.40, False, "")])
    fresh = next(line for line in lines if line.startswith("fresh"))
    assert "n=2" in fresh and "25.0 %" in fresh and fresh.endswith("rows 1,3")
    assert not any(line.startswith("fresh") for line in medians([_row(1, 0.10, False), _row(2, 0.90, False)]))


def test_fifth_hunt_table_sidecar_and_seen_rows_agree():
    """refusal_hunt5.md: 26 rows with a command, each with one sidecar row of a known metric; at least 8 MoE commands,
    5 published peaks and 4 cp > 1 commands; plan_heldout reads the accepted ones (all but row 26, refused) and takes
    what an earlier source holds from the sidecar's seen column (rows 4, 13, 16-21), not refusal_hunt.md's SEEN; the
    fourth hunt's sidecar has no seen column, so none of its rows is seen."""
    hunt = BENCH / "refusal_hunt5.md"
    rows = runs_table(hunt)
    nums = {num for num, _, _ in rows}
    assert nums == set(range(1, 27))
    pubs = published(sidecar_for(hunt))
    assert set(pubs) == nums and all(p["metric"] in METRICS for ps in pubs.values() for p in ps)
    assert sum(1 for ps in pubs.values() if any(p["memory_gib"] for p in ps)) >= 5
    moe = {"qwen3_30b_a3b", "qwen3_235b_a22b", "gpt_oss_120b", "deepseek_v3"}
    assert sum(1 for _, _, cmd in rows if any(f"model={m} " in cmd for m in moe)) >= 8
    assert sum(1 for _, _, cmd in rows if "parallel.cp=" in cmd and "parallel.cp=1 " not in cmd) >= 4
    assert {num for num, _, _ in hunt_rows(hunt)} == nums - {26}
    assert set(seen_rows(hunt)) == {4, 13, 16, 17, 18, 19, 20, 21}
    assert seen_rows(BENCH / "refusal_hunt4.md") == {}
