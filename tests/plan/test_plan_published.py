"""Published layouts (tests/data/) against the plan's top list (issue 44 item 5): for each run, the plan
with its model, hardware, framework profile and global batch holds the published layout's degree group
(tp, pp, dp, cp, ep, ZeRO, etp) among its top 10 groups, or the test says why not. A few rows, each a
plan of 1-8 s."""
from __future__ import annotations

import csv
import pathlib

import numpy as np

from tests.plan.test_plan import plan_of
from xpar.plan.groups import group_ranks

DATA = pathlib.Path(__file__).parents[1] / "data"


def rows(name: str) -> list[dict]:
    with open(DATA / name) as f:
        return list(csv.DictReader(line for line in f if not line.startswith("#")))


def group_rank(plan, **degrees) -> tuple[int, np.ndarray]:
    """(The rank of the degree group holding ``degrees`` among the fitting layouts, 0 if none fits; the
    candidate rows with those degrees, fitting or not)."""
    r, ranked = plan.res, plan.ranked
    mine = np.ones(len(r["tp"]), dtype=bool)
    for k, v in degrees.items():
        mine &= np.asarray(r[k]) == v
    hit = np.flatnonzero(mine[ranked])
    return (int(group_ranks(r, ranked)[hit[0]]) if len(hit) else 0), np.flatnonzero(mine)


def test_nemo_gpt3_175b_on_128_h100_is_the_plans_first_group():
    """dgxc NeMo GPT-3 175B, 128 H100: tp 4, pp 8 (vp 12), dp 4, distributed optimizer, global batch 256."""
    row = next(x for x in rows("dgxc_nemo_h100_bf16.csv") if x["model"] == "gpt3_175b" and x["gpus"] == "128")
    gpus, tp, pp = int(row["gpus"]), int(row["tp"]), int(row["pp"])
    plan = plan_of("model=175b", "hardware=h100_80gb_node", f"hardware.nodes={gpus // 8}", "framework=megatron_core",
                   f"plan.global_batch_size={row['global_batch']}")
    rank, _ = group_rank(plan, tp=tp, pp=pp, dp=gpus // (tp * pp), cp=1, zero=1)
    assert 1 <= rank <= 10, rank


def test_torchtitan_llama31_8b_fsdp_on_128_h100_is_in_the_top_10_groups():
    """torchtitan Llama 3.1 8B, 128 H100 (96 GB, 2.4 TB/s), FSDP (ZeRO-3, dp 128), local batch 2, 8k tokens."""
    row = next(x for x in rows("torchtitan_h100_2024.csv") if x["gpus"] == "128")
    gpus = int(row["gpus"])
    plan = plan_of("model=7b", "model.n_kv_heads=8", "model.ffn_hidden=14336", "model.vocab_size=128256",
                   "train.seq_len=8192", "hardware=h100_80gb_node", f"hardware.nodes={gpus // 8}",
                   "hardware.device_memory_gb=96", "hardware.hbm_tb_per_s=2.4", "framework=torchtitan",
                   f"plan.global_batch_size={gpus * int(row['local_batch'])}")
    rank, _ = group_rank(plan, tp=1, pp=1, dp=gpus, cp=1, zero=3)
    assert 1 <= rank <= 10, rank


def test_llama3_405b_on_8192_h100_is_in_the_space_and_says_why_it_ranks_lower():
    """Llama 3 405B, 8192 H100, 8k tokens: tp 8, pp 16, dp 64, global batch 2048. In the space and fitting, but
    not in the top 10 groups: by xpar's memory its layouts fit the device less the plan's 8 % headroom only
    with full recompute (the rows without it are dropped for memory), which costs a third of the step; cp 2
    halves the activations and wins. With plan.memory_headroom=0 its selective-recompute 1F1B layout fits
    (79.3 of 85 GB): the headroom, and the memory model's count for this run, decide it."""
    row = next(x for x in rows("llama3_2024_table4.csv") if x["gpus"] == "8192")
    gpus, tp, pp, dp = (int(row[k]) for k in ("gpus", "tp", "pp", "dp"))
    plan = plan_of("model=405b", "hardware=h100_80gb_node", f"hardware.nodes={gpus // 8}", "framework=megatron_core",
                   f"train.seq_len={row['seq']}", f"plan.global_batch_size={dp * int(row['batch_per_dp'])}")
    rank, rows_of_group = group_rank(plan, tp=tp, pp=pp, dp=dp, cp=1, zero=1)
    r = plan.res
    fits = rows_of_group[r["fits"][rows_of_group]]
    assert rank > 10 and len(fits)
    assert set(r["recompute"][fits].tolist()) == {"full"}
    assert not r["fits"][rows_of_group[r["recompute"][rows_of_group] == "none"]].any()
    assert r["cp"][plan.best] == 2
