"""Multirun sweeps: pre-flight validation, parent/child grouping in MLflow, honest end
statuses when a job fails, and `xpar compare`."""
import os
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest


def _xpar(cwd, *args, timeout=300):
    return subprocess.run([sys.executable, "-m", "xpar", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, HYDRA_FULL_ERROR="0"))


def _runs(cwd):
    mlflow.set_tracking_uri(f"sqlite:///{cwd / 'mlflow.db'}")
    return mlflow.search_runs(experiment_names=["xpar"])


FAST = ["train.steps=3", "train.warmup_steps=1", "run.progress=false"]


@pytest.mark.slow
def test_invalid_combination_stops_sweep_before_any_job(tmp_path):
    r = _xpar(tmp_path, "-m", "train.steps=0,3", "parallel=dp,zero2", "run.progress=false")
    assert r.returncode == 2, r.stderr[-2000:]
    assert "pre-flight found 2 invalid job(s)" in r.stderr
    assert "job 0 (train.steps=0 parallel=dp run.progress=False): train.steps must be > 0, got 0; e.g. train.steps=10." in r.stderr
    assert "job 1 (train.steps=0 parallel=zero2" in r.stderr
    assert "Launching" not in r.stdout + r.stderr
    assert not (tmp_path / "mlflow.db").exists()


@pytest.mark.slow
def test_skip_invalid_runs_the_rest_and_compare_reads_the_sweep(tmp_path):
    r = _xpar(tmp_path, "-m", "train.steps=0,3", "sweep.skip_invalid=true", "train.warmup_steps=1",
              "run.progress=false", "hardware.devices_per_node=1")  # one worker: the sweep is what is tested
    assert r.returncode == 0, r.stderr[-2000:]
    assert "skipping job 0" in r.stderr
    runs = _runs(tmp_path)
    parent = runs[runs["tags.xpar.role"] == "sweep"].iloc[0]
    children = runs[runs["tags.mlflow.parentRunId"] == parent["run_id"]]
    assert parent["status"] == "FINISHED"
    assert list(children["tags.xpar.job_num"]) == ["1"] and list(children["status"]) == ["FINISHED"]
    invalid = mlflow.tracking.MlflowClient().download_artifacts(parent["run_id"], "invalid_jobs.csv", str(tmp_path))
    assert "train.steps must be > 0, got 0; e.g. train.steps=10." in open(invalid).read()  # the reason is kept beside the results
    c = subprocess.run([sys.executable, "-m", "xpar.track.compare", "--sweep", parent["tags.xpar.sweep_id"],
                        "--out", str(tmp_path / "cmp")], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert c.returncode == 0, c.stderr
    assert "1 runs of sweep" in c.stdout and "FINISHED" in c.stdout
    assert (tmp_path / "cmp" / "throughput_by_layout.png").stat().st_size > 1000


@pytest.mark.slow
def test_failing_job_is_failed_others_finish_parent_ended(tmp_path):
    r = _xpar(tmp_path, "-m", "run.fail_rank=1,null", *FAST)
    assert r.returncode != 0  # Hydra reports the failed job at the end of the sweep
    runs = _runs(tmp_path)
    parent = runs[runs["tags.xpar.role"] == "sweep"]
    assert list(parent["status"]) == ["FAILED"]  # ended although Hydra skipped on_multirun_end
    kids = runs[runs["tags.mlflow.parentRunId"] == parent.iloc[0]["run_id"]].set_index("tags.xpar.job_num")
    assert kids.loc["0", "status"] == "FAILED" and kids.loc["1", "status"] == "FINISHED"
    assert kids.loc["1", "tags.xpar.overrides"].startswith("run.fail_rank=null")
    why = "worker rank 1 failed"  # the failed job's reason: on its run, in its xpar.log, on the console
    assert why in kids.loc["0", "tags.xpar.error"]
    sweep_dir, = {p.parent.parent for p in tmp_path.glob("multirun/*/*/0/xpar.log")}
    assert f"job 0 failed: WorkerFailed: {why}" in (sweep_dir / "0" / "xpar.log").read_text()
    assert f"job 0 failed: WorkerFailed: {why}" in r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr  # Hydra's end-of-sweep report is one line, not a traceback


def _parent_and_children(runs):
    parent = runs[runs["tags.xpar.role"] == "sweep"]
    assert len(parent) == 1
    kids = runs[runs["tags.mlflow.parentRunId"] == parent.iloc[0]["run_id"]]
    return parent.iloc[0], kids


# submitit's local launcher grouping its jobs under one parent: tests/track/test_ui.py (one sweep for both).


@pytest.mark.slow
def test_optuna_sweeper_preflights_discrete_choices(tmp_path):
    """Every discrete choice of an Optuna sweep is validated before any trial: one invalid value
    stops it with exit 2. (Trials grouped under one parent, a skipped trial, a continuous parameter:
    tests/run/test_faults.py::test_optuna_skipped_trial_is_failed_and_the_sweep_goes_on.)"""
    bad = _xpar(tmp_path, "-m", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=2",
                "train.steps=choice(0,3)", "train.lr=interval(0.0001,0.01)", "run.progress=false")
    assert bad.returncode == 2 and "train.steps must be > 0, got 0" in bad.stderr
    assert "Launching" not in bad.stdout + bad.stderr and not (tmp_path / "mlflow.db").exists()


@pytest.mark.slow
def test_microbatch_sweep_of_a_pipeline_and_its_bubble_comparison(tmp_path):
    """The README's sweep (over m = 1, 2, 4 and the tiny model here; the README adds 8, on mini): one parent, 3 FINISHED children,
    compare shows measured and theoretical bubble per m and writes the bubble plot."""
    r = _xpar(tmp_path, "-m", "parallel=pp", "model=tiny", "parallel.micro_batches=1,2,4", *FAST)
    assert r.returncode == 0, r.stderr[-2000:]
    parent, kids = _parent_and_children(_runs(tmp_path))
    assert parent["status"] == "FINISHED" and len(kids) == 3 and set(kids["status"]) == {"FINISHED"}
    sweep_id = parent["tags.xpar.sweep_id"]  # the multirun ends with its summary: a row per job, best job, compare line
    assert f"sweep {sweep_id}: 3 job(s), parent run FINISHED" in r.stderr and f"xpar compare --sweep {sweep_id}" in r.stderr
    assert "best by throughput/tokens_per_s (max): job " in r.stderr and parent["tags.xpar.best_run_id"] in r.stderr
    theory = dict(zip(kids["params.parallel.micro_batches"].astype(int), kids["metrics.pipeline/bubble_ratio_theory"]))
    assert theory == {m: pytest.approx(1 / (m + 1)) for m in (1, 2, 4)}  # (p-1)/(m+p-1), p=2
    assert (kids["metrics.pipeline/bubble_ratio"] > 0).all()
    for key in ("parallel.dp", "parallel.micro_batches", "parallel.virtual_stages", "train.global_batch_size"):
        assert kids[f"params.{key}"].str.fullmatch(r"\d+").all(), key  # resolved numbers, never 'auto'
    ints = {k: kids[f"params.{k}"].astype(int) for k in ("train.micro_batch_size", "parallel.micro_batches", "parallel.dp")}
    assert (kids["params.train.global_batch_size"].astype(int)
            == ints["train.micro_batch_size"] * ints["parallel.micro_batches"] * ints["parallel.dp"]).all()
    assert (kids["params.hardware.peak_tflops"].astype(float) > 0).all()  # the device peak behind MFU
    for k in ("fidelity/step_time_ratio", "fidelity/peak_memory_ratio", "fidelity/bubble_diff"):
        assert kids[f"metrics.{k}"].notna().all(), k  # every executed run is also estimated
    assert kids["metrics.fidelity/peak_memory_ratio"].between(0.5, 2).all()
    from tests.conftest import (
        runs_missing_fidelity,  # the suite-wide check (conftest) finds these runs
    )
    assert runs_missing_fidelity(tmp_path) == []
    import shutil
    import sqlite3
    import tempfile
    with tempfile.TemporaryDirectory() as d:  # outside pytest's tmp: the session check must not see it
        shutil.copy(tmp_path / "mlflow.db", d)
        con = sqlite3.connect(Path(d) / "mlflow.db")
        con.execute("DELETE FROM metrics WHERE key = 'fidelity/bubble_diff'")
        con.commit()
        con.close()
        assert len(runs_missing_fidelity(Path(d))) == 3  # and would report a run without them
    c = subprocess.run([sys.executable, "-m", "xpar.track.compare", "--out", str(tmp_path / "cmp")], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert c.returncode == 0, c.stderr
    assert "3 runs of sweep" in c.stdout and "bubble_theory" in c.stdout
    assert (tmp_path / "cmp" / "bubble_vs_microbatches.png").stat().st_size > 1000


def test_compare_table_says_where_each_run_ran_and_how_close_its_estimate_was():
    """`xpar compare` rows carry hardware, framework, devices (dp x tp x pp), global batch, step
    time and fidelity/step_time_ratio beside tokens/s (a fresh-user breaker could not tell a
    405B run on 64 H100s from one on 512)."""
    import pandas as pd

    from xpar.track.compare import headline_table
    runs = pd.DataFrame([{"run_id": "a", "tags.xpar.hardware": "h100_80gb_64gpu", "params.framework.name": "megatron",
                          "params.parallel.dp": "2", "params.parallel.tp": "8", "params.parallel.pp": "4",
                          "params.train.global_batch_size": "256", "metrics.throughput/step_time_s": 1.5,
                          "metrics.fidelity/step_time_ratio": 0.9, "metrics.throughput/tokens_per_s": 1e5}])
    t = headline_table(runs)
    row = t.iloc[0]
    assert (row["hardware"], row["framework"], row["devices"], row["global_batch"]) == ("h100_80gb_64gpu", "megatron",
                                                                                        64, 256)
    assert row["step_time_s"] == 1.5 and row["fidelity_step_ratio"] == 0.9


def test_memory_chart_stacks_the_terms_in_the_unit_of_its_sizes():
    """A ZeRO sweep of the tiny model: bars stacked by term (params, grads, optimizer,
    activations), labelled in MiB, not 0.009 GiB."""
    import pandas as pd

    from xpar.track.report import format_bytes, memory_unit
    from xpar.track.compare import headline_table, memory_figure
    assert memory_unit(9.5e6) == ("MiB", 2 ** 20) and memory_unit(3e10)[0] == "GiB" and memory_unit(10) == ("B", 1)
    assert format_bytes(9.5e6) == "9.06 MiB" and format_bytes(10) == "10 B"
    runs = pd.DataFrame([{"run_id": f"r{z}", "tags.mlflow.runName": f"tiny zero{z}", "tags.xpar.mode": "execute",
                          "tags.xpar.model": "tiny", "metrics.memory/peak_bytes_per_device": 9.5e6 - z * 1e6,
                          **{f"metrics.memory/{k}_bytes": v for k, v in
                             (("params", 1e6), ("grads", 1e6), ("optimizer", 2e6 / (1 + z)), ("activations", 5e6))}}
                         for z in (0, 1, 2, 3)])
    fig = memory_figure(runs, headline_table(runs))
    ax = fig.axes[0]
    assert ax.get_ylabel() == "peak memory per device (MiB)"
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["params", "grads", "optimizer", "activations"]
    tops = [max(p.get_y() + p.get_height() for p in ax.patches if abs(p.get_x() + p.get_width() / 2 - i) < 0.1)
            for i in range(4)]
    assert tops[0] == pytest.approx(9e6 / 2 ** 20)  # the four terms of zero0, stacked, in MiB


def test_the_sweep_summary_labels_estimated_jobs(capsys):
    """-m parallel=3d model=70b parallel.micro_batches=16,32 ended with a table of tokens/s and 'FINISHED'
    and no word that the figures were the cost model's; an executed job stays unlabelled."""
    import pandas as pd

    from xpar.track.parent_run import print_sweep_summary
    table = pd.DataFrame({"job": ["0", "1"], "layout": ["dp2-tp8-pp4", "dp2"], "tokens_per_s": [20998.0, 7000.0],
                          "peak_gib_per_device": [58.0, 0.01], "bubble": [0.086, None],
                          "status": ["FINISHED", "FINISHED"], "mode": ["estimate", "execute"]})
    print_sweep_summary({"sweep_id": "abc", "metric": "throughput/tokens_per_s", "goal": "max"},
                        {"table": table, "status": "FINISHED", "contention": set(), "best": None})
    err = capsys.readouterr().err
    job0, job1 = err.split("│   1 │")  # a row may wrap onto a second line
    assert "(estimate)" in job0.split("│   0 │")[1] and "20,998" in job0, err
    assert "(estimate)" not in job1, err


def test_the_sweep_summary_names_the_jobs_it_skipped(capsys):
    """-m ... parallel.tp=1,3,2 sweep.skip_invalid=true ended with 'sweep 191be87f: 2 job(s), parent run FINISHED'
    and rows 0 and 2: job 1's refusal was printed before the jobs ran, a screen above, and the summary said nothing."""
    import pandas as pd

    from xpar.track.parent_run import print_sweep_summary
    table = pd.DataFrame({"job": ["0", "2"], "layout": ["dp8-tp1", "dp4-tp2"], "tokens_per_s": [71569.0, 60083.0],
                          "peak_gib_per_device": [37.4, 28.0], "bubble": [None] * 2, "status": ["FINISHED"] * 2,
                          "mode": ["estimate"] * 2})
    print_sweep_summary({"sweep_id": "abc", "metric": "throughput/tokens_per_s", "goal": "max", "skipped": [1]},
                        {"table": table, "status": "FINISHED", "contention": set(), "best": None})
    err = " ".join(capsys.readouterr().err.split())
    assert "1 skipped as invalid (job 1: invalid_jobs.csv on the parent run)" in err, err


def test_the_sweep_summary_names_what_each_job_changed_where_layouts_repeat(capsys):
    """-m model=7b parallel=zero3 train=cluster hardware=h100_80gb_8gpu,a100_80gb_8gpu,b200_180gb_node run.mode=estimate
    ended with three rows named dp8-tp1-pp1-zero3-m1-b1 and nothing telling which ran on which GPU; each row now
    names its swept override. A micro-batch sweep (layout names differ) keeps its columns."""
    import pandas as pd

    from xpar.track.parent_run import print_sweep_summary, swept_overrides
    common = "model=7b parallel=zero3 train=cluster run.mode=estimate"
    hws = ["h100_80gb_8gpu", "a100_80gb_8gpu", "b200_180gb_node"]
    table = pd.DataFrame({"job": ["0", "1", "2"], "layout": ["dp8-tp1-pp1-zero3-m1-b1"] * 3,
                          "tokens_per_s": [71569.0, 29430.0, 155158.0], "peak_gib_per_device": [37.4] * 3,
                          "bubble": [None] * 3, "status": ["FINISHED"] * 3, "mode": ["estimate"] * 3,
                          "overrides": [f"{common} hardware={h}" for h in hws]})
    assert swept_overrides(table) == [f"hardware={h}" for h in hws]
    print_sweep_summary({"sweep_id": "abc", "metric": "throughput/tokens_per_s", "goal": "max"},
                        {"table": table, "status": "FINISHED", "contention": set(), "best": None})
    err = capsys.readouterr().err
    assert "swept" in err
    for job, h in enumerate(hws):
        row = err.split(f"│   {job} │")[1].split(f"│   {job + 1} │")[0]
        assert f"hardware={h[0]}" in row and h[1:9] in row, err  # the column folds a long value over lines
    pipeline = table.assign(layout=[f"dp1-pp2-m{m}" for m in (1, 2, 4)],
                            overrides=[f"parallel=pp parallel.micro_batches={m}" for m in (1, 2, 4)])
    assert swept_overrides(pipeline) == []
