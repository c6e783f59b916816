"""Faults with real processes: the tracking server dies during a run (nothing logged is lost,
the run ends with its summary and exit 1, ``xpar sync`` delivers the rest with the final
status), and the step metrics carry their own timestamps."""
import psutil
import pytest
import json
import os
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

from tests.conftest import start_mlflow_server
from xpar.run.exits import ServerDied
from xpar.run.forkserver import end_orphans
from xpar.run.launch import free_port

STEPS = 40
ONE_WORKER = "hardware.devices_per_node=1"  # one worker where the fault is not a worker's: faster start


def _get(url: str, path: str, **query) -> dict:
    return json.loads(urllib.request.urlopen(f"{url}{path}?{urllib.parse.urlencode(query)}", timeout=30).read())


def _start_server(port: int, root: Path) -> subprocess.Popen:
    return start_mlflow_server(root, port)


def test_journal_merges_steps_incrementally_and_replays_what_was_not_acked(tmp_path):
    """Fast, no processes: complete step lines only, loss mean / time max over ranks, pending
    records survive a reload, and `xpar sync` refuses a folder without a journal."""
    from xpar.track.journal import Journal, StepMerger, StepWriter
    from xpar.track.recorder import sync

    w0, w1 = StepWriter(tmp_path, 0), StepWriter(tmp_path, 1)
    merger = StepMerger(tmp_path, 2)
    w0(0, 2.0, 0.1)
    assert merger.new_steps(0) == []  # rank 1 has not finished step 0
    w1(0, 4.0, 0.3)
    w0(1, 1.0, 0.1)
    with open(tmp_path / "steps" / "rank1.jsonl", "a") as f:
        f.write('{"step": 1, "loss": 3.0, "ti')  # a line being written
    (step, loss, seconds, ts, grad_norm, lr, live), = merger.new_steps(0)
    assert (step, loss, seconds, grad_norm, lr, live) == (0, 3.0, 0.3, None, None, None) and ts > 0
    with open(tmp_path / "steps" / "rank1.jsonl", "a") as f:
        f.write('me_s": 0.2, "ts_ms": 5}\n')
    assert [s[:3] for s in merger.new_steps(1)] == [(1, 2.0, 0.2)]
    w0(2, 1.0, 0.1, live={"step/tokens_per_s": 100.0, "step/memory_rss_bytes": 5.0})
    w1(2, 1.0, 0.2, live={"step/tokens_per_s": 50.0, "step/memory_rss_bytes": 9.0})
    (*_, live), = merger.new_steps(2)
    assert live == {"step/memory_rss_bytes": 9.0, "step/tokens_per_s": 50.0}  # the most loaded rank's, the slowest's
    j = Journal(tmp_path)
    a, b = j.append("metrics", points=[["train/step_time_s", 0.3, 1, 0]]), j.append("end", status="FINISHED", end_ms=1)
    j.ack(a)
    again = Journal(tmp_path)
    assert [r["seq"] for r in again.pending()] == [b["seq"]] and again.steps_journaled() == 1
    assert sync(tmp_path / "elsewhere") == 2


@pytest.mark.slow
def test_watchdog_names_the_oldest_live_heartbeat(tmp_path):
    """Fast: the rank whose heartbeat is oldest beyond the timeout is named with its process
    state; a rank whose process has exited is left to its exit code."""
    from xpar.run.launch import stalled_rank

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    d = tmp_path / "heartbeat"
    d.mkdir()
    now = time.time()
    for rank, pid, t in ((0, os.getpid(), now - 1), (1, os.getpid(), now - 40), (2, gone.pid, now - 99)):
        (d / f"rank{rank}.json").write_text(json.dumps({"pid": pid, "t": t}))
        os.utime(d / f"rank{rank}.json", (t, t))  # a beat also touches the file (a full disk: only that)
    assert stalled_rank(tmp_path, 60, now) is None
    rank, why = stalled_rank(tmp_path, 30, now)
    assert rank == 1 and "no heartbeat for 40 s" in why and f"pid {os.getpid()} state R" in why


@pytest.mark.slow
def test_server_down_at_the_end_exit_1_then_sync(tmp_path):
    port, root = free_port(), tmp_path / "server"
    root.mkdir()
    server = _start_server(port, root)
    url = f"http://127.0.0.1:{port}"
    try:
        _server_dies_then_sync(url, server, port, root, tmp_path)
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)


def _server_dies_then_sync(url, server, port, root, tmp_path):
    run_dir = tmp_path / "run"
    xpar = subprocess.Popen([sys.executable, "-m", "xpar", f"tracking.uri={url}", f"train.steps={STEPS}", ONE_WORKER,
                             "train.warmup_steps=1", "run.progress=false", f"hydra.run.dir={run_dir}"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    steps_file = run_dir / "steps" / "rank0.jsonl"
    deadline = time.time() + 120
    while not steps_file.exists() or steps_file.read_text().count("\n") < 2:  # training has begun
        assert time.time() < deadline and xpar.poll() is None, xpar.communicate()
        time.sleep(0.05)
    os.killpg(server.pid, signal.SIGKILL)  # the server dies while the workers train
    server.wait(30)
    killed_at = time.time()
    out, err = xpar.communicate(timeout=120)
    after_kill = time.time() - killed_at
    assert xpar.returncode == 1, err[-3000:]  # trained, but not all recorded: non-zero, with the sync line
    assert "tokens/s" in out and "Traceback" not in err, err[-3000:]
    assert f"xpar sync {run_dir}" in err, err[-3000:]
    assert "Recorded in MLflow" not in out and "NOT all recorded in MLflow:" in out, out[-2000:]
    assert "metric points" in out and "xpar sync" in out, out[-2000:]  # how many, and what to do
    assert after_kill < 30, after_kill  # training (~2 s) + bounded end, not MLflow's ~250 s of retries

    proc = _start_server(port, root)
    try:
        r = subprocess.run([sys.executable, "-m", "xpar", "sync", str(run_dir)], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, r.stderr
        run_id = json.loads(next(ln for ln in (run_dir / "tracking_journal.jsonl").read_text().splitlines()
                                 if '"start"' in ln))["run_id"]
        info = _get(url, "/api/2.0/mlflow/runs/get", run_id=run_id)["run"]["info"]
        assert info["status"] == "FINISHED"
        history = _get(url, "/api/2.0/mlflow/metrics/get-history", run_id=run_id, metric_key="train/loss")
        points = history.get("metrics", [])
        assert sorted(p["step"] for p in points) == list(range(STEPS))  # every step, once
        assert len({p["timestamp"] for p in points}) > STEPS // 2  # real step times, not one stamp
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)


def _sweep_runs(cwd: Path):
    import mlflow
    mlflow.set_tracking_uri(f"sqlite:///{cwd / 'mlflow.db'}")
    runs = mlflow.search_runs(experiment_names=["xpar"])
    parent = runs[runs["tags.xpar.role"] == "sweep"]
    assert len(parent) == 1
    return parent.iloc[0], runs[runs["tags.mlflow.parentRunId"] == parent.iloc[0]["run_id"]]


@pytest.mark.slow
def test_optuna_skipped_trial_is_failed_and_the_sweep_goes_on(tmp_path):
    """A skipped (invalid) trial is told to Optuna as FAIL (NaN crashed the sweeper), later
    trials run, grouped under one parent, and the parent's best job is one that finished. Random
    sampler with a fixed seed (the grid sampler may repeat a point whose trial failed: the test was
    random); a continuous parameter beside the discrete one, maximising (the sweeper's own direction).
    Its pre-flight of discrete choices: tests/track/test_sweep.py."""
    r = subprocess.run([sys.executable, "-m", "xpar", "-m", "hydra/sweeper=optuna", "hydra/sweeper/sampler=random",
                        "hydra.sweeper.sampler.seed=0", "hydra.sweeper.n_trials=4", "hydra.sweeper.n_jobs=1",
                        "hydra.sweeper.direction=maximize", "train.lr=interval(0.0001,0.01)",
                        "train.warmup_steps=choice(9,1)", "sweep.skip_invalid=true", "train.steps=3",
                        "run.progress=false", ONE_WORKER], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "skipping job" in r.stderr and "Traceback" not in r.stderr
    parent, kids = _sweep_runs(tmp_path)
    assert len(kids) >= 1 and set(kids["status"]) == {"FINISHED"} and set(kids["params.train.warmup_steps"]) == {"1"}
    assert kids["params.train.lr"].astype(float).between(0.0001, 0.01).all()
    assert parent["status"] == "FINISHED" and parent["tags.xpar.best_run_id"] in set(kids["run_id"])


def _ctrl_c_reaches_it() -> None:
    """In the child before exec: SIGINT handled as in a terminal's foreground job. A process
    started with SIGINT ignored keeps it ignored (Python installs no handler then): so does pytest
    launched in the background by a non-interactive shell (``nohup ... &``), and its children
    with it, where this test failed with exit 0, the sweep run to its end."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow
def test_ctrl_c_ends_the_sweep_parent_killed(tmp_path):
    sweep_dir = tmp_path / "mr"
    p = subprocess.Popen([sys.executable, "-m", "xpar", "-m", "train.steps=400,3", "train.warmup_steps=1", ONE_WORKER,
                          "run.progress=false", f"hydra.sweep.dir={sweep_dir}"], cwd=tmp_path,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_ctrl_c_reaches_it)
    steps = [sweep_dir / "0" / "steps" / "rank0.jsonl"]
    deadline = time.time() + 120
    while not all(f.exists() and f.read_text().count("\n") >= 3 for f in steps):  # 3 steps done
        assert time.time() < deadline and p.poll() is None, p.communicate()
        time.sleep(0.05)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130, out[-2000:] + err[-3000:]
    parent, kids = _sweep_runs(tmp_path)
    assert parent["status"] == "KILLED" and parent["tags.xpar.jobs_not_started"] == "1"
    assert list(kids["status"]) == ["KILLED"]
    assert kids.iloc[0]["metrics.train/loss"] > 0  # the steps before Ctrl-C are kept


@pytest.mark.slow
@pytest.mark.parametrize("after_s", [0.0, 0.3])
def test_ctrl_c_while_the_fork_server_imports_is_one_line(tmp_path, after_s):
    """Ctrl-C (SIGINT to the terminal's process group) while the fork server imports (the standard library's
    forkserver module at once: before the preload's quiet_server, its traceback seen under load; torch after
    0.3 s), before any worker runs: xpar's one line and exit 130; no traceback from the server, which shares
    the group."""
    p = subprocess.Popen([sys.executable, "-m", "xpar", "train.steps=200", "train.warmup_steps=1", ONE_WORKER,
                          "run.progress=false"], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, preexec_fn=_ctrl_c_reaches_it, start_new_session=True)
    deadline = time.time() + 60
    while not _fork_server_of(p.pid):
        assert time.time() < deadline and p.poll() is None, p.communicate()
        time.sleep(0.05)
    time.sleep(after_s)  # inside its imports
    os.killpg(p.pid, signal.SIGINT)
    out, err = p.communicate(timeout=60)
    # 130, or killed by SIGINT (a shell shows both as 130): CPython kills itself with SIGINT at its exit when it
    # counted a KeyboardInterrupt unhandled (Modules/main.c exit_sigint); strace showed xpar's process sending
    # itself SIGINT after xpar's line in 3 of 6 runs, xpar having caught the interrupt
    assert p.returncode in (130, -signal.SIGINT) and "Traceback" not in err, (p.returncode, err[-3000:])
    assert err.strip().splitlines() == ["xpar: interrupted; workers ended, the MLflow run (if any) ended KILLED."], err


def _fork_server_of(pgid: int) -> bool:
    """Whether process group ``pgid`` holds a fork server (xpar.run.forkserver)."""
    for d in Path("/proc").glob("[0-9]*"):
        try:
            group = int((d / "stat").read_text().rsplit(")", 1)[1].split()[2])
            if group == pgid and b"forkserver" in (d / "cmdline").read_bytes():
                return True
        except (OSError, IndexError, ValueError):
            continue
    return False


def _pids(run_dir: Path) -> dict:
    return {int(f.stem[4:]): json.loads(f.read_text())["pid"] for f in (run_dir / "heartbeat").glob("rank*.json")}


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "State:\tZ" not in state


def _start_and_wait(tmp_path: Path, run_dir: Path, *args, steps_done: int = 3):
    p = subprocess.Popen([sys.executable, "-m", "xpar", "train.steps=2000", "train.warmup_steps=1",
                          "run.progress=false", "run.allow_long=true", f"hydra.run.dir={run_dir}", *args],
                         cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    files = [run_dir / "steps" / f"rank{r}.jsonl" for r in (0, 1)]
    deadline = time.time() + 120
    while not all(f.exists() and f.read_text().count("\n") >= steps_done for f in files):
        assert time.time() < deadline and p.poll() is None, p.communicate()
        time.sleep(0.05)
    return p


def _last_run(cwd: Path):
    import mlflow
    mlflow.set_tracking_uri(f"sqlite:///{cwd / 'mlflow.db'}")
    run = mlflow.search_runs(experiment_names=["xpar"], order_by=["start_time DESC"]).iloc[0]
    history = mlflow.tracking.MlflowClient().get_metric_history(run["run_id"], "train/loss")
    return run, history


@pytest.mark.slow
def test_sigkilled_rank_stops_the_job_failed_with_metrics_kept(tmp_path):
    run_dir = tmp_path / "run"
    p = _start_and_wait(tmp_path, run_dir)
    pids = _pids(run_dir)
    os.kill(pids[1], signal.SIGKILL)
    t0 = time.time()
    out, err = p.communicate(timeout=60)
    assert time.time() - t0 < 30 and p.returncode == 1, err[-2000:]
    assert "worker rank 1 failed: killed by signal SIGKILL" in err
    run, history = _last_run(tmp_path)
    assert run["status"] == "FAILED"
    done = (run_dir / "steps" / "rank1.jsonl").read_text().count("\n")
    assert len(history) >= min(done, 3) and sorted(m.step for m in history) == list(range(len(history)))
    assert not any(_alive(pid) for pid in pids.values())


@pytest.mark.slow
def test_sigstopped_rank_is_named_within_60_s(tmp_path):
    run_dir = tmp_path / "run"
    p = _start_and_wait(tmp_path, run_dir, "run.heartbeat_timeout_s=5")
    pids = _pids(run_dir)
    os.kill(pids[1], signal.SIGSTOP)
    t0 = time.time()
    out, err = p.communicate(timeout=90)
    assert time.time() - t0 < 60 and p.returncode == 1, err[-2000:]
    assert "worker rank 1 failed: stopped progressing" in err and "T (stopped)" in err, err[-2000:]
    run, history = _last_run(tmp_path)
    assert run["status"] == "FAILED" and len(history) >= 3
    assert not any(_alive(pid) for pid in pids.values())


@pytest.mark.slow
def test_a_full_disk_is_a_warning_and_the_run_keeps_every_step(tmp_path):
    """A full disk under the run folder printed 9 tracebacks and recorded the run FINISHED with
    100 of 116 steps. The workers' step files here are folders, so they cannot be written (as on a
    full disk, where they fail with ENOSPC; /dev/full would hang the parent's reader): one warning
    line per worker, no traceback, and the run FINISHED with every step in MLflow (the steps come
    from the gathered stats at the end). Measured on a full 2 MiB tmpfs: the same."""
    import mlflow

    run_dir = tmp_path / "run"
    (run_dir / "steps").mkdir(parents=True)
    for rank in (0, 1):
        (run_dir / "steps" / f"rank{rank}.jsonl").mkdir()
    r = subprocess.run([sys.executable, "-m", "xpar", "train.steps=6", "train.warmup_steps=1", "run.progress=false",
                        f"hydra.run.dir={run_dir}"], cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.stderr.count("xpar: warning: cannot write") == 2, r.stderr[-3000:]  # one line per worker
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = mlflow.search_runs(experiment_names=["xpar"]).iloc[0]
    losses = mlflow.tracking.MlflowClient().get_metric_history(run["run_id"], "train/loss")
    assert run["status"] == "FINISHED" and sorted(h.step for h in losses) == list(range(6))


def test_journal_and_stats_survive_a_full_disk(tmp_path, capsys):
    """Fast: a journal whose file takes no write keeps its records in memory (and says so once);
    stats rank 0 could not write to the run folder are read from the temporary folder."""
    from pathlib import Path

    from xpar.run.launch import WorkerFailed, read_stats
    from xpar.run.worker_files import stats_fallback
    from xpar.track.journal import Journal

    j = Journal(tmp_path)
    j.path = Path("/dev/full")
    j.append("metrics", points=[["train/loss", 1.0, 1, 0]])
    assert len(j.pending()) == 1 and j.disk_error == "No space left on device"
    (tmp_path / "ranks.json").write_text("")  # cut short by the full disk
    stats_fallback(tmp_path).write_text('[{"rank": 0}]')
    assert read_stats(tmp_path) == [{"rank": 0}] and not stats_fallback(tmp_path).exists()
    try:
        read_stats(tmp_path)
    except WorkerFailed as e:
        assert "a full disk?" in str(e)
    else:
        raise AssertionError("no stats, no error")


def test_a_rank_that_only_saw_its_peer_die_is_not_blamed(tmp_path):
    """Fast: torch's join may report rank 0's "Connection closed by peer" first when rank 1 raised on
    purpose (gloo, seen in CI); the launcher blames the rank whose error is its own."""
    import pickle
    from types import SimpleNamespace

    from xpar.run.launch import _raised

    peer = "RuntimeError: [gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234"
    own = "Traceback ...\nRuntimeError: fault injection: run.fail_rank=1"
    files = []
    for rank, msg in enumerate([peer, own, None]):
        files.append(str(tmp_path / f"err{rank}"))
        Path(files[-1]).write_bytes(b"" if msg is None else pickle.dumps(msg))  # rank 2: empty, never raised
    ctx = SimpleNamespace(error_files=files)
    assert _raised(ctx, 0, peer) == (1, own)
    assert _raised(ctx, 1, own) == (1, own)  # its own error: kept as torch reported it
    ctx.error_files = [files[0], files[2]]
    assert _raised(ctx, 0, peer) == (0, peer)  # nobody else raised: the peer error is all there is


@pytest.mark.slow
def test_a_killed_fork_server_is_its_own_line_and_its_workers_end(tmp_path):
    """The fork server killed while its workers run: multiprocessing reports exit 255 for every worker; xpar says
    the server ended (not "worker rank 0 failed: exited with code 255" with a traceback that does not exist),
    exit 1, and no worker outlives the run."""
    run_dir = tmp_path / "run"
    p = _start_and_wait(tmp_path, run_dir)
    pids = _pids(run_dir)
    server = [c for c in psutil.Process(p.pid).children() if "multiprocessing.forkserver" in " ".join(c.cmdline())]
    assert len(server) == 1, server
    server[0].kill()
    out, err = p.communicate(timeout=60)
    assert p.returncode == 1 and "worker rank" not in err and "traceback in" not in err, err[-2000:]
    assert err.strip().splitlines()[-1] == f"xpar: {ServerDied.TEXT}", err[-2000:]
    assert not any(_alive(pid) for pid in pids.values())


@pytest.mark.slow
def test_end_orphans_kills_the_servers_command_lines_only():
    """A launcher that goes on after its server died (a sweep's next job) ends the workers by pid; a process that
    does not run the server's command line (a reused pid) is left alone."""
    forked = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "multiprocessing.forkserver"])
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        end_orphans([forked.pid, other.pid, 2**22 + 1])  # the last: no such process
        assert forked.wait(timeout=10) == -signal.SIGKILL and other.poll() is None
    finally:
        other.kill()
        other.wait()


def test_the_rendezvous_port_is_drawn_below_the_kernels_ephemeral_range():
    """free_port probed with port 0 (an ephemeral port, which gloo's own connections can take before rank 0 binds
    it: EADDRINUSE seen once in the suite); it now draws below ip_local_port_range, free when drawn."""
    import socket

    from xpar.run.launch import PORT_FLOOR, _ephemeral_floor, free_port
    for _ in range(20):
        port = free_port()
        assert PORT_FLOOR <= port < _ephemeral_floor()
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
