"""The README and the documentation site: the README stays short and every command in it is
either run here, validated as the command line would validate it, or named with the test that
runs it; the site builds strictly and its configuration reference lists every key of the schema."""
from __future__ import annotations

import dataclasses
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import compose

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

COVERED_ELSEWHERE = {
    "python3 -m venv": "CI's .ci/run (the set-up line itself)",
    "python -m pytest": "CI's .ci/run",
    "torchrun": "tests/run/test_launchers.py (torchrun ranks, and two agents as two nodes, as one run)",
    "MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false mlflow server --workers 1": "tests/track/test_ui.py (this server, its UI in headless Chromium)",
    "MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false mlflow server": "tests/track/test_mlflow_server.py (a sweep against it)",
    "xpar compare": "tests/track/test_sweep.py (the README's sweep, then compare)",
    "xpar calibrate": "tests/calibrate/test_calibrate.py (xpar calibrate --quick; --device cuda on a GPU node: benchmarks/gpu_node.sh)",
    "python -m xpar -m": "tests/track/test_sweep.py, test_launchers.py, test_mlflow_server.py (sweeps, launchers, servers)",
    "python -m xpar hardware=calibrated_here": "tests/calibrate/test_calibrate.py (a run on the preset calibrate wrote)",
    "xpar plan model=tiny hardware=local plan.execute_top=3": "tests/plan/test_plan.py (execute_top runs the top layouts)",
}
PAGES = [README] + sorted((ROOT / "docs").rglob("*.md"))


def commands(page: Path) -> list[str]:
    """The command lines of a page's bash blocks (comments dropped, continuation lines joined)."""
    out, block, pending = [], False, ""
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            block = line.strip() == "```bash"
            continue
        if not block or not line.strip() or line.lstrip().startswith("#"):
            continue
        text = pending + line.split("  #")[0].strip()
        pending = text[:-1] + " " if text.endswith("\\") else ""
        if not pending:
            out.append(text)
    return out


def test_readme_is_short_and_links_into_the_docs():
    text = README.read_text()
    assert len(text.splitlines()) <= 220
    for link in ("docs/guides/run.md", "docs/guides/sweeps.md", "docs/guides/estimate.md", "docs/guides/plan.md",
                 "docs/guides/calibrate.md", "docs/accuracy/published.md"):
        assert f"]({link})" in text and (ROOT / link).is_file(), link


def _overrides(cmd: str) -> list[str]:
    args = shlex.split(cmd)
    return args[3:] if args[:3] == ["python", "-m", "xpar"] else args[1:]


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_command_runs_or_is_validated_or_is_run_elsewhere(page, tmp_path):
    """``xpar --help`` and the README's ``xpar plan`` run here (the docs' plans are composed and
    checked as the plan command composes them); a single run's overrides pass the checks the
    command line runs before any worker starts (override refusals, composition, validation, the
    memory fit); the rest are named with the test that runs them; a command with a placeholder
    (``<date>``) is validated without its placeholder's override."""
    from xpar.config.overrides import refuse_bad_overrides
    from xpar.estimate.preflight.check import check_run
    for cmd in commands(page):
        if any(cmd.startswith(prefix) for prefix in COVERED_ELSEWHERE):
            continue
        if cmd.startswith("xpar plan") and page != README:  # the README's plans run; the rest are validated
            from xpar.plan.inputs import plan_argv
            argv = plan_argv(_overrides(cmd)[1:])
            refuse_bad_overrides(argv)
            compose(*argv)
            continue
        if cmd.startswith(("xpar --help", "xpar plan")):
            args = _overrides(cmd) + (["tracking=off"] if "plan" in cmd else [])
            r = subprocess.run([sys.executable, "-m", "xpar", *args], cwd=tmp_path, capture_output=True, text=True,
                               timeout=300)
            assert r.returncode == 0, (cmd, r.stderr[-2000:])
            continue
        assert cmd.startswith(("python -m xpar", "xpar ")), f"a command no test covers in {page.name}: {cmd}"
        overrides = [o for o in _overrides(cmd) if "<" not in o]
        refuse_bad_overrides(overrides)
        check_run(compose(*overrides))


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


@pytest.mark.slow
def test_the_site_builds_strictly_and_documents_every_config_key(site):
    from xpar.config import schema
    sys.path.insert(0, str(ROOT / "docs"))
    from hooks import field_docs
    page = (site / "reference" / "config" / "index.html").read_text()
    for group in dataclasses.fields(schema.XparConfig):
        cls = group.default_factory
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            assert f"{group.name}.{f.name}" in page, f"{group.name}.{f.name} missing from the reference"
            assert docs.get(f.name), f"{group.name}.{f.name} has no docstring in xpar/config/schema.py"
    layers = (site / "concepts" / "architecture" / "index.html").read_text()
    assert all(f"xpar/{pkg}/" in layers for pkg in ("config", "estimate", "track", "run", "calibrate"))
    profiles = (site / "concepts" / "cost-model" / "index.html").read_text()
    assert all(f"framework={p.stem}" in profiles for p in (ROOT / "conf" / "framework").glob("*.yaml"))
    assert "Generated by" in (site / "accuracy" / "published" / "index.html").read_text()


@pytest.mark.slow
def test_the_site_has_the_first_run_and_troubleshooting_pages_and_no_made_up_repository(site):
    """Issue 45: the pages a new user needs in the nav, keys kept whole by the site's stylesheet,
    no link to a repository that does not exist."""
    page = (site / "reference" / "config" / "index.html").read_text()
    assert "stylesheets/extra.css" in page and "white-space: nowrap" in (site / "stylesheets" / "extra.css").read_text()
    assert "Reading your first run" in page and "Troubleshooting" in page  # in every page's nav
    assert "github.com/xpar" not in page
    first = (site / "guides" / "first_run" / "index.html").read_text()
    assert "time/comm_exposed_s" in first and "step: 10 loss:" in first  # every row, and the step line


def test_every_test_file_the_docs_name_exists():
    """docs/concepts/cost-model-derivations.md pointed to tests/test_comm_log.py, which does not exist."""
    import re

    pages = [README, *sorted((ROOT / "docs").rglob("*.md"))]
    named = {(p.name, m) for p in pages for m in re.findall(r"tests/[\w/.]*?\.py", p.read_text())}
    assert named and not [(page, path) for page, path in sorted(named) if not (ROOT / path).is_file()]


def test_readme_resume_example_says_which_mlflow_run_it_logs_into():
    """The README's resume example changes train.steps (a new run linked by xpar.resumed_from_run,
    xpar.run.checkpoint) while its text said the resumed run continued in the same MLflow run."""
    text = README.read_text()
    section = text[text.index("## Checkpoints and clusters"):]
    section = section[:section.index("\n## ", 4)]
    first, second = [line for line in section.splitlines() if line.startswith("python -m xpar")][:2]
    assert "train.resume=" in second and "train.steps=20" in first and "train.steps=30" in second
    assert "xpar.resumed_from_run" in section and "continues exactly where it stopped, in the same MLflow run" \
        not in " ".join(section.split())
