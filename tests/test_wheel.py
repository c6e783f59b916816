"""The built wheel carries conf/ and composes from another directory."""
import pytest
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_installed_wheel_composes_from_another_directory(tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(wheels), str(ROOT)], check=True, capture_output=True, timeout=300)
    wheel = next(wheels.glob("xpar-*.whl"))
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
                    str(wheel)], check=True, capture_output=True, timeout=300)
    assert (target / "xpar" / "conf" / "model" / "70b.yaml").is_file()
    for init in (ROOT / "xpar").rglob("__init__.py"):  # every package of the tree ships (pyproject lists them)
        assert (target / init.relative_to(ROOT)).is_file(), init.relative_to(ROOT)
    assert (target / "xpar" / "conf" / "experiment" / "setup" / "small_local.yaml").is_file()  # +experiment=zero_memory
    run_dir = tmp_path / "elsewhere"
    run_dir.mkdir()
    code = ("import xpar.config.presets as p, xpar.__main__ as m;"
            "from hydra import compose, initialize_config_dir;"
            "initialize_config_dir(config_dir=str(p.conf_dir()), version_base=None);"
            "c = compose(config_name='config', overrides=['parallel=zero3', 'model=70b']);"
            "print(p.conf_dir()); print(c.model.n_layers, c.parallel.zero_stage)")
    env = dict(os.environ, PYTHONPATH=str(target))
    r = subprocess.run([sys.executable, "-c", code], cwd=run_dir, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    conf, shape = r.stdout.strip().splitlines()
    assert conf.startswith(str(target)) and shape == "80 3"
    # the console entry composes the same way (a bad preset is refused from the wheel's tree)
    r = subprocess.run([sys.executable, "-m", "xpar", "parallel=zero3", "model=70b", "model.n_kv_heads=7"],
                       cwd=run_dir, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "n_kv_heads" in r.stderr, r.stderr
