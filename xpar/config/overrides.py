"""Command-line overrides checked before Hydra composes anything.

Hydra refuses an unknown key, an unknown group or a wrong type with its own message and exit
status 1 (``Could not override 'train.stepz'``, ``Value 'abc' ... could not be converted to
Integer``), and an output directory it cannot create with a traceback. :func:`override_problems`
finds these in ``argv`` first, against the typed schema (:class:`xpar.config.schema.XparConfig`) and
the preset files under ``conf/``, so that :func:`refuse_bad_overrides` can print them in xpar's
one refusal format (``xpar: invalid configuration:``, the constraint, the values given, values
that work) and exit 2 before any worker starts. Every suggested override is one that the same
check accepts. Torch-free.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

from omegaconf import OmegaConf

from xpar.config.presets import conf_dir, presets
from xpar.config.schema import GROUPS, XparConfig
from xpar.config.torchrun import quiet_exit, torchrun_follower

SECTIONS = {f.name: f.default_factory for f in dataclasses.fields(XparConfig)}
"""Top-level schema sections (model, parallel, ..., run, sweep) -> their dataclass."""


def refuse(problems: list[str]) -> None:
    """Print ``problems`` in the refusal format and exit 2 (under torchrun: rank 0 prints, xpar.run.job.fail)."""
    if torchrun_follower():
        quiet_exit(2)
    print("xpar: invalid configuration:\n" + "\n".join(f"  - {p}" for p in problems), file=sys.stderr)
    raise SystemExit(2)


def refuse_bad_overrides(argv: list[str]) -> None:
    """Exit 2 with every problem of the command line ``argv`` (see :func:`override_problems`)."""
    problems = override_problems(argv)
    if problems:
        refuse(problems)


def groups() -> list[str]:
    """Config groups: the folders of ``conf/`` (model, parallel, ..., and any added later)."""
    return sorted(p.name for p in conf_dir().iterdir() if p.is_dir() and any(p.glob("*.yaml")))


def fields_of(section: str) -> list[str]:
    return [f.name for f in dataclasses.fields(SECTIONS[section])]


def all_keys() -> list[str]:
    """Every ``section.field`` of the schema."""
    return [f"{s}.{f}" for s in SECTIONS for f in fields_of(s)]


def _closest(word: str, candidates: list[str]) -> Optional[str]:
    match = difflib.get_close_matches(word, candidates, n=1, cutoff=0.6)
    return match[0] if match else None


def _text(value: Any) -> str:
    """An override value as it is written on the command line."""
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "null"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_text(v) for v in value) + "]"
    return str(value)


def _values(override) -> Optional[list]:
    """The concrete values an override sets (each choice of a sweep); None for intervals and
    other sweeps that only a sweeper expands."""
    from hydra.core.override_parser.types import ChoiceSweep, RangeSweep

    value = override.value()
    if not override.is_sweep_override():
        return [value]
    if isinstance(value, ChoiceSweep):
        return [getattr(v, "text", v) for v in value.list]
    if isinstance(value, RangeSweep):
        return list(override.sweep_iterator())
    return None


COMMANDS = ("compare", "plan", "calibrate", "sync", "help")
"""The subcommands of ``xpar`` (xpar.__main__); anything else is a run's overrides."""
VALUE_FLAGS = ("--cfg", "-c", "--package", "-p", "--config-name", "-cn", "--config-path", "-cp",
               "--config-dir", "-cd", "--info", "-i", "--experimental-rerun")
"""Hydra's flags that take the next word as their value."""


def word_problems(argv: list[str]) -> list[str]:
    """A bare word where an override (key=value) or a command belongs, e.g. ``xpar compre``: Hydra
    said only "mismatched input ... expecting EQUAL". Names the closest command or key."""
    out = []
    for i, arg in enumerate(argv):
        if "=" in arg or arg.startswith("-") or (i > 0 and argv[i - 1] in VALUE_FLAGS):
            continue
        near = _closest(arg, list(COMMANDS)) if i == 0 else None
        key = None if near else _closest(arg, all_keys() + groups())
        rest = " ".join(a for a in argv[i + 1:] if "=" in a)
        hint = (f"did you mean `xpar {near}`?" if near else f"did you mean {key}=<value>?" if key else
                f"a run needs no command word: `xpar {rest}`." if arg in ("run", "train", "execute") and rest else
                "`xpar --help` lists the commands, groups and keys.")
        out.append(f"{arg!r} is neither a command ({', '.join(COMMANDS)}) nor an override (key=value): {hint} "
                   f"A run takes overrides such as parallel=zero3 train.steps=5.")
    return out


def override_problems(argv: list[str]) -> list[str]:
    """Problems of the overrides in ``argv`` (flags and ``hydra.*`` left to Hydra): unknown
    groups, presets, sections and keys (with the closest valid one), ``+`` on a key that
    exists, values of the wrong type, and an output directory that cannot be written."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    out: list[str] = []
    for arg in argv:
        if arg.startswith("-") or "=" not in arg or arg.lstrip("+~").startswith("hydra"):
            continue
        try:
            override = parser.parse_override(arg)
        except HydraException as e:
            out.append(f"cannot parse the override {arg!r}: {str(e).splitlines()[0][:200]}; write key=value, "
                       f"e.g. train.steps=5 or parallel=zero3.")
            continue
        if override.is_delete() or "/" in override.key_or_group:
            continue
        out += _override_problem(arg, override)
    return word_problems(argv) + out + env_problems(argv) + output_dir_problems(argv) + launcher_problems(argv)


ENV_INTERPOLATION = re.compile(r"\$\{oc\.env:\s*([^,}\s]+)\s*(,[^}]*)?\}")
"""``${oc.env:NAME}`` or ``${oc.env:NAME,default}`` in an override's value."""


def env_problems(argv: list[str]) -> list[str]:
    """``key=${oc.env:NAME}`` (no default) with NAME unset fails in OmegaConf's resolution (a
    traceback, after Hydra set up the run); a directory key (``hydra.run.dir``, ``hydra.sweep.dir``)
    with NAME set but empty would be the start directory (omegaconf#1179). One line each."""
    out = []
    for arg in argv:
        key, _, value = arg.lstrip("+~").partition("=")
        for m in ENV_INTERPOLATION.finditer(value if not arg.startswith("-") else ""):
            name, default = m.group(1), m.group(2)
            example = "outputs/mine" if key.endswith(".dir") else "<value>"
            fix = f"export {name}={example}"
            if name not in os.environ and default is None:
                out.append(f"{key}={value}: the environment variable {name} is not set; set it ({fix}) or give a "
                           f"default, e.g. {key}=${{oc.env:{name},{example}}}.")
            elif key.startswith("hydra.") and key.endswith(".dir") and os.environ.get(name) == "":
                out.append(f"{key}={value}: the environment variable {name} is set but empty, so the run would write "
                           f"into the start directory (omegaconf#1179); {fix}, or unset {name} and give a default.")
    return out


def launcher_problems(argv: list[str]) -> list[str]:
    """``hydra/launcher=slurm`` where SLURM is not installed: submitit raised a traceback
    ('Could not detect "srun"') after the sweep had started."""
    import shutil

    if not any(a.lstrip("+").startswith("hydra/launcher=slurm") for a in argv):
        return []
    missing = [cmd for cmd in ("srun", "sbatch") if shutil.which(cmd) is None]
    if not missing:
        return partition_gpu_problems(argv)
    return [f"hydra/launcher=slurm needs SLURM on this host ({' and '.join(missing)} not on PATH): run it from a "
            f"cluster's login node, or drop hydra/launcher=slurm to run the jobs here."]


def _launcher_value(argv: list[str], key: str):
    """``hydra.launcher.<key>`` from the command line, else conf/hydra/launcher/slurm.yaml's."""
    from omegaconf import OmegaConf

    given = [a.split("=", 1)[1] for a in argv if a.startswith(f"hydra.launcher.{key}=")]
    if given:
        return given[-1]
    return OmegaConf.load(conf_dir() / "hydra" / "launcher" / "slurm.yaml").get(key)


def partition_gpu_problems(argv: list[str]) -> list[str]:
    """GPUs asked per node (``hydra.launcher.gpus_per_node``, 8 in the preset) that the partition
    does not have, read from ``sinfo`` (its GRES): sbatch failed after the sweep had started (a
    30-line traceback and an empty FAILED sweep run on a CPU partition)."""
    import re
    import subprocess

    want, part = int(_launcher_value(argv, "gpus_per_node") or 0), _launcher_value(argv, "partition")
    if want <= 0:
        return []
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%P %G"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return []  # sinfo unavailable: sbatch will say
    named = part not in (None, "None", "null")
    mine = []  # the GRES of the partition asked for (the default one, marked *, when none is)
    for line in out.splitlines():
        name, _, gres = line.strip().partition(" ")
        if name and (name.rstrip("*") == part if named else name.endswith("*")):
            mine.append(gres.strip() or "(null)")
    if not mine:
        return []
    have = max((int(n) for g in mine for n in re.findall(r"gpu(?::[\w.-]+)?:(\d+)", g)), default=0)
    if have >= want:
        return []
    name = part if named else "the default partition"
    return [f"hydra.launcher.gpus_per_node={want} but {name} has {have or 'no'} GPU(s) per node (sinfo GRES: "
            f"{', '.join(sorted(set(mine)))}): pass hydra.launcher.gpus_per_node={have} (CPU workers when 0) or a GPU "
            f"partition with hydra.launcher.partition=<name>."]


def _override_problem(arg: str, override) -> list[str]:
    key, values = override.key_or_group, _values(override)
    if "." not in key:
        if key in groups() and override.is_add() == (key in GROUPS):  # '+' only for groups outside the defaults
            return [f"{arg}: {key} is {'already' if key in GROUPS else 'not'} in the defaults list; write "
                    f"{_suggest(key, _text(values[0]) if values and len(values) == 1 else None)}."]
        return _group_problem(arg, key, values)
    section, _, name = key.partition(".")
    if section not in SECTIONS:
        return _unknown(arg, key, values)
    if name not in fields_of(section):
        return _unknown(arg, key, values, section)
    if override.is_add():
        return [f"{arg}: '+' adds a key that does not exist, but {key} is in the schema; "
                f"set it without '+': {key}={_text(override.value()) if values else '...'}."]
    return _type_problems(arg, section, name, values)


def _group_problem(arg: str, key: str, values: Optional[list]) -> list[str]:
    """``group=preset``: a known group and preset; a section (run, sweep) is not a group."""
    if key in groups():
        known = presets(key)
        bad = [v for v in (values or []) if str(v) not in known]
        return [f"unknown {key} preset {str(v)!r} in {arg}; "
                + (f"did you mean {key}={_sweep_fix(values, known)}? " if _closest(str(v), known) else "")
                + f"available: {', '.join(known)}." for v in bad]
    if key in SECTIONS:
        return [f"{arg}: {key} is not a config group but a section of fields ({', '.join(fields_of(key))}); "
                f"set one of them, e.g. {key}.{fields_of(key)[0]}=..."]
    return _unknown(arg, key, values)


def _sweep_fix(values: list, known: list[str]) -> str:
    """The values of ``group=a,b,c`` with each unknown one replaced by its closest preset (dropped without one),
    each once: a sweep stays a sweep (parallel=dp,zero4,zero3 was told 'did you mean parallel=zero3?', one job
    where three were asked)."""
    fixed = [str(v) if str(v) in known else _closest(str(v), known) for v in values]
    return ",".join(dict.fromkeys(f for f in fixed if f))


def _unknown(arg: str, key: str, values: Optional[list], section: Optional[str] = None) -> list[str]:
    """An unknown key or group, with the closest valid one written as a working override (a sweep's values as
    given: parallel.tpp=1,2 -> parallel.tp=1,2, was 'parallel.tp=...')."""
    value = _text(values[0]) if values and len(values) == 1 else (arg.split("=", 1)[1] or None) if "=" in arg else None
    candidates = ([f"{section}.{f}" for f in fields_of(section)] if section
                  else groups() + all_keys())
    leaf = key.split(".")[-1]
    prefixed = sorted((k for k in candidates if k.startswith(key)), key=len)  # parallel.zero -> parallel.zero_stage
    near = (prefixed[0] if prefixed else None) or (_other_section(section, leaf) if section else None) \
        or _closest(key, candidates) or next((k for k in candidates if k.split(".")[-1] == leaf), None) \
        or _closest(leaf, candidates)
    what = f"key {key!r} is not in the schema" if section or "." in key else f"{key!r} is neither a config group nor a key"
    if near is None:
        valid = ", ".join(candidates) if section else (f"groups {', '.join(groups())}; sections "
                                                        f"{', '.join(f'{s}.*' for s in SECTIONS)}")
        return [f"{arg}: {what}; valid: {valid}."]
    return [f"{arg}: {what}; did you mean {_suggest(near, value)}?"]


def _other_section(section: str, leaf: str) -> Optional[str]:
    """``section.<field>`` for a field name close to ``leaf`` (parallel.micro_batchs ->
    parallel.micro_batches), else the key of another section whose field is ``leaf`` (parallel.steps ->
    train.steps: comparing whole keys, the shared 'parallel.' made parallel.tp the closest); None if neither."""
    field = _closest(leaf, fields_of(section))
    if field is not None:
        return f"{section}.{field}"
    same = [k for k in all_keys() if k.split(".", 1)[1] == leaf]  # train.seq_len before model.seq_len
    return min(same, key=lambda k: not k.startswith("train.")) if same else None


def _suggest(near: str, value: Optional[str]) -> str:
    """``near=value`` written so that it composes: a group outside the defaults list needs '+'."""
    if value is None:
        return f"{near}=..."
    if "." not in near:  # a group
        known = presets(near)
        plus = "" if near in GROUPS else "+"  # a group outside the defaults list: experiment=foo was told 'experiment=<...>'
        if any(v not in known for v in value.split(",")):  # a sweep's values (paralel=dp,zero3) each a preset
            return f"{plus}{near}=<one of {', '.join(known)}>"
        return f"{plus}{near}={value}"
    return f"{near}={value}"


def _type_problems(arg: str, section: str, name: str, values: Optional[list]) -> list[str]:
    """Each value must convert to the field's type (the check OmegaConf does when Hydra merges)."""
    from omegaconf.errors import ValidationError

    node = OmegaConf.structured(SECTIONS[section])
    default = getattr(node, name)
    for value in values or []:
        try:
            setattr(node, name, value)
        except ValidationError:
            kind = _kind(SECTIONS[section], name)
            return [f"{section}.{name} must be {kind}, got {_text(value)!r} ({arg}); e.g. {section}.{name}="
                    f"{_text(default)}."]
    return []


def _kind(cls, name: str) -> str:
    import typing
    hint = typing.get_type_hints(cls)[name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    base = args[0] if args else hint
    words = {int: "an integer", float: "a number", bool: "true or false", str: "a string", list: "a list"}
    text = words.get(base, getattr(base, "__name__", str(base)))
    return text + (" or null" if type(None) in typing.get_args(hint) else "")


def _dir_override(argv: list[str], key: str) -> Optional[str]:
    for arg in argv:
        if arg.startswith(key + "="):
            return arg.split("=", 1)[1]
    return None


def output_dir_problems(argv: list[str]) -> list[str]:
    """The run (or sweep) directory Hydra will create must be writable."""
    multirun = any(a in ("-m", "--multirun") for a in argv)
    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    given = _dir_override(argv, key)
    if given is not None and not given.strip():
        return [f"{key} is set but empty: the run would write into the start directory; give a directory, "
                f"e.g. {key}={'multirun' if multirun else 'outputs'}/mine, or leave it out."]
    env = None if multirun else os.environ.get("XPAR_RUN_DIR")
    if given is None and env is not None and not env.strip():
        return ["XPAR_RUN_DIR is set but empty: the run would write into the start directory (omegaconf#1179); "
                "unset it (unset XPAR_RUN_DIR) or set it to a directory, e.g. XPAR_RUN_DIR=outputs/pinned."]
    path = given or env or ("multirun" if multirun else "outputs")
    static = path.split("${", 1)[0] or "."
    problem = unwritable(Path(static))
    if problem is None:
        return []
    fix = Path(tempfile.gettempdir()) / "xpar" / ("multirun" if multirun else "outputs")
    return [f"the output directory {path} cannot be written ({problem}); start xpar from a writable "
            f"directory or pass {key}={fix}."]


def unwritable(path: Path) -> Optional[str]:
    """None if a file can be created at ``path`` (a directory, existing or to be created),
    else why not. Probes the nearest existing ancestor by creating and removing a file (so
    it is right for root and read-only file systems alike)."""
    path = Path(path).expanduser().absolute()
    probe = path
    while not probe.exists():
        if probe.parent == probe:
            return "no existing parent"
        probe = probe.parent
    if not probe.is_dir():
        return f"{probe} is not a directory"
    try:
        fd, name = tempfile.mkstemp(dir=probe, prefix=".xpar-probe-")
        os.close(fd)
        os.unlink(name)
    except OSError as e:
        return f"{probe}: {e.strerror or e}"
    return None
