"""The private Hydra API xpar uses (hydra-core 1.3), behind one function; a Hydra upgrade
that moves it breaks here, and tests/parallel/test_private_apis.py says so."""
from __future__ import annotations


def split_sweep_arguments(overrides: list) -> list:
    """Hydra's own expansion of sweep overrides into batches of jobs
    (``hydra._internal.core_plugins.basic_sweeper.BasicSweeper.split_arguments``)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    return BasicSweeper.split_arguments(overrides, None)


def apply_value_overrides(overrides: list, cfg) -> None:
    """Hydra's own application of parsed ``key=value`` overrides to a composed config, in place and in
    order, as it applies them after the defaults list
    (``hydra._internal.config_loader_impl.ConfigLoaderImpl._apply_overrides_to_config``; the tests' compose)."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    ConfigLoaderImpl._apply_overrides_to_config(overrides, cfg)
