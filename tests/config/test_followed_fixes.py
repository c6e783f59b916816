"""Refusals whose suggestion, followed, passes every check (the fresh-user review of 2026-12-06):
each case is refused in-process before any worker starts, the suggested overrides are taken
from the message and the config with them validates."""
import re

import pytest

from tests.config.test_refusals import _accepted, refusal


def _follow(argv: list[str], fix: str) -> list[str]:
    """``argv`` with the overrides of ``fix`` replacing those of the same keys."""
    fix_argv = fix.split()
    keys = {a.split("=")[0] for a in fix_argv}
    return [a for a in argv if a.split("=")[0] not in keys] + fix_argv


def _refused(argv, tmp_path, monkeypatch, capsys) -> str:
    code, err = refusal(argv, tmp_path, monkeypatch, capsys)
    assert code == 2 and "Traceback" not in err, err
    return err


LOCAL = ["hardware.device=cpu", "hardware.device_memory_gb=16"]  # 12.8 GB usable on any host


@pytest.mark.parametrize("dps,extra", [
    (("1000", "100000000000"), []),
    (("1000", "100000000000"), ["hardware.devices_per_node=1", "train.micro_batch_size=1"]),
    (("1000",), ["train.global_batch_size=4000", "parallel.micro_batches=auto"])])
def test_too_many_local_workers_are_refused_with_a_dp_that_fits(dps, extra, tmp_path, monkeypatch, capsys):
    """parallel.dp=1000 passed (the cost model's ~10 MB per worker, not the ~0.35 GB of a torch
    process); dp=1e11 suggested a change that gave the same refusal."""
    for dp in dps:
        argv = ["parallel.dp=" + dp, *LOCAL, *extra]
        err = _refused(argv, tmp_path, monkeypatch, capsys)
        assert "does not fit this machine" in err and "0.35 GB for the process with torch" in err, err
        fix = re.search(r"Use at most (\d+) workers: (parallel.dp=\d+ train.global_batch_size=auto)", err)
        assert fix and 20 <= int(fix.group(1)) <= 40, err  # 12.8 GB / ~0.36 GB
        assert _accepted(_follow(argv, fix.group(2)))
        assert not _accepted_quietly(_follow(argv, f"parallel.dp={int(fix.group(1)) + 8}"))


def _accepted_quietly(argv) -> bool:
    from xpar.config.checks import ConfigError

    try:
        return _accepted(argv)
    except ConfigError:
        return False


CP70B = "model=70b hardware=h100_80gb_64gpu parallel.tp=8 train=cluster run.mode=estimate parallel.zero_stage=2".split()


@pytest.mark.parametrize("seq", ["4096", "4098"])
def test_cp_refusal_names_tp_cp_pp_and_offers_only_cp_values_that_pass(seq, tmp_path, monkeypatch, capsys):
    """parallel.cp=3 on 64 devices said tp*pp=24 and offered cp=16 (8 x 16 > 64) or train.seq_len=4098
    (still cp=3): the product is tp*cp*pp, each value named passes every check when followed."""
    argv = [*CP70B, "parallel.cp=3", "train.seq_len=" + seq]
    err = _refused(argv, tmp_path, monkeypatch, capsys)
    assert "tp*cp*pp=24" in err and "tp*pp=24" not in err, err
    assert "train.seq_len in" not in err, err  # no seq_len makes cp=3 fit 64 devices
    listed = [int(c) for c in re.search(r"cp values that work with tp=8 x pp=1 on 64 devices and seq_len=\d+: "
                                        r"\[([\d, ]+)\]", err).group(1).split(",")]
    assert listed == ([1, 2, 4, 8] if seq == "4096" else [1]), err
    fix = re.search(r"\(e\.g\. (parallel\.cp=\d+ parallel\.dp=auto)\)", err).group(1)
    for cp in listed:
        assert _accepted(_follow(argv, f"parallel.cp={cp} parallel.dp=auto"))
    assert fix == ("parallel.cp=4 parallel.dp=auto" if seq == "4096" else "parallel.cp=1 parallel.dp=auto")
    assert not _accepted_quietly(_follow(argv, "parallel.cp=16"))


PP70B = ("model=70b hardware=h100_80gb_64gpu parallel.tp=8 parallel.pp=4 parallel.dp=2 train=cluster "
         "train.global_batch_size=64 run.mode=estimate parallel.zero_stage=2 parallel.micro_batches=1").split()


def test_micro_batch_counts_offered_keep_the_given_global_batch(tmp_path, monkeypatch, capsys):
    """1f1b at pp=4 with micro_batches=1 offered [4, 5, 6]; 5 then gave 64 != 1 x 5 x 2 = 10."""
    err = _refused(PP70B, tmp_path, monkeypatch, capsys)
    assert "[4, 5, 6]" not in err, err
    fix = re.search(r"micro_batches that work: \[32\] \((parallel.micro_batches=32) or auto\)", err)
    assert fix, err
    assert _accepted(_follow(PP70B, fix.group(1))) and _accepted(_follow(PP70B, "parallel.micro_batches=auto"))
    assert not _accepted_quietly(_follow(PP70B, "parallel.micro_batches=5"))


LOCAL_EST = "run.mode=estimate run.dry_run=false parallel.dp=2 hardware.devices_per_node=2".split()


@pytest.mark.parametrize("extra", [["parallel.micro_batches=auto"], []])
def test_a_global_batch_dp_cannot_split_says_so_and_offers_one_that_works(extra, tmp_path, monkeypatch, capsys):
    """train.global_batch_size=7 over dp=2: 'micro_batch_size values that work: []' (and, without
    micro_batches=auto, a suggestion of micro_batches=auto that led there)."""
    argv = [*LOCAL_EST, "train.global_batch_size=7", *extra]
    err = _refused(argv, tmp_path, monkeypatch, capsys)
    assert "values that work: []" not in err and "7 sequences cannot be split evenly over dp=2" in err, err
    assert "or parallel.micro_batches=auto" not in err, err
    fixes = re.findall(r"(?:e\.g\. |Set )(train.global_batch_size=\d+(?: parallel.micro_batches=auto)?)", err)
    assert fixes, err
    for fix in fixes:
        assert _accepted(_follow(argv, fix)), fix


def test_a_micro_batch_size_is_offered_where_dp_splits_the_global_batch(tmp_path, monkeypatch, capsys):
    argv = [*LOCAL_EST, "train.global_batch_size=6"]
    err = _refused(argv, tmp_path, monkeypatch, capsys)
    fix = re.search(r"micro_batch_size values that work: \[1, 3\] \(e\.g\. (train.micro_batch_size=3 "
                    r"parallel.micro_batches=auto)\)", err)
    assert fix, err
    assert _accepted(_follow(argv, fix.group(1)))


LLMF = "model=70b hardware=h100_80gb_64gpu train=cluster run.mode=estimate framework=llmfoundry".split()


@pytest.mark.parametrize("degrees", [["parallel.tp=8", "parallel.pp=4", "parallel.micro_batches=8"],
                                     ["parallel.tp=8"], ["parallel.pp=4", "parallel.micro_batches=8"]])
def test_llmfoundry_refuses_pipeline_and_tensor_parallelism(degrees, tmp_path, monkeypatch, capsys):
    """framework=llmfoundry estimated tp=8 pp=4, a layout llm-foundry (Composer FSDP) does not run."""
    from xpar.config.validate import validate
    from tests.conftest import compose

    argv = [*LLMF, *degrees]
    err = _refused(argv, tmp_path, monkeypatch, capsys)
    assert err.count("framework=llmfoundry does not run") == 1, err
    fix = re.search(r"e\.g\. ((?:parallel\.(?:pp|tp)=1 )+parallel\.dp=auto parallel\.micro_batches=auto)", err).group(1)
    validate(compose("run.progress=false", *_follow(argv, fix)))  # every check but memory's (its own line, own fix)
    other = re.search(r"or (framework=\w+) \(it runs", err).group(1)
    # torchtitan where it runs the layout whole; its DDP runs alone and its tp carries sp (framework.ddp_alone,
    # sequence_parallel [true]), so tp 8 at this ZeRO-0 without sp is another profile's (deepspeed)
    assert other in ("framework=torchtitan", "framework=deepspeed"), other
    validate(compose("run.progress=false", *_follow(argv, other)))


def test_llmfoundry_plan_searches_neither_pp_nor_tp():
    """xpar plan under framework=llmfoundry searches only what the profile runs: pp 1, tp 1."""
    from tests.plan.test_plan import plan_of

    cols = plan_of("model=7b", "hardware=h100_80gb_8gpu", "framework=llmfoundry").space.cols
    assert len(cols["pp"]) and set(cols["pp"]) == {1} and set(cols["tp"]) == {1}


def test_execute_on_a_cluster_preset_names_the_presets_devices_and_this_machine(tmp_path, monkeypatch, capsys):
    """'dp*tp*pp=32 exceeds the 8 local CUDA devices' on a machine with no CUDA: the 8 was the
    preset's devices_per_node. dp is the preset's cluster's (64 / 32 = 2), not one node's."""
    from xpar.config.validate import validate
    from tests.conftest import compose

    argv = ("model=70b hardware=h100_80gb_64gpu parallel.tp=8 parallel.pp=4 train=cluster parallel.micro_batches=8 "
            "run.mode=execute").split()
    err = _refused(argv, tmp_path, monkeypatch, capsys)
    assert "exceeds the 8 local CUDA devices" not in err, err
    assert re.search(r"dp\*tp\*pp=64 ranks exceed hardware=h100_80gb_64gpu's devices_per_node=8 .*this machine has "
                     r"(no CUDA device|\d+ CUDA devices?); .*run\.mode=estimate, or .*hardware=local", err), err
    validate(compose("run.progress=false", *_follow(argv, "run.mode=estimate")))

