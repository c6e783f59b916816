"""A new SQLite tracking store starts as a copy of an empty one, migrated once per MLflow version.

MLflow builds a new SQLite store by running each of its Alembic migrations in turn
(``mlflow.store.db.utils._initialize_tables``: seconds of CPU, benchmarks/README.md), paid by every
first run in a directory and by every test that runs xpar in a fresh one. xpar migrates one
empty store per MLflow version into ``$XDG_CACHE_HOME/xpar/mlflow-<version>-empty.db`` (default
``~/.cache``) and copies it where a new store is wanted. The copy holds MLflow's tables and no
experiment: MLflow creates its 'Default' experiment (id 0, artifacts under ./mlruns) when it
first opens the store, as it does for a store it migrated itself. Anything that goes wrong falls
back to MLflow's own creation.
"""
from __future__ import annotations

import os
import shutil
import sqlite3
from pathlib import Path

from xpar.config.hardware import cache_dir


def template_path() -> Path:
    """``$XDG_CACHE_HOME/xpar/mlflow-<MLflow version>-empty.db`` (default ``~/.cache``), beside
    the CPU peak cache (:func:`xpar.config.hardware.cache_dir`)."""
    import mlflow

    return cache_dir() / f"mlflow-{mlflow.__version__}-empty.db"


def build_template(path: Path) -> None:
    """Migrate an empty store at ``path`` (MLflow's SqlAlchemyStore creates the tables and its
    'Default' experiment; the experiment is deleted so that each copy gets its own). Atomic: a
    concurrent builder's file is replaced whole, never read half-written."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        store = SqlAlchemyStore(f"sqlite:///{tmp}", str(path.parent / "mlruns"))
        store.engine.dispose()
        with sqlite3.connect(tmp) as con:
            con.execute("DELETE FROM experiment_tags")
            con.execute("DELETE FROM experiments")
        con.close()
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


def usable_template(path: Path) -> bool:
    """``path`` is an SQLite file that passes SQLite's quick check, at this MLflow's Alembic head
    revision and with no experiment (a truncated or foreign file is rebuilt, never copied)."""
    from mlflow.store.db.utils import _get_latest_schema_revision  # what MLflow checks on open (~30 ms)

    if not path.is_file():
        return False
    head = _get_latest_schema_revision()  # raises if MLflow's layout moved: the caller does not seed
    try:
        con = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
        try:
            ok = con.execute("PRAGMA quick_check").fetchone() == ("ok",)
            revisions = [r[0] for r in con.execute("SELECT version_num FROM alembic_version")]
            experiments = con.execute("SELECT count(*) FROM experiments").fetchone()[0]
        finally:
            con.close()
    except sqlite3.Error:
        return False
    return ok and revisions == [head] and experiments == 0


def seed_sqlite_store(db: Path) -> bool:
    """Create the missing SQLite store ``db`` as a copy of :func:`template_path` (built first if
    missing or not :func:`usable_template`); True when it did. Call it under
    :func:`xpar.track.runs.store_lock`. Never raises: on any error the store is left missing and
    MLflow creates it as usual."""
    if db.exists() or "?" in db.name or db.name == ":memory:":  # sqlite:///x.db?opt=..., in-memory: no file to seed
        return False
    tmp = db.with_name(f"{db.name}.{os.getpid()}.seed")
    try:
        template = template_path()
        if not usable_template(template):
            build_template(template)
        shutil.copyfile(template, tmp)
        tmp.replace(db)
        return True
    except Exception:  # unwritable cache, another MLflow layout: MLflow builds the store itself
        return False
    finally:
        tmp.unlink(missing_ok=True)
