"""What a run prints when its output goes to a file (SLURM, nohup, a log): a step line every
``train.log_every`` steps, torchtitan's fields, and commands on one line each (issue 45)."""
import re
import subprocess
import sys

import pytest

from xpar.run.console import line_rank, step_line
from tests.conftest import spec_for

STEP = re.compile(r"^step: (\d+) loss: ([\d.]+) grad_norm: [\d.]+ memory: [\d.]+GiB\([\d.]+%\) tps: [\d,]+ "
                  r"tflops: [\d.]+ mfu: [\d.]+%$")


def test_the_step_line_has_torchtitans_fields():
    spec = spec_for("model=tiny", "parallel.dp=2")
    line = step_line(spec, 9, 7.8123, 1.2, 0.05)
    assert STEP.match(line) and line.startswith("step: 10 loss: 7.8123 grad_norm: 1.20"), line
    tps = spec.tokens_per_step / 0.05 / spec.world_size
    assert f"tps: {tps:,.0f}" in line


def test_the_line_is_printed_by_the_rank_that_sees_the_loss():
    assert line_rank(spec_for("model=tiny", "parallel.dp=2").layout) == 0
    pp = spec_for("model=tiny", "parallel.pp=2", "parallel.dp=1", "parallel.micro_batches=2")
    assert line_rank(pp.layout) == 1  # the last stage's rank computes the loss


@pytest.mark.slow
def test_a_run_into_a_file_prints_a_step_line_every_log_every_steps(tmp_path):
    log = tmp_path / "out.txt"
    with open(log, "w") as f:
        r = subprocess.run([sys.executable, "-m", "xpar", "train.steps=20", "train.log_every=5", "parallel.dp=2",
                            "run.progress=false"], cwd=tmp_path, stdout=f, stderr=subprocess.STDOUT, timeout=300)
    text = log.read_text()
    assert r.returncode == 0, text[-3000:]
    steps = [STEP.match(line) for line in text.splitlines() if line.startswith("step: ")]
    assert len(steps) >= 4 and all(steps), text[-3000:]
    assert [int(m.group(1)) for m in steps] == [5, 10, 15, 20]
    assert all(float(m.group(2)) > 0 for m in steps)
    last = re.search(r"loss first -> last\s*│\s*[\d.]+ -> ([\d.]+)", text)
    assert last and float(steps[-1].group(2)) == pytest.approx(float(last.group(1)), abs=2e-4), text[-3000:]  # dp mean, not rank 0's
    server = [line for line in text.splitlines() if "mlflow server" in line]
    gap = [line for line in text.splitlines() if line.startswith("NOT all recorded")]
    if gap:  # a loaded machine's store missed the 4 s end budget: the sync command instead, on one line
        assert re.search(r"send them with: xpar sync /\S+/\d\d-\d\d-\d\d$", gap[0]), gap
    else:
        assert len(server) == 1, text[-2000:]
        assert re.search(r"mlflow server .*--backend-store-uri sqlite:///\S+/mlflow.db, then http://127.0.0.1:5000/"
                         r"#/experiments/\d+/runs/\w+\?workflowType=machine_learning$", server[0]), server
    assert not any(line.startswith("calibrate hardware=local") for line in text.splitlines())  # the note's command whole
    run_log = next(tmp_path.glob("outputs/**/xpar.log")).read_text()
    assert sum(1 for line in run_log.splitlines() if STEP.match(line)) == 4  # the run's log file has them too
