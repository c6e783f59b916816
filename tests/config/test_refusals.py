"""The catalogue of bad inputs: each is refused with exit 2, xpar's one format
(``xpar: invalid configuration:``), the expected fragment and no traceback, before any worker
starts and before any MLflow run exists. Where a message suggests an override, the test
follows it and the config is accepted.

Fast path: the entry point's own functions in-process (the pre-Hydra override check, then
:func:`xpar.run.job.run_job` on the composed config with the worker launch replaced by an
assertion); three subprocesses cover the real ``python -m xpar`` path.
"""
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.conftest import compose

TMP = tempfile.gettempdir()
EMPTY = "{empty}"  # replaced by an empty file, TEXT by a readable corpus, DIR by a folder
TEXT = "{text}"
DIR = "{dir}"

# (overrides, expected fragment, the suggested fix: overrides that must be in the message and validate)
CATALOGUE = [
    # unknown keys and groups (Hydra's exit 1 before): the closest valid key, as a working override
    ("+train.stepz=5", "did you mean train.steps=5", "train.steps=5"),
    ("train.stepz=5", "did you mean train.steps=5", "train.steps=5"),
    ("+paralel=zero3", "did you mean parallel=zero3", "parallel=zero3"),
    ("paralel=zero3", "did you mean parallel=zero3", "parallel=zero3"),
    ("steps=5", "did you mean train.steps=5", "train.steps=5"),
    ("model.hiden=32", "did you mean model.hidden=32", "model.hidden=32"),
    ("model.nheads=4", "did you mean model.n_heads=4", "model.n_heads=4"),
    ("parallel.micro_batch=4", "did you mean parallel.micro_batches=4", "parallel.micro_batches=4"),
    ("train.global_batch=8", "did you mean train.global_batch_size=8", "train.global_batch_size=8"),
    ("hardware.gpuz=A100", "did you mean hardware.gpu=A100", "hardware.gpu=A100"),
    ("tracking.experimnt=foo", "did you mean tracking.experiment=foo", "tracking.experiment=foo"),
    ("parallel.zero=3", "did you mean parallel.zero_stage=3", "parallel.zero_stage=3"),
    ("modle=small", "did you mean model=small", "model=small"),
    ("hardwre=h100_80gb_8gpu", "did you mean hardware=h100_80gb_8gpu", "hardware=h100_80gb_8gpu"),
    ("parallel.steps=20", "did you mean train.steps=20", "train.steps=20"),  # was: parallel.tp=20
    ("foo.bar=1", "'foo.bar' is not in the schema; valid: groups", None),
    ("+model.extra_layers=1", "is not in the schema", None),
    ("+parallel=zero3", "already in the defaults list; write parallel=zero3", "parallel=zero3"),
    ("+train.steps=5", "set it without '+': train.steps=5", "train.steps=5"),
    ("run=estimate", "run is not a config group", None),
    ("sweep=optuna", "sweep is not a config group", None),
    # unknown presets
    ("parallel=zero4", "unknown parallel preset 'zero4'", None),
    ("model=huge", "unknown model preset 'huge'", None),
    ("hardware=tpu_v5", "unknown hardware preset 'tpu_v5'", None),
    ("train=fast", "unknown train preset 'fast'", None),
    ("data=images", "unknown data preset 'images'", None),
    ("tracking=on", "unknown tracking preset 'on'", None),
    ("-m parallel=dp,zero9", "unknown parallel preset 'zero9'", None),
    # wrong types (Hydra's exit 1 before)
    ("parallel.tp=abc", "parallel.tp must be an integer, got 'abc'", "parallel.tp=1"),
    ("parallel.pp=two", "parallel.pp must be an integer", "parallel.pp=1"),
    ("train.steps=abc", "train.steps must be an integer", "train.steps=10"),
    ("train.steps=", "train.steps must be an integer", "train.steps=10"),
    ("-m train.steps=1,x", "train.steps must be an integer, got 'x'", None),
    ("train.lr=abc", "train.lr must be a number", None),
    ("run.progress=maybe", "run.progress must be true or false", "run.progress=true"),
    ("model.hidden=big", "model.hidden must be an integer", "model.hidden=64"),
    ("model.n_heads=2.5", "model.n_heads must be an integer", "model.n_heads=4"),
    ("hardware.nodes=1.5", "hardware.nodes must be an integer", "hardware.nodes=1"),
    ("train.micro_batch_size=x", "train.micro_batch_size must be an integer", "train.micro_batch_size=4"),
    ("train.seq_len=long", "train.seq_len must be an integer or null", "train.seq_len=null"),
    ("parallel.layer_split=abc", "parallel.layer_split must be a list or null", "parallel.layer_split=null"),
    ("parallel.tp=[1,2]", "parallel.tp must be an integer", "parallel.tp=1"),
    ("hardware.peak_tflops=fast", "hardware.peak_tflops must be a number or null", "hardware.peak_tflops=null"),
    ("tracking.enabled=perhaps", "tracking.enabled must be true or false", None),
    # an output directory Hydra cannot create (a traceback before)
    ("hydra.run.dir=/proc/xpar/run", "cannot be written", f"hydra.run.dir={TMP}/xpar/outputs"),
    ("-m hydra.sweep.dir=/proc/xpar/sweep", "cannot be written", f"hydra.sweep.dir={TMP}/xpar/multirun"),
    ("hydra.run.dir=/etc/hostname/run", "is not a directory", f"hydra.run.dir={TMP}/xpar/outputs"),
    # the model
    ("model.n_heads=0", "model.n_heads must be >= 1, got 0", None),
    ("model.hidden=0", "model.hidden must be >= 1, got 0", None),
    ("model.n_layers=0", "model.n_layers must be >= 1", None),
    # sliding-window attention (issue 42): a pattern without a window, or one leaving no local or no full layer
    ("model.sliding_window_pattern=2", "needs model.sliding_window > 0", "model.sliding_window_pattern=0"),
    ("model.sliding_window=16 model.sliding_window_pattern=1", "makes every layer full attention",
     "model.sliding_window_pattern=0"),
    ("model.sliding_window=16 model.sliding_window_pattern=5", "leaves no full layer among model.n_layers=4",
     "model.sliding_window_pattern=2"),
    ("model.sliding_window=-8", "model.sliding_window must be an integer >= 0", "model.sliding_window=0"),
    ("model.vocab_size=0", "model.vocab_size must be >= 1", None),
    ("model.ffn_hidden=0", "model.ffn_hidden must be >= 1", None),
    ("model.seq_len=0", "model.seq_len must be >= 1", None),
    ("model.hidden=66", "model.hidden must be divisible by model.n_heads", None),
    ("model.n_heads=6", "model.hidden must be divisible by model.n_heads", None),
    ("model.n_kv_heads=3", "n_kv_heads values that work: [1, 2, 4]", None),
    ("model.n_kv_heads=0", "model.n_heads must be divisible by model.n_kv_heads", None),
    ("model.hidden=12", "rope needs an even head dim", None),
    ("model.activation=tanh", "model.activation must be one of ['swiglu', 'gelu', 'relu', 'squared_relu']", None),
    ("model.norm=batchnorm", "model.norm must be one of", None),
    ("model.position=alibi", "model.position=alibi is estimated, not executed", "model.position=rope"),
    ("train.compile=true", "train.compile=true is estimated, not executed", "train.compile=false"),
    ("train.compile_loss=true", "train.compile_loss=true is estimated, not executed", "train.compile_loss=false"),
    ("model.position=sinusoidal", "model.position must be one of", None),
    ("model.position=learned train.seq_len=128", "train.seq_len must be in [1, 64]", None),
    # the layout
    ("parallel.zero_stage=4", "parallel.zero_stage must be one of [0, 1, 2, 3]", None),
    ("parallel.schedule=foo", "parallel.schedule must be one of", None),
    ("parallel.recompute=some", "parallel.recompute must be one of", None),
    ("parallel.micro_batches=abc", "parallel.micro_batches must be an integer >= 1 or 'auto', got 'abc'",
     "parallel.micro_batches=auto"),
    ("parallel.micro_batches=1.5", "parallel.micro_batches must be an integer >= 1 or 'auto', got 1.5",
     "parallel.micro_batches=auto"),
    ("parallel.micro_batches=0", "parallel.micro_batches must be an integer >= 1", None),
    ("parallel.dp=0", "parallel.dp must be an integer >= 1", "parallel.dp=auto"),
    ("parallel.dp=abc", "parallel.dp must be an integer >= 1 or 'auto'", None),
    ("parallel.virtual_stages=0", "parallel.virtual_stages must be an integer >= 1", "parallel.virtual_stages=auto"),
    ("parallel.tp=0", "parallel.tp must be >= 1, got 0", "parallel.tp=1"),
    ("parallel.pp=0", "parallel.pp must be >= 1, got 0", "parallel.pp=1"),
    ("train.global_batch_size=0", "train.global_batch_size must be an integer >= 1", None),
    ("train.global_batch_size=7", "train.global_batch_size=7 must be divisible by micro-batch size x dp", None),
    ("parallel.sequence_parallel=true", "parallel.sequence_parallel=true needs parallel.tp > 1",
     "parallel.sequence_parallel=false"),
    ("parallel=pp parallel.layer_split=[4,1]", "each >= 1 but the first and last", None),
    ("parallel=pp parallel.layer_split=[1,1,0,0]", "each >= 1", None),
    ("parallel=pp parallel.layer_split=[2.5,1.5]", "whole numbers of layers per stage", None),
    ("model.n_layers=2 parallel=pp parallel.schedule=interleaved_1f1b parallel.virtual_stages=2",
     "fewer than the 4 pipeline stages", "model.n_layers=4"),
    ("parallel=pp parallel.schedule=1f1b parallel.micro_batches=1", "micro_batches=1", None),
    ("parallel=pp model.tied_embeddings=true", "set model.tied_embeddings=false", "model.tied_embeddings=false"),
    ("parallel.reference_hardware=foo", "parallel.reference_hardware='foo' is not a hardware preset", None),
    ("run.mode=execute hardware=h100_80gb_8gpu", "run.mode=execute needs the devices", "run.mode=estimate"),
    ("hardware=h100_80gb_8gpu parallel.dp=3", "dp*tp*pp must equal the world size", "parallel.dp=auto"),
    ("model=70b parallel=zero3", "does not fit this machine", None),
    # the step loop
    ("parallel.cp=3 parallel.dp=1 run.mode=estimate hardware.devices_per_node=3",  # cp 3 on 3 devices, seq_len 64
     "no cp > 1 on these devices splits seq_len=64; or keep cp=3 with train.seq_len=60 (or 66)", "train.seq_len=60"),
    ("train.steps=0", "train.steps must be > 0, got 0", "train.steps=10"),
    ("train.steps=-1", "train.steps must be > 0", "train.steps=10"),
    ("train.warmup_steps=10", "train.warmup_steps must satisfy 0 <= warmup_steps < steps", None),
    ("train.warmup_steps=-1", "train.warmup_steps must satisfy", None),
    ("train.lr=0", "train.lr must be > 0, got 0.0", "train.lr=3e-4"),
    ("train.lr=-1", "train.lr must be > 0", "train.lr=3e-4"),
    ("train.weight_decay=-1", "train.weight_decay must be >= 0", None),
    ("train.micro_batch_size=0", "train.micro_batch_size must be >= 1", "train.micro_batch_size=1"),
    ("train.dtype=fp16", "train.dtype must be one of ['fp32', 'bf16', 'fp8']", None),
    ("train.max_grad_norm=0", "train.max_grad_norm must be > 0 or null", None),
    ("train.lr_schedule=linear", "train.lr_schedule='linear' is unknown", None),
    ("train.lr_warmup_steps=100", "train.lr_warmup_steps must satisfy", "train.lr_warmup_steps=1"),
    ("train.min_lr_ratio=2", "train.min_lr_ratio must be in [0, 1]", None),
    ("train.threads_per_worker=0", "train.threads_per_worker must be >= 1 or null", None),
    ("train.seq_len=100000", "pass run.allow_long=true", "run.allow_long=true"),
    ("run.mode=train", "run.mode must be one of", None),
    ("run.collective_timeout_s=0", "run.collective_timeout_s must be > 0", None),
    ("run.heartbeat_timeout_s=1", "run.heartbeat_timeout_s must be >= 5", None),
    # hardware values: 0 was treated as infinitely fast, or dropped under a cluster preset
    ("hardware.peak_tflops=0", "hardware.peak_tflops must be > 0 or null", "hardware.peak_tflops=null"),
    ("hardware.peak_tflops=-5", "hardware.peak_tflops must be > 0 or null", "hardware.peak_tflops=null"),
    # off hardware=local nothing measures the peak or detects memory: 0 and null are refused with the
    # preset's own figure (null made the matmul time 0, or every layout "fit"; 0 suggested null)
    ("hardware=h100_80gb_8gpu hardware.peak_tflops=0", "got 0.0 on hardware=h100_80gb_8gpu",
     "hardware.peak_tflops=989"),
    ("hardware=a100_80gb_64gpu hardware.peak_tflops=-5", "A100 312, H100 SXM 989", "hardware.peak_tflops=312"),
    ("parallel=3d model=70b hardware=a100_80gb_64gpu hardware.peak_tflops=null",
     "hardware.peak_tflops=null on hardware=a100_80gb_64gpu: xpar measures a peak only on hardware=local",
     "hardware.peak_tflops=312"),
    ("hardware=h100_80gb_8gpu hardware.hbm_tb_per_s=0", "hardware.hbm_tb_per_s must be > 0", "hardware.hbm_tb_per_s=3.35"),
    ("hardware=h100_80gb_8gpu hardware.intra_node_gb_per_s=0", "hardware.intra_node_gb_per_s must be > 0",
     "hardware.intra_node_gb_per_s=450"),
    ("hardware=b200_180gb_node hardware.deepep_nvl_gb_per_s=0", "hardware.deepep_nvl_gb_per_s must be > 0 or null "
     "(null: DeepEP at intra_node_gb_per_s x link_efficiency)", "hardware.deepep_nvl_gb_per_s=500.8"),
    ("hardware=h100_80gb_64gpu hardware.inter_node_gb_per_s=0",
     "hardware.inter_node_gb_per_s must be > 0 or null (null: on one node only), got 0.0 on hardware=h100_80gb_64gpu",
     "hardware.inter_node_gb_per_s=50"),
    ("hardware=a100_80gb_64gpu hardware.inter_node_gb_per_s=null", "priced at the intra-node link's 300 GB/s",
     "hardware.inter_node_gb_per_s=25"),
    ("hardware=a100_80gb_64gpu hardware.inter_node_gb_per_s=null", "hardware.inter_node_gb_per_s=null on",
     "hardware.nodes=1"),
    ("hardware=h100_80gb_8gpu hardware.device_memory_gb=0", "hardware.device_memory_gb must be > 0",
     "hardware.device_memory_gb=85"),
    ("parallel=3d model=70b hardware=a100_80gb_64gpu hardware.device_memory_gb=null",
     "hardware.device_memory_gb=null on hardware=a100_80gb_64gpu", "hardware.device_memory_gb=85"),
    ("hardware.device_memory_gb=-1", "hardware.device_memory_gb must be > 0", "hardware.device_memory_gb=null"),
    # latencies and host overheads add to the step: a negative one gave a negative step time (MFU -21 %)
    ("hardware=a100_80gb_64gpu hardware.intra_node_latency_us=-1000", "hardware.intra_node_latency_us must be >= 0",
     "hardware.intra_node_latency_us=3.4"),
    ("hardware=a100_80gb_64gpu hardware.inter_node_latency_us=-1", "hardware.inter_node_latency_us must be >= 0",
     "hardware.inter_node_latency_us=9.6"),
    ("hardware=a100_80gb_64gpu hardware.collective_latency_us=-1", "hardware.collective_latency_us must be >= 0",
     "hardware.collective_latency_us=8.4"),
    ("hardware=a100_80gb_64gpu hardware.p2p_latency_us=-1", "hardware.p2p_latency_us must be >= 0",
     "hardware.p2p_latency_us=null"),
    ("hardware.op_overhead_us=-1", "hardware.op_overhead_us must be >= 0", "hardware.op_overhead_us=0"),
    ("hardware.dtensor_op_overhead_us=-1", "hardware.dtensor_op_overhead_us must be >= 0",
     "hardware.dtensor_op_overhead_us=0"),
    ("hardware.fsdp_unit_overhead_us=-1", "hardware.fsdp_unit_overhead_us must be >= 0",
     "hardware.fsdp_unit_overhead_us=0"),
    # a NIC count of 0 was read as one per device, -8 sped the step up
    ("hardware=a100_80gb_64gpu hardware.nics_per_node=0", "hardware.nics_per_node must be an integer >= 1 or null",
     "hardware.nics_per_node=8"),
    ("hardware=a100_80gb_64gpu hardware.nics_per_node=-8", "got -8", "hardware.nics_per_node=8"),
    ("hardware.nics_per_node=0", "hardware.nics_per_node must be an integer >= 1 or null", "hardware.nics_per_node=null"),
    # optimizer offload's host figures (issue 11.2: 0 and negatives were accepted)
    ("hardware=a100_80gb_8gpu hardware.pcie_gb_per_s=0", "hardware.pcie_gb_per_s must be > 0 or null",
     "hardware.pcie_gb_per_s=12.5"),
    ("hardware=a100_80gb_8gpu hardware.host_mem_gb_per_s=-1", "hardware.host_mem_gb_per_s must be > 0 or null",
     "hardware.host_mem_gb_per_s=409.6"),
    ("hardware=a100_80gb_8gpu hardware.host_memory_gb=0", "hardware.host_memory_gb must be > 0 or null",
     "hardware.host_memory_gb=2000"),
    ("hardware.pcie_gb_per_s=0", "hardware.pcie_gb_per_s must be > 0 or null", "hardware.pcie_gb_per_s=null"),
    ("framework.offload=[maybe]", "framework.offload=[maybe]: [maybe] not allowed", "framework.offload=[false,true]"),
    ("framework.optimizer_bytes=-1", "framework.optimizer_bytes=-1 must be 0", "framework.optimizer_bytes=12"),
    ("hardware=h100_80gb_8gpu hardware.nodes=0", "hardware.nodes must be >= 1", "hardware.nodes=1"),
    ("hardware.devices_per_node=0", "hardware.devices_per_node must be an integer >= 1 or 'auto'",
     "hardware.devices_per_node=auto"),
    ("hardware.matmul_efficiency=0", "hardware.matmul_efficiency must be in (0, 1]", "hardware.matmul_efficiency=0.7"),
    ("hardware.link_efficiency=2", "hardware.link_efficiency must be in (0, 1]", "hardware.link_efficiency=0.7"),
    ("hardware.framework_overhead_gb=-1", "hardware.framework_overhead_gb must be >= 0", None),
    ("parallel=7b_8gpu hardware.peak_tflops=500", "would not apply",
     "hardware=a100_80gb_8gpu hardware.peak_tflops=500.0"),
    # this machine: device, data files, store and artifact directories
    ("hardware.device=cuda", "is a CPU build", "hardware.device=cpu"),
    ("hardware.device=cuda run.mode=estimate", "is a CPU build", "hardware.device=cpu"),
    ("hardware.device=tpu", "hardware.device must be one of", None),
    ("data=text", "data.path must be an existing text file", "data=synthetic"),  # was: no value that works
    ("data=text data.path=/nonexistent/corpus.txt", "data.path must be an existing text file", None),
    (f"data=text data.path={EMPTY}", "holds fewer than seq_len+1=65 bytes", None),
    (f"data=text data.path={DIR}", "data.path must be an existing text file", None),
    (f"data=text data.path={TEXT} model.vocab_size=128", "model.vocab_size must be >= 256", None),
    (f"data.path={TEXT}", "ignores it", f"data=text data.path={TEXT}"),
    ("data.kind=images", "data.kind must be one of", None),
    ("tracking.uri=sqlite:////proc/xpar/mlflow.db", "cannot be written", "tracking=off"),
    ("tracking.uri=sqlite:////etc/hostname/mlflow.db", "cannot be written", "tracking=off"),
    ("tracking.artifact_location=/proc/xpar/artifacts", "artifact directory /proc/xpar/artifacts cannot be written",
     "tracking=off"),
    ("tracking.artifact_location=file:///proc/xpar/artifacts", "cannot be written", "tracking=off"),
    # issue 28: empty paths wrote into the start directory; tracebacks; silently ignored keys; failing advice
    ("hydra.run.dir=", "hydra.run.dir is set but empty", "hydra.run.dir=outputs/mine"),
    ("train.checkpoint_dir=", "train.checkpoint_dir is set but empty", "train.checkpoint_dir=null"),
    ("tracking.uri=", "tracking.uri is set but empty", "tracking.uri=null"),
    ("tracking.artifact_location=", "tracking.artifact_location is set but empty", "tracking.artifact_location=null"),
    ("tracking.experiment=", "tracking.experiment is set but empty", "tracking.experiment=xpar"),
    ("train.checkpoint_every=1 train.checkpoint_dir=/proc/xpar/ckpt", "train.checkpoint_dir=/proc/xpar/ckpt is not "
     "writable", None),
    ("train.threads_per_worker=-1", "train.threads_per_worker must be >= 1 or null", None),
    ("run.fail_rank=7", "run.fail_rank must be a rank of this run, 0..1", "run.fail_rank=1"),
    ("run.fail_rank=-1", "run.fail_rank must be a rank of this run", "run.fail_rank=1"),
    ("run.fail_rank=0 run.mode=estimate hardware=h100_80gb_8gpu", "starts no worker", "run.fail_rank=null"),
    ("sweep.goal=sideways", "sweep.goal must be one of ['max', 'min']", None),
    ("sweep.metric=throughput/tokens_per_sec", "is not a metric xpar logs",
     "sweep.metric=throughput/tokens_per_s"),
    ("train.on_nonfinite=warn", "train.on_nonfinite must be one of ['stop', 'skip', 'ignore']", None),
    ("train.seq_len=0", "train.seq_len must be >= 1, got 0", "train.seq_len=64"),
    ("-m hydra/launcher=slurm", "hydra/launcher=slurm needs SLURM on this host", None),
    ("train.log_every=0", "train.log_every must be >= 1", "train.log_every=10"),
    ("parallel=pp parallel.first_stage_layers=5", "values that work: 0 .. 3", "parallel.first_stage_layers=3"),
    ("parallel=pp parallel.layer_split=[0,3,1]", "each >= 1 but the first and last (>= 0: embedding or head alone)",
     None),
    ("parallel=pp parallel.last_stage_layers=0 parallel.layer_split=[2,2]", "both set the stages' layers", None),
    ("compre", "'compre' is neither a command (compare, plan, calibrate, sync, help) nor an override (key=value): "
               "did you mean `xpar compare`?", None),
    ("parallel=zero3 trainsteps", "did you mean train.steps=<value>?", None),
]


def _argv(case: str, files: dict) -> list[str]:
    for mark, path in files.items():
        case = case.replace(mark, str(path))
    return case.split()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    (d / "empty.txt").write_text("")
    (d / "corpus.txt").write_text("hello world. " * 200)
    (d / "folder").mkdir()
    return {EMPTY: d / "empty.txt", TEXT: d / "corpus.txt", DIR: d / "folder"}


def refusal(argv: list[str], start: Path, monkeypatch, capsys) -> tuple[int, str]:
    """What ``python -m xpar argv`` does up to the first worker, in-process: the pre-Hydra
    override check, then run_job on the composed config. A worker launch fails the test."""
    import xpar.run.launch
    from xpar.config.overrides import refuse_bad_overrides
    from xpar.run.job import run_job

    def no_worker(*a, **k):
        raise AssertionError("a worker was started")
    monkeypatch.setattr(xpar.run.launch, "launch_local", no_worker)
    monkeypatch.chdir(start)
    try:
        refuse_bad_overrides(argv)
        overrides = [a for a in argv if a not in ("-m", "--multirun")]
        cfg = compose("run.progress=false", *overrides)
        run_job(cfg, start / "out", start)
    except SystemExit as e:
        return e.code, capsys.readouterr().err
    raise AssertionError(f"accepted: {argv}")


def _accepted(argv: list[str]) -> bool:
    from xpar.config.overrides import override_problems
    from xpar.estimate.preflight.check import check_run

    if override_problems(argv):
        return False
    if any(a.startswith("hydra.") for a in argv):
        return True  # the output directory: the override check is the whole check
    check_run(compose("run.progress=false", *[a for a in argv if a not in ("-m", "--multirun")]))
    return True


def test_catalogue_is_large():
    assert len(CATALOGUE) >= 100


FAST_SAMPLE = 5
"""The fast loop runs every 5th case of the catalogue (its first included); the full suite runs all of
them (153 cases: ~50 s of one core, conftest.INTEGRATION)."""


def _catalogue_params():
    return [pytest.param(*c, id=c[0][:60], marks=() if i % FAST_SAMPLE == 0 else pytest.mark.slow)
            for i, c in enumerate(CATALOGUE)]


@pytest.mark.parametrize("case,fragment,fix", _catalogue_params())
def test_bad_input_is_refused_in_one_format(case, fragment, fix, files, tmp_path, monkeypatch, capsys):
    argv = _argv(case, files)
    code, err = refusal(argv, tmp_path, monkeypatch, capsys)
    assert code == 2, err
    assert err.startswith("xpar: invalid configuration:") or "\nxpar: invalid configuration:" in err, err
    assert "Traceback" not in err and fragment in err, err
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "mlartifacts").exists()
    assert not list(tmp_path.glob("out/worker_*"))
    if fix is not None:
        from xpar.config.overrides import override_problems
        fix_argv = _argv(fix, files)
        assert " ".join(fix_argv) in err, err  # the message says exactly this
        keys = {a.split("=")[0].lstrip("+") for a in fix_argv}
        kept = [a for a in argv if a.split("=")[0].lstrip("+") not in keys and not override_problems([a])]
        assert _accepted(kept + fix_argv), (kept, fix_argv)


def _run(args, cwd, **kw):
    return subprocess.run([sys.executable, "-m", "xpar", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, PYTHONPATH=str(Path(__file__).parents[2])), **kw)


@pytest.mark.slow
def test_unknown_key_and_group_exit_2_from_the_command_line(tmp_path):
    """Issue 12 item 4: a key not in the schema names the closest valid key; no run, no folder."""
    r = _run(["+train.stepz=5", "+paralel=zero3"], tmp_path)
    assert r.returncode == 2, r.stderr
    assert "did you mean train.steps=5?" in r.stderr and "did you mean parallel=zero3?" in r.stderr
    assert "Traceback" not in r.stderr and "Hydra" not in r.stderr
    assert list(tmp_path.iterdir()) == []  # no outputs/, no mlflow.db


@pytest.mark.slow
@pytest.mark.parametrize("args,fragment", [
    (["model.n_heads=0", "run.progress=false"], "model.n_heads must be >= 1, got 0"),
    (["hardware.device=cuda", "parallel.tp=2", "parallel.dp=1"], "is a CPU build"),
])
def test_tracebacks_of_old_are_refusals_from_the_command_line(args, fragment, tmp_path):
    r = _run(args, tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("xpar: invalid configuration:") and fragment in r.stderr, r.stderr
    assert not (tmp_path / "mlflow.db").exists() and not list(tmp_path.glob("outputs/*/worker_*"))


@pytest.mark.slow  # integration-sized (conftest.INTEGRATION): runs in the full suite, not the fast loop
def test_compare_refuses_in_one_line_and_seconds(tmp_path, capsys, monkeypatch):
    """`xpar compare`: a bad filter, an unknown sweep id, a missing store, an unreachable server
    and an unwritable output folder: exit 2, one line, in seconds (an unreachable URI took 250 s)."""
    import time

    import mlflow

    from xpar.run.launch import free_port
    from xpar.track.compare import main

    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = mlflow.tracking.MlflowClient(uri)
    exp = client.create_experiment("xpar")
    run = client.create_run(exp, tags={"xpar.role": "sweep", "xpar.sweep_id": "abc12345"})
    client.set_terminated(run.info.run_id)
    cases = [(["--uri", uri, "--filter", "metrics.x >>> 1"], "is not a valid MLflow search filter"),
             (["--uri", uri, "--sweep", "nosuch"], "sweep ids there: abc12345"),
             (["--uri", f"sqlite:///{tmp_path / 'none.db'}"], "no tracking store at"),
             (["--uri", f"http://127.0.0.1:{free_port()}"], "does not answer"),
             (["--uri", uri, "--out", "/proc/xpar/cmp"], "cannot be written")]
    for args, fragment in cases:
        t0 = time.monotonic()
        assert main(args) == 2, args
        err = "".join(ln for ln in capsys.readouterr().err.splitlines(True) if " INFO " not in ln)  # MLflow's log
        assert time.monotonic() - t0 < 10, args
        assert err.count("\n") == 1 and err.startswith("xpar: invalid configuration: ") and fragment in err, err


def test_compare_filter_example_survives_a_shell(tmp_path, capsys):
    """The bad-filter refusal's example works when pasted into bash: it printed
    --filter "tags.`xpar.mode` = 'estimate'", whose backticks bash runs as a command inside double
    quotes (the filter became "tags. = 'estimate'": 'no runs match'). Single quotes keep them; the
    value MLflow then gets finds an estimate run (test_compare_filter_example_finds_runs)."""
    import re

    from xpar.track.refusals import FILTER_EXAMPLE

    assert re.fullmatch(r"--filter '[^']*'", FILTER_EXAMPLE), FILTER_EXAMPLE  # no expansion inside '...'


@pytest.mark.slow  # integration-sized (conftest.INTEGRATION): a new SQLite store, ~20 s on 2 cores
def test_compare_filter_example_finds_runs(tmp_path, capsys):
    """The example's value, as a shell passes it, is a filter MLflow takes and matches with."""
    import shlex

    import mlflow

    from xpar.track.compare import main
    from xpar.track.refusals import FILTER_EXAMPLE

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = mlflow.tracking.MlflowClient(uri)
    exp = client.create_experiment("xpar")
    run = client.create_run(exp, tags={"xpar.mode": "estimate", "xpar.layout": "dp1-tp1-pp1-zero0-m1-b1"})
    client.log_metric(run.info.run_id, "throughput/tokens_per_s", 1.0)
    client.set_terminated(run.info.run_id)
    assert main(["--uri", uri, "--out", str(tmp_path / "cmp"), *shlex.split(FILTER_EXAMPLE)]) == 0
    assert (tmp_path / "cmp" / "table.csv").read_text().count("\n") == 2  # header and the one run


def test_duration_check_warns_refuses_and_stays_out_of_the_way(capsys):
    """Above a minute per step: a warning; above an hour of training: refused unless
    run.allow_long; without a peak to estimate with (local CUDA): no check, no crash."""
    from dataclasses import replace

    from tests.conftest import spec_for
    from xpar.estimate.preflight.duration import duration_problems

    spec = spec_for("train.seq_len=100000", "run.allow_long=true")
    assert "pass run.allow_long=true" in duration_problems(spec)[0]
    assert "per step on this machine" in capsys.readouterr().err
    assert duration_problems(spec, {"run": {"allow_long": True}}) == []
    assert duration_problems(replace(spec, hardware=replace(spec.hardware, peak_tflops=None))) == []
    capsys.readouterr()
    assert duration_problems(spec_for()) == [] and capsys.readouterr().err == ""


def test_a_refused_hardware_value_is_not_suggested_again(files, tmp_path, monkeypatch, capsys):
    """Under a cluster preset's reference hardware, a refused figure was also put on the "would
    not apply ... pass it explicitly" line with the refused value (hardware.device_memory_gb=0.0):
    now it has its own line only, and a valid change keeps the pass-it-explicitly line."""
    code, err = refusal(["parallel=3d", "hardware.device_memory_gb=0"], tmp_path, monkeypatch, capsys)
    assert code == 2 and "hardware.device_memory_gb must be > 0 or null" in err
    assert "would not apply" not in err and "device_memory_gb=0.0" not in err.split("got 0.0")[1], err
    code, err = refusal(["parallel=3d", "hardware.device_memory_gb=0", "hardware.nodes=4"], tmp_path, monkeypatch, capsys)
    assert "pass it explicitly to change it: hardware=a100_80gb_64gpu hardware.nodes=4." in err, err


def test_an_estimate_of_a_local_gpu_without_a_peak_is_refused(monkeypatch):
    """hardware=local on a CUDA device: xpar measures no GPU peak (resolve_hardware leaves None),
    so an estimate would price every matmul at 0 s; refused with the datasheet figures, and
    accepted once hardware.peak_tflops is given. (A GPU is simulated: this torch is a CPU build.)"""
    from dataclasses import replace

    import xpar.config.resolve
    from tests.conftest import spec_for
    from xpar.config.checks import ConfigError

    real = xpar.config.resolve.resolve_hardware

    def as_gpu(hw, *a, **k):
        return replace(real(hw, *a, **k), device="cuda", peak_tflops=hw.peak_tflops)
    monkeypatch.setattr(xpar.config.resolve, "resolve_hardware", as_gpu)  # where validation looks it up
    with pytest.raises(ConfigError) as e:
        spec_for("run.mode=estimate")
    msg = str(e.value)
    assert "hardware.peak_tflops=null on hardware=local with device cuda" in msg and "A100 312, H100 SXM 989" in msg
    assert "e.g. hardware.peak_tflops=312, or run.mode=execute" in msg
    s = spec_for("run.mode=estimate", "hardware.peak_tflops=312")
    assert s.hardware.peak_tflops == 312 and s.hardware.device == "cuda"


def test_plan_refuses_null_device_memory_instead_of_a_traceback(capsys):
    """`xpar plan ... hardware.device_memory_gb=null` on a GPU preset ended in a TypeError in
    nothing_fits_line (exit 1): now exit 2 with the preset's figure."""
    from tests.plan.test_plan import refusal as plan_refusal

    err = plan_refusal(capsys, "model=70b", "hardware=a100_80gb_8gpu", "hardware.device_memory_gb=null")
    assert "hardware.device_memory_gb=null on hardware=a100_80gb_8gpu" in err
    assert "e.g. hardware.device_memory_gb=85 (the preset's figure)" in err
    err = plan_refusal(capsys, "model=70b", "hardware=a100_80gb_8gpu", "hardware.peak_tflops=null")
    assert "e.g. hardware.peak_tflops=312 (the preset's figure)" in err


@pytest.mark.slow
def test_empty_run_dir_variable_is_refused_and_nothing_is_written(tmp_path):
    """XPAR_RUN_DIR= (set but empty) resolved hydra.run.dir to '' (omegaconf#1179): every file of
    the run went into the start directory. Refused before Hydra starts; the directory stays empty."""
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[2]), XPAR_RUN_DIR="")
    r = subprocess.run([sys.executable, "-m", "xpar"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env=env)
    assert r.returncode == 2 and "XPAR_RUN_DIR is set but empty" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("meta", ["{}", '{"step": "x", "model": {}}', '{"step": -1, "model": {}}', "[]"])
def test_a_checkpoint_meta_xpar_did_not_write_is_refused(tmp_path, meta):
    """xpar.json of {} or a non-integer step raised KeyError/TypeError in the resume checks."""
    from xpar.run.checkpoint import CheckpointError, read_meta

    (tmp_path / "xpar.json").write_text(meta)
    with pytest.raises(CheckpointError, match="is not one xpar wrote"):
        read_meta(tmp_path)


def test_a_refused_execute_checks_the_layout_on_the_named_cluster(tmp_path, monkeypatch, capsys):
    """run.mode=execute of a cluster preset is refused for its devices; the layout's other checks
    used dp resolved on one node (dp 1), so an ep line said 'ep values that work: [1]' of a layout
    that is right on its cluster. Now they see the named cluster's world (2,048 devices)."""
    code, err = refusal(["parallel=deepseek_v3_2048gpu", "run.mode=execute"], tmp_path, monkeypatch, capsys)
    assert code == 2 and "run.mode=execute needs the devices of hardware=h800_80gb_2048gpu" in err
    assert "parallel.ep=64 must divide" not in err and "dp=1" not in err, err
