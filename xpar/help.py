"""``xpar --help``: the config groups and their presets, the headline commands, and where runs
are recorded. Read from the config tree, so a new preset shows up without editing this file.
(Hydra's own page stays available as ``--hydra-help``.) Torch-free."""
from __future__ import annotations

from xpar.config.presets import conf_dir, presets
from xpar.config.schema import PlanConfig

HEADLINE = """\
  python -m xpar                                   tiny model, data-parallel over the local CPU workers
  python -m xpar parallel=zero3                    same model, ZeRO-3 (FSDP2)
  python -m xpar parallel=pp parallel.schedule=1f1b  pipeline over 2 workers (model=mini)
  python -m xpar -m parallel=pp parallel.micro_batches=1,2,4,8   the headline sweep: bubble vs m
  python -m xpar parallel=3d model=70b             beyond this machine: estimate + fake-PG dry run
  python -m xpar +experiment=zero_memory           a named experiment (sweep) that checks one claim
  xpar plan model=175b hardware=a100_80gb_1024gpu  every layout ranked by the cost model, explained
  torchrun --nproc-per-node 2 -m xpar parallel=zero2   the same job as torchrun ranks
  xpar compare                                     table + plots of the newest sweep"""


def groups_text() -> str:
    """One line per config group of conf/: its presets, the default marked with '*'."""
    from omegaconf import OmegaConf

    defaults = {}
    for entry in OmegaConf.load(conf_dir() / "config.yaml").get("defaults", []):
        if isinstance(entry, dict) or OmegaConf.is_dict(entry):
            defaults.update({str(k): str(v) for k, v in dict(entry).items()})
    lines = []
    for group in sorted(p.name for p in conf_dir().iterdir() if p.is_dir() and any(p.glob("*.yaml"))):
        names = [n + ("*" if defaults.get(group) == n else "") for n in presets(group)]
        add = "+" if group not in defaults else ""
        lines.append(f"  {add}{group}=  {', '.join(names)}")
    launchers = presets("hydra/launcher") if (conf_dir() / "hydra" / "launcher").is_dir() else []
    if launchers:
        lines.append(f"  hydra/launcher=  {', '.join(launchers)} (also Hydra's basic, submitit_local, submitit_slurm)")
    return "\n".join(lines)


def help_text() -> str:
    return f"""usage: python -m xpar [group=preset ...] [key=value ...]      (or: xpar ...)
       python -m xpar -m key=a,b,...                           a sweep (one MLflow parent run)
       xpar compare [--sweep ID] [--filter F] [--out DIR]      compare recorded runs
       xpar plan [group=preset ...] [plan.key=value ...]       every layout ranked and explained (xpar plan --help)
       xpar calibrate hardware=local --name NAME               measure this machine into hardware=calibrated_NAME
       xpar sync <run dir>                                     send what a run's journal kept to the MLflow store

Config groups (preset names; * = default; '+' = add with +group=name):
{groups_text()}

Any field can be overridden: train.steps=20, parallel.micro_batches=8, model.hidden=512.
Print the composed config without running: python -m xpar parallel=pp --cfg job

Headline commands:
{HEADLINE}

Where runs are recorded:
  MLflow store   ./mlflow.db (SQLite, in the directory you run from), artifacts in ./mlartifacts;
                 tracking.uri=http://127.0.0.1:5000 logs to a server; tracking=off logs nothing
  run folders    outputs/<date>/<time>/ (one run), multirun/<date>/<time>/<job>/ (sweeps):
                 config.yaml, ranks.json, timelines, worker tracebacks
  comparisons    ./xpar_compare/<sweep id>/ (xpar compare)
  MLflow UI      MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false mlflow server --workers 1 --host 127.0.0.1 --port 5000 --backend-store-uri sqlite:///$PWD/mlflow.db
                 then http://127.0.0.1:5000/#/experiments/1/runs?workflowType=machine_learning

Hydra's own help: python -m xpar --hydra-help.  More: README.md."""


def print_page(text: str) -> None:
    """Print a help page; a reader that closes the pipe early (``| head``) ends it quietly (the
    Python docs' recipe: point stdout at devnull so the exit's flush does not raise)."""
    import os
    import sys

    try:
        print(text, flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def print_help() -> None:
    print_page(help_text())


PLAN_EXAMPLES = """\
  xpar plan model=175b hardware=a100_80gb_1024gpu                   the 175B / 1024 A100 search
  xpar plan model=70b hardware=a100_80gb_64gpu framework=megatron   as Megatron-LM would run it
  xpar plan model=7b hardware=a100_80gb_8gpu plan.zero_stages=[0,1] plan.max_tp=2
  xpar plan model=70b hardware=h100_80gb_64gpu plan.devices=[64,512] plan.min_tokens_per_s=2e5
  xpar plan model=tiny hardware=local plan.execute_top=3              run the top 3 for real here"""


def field_docs(cls) -> dict[str, str]:
    """The attribute docstrings of a dataclass (the string after each field), from its source."""
    import ast
    import inspect
    import textwrap

    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    docs = {}
    for field, doc in zip(body, body[1:]):
        if isinstance(field, ast.AnnAssign) and isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant):
            docs[field.target.id] = " ".join(str(doc.value.value).split())
    return docs


def plan_help_text() -> str:
    """``xpar plan --help``: usage, examples and every ``plan.*`` key with its default and meaning."""
    import dataclasses
    import textwrap

    docs = field_docs(PlanConfig)
    keys = []
    for f in dataclasses.fields(PlanConfig):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        text = textwrap.fill(docs.get(f.name, ""), width=96, initial_indent=" " * 6, subsequent_indent=" " * 6)
        keys.append(f"  plan.{f.name}={'null' if default is None else default}\n{text}")
    keys_text = "\n".join(keys)
    return f"""usage: xpar plan [group=preset ...] [plan.key=value ...]     (= python -m xpar run.mode=plan train=cluster ...)

Every valid layout of the model on the hardware (tp, pp, dp, ZeRO stage, micro-batch size and count,
schedule and virtual stages, sequence parallelism, recompute), ranked by the cost model's tokens/s and
explained; an MLflow run (tag xpar.mode=plan) with the ranked table; the winner as a python -m xpar line.

Examples:
{PLAN_EXAMPLES}

Constraints (plan.*):
{keys_text}

Groups as for a run (model=, hardware=, framework=, train=): xpar --help lists their presets."""

