"""The MLflow UI as a first-time user sees it: a 2-job sweep into ./mlflow.db, `mlflow server`
on 127.0.0.1 over that store, and the README's experiment page loaded in headless Chromium
(Debian package `chromium`; .ci/run installs it). The DOM must hold the runs table (not the
GenAI overview) with the sweep parent and the children's layout names.

MLflow 3.17's UI picks the GenAI or the model-training view from its global switch (URL
parameter ``workflowType``, else the browser's localStorage, default GenAI); older 3.x read the
experiment tag ``mlflow.experimentKind``, which xpar also sets. Children are nested under their
parent unless the table is sorted or filtered (``orderByKey``), as in the README's second link.

The sweep runs through submitit's local executor with 4 tasks per job (one process start-up
paid for two checks): each job's 4 tasks are the 4 ranks of ONE xpar job (xpar.config.cluster), so
the store holds one child run per job, world size 4, tagged launcher submitit-local.
"""
import os
import re
import shutil
import subprocess
import sys

import mlflow
import pytest

from tests.conftest import start_mlflow_server
from xpar.run.launch import free_port

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ui(tmp_path_factory):
    """(UI base URL, experiment id, store dir, the sweep's console output) after a 2-job sweep."""
    cwd = tmp_path_factory.mktemp("ui")
    r = subprocess.run([sys.executable, "-m", "xpar", "-m", "hydra/launcher=submitit_local",
                        "hydra.launcher.tasks_per_node=4", "parallel.micro_batches=1,2", "train.steps=2",
                        "train.warmup_steps=1", "run.progress=false"], cwd=cwd, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    port = free_port()
    proc = start_mlflow_server(cwd, port, store=cwd / "mlflow.db")
    url = f"http://127.0.0.1:{port}"
    try:
        mlflow.set_tracking_uri(f"sqlite:///{cwd / 'mlflow.db'}")
        yield url, mlflow.get_experiment_by_name("xpar").experiment_id, cwd, r.stdout + r.stderr
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(30)


def page_text(url: str) -> str:
    """The rendered page as text: Chromium's DOM dump (the UI renders only with a virtual
    time budget), scripts and tags stripped."""
    out = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                          "--virtual-time-budget=20000", "--dump-dom", url],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-1000:]
    text = re.sub(r"<script.*?</script>|<style.*?</style>", "", out.stdout, flags=re.S)
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", text))


def test_the_readme_link_opens_the_runs_table_with_the_childrens_names(ui):
    url, exp, _, _ = ui
    runs = mlflow.search_runs(experiment_ids=[exp])
    parent = runs[runs["tags.xpar.role"] == "sweep"].iloc[0]
    assert mlflow.get_experiment(exp).tags["mlflow.experimentKind"] == "custom_model_development"
    opened = page_text(f"{url}/#/experiments/{exp}/runs?workflowType=machine_learning")
    assert "Run Name" in opened and parent["tags.mlflow.runName"] in opened  # the runs table, parent on top
    assert "Detect Issues" not in opened and "Token Usage" not in opened  # not the GenAI overview
    flat = page_text(f"{url}/#/experiments/{exp}/runs?workflowType=machine_learning"
                     "&orderByKey=attributes.run_name&orderByAsc=true")
    assert "micro_batches=1·tiny·dp4 #0" in flat and "micro_batches=2·tiny·dp4 #1" in flat, flat[:2000]


def test_runs_carry_names_descriptions_and_identifiers_as_tags(ui):
    _, exp, _, _ = ui
    runs = mlflow.search_runs(experiment_ids=[exp])
    kids = runs[runs["tags.xpar.role"] != "sweep"].sort_values("tags.xpar.job_num")
    assert list(kids["tags.mlflow.runName"]) == ["micro_batches=1·tiny·dp4 #0", "micro_batches=2·tiny·dp4 #1"]
    assert kids["tags.mlflow.note.content"].str.contains("measured on 4 cpu worker").all()
    assert (kids["tags.xpar.peak_rank"].str.fullmatch(r"\d+")).all()
    assert "metrics.memory/peak_rank" not in runs  # an identifier is not charted as a metric
    assert set(kids["status"]) == {"FINISHED"} and len(kids) == 2  # one run per job, not one per task
    parent = runs[runs["tags.xpar.role"] == "sweep"]
    assert len(parent) == 1 and parent.iloc[0]["status"] == "FINISHED"  # submitit's jobs grouped under one parent
    assert parent.iloc[0]["tags.xpar.best_run_id"] in set(kids["run_id"])
    assert set(kids["tags.mlflow.parentRunId"]) == {parent.iloc[0]["run_id"]}
    assert set(kids["params.parallel.dp"]) == {"4"}  # the job's world: its 4 tasks, one rank each
    assert set(kids["tags.xpar.launcher"]) == {"submitit-local"} and set(kids["tags.xpar.nodes"]) == {"1"}
    assert set(kids["tags.xpar.devices_per_node"]) == {"4"}  # 4 tasks on the one node


def test_the_printed_run_link_opens_the_run_with_its_metrics(ui):
    """The link each run prints (xpar.track.naming.ui_hint) lands on the run's page, its metrics
    listed, in the model-training frame: the breadcrumb reads "Runs" and the sidebar has the model
    registry, where the GenAI frame shows an "Evaluations" breadcrumb and its Judges and Sessions."""
    from xpar.track.naming import ui_hint
    url, exp, _, _ = ui
    runs = mlflow.search_runs(experiment_ids=[exp])
    kid = runs[runs["tags.xpar.role"] != "sweep"].iloc[0]
    link = ui_hint("sqlite:///mlflow.db", exp, kid["run_id"]).split("then ")[-1]
    assert link.endswith("?workflowType=machine_learning")
    opened = page_text(link.replace("http://127.0.0.1:5000", url))
    assert kid["tags.mlflow.runName"] in opened and "throughput/tokens_per_s" in opened, opened[:3000]
    assert "Detect Issues" not in opened and "Token Usage" not in opened
    assert "Evaluations" not in opened and "Judges" not in opened, opened[:1500]  # not the GenAI frame
    assert f"xpar Runs {kid['tags.mlflow.runName']}" in opened and "Model registry" in opened, opened[:1500]


def test_the_sweep_prints_a_compare_url_that_opens_its_children(ui):
    """The sweep's summary prints MLflow's compare page of its children
    (``#/compare-runs?runs=[...]&experiments=[...]``); loaded, it compares exactly those runs."""
    import json
    from urllib.parse import parse_qs, urlsplit
    url, exp, _, out = ui
    line = next(ln for ln in out.splitlines() if ln.startswith("compare in MLflow:"))
    link = line.split("then ")[-1]
    query = parse_qs(urlsplit(urlsplit(link).fragment).query)
    assert urlsplit(urlsplit(link).fragment).path == "/compare-runs" and json.loads(query["experiments"][0]) == [exp]
    runs = mlflow.search_runs(experiment_ids=[exp])
    kids = runs[runs["tags.xpar.role"] != "sweep"]
    assert sorted(json.loads(query["runs"][0])) == sorted(kids["run_id"])
    opened = page_text(link.replace("http://127.0.0.1:5000", url))
    assert "Comparing 2 Runs from 1 Experiment" in opened, opened[:2000]
    assert all(name in opened for name in kids["tags.mlflow.runName"]), opened[:3000]
