"""The planner's answer checked the way a user would run it: the reproducing command line
composed by Hydra and validated, resolving to the planned layout."""
from __future__ import annotations

import shlex

from xpar.config.checks import ConfigError
from xpar.config.presets import conf_dir
from xpar.config.validate import validate
from xpar.estimate.columns.stage_split import plan_split


def compose_line(line: str):
    """The config Hydra composes for ``python -m xpar <overrides>`` (inside a running Hydra app
    its loader, else conf/ directly)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    overrides = shlex.split(line)[3:]  # after 'python -m xpar'
    if GlobalHydra.instance().is_initialized():
        return compose(config_name="config", overrides=overrides)
    with initialize_config_dir(version_base=None, config_dir=str(conf_dir())):
        return compose(config_name="config", overrides=overrides)


def composed_spec(line: str, want: dict):
    """(RunSpec, None) when ``line`` composes, validates (:func:`xpar.config.validate.validate`: every
    rule, as a run checks it) and resolves to the layout ``want`` (a candidate row,
    :func:`xpar.plan.context.row`; its pipeline split :func:`xpar.estimate.columns.stage_split.plan_split`'s); else
    (None, the problem in words). Whether it fits and its figures are the vectorised cost model's, equal to the scalar one's (tests/plan/test_plan_vector.py,
    tests/plan/test_plan_memory.py): not recomputed here, which would walk torch's schedules."""
    try:
        spec = validate(compose_line(line))
    except ConfigError as e:
        return None, str(e).replace("\n", " ")
    except Exception as e:  # Hydra's composition errors
        return None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    lay = spec.layout
    got = dict(tp=lay.tp, pp=lay.pp, dp=lay.dp, b=lay.micro_batch_size, m=lay.micro_batches, v=lay.virtual_stages,
               schedule=lay.schedule, zero=lay.zero_stage, sp=lay.sequence_parallel, recompute=lay.recompute)
    got.update({k: v for k, v in (("cp", lay.cp), ("ep", lay.ep), ("dtype", spec.train.dtype), ("etp", lay.etp))
                if k in want})
    if "act_offload" in want:  # parallel.activation_offload_layers (xpar.plan.offload_fit)
        got["act_offload"] = spec.parallel.activation_offload_layers or 0
    if lay.pp == 1:  # no pipeline: the schedule does not matter
        got.update(schedule=want["schedule"], v=want["v"])
    got["layer_split"] = list(lay.layer_split)  # even, else lighter ends (xpar.estimate.columns.stage_split)
    want = dict(want, layer_split=plan_split(spec.model.n_layers, lay.pp * lay.virtual_stages))
    diff = {k: (got[k], want[k]) for k in got if got[k] != want[k]}
    return (spec, None) if not diff else (None, f"it resolves to another layout: {diff} (got, wanted)")
