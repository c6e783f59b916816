"""Bad input refused before any worker starts (issue 40): every numeric key of the schema has a
range (xpar.config.checks.ranges), out-of-range values are refused with one line naming the key, the
value, the range and a value that works; estimates whose figures are not finite or negative are
refused; advice that works when followed; no traceback on the cases of the issue (subprocesses,
marked slow)."""
from __future__ import annotations

import dataclasses
import math
import typing
from pathlib import Path

import pytest

from tests.conftest import compose, spec_for
from xpar.config.checks import ConfigError
from xpar.config.checks.ranges import RANGES, range_problems
from xpar.config.presets import conf_dir
from xpar.config.schema import XparConfig
from xpar.config.validate import to_schema

NUMERIC = (int, float, typing.Optional[int], typing.Optional[float], typing.Any)


def schema_numeric_keys() -> list[str]:
    """Every field of every group whose type is a number, an optional number or Any (numbers or 'auto')."""
    out = []
    for group in dataclasses.fields(XparConfig):
        cls = type(group.default_factory())
        hints = typing.get_type_hints(cls)
        out += [f"{group.name}.{f.name}" for f in dataclasses.fields(cls) if hints[f.name] in NUMERIC]
    return out


def test_every_numeric_field_of_the_schema_has_a_range():
    keys = schema_numeric_keys()
    assert len(keys) > 100
    missing = [k for k in keys if k not in RANGES]
    assert not missing, f"numeric keys without a range in xpar.config.checks.ranges.RANGES: {missing}"
    assert not [k for k in RANGES if k not in keys]  # no range for a key that is gone


@pytest.mark.slow  # integration-sized (conftest.INTEGRATION): runs in the full suite, not the fast loop
def test_every_default_and_every_preset_is_in_range():
    """A range that refused a shipped preset would refuse the user's working command."""
    assert range_problems(XparConfig()) == {}
    for group in ("model", "parallel", "hardware", "framework", "train", "plan"):
        for path in sorted((conf_dir() / group).glob("*.yaml")):
            c = to_schema(compose(f"{'+' if group == 'plan' else ''}{group}={path.stem}"))
            assert range_problems(c) == {}, (group, path.stem, range_problems(c))


@pytest.mark.parametrize("key, bad", [
    ("parallel.etp", -1), ("model.moe_imbalance", math.inf), ("model.moe_imbalance", math.nan),
    ("model.norm_eps", 0), ("train.seed", -3), ("hardware.memory_headroom", 1.0),
    ("framework.bucket_mb", -1.0), ("framework.bucket_mb", math.inf), ("run.collective_timeout_s", math.inf), ("plan.top_k", 0),
    ("train.checkpoint_keep", 0), ("model.rope_theta", -1.0)])
def test_an_out_of_range_value_is_refused_naming_key_value_range_and_a_fix(key, bad):
    c = XparConfig()
    group, name = key.split(".")
    setattr(getattr(c, group), name, bad)
    line = range_problems(c)[key]
    assert line.startswith(f"{key} must be ") and f"got {bad}" in line and f"e.g. {key}=" in line
    fix = line.rsplit(f"e.g. {key}=", 1)[1].rstrip(".")
    given = None if fix == "null" else fix if fix == "auto" else int(fix) if RANGES[key].integer else float(fix)
    setattr(getattr(c, group), name, given)
    assert key not in range_problems(c), line  # the suggestion works


@pytest.mark.parametrize("overrides, key", [
    (("model=mixtral_8x7b", "parallel.etp=-1"), "parallel.etp"),
    (("model=mixtral_8x7b", "model.moe_imbalance=inf"), "model.moe_imbalance"),
])
def test_etp_and_imbalance_refused_in_an_estimate(overrides, key):
    with pytest.raises(ConfigError) as e:
        spec_for("run.mode=estimate", "hardware=h100_80gb_64gpu", *overrides)
    assert [p for p in e.value.problems if p.startswith(key)], e.value.problems


def test_an_estimate_with_a_nan_or_negative_figure_is_refused_not_recorded(tmp_path):
    """The guard behind the range checks: a spec that slipped past them (imbalance inf, etp -1 set on
    the resolved spec) gives no Report; the run ends FAILED (xpar.track.runs.mlflow_run), exit 2."""
    from dataclasses import replace

    from xpar.run.estimate_mode import EstimateError, estimate_report

    spec = spec_for("run.mode=estimate", "hardware=h100_80gb_64gpu", "model=mixtral_8x7b", "parallel.ep=8",
                    "parallel.zero_stage=3", "parallel.recompute=full", "train.micro_batch_size=1", "run.dry_run=false")
    assert estimate_report(spec, tmp_path).step_time_s > 0
    for bad in (replace(spec, model=replace(spec.model, moe_imbalance=math.inf)),
                replace(spec, layout=replace(spec.layout, etp=-1))):
        with pytest.raises(EstimateError) as e:
            estimate_report(bad, tmp_path)
        assert "not finite or negative" in str(e.value) and "\n" not in str(e.value)


# --- no traceback, one line (subprocesses) ---------------------------------------------------------

def _xpar(*args: str, cwd, env=None, timeout: int = 240):
    import os
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "xpar", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def _refusal_lines(stderr: str) -> list[str]:
    assert "Traceback" not in stderr, stderr[-3000:]
    return [ln for ln in stderr.splitlines() if ln.startswith("  - ")]


def test_an_unset_environment_variable_in_an_override_is_one_line():
    from xpar.config.overrides import env_problems

    [line] = env_problems(["hydra.run.dir=${oc.env:XPAR_TEST_UNSET_VAR}"])
    assert "XPAR_TEST_UNSET_VAR is not set" in line and "hydra.run.dir=${oc.env:XPAR_TEST_UNSET_VAR,outputs/mine}" in line
    assert env_problems(["hydra.run.dir=${oc.env:XPAR_TEST_UNSET_VAR,outputs/x}"]) == []  # a default works


@pytest.mark.slow
def test_unset_env_in_the_run_dir_exit_2_no_traceback(tmp_path):
    r = _xpar("hydra.run.dir=${oc.env:XPAR_TEST_UNSET_VAR}", "tracking=off", cwd=tmp_path, timeout=120)
    assert r.returncode == 2
    [line] = _refusal_lines(r.stderr)
    assert "XPAR_TEST_UNSET_VAR is not set" in line
    assert not (tmp_path / "outputs").exists()


@pytest.mark.slow
def test_sigterm_during_calibrate_one_line_no_preset(tmp_path):
    """SIGTERM to calibrate's process group while its workers measure: one line, exit 130, no
    KeyboardInterrupt traceback, no preset, no worker left."""
    import os
    import signal
    import subprocess
    import sys
    import time

    name = f"pytest_term_{os.getpid()}"
    p = subprocess.Popen([sys.executable, "-m", "xpar", "calibrate", "--quick", "--no-track", "--name", name,
                          "--out", str(tmp_path / "cal")], cwd=tmp_path, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.time() + 120
    preset = conf_dir() / "hardware" / f"calibrated_{name}.yaml"
    try:
        while not _workers_of_group(p.pid) and time.time() < deadline and p.poll() is None:
            time.sleep(0.5)
        time.sleep(3)  # the workers are measuring (a --quick calibration takes ~30 s or more here)
        assert p.poll() is None, "calibrate ended before it could be interrupted"
        os.killpg(p.pid, signal.SIGTERM)
        out, err = p.communicate(timeout=60)
        assert p.returncode == 130, (p.returncode, err[-2000:])
        lines = [ln for ln in err.strip().splitlines() if not ln.startswith("xpar calibrate: [")]  # its stage lines
        assert lines == ["xpar: calibrate interrupted; workers ended, no preset written."], err[-3000:]
        assert not preset.exists()
        assert _workers_of_group(p.pid) == []  # no calibration worker left (the parent joined them)
    finally:
        p.kill()
        preset.unlink(missing_ok=True)  # a failed check leaves no preset behind for the other tests


def _workers_of_group(pgid: int) -> list[int]:
    """Live workers in process group ``pgid``: processes forked by its fork server (xpar.run.forkserver), whose
    parent is the server, not the group's leader, or spawned ones (multiprocessing's spawn_main)."""
    from pathlib import Path

    out = []
    for d in Path("/proc").glob("[0-9]*"):
        try:
            stat = (d / "stat").read_text().rsplit(")", 1)[1].split()
            cmd, forked = (d / "cmdline").read_bytes(), int(stat[1]) != pgid
            if int(stat[2]) == pgid and stat[0] != "Z" and (b"spawn_main" in cmd or forked and b"forkserver" in cmd):
                out.append(int(d.name))
        except (OSError, IndexError, ValueError):
            continue
    return out


@pytest.mark.slow
def test_a_broken_store_stops_calibrate_before_it_measures(tmp_path):
    """The store is broken (a file that is not SQLite where the default store goes): calibrate says so in
    one line and exits 2 before any worker measures anything (no calibration.json), writing no preset."""
    import os

    name = f"pytest_fail_{os.getpid()}"
    (tmp_path / "mlflow.db").write_text("not a database\n" * 100)
    r = _xpar("calibrate", "--quick", "--name", name, "--out", str(tmp_path / "cal"), cwd=tmp_path, timeout=300)
    preset = conf_dir() / "hardware" / f"calibrated_{name}.yaml"
    try:
        assert r.returncode == 2, r.stderr[-2000:]
        assert "Traceback" not in r.stderr and "xpar: calibrate measured nothing: " in r.stderr, r.stderr[-3000:]
        assert "tracking.uri=sqlite:///" in r.stderr and "or pass --no-track." in r.stderr, r.stderr[-3000:]
        assert "tracking=off" not in r.stderr  # a run's switch, not calibrate's
        assert not (tmp_path / "cal" / "calibration.json").exists() and not preset.exists()
    finally:
        preset.unlink(missing_ok=True)


def _measured_quick() -> dict:
    """What ``measure_workers(2, QUICK_BYTES, 5)`` returned on a 2-core machine (tests/calibrate/measured_quick.json)."""
    import json

    raw = json.loads((Path(__file__).parents[1] / "calibrate" / "measured_quick.json").read_text())
    raw["compute"]["matmul"] = {int(n): r for n, r in raw["compute"]["matmul"].items()}
    raw["collectives"] = {k: {int(b): t for b, t in v.items()} for k, v in raw["collectives"].items()}
    return raw


def test_a_calibration_that_fails_recording_writes_no_preset(tmp_path, monkeypatch, capsys):
    """Measured, then the store fails while the run is logged: one line "calibrate failed", exit 1, no preset."""
    import os

    from xpar.calibrate import command

    def store_fails(*_args):
        raise OSError("database or disk is full")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(command, "setup_experiment", lambda *_a: "0")  # no store (and no MLflow state) here
    monkeypatch.setattr(command, "measure_workers", lambda *_a, **_k: _measured_quick())
    monkeypatch.setattr(command, "_log", store_fails)
    name = f"pytest_fail_{os.getpid()}"
    preset = conf_dir() / "hardware" / f"calibrated_{name}.yaml"
    try:
        assert command.main(["--quick", "--name", name, "--out", str(tmp_path / "cal")]) == 1
        err = capsys.readouterr().err
        assert "xpar: calibrate failed, no preset written: database or disk is full" in err, err
        assert (tmp_path / "cal" / "calibration.json").exists() and not preset.exists()
    finally:
        preset.unlink(missing_ok=True)


# --- advice that works when followed ---------------------------------------------------------------

def _refused(*overrides: str, local_devices: int = 2) -> list[str]:
    with pytest.raises(ConfigError) as e:
        spec_for(*overrides, local_devices=local_devices)
    return e.value.problems


@pytest.mark.parametrize("first, last", [(0, 0), (3, 3), (-1, 2)])
def test_the_fix_for_both_edge_stages_is_another_input_that_runs(first, last):
    given = ("parallel=pp", f"parallel.first_stage_layers={first}", f"parallel.last_stage_layers={last}")
    [line] = [p for p in _refused(*given) if "first_stage_layers" in p]
    fix = line.rsplit("e.g. ", 1)[1].rstrip(".").split()
    assert fix != list(given[1:]), line  # not the same input
    spec = spec_for("parallel=pp", *fix)
    assert sum(spec.layout.layer_split) == spec.model.n_layers


def test_zb_h1_advice_names_the_framework_that_estimates_it():
    problems = _refused("parallel=pp", "parallel.schedule=zb_h1", "parallel.virtual_stages=1")
    assert any("run.mode=estimate framework=megatron_zb estimates it" in p for p in problems), problems
    assert not any(p.endswith("or framework=xpar.") for p in problems), problems  # the framework in use
    spec = spec_for("parallel=pp", "parallel.schedule=zb_h1", "parallel.virtual_stages=1", "run.mode=estimate",
                    "framework=megatron_zb")
    assert spec.mode == "estimate" and spec.layout.schedule == "zb_h1"


@pytest.mark.slow
def test_torchrun_layout_mismatch_is_said_once(tmp_path):
    """torchrun --nproc-per-node 3 with dp=2: xpar's refusal once (rank 0), the root cause exit code 2.
    torchrun itself then exits 1 and prints its ChildFailedError summary for any child's non-zero exit
    (torch.distributed.run: not xpar's to silence)."""
    import os
    import shutil
    import subprocess
    import sys

    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or "torchrun"
    r = subprocess.run([torchrun, "--nproc-per-node", "3", "-m", "xpar", "tracking=off", "parallel.dp=2"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=240)
    out = r.stdout + r.stderr
    assert r.returncode != 0
    assert out.count("xpar: invalid configuration:") == 1, out[-3000:]
    assert out.count("dp*tp*pp must equal the world size") == 1 and "exitcode  : 2" in out, out[-3000:]


@pytest.mark.slow
def test_etp_and_imbalance_exit_2_on_the_command_line(tmp_path):
    r = _xpar("model=mixtral_8x7b", "hardware=h100_80gb_64gpu", "run.mode=estimate", "parallel.ep=8",
              "parallel.etp=-1", "model.moe_imbalance=inf", cwd=tmp_path, timeout=200)
    assert r.returncode == 2
    lines = _refusal_lines(r.stderr)
    assert "  - parallel.etp must be an integer >= 1, or null, got -1; e.g. parallel.etp=null." in lines, lines
    assert "  - model.moe_imbalance must be a finite number >= 1, got inf; e.g. model.moe_imbalance=1.0." in lines, lines
    assert not (tmp_path / "mlflow.db").exists()  # refused before anything is recorded
