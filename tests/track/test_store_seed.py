"""A new SQLite store copied from an empty one migrated once (xpar.track.store_seed) is the store
MLflow would have built, and seeding never stands between a run and its store."""
import sqlite3
from pathlib import Path

import mlflow
import pytest

from xpar.track import runs, store_seed


def _store(db):
    con = sqlite3.connect(db)
    try:
        tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        version = con.execute("SELECT version_num FROM alembic_version").fetchall()
        experiments = con.execute("SELECT experiment_id, name, artifact_location, lifecycle_stage FROM experiments "
                                  "ORDER BY experiment_id").fetchall()
    finally:
        con.close()
    return tables, version, experiments


@pytest.mark.slow  # integration-sized (conftest.INTEGRATION): runs in the full suite, not the fast loop
def test_a_seeded_store_is_the_store_mlflow_builds(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    seeded, built = tmp_path / "seeded", tmp_path / "built"
    seeded.mkdir(), built.mkdir()
    monkeypatch.chdir(seeded)
    runs.setup_experiment(None, "xpar", None, seeded)
    assert store_seed.template_path().exists() and _store(store_seed.template_path())[2] == []  # no experiment
    monkeypatch.chdir(built)
    monkeypatch.setattr(runs, "seed_sqlite_store", lambda db: False)  # MLflow migrates this one itself
    runs.setup_experiment(None, "xpar", None, built)
    (t1, v1, e1), (t2, v2, e2) = _store(seeded / "mlflow.db"), _store(built / "mlflow.db")
    assert t1 == t2 and v1 == v2 and len(t1) > 10
    assert [x[:2] + x[3:] for x in e1] == [x[:2] + x[3:] for x in e2] == [(0, "Default", "active"), (1, "xpar", "active")]
    assert e1[0][2] == str(seeded / "mlruns" / "0") and e2[0][2] == str(built / "mlruns" / "0")  # MLflow's own default
    mlflow.set_tracking_uri(f"sqlite:///{seeded / 'mlflow.db'}")
    with mlflow.start_run(experiment_id="1") as run:
        mlflow.log_metric("loss", 1.5)
    assert mlflow.get_run(run.info.run_id).data.metrics == {"loss": 1.5}


@pytest.mark.slow  # integration-sized (conftest.INTEGRATION): runs in the full suite, not the fast loop
def test_an_unusable_cache_leaves_the_store_to_mlflow(tmp_path, monkeypatch):
    (tmp_path / "cache").write_text("a file where the cache folder should be")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    assert store_seed.seed_sqlite_store(tmp_path / "mlflow.db") is False
    assert not (tmp_path / "mlflow.db").exists() and list(tmp_path.iterdir()) == [tmp_path / "cache"]
    assert runs.setup_experiment(None, "xpar", None, tmp_path) == "1"  # MLflow built it
    assert store_seed.seed_sqlite_store(tmp_path / "mlflow.db") is False  # an existing store is never replaced


@pytest.mark.slow  # integration-sized (conftest.INTEGRATION): runs in the full suite, not the fast loop
def test_a_damaged_template_is_rebuilt_not_copied(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    template = store_seed.template_path()
    template.parent.mkdir(parents=True)
    template.write_bytes(b"SQLite format 3\x00" + b"\x00" * 100)  # a truncated file
    assert not store_seed.usable_template(template)
    assert store_seed.seed_sqlite_store(tmp_path / "mlflow.db") is True
    assert store_seed.usable_template(template)  # rebuilt
    assert runs.setup_experiment(None, "xpar", None, tmp_path) == "1"


@pytest.mark.slow  # integration-sized (conftest.INTEGRATION): runs in the full suite, not the fast loop
def test_a_template_at_another_revision_is_rebuilt_not_copied(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    template = store_seed.template_path()
    store_seed.build_template(template)
    con = sqlite3.connect(template)
    con.execute("UPDATE alembic_version SET version_num = 'a_stale_revision'")  # a dev build's older template
    con.commit(), con.close()
    assert not store_seed.usable_template(template)
    assert runs.setup_experiment(None, "xpar", None, tmp_path) == "1"


@pytest.mark.slow  # integration-sized (conftest.INTEGRATION): runs in the full suite, not the fast loop
def test_plans_side_process_opens_a_new_store_from_the_template(tmp_path, monkeypatch):
    """xpar plan warms its store in a side process (xpar.track.runs.open_store): a new SQLite store there
    is a copy of the template too, and MLflow then reads it (its Default experiment added)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    copied = []
    real = runs.seed_sqlite_store
    monkeypatch.setattr(runs, "seed_sqlite_store", lambda db: copied.append(db) or real(db))
    runs.open_store(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert copied == [tmp_path / "mlflow.db"] and store_seed.template_path().exists()
    assert [x[1] for x in _store(tmp_path / "mlflow.db")[2]] == ["Default"]


def test_a_relative_xdg_cache_home_is_ignored(tmp_path, monkeypatch):
    """The XDG Base Directory spec: a relative $XDG_CACHE_HOME is invalid and ignored (~/.cache), so that
    runs started in different folders share one cache and never write a cache folder into the run's."""
    from xpar.config.hardware import cache_dir
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for value in ("cache", "./c", ""):
        monkeypatch.setenv("XDG_CACHE_HOME", value)
        assert cache_dir() == tmp_path / "home" / ".cache" / "xpar"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "abs"))
    assert cache_dir() == tmp_path / "abs" / "xpar"


def test_a_server_nobody_answers_at_is_one_short_line_with_the_command_that_serves_it(monkeypatch, caplog):
    """tracking.uri=http://127.0.0.1:<closed port> printed urllib3's 'Retrying ... NewConnectionError' warning and
    MLflow's HTTPConnectionPool text cut mid-word ("HTTPConnection(host='127.0.0.1', por."); now the socket's
    reason and the mlflow server line at that host and port."""
    import logging
    import socket

    from xpar.track.runs import TrackingUnavailable, setup_experiment
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    with socket.socket() as s:  # a port bound, never listened on: refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        with caplog.at_level(logging.WARNING), pytest.raises(TrackingUnavailable) as info:
            setup_experiment(f"http://127.0.0.1:{port}", "xpar", None, Path.cwd())
    text = str(info.value)
    assert "no server answers there" in text and "Connection refused" in text, text
    assert "HTTPConnectionPool" not in text and "NewConnectionError" not in text, text
    assert f"mlflow server --workers 1 --host 127.0.0.1 --port {port} " in text, text
    assert not [r for r in caplog.records if r.name.startswith("urllib3")], caplog.text
