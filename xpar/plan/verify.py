"""The planner's answer checked the way a user would run it: the reproducing command line
composed by Hydra, validated and fit-checked (:func:`xpar.fit.check_run`), its estimate equal to
the plan's."""
from __future__ import annotations

import shlex
REL_TOL = 1e-6


def compose_line(line: str):
    """The config Hydra composes for ``python -m xpar <overrides>`` (inside a running Hydra app
    its loader, else conf/ directly)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from xpar.presets import conf_dir
    overrides = shlex.split(line)[3:]  # after 'python -m xpar'
    if GlobalHydra.instance().is_initialized():
        return compose(config_name="config", overrides=overrides)
    with initialize_config_dir(version_base=None, config_dir=str(conf_dir())):
        return compose(config_name="config", overrides=overrides)


def composed_spec(line: str, tokens_per_s: float):
    """(RunSpec, None) when ``line`` composes, validates, fits and its estimate gives
    ``tokens_per_s`` (relative :data:`REL_TOL`); else (None, the problem in words)."""
    from xpar.checks import ConfigError
    from xpar.estimate.cost import estimate
    from xpar.fit import check_run

    try:
        cfg = compose_line(line)
        spec = check_run(cfg)
    except ConfigError as e:
        return None, str(e).replace("\n", " ")
    except Exception as e:  # Hydra's composition errors
        return None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    got = estimate(spec).tokens_per_s
    if abs(got / tokens_per_s - 1) > REL_TOL:
        return None, f"its estimate is {got:,.1f} tokens/s, the plan's {tokens_per_s:,.1f}"
    return spec, None

