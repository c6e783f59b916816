"""`xpar calibrate`: this machine measured into a hardware preset that a run then uses."""
import json
import os
import subprocess
import sys

import mlflow
import pytest

from tests.conftest import spec_for


def test_alpha_beta_fit_recovers_the_model():
    """Timings made from t = steps * alpha + ring_bytes / beta give alpha and beta back."""
    from xpar.calibrate import fit_alpha_beta, ring_steps
    from xpar.estimate.comm import ring_factor

    alpha, beta, n = 25e-6, 3e9, 4
    timings = {c: {s: ring_steps(c, n) * alpha + (s if c == "send_recv" else ring_factor(c, n) * s) / beta
                   for s in (2 ** 10, 2 ** 16, 2 ** 22)} for c in ("allreduce", "allgather", "send_recv")}
    timings["reduce_scatter"] = {"unsupported": "not in this backend"}
    got = fit_alpha_beta(timings, n)
    assert got == pytest.approx((alpha, beta), rel=1e-6)


def test_matmul_efficiency_fit_is_the_cost_model_curve():
    from xpar.calibrate import fit_matmul_efficiency
    rates = {n: 1e11 * 0.8 * n / (n + 32) for n in (64, 256, 512)}
    assert fit_matmul_efficiency(rates, 1e11, 32) == pytest.approx(0.8)


def test_calibrate_writes_a_preset_that_runs_use(tmp_path):
    name = f"pytest_{os.getpid()}"
    r = subprocess.run([sys.executable, "-m", "xpar", "calibrate", "hardware=local", "--quick", "--name", name,
                        "--out", str(tmp_path / "cal")], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    from xpar.presets import conf_dir
    preset = conf_dir() / "hardware" / f"calibrated_{name}.yaml"
    try:
        assert r.returncode == 0, r.stderr[-2000:]
        assert f"hardware=calibrated_{name}" in r.stdout
        raw = json.loads((tmp_path / "cal" / "calibration.json").read_text())
        assert set(raw["collectives"]) == {"allreduce", "allgather", "reduce_scatter", "send_recv"}
        assert raw["alpha_s"] >= 0 and raw["beta_bytes_per_s"] > 0
        spec = spec_for(f"hardware=calibrated_{name}")  # validates and resolves with the measured figures
        assert spec.mode == "execute"
        assert spec.hardware.peak_tflops == pytest.approx(raw["preset"]["peak_tflops"])
        assert spec.hardware.intra_node_gb_per_s == pytest.approx(raw["beta_bytes_per_s"] / 1e9)
        from xpar.estimate.cost import peak_memory  # memory is the local preset's: no CUDA context on a CPU
        assert peak_memory(spec).total == pytest.approx(peak_memory(spec_for("hardware=local")).total, rel=1e-9)
        mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
        runs = mlflow.search_runs(experiment_names=["xpar"])
        assert list(runs["tags.xpar.mode"]) == ["calibrate"]
    finally:
        preset.unlink(missing_ok=True)


def test_calibrate_refuses_another_machine(tmp_path):
    r = subprocess.run([sys.executable, "-m", "xpar", "calibrate", "hardware=a100_80gb_8gpu"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "measures this machine" in r.stderr and "Traceback" not in r.stderr
