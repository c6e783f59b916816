"""Each published FP8 row of tests/data/cp_fp8_h100.csv is priced at the scaling recipe its source used (its
``fp8_recipe`` column; issue 42): cp_fp8_case passes it to train.fp8_recipe, and the row's kernel terms differ from
the default recipe's by that recipe's quantise passes only (xpar.estimate.compute.fp8_recipes)."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from xpar.calibrate.cp_fp8 import NEW_GPU_PRESETS, cp_fp8_case, row_fp8_recipe
from xpar.calibrate.published import read_table
from xpar.estimate.compute.fp8_recipes import DEFAULT, RECIPES, quantiser
from xpar.estimate.compute.kernel_block import priced_cast_bytes
from xpar.estimate.compute.kernel_costs import kernel_layer_costs
from xpar.estimate.cost import estimate

DATA = Path(__file__).resolve().parents[1] / "data"
ROWS = {r["id"]: r for r in read_table(DATA / "cp_fp8_h100.csv")}


def _case(row_id: str, gpu_presets: dict = None):
    """cp_fp8_case of a row (torchtitan's carry the global batch their source implies: tests/estimate/test_torchtitan_h100_rows.py)."""
    return cp_fp8_case(ROWS[row_id], gpu_presets)


def test_every_fp8_row_names_a_known_recipe_and_no_bf16_row_names_one():
    """32 FP8 rows, each with a recipe train.fp8_recipe knows; the bf16 rows' column is empty."""
    fp8 = [r for r in ROWS.values() if r["dtype"] == "fp8"]
    assert len(fp8) == 32 and all(r["fp8_recipe"] in RECIPES for r in fp8)
    assert all(r["fp8_recipe"] == "" for r in ROWS.values() if r["dtype"] != "fp8")


@pytest.mark.parametrize("row_id, recipe", [
    ("torchtitan_llama31_8b_fp8_8_cp1", "current"),  # torchao float8, dynamic per-tensor (tensorwise)
    ("torchtitan_llama31_405b_fp8_512_cp2", "current"),
    ("mbridge_2511_h100_llama31_405b_1024", "current"),  # Megatron-Bridge FP8-CS
    ("mbridge_2606_h100_llama31_405b_1024", "current"),  # 'FP8' on H100: the FP8_CS config
    ("dsv3_paper_pretrain_2048_h800", "blockwise"),  # DeepSeek-V3 report Sec. 3.3
    ("dgxc_llama31_70b_fp8_64", "delayed"),  # NeMo 24.09 on Megatron-Core's TEDelayedScaling
    ("mlm_llama3_405b_fp8_1024", "delayed"),
    ("nemo2407_llama3_8b_fp8_8", "delayed"),
    ("dgxc_llama31_70b_bf16_64", DEFAULT),  # bf16: the field keeps its default, unused
])
def test_the_rows_recipe_reaches_the_spec(row_id, recipe):
    assert _case(row_id)[0].train.fp8_recipe == recipe


def test_a_blackwell_mxfp8_row_reaches_the_spec_on_its_preset():
    """The GB200 DeepSeek-V3 FP8-MX row: mxfp8 on the GB200 preset (not priced by default: cp_fp8_case returns None)."""
    assert _case("mbridge_2511_gb200_dsv3_mxfp8_256") is None
    assert _case("mbridge_2511_gb200_dsv3_mxfp8_256", NEW_GPU_PRESETS)[0].train.fp8_recipe == "mxfp8"


@pytest.mark.parametrize("row_id", ["torchtitan_llama31_8b_fp8_8_cp1", "mbridge_2511_h100_llama31_405b_1024",
                                    "mbridge_2511_h100_qwen3_30b_16", "dsv3_paper_pretrain_2048_h800"])
def test_the_rows_pricing_differs_from_the_default_by_the_recipes_passes(row_id):
    """Against the same row at the default (delayed: 3 bytes an element quantised), the row's element-wise seconds
    grow by (cast bytes - 3) / 3 of the default's quantisation traffic (the FP8 rows' minus the bf16 row's), forward
    and backward (current: 5 bytes, its amax read; blockwise: 4 1/16, two copies with FP32 scales per 128; under
    Transformer Engine's kernels, framework.fp8_cast_kernels te, at CAST_HBM_FRACTION of HBM, else the block's); its
    GEMMs are the same (Hopper: tensor-scaled and blockwise both at the FP8 rate), and its step is longer."""
    spec, assume, _, _ = _case(row_id)
    recipe = spec.train.fp8_recipe
    at = {name: replace(spec, train=replace(spec.train, dtype=dtype, fp8_recipe=r))
          for name, dtype, r in (("bf16", "bf16", DEFAULT), ("default", "fp8", DEFAULT), ("row", "fp8", recipe))}
    k = {name: kernel_layer_costs(s, assume) for name, s in at.items()}
    cast = quantiser(recipe, assume.fp8_cast_kernels)  # TE's kernels at CAST_HBM_FRACTION (megatron_core)
    extra = (priced_cast_bytes(cast) - priced_cast_bytes(RECIPES[DEFAULT])) / priced_cast_bytes(RECIPES[DEFAULT])
    assert extra > 0
    for term in ("mem_f", "mem_b"):
        quant = k["default"][term] - k["bf16"][term]
        assert quant > 0 and k["row"][term] - k["default"][term] == pytest.approx(extra * quant, rel=1e-9), term
    for term in ("mm_f", "mm_b"):
        assert k["row"][term] == pytest.approx(k["default"][term], rel=1e-12), term
    assert estimate(at["row"], assume).time_per_step_s > estimate(at["default"], assume).time_per_step_s


def test_a_row_without_the_column_keeps_the_default_and_an_unknown_recipe_is_refused():
    """Files sharing these columns without fp8_recipe (moe_layouts_h100.csv, blackwell_published.csv) keep the
    default; a misspelt recipe in the column is refused, naming the row and the known recipes."""
    row = dict(ROWS["dgxc_llama31_8b_fp8_8"])
    assert row_fp8_recipe({k: v for k, v in row.items() if k != "fp8_recipe"}) == {}
    assert row_fp8_recipe(dict(row, dtype="bf16", fp8_recipe="current")) == {}
    with pytest.raises(ValueError, match="dgxc_llama31_8b_fp8_8.*'tensorwise'.*blockwise"):
        row_fp8_recipe(dict(row, fp8_recipe="tensorwise"))
