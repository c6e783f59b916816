"""Every preset composes; parameter counts match the published ones; validation names the
violated constraint with the values given and values that would work."""
import subprocess
import sys

import pytest

from tests.conftest import compose, spec_for
from xpar.config.presets import check_presets, presets
from xpar.config.validate import ConfigError, to_schema
from xpar.models.shapes import param_count

PUBLISHED = {"7b": 6.74e9, "13b": 13.02e9, "70b": 68.98e9, "175b": 174.6e9, "405b": 405.9e9, "small": 124.4e6}


@pytest.mark.parametrize("name,count", sorted(PUBLISHED.items()))
def test_param_count_matches_published(name, count):
    cfg = to_schema(compose(f"model={name}")).model
    assert param_count(cfg).total == pytest.approx(count, rel=0.005)


def test_param_count_equals_built_model():
    import torch

    from xpar.models.transformer import Transformer
    for name in ("tiny", "small", "70b"):
        cfg = to_schema(compose(f"model={name}")).model
        with torch.device("meta"):
            assert sum(p.numel() for p in Transformer(cfg).parameters()) == param_count(cfg).total


OTHER_TESTS_PRESETS = "calibrated_pytest"
"""Presets that tests/calibrate/test_calibrate.py and tests/plan/test_plan.py write and remove while another pytest
worker may be listing the group (-n 2): not this test's to compose."""


@pytest.mark.slow  # integration-sized (conftest.INTEGRATION): runs in the full suite, not the fast loop
@pytest.mark.parametrize("group", ["model", "parallel", "hardware", "train", "data", "tracking"])
def test_every_preset_composes(group):
    names = [n for n in presets(group) if not n.startswith(OTHER_TESTS_PRESETS)]
    assert names
    for name in names:
        c = to_schema(compose(f"{group}={name}", "data.path=README.md"))
        assert getattr(c, group) is not None


def test_default_run_resolves():
    s = spec_for()
    assert (s.mode, s.dp, s.world_size, s.global_batch, s.micro_batches) == ("execute", 2, 2, 8, 1)


def _problems(*overrides, local_devices=2):
    with pytest.raises(ConfigError) as e:
        spec_for(*overrides, local_devices=local_devices)
    return str(e.value)


def test_global_batch_must_equal_b_m_dp():
    msg = _problems("train.global_batch_size=30", "parallel.micro_batches=auto")
    assert "global_batch_size=30 must be divisible by micro-batch size x dp = 4 x 2 = 8" in msg
    msg = _problems("train.global_batch_size=32", "parallel.micro_batches=2")
    assert "32 != 4 x 2 x 2 = 16" in msg and "train.global_batch_size=16" in msg


def test_steps_and_warmup():
    assert "train.steps must be > 0, got 0" in _problems("train.steps=0")
    msg = _problems("train.steps=3", "train.warmup_steps=3")
    assert "0 <= warmup_steps < steps" in msg and "warmup_steps=2" in msg


def test_a_negative_step_count_is_one_line_with_a_working_value():
    """train.steps=-3 was refused twice: its own line, and an lr-warmup line suggesting 'e.g. -3'."""
    msg = _problems("train.steps=-3")
    assert "train.steps must be > 0, got -3; e.g. train.steps=10." in msg
    assert "lr_warmup_steps" not in msg and "e.g. -3" not in msg
    msg = _problems("train.lr_warmup_steps=20")  # steps=10: the suggestion is an override that validates
    assert "e.g. train.lr_warmup_steps=1." in msg
    assert spec_for("train.lr_warmup_steps=1").train.lr_warmup_steps == 1


def test_heads_not_divisible_by_kv_heads():
    msg = _problems("model.n_kv_heads=3")
    assert "n_heads must be divisible by model.n_kv_heads" in msg and "[1, 2, 4]" in msg


def test_text_path_must_exist():
    msg = _problems("data=text", "data.path=/no/such/file.txt")
    assert "data.path must be an existing text file" in msg and "/no/such/file.txt" in msg


def test_world_size_under_torchrun(monkeypatch):
    for k, v in {"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "WORLD_SIZE": "6", "LOCAL_RANK": "0",
                 "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(k, v)
    msg = _problems("parallel.dp=4")
    assert "dp*tp*pp must equal the world size" in msg and "WORLD_SIZE=6" in msg and "dp=6" in msg


def test_all_problems_reported_together():
    msg = _problems("train.steps=0", "model.n_kv_heads=3")
    assert "train.steps" in msg and "n_kv_heads" in msg


def test_model_too_large_for_this_machine_is_refused():
    msg = _problems("model=70b", "parallel=zero3")
    assert "does not fit this machine" in msg and "xpar plan model=70b hardware=b200_180gb_node" in msg, msg


def test_a_model_this_machine_cannot_hold_is_sent_where_its_estimate_or_plan_fits():
    """python -m xpar model=7b said 'or estimate it: run.mode=estimate hardware=a100_40gb_node parallel.dp=auto',
    which was refused again (305 GB per device at fp32, micro-batch 4, ZeRO-0 on any preset): the estimate line
    is offered only where it passes when followed, else the plan on the smallest preset whose memory holds
    the model's mixed-precision AdamW states (1.1 TB for 70B: not a100_40gb_node's 320 GB)."""
    from xpar.config.checks.hardware import load_hardware_preset
    from xpar.models.shapes import param_count

    msg = _problems("model=small", "parallel.dp=1000")
    assert "or estimate it: run.mode=estimate hardware=a100_40gb_node parallel.dp=auto." in msg, msg
    assert spec_for("model=small", "run.mode=estimate", "hardware=a100_40gb_node", "parallel.dp=auto").world_size == 8
    for model, preset in (("7b", "a100_40gb_node"), ("70b", "b200_180gb_node")):
        msg = _problems(f"model={model}")
        assert f"(it fits none as it is): xpar plan model={model} hardware={preset}." in msg, msg
        hw = load_hardware_preset(preset)
        states = 16 * param_count(spec_for(f"model={model}", "run.mode=estimate", "hardware=b200_180gb_64gpu",
                                           "parallel.zero_stage=3", "parallel.recompute=full", "train=cluster").model).total
        assert hw.devices_per_node * hw.nodes * hw.device_memory_gb * 1e9 >= states


def test_unknown_preset_names_the_valid_ones(capsys):
    with pytest.raises(SystemExit) as e:
        check_presets(["parallel=zero4"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "unknown parallel preset 'zero4'" in err and "zero3" in err


@pytest.mark.slow
def test_bad_input_exits_2_without_traceback(tmp_path):
    r = subprocess.run([sys.executable, "-m", "xpar", "train.steps=0", "model.n_kv_heads=3"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and "train.steps must be > 0" in r.stderr
    assert not (tmp_path / "mlflow.db").exists()  # refused before anything ran or was logged


def test_learning_rate_and_fractional_layer_split_are_refused():
    assert "train.lr must be > 0, got -1.0" in _problems("train.lr=-1")
    msg = _problems("parallel=pp", "parallel.layer_split=[2.5,1.5]")
    assert "whole numbers of layers per stage, got [2.5, 1.5]; e.g. [2, 2]" in msg


def test_unusable_tracking_store_is_a_clear_error(tmp_path):
    from xpar.track.runs import TrackingUnavailable, setup_experiment
    with pytest.raises(TrackingUnavailable) as e:
        setup_experiment("foo://bar", "xpar", None, tmp_path)
    assert "tracking.uri=foo://bar" in str(e.value) and "tracking=off" in str(e.value)


def test_a_tracking_uri_that_is_a_path_is_told_its_sqlite_uri(tmp_path):
    """tracking.uri=other.db (a path, no scheme) said 'The store is healthy and refused a value: fix it (e.g. a
    shorter tracking.experiment...)': MLflow 3 reads a bare path as its file store and refuses it. The advice
    is the SQLite URI of that file, and following it records."""
    from xpar.track.runs import TrackingUnavailable, setup_experiment
    with pytest.raises(TrackingUnavailable) as e:
        setup_experiment("other.db", "xpar", None, tmp_path)
    fix = f"tracking.uri=sqlite:///{(tmp_path / 'other.db').resolve()}"
    assert fix in str(e.value) and "healthy" not in str(e.value), str(e.value)
    assert setup_experiment(fix.split("=", 1)[1], "xpar", None, tmp_path)
    with pytest.raises(TrackingUnavailable) as e:
        setup_experiment("runs", "xpar", None, tmp_path)  # a folder: a file in it, the folder to make first
    assert f"sqlite:///{(tmp_path / 'runs' / 'mlflow.db').resolve()} (after mkdir -p" in str(e.value)


def test_worker_failure_survives_pickling():  # launchers such as submitit ship job errors between processes
    import pickle

    from xpar.run.launch import WorkerFailed
    e = pickle.loads(pickle.dumps(WorkerFailed(1, "RuntimeError: boom", "traceback")))
    assert (e.rank, e.error, str(e)) == (1, "RuntimeError: boom", "worker rank 1 failed: RuntimeError: boom")


def test_found_by_a_new_user_refused_before_any_worker():
    """From the break-it pass: each of these used to crash a worker or run silently wrong."""
    msg = _problems("parallel=pp", "model=tiny", "parallel.schedule=zbv", "parallel.recompute=selective")
    assert "parallel.recompute=selective cannot run with schedule zbv" in msg and "recompute=full" in msg
    assert "train.lr must be > 0 and finite, got inf" in _problems("train.lr=inf")
    assert "weight_decay must be >= 0 and finite, got nan" in _problems("train.weight_decay=nan")
    msg = _problems("parallel=pp", "model=tiny", "train.global_batch_size=4", "parallel.micro_batches=auto",
                    "parallel.schedule=1f1b")
    assert "micro_batches=auto gave m = train.global_batch_size / (micro_batch_size x dp) = 4 / (4 x 1)" in msg
    assert "parallel.virtual_stages=auto" in _problems("parallel=pp", "model=tiny", "parallel.virtual_stages=2")
    msg = _problems("parallel.recompute=bogus", "train.max_grad_norm=-1")  # every violated constraint at once
    assert "parallel.recompute must be one of" in msg and "train.max_grad_norm must be > 0" in msg


def test_an_estimate_only_schedule_is_refused_in_execute_mode_with_what_runs():
    """zb_h1 / zb_h2 have no torch class: execute mode refuses them in one line naming the
    estimate and the zero-bubble schedules torch runs; the estimate takes them."""
    msg = _problems("framework=megatron_zb", "parallel=pp", "parallel.schedule=zb_h2", "parallel.zero_stage=0")
    assert "estimate-only" in msg and "run.mode=estimate" in msg and "parallel.schedule=zbv" in msg
    spec = spec_for("framework=megatron_zb", "parallel=pp", "parallel.schedule=zb_h2", "parallel.zero_stage=0",
                    "run.mode=estimate")
    assert spec.layout.schedule == "zb_h2" and spec.pp == 2


def test_an_estimate_of_another_size_on_this_machine_names_the_device_count_that_prices_it():
    """Execute mode on hardware=local sizes its workers from the layout; estimate mode counted this machine's
    devices and offered only layouts of that size (a refusal that said 'estimate it with run.mode=estimate'
    led here and lost the tp asked for). The device count that prices it, followed, is accepted."""
    with pytest.raises(ConfigError) as e:
        spec_for("run.mode=estimate", "parallel.tp=4", "parallel.dp=1", "model.n_kv_heads=4")
    line = next(p for p in e.value.problems if "must equal the world size" in p)
    assert line.endswith("Or estimate 4 devices of this machine's kind: hardware.devices_per_node=4.")
    assert spec_for("run.mode=estimate", "parallel.tp=4", "parallel.dp=1", "model.n_kv_heads=4",
                    "hardware.devices_per_node=4").tp == 4
    with pytest.raises(ConfigError) as e:  # a cluster preset's count is its own: no such line
        spec_for("run.mode=estimate", "hardware=h100_80gb_node", "parallel.tp=4", "parallel.dp=1")
    assert "devices of this machine's kind" not in str(e.value)


def test_text_data_without_a_path_names_values_that_work(tmp_path, monkeypatch):
    """python -m xpar data=text said 'data.path must be an existing text file for data=text, got None.' and
    nothing that works; now data=synthetic, and README.md where the command runs from a clone."""
    monkeypatch.chdir(tmp_path)
    msg = _problems("data=text")
    assert "e.g. data=synthetic" in msg and "README.md" not in msg, msg
    (tmp_path / "README.md").write_text("x" * 100)
    msg = _problems("data=text")
    assert "e.g. data.path=README.md (any text file of at least 65 bytes), or data=synthetic" in msg, msg
    assert spec_for("data=text", "data.path=README.md").data.path == "README.md"  # following it validates


def test_a_hidden_size_the_heads_do_not_divide_names_values_that_pass_when_followed():
    """model.hidden=65 offered n_heads [1, 5, 13, 65], each refused again (model=tiny's n_kv_heads=2, and
    RoPE needs an even head dim); now the n_heads values that pass every head check, else hidden sizes."""
    import re

    msg = _problems("model.hidden=65")
    assert "no n_heads works with hidden=65, n_kv_heads=2 and RoPE's even head dim" in msg, msg
    assert "model.hidden=64 or model.hidden=72" in msg, msg
    assert spec_for("model.hidden=72").model.hidden == 72
    msg = _problems("model.n_heads=6")
    heads = [int(h) for h in re.search(r"RoPE's even head dim: \[([\d, ]+)\]", msg).group(1).split(",")]
    assert heads == [2, 4, 8, 16, 32], msg
    for h in heads:
        assert spec_for("model.n_heads=" + str(h)).model.n_heads == h


def test_a_negative_hidden_size_is_one_line():
    """model.hidden=-1 added 'no n_heads works with hidden=-1 ...; hidden values that work with n_heads=4: ;'
    (an empty list) under 'model.hidden must be >= 1'."""
    msg = _problems("model.hidden=-1")
    assert msg.strip() == "- model.hidden must be >= 1, got -1.", msg


def test_sequence_parallel_over_an_odd_sequence_names_overrides_that_pass():
    """parallel.tp=2 parallel.sequence_parallel=true train.seq_len=63 said 'e.g. train.seq_len in [58, 60, 62], or
    sequence_parallel=false': neither an override (no such key as sequence_parallel); each now follows."""
    sp = ("parallel.tp=2", "parallel.dp=1", "parallel.sequence_parallel=true")
    msg = _problems(*sp, "train.seq_len=63")
    assert "e.g. train.seq_len=62, or parallel.sequence_parallel=false." in msg, msg
    assert spec_for(*sp, "train.seq_len=62").seq_len == 62
    assert spec_for(*sp, "train.seq_len=63", "parallel.sequence_parallel=false").seq_len == 63
    assert "e.g. parallel.sequence_parallel=false." in _problems(*sp, "train.seq_len=1")


@pytest.mark.parametrize("overrides,says", [
    (("parallel=pp", "parallel.schedule=1f1b", "parallel.micro_batches=1", "run.mode=estimate"),
     "or parallel.schedule=gpipe."),  # was 'or schedule=gpipe.'
    (("parallel.dp=1", "run.mode=estimate", "hardware.devices_per_node=2"), "or parallel.dp=2."),  # 'or dp=2.'
    (("parallel=pp", "model.tied_embeddings=true"), "model.tied_embeddings=false or parallel.pp=1."),  # 'or pp=1.'
    (("model=mixtral_8x7b", "hardware=h100_80gb_64gpu", "train=cluster", "parallel.tp=4", "parallel.cp=2",
      "parallel.sequence_parallel=true", "train.seq_len=4100", "parallel.zero_stage=3"),
     "e.g. train.seq_len=4096, or parallel.sequence_parallel=false."),  # 'train.seq_len in [8, 16, 24], or sequence_parallel=false.'
])
def test_a_refusal_suggests_overrides_of_the_command_line(overrides, says):
    """Refusals suggested 'or schedule=gpipe', 'or dp=2', 'or pp=1', 'train.seq_len in [8, 16, 24], or
    sequence_parallel=false': no such keys (parallel.schedule, parallel.dp, parallel.pp,
    parallel.sequence_parallel), nor a value, so the line did not run as written; each is now an override
    that validates when followed."""
    msg = _problems(*overrides)
    assert says in msg, msg
    fix = says.rstrip(".").split()[-1]
    assert spec_for(*overrides, fix) is not None
