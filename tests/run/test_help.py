"""`xpar --help` lists the config groups with their presets, the headline commands and where
runs are recorded (xpar.help), instead of Hydra's stock page."""
import pytest
import subprocess
import sys


@pytest.mark.slow
def test_help_lists_groups_presets_commands_and_the_store(tmp_path):
    r = subprocess.run([sys.executable, "-m", "xpar", "--help"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    for line in ("  model=  ", "  parallel=  ", "  hardware=  ", "  train=  ", "  data=  ", "  tracking=  ",
                 "  +experiment=  "):
        assert line in out, line
    assert "tiny*" in out and "mini" in out and "dp*" in out and "zero_memory" in out  # presets, default marked
    assert "python -m xpar -m parallel=pp parallel.micro_batches=1,2,4,8" in out  # the headline sweep
    assert "./mlflow.db" in out and "workflowType=machine_learning" in out  # where runs go, how to see them
    assert "Hydra" not in out.splitlines()[0] and not (tmp_path / "outputs").exists()  # nothing ran


@pytest.mark.slow
def test_plan_help_lists_every_plan_key_and_runs_nothing(tmp_path):
    """`xpar plan --help` (was Hydra's page): usage, examples, every plan.* key with its default
    and meaning from xpar.config.schema.PlanConfig."""
    import dataclasses

    from xpar.config.schema import PlanConfig
    from xpar.help import field_docs

    r = subprocess.run([sys.executable, "-m", "xpar", "plan", "model=7b", "--help"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    docs = field_docs(PlanConfig)
    for f in dataclasses.fields(PlanConfig):
        assert f"  plan.{f.name}=" in r.stdout and docs[f.name], f.name
    assert "Sequences per step" in r.stdout and "xpar plan model=175b hardware=a100_80gb_1024gpu" in r.stdout
    assert not (tmp_path / "outputs").exists() and not (tmp_path / "mlflow.db").exists()


@pytest.mark.slow
def test_help_pages_end_quietly_when_the_reader_stops_early(tmp_path):
    """`xpar help | head -1` and `xpar plan help | head -1`: no BrokenPipeError traceback when the
    reader is gone before the page is written (the pipe's read end closed at once)."""
    for args in (["help"], ["plan", "help"]):
        p = subprocess.Popen([sys.executable, "-m", "xpar", *args], cwd=tmp_path, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        p.stdout.close()  # the reader goes away before the child writes (it is still importing)
        err = p.stderr.read()
        assert p.wait(timeout=60) == 0 and "Traceback" not in err, (args, err)


def test_every_calibrate_option_says_what_it_does(capsys):
    """``xpar calibrate --help`` listed --name NAME and --out OUT with no word on what they set."""
    from xpar.calibrate.command import _args
    with pytest.raises(SystemExit):
        _args(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--name NAME the preset's name: conf/hardware/calibrated_NAME.yaml" in out, out
    assert "--out OUT folder for calibration.json" in out and "outputs/calibrate" in out, out


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version_names_xpar_and_the_packages_its_figures_rest_on(flag, monkeypatch, capsys):
    """`xpar --version` printed Hydra's 'Hydra 1.3.8' and nothing of xpar; it names xpar's version, torch,
    hydra-core and mlflow, and runs nothing."""
    import xpar
    from xpar import __main__ as entry

    monkeypatch.setattr(sys, "argv", ["xpar", flag])
    with pytest.raises(SystemExit) as e:
        entry._commands()
    out = capsys.readouterr().out
    assert e.value.code == 0 and out.startswith(f"xpar {xpar.__version__} (torch "), out
    assert "hydra-core " in out and "mlflow " in out and "Hydra 1." not in out, out
