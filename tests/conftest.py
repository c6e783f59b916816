"""Shared test helpers: config composition, the single-process reference, and ONE spawn of
gloo workers that runs several checks in a row (process start-up costs seconds here)."""
from __future__ import annotations

import contextlib
import copy
import functools
import json
import multiprocessing.process
import multiprocessing.util
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, Optional

import pytest
import torch

from xpar.config.spec import RunSpec

platform.uname().processor  # cached now: MLflow's first import asks it of `uname -p`, a subprocess _no_spawn refuses


def compose(*overrides: str):
    """The composed DictConfig for ``overrides`` (as on the command line), as Hydra's compose gives it: the
    presets the group overrides choose, composed once per choice in this process (Hydra's compose takes
    ~0.2 s), copied, then the value overrides (``group.key=value``) applied by Hydra's own code, in order and
    in struct mode, as Hydra applies them after composing the defaults list (hydra/_internal/config_loader_impl.py).
    ``XPAR_TEST_COMPOSE_CHECK=1`` compares each result with Hydra's compose of all the overrides."""
    from omegaconf import OmegaConf

    from xpar.config.hydra_internals import apply_value_overrides

    choices, values = _split(overrides)
    cfg = copy.deepcopy(_composed(choices))
    apply_value_overrides(values, cfg)
    if os.environ.get("XPAR_TEST_COMPOSE_CHECK") == "1":
        whole = _composed(tuple(overrides))
        assert OmegaConf.to_yaml(cfg) == OmegaConf.to_yaml(whole), overrides
        assert OmegaConf.is_struct(cfg) == OmegaConf.is_struct(whole), overrides
    return cfg


def _split(overrides: tuple[str, ...]) -> tuple[tuple[str, ...], list]:
    """(what Hydra must compose: group choices and any override not a plain ``a.b=value`` change outside
    ``hydra.``, the parsed plain changes): a plain change never alters the defaults list."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    choices, values = [], []
    for text, o in zip(overrides, OverridesParser.create().parse_overrides(list(overrides))):
        plain = o.type.name == "CHANGE" and not o.is_sweep_override() and not o.is_hydra_override()
        (values.append(o) if plain and "." in o.key_or_group and o.package is None else choices.append(text))
    return tuple(choices), values


@functools.lru_cache(maxsize=None)
def _composed(overrides: tuple[str, ...]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    import xpar.config.schema  # noqa: F401
    from xpar.config.presets import conf_dir

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        return hydra_compose(config_name="config", overrides=list(overrides))


def spec_for(*overrides: str, local_devices: int = 2) -> RunSpec:
    """A validated RunSpec (tracking off, no progress bar)."""
    from xpar.estimate.preflight.check import check_run

    cfg = compose("tracking=off", "run.progress=false", *overrides)
    return check_run(cfg, local_devices=local_devices)


def reference_losses(spec: RunSpec, steps: Optional[int] = None, grads: bool = False):
    """Single-process fp32 reference (:func:`xpar.run.reference.reference_run`): the whole model,
    the whole global batch per step, clipping and lr schedule as the engine does.

    Returns the per-step losses (and, with ``grads``, the gradients of the last step by
    parameter name)."""
    from xpar.run.reference import reference_run

    torch.manual_seed(0)
    out = reference_run(spec, steps, precision="fp32")
    return (out["losses"], out["last_grads"]) if grads else out["losses"]


def _entry(local_rank: int, world: int, port: int, fn: Callable, payload, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=local_rank, world_size=world)
    try:
        result = fn(payload)
        if local_rank == 0:
            Path(out).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()
    from xpar.run.worker import exit_worker
    exit_worker()  # skip finalization: gloo may abort a finished process there (see exit_worker)


def spawn(fn: Callable, world: int, payload) -> object:
    """Run ``fn(payload)`` on ``world`` gloo ranks (a module-level function, so the children
    can import it); return rank 0's JSON-serialisable result. The ranks start as xpar's workers do
    (:func:`xpar.run.launch.start_workers`: forked from a server that imported torch once)."""
    from xpar.run.forkserver import WORKER_PRELOAD
    from xpar.run.launch import free_port, start_workers

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "result.json")
        ctx = start_workers(_entry, (world, free_port(), fn, payload, out), world, (*WORKER_PRELOAD, "tests.conftest"))
        while not ctx.join():
            pass
        return json.loads(Path(out).read_text())


def run_specs(spec_dicts: list[dict]) -> list[list]:
    """Worker side: build and train each spec through xpar's real path; on rank 0 return
    [(losses, memory, timing of every rank)] per spec (timing: ``comm`` metrics, ``thread_cpu_s``
    and ``step_times_s``, xpar.run.train.train)."""
    import tempfile as tf

    from xpar.run.worker import run_rank

    results = []
    for d in spec_dicts:
        with tf.TemporaryDirectory() as out:
            stats = run_rank(RunSpec.from_dict(d), Path(out))
        if stats is not None:
            timing = [{k: s.get(k) for k in ("comm", "thread_cpu_s", "core_wait_s", "comm_exposed_s", "step_times_s",
                                              "cpu_share")} for s in stats]
            results.append([[s["losses"] for s in stats], [s["memory"] for s in stats], timing])
    return results


def start_mlflow_server(root: Path, port: int, store: Optional[Path] = None) -> subprocess.Popen:
    """``mlflow server`` on 127.0.0.1:``port`` over the SQLite ``store`` (default
    ``root/server.db``), artifacts under ``root``, in its own session (kill with
    ``os.killpg(proc.pid, 15)``); returns once /health answers. Job execution off and one
    worker: 2 processes (~360 MB), healthy in ~10 s here.

    Raises:
        RuntimeError: not healthy within 90 s, or the server exited.
    """
    import shutil
    import time
    import urllib.request

    env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
    mlflow_bin = shutil.which("mlflow", path=os.path.dirname(sys.executable)) or "mlflow"
    proc = subprocess.Popen([mlflow_bin, "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
                             "--backend-store-uri", f"sqlite:///{store or root / 'server.db'}",
                             "--default-artifact-root", str(root / "server_artifacts")], cwd=root,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True)
    deadline = time.time() + 90
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return proc
        except OSError:
            if time.time() > deadline or proc.poll() is not None:
                raise RuntimeError("mlflow server did not become healthy in 90 s")
            time.sleep(0.5)


FIDELITY_METRICS = ("fidelity/step_time_ratio", "fidelity/peak_memory_ratio", "fidelity/bubble_diff")


def runs_missing_fidelity(root: Path) -> list[str]:
    """Finished executed runs (tag xpar.mode=execute) in every SQLite MLflow store under
    ``root`` that lack one of :data:`FIDELITY_METRICS`, as 'store: run name: missing keys'."""
    import sqlite3

    out = []
    for db in root.rglob("*.db"):
        try:
            con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
            runs = con.execute("SELECT r.run_uuid, r.name FROM runs r JOIN tags t ON t.run_uuid = r.run_uuid "
                               "WHERE t.key = 'xpar.mode' AND t.value = 'execute' AND r.status = 'FINISHED'"
                               ).fetchall()
            for run_id, name in runs:
                have = {k for (k,) in con.execute("SELECT DISTINCT key FROM metrics WHERE run_uuid = ?", (run_id,))}
                if missing := [k for k in FIDELITY_METRICS if k not in have]:
                    out.append(f"{db}: {name}: {missing}")
            con.close()
        except sqlite3.DatabaseError:  # not an MLflow store
            continue
    return out


SLOWEST_MODULES = ("test_ownership", "test_run", "test_parity", "test_checkpoint", "test_faults", "test_estimate_run",
                   "test_sweep", "test_plan", "test_moe_empty_experts", "test_ui", "test_context_parallel",
                   "test_calibrate", "test_input_checks", "test_pipeline", "test_estimate_throughput",
                   "test_expert_parallel", "test_clipping")
"""Modules that launch workers, longest first (the longest processing time first keeps the two workers'
ends close): seconds per module in the full suite here (2026-12-06, load 4-8, sum of its tests of >= 3.3 s):
420, 372, 369, 223, 223, 174, 164, 139, 119, 101, 98, 97, 90, 89, 77, 74, 65. Each module goes
whole to a free pytest worker in collection order (pyproject's addopts: ``-n 2 --dist loadfile
--no-loadscope-reorder``; xdist would otherwise order modules by their number of tests, which left the
long multi-process modules, with few tests each, for the end): the longest go first."""


INTEGRATION = "integration-sized"
"""Besides the tests that start processes, ``slow`` marks the integration-sized ones (a comment naming
this constant beside the marker): fits and checks over the whole published corpus
(tests/data/), every preset composed, dry runs of full-size engines, plan searches over ranges of
clusters; seconds each on 2 cores. The fast loop (``pytest -m "not slow"``) keeps the small
tests of the same code; the full suite runs all."""


def pytest_collection_modifyitems(items):
    """Collect :data:`SLOWEST_MODULES` first, longest first (a stable sort: each module's own order kept)."""
    rank = {m: i for i, m in enumerate(SLOWEST_MODULES)}
    items.sort(key=lambda it: rank.get(it.path.stem, len(rank)))


@pytest.fixture(scope="session", autouse=True)
def every_executed_run_has_fidelity(tmp_path_factory):
    """After the session: every finished executed run that any test recorded under pytest's
    temporary directories carries the three fidelity metrics (issue: the closed loop)."""
    yield
    missing = runs_missing_fidelity(tmp_path_factory.getbasetemp())
    assert not missing, "executed runs without fidelity metrics:\n" + "\n".join(missing)


@contextlib.contextmanager
def _no_spawn(item):
    """Inside a test not marked ``slow``: starting a subprocess or a worker process fails the
    test, so that ``pytest -m "not slow"`` is the fast loop and the marker cannot be forgotten."""
    if item.get_closest_marker("slow"):
        yield
        return

    def refuse(*_args, **_kwargs):
        raise RuntimeError(f"{item.nodeid} starts a process: mark it @pytest.mark.slow")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(subprocess.Popen, "_execute_child", refuse)
        mp.setattr(multiprocessing.process.BaseProcess, "start", refuse)
        mp.setattr(multiprocessing.util, "spawnv_passfds", refuse)  # the fork server's and resource tracker's start
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    with _no_spawn(item):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    with _no_spawn(item):
        yield
