"""A real `mlflow server` on 127.0.0.1: a 2-job sweep logs to it over HTTP, and the parent
and children are found with their metrics through the REST search API."""
import json
import os
import subprocess
import sys
import urllib.request

import pytest

from tests.conftest import start_mlflow_server
from xpar.run.launch import free_port


@pytest.fixture
def server(tmp_path):
    port = free_port()
    proc = start_mlflow_server(tmp_path, port)
    url = f"http://127.0.0.1:{port}"
    try:
        yield url
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(30)


def _search(url, experiment_id, filter_string):
    body = json.dumps({"experiment_ids": [experiment_id], "filter": filter_string}).encode()
    req = urllib.request.Request(f"{url}/api/2.0/mlflow/runs/search", data=body,
                                 headers={"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(req, timeout=30).read()).get("runs", [])


@pytest.mark.slow
def test_sweep_against_a_real_server(server, tmp_path):
    r = subprocess.run([sys.executable, "-m", "xpar", "-m", "parallel=dp,zero2", f"tracking.uri={server}",
                        "train.steps=3", "train.warmup_steps=1", "run.progress=false"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert not (tmp_path / "mlflow.db").exists()  # everything went to the server
    exp = json.loads(urllib.request.urlopen(f"{server}/api/2.0/mlflow/experiments/get-by-name?experiment_name=xpar",
                                            timeout=30).read())["experiment"]["experiment_id"]
    parents = _search(server, exp, "tags.`xpar.role` = 'sweep'")
    assert len(parents) == 1 and parents[0]["info"]["status"] == "FINISHED"
    pid = parents[0]["info"]["run_id"]
    kids = _search(server, exp, f"tags.`mlflow.parentRunId` = '{pid}'")
    assert len(kids) == 2
    for kid in kids:
        assert kid["info"]["status"] == "FINISHED"
        metrics = {m["key"]: m["value"] for m in kid["data"]["metrics"]}
        assert metrics["throughput/tokens_per_s"] > 0 and metrics["memory/peak_bytes_per_device"] > 0
    stages = sorted(p["value"] for k in kids for p in k["data"]["params"] if p["key"] == "parallel.zero_stage")
    assert stages == ["0", "2"]


def test_mlflow_prints_no_run_links_of_its_own(monkeypatch):
    """On a tracking server every run printed MLflow's '🏃 View run ... at: <url>' and '🧪 View experiment' twice
    above xpar's table (its end_run and xpar's journal each end the run), links without workflowType=machine_learning
    that open the GenAI view; xpar prints its own link. MLflow reads the switch at each run end."""
    from mlflow.environment_variables import MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT

    from xpar.track.recorder import bound_http

    monkeypatch.setenv("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "false")  # each restored after the test
    for name in ("MLFLOW_HTTP_REQUEST_TIMEOUT", "MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR"):
        monkeypatch.setenv(name, os.environ.get(name, "1"))
    assert not MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT.get()
    bound_http()
    assert MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT.get()
