"""Model presets of the models teams trained in 2023-26 (conf/model/*.yaml): each loads onto the model schema and
validates; xpar's parameter count (xpar.models.shapes.param_count, what the estimate's memory and FLOPs read) is the
published one; where tests/data or benchmarks/refusal_hunt.md typed the same model by hand, the preset has its
shape; and a few estimate in-process on a cluster preset."""
from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests.conftest import compose
from xpar.calibrate.published import make_spec, preset, read_table
from xpar.config.presets import conf_dir, preset_dict
from xpar.config.schema import ModelConfig
from xpar.config.validate import validate
from xpar.estimate.cost import estimate
from xpar.models.shapes import param_count

ROOT = Path(__file__).resolve().parents[2]

PRESETS = ("llama3_8b", "llama3_70b", "qwen3_30b_a3b", "qwen3_235b_a22b", "gpt_oss_120b", "gpt_oss_20b", "deepseek_v2",
           "deepseek_v2_lite", "nemotron4_15b", "nemotron4_340b", "grok1", "mixtral_8x22b", "mistral_7b", "falcon_7b",
           "falcon_40b", "falcon_180b", "gemma2_9b", "gemma2_27b", "gemma3_27b", "qwen2_5_7b", "qwen2_5_72b",
           "llama4_scout", "llama4_maverick")
"""The presets of this module (the older ones: tests/config/test_config.py, tests/parallel/test_moe.py)."""


def model(name: str) -> ModelConfig:
    return ModelConfig(**preset("model", name))


@pytest.fixture(scope="module")
def base():
    """One composed estimate-mode config (H100 cluster preset, bf16) whose model group each preset replaces."""
    return compose("tracking=off", "run.progress=false", "run.mode=estimate", "hardware=h100_80gb_64gpu",
                   "train=cluster")


@pytest.mark.parametrize("name", PRESETS)
def test_preset_loads_onto_the_schema_and_validates(base, name):
    """The YAML merged onto the model schema as Hydra merges a group choice (struct mode: an unknown key or a wrong
    type is refused), then validated into a RunSpec (Hydra's own compose of every preset: the slow
    tests/config/test_config.py::test_every_preset_composes)."""
    cfg = base.copy()
    own = OmegaConf.load(conf_dir() / "model" / f"{name}.yaml")
    cfg.model = OmegaConf.merge(OmegaConf.structured(ModelConfig), own)
    if cfg.model.attention_sinks:  # gpt-oss: a profile with a sink path (framework=xpar refuses the model in a line)
        cfg.framework.sink_attention = "fused"
    spec = validate(cfg)
    assert spec.model.name == name and spec.model.n_layers > 0


G = 1e9

TOTALS = {
    "llama3_8b": (8.03 * G, 0.005),  # Hugging Face Hub, meta-llama/Llama-3.1-8B: 8.03B (safetensors)
    "llama3_70b": (70.6 * G, 0.005),  # Hugging Face Hub, meta-llama/Llama-3.1-70B: 70.6B
    "qwen3_30b_a3b": (30.5 * G, 0.005),  # Qwen/Qwen3-30B-A3B model card: "30.5B in total"
    "qwen3_235b_a22b": (235 * G, 0.005),  # Qwen/Qwen3-235B-A22B model card: "235B in total"
    "gpt_oss_120b": (116.83 * G, 0.001),  # gpt-oss model card (arXiv 2508.10925) Table 1: total 116.83B
    "gpt_oss_20b": (20.91 * G, 0.001),  # ibid.: total 20.91B
    "nemotron4_15b": ((3.2 + 12.5) * G, 0.01),  # Nemotron-4 15B report Sec. 2: 3.2B embedding + 12.5B non-embedding
    "nemotron4_340b": ((9.4 + 331.6) * G, 0.001),  # Nemotron-4 340B report Sec. 2.2: 9.4B + 331.6B
    "grok1": (314 * G, 0.01),  # xai-org/grok-1 README: "Parameters: 314B"
    "mixtral_8x22b": (141 * G, 0.005),  # Mistral AI release note "Cheaper, Better, Faster, Stronger" (April 2024): 141B
    "mistral_7b": (7.3 * G, 0.01),  # "Announcing Mistral 7B" (September 2023): "7.3B parameter model"
    "gemma2_9b": (917_962_752 + 8_324_201_984, 0.001),  # Gemma 2 report (arXiv 2408.00118) Table 2
    "gemma2_27b": (1_180_237_824 + 26_047_480_320, 0.001),  # ibid.
    "gemma3_27b": ((1416 + 25600) * 1e6, 0.005),  # Gemma 3 report (arXiv 2503.19786) Table 1, vision encoder aside
    "qwen2_5_7b": (7.61 * G, 0.002),  # Qwen/Qwen2.5-7B model card: "Number of Parameters: 7.61B"
    "qwen2_5_72b": (72.7 * G, 0.002),  # Qwen/Qwen2.5-72B model card: 72.7B
    "llama4_maverick": (400 * G, 0.005),  # Llama 4 model card: "400B" total (experts in every other block)
    "llama4_scout": (109 * G, 0.015),  # ibid.: "109B" total, the vision encoder in it (the text model: 107.8B)
}
"""Published total parameters and the relative tolerance (the published figure's rounding, at most 1 %)."""

NON_EMBEDDING = {
    "nemotron4_15b": 12.5 * G, "nemotron4_340b": 331.6 * G, "gemma2_9b": 8_324_201_984, "gemma2_27b": 26_047_480_320,
    "gemma3_27b": 25_600e6, "qwen2_5_7b": 6.53 * G, "qwen2_5_72b": 70.0 * G,
}
"""Published non-embedding parameters (sources as :data:`TOTALS`'), where the source splits them out."""


@pytest.mark.parametrize("name", sorted(TOTALS))
def test_parameter_count_is_the_published_one(name):
    count, (published, rel) = param_count(model(name)), TOTALS[name]
    assert count.total == pytest.approx(published, rel=rel)
    if name in NON_EMBEDDING:
        assert count.total - count.embedding - count.output == pytest.approx(NON_EMBEDDING[name], rel=0.005)


@pytest.mark.parametrize("name, active, rel, input_embedding", [
    ("qwen3_30b_a3b", 3.3 * G, 0.02, True),  # model card: "3.3B activated" (1 decimal: 3.35 rounds to it)
    ("qwen3_235b_a22b", 22 * G, 0.01, True),  # model card: "22B activated"
    ("mixtral_8x22b", 39 * G, 0.01, True),  # release note: "39B active parameters"
    ("gpt_oss_120b", 5.13 * G, 0.002, False),  # card Table 1: 5.13B; "Unembedding ... counted towards active, but
    ("gpt_oss_20b", 3.61 * G, 0.002, False),  # not embeddings" (the lookup has no FLOPs)
    ("llama4_maverick", 17 * G, 0.015, True),  # Llama 4 model card: "17B active parameters"
    ("llama4_scout", 17 * G, 0.015, True),  # ibid.
])
def test_active_parameters_are_the_published_ones(name, active, rel, input_embedding):
    count = param_count(model(name))
    got = count.active if input_embedding else count.active - count.embedding_tokens
    assert got == pytest.approx(active, rel=rel)


def mla_minus_mha(m: ModelConfig) -> int:
    """Parameters of one block's multi-head latent attention (DeepSeek-V2, arXiv 2405.04434, Sec. 2.1: W^DQ, the
    query latent's norm and W^UQ/W^QR, or W^Q without q_lora_rank; W^DKV with W^KR, the kv latent's norm, W^UK/W^UV;
    W^O) less the multi-head attention at h that xpar counts in its place (4 h^2)."""
    h, a, rope, nope, v, r = (m.hidden, m.n_heads, m.qk_rope_head_dim, m.qk_nope_head_dim, m.v_head_dim,
                              m.kv_lora_rank)
    q_head = a * (nope + rope)
    q = h * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * q_head if m.q_lora_rank else h * q_head
    kv = h * (r + rope) + r + r * a * (nope + v)
    return q + kv + a * v * h - 4 * h * h


@pytest.mark.parametrize("name, total, active", [
    ("deepseek_v2", 236 * G, 21 * G),  # arXiv 2405.04434 Sec. 3.1.2: "236B total parameters, ... 21B are activated"
    ("deepseek_v2_lite", 15.7 * G, 2.4 * G),  # ibid. App. B: "15.7B parameters in total, ... 2.4B are activated"
])
def test_deepseek_v2_counts_are_the_published_ones_with_mla_as_mla(name, total, active):
    """xpar counts MLA's parameters as multi-head attention at h (conf/model/deepseek_v2.yaml): with the difference
    added back, the published totals within 0.5 %; active (the input embedding aside, as the gpt-oss card counts it)
    within 1 % for V2 and 2.5 % for V2-Lite (2.45B against "2.4B": the published figure is truncated)."""
    m = model(name)
    count, fix = param_count(m), m.n_layers * mla_minus_mha(m)
    assert count.total + fix == pytest.approx(total, rel=0.005)
    rel = 0.01 if name == "deepseek_v2" else 0.025
    assert count.active + fix - count.embedding_tokens == pytest.approx(active, rel=rel)
    assert (fix < 0) == (name == "deepseek_v2_lite")  # MLA outweighs 4 h^2 at V2's 128 heads, not at Lite's 16


def test_grok1_routes_a_quarter_of_its_expert_weights():
    """xAI's "Open Release of Grok-1" (March 2024): "25% of the weights active on a given token" (2 of 8 experts;
    with the attention and the embedding, all active, xpar's count gives 26.5 %)."""
    count = param_count(model("grok1"))
    assert 0.25 <= count.active / count.total <= 0.27


@pytest.mark.parametrize("name, hub_billions", [("falcon_7b", 7), ("falcon_40b", 42), ("falcon_180b", 180)])
def test_falcon_counts_round_to_the_hub_counts(name, hub_billions):
    """The Falcon papers and cards name the models (7B, 40B, 180B); the Hugging Face Hub counts the released
    safetensors, which store lm_head beside the embedding it is tied to (transformers FalconForCausalLM): xpar's
    count plus that copy rounds to the Hub's figure (7B, 42B, 180B), the tied count alone would not for 40B (41)."""
    count = param_count(model(name))
    assert round((count.total + count.embedding_tokens) / G) == hub_billions
    assert count.total == pytest.approx(hub_billions * G, rel=0.02)


HUNT_PRESETS = {"deepseek_v2": "deepseek_v2", "gpt_oss_120b": "gpt_oss_120b", "grok1": "grok1",
                "qwen3_30b_a3b": "qwen3_30b_a3b", "nemotron4_340b": "nemotron4_340b", "falcon7b": "falcon_7b",
                "falcon40b": "falcon_40b", "falcon180b": "falcon_180b", "llama3_8b": "llama3_8b"}
"""benchmarks/refusal_hunt.md's ``model.name`` of a run typed by hand -> the preset of that model."""

RECIPE_FIELDS = {"grok1": {"vocab_size": 128256, "capacity_factor": 1.0}}
"""Fields a hand-typed run sets from its training recipe, not the model's release: NeMo's Grok-1 recipe (row 30,
tests/data/cp_fp8_h100.csv) trains with a 128,256-token vocabulary and pads experts to capacity 1.0, the release
has 131,072 tokens (xai-org/grok-1 README) and no capacity (conf/model/grok1.yaml)."""


def hunt_models() -> list[tuple[int, str, dict]]:
    """(row, preset, {field: typed value}) of each benchmarks/refusal_hunt.md run whose ``model.name`` has a preset
    (a row that also says ``model=<preset>``: the fields it typed over that preset)."""
    out = []
    for line in (ROOT / "benchmarks" / "refusal_hunt.md").read_text().splitlines():
        m = re.match(r"\| (\d+) \|.*?`python -m xpar ([^`]*)`", line)
        typed = dict(re.findall(r"\bmodel\.(\w+)=(\S+)", m.group(2))) if m else {}
        if typed.get("name") in HUNT_PRESETS:
            out.append((int(m.group(1)), HUNT_PRESETS[typed.pop("name")], typed))
    return out


def test_the_presets_have_the_shapes_the_refusal_hunt_typed():
    rows = hunt_models()
    assert {p for _, p, _ in rows} == set(HUNT_PRESETS.values())  # every model the hunt typed is found
    for row, name, typed in rows:
        own = OmegaConf.structured(model(name))
        for key, text in typed.items():
            want = RECIPE_FIELDS.get(name, {}).get(key, own[key])
            got = OmegaConf.merge(own, OmegaConf.from_dotlist([f"{key}={text}"]))[key]
            assert got == want, f"refusal_hunt.md row {row}: model.{key}={text}, model={name} has {own[key]}"


CSV_PRESETS = {"Llama 3.1 8B": "llama3_8b", "Llama 3 8B": "llama3_8b", "Llama 3 8B (LLAMA3-8B)": "llama3_8b",
               "Llama 3.1 70B": "llama3_70b", "Llama 3 70B": "llama3_70b", "Llama 3 70B (LLAMA3-70B)": "llama3_70b",
               "Qwen3-30B-A3B": "qwen3_30b_a3b", "Qwen3-235B-A22B": "qwen3_235b_a22b", "gpt-oss-120b": "gpt_oss_120b",
               "Grok-1 314B (NeMo recipe)": "grok1", "Mixtral-8x22B": "mixtral_8x22b"}
"""tests/data rows' ``model_name`` -> the preset of that model."""

CSV_FIELDS = {"layers": "n_layers", "hidden": "hidden", "heads": "n_heads", "kv_heads": "n_kv_heads",
              "ffn": "ffn_hidden", "vocab": "vocab_size", "experts": "n_experts", "top_k": "moe_top_k",
              "shared_experts": "n_shared_experts", "expert_ffn": "expert_ffn_hidden",
              "sliding_window": "sliding_window", "sliding_window_pattern": "sliding_window_pattern"}
"""Columns of the published-run files (cp_fp8_h100.csv's and the files that share its columns) -> model fields."""

SOURCE_VOCABULARY = {128000}
"""Vocabularies a source states for the model without its special tokens (the Llama 3 paper's Table 3 "128,000",
typed by its and torchtitan's rows): the released embedding has 128,256 rows."""


def csv_models():
    for fname in ("cp_fp8_h100.csv", "blackwell_published.csv", "moe_layouts_h100.csv"):
        for r in read_table(ROOT / "tests" / "data" / fname):
            if r["model_name"] in CSV_PRESETS and "proxy" not in r["id"]:  # dgxc's proxies: Grok-1 cut to 8/32 layers
                yield fname, r, CSV_PRESETS[r["model_name"]]


def test_the_presets_have_the_shapes_of_the_published_runs_in_tests_data():
    seen = set()
    for fname, r, name in csv_models():
        m, seen = model(name), seen | {name}
        first = int(r["moe_layers"].split("first ")[1].split()[0]) if "first" in (r["moe_layers"] or "") else 0
        assert m.first_dense_layers == first, (fname, r["id"])
        for col, key in CSV_FIELDS.items():
            text = r.get(col) or ""
            if not text or (key == "vocab_size" and int(text) in SOURCE_VOCABULARY):
                continue
            want = RECIPE_FIELDS.get(name, {}).get(key, getattr(m, key))
            assert int(text) == want, f"{fname} {r['id']}: {col}={text}, model={name} has {getattr(m, key)}"
    assert seen == set(CSV_PRESETS.values())


@pytest.mark.parametrize("name", ["nemotron4_15b", "nemotron4_340b"])
def test_the_nemotron_presets_have_the_shapes_of_the_dgxc_recipes(name):
    row = next(r for r in read_table(ROOT / "tests" / "data" / "dgxc_nemo_h100_bf16.csv") if r["model"] == name)
    m = model(name)
    got = (m.n_layers, m.hidden, m.n_heads, m.n_kv_heads, m.ffn_hidden, m.vocab_size, m.seq_len)
    assert got == tuple(int(row[k]) for k in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq"))


def test_gpt_oss_120b_estimates_as_the_refusal_hunts_typed_run():
    """Row 26 (Megatron-Bridge's gpt-oss-120b recipe, pp 4 ep 8 on 64 H100s) with model=gpt_oss_120b in place of its
    18 typed model fields: the same step, term by term."""
    layout = ("framework=megatron_core", "hardware=h100_80gb_64gpu", "hardware.nodes=8", "parallel.tp=1",
              "parallel.pp=4", "parallel.ep=8", "parallel.dp=16", "parallel.zero_stage=1", "train.dtype=bf16",
              "train.micro_batch_size=1", "train.global_batch_size=1280", "parallel.micro_batches=auto")
    typed = next(t for row, _, t in hunt_models() if row == 26)
    by_hand = validate(compose("tracking=off", "run.mode=estimate", "run.progress=false", *layout,
                               *(f"model.{k}={v}" for k, v in typed.items()), "model.name=gpt_oss_120b"))
    from_preset = validate(compose("tracking=off", "run.mode=estimate", "run.progress=false", *layout,
                                   "model=gpt_oss_120b"))
    a, b = estimate(by_hand), estimate(from_preset)
    assert a.time_breakdown == b.time_breakdown and a.time_per_step_s == b.time_per_step_s


@pytest.mark.parametrize("name, parallel", [
    ("qwen3_30b_a3b", dict(dp=8, ep=8, pp=2, virtual_stages=24, schedule="interleaved_1f1b", zero_stage=1,
                           recompute="full")),
    ("deepseek_v2_lite", dict(dp=16, ep=8, zero_stage=1)),
    ("falcon_40b", dict(dp=1, tp=8, pp=2, zero_stage=1, sequence_parallel=True, recompute="selective")),
    ("gemma3_27b", dict(dp=2, tp=8, zero_stage=1, sequence_parallel=True, recompute="full")),
])
def test_presets_estimate_on_a_cluster_preset(name, parallel):
    """In-process estimates on 16 H100s (hardware=h100_80gb_16gpu), 64 sequences of 4096 a step: a finite step, MFU
    in (0, 1), model FLOPs of at least 6 x the active parameters per token, and a peak inside the device."""
    spec = make_spec(preset("model", name), dict(name="smoke", micro_batches="auto", **parallel),
                     preset_dict("hardware", "h100_80gb_16gpu"),
                     dict(dtype="bf16", micro_batch_size=1, global_batch_size=64, seq_len=4096))
    est = estimate(spec)
    assert math.isfinite(est.time_per_step_s) and est.time_per_step_s > 0
    assert 0 < est.mfu < 1
    assert est.model_flops_per_step >= 6 * param_count(spec.model).active * 64 * 4096 * 0.9
    assert est.memory.total < est.memory.device_memory
