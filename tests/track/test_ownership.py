"""Every run owns its folder and every record tells the truth (issue 40): a run's folder is claimed
atomically and another run's is refused before Hydra writes into it; two sweeps at once keep their
own state; ``xpar sync`` only adds what is missing; an inherited MLFLOW_RUN_ID hijacks nothing; no
traceback for a foreign store file or a damaged journal. The process tests start real processes
together (``@pytest.mark.slow``)."""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

from xpar.track.run_dir import MARKER, claim, claim_new, held_by_another, refusal

ONE = ["hardware.devices_per_node=1", "train.warmup_steps=1", "run.progress=false"]


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("XPAR_RUN_DIR", "MLFLOW_RUN_ID", "XPAR_SWEEP_FILE")}
    env.update(HYDRA_FULL_ERROR="0", **extra)
    return env


def _start(cwd: Path, *args: str, **env) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "xpar", *args], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env(**env))


def _xpar(cwd: Path, *args: str, timeout: int = 300, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "xpar", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=_env(**env))


def _digest(folder: Path) -> dict:
    """Every file under ``folder`` by relative path: its bytes' sha256."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _client(cwd: Path):
    import mlflow
    return mlflow.tracking.MlflowClient(f"sqlite:///{cwd / 'mlflow.db'}")


def _run_state(client, run_id: str) -> tuple:
    """Everything a later process could change on a run: status, end, name, params, tags, every metric point."""
    run = client.get_run(run_id)
    history = {k: [(m.value, m.step, m.timestamp) for m in client.get_metric_history(run_id, k)]
               for k in run.data.metrics}
    return run.info.status, run.info.end_time, run.info.run_name, run.data.params, run.data.tags, history


def _journal_run_id(run_dir: Path) -> str:
    first = (run_dir / "tracking_journal.jsonl").read_text().splitlines()[0]
    return json.loads(first)["run_id"]


# -- fast: the claim itself ---------------------------------------------------------------------
def test_a_folder_is_claimed_once_and_the_default_takes_a_suffix(tmp_path):
    now = datetime(2026, 12, 6, 12, 0, 40)
    first, second = claim_new(tmp_path / "outputs", now), claim_new(tmp_path / "outputs", now)
    assert (first.name, second.name) == ("12-00-40", "12-00-40-2")  # the same second, two folders
    assert json.loads((first / MARKER).read_text())["pid"] == os.getpid()
    assert claim(first) is None  # this process's own folder
    (first / MARKER).write_text(json.dumps({"host": "elsewhere", "pid": 1}))
    why = claim(first)
    assert why is not None and "pid 1 on elsewhere" in why
    line = refusal("hydra.run.dir", str(first), first, why)
    assert f"hydra.run.dir={first}-3." in line and not Path(f"{first}-3").exists()  # a free folder (-2 is taken)
    old = tmp_path / "old_run"  # a run folder of an earlier xpar (no claim): its journal or checkpoints
    (old / "checkpoints" / "step_0000005").mkdir(parents=True)
    (old / "checkpoints" / "step_0000005" / "xpar.json").write_text("{}")
    assert "checkpoints/step_0000005" in held_by_another(old) and claim(old) is not None
    assert not (old / MARKER).exists()  # a refused folder is not written
    (tmp_path / "steps_only" / "steps").mkdir(parents=True)
    assert claim(tmp_path / "steps_only") is None  # an empty or unrelated folder is taken


@pytest.mark.parametrize("text", ["", "garbage\n", "5\n", '{"ack": [1]}\n', '[1, 2]\n{"seq": "x", "kind": 3}\n',
                                  b"\xff\xfe", b'{"ack": 0}\n\xff{"seq": 0}\n'])
def test_sync_of_an_empty_or_damaged_journal_is_one_line(tmp_path, capsys, text):
    from xpar.track.journal import Journal
    from xpar.track.recorder import sync

    journal = tmp_path / "tracking_journal.jsonl"
    journal.write_bytes(text) if isinstance(text, bytes) else journal.write_text(text)  # bytes: not UTF-8
    assert Journal(tmp_path).pending() == []  # read without TypeError/IndexError
    assert sync(tmp_path) == 2
    err = capsys.readouterr().err
    assert "names no run" in err and "Traceback" not in err


def test_sync_to_a_server_that_is_down_is_one_short_line(tmp_path, capsys):
    """xpar sync with the server still down printed two lines: the live run's warning ('... retried while the run
    lasts': no run lasts) and the refusal, each with MLflow's 'API request to ... failed with exception
    HTTPConnectionPool(...): Max retries exceeded with url: ...' cut mid-URL. Now one line with the socket's reason."""
    from xpar.run.launch import free_port
    from xpar.track.journal import Journal
    from xpar.track.recorder import sync

    uri = f"http://127.0.0.1:{free_port()}"
    j = Journal(tmp_path)
    j.ack(j.append("start", uri=uri, run_id="0" * 32, world=0, pid=os.getpid()))
    j.append("metrics", points=[["train/loss", 1.5, 1, 0]])
    assert sync(tmp_path) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "retried while the run lasts" not in err, err
    assert f"xpar: the tracking store at {uri} still fails (MlflowException: no server answers ([Errno 111] " \
           f"Connection refused)); 1 record(s) kept in" in err, err


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_sync_help_prints_usage_not_a_missing_journal(capsys, flag):
    from xpar.__main__ import _sync
    assert _sync([flag]) == 0
    out = capsys.readouterr()
    assert out.out.startswith("usage: xpar sync <run dir>") and "no tracking journal" not in out.err


def _store_with_run(tmp_path: Path, status: str):
    """A SQLite store with one run ended ``status`` and a journal (of a process that is gone) that
    holds a metric point the store has not taken and no end record (a kill -9, a full disk)."""
    import mlflow

    from xpar.track.journal import Journal
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = mlflow.tracking.MlflowClient(uri)
    exp = client.create_experiment("xpar", artifact_location=(tmp_path / "art").as_uri())
    run = client.create_run(exp)
    if status != "RUNNING":
        client.set_terminated(run.info.run_id, status)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    j = Journal(tmp_path / "run")
    j.ack(j.append("start", uri=uri, run_id=run.info.run_id, world=0, pid=gone.pid))
    j.append("metrics", points=[["train/loss", 1.5, 1, 0]])
    return client, run.info.run_id


@pytest.mark.slow
@pytest.mark.parametrize("status,after", [("KILLED", "KILLED"), ("FINISHED", "FINISHED"), ("FAILED", "FAILED"),
                                          ("RUNNING", "KILLED")])
def test_sync_only_adds_what_is_missing(tmp_path, capsys, status, after):
    """A status the journal never saw is not invented: KILLED stays KILLED, FINISHED stays FINISHED
    (a full disk under the run folder once flipped a FINISHED run to FAILED); a run still RUNNING
    whose process is gone ends KILLED; the missing point is delivered."""
    from xpar.track.recorder import sync

    client, run_id = _store_with_run(tmp_path, status)
    assert sync(tmp_path / "run") == 0, capsys.readouterr().err
    run = client.get_run(run_id)
    assert run.info.status == after and run.data.metrics == {"train/loss": 1.5}


# -- fast: xpar compare reads and never writes -----------------------------------------------------
def test_compare_refuses_a_file_that_is_no_mlflow_store_and_leaves_it_as_it_was(tmp_path, capsys):
    from xpar.track.compare import main

    empty, text, other = tmp_path / "empty.db", tmp_path / "notes.db", tmp_path / "other.db"
    empty.write_bytes(b"")
    text.write_text("not a database\n" * 10)
    import sqlite3
    con = sqlite3.connect(other)
    con.execute("CREATE TABLE t (x)")
    con.commit()
    con.close()
    before = _digest(tmp_path)
    for f, why in ((empty, "is empty"), (text, "is not an SQLite file"), (other, "without MLflow's tables")):
        assert main(["--uri", f"sqlite:///{f}", "--out", str(tmp_path / "cmp")]) == 2
        err = capsys.readouterr().err
        assert why in err and "is no MLflow tracking store" in err and "Traceback" not in err
    assert _digest(tmp_path) == before  # no command writes a file it was only asked to read


@pytest.mark.parametrize("form", ["{}", "file://{}"])
def test_compare_of_a_path_or_file_store_says_give_sqlite(tmp_path, capsys, form):
    """A plain path or a file:// store: one line naming the SQLite form
    that works (before: MLflow's file-store deprecation text, cut mid-sentence); nothing created."""
    from xpar.track.compare import main

    (tmp_path / "notes.txt").write_text("not a store\n")
    before = _digest(tmp_path)
    for target in (tmp_path / "notes.txt", tmp_path / "mlruns"):
        assert main(["--uri", form.format(target), "--out", str(tmp_path / "cmp")]) == 2
        err = capsys.readouterr().err
        assert "names no SQLite store" in err and "--uri sqlite:///mlflow.db" in err and "Traceback" not in err
        assert len(err.strip().splitlines()) == 1
    assert _digest(tmp_path) == before


@pytest.mark.slow  # integration-sized (conftest.INTEGRATION): runs in the full suite, not the fast loop
def test_compare_with_a_sweep_run_that_has_no_sweep_id(tmp_path, capsys, monkeypatch):
    """A sweep-role run without xpar.sweep_id (KeyError in compare before): no sweep to compare."""
    import mlflow

    from xpar.track.compare import main
    monkeypatch.chdir(tmp_path)
    client = mlflow.tracking.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.create_experiment("xpar", artifact_location=(tmp_path / "art").as_uri())
    client.set_terminated(client.create_run(exp, tags={"xpar.role": "sweep"}).info.run_id)
    assert main(["--out", str(tmp_path / "cmp")]) == 2
    err = capsys.readouterr().err
    assert "no sweep found in experiment 'xpar'" in err and "Traceback" not in err
    assert err.count("python -m xpar -m") == 1, err  # the advice once (it was given twice in one line)


def test_a_value_mlflow_refuses_gets_no_move_the_store_aside_advice(tmp_path):
    """A long experiment name on a healthy store: the advice names the value, not the store."""
    from xpar.track.runs import TrackingUnavailable, setup_experiment

    setup_experiment(None, "xpar", None, tmp_path)  # a healthy store
    with pytest.raises(TrackingUnavailable) as e:
        setup_experiment(None, "x" * 1000, None, tmp_path)
    assert "move it aside" not in str(e.value) and "tracking.experiment" in str(e.value)


# -- processes ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_two_runs_started_in_the_same_second_each_keep_their_own_folder_and_points(tmp_path):
    """Two default runs started together: two folders (one with a suffix), each journal naming its
    own run, each MLflow run with every one of its loss points."""
    steps = 5
    procs = [_start(tmp_path, f"train.steps={steps}", *ONE) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0 and "Traceback" not in err, err[-3000:]
    folders = sorted({p.parent for p in (tmp_path / "outputs").rglob("tracking_journal.jsonl")})
    assert len(folders) == 2, folders
    client = _client(tmp_path)
    run_ids = {_journal_run_id(f) for f in folders}
    assert len(run_ids) == 2
    for run_id in run_ids:
        assert sorted(m.step for m in client.get_metric_history(run_id, "train/loss")) == list(range(steps))
        assert client.get_run(run_id).info.status == "FINISHED"


@pytest.mark.slow
def test_another_runs_folder_is_refused_and_left_byte_identical(tmp_path):
    """A finished run with checkpoints; then XPAR_RUN_DIR reused (twice at once), and hydra.run.dir
    pointing at it with train.checkpoint_every=5: each refused with exit 2 in one line before any
    worker starts; the run's files and its MLflow run are unchanged; the suggested folder works."""
    pinned = tmp_path / "outputs" / "pinned"
    a = _xpar(tmp_path, "train.steps=10", "train.checkpoint_every=5", *ONE, XPAR_RUN_DIR=str(pinned))
    assert a.returncode == 0, a.stderr[-3000:]
    files, client = _digest(pinned), _client(tmp_path)
    assert any(k.startswith("checkpoints/step_") for k in files)
    run_id = _journal_run_id(pinned)
    state = _run_state(client, run_id)
    again = [_start(tmp_path, "train.steps=10", *ONE, XPAR_RUN_DIR=str(pinned)) for _ in range(2)]
    done = [p.communicate(timeout=120) for p in again]
    b = _xpar(tmp_path, f"hydra.run.dir={pinned}", "train.steps=10", "train.checkpoint_every=5", *ONE)
    for code, err in [(p.returncode, e) for p, (_, e) in zip(again, done)] + [(b.returncode, b.stderr)]:
        assert code == 2 and "is another run's folder" in err and "Traceback" not in err, err[-2000:]
        assert "Launching" not in err and err.count("\n") <= 3
    assert f"XPAR_RUN_DIR={pinned}-2" in done[0][1] and f"hydra.run.dir={pinned}-2" in b.stderr
    assert _digest(pinned) == files and _run_state(client, run_id) == state
    ok = _xpar(tmp_path, f"hydra.run.dir={pinned}-2", "train.steps=3", *ONE)  # the suggestion works
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert _journal_run_id(Path(f"{pinned}-2")) != run_id and _digest(pinned) == files


@pytest.mark.slow
def test_two_sweeps_at_once_both_finish_with_their_own_children(tmp_path):
    procs = [_start(tmp_path, "-m", f"train.steps=3,4", f"train.seed={seed}", *ONE) for seed in (1, 2)]
    outs = [p.communicate(timeout=400) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0 and "Traceback" not in err, err[-3000:]
    import mlflow
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = mlflow.search_runs(experiment_names=["xpar"])
    parents = runs[runs["tags.xpar.role"] == "sweep"]
    assert len(parents) == 2 and set(parents["status"]) == {"FINISHED"}
    seeds = set()
    for _, parent in parents.iterrows():
        kids = runs[runs["tags.mlflow.parentRunId"] == parent["run_id"]]
        assert len(kids) == 2 and set(kids["status"]) == {"FINISHED"}
        assert set(kids["tags.xpar.sweep_id"]) == {parent["tags.xpar.sweep_id"]}
        seed, = set(kids["params.train.seed"])  # both jobs of one sweep, none of the other's
        seeds.add(seed)
    assert seeds == {"1", "2"}
    sweep_files = sorted(p.name for p in (tmp_path / "multirun").rglob("xpar_sweep_*.json"))
    assert len(sweep_files) == 2


@pytest.mark.slow
def test_an_inherited_mlflow_run_id_leaves_that_run_unchanged(tmp_path):
    """MLFLOW_RUN_ID naming another run (mlflow#15713: xpar's data went into it and renamed it):
    ignored with one line; the other run is unchanged and xpar's run is its own."""
    import mlflow
    client = _client(tmp_path)
    exp = client.create_experiment("theirs", artifact_location=(tmp_path / "art").as_uri())
    theirs = client.create_run(exp, run_name="their run", tags={"owner": "them"}).info.run_id
    client.log_metric(theirs, "loss", 0.5, step=0)
    client.log_param(theirs, "lr", "0.1")
    client.set_terminated(theirs, "FINISHED")
    state = _run_state(client, theirs)
    r = _xpar(tmp_path, "train.steps=3", *ONE, MLFLOW_RUN_ID=theirs)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert f"ignoring MLFLOW_RUN_ID={theirs}" in r.stderr
    assert _run_state(client, theirs) == state
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    ours = mlflow.search_runs(experiment_names=["xpar"])
    assert len(ours) == 1 and ours.iloc[0]["run_id"] != theirs and ours.iloc[0]["status"] == "FINISHED"


@pytest.mark.slow
def test_after_a_kill_9_the_next_command_says_sync_and_sync_keeps_killed(tmp_path):
    run_dir = tmp_path / "run"
    p = subprocess.Popen([sys.executable, "-m", "xpar", "train.steps=2000", "run.allow_long=true",
                          f"hydra.run.dir={run_dir}", *ONE], cwd=tmp_path, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=_env(), start_new_session=True)
    steps, deadline = run_dir / "steps" / "rank0.jsonl", time.time() + 120
    while not (steps.exists() and steps.read_text().count("\n") >= 5):
        assert time.time() < deadline and p.poll() is None, p.communicate()
        time.sleep(0.05)
    os.killpg(p.pid, signal.SIGKILL)  # xpar and its worker, as a kill -9 of the job
    p.communicate(timeout=30)
    with open(steps, "a") as f:  # a step the worker wrote after the last delivery (not journaled)
        last = json.loads(steps.read_text().splitlines()[-1])
        f.write(json.dumps(dict(last, step=last["step"] + 1)) + "\n")
    run_id = _journal_run_id(run_dir)
    nxt = _xpar(tmp_path, "train.steps=2", *ONE)
    assert nxt.returncode == 0, nxt.stderr[-3000:]
    assert "ended KILLED" in nxt.stderr and f"xpar sync {run_dir}" in nxt.stderr, nxt.stderr[-3000:]
    client = _client(tmp_path)
    assert client.get_run(run_id).info.status == "KILLED"
    s = _xpar(tmp_path, "sync", str(run_dir), timeout=120)
    assert s.returncode == 0, s.stderr
    assert client.get_run(run_id).info.status == "KILLED"  # not FAILED
    losses = client.get_metric_history(run_id, "train/loss")
    assert max(m.step for m in losses) == last["step"] + 1  # every step the workers recorded


FULL_STORE = """
import runpy, sys
from mlflow.exceptions import MlflowException
from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

def full(*args, **kwargs):
    raise MlflowException("(raised as a result of Query-invoked autoflush)\\n(sqlite3.OperationalError) database or disk is full")

setattr(SqlAlchemyStore, sys.argv.pop(1), full)
sys.argv[0] = "xpar"
runpy.run_module("xpar", run_name="__main__", alter_sys=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("method,code", [("create_run", 2), ("log_batch", 1)])
def test_a_full_store_is_one_line_and_a_non_zero_exit(tmp_path, method, code):
    """The store's disk full (its writes raise as SQLite's do): at the run's start, one line and
    exit 2 before any worker; during the run, the run trains, exits 1 and says which `xpar sync`
    delivers the rest (24 MLflow/SQLAlchemy tracebacks and exit 0 before)."""
    r = subprocess.run([sys.executable, "-c", FULL_STORE, method, "train.steps=3", *ONE], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300, env=_env())
    assert r.returncode == code and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert "database or disk is full" in r.stderr
    if method == "create_run":
        assert "did not take a new run" in r.stderr and not list(tmp_path.glob("outputs/*/*/steps"))
    else:  # the store had the run's start and end, not its metrics: the advised sync adds them, status kept
        assert "xpar sync " in r.stderr and "NOT all recorded in MLflow" in r.stdout
        run_dir = Path(r.stderr.split("xpar sync ")[-1].split()[0])
        assert _xpar(tmp_path, "sync", str(run_dir), timeout=120).returncode == 0
        run = _client(tmp_path).get_run(_journal_run_id(run_dir))
        assert run.info.status == "FINISHED" and "fidelity/step_time_ratio" in run.data.metrics


def test_a_claim_on_a_full_disk_is_a_warning_and_an_uncreatable_folder_one_line(tmp_path, monkeypatch, capsys):
    """The claim's own file cannot be written (a full disk): one warning line, the run goes on
    unclaimed; the folder itself cannot be created: the refusal line names why."""
    import xpar.track.run_dir as run_dir
    from xpar.track import journal

    real = os.fdopen

    def full(fd, *a, **k):
        f = real(fd, *a, **k)
        f.write = lambda text: (_ for _ in ()).throw(OSError(28, "No space left on device"))
        return f
    monkeypatch.setattr(journal, "_WARNED", set())
    monkeypatch.setattr(run_dir.os, "fdopen", full)
    assert claim(tmp_path / "run") is None and not (tmp_path / "run" / MARKER).exists()
    assert "cannot write" in capsys.readouterr().err
    monkeypatch.setattr(run_dir.os, "fdopen", real)
    (tmp_path / "file").write_text("")
    extra, line = run_dir.claim_before_hydra([f"hydra.run.dir={tmp_path / 'file' / 'run'}"], tmp_path)
    assert extra == [] and "cannot be created" in line and "hydra.run.dir=<a folder with space>" in line


def test_compare_of_an_experiment_the_store_lacks_names_those_it_holds(tmp_path, capsys):
    """xpar compare --experiment nope said MLflow's 'Cannot retrieve experiment by name nope' and then 'no sweep
    found in experiment 'nope'', as if it were there and empty; now one line naming the store's experiments,
    the closest first, and following it finds the experiment."""
    from xpar.track.compare import main
    from xpar.track.runs import setup_experiment

    setup_experiment(None, "xpar", None, tmp_path)  # a store holding the experiment xpar
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert main(["--uri", uri, "--experiment", "xpr", "--out", str(tmp_path / "cmp")]) == 2
    err = capsys.readouterr().err
    assert "--experiment xpr names no experiment" in err and "experiments there: " in err, err
    assert "e.g. --experiment xpar." in err and "no sweep found" not in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert main(["--uri", uri, "--experiment", "xpar", "--out", str(tmp_path / "cmp")]) == 2
    assert "no sweep found in experiment 'xpar'" in capsys.readouterr().err  # the experiment is found (and empty)
