"""Checkpoint and resume (xpar.run.checkpoint) with real 2-worker runs of the tiny model.

One uninterrupted reference run (dp=2, cosine lr schedule, a checkpoint every 3 steps) is
shared by the tests: a DDP resume from its step-3 checkpoint must give bitwise the same
losses and continue its MLflow run; a chain of resumes through zero3, tp2 and pp2 (each
loading the previous layout's checkpoint, DCP resharding) must stay within 1e-6 of it; a run
SIGKILLed after a checkpoint resumes from the latest one, losing at most the steps since.
"""
import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path
from statistics import fmean

import pytest

from tests.conftest import spec_for
from xpar.config.checks import ConfigError

STEPS = 12
COMMON = ["train.warmup_steps=1", "run.progress=false", "train.lr_schedule=cosine", "train.lr_warmup_steps=2"]


class _Evil:
    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


def _xpar(cwd: Path, run_dir: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "xpar", f"hydra.run.dir={run_dir}", *COMMON, *args],
                       cwd=cwd, capture_output=True, text=True, timeout=300)
    assert not check or r.returncode == 0, r.stderr[-3000:]
    return r


def _losses(run_dir: Path) -> list:
    """The run's loss per step as the report folds the ranks (mean over ranks that see one)."""
    stats = json.loads((run_dir / "ranks.json").read_text())
    return [fmean([s["losses"][i] for s in stats if s["losses"][i] is not None]) for i in range(len(stats[0]["losses"]))]


def _runs(cwd: Path):
    import mlflow
    mlflow.set_tracking_uri(f"sqlite:///{cwd / 'mlflow.db'}")
    return mlflow.search_runs(experiment_names=["xpar"], order_by=["start_time ASC"])


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(start dir, run dir) of the uninterrupted dp=2 run: steps 0..11, checkpoints 3, 6, 9, 12."""
    cwd = tmp_path_factory.mktemp("ckpt")
    run = cwd / "ref"
    _xpar(cwd, run, f"train.steps={STEPS}", "train.checkpoint_every=3")
    return cwd, run


def _step3(run: Path) -> str:
    return str(run / "checkpoints" / "step_0000003")


@pytest.mark.slow
def test_ddp_resume_is_bitwise_and_continues_the_mlflow_run(reference):
    cwd, ref = reference
    assert sorted(p.name for p in (ref / "checkpoints").iterdir()) == [f"step_{k:07d}" for k in (3, 6, 9, 12)]
    resumed = cwd / "ddp_resumed"
    _xpar(cwd, resumed, f"train.steps={STEPS}", "train.checkpoint_every=3", f"train.resume={_step3(ref)}")
    assert _losses(resumed)[3:] == _losses(ref)[3:]  # bitwise
    a, b = (json.loads((d / "ranks.json").read_text())[0] for d in (ref, resumed))
    assert b["lrs"] == a["lrs"] and b["grad_norms"] == a["grad_norms"] and b["first_step"] == 3
    runs = _runs(cwd)
    assert len(runs) == 1  # the same MLflow run, continued
    run = runs.iloc[0]
    assert run["status"] == "FINISHED" and run["tags.xpar.resumed_step"] == "3"
    assert "params.train.resume" not in runs.columns  # where from is a tag, never a param
    import mlflow
    history = mlflow.tracking.MlflowClient().get_metric_history(run["run_id"], "train/loss")
    assert {m.step for m in history} == set(range(STEPS))
    by_step = {}
    for m in history:
        by_step.setdefault(m.step, set()).add(m.value)
    assert all(len(v) == 1 for v in by_step.values())  # steps redone after the resume log the same loss


@pytest.mark.slow
def test_checkpoints_reshard_through_zero3_tp_and_pp(reference):
    """dp2 step 3 -> zero3 (saves 6) -> tp2 (saves 9) -> pp2: each loads the previous layout's
    checkpoint (DCP reshards) and continues the reference's losses within 1e-6."""
    cwd, ref = reference
    chain = [("zero3", ["parallel=zero3"], _step3(ref)),
             ("tp2", ["parallel=tp", "parallel.micro_batches=2", "tracking=off"], "zero3/checkpoints/step_0000006"),
             ("pp2", ["parallel=pp", "model=tiny", "parallel.micro_batches=2", "tracking=off"],
              "tp2/checkpoints/step_0000009")]
    want = _losses(ref)
    for name, args, resume in chain:
        r = _xpar(cwd, cwd / name, f"train.steps={STEPS}", "train.checkpoint_every=3", *args, f"train.resume={resume}")
        k = int(resume.rsplit("_", 1)[1])
        got = _losses(cwd / name)
        assert max(abs(g - w) / abs(w) for g, w in zip(got[k:], want[k:])) <= 1e-6, (name, got, want)
        if name == "zero3":  # its params differ (parallel.*): a new MLflow run linked to the reference's
            assert "resuming in a new MLflow run linked to run" in r.stderr
            runs = _runs(cwd)
            new = runs[runs["tags.xpar.resumed_from_run"].notna()].iloc[0]
            assert new["tags.xpar.resumed_from_run"] == runs.iloc[0]["run_id"] != new["run_id"]
            assert new["params.parallel.zero_stage"] == "3"


@pytest.mark.slow
def test_a_killed_run_resumes_from_its_latest_checkpoint(tmp_path):
    """SIGKILL a rank after a checkpoint; train.resume=latest resumes from the newest complete
    checkpoint, losing at most the steps since it (checkpoint_every=2; one more where the kill
    came while the next one was written); the redone steps give each rank's losses of before
    the kill, bitwise."""
    run = tmp_path / "outputs" / "killed"
    args = ["train.steps=40", "train.checkpoint_every=2", "train.checkpoint_keep=2", "tracking=off",
            "train.lr_schedule=constant"]
    p = subprocess.Popen([sys.executable, "-m", "xpar", f"hydra.run.dir={run}", *COMMON, *args], cwd=tmp_path,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    step_file, deadline = run / "steps" / "rank1.jsonl", time.time() + 120
    while not (step_file.exists() and step_file.read_text().count("\n") >= 5
               and list(run.glob("checkpoints/step_*/xpar.json"))):
        assert time.time() < deadline and p.poll() is None, p.communicate()
        time.sleep(0.02)
    pid = json.loads((run / "heartbeat" / "rank1.json").read_text())["pid"]
    os.kill(pid, signal.SIGKILL)
    p.communicate(timeout=60)
    assert p.returncode == 1
    done = step_file.read_text().count("\n")  # steps rank 1 finished before it died
    resumed = tmp_path / "outputs" / "resumed"
    r = _xpar(tmp_path, resumed, *args, "train.resume=latest")
    stats = json.loads((resumed / "ranks.json").read_text())
    first = stats[0]["first_step"]
    complete = [int(m.parent.name.split("_")[1]) for m in run.glob("checkpoints/step_*/xpar.json")]
    assert 1 <= len(complete) <= 2  # train.checkpoint_keep=2
    newest = max(complete)
    assert first == newest and done - 3 <= first < done, (done, first)
    for rank in (0, 1):  # the steps redone after the resume: each rank's loss as before the kill, bitwise
        before = {json.loads(line)["step"]: json.loads(line)["loss"]
                  for line in (run / "steps" / f"rank{rank}.jsonl").read_text().splitlines()}
        assert [stats[rank]["losses"][i] for i in range(first, done)] == [before[i] for i in range(first, done)]
    assert len(stats[0]["losses"]) == 40 and r.returncode == 0
    assert sorted(p.name for p in (resumed / "checkpoints").iterdir()) == ["step_0000038", "step_0000040"]


@pytest.mark.slow
def test_resume_refusals_exit_2_before_any_worker(reference, tmp_path):
    cwd, ref = reference
    runs_before = len(_runs(cwd))
    r = _xpar(cwd, tmp_path / "refused", "train.resume=does/not/exist", check=False)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "xpar: invalid configuration" in r.stderr and "train.resume=does/not/exist: no such directory" in r.stderr
    assert not (tmp_path / "refused" / "worker_0.log").exists() and len(_runs(cwd)) == runs_before
    from xpar.run.resume import checkpointing

    cases = [((f"train.resume={ref / 'steps'}",), "no complete checkpoint in"),
             ((f"train.resume={_step3(ref)}", "model.hidden=128"), "holds another model (model.hidden=128"),
             ((f"train.resume={_step3(ref)}", "train.steps=3"), "train.steps=3 must exceed the checkpoint's step 3"),
             (("train.resume=latest", f"train.checkpoint_dir={tmp_path}"), "train.resume=latest: no complete checkpoint"),
             (("train.checkpoint_every=2", "parallel=zero1"), "not available with parallel.zero_stage=1"),
             (("train.checkpoint_every=-1",), "train.checkpoint_every must be an integer >= 0, or null, got -1"),
             (("train.checkpoint_keep=0",), "train.checkpoint_keep must be an integer >= 1, or null, got 0")]
    evil = tmp_path / "evil"  # a copy of a checkpoint whose .metadata would run a command when unpickled
    import shutil
    shutil.copytree(_step3(ref), evil)
    (evil / ".metadata").write_bytes(pickle.dumps(_Evil(tmp_path / "pwned")))
    cases.append(((f"train.resume={evil}",), "cannot be loaded safely (UnpicklingError: global posix.system"))
    aside = tmp_path.parent / f"{tmp_path.name}_aside"  # outside train.checkpoint_dir={tmp_path} above
    for name, damage in (("short", lambda f: f.write_bytes(f.read_bytes()[:1000])), ("gone", lambda f: f.unlink())):
        broken = aside / name  # a shard truncated, or deleted: refused before any worker
        shutil.copytree(_step3(ref), broken)
        damage(sorted(broken.glob("*.distcp"))[0])
        cases.append(((f"train.resume={broken}",), "the checkpoint is damaged"))
    reused = aside / "reused"  # another run's checkpoints in the folder: not overwritten
    shutil.copytree(_step3(ref), reused / "step_0000003")
    cases.append(((f"train.checkpoint_dir={reused}", "train.checkpoint_every=2"),
                  "already holds 1 checkpoint(s) of another run (step_0000003)"))
    for overrides, fragment in cases:
        with pytest.raises(ConfigError) as e:
            checkpointing(spec_for(*overrides), cwd)
        assert fragment in str(e.value), (overrides, str(e.value))
    assert not (tmp_path / "pwned").exists()
    spec, meta = checkpointing(spec_for(f"train.resume={ref}", "train.steps=20"), cwd)  # a run dir: its newest
    assert meta["step"] == 12 and spec.train.resume.endswith("step_0000012")
    assert f"resumed from {spec.train.resume} at step 12" in " ".join(spec.notes)  # said on the console


def test_lr_schedule_restored_at_the_step_with_this_runs_config():
    """restore_lr_scheduler gives bitwise LambdaLR's lr after k steps, and the next steps' lrs;
    a changed train.lr takes effect (no process needed)."""
    import torch

    from xpar.config.schema import TrainConfig
    from xpar.parallel.optim import build_lr_scheduler, restore_lr_scheduler

    train = TrainConfig(steps=12, lr=1e-3, lr_schedule="cosine", lr_warmup_steps=2)

    def fresh(cfg):
        opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=cfg.lr)
        return opt, build_lr_scheduler(opt, cfg)
    opt, sched = fresh(train)
    want = []
    for _ in range(12):
        opt.step()
        sched.step()
        want.append(opt.param_groups[0]["lr"])
    opt, sched = fresh(train)
    assert restore_lr_scheduler(sched, opt, train, 5) == want[4] == opt.param_groups[0]["lr"]
    got = []
    for _ in range(5, 12):
        opt.step()
        sched.step()
        got.append(opt.param_groups[0]["lr"])
    assert got == want[5:]
    doubled = TrainConfig(steps=12, lr=2e-3, lr_schedule="cosine", lr_warmup_steps=2)
    opt, sched = fresh(doubled)
    assert restore_lr_scheduler(sched, opt, doubled, 5) == 2 * want[4]
