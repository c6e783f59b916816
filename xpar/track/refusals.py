"""``xpar compare``'s refusals: one line and exit 2, within seconds, for a tracking store that
is missing or unreachable, an output folder that cannot be written, an MLflow filter the store
rejects and a sweep id that names no sweep (:func:`xpar.track.compare.main` calls these)."""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

from xpar.config.checks.environment import sqlite_path
from xpar.config.overrides import unwritable
from xpar.track.recorder import bound_http

HEALTH_TIMEOUT_S = 3
"""Seconds to wait for a tracking server's /health before refusing."""

FILTER_EXAMPLE = "--filter 'tags.`xpar.mode` = \"estimate\"'"
"""A filter a shell passes as written: backticks inside single quotes (inside double quotes bash ran
`xpar.mode` as a command, and the filter reached MLflow as "tags. = 'estimate'")."""


def refuse_compare(uri: str, out: Optional[str]) -> Optional[str]:
    """None, or why the store at ``uri`` or the folder ``out`` cannot be used (one line)."""
    bound_http()
    db = sqlite_path(uri)
    scheme = uri.partition("://")[0] if "://" in uri else ""
    if db is None and scheme in ("", "file", "sqlite"):  # a path or file store: MLflow 3 reads none here
        return (f"--uri {uri} names no SQLite store (xpar records into SQLite; a path or a file:// store is not "
                f"read); pass --uri sqlite:///<path of the .db>, e.g. --uri sqlite:///mlflow.db.")
    if db is not None and not db.is_file():
        return (f"no tracking store at {uri} (no file {db}); run xpar from this directory first, "
                f"or pass --uri <the store's URI>.")
    if db is not None and (why := not_an_mlflow_store(db)):
        return f"--uri {uri} is no MLflow tracking store ({why}); pass --uri <the store's URI>, e.g. sqlite:///mlflow.db."
    if uri.startswith(("http://", "https://")):
        import urllib.request
        try:
            urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=HEALTH_TIMEOUT_S)
        except Exception as e:  # refused, timed out, not a server
            return (f"the tracking server --uri {uri} does not answer ({type(e).__name__}: "
                    f"{str(e)[:120]}); start it, or give a reachable URI.")
    if out is not None:
        why = unwritable(Path(out))
        if why:
            return f"--out {out} cannot be written ({why}); give a writable folder, e.g. --out ./xpar_compare."
    return None


SQLITE_HEADER = b"SQLite format 3\x00"
MLFLOW_TABLES = {"alembic_version", "experiments", "runs"}


def not_an_mlflow_store(db: Path) -> Optional[str]:
    """None if the SQLite file ``db`` holds MLflow's tables, else why not (empty, not SQLite,
    damaged, no MLflow tables). Opened read-only: MLflow would otherwise build its tables into
    any file it is given (an empty file became a store), and a command never writes a file it
    was only asked to read."""
    import sqlite3
    try:
        with open(db, "rb") as f:
            head = f.read(len(SQLITE_HEADER))
    except OSError as e:
        return f"{db} cannot be read: {e.strerror or e}"
    if not head:
        return f"{db} is empty"
    if head != SQLITE_HEADER:
        return f"{db} is not an SQLite file"
    try:
        con = sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True)
        try:
            tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        finally:
            con.close()
    except sqlite3.Error as e:
        return f"{db} is a damaged SQLite file: {e}"
    return None if MLFLOW_TABLES <= tables else f"{db} is an SQLite file without MLflow's tables"


def selected(select_runs: Callable, uri: str, experiment: str, sweep: Optional[str], filter_string: Optional[str]):
    """``select_runs(...)``, or the refusal line (a str) for a rejected filter, an unknown
    sweep id or experiment."""
    from mlflow.exceptions import MlflowException

    try:
        if missing := _no_experiment(uri, experiment):
            return missing, sweep
        runs, sweep = select_runs(uri, experiment, sweep, filter_string)
    except MlflowException as e:
        first = str(e).splitlines()[0][:200]
        if filter_string:
            return f"--filter {filter_string!r} is not a valid MLflow search filter ({first}); e.g. {FILTER_EXAMPLE}.", sweep
        return f"the tracking store at {uri} failed: {first}", sweep
    except SystemExit as e:  # select_runs: no sweep in the experiment (its line says what to run)
        return f"{str(e.code).removeprefix('xpar compare: ')}.", sweep
    if runs.empty and sweep and sweep != "latest" and not filter_string:
        known = _sweep_ids(experiment)
        return (f"--sweep {sweep} names no sweep in experiment {experiment!r} at {uri}; sweep ids there: "
                f"{', '.join(known) or 'none'}."), sweep
    return runs, sweep


def _no_experiment(uri: str, experiment: str) -> Optional[str]:
    """None if the store at ``uri`` holds ``experiment``, else the refusal naming the experiments it holds
    (``--experiment nope`` said "no sweep found in experiment 'nope'", after MLflow's own warning
    "Cannot retrieve experiment by name nope", as if the experiment were there and empty)."""
    import mlflow

    client = mlflow.tracking.MlflowClient(uri)
    if client.get_experiment_by_name(experiment) is not None:
        return None
    import difflib
    names = [e.name for e in client.search_experiments(max_results=50)]
    near = difflib.get_close_matches(experiment, names, n=1) or [n for n in names if n == "xpar"] or names[:1]
    return (f"--experiment {experiment} names no experiment at {uri}; experiments there: {', '.join(names) or 'none'}"
            + (f"; e.g. --experiment {near[0]}." if near else "; run xpar first (python -m xpar)."))


def _sweep_ids(experiment: str) -> list[str]:
    import mlflow

    parents = mlflow.search_runs(experiment_names=[experiment], filter_string="tags.`xpar.role` = 'sweep'",
                                 order_by=["start_time DESC"], max_results=10)
    return list(parents["tags.xpar.sweep_id"].dropna()) if "tags.xpar.sweep_id" in parents else []
