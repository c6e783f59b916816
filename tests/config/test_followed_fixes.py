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
