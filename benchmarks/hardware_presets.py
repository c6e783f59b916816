"""Every hardware preset, composed three ways, against a snapshot of its values (issue 41, point 4).

The three ways a preset is read: Hydra's composition (``hardware=<name>``), the schema loader
(``xpar.config.checks.hardware.load_hardware_preset``, used by the estimate's suggestions and
``parallel.reference_hardware``), and the published-run loader (``xpar.calibrate.published.preset``).

    python benchmarks/hardware_presets.py            # compare with tests/data/hardware_presets.json
    python benchmarks/hardware_presets.py --write    # write the snapshot (run on the tree before a change)

A field present now and absent from the snapshot is listed as added (new schema fields); a field
whose value changed, or that went missing, is a difference (exit 1).
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

import xpar.config.schema  # noqa: F401  (registers the structured configs)
from xpar.calibrate.published import preset
from xpar.config.checks.hardware import load_hardware_preset
from xpar.config.presets import conf_dir, presets

SNAPSHOT = Path(__file__).resolve().parents[1] / "tests" / "data" / "hardware_presets.json"


def composed(name: str) -> dict:
    """{'hydra': ..., 'schema': ..., 'published': ...}: preset ``name`` read the three ways."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        cfg = compose(config_name="config", overrides=[f"hardware={name}"])
    return {"hydra": OmegaConf.to_container(cfg.hardware), "schema": asdict(load_hardware_preset(name)),
            "published": preset("hardware", name)}


def snapshot(names: list[str]) -> dict:
    return {name: composed(name) for name in names}


def differences(before: dict, now: dict) -> tuple[list[str], list[str]]:
    """(differences, added): fields changed or missing, and fields new since the snapshot."""
    diff, added = [], []
    for name, ways in before.items():
        if name not in now:
            diff.append(f"{name}: preset missing")
            continue
        for way, values in ways.items():
            got = now[name][way]
            diff += [f"{name} [{way}] {k}: {v!r} -> {got.get(k, '<missing>')!r}"
                     for k, v in values.items() if got.get(k, "<missing>") != v]
            added += [f"{name} [{way}] {k} = {got[k]!r}" for k in got if k not in values]
    return diff, added


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--write", action="store_true", help="write the snapshot of the presets as they are now")
    args = parser.parse_args()
    names = [n for n in presets("hardware") if not n.startswith("calibrated_")]
    if args.write:
        SNAPSHOT.write_text(json.dumps(snapshot(names), indent=1, sort_keys=True) + "\n")
        print(f"wrote {SNAPSHOT} ({len(names)} presets)")
        return 0
    before = json.loads(SNAPSHOT.read_text())
    diff, added = differences(before, snapshot(sorted(before)))
    new = sorted(set(names) - set(before))
    print(f"{len(before)} presets of the snapshot, each read 3 ways: {len(diff)} differences, "
          f"{len(added)} fields added; new presets: {', '.join(new) or 'none'}")
    for line in diff:
        print("  " + line)
    fields = sorted({a.split("] ")[1].split(" = ")[0] for a in added})
    print(f"fields added (new schema fields, every preset): {', '.join(fields) or 'none'}")
    return 1 if diff else 0


if __name__ == "__main__":
    sys.exit(main())
