"""What a held-out hunt row's source ran that the row's typed command leaves out (issue 44): the settings of the
benchmark recipe behind a published figure, applied by ``--recipe`` in benchmarks/plan_heldout.py and
benchmarks/hunt_score.py, so that a check compares xpar with the run as it ran, not as it was typed.

The rows' commands (benchmarks/refusal_hunt*.md) stay as typed: they are the record of what a user types. Each
entry of :data:`RECIPES` names the hunt file, the row, the overrides and the source line that sets them.

- Round-robin routing (``model.moe_routing=round_robin``, xpar.estimate.expert_parallel.round_robin_reach): NeMo
  AutoModel's benchmark recipes set ``fake_balanced_gate: true`` (examples/benchmark/configs/*_te_deepep.yaml
  @037e04a6, e.g. deepseek_v3_te_deepep.yaml ``model.backend``; docs/performance-summary.md @01926a5c, Notes: "Fake
  balanced gate is enabled to simulate ideal expert routing"), and torchtitan's DeepEP recipe sets
  ``debug_moe_force_load_balance=true`` (torchtitan/models/qwen3/train_configs/qwen3_10b_a1b_with_deepep.toml
  @022f885f), whose router takes ``arange(N k) % E`` (torchtitan/models/moe/moe.py
  ``TokenChoiceTopKRouter._debug_force_load_balance_routing``, "Balanced round-robin expert assignment"): token t
  gets the k consecutive experts (t k + j) mod E, on 1-2 ranks and nodes, where learned routing spreads them. Not
  for Megatron-Core's ``--moe-router-force-load-balancing``: it draws random logits
  (megatron/core/transformer/moe/moe_utils.py ``RandomSTE``), so its experts spread as learned routing's do.
- Megatron-Core's 1F1B all-to-all overlap and module recompute of Megatron-Bridge's DeepSeek-V3 H100 recipe
  (refusal_hunt.md row 31, the 25.09 row of tests/data/cp_fp8_h100.csv): :data:`MBRIDGE_DSV3_H100`.
- Full recompute without early stop (``framework.checkpoint_early_stop=false``): torchtitan's DeepEP recipe sets
  ``[activation_checkpoint] mode = "full"`` and leaves ``early_stop`` at its default, False (torchtitan
  torchtitan/config/job_config.py @022f885f ``ActivationCheckpoint.early_stop``, passed to ``ptd_checkpoint_wrapper`` in
  torchtitan/distributed/activation_checkpoint.py ``_apply_full_ac``; pytorch/torchtitan PR 1580, 2025-08: "toggle
  early-stop with a default of False"), so each block's recomputed forward runs to its end, w2 included, where the
  torchtitan profile's ``checkpoint_early_stop: true`` is torch's own default that torchtitan ran before that PR.
- The DeepEP branch's kept recompute graphs (``framework.moe_recompute_graph_kept=true``,
  xpar.estimate.memory.activations.moe_kept_graph_bytes): the rows published on torchtitan's DeepEP README ran the
  branch that README belongs to (022f885f, 2a642d02: neither is an ancestor of torchtitan's main), whose
  ``PrimusTurboDeepepManager.setup_metadata`` stores ``self.token_probs`` / ``self.token_indices`` on each MoE layer's
  manager and nothing clears them (torchtitan/distributed/deepep/utils.py at both commits: ``combine`` clears the
  dispatch fields only), so each fully recomputed MoE block keeps its recomputed attention and router graph from its
  backward to its next forward. The profile's default (false) is torchtitan's own DeepEP path, which does not.
- llm.c's runs (``framework=llmc``, conf/framework/llmc.yaml), typed as megatron_core with its fused loss before the
  profile existed; the 124M run's commit reduced the gradients after the backward (``framework.dp_overlap=false``).
- TinyLlama's fused kernels (``framework.elementwise_passes=1.0``): its row is typed with llm-foundry's profile (torch
  FSDP1, the nearest), whose MPT runs move q, k and v around the flash kernel (2 passes); TinyLlama's lit-gpt fork runs
  every norm, SwiGLU and rotary embedding as one kernel.
"""
from __future__ import annotations

import sys
from pathlib import Path

ROUND_ROBIN = ("model.moe_routing=round_robin",)
AUTOMODEL = "NeMo AutoModel examples/benchmark/configs/{}_te_deepep.yaml @037e04a6: fake_balanced_gate: true"
TORCHTITAN = ("torchtitan qwen3_10b_a1b_with_deepep.toml @022f885f: debug_moe_force_load_balance=true; full AC with "
              "ActivationCheckpoint.early_stop at its default, False (torchtitan/config/job_config.py); the deepep "
              "branch's PrimusTurboDeepepManager keeps token_probs (torchtitan/distributed/deepep/utils.py @022f885f)")
TORCHTITAN_DEEPEP = (*ROUND_ROBIN, "framework.checkpoint_early_stop=false", "framework.moe_recompute_graph_kept=true")
LLMC = ("framework=llmc",)
LLMC_SOURCE = "karpathy/llm.c train_gpt2.cu (C/CUDA, cuDNN attention, fused classifier): conf/framework/llmc.yaml"
LLMC_A0D5 = ("framework=llmc", "framework.dp_overlap=false")
LLMC_A0D5_SOURCE = ("llm.c @a0d5dbbd (run_gpt2_124M.sh's commit): gpt2_multi_gpu_accumulate reduce-scatters the "
                    "gradients after the backward on the compute stream")
TINYLLAMA = ("framework.elementwise_passes=1.0",)
TINYLLAMA_SOURCE = ("jzhang38/TinyLlama @bf122247 README ('fused layernorm, fused swiglu, fused cross entropy loss, "
                    "fused rotary positional embedding'), lit_gpt/model.py: FusedRMSNorm, xformers SwiGLU, "
                    "apply_rotary_emb_func")
MBRIDGE_DSV3_H100 = ("Megatron-Bridge DEEPSEEK_V3_H100_BASE_CONFIG (scripts/performance/configs/deepseek/"
                     "workload_base_configs.py, read in the okoge-kaz/Megatron-Bridge fork @7febf98c): moe_a2a_overlap=True "
                     "(framework.ep_a2a_overlap at xpar.calibrate.cp_fp8.MOE_A2A_OVERLAP, as tests/data/cp_fp8_h100.csv "
                     "prices Megatron-Bridge's overlapped rows; v0.1.0rc4 run_script.py sets it for h100), "
                     "recompute_modules [mla_up_proj, mlp] (mlp reruns the three dense blocks' MLPs only: not typed)")

RECIPES: dict[tuple[str, int], tuple[tuple[str, ...], str]] = {
    ("refusal_hunt2.md", 9): (ROUND_ROBIN, AUTOMODEL.format("deepseek_v3")),
    ("refusal_hunt2.md", 10): (ROUND_ROBIN, AUTOMODEL.format("qwen3_moe_30b")),
    ("refusal_hunt2.md", 11): (ROUND_ROBIN, AUTOMODEL.format("gptoss_120b")),
    ("refusal_hunt2.md", 12): (ROUND_ROBIN, AUTOMODEL.format("gptoss_20b")),
    ("refusal_hunt2.md", 18): (ROUND_ROBIN, AUTOMODEL.format("deepseek_v3")),
    ("refusal_hunt2.md", 19): (ROUND_ROBIN, AUTOMODEL.format("kimi_k2")),
    **{("refusal_hunt3.md", row): (TORCHTITAN_DEEPEP, TORCHTITAN) for row in (22, 23, 24, 25)},
    **{("refusal_hunt4.md", row): (TORCHTITAN_DEEPEP, TORCHTITAN) for row in (10, 11)},  # the same recipe on 16, 32 B200
    ("refusal_hunt4.md", 20): (LLMC_A0D5, LLMC_A0D5_SOURCE),
    **{("refusal_hunt4.md", row): (LLMC, LLMC_SOURCE) for row in (21, 22, 23, 24)},
    ("refusal_hunt4.md", 25): (TINYLLAMA, TINYLLAMA_SOURCE),
    ("refusal_hunt.md", 31): (("framework.ep_a2a_overlap=0.3", "parallel.recompute=mla_up_proj"), MBRIDGE_DSV3_H100),
}
"""(hunt file name, row) -> (overrides the recipe sets, its source)."""


def recipe_overrides(hunt: Path, row: int) -> tuple[str, ...]:
    """The overrides :data:`RECIPES` holds for ``row`` of the hunt file ``hunt`` (by its name); () for none."""
    return RECIPES.get((Path(hunt).name, int(row)), ((), ""))[0]


def checked_sets(values: list[str] | None, prog: str) -> tuple[str, ...]:
    """``--set`` values as overrides: each KEY=VALUE with a dotted key (``model.moe_routing=round_robin``).

    Raises:
        SystemExit: code 2, one line on stderr, for a value without '=' or a key without a group."""
    out = []
    for v in values or []:
        key, eq, _ = v.partition("=")
        if not eq or "." not in key or not key.replace(".", "").replace("_", "").isalnum():
            print(f"{prog}: --set {v!r} is not KEY=VALUE with a dotted key; e.g. --set model.moe_routing=round_robin",
                  file=sys.stderr)
            raise SystemExit(2)
        out.append(v)
    return tuple(out)


def with_overrides(command: str, overrides: tuple[str, ...]) -> str:
    """``command`` with ``overrides`` appended (Hydra: a later key=value wins)."""
    return " ".join((command, *overrides)) if overrides else command
