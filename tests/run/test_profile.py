"""``train.profile=true``: a torch.profiler Chrome trace of the last steps, logged to MLflow (issue 45)."""
import json
import subprocess
import sys

import mlflow
import pytest


@pytest.mark.slow
def test_a_profiled_run_logs_a_chrome_trace_with_its_steps(tmp_path):
    r = subprocess.run([sys.executable, "-m", "xpar", "train.steps=4", "train.warmup_steps=1", "train.profile=true",
                        "parallel.dp=2", "run.progress=false"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = mlflow.search_runs(experiment_names=["xpar"]).iloc[0]
    names = {a.path for a in mlflow.MlflowClient().list_artifacts(run["run_id"], "profile")}
    assert names == {"profile/rank0_trace.json", "profile/rank1_trace.json"}, names
    local = mlflow.artifacts.download_artifacts(run_id=run["run_id"], artifact_path="profile/rank0_trace.json",
                                                dst_path=str(tmp_path / "dl"))
    events = json.load(open(local))["traceEvents"]
    spans = [e for e in events if e.get("name", "").startswith("ProfilerStep#") and e.get("ph") == "X"]
    assert sorted(e["name"] for e in spans) == ["ProfilerStep#2", "ProfilerStep#3"]  # the last 2 steps, a span each
    for span in spans:  # the step's matmuls and its gradient all-reduce inside its span
        inside = [e["name"] for e in events if e.get("ph") == "X" and e.get("pid") == span["pid"]
                  and span["ts"] <= e["ts"] <= span["ts"] + span["dur"]]
        assert "aten::mm" in inside and any("allreduce" in n.lower() for n in inside), span
    ops = {e.get("name") for e in events}
    assert any(n and n.startswith("aten::mm") for n in ops) and any(n and "allreduce" in n.lower() for n in ops), \
        sorted(n for n in ops if n)[:80]
    assert "torch.profiler" in r.stdout  # the note that the traced steps carry its overhead
