"""End to end: `python -m xpar` writes one FINISHED MLflow run with what a user compares;
a failing worker stops the others and leaves a FAILED run; end statuses are honest."""
import json
import os
import subprocess
import sys

import mlflow
import pytest


def _xpar(cwd, *args, env=None, timeout=180):
    e = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-m", "xpar", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env=e)


def _runs(cwd):
    mlflow.set_tracking_uri(f"sqlite:///{cwd / 'mlflow.db'}")
    return mlflow.search_runs(experiment_names=["xpar"])


@pytest.mark.slow
def test_main_job_records_one_finished_run(tmp_path):
    r = _xpar(tmp_path, "train.steps=4", "train.warmup_steps=1")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "tokens/s (global)" in r.stdout and "Recorded in MLflow" in r.stdout
    runs = _runs(tmp_path)
    assert len(runs) == 1
    run = runs.iloc[0]
    assert run["status"] == "FINISHED"
    assert run["params.parallel.name"] == "dp" and run["params.model.name"] == "tiny"
    assert run["tags.xpar.mode"] == "execute"
    for m in ("throughput/tokens_per_s", "throughput/mfu", "memory/peak_bytes_per_device",
              "memory/activations_bytes", "throughput/tflops_per_device"):
        assert run[f"metrics.{m}"] > 0, m
    client = mlflow.tracking.MlflowClient()
    history = client.get_metric_history(run["run_id"], "train/loss")
    assert [h.step for h in history] == [0, 1, 2, 3]
    norms = client.get_metric_history(run["run_id"], "train/grad_norm")  # pre-clip global norm, per step
    assert [h.step for h in norms] == [0, 1, 2, 3] and all(h.value > 0 for h in norms)
    ranks = json.loads(open(client.download_artifacts(run["run_id"], "ranks.json", str(tmp_path))).read())
    assert [h.value for h in norms] == pytest.approx(ranks[0]["grad_norms"], rel=1e-12)
    lrs = client.get_metric_history(run["run_id"], "train/lr")  # the lr each step used
    assert [h.step for h in lrs] == [0, 1, 2, 3] and lrs[0].value == pytest.approx(float(run["params.train.lr"]))
    artifacts = {a.path for a in client.list_artifacts(run["run_id"])}
    assert {"config.yaml", "ranks.json", "step_split.png"} <= artifacts
    # measured communication (DDP's bucket all-reduce, from its logger) beside the estimate's bytes (issue 31)
    assert run["metrics.comm/dp_allreduce_bytes"] == run["metrics.fidelity/estimate_comm_dp_allreduce_bytes"] > 0
    assert run["metrics.time/compute_cpu_s"] > 0 and run["metrics.comm/dp_allreduce_calls"] >= 1
    local = client.download_artifacts(run["run_id"], "config.yaml", str(tmp_path))
    assert "zero_stage: 0" in open(local).read()
    assert (tmp_path / "mlartifacts").is_dir()  # artifacts beside the store, not in a temp dir
    logs = {p.name: p.stat().st_size for p in tmp_path.glob("outputs/*/*/*.log")}  # the job's and each worker's
    assert set(logs) == {"xpar.log", "worker_0.log", "worker_1.log"} and all(logs.values()), logs


@pytest.mark.slow
def test_failing_worker_stops_the_others_and_run_is_failed(tmp_path):
    r = _xpar(tmp_path, "train.steps=3", "train.warmup_steps=1", "run.fail_rank=1", timeout=120)
    assert r.returncode == 1
    assert "worker rank 1 failed" in r.stderr and "injected failure" in r.stderr
    assert "Traceback" not in r.stderr
    runs = _runs(tmp_path)
    assert list(runs["status"]) == ["FAILED"]
    assert _processes_in(tmp_path) == []  # no worker left behind


def _processes_in(cwd):
    """PIDs of live processes whose working directory is ``cwd`` (the workers inherit it)."""
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if os.readlink(f"/proc/{d}/cwd") == str(cwd):
                    pids.append(int(d))
            except OSError:
                pass
    return pids


@pytest.mark.slow
def test_interrupt_ends_run_killed_and_error_failed(tmp_path):
    from tests.conftest import spec_for
    from xpar.track.runs import mlflow_run

    spec = spec_for(f"tracking.uri=sqlite:///{tmp_path / 'm.db'}", "tracking.enabled=true")
    for exc, status in ((KeyboardInterrupt, "KILLED"), (ValueError, "FAILED")):
        with pytest.raises(exc):
            with mlflow_run(spec, {"a": {"b": 1}}, tmp_path):
                raise exc()
        run = mlflow.search_runs(experiment_names=["xpar"], order_by=["start_time DESC"]).iloc[0]
        assert run["status"] == status
        assert run["params.a.b"] == "1"


@pytest.mark.slow
def test_a_run_that_ends_early_keeps_its_config_log_and_tracebacks(tmp_path):
    """A FAILED or KILLED run reaches no log_report: its MLflow page held no artifact (no config.yaml,
    no worker traceback: a break-it user saw FAILED and the error tag only). The run folder's
    config.yaml, xpar.log and worker tracebacks go with it (xpar.track.runs.RUN_FILES)."""
    from tests.conftest import spec_for
    from xpar.track.runs import mlflow_run

    spec = spec_for(f"tracking.uri=sqlite:///{tmp_path / 'm.db'}", "tracking.enabled=true")
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'm.db'}")
    for exc in (KeyboardInterrupt, ValueError):
        out = tmp_path / exc.__name__
        out.mkdir()
        for name, text in (("config.yaml", "model:\n  name: tiny\n"), ("xpar.log", "step: 1 loss: 5.5\n"),
                           ("worker_1.traceback.txt", "Traceback: boom\n")):
            (out / name).write_text(text)
        with pytest.raises(exc):
            with mlflow_run(spec, {"a": 1}, tmp_path, out_dir=out) as run:
                raise exc()
        top = {a.path for a in client.list_artifacts(run.info.run_id)}
        logs = {a.path for a in client.list_artifacts(run.info.run_id, "logs")}
        assert "config.yaml" in top and logs == {"logs/xpar.log", "logs/worker_1.traceback.txt"}, (top, logs)
        text = client.download_artifacts(run.info.run_id, "logs/worker_1.traceback.txt", str(tmp_path))
        assert open(text).read() == "Traceback: boom\n"
    # Ctrl-C's one line names the killed run, what it kept and where (was 'the MLflow run (if any) ended KILLED')
    from xpar.__main__ import _killed_runs
    assert _killed_runs().endswith(f"ended KILLED with 0 step(s) recorded, its config and log kept "
                                   f"(run folder {tmp_path / 'KeyboardInterrupt'})"), _killed_runs()
    assert _killed_runs().startswith("MLflow run ") and "ValueError" not in _killed_runs()


def test_long_params_are_kept_within_mlflow_limits():
    from xpar.track.runs import MAX_PARAM_CHARS, flatten
    flat = flatten({"x": {"y": "z" * 10000, "l": [1, 2]}})
    assert len(flat["x.y"]) <= MAX_PARAM_CHARS and flat["x.y"].endswith("[truncated]")
    assert flat["x.l"] == "[1, 2]"


@pytest.mark.slow
def test_diverged_run_stops_failed_naming_the_step_and_skip_counts(tmp_path):
    """train.lr=1e30: step 0 is finite and its update makes every later loss NaN. Default
    (on_nonfinite=stop): exit 1, FAILED, one line naming step 1, its rank and the value. With
    skip (one worker): FINISHED, the 3 skipped steps counted, the run tagged diverged."""
    stop, skip = tmp_path / "stop", tmp_path / "skip"
    stop.mkdir(), skip.mkdir()
    r = _xpar(stop, "train.lr=1e30", "train.steps=4", "train.warmup_steps=1", timeout=120)
    assert r.returncode == 1, r.stderr[-2000:]
    assert "non-finite step 1: first on rank 0; loss nan" in r.stderr and "Traceback" not in r.stderr
    assert list(_runs(stop)["status"]) == ["FAILED"]
    r = _xpar(skip, "train.lr=1e30", "train.steps=4", "train.warmup_steps=1", "train.on_nonfinite=skip",
              "hardware.devices_per_node=1", timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "diverged: 3 of 4 steps" in " ".join(r.stdout.split())
    run = _runs(skip).iloc[0]
    assert run["status"] == "FINISHED" and run["tags.xpar.diverged"] == "true"
    assert run["metrics.train/skipped_steps"] == 3 and run["metrics.train/nonfinite_steps"] == 3


@pytest.mark.slow
def test_three_concurrent_first_runs_in_a_new_directory_are_all_recorded(tmp_path):
    """Three first runs started at once on a new SQLite store ran MLflow's migrations together:
    one succeeded, the others exited 2 ("duplicate column name") and the store was broken for
    every later run. Creation is serialised (xpar.track.runs.store_lock): all three finish. A fresh
    cache folder: the three also race to build the migrated empty store they copy (xpar.track.store_seed)."""
    args = [sys.executable, "-m", "xpar", "train.steps=2", "train.warmup_steps=1", "hardware.devices_per_node=1",
            "run.progress=false"]
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"))
    procs = [subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for _ in range(3)]
    outs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [o[1][-1500:] for o in outs]
    runs = _runs(tmp_path)
    assert len(runs) == 3 and set(runs["status"]) == {"FINISHED"}


def _wait_for_steps(run_dir, n, proc, timeout=120):
    import time
    steps = run_dir / "steps" / "rank0.jsonl"
    deadline = time.time() + timeout
    while not steps.exists() or steps.read_text().count("\n") < n:
        assert time.time() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.1)


@pytest.mark.slow
def test_kill_9_of_xpar_ends_its_workers_and_the_next_command_ends_the_run(tmp_path):
    """kill -9 of the parent left its run RUNNING and its workers training on as orphans. Now
    each worker ends itself within a heartbeat (1 s) of losing its parent, and the next xpar
    command in that directory ends the run KILLED, saying why."""
    import signal
    import time

    run_dir = tmp_path / "run"
    p = subprocess.Popen([sys.executable, "-m", "xpar", "train.steps=2000", "train.warmup_steps=1",
                          "train.log_every=2", "run.progress=false", f"hydra.run.dir={run_dir}"], cwd=tmp_path,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait_for_steps(run_dir, 10, p)
    time.sleep(1.5)  # the recorder delivers every 0.5 s
    workers = [pid for pid in _processes_in(tmp_path) if pid != p.pid]
    assert len(workers) >= 2, workers
    os.kill(p.pid, signal.SIGKILL)
    p.wait(10)
    deadline = time.time() + 10  # heartbeat 1 s; the rest is process exit on 2 busy cores
    while set(workers) & set(_processes_in(tmp_path)) and time.time() < deadline:
        time.sleep(0.2)
    assert not set(workers) & set(_processes_in(tmp_path)), "workers outlived xpar"
    assert list(_runs(tmp_path)["status"]) == ["RUNNING"]
    r = _xpar(tmp_path, "train.steps=2", "train.warmup_steps=1", "hardware.devices_per_node=1", "run.progress=false")
    assert r.returncode == 0 and "ended KILLED" in r.stderr, r.stderr[-2000:]
    runs = _runs(tmp_path).sort_values("start_time")
    assert list(runs["status"]) == ["KILLED", "FINISHED"]
    assert "was gone" in runs.iloc[0]["tags.xpar.ended_by"]
    live = mlflow.tracking.MlflowClient().get_metric_history(runs.iloc[0]["run_id"], "step/tokens_per_s")
    assert len(live) >= 3  # the live points logged before the kill are kept


@pytest.mark.slow
def test_a_killed_sweep_ends_its_parent_killed(tmp_path):
    """kill -9 of a sweep left its parent run RUNNING forever and the jobs that never started
    recorded nowhere. The next xpar command in that directory ends the parent and its running
    job KILLED, and counts the jobs that never started. (SIGTERM acts as Ctrl-C: see
    xpar.track.sweep._sigterm_interrupts.)"""
    import signal
    import time

    p = subprocess.Popen([sys.executable, "-m", "xpar", "-m", "train.steps=2000", "train.warmup_steps=1",
                          "run.progress=false", "hardware.devices_per_node=1", "train.seed=0,1,2"], cwd=tmp_path,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not list(tmp_path.glob("multirun/*/*/0/steps/rank0.jsonl")):
        assert time.time() < deadline and p.poll() is None, "the sweep's first job did not start"
        time.sleep(0.1)
    os.kill(p.pid, signal.SIGKILL)
    p.wait(10)
    r = _xpar(tmp_path, "train.steps=2", "train.warmup_steps=1", "hardware.devices_per_node=1", "run.progress=false")
    assert r.returncode == 0, r.stderr[-2000:]
    runs = _runs(tmp_path)
    parent = runs[runs["tags.xpar.role"] == "sweep"].iloc[0]
    assert parent["status"] == "KILLED" and parent["tags.xpar.jobs_not_started"] == "2", parent
    jobs = runs[runs["tags.mlflow.parentRunId"] == parent["run_id"]]
    assert list(jobs["status"]) == ["KILLED"]


@pytest.mark.slow
def test_a_run_beside_busy_processes_is_tagged_measured_under_contention(tmp_path):
    """Three spinning processes beside a 2-worker run take most of the cores: the workers' CPU
    share (schedstat over the timed steps) is logged, the run tagged xpar.contention and noted."""
    cores = len(os.sched_getaffinity(0))
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cores + 1)]
    try:
        r = _xpar(tmp_path, "train.steps=12", "train.warmup_steps=2", "run.progress=false")
    finally:
        for p in spinners:
            p.kill()
    assert r.returncode == 0, r.stderr[-2000:]
    run = _runs(tmp_path).iloc[0]
    assert run["metrics.system/workers_cpu_share"] < 0.8 * min(1.0, cores / 2)
    assert run["tags.xpar.contention"] == "true" and "measured under contention" in r.stdout


def test_contention_is_judged_against_what_the_workers_own_number_allows():
    """8 workers on 2 cores get a quarter of a core each without anyone else: no contention."""
    from types import SimpleNamespace

    from xpar.run.fidelity import contention
    spec = SimpleNamespace(train=SimpleNamespace(threads_per_worker=1))
    assert contention(spec, [{"cpu_share": 0.24}] * 8, cores=2) == (pytest.approx(0.24), None)
    share, note = contention(spec, [{"cpu_share": 0.1}] * 8, cores=2)
    assert note.startswith("measured under contention") and "8 worker(s) on 2 core(s) allow 25%" in note
    assert contention(spec, [{"memory": {}}], cores=2) == (None, None)  # a GPU run: no share measured


@pytest.mark.slow
def test_live_throughput_and_memory_every_log_every_steps(tmp_path):
    """50 steps at train.log_every=5: 10 points each of tokens/s, TFLOP/s, MFU and memory (RSS on a
    CPU) while the run goes (a killed run keeps those delivered: the kill -9 test)."""
    r = _xpar(tmp_path, "train.steps=50", "train.warmup_steps=1", "train.log_every=5", "run.progress=false")
    assert r.returncode == 0, r.stderr[-2000:]
    run_id = _runs(tmp_path).iloc[0]["run_id"]
    client = mlflow.tracking.MlflowClient()
    for key in ("step/tokens_per_s", "step/tflops_per_device", "step/mfu", "step/memory_rss_bytes"):
        points = client.get_metric_history(run_id, key)
        assert [p.step for p in points] == list(range(4, 50, 5)) and all(p.value > 0 for p in points), key


@pytest.mark.slow
@pytest.mark.parametrize("overrides, comm", [
    (("parallel.dp=1", "parallel.cp=2"), "comm/cp_allgather_bytes"),
    (("model=moe_tiny", "parallel.dp=2", "parallel.ep=2"), "comm/ep_all_to_all_bytes"),
])
def test_context_and_expert_parallel_main_jobs_are_recorded_and_equal_the_reference(tmp_path, overrides, comm):
    """Issue 30's two commands run as a user runs them: FINISHED in MLflow, their fidelity ratios and
    their axis's measured collective logged, and the logged loss of every step the single-process
    reference's (rel 1e-4)."""
    from tests.conftest import spec_for
    from xpar.run.reference import reference_run

    steps = ("train.steps=3", "train.warmup_steps=1")
    r = _xpar(tmp_path, *overrides, *steps)
    assert r.returncode == 0, r.stderr[-2000:]
    run = _runs(tmp_path).iloc[0]
    assert run["status"] == "FINISHED"
    for m in ("fidelity/step_time_ratio", "fidelity/peak_memory_ratio", comm):
        assert run[f"metrics.{m}"] > 0, m
    history = mlflow.tracking.MlflowClient().get_metric_history(run["run_id"], "train/loss")
    ref = reference_run(spec_for(*overrides, *steps))["losses"]
    assert [h.value for h in sorted(history, key=lambda h: h.step)] == pytest.approx(ref, rel=1e-4)
