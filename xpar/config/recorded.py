"""The config as a run records it: every group replaced by the RunSpec's resolved copy."""
from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from xpar.config.cluster import placement
from xpar.config.schema import GROUPS
from xpar.config.spec import RunSpec


def resolved_config(cfg: DictConfig, spec: RunSpec) -> dict:
    """The config as it runs: every group replaced by the spec's resolved copy (dp, global
    batch, micro-batches, virtual stages and layer split as numbers, the ZeRO stage that
    runs, the detected hardware with the device peak behind MFU). Logged as params and
    saved as config.yaml, so no 'auto' reaches a record."""
    from dataclasses import asdict

    config = OmegaConf.to_container(cfg, resolve=True)
    for group in GROUPS:
        config[group] = asdict(spec.parallel_config() if group == "parallel" else getattr(spec, group))
    config["run"]["mode"] = spec.mode  # 'auto' resolved: execute or estimate
    config["train"].pop("resume", None)  # where a run resumed from is a tag (xpar.run.checkpoint.tracking_link)
    if spec.mode == "execute" and spec.launcher != "local":  # torchrun/submitit: nodes as launched
        where = placement(spec)
        config["hardware"].update(nodes=where["nodes"], devices_per_node=where["devices_per_node"])
    return config
