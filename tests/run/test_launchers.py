"""Clusters through real launchers, as one job:

- two torchrun agents on 127.0.0.1 as two nodes (c10d rendezvous, 2 ranks each) -> one MLflow
  run, world size 4, tagged torchrun / 2 nodes / 2 devices per node, in outputs/torchrun-<rdzv id>;
- a SLURM job's environment (faked: what srun sets for task 9 of 2 nodes x 8 tasks) -> the
  torch.distributed variables xpar.config.cluster exports, so its tasks become one job's ranks;
- the `hydra/launcher=slurm` preset composes onto submitit's SLURM launcher.

(submitit's local executor with 2 tasks per job is exercised by tests/track/test_ui.py's sweep.)
"""
import os
import subprocess
import sys

import mlflow
import pytest

from xpar.run.launch import free_port


@pytest.mark.slow
def test_two_torchrun_agents_as_two_nodes_make_one_run_of_world_size_4(tmp_path):
    port = free_port()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "twonodes",
                "-m", "xpar", "train.steps=2", "train.warmup_steps=1", "run.progress=false"]
    env = {k: v for k, v in os.environ.items() if k not in ("XPAR_RUN_DIR", "RANK", "WORLD_SIZE", "MASTER_ADDR")}
    agents = [subprocess.Popen(torchrun, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True) for _ in range(2)]
    logs = [a.communicate(timeout=300)[0] for a in agents]
    assert [a.returncode for a in agents] == [0, 0], "\n".join(log[-1500:] for log in logs)
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = mlflow.search_runs(experiment_names=["xpar"])
    assert len(runs) == 1, runs[["tags.mlflow.runName", "status"]]  # one run, not one per node or rank
    run = runs.iloc[0]
    assert run["status"] == "FINISHED" and run["tags.mlflow.runName"] == "tiny·dp4"
    assert run["params.parallel.dp"] == "4"  # world size 4 = 2 nodes x 2
    assert (run["tags.xpar.launcher"], run["tags.xpar.nodes"], run["tags.xpar.devices_per_node"]) == ("torchrun", "2", "2")
    assert (run["params.hardware.nodes"], run["params.hardware.devices_per_node"]) == ("2", "2")
    assert (tmp_path / "outputs" / "torchrun-twonodes" / "config.yaml").is_file()  # the job's own folder


SLURM_TASK_9 = {"SUBMITIT_EXECUTOR": "slurm", "SLURM_JOB_ID": "4242", "SLURM_NTASKS": "16",
                "SLURM_JOB_NUM_NODES": "2", "SLURM_NODEID": "1", "SLURM_PROCID": "9", "SLURM_LOCALID": "1",
                "SLURM_JOB_NODELIST": "gpu[07-08]"}


def test_a_slurm_task_becomes_one_rank_of_the_job(monkeypatch):
    from xpar.config.cluster import adopt_submitit_tasks

    monkeypatch.setattr(os, "environ", os.environ.copy())  # adopt_submitit_tasks exports into os.environ
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                "XPAR_SUBMITIT_TASKS", "XPAR_SUBMITIT_NODES", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(key, raising=False)
    for key, value in SLURM_TASK_9.items():
        monkeypatch.setenv(key, value)
    assert adopt_submitit_tasks()
    got = {k: os.environ[k] for k in ("MASTER_ADDR", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    assert got == {"MASTER_ADDR": "gpu07", "RANK": "9", "WORLD_SIZE": "16", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "8"}
    assert 20000 <= int(os.environ["MASTER_PORT"]) <= 60000  # the same on every task: seeded by the job id
    assert "CUDA_VISIBLE_DEVICES" not in os.environ  # xpar selects cuda:LOCAL_RANK itself
    monkeypatch.setenv("SLURM_NTASKS", "1")
    monkeypatch.delenv("RANK")
    assert not adopt_submitit_tasks()  # a one-task job is an ordinary local run


def test_slurm_launcher_preset_composes():
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    import xpar.config.schema  # noqa: F401
    from xpar.config.presets import conf_dir

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        cfg = compose("config", return_hydra_config=True,
                      overrides=["hydra/launcher=slurm", "hydra.launcher.partition=gpu", "hydra.launcher.nodes=2"])
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert (launcher.nodes, launcher.tasks_per_node, launcher.gpus_per_node, launcher.partition) == (2, 8, 8, "gpu")
    assert launcher.submitit_folder.endswith(".submitit/%j")


@pytest.mark.slow
def test_slurm_gpus_the_partition_lacks_are_refused_before_submission(tmp_path, monkeypatch):
    """The preset's gpus_per_node=8 on a CPU partition made sbatch fail after the sweep had started;
    now sinfo's GRES is read first and the command line is refused in one line that works when followed."""
    from xpar.config.overrides import override_problems

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for cmd, body in (("srun", "exit 0"), ("sbatch", "exit 0"), ("sinfo", "printf 'cpu* (null)\\ngpu gpu:a100:4\\n'")):
        (bin_dir / cmd).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / cmd).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    problems = override_problems(["-m", "hydra/launcher=slurm"])
    assert len(problems) == 1 and "gpus_per_node=8 but the default partition has no GPU(s)" in problems[0]
    assert "hydra.launcher.gpus_per_node=0" in problems[0]
    assert override_problems(["-m", "hydra/launcher=slurm", "hydra.launcher.gpus_per_node=0"]) == []  # the fix
    gpu = override_problems(["-m", "hydra/launcher=slurm", "hydra.launcher.partition=gpu"])
    assert "has 4 GPU(s) per node" in gpu[0] and "hydra.launcher.gpus_per_node=4" in gpu[0]
    assert override_problems(["-m", "hydra/launcher=slurm", "hydra.launcher.partition=gpu",
                              "hydra.launcher.gpus_per_node=4"]) == []


def test_a_config_error_survives_pickling_as_its_list_of_problems():
    """submitit pickles a job's exception back to the submitting process: rebuilt from its string,
    a ConfigError printed one character per line (134 lines)."""
    import pickle

    from xpar.config.checks import ConfigError
    from xpar.plan.command import PlanRefused

    e = pickle.loads(pickle.dumps(ConfigError(["parallel.tp=3 must divide model.n_heads=4", "train.steps must be > 0"])))
    assert e.problems == ["parallel.tp=3 must divide model.n_heads=4", "train.steps must be > 0"]
    assert str(e).count("\n") == 1 and str(e).startswith("  - parallel.tp=3")
    assert pickle.loads(pickle.dumps(PlanRefused(["no layout fits"]))).problems == ["no layout fits"]


def _sweep_config(*overrides: str):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    import xpar.config.schema  # noqa: F401
    from xpar.config.presets import conf_dir

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        return compose("config", return_hydra_config=True, overrides=list(overrides))


def test_ranks_are_held_against_the_slurm_jobs_tasks_before_submission():
    """A layout of 8 ranks on a 2-task allocation is refused before sbatch, with a value that works."""
    from xpar.config.cluster import submitit_task_problems

    cfg = _sweep_config("hydra/launcher=slurm", "hydra.launcher.tasks_per_node=2", "parallel.tp=4", "parallel.pp=2",
                        "parallel.dp=1", "model=mini", "run.mode=execute")
    problems = submitit_task_problems(cfg.hydra.launcher, cfg)
    assert len(problems) == 1 and "8 ranks" in problems[0] and "2 tasks" in problems[0], problems
    assert "hydra.launcher.tasks_per_node=8" in problems[0]
    fixed = _sweep_config("hydra/launcher=slurm", "hydra.launcher.tasks_per_node=8", "parallel.tp=4", "parallel.pp=2",
                          "parallel.dp=1", "model=mini", "run.mode=execute")
    assert submitit_task_problems(fixed.hydra.launcher, fixed) == []  # the fix it names
    auto = _sweep_config("hydra/launcher=slurm", "hydra.launcher.tasks_per_node=2", "parallel.tp=2")
    assert submitit_task_problems(auto.hydra.launcher, auto) == []  # dp=auto fills the 2 tasks
    estimate = _sweep_config("hydra/launcher=slurm", "hydra.launcher.tasks_per_node=2", "parallel.tp=8",
                             "run.mode=estimate")
    assert submitit_task_problems(estimate.hydra.launcher, estimate) == []  # an estimate runs no ranks


def test_slurm_jobs_are_named_and_announced_with_their_real_ids():
    from types import SimpleNamespace as NS

    from xpar.track.slurm import job_lines, refusal_line

    cfg = _sweep_config("hydra/launcher=slurm", "model=mini", "parallel=zero3")
    assert cfg.hydra.launcher.name == "xpar-mini-zero3"
    jobs = [NS(job_id="4242_0", paths=NS(stdout="/sw/.submitit/4242_0/4242_0_0_log.out")),
            NS(job_id="4242_1", paths=NS(stdout="/sw/.submitit/4242_1/4242_1_0_log.out"))]
    lines = job_lines(jobs, [["parallel.micro_batches=2"], ["parallel.micro_batches=4"]], 0)
    assert lines[1] == ("xpar: job 1 submitted as SLURM job 4242_1 (parallel.micro_batches=4); "
                        "log: /sw/.submitit/4242_1/4242_1_0_log.out")
    assert not any("%j" in line for line in lines)
    err = subprocess.CalledProcessError(1, ["sbatch"], output=b"sbatch: error: invalid partition specified: gpux\n")
    line = refusal_line(err)
    assert "invalid partition specified: gpux" in line and "\n" not in line


@pytest.mark.slow
def test_an_sbatch_refusal_is_one_line_and_exit_2(tmp_path):
    """The pre-submission path with stub SLURM commands: sbatch refuses; xpar says so in one line,
    exits 2, and prints no traceback and no compare hint for the sweep that never ran."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for cmd, body in (("srun", "exit 0"), ("sinfo", "printf 'cpu* (null)\\n'"),
                      ("sbatch", "echo 'sbatch: error: invalid partition specified: gpux' >&2; exit 1")):
        (bin_dir / cmd).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / cmd).chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}")
    r = subprocess.run([sys.executable, "-m", "xpar", "-m", "hydra/launcher=slurm", "hydra.launcher.gpus_per_node=0",
                        "hydra.launcher.tasks_per_node=2", "parallel.micro_batches=1,2", "train.steps=3"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "xpar: sbatch refused the sweep (sbatch: error: invalid partition" in r.stderr
    assert "compare:" not in r.stderr and "no job ran" in r.stderr, r.stderr[-3000:]
