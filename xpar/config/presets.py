"""Where the config tree lives, and preset-name checks before Hydra composes anything."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from omegaconf import DictConfig, OmegaConf

from xpar.config.schema import GROUPS
from xpar.config.torchrun import quiet_exit, torchrun_follower


def conf_dir() -> Path:
    """``conf/`` at the repository top (checkout, editable install) or ``xpar/conf`` (wheel)."""
    here = Path(__file__).resolve().parents[1]  # xpar/
    for candidate in (here / "conf", here.parent / "conf"):
        if (candidate / "config.yaml").is_file():
            return candidate
    raise FileNotFoundError(f"xpar: no config tree found at {here / 'conf'} or {here.parent / 'conf'}")


def presets(group: str) -> list[str]:
    return sorted(p.stem for p in (conf_dir() / group).glob("*.yaml"))


def load_preset(group: str, name: str) -> DictConfig:
    """conf/<group>/<name>.yaml merged over the presets of its group that its ``defaults`` list names, in
    the list's order, the file itself where ``_self_`` stands (last where it is absent: Hydra's rule);
    what ``group=name`` composes, without Hydra (conf/hardware/h100_80gb_64gpu.yaml over h100_80gb_node).

    Raises:
        FileNotFoundError: ``name`` (or a preset it names) is not a preset of ``group``."""
    own = OmegaConf.load(conf_dir() / group / f"{name}.yaml")
    order = list(own.pop("defaults", None) or [])
    parts = [own if entry == "_self_" else load_preset(group, entry) for entry in order]
    return OmegaConf.merge(*parts, *([] if "_self_" in order else [own])) if parts else own


def preset_dict(group: str, name: str) -> dict:
    """conf/<group>/<name>.yaml as a plain dict: a hardware preset over its node preset (:func:`load_preset`, as
    Hydra composes it); other groups' presets as written, without their defaults list (what the planner's and
    the estimate's tests build a spec from)."""
    if group == "hardware":
        return OmegaConf.to_container(load_preset(group, name), resolve=True)
    d = OmegaConf.to_container(OmegaConf.load(conf_dir() / group / f"{name}.yaml"))
    d.pop("defaults", None)
    return d


def check_presets(argv: list[str]) -> None:
    """Exit 2 naming the valid presets if an override ``group=name[,name...]`` names an
    unknown preset of a config group (model, parallel, hardware, train, data, tracking)."""
    bad = []
    for arg in argv:
        if "=" not in arg or arg.startswith("-"):
            continue
        key, value = arg.split("=", 1)
        key = key.lstrip("+~")
        if key not in GROUPS:
            continue
        names = value.strip("[]").split(",") if "(" not in value else []
        known = presets(key)
        for name in names:
            if name and name not in known:
                bad.append(f"  - unknown {key} preset {name!r}; available: {', '.join(known)}.")
    if bad:
        import sys

        if torchrun_follower():  # rank 0 says it once
            quiet_exit(2)
        print("xpar: invalid configuration:\n" + "\n".join(bad), file=sys.stderr)
        raise SystemExit(2)


def kept_kv_heads_notes(n_heads: int, n_kv_heads: Optional[int], preset: Optional[str], overrides: list[str]) -> list[str]:
    """A note where ``model.n_heads`` differs from the model preset's (``preset``: the model group's choice) while
    no override names ``model.n_kv_heads``: the preset's K/V heads stay, and with them a grouping the user may not
    mean (tiny's 2 K/V heads under 48 query heads: grouped-query attention). [] when the preset sets no K/V heads
    (multi-head: they follow n_heads), the heads are the preset's, or the K/V heads were given."""
    given = {o.lstrip("+~").split("=", 1)[0] for o in overrides}
    if preset is None or preset not in presets("model") or "model.n_kv_heads" in given:
        return []
    own = preset_dict("model", preset)
    kept = own.get("n_kv_heads")
    if kept is None or own.get("n_heads") == n_heads or n_kv_heads != kept:
        return []
    return [f"model.n_heads={n_heads} is not model={preset}'s {own.get('n_heads')}, but model.n_kv_heads was not given: "
            f"the preset's n_kv_heads={kept} is kept, so {n_heads // kept} query heads share each K/V head; set "
            f"model.n_kv_heads (e.g. model.n_kv_heads={n_heads} for multi-head attention) if the model has others"]


MOE_FIELDS = ("moe_top_k", "n_shared_experts", "expert_ffn_hidden", "first_dense_layers", "moe_layer_freq", "capacity_factor",
              "moe_imbalance", "moe_routing", "moe_router_groups", "moe_router_group_topk")
"""Model fields read only where the model has experts (model.n_experts > 0)."""


def dense_moe_notes(n_experts: int, overrides: list[str]) -> list[str]:
    """A note where the command line sets mixture-of-experts fields (:data:`MOE_FIELDS`) on a dense model
    (``n_experts`` 0): they change nothing, and the user may have meant a MoE model. [] otherwise."""
    given = [o.lstrip("+~") for o in overrides]
    named = [o for o in given if o.split("=", 1)[0] in {f"model.{k}" for k in MOE_FIELDS}]
    if n_experts or not named:
        return []
    return [f"{', '.join(named)} change{'s' if len(named) == 1 else ''} nothing: model.n_experts=0 (a dense model); "
            f"set model.n_experts=<E> for a mixture of experts (e.g. model=moe_tiny)"]


def fp8_recipe_notes(dtypes: list[str], overrides: list[str]) -> list[str]:
    """A note where the command line sets ``train.fp8_recipe`` but no dtype in ``dtypes`` (the run's
    ``train.dtype``; a plan's searched ``plan.dtype``) is fp8: the recipe scales FP8 matmuls only, so it
    changes nothing, and the user may have meant an FP8 run. [] otherwise."""
    given = [o.lstrip("+~") for o in overrides if o.lstrip("+~").startswith("train.fp8_recipe=")]
    if not given or "fp8" in dtypes:
        return []
    return [f"{given[-1]} changes nothing: it scales FP8 matmuls and train.dtype={dtypes[0]}; "
            f"add train.dtype=fp8 for an FP8 run"]
