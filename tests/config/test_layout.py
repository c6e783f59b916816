"""The layout core: one owner of a layout's rules, torch-free, no import cycles, small
functions, validation that never mutates, every preset and experiment valid."""
from __future__ import annotations

import ast
import copy
import itertools
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import compose
from xpar.config.layout import SCHEDULES, Layout

XPAR = Path(__file__).resolve().parents[2] / "xpar"


def test_schedule_registry_matches_torch():
    """Every record names a class torch's own get_schedule_class returns, and every torch
    schedule class xpar knows of is in the registry once."""
    from torch.distributed.pipelining.schedules import get_schedule_class

    for rec in SCHEDULES.values():
        if not rec.executable:  # estimate-only (zb_h1, zb_h2): torch has no class for it
            with pytest.raises(ValueError):
                get_schedule_class(rec.torch_name)
            continue
        assert get_schedule_class(rec.torch_name).__name__ == rec.torch_class, rec.name
    assert len({rec.torch_name for rec in SCHEDULES.values()}) == len(SCHEDULES)


@pytest.mark.parametrize("pp,dp,tp", [(1, 1, 1), (2, 3, 4), (4, 2, 8), (3, 5, 1)])
def test_rank_order_is_the_device_mesh_order(pp, dp, tp):
    """coords/rank invert each other and follow init_device_mesh's row-major (pp, dp, tp)
    layout: the mesh tensor is arange(world).reshape(pp, dp, tp)."""
    import torch

    layout = Layout(dp=dp, tp=tp, pp=pp, micro_batch_size=1, micro_batches=pp, seq_len=8, layer_split=[1] * pp)
    mesh = torch.arange(layout.world_size).reshape(pp, dp, tp)
    for p, d, t in itertools.product(range(pp), range(dp), range(tp)):
        r = int(mesh[p, d, t])
        assert layout.rank(p, d, t) == r and layout.coords(r) == (p, d, t)


@pytest.mark.parametrize("pp,dp,cp,tp", [(1, 1, 2, 1), (2, 2, 2, 2), (1, 3, 4, 2)])
def test_rank_order_with_cp_is_the_device_mesh_order(pp, dp, cp, tp):
    """With cp the mesh is (pp, dp, cp, tp) row-major (xpar.parallel.mesh.build_mesh): coords
    (pp, dp, tp) and cp_rank read a rank's place, rank(pp, dp, tp, cp) inverts them."""
    import torch

    layout = Layout(dp=dp, tp=tp, pp=pp, cp=cp, micro_batch_size=1, micro_batches=pp, seq_len=16,
                    layer_split=[1] * pp)
    mesh = torch.arange(layout.world_size).reshape(pp, dp, cp, tp)
    for p, d, c, t in itertools.product(range(pp), range(dp), range(cp), range(tp)):
        r = int(mesh[p, d, c, t])
        assert layout.rank(p, d, t, cp=c) == r and layout.coords(r) == (p, d, t) and layout.cp_rank(r) == c


def test_stage_placement_loop_and_v():
    loop = Layout(dp=1, tp=1, pp=2, micro_batch_size=1, micro_batches=4, seq_len=8, layer_split=[1, 2, 3, 4],
                  schedule="interleaved_1f1b")
    v = Layout(dp=1, tp=1, pp=2, micro_batch_size=1, micro_batches=4, seq_len=8, layer_split=[1, 2, 3, 4],
               schedule="zbv")
    assert [loop.stages_of(r) for r in (0, 1)] == [[0, 2], [1, 3]]
    assert [v.stages_of(r) for r in (0, 1)] == [[0, 3], [1, 2]]
    assert v.stage_layers(2) == [3, 4, 5] and v.layers_of(0) == 5 and v.has_last_stage(0)
    assert (loop.virtual_stages, loop.global_batch, loop.tokens_per_step) == (2, 4, 32)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """xpar modules imported anywhere in ``path`` (function-level imports included)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("xpar"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                out.add(full if full in modules else node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in modules}
    return out & modules


def _module_graph() -> dict[str, set[str]]:
    paths = {".".join(p.relative_to(XPAR.parent).with_suffix("").parts).removesuffix(".__init__"): p
             for p in XPAR.rglob("*.py")}
    return {name: _imports(p, set(paths)) - {name} for name, p in paths.items()}


def test_import_graph_has_no_cycle():
    graph = _module_graph()
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(node):] + [node]))
        if node in done:
            return
        for dep in sorted(graph.get(node, ())):
            visit(dep, path + [node])
        done.add(node)

    for node in sorted(graph):
        visit(node, [])


# The package layers, lowest first: a module imports only from its own layer or those below it
# (function-level imports included). xpar/__init__.py and __main__.py (the command line) sit on top.
LAYERS = ("config", "models", "parallel", "estimate", "track", "plan", "run", "calibrate", "help")


def _layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else len(LAYERS)


def test_imports_only_go_down_the_layers():
    up = [f"{m} ({LAYERS[_layer(m)] if _layer(m) < len(LAYERS) else 'top'}) imports {d} ({LAYERS[_layer(d)]})"
          for m, deps in sorted(_module_graph().items()) for d in sorted(deps)
          if d != "xpar" and _layer(d) > _layer(m)]
    assert not up, "\n".join(up)


def test_the_top_level_is_the_layers_and_no_module_is_over_600_lines():
    top = sorted(p.name for p in XPAR.iterdir() if p.name not in ("__pycache__", "__init__.py", "__main__.py"))
    assert top == sorted([n for n in LAYERS if n != "help"] + ["help.py"]), top
    long = [f"{p.relative_to(XPAR.parent)} ({n} lines)" for p in XPAR.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 600]
    assert not long, long
    for pkg in LAYERS[:-1]:  # each package says what it owns and what it may import
        doc = ast.get_docstring(ast.parse((XPAR / pkg / "__init__.py").read_text())) or ""
        assert len(doc) > 80 and "import" in doc, pkg


def test_no_function_over_60_lines():
    long = []
    for path in XPAR.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > 60:
                    long.append(f"{path.relative_to(XPAR.parent)}:{node.lineno} {node.name} ({n} lines)")
    assert not long, long


@pytest.mark.slow
def test_layout_validation_and_cost_model_do_not_import_torch():
    code = ("import sys, xpar.config.layout, xpar.config.checks.config, xpar.config.checks.layout, xpar.config.resolve, xpar.config.validate, "
            "xpar.estimate.cost, xpar.estimate.comm.volume, xpar.estimate.schedule; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr


def test_validation_does_not_change_the_config():
    from xpar.config.validate import to_schema, validate

    for overrides in (["parallel=pp", "parallel.schedule=zbv", "parallel.zero_stage=3"], ["parallel=3d", "model=70b"],
                      ["train.global_batch_size=16", "parallel.micro_batches=auto"]):
        c = to_schema(compose("tracking=off", *overrides))
        before = copy.deepcopy(c)
        spec = validate(c, local_devices=2)
        assert c == before, overrides
        par = spec.parallel_config()  # what is logged as params
        assert "auto" not in (par.dp, par.micro_batches, par.virtual_stages,
                              spec.train.global_batch_size)


def test_zero3_under_a_zero_bubble_schedule_is_resolved_and_noted():
    from xpar.config.validate import to_schema, validate

    spec = validate(to_schema(compose("tracking=off", "parallel=pp", "parallel.schedule=zbv", "parallel.zero_stage=3")),
                    local_devices=2)
    assert spec.layout.zero_stage == spec.parallel_config().zero_stage == 2
    assert any("ran as zero_stage=2" in n for n in spec.notes)


def _presets(group: str) -> list[str]:
    from tests.config.test_config import OTHER_TESTS_PRESETS
    from xpar.config.presets import presets
    return [n for n in presets(group) if not n.startswith(OTHER_TESTS_PRESETS)]


@pytest.mark.slow  # integration-sized (conftest.INTEGRATION): runs in the full suite, not the fast loop
@pytest.mark.parametrize("group", ["model", "parallel", "hardware", "train", "data", "tracking"])
def test_every_preset_composes_and_validates(group):
    """Each preset on its own (the rest default) passes validation and the memory checks,
    except the presets that exist to show a refusal (named in their file)."""
    from xpar.config.checks import ConfigError
    from xpar.config.presets import conf_dir
    from xpar.estimate.preflight.check import check_run

    for name in _presets(group):
        text = (conf_dir() / group / f"{name}.yaml").read_text()
        extra = ["data.path=README.md"] if (group, name) == ("data", "text") else []
        cfg = compose(f"{group}={name}", "tracking=off", *extra)
        try:
            check_run(cfg, local_devices=2)
        except ConfigError as e:
            assert "refused" in text or "does not fit" in str(e), f"{group}={name}: {e}"


@pytest.mark.slow  # integration-sized (conftest.INTEGRATION): runs in the full suite, not the fast loop
@pytest.mark.parametrize("name", _presets("experiment"))
def test_every_experiment_composes_and_its_jobs_validate(name):
    """Every experiment preset (conf/experiment/<name>.yaml, run as ``+experiment=<name>``)
    expands into jobs that pass pre-flight, or that it skips on purpose (sweep.skip_invalid
    with a reason)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from xpar.config.presets import conf_dir
    from xpar.track.sweep import job_overrides, preflight

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        cfg = hydra_compose(config_name="config", return_hydra_config=True, overrides=[f"+experiment={name}"])
        jobs, _ = job_overrides(cfg)
        bad = preflight(cfg)
    assert jobs
    assert not bad or cfg.sweep.skip_invalid, bad
    assert len(bad) < len(jobs)


def test_uneven_edge_stages_as_megatron_sets_them():
    """--decoder-first/last-pipeline-num-layers: the named edge stages, the rest even (earlier
    stages take the extra); 0 leaves a stage with the embedding or the head alone."""
    from xpar.config.layout import edge_split
    assert edge_split(96, 8, 0, None) == [0, 14, 14, 14, 14, 14, 13, 13]
    assert edge_split(96, 8, 11, 11) == [11, 13, 13, 12, 12, 12, 12, 11]
    assert edge_split(4, 2, 0, None) == [0, 4] and edge_split(4, 2, None, 0) == [4, 0]
    assert edge_split(4, 2, 1, 3) == [1, 3] and edge_split(4, 2, 1, 2) is None  # no middle left for the 1 block
    assert edge_split(4, 3, 0, 4) is None and edge_split(8, 4, None, None) is None
    spec = spec_for_split("parallel.first_stage_layers=0")
    assert spec.layout.layer_split == (0, 4) and spec.layout.stage_layers(0) == []


def test_lighter_ends_as_bloom_and_deepseek_v3_split_their_blocks():
    """The split xpar plan gives pp x v stages that do not divide the blocks: ceil(L / n) blocks on every
    stage between, the first and last the rest, the first the odd one -- BLOOM 176B's 70 over 12 (5, 10 x
    6, 5), DeepSeek-V3's 61 over 32 (1, 30 x 2, 0); even where n divides L; None where the stages between
    would take more than L blocks."""
    from xpar.config.layout import edge_split, lighter_ends
    assert lighter_ends(70, 12) == (5, 5) and edge_split(70, 12, 5, 5) == [5] + [6] * 10 + [5]
    assert lighter_ends(61, 32) == (1, 0) and edge_split(61, 32, 1, 0) == [1] + [2] * 30 + [0]
    assert lighter_ends(96, 8) == (12, 12) and lighter_ends(7, 2) == (4, 3) and lighter_ends(32, 34) == (0, 0)
    assert lighter_ends(96, 64) is None and lighter_ends(96, 1) is None


def spec_for_split(*overrides):
    from tests.conftest import spec_for
    return spec_for("parallel=pp", *overrides, local_devices=2)


def test_an_estimate_splits_layers_the_stages_do_not_divide_with_lighter_ends():
    """A run that trained with 70 blocks over 12 stages (BLOOM) and gave no split is estimated, not refused: the
    lighter ends xpar plan prices, said in a note. A run executes only the split it names; a framework that splits
    evenly only (megatron_2021) refuses it in an estimate too."""
    from xpar.config.checks import ConfigError
    from xpar.config.validate import validate
    args = ("hardware=h100_80gb_64gpu", "hardware.nodes=3", "model=small", "model.n_layers=70", "parallel.pp=12",
            "parallel.dp=2",
            "parallel.micro_batches=24", "train.micro_batch_size=1")
    spec = validate(compose("run.mode=estimate", "framework=megatron_core", *args))
    assert spec.layout.layer_split == tuple([5] + [6] * 10 + [5])
    assert any("model.n_layers=70 over 12 pipeline stages: estimated with the split [5, 6," in n for n in spec.notes)
    for refused in (("run.mode=estimate", "framework=megatron_2021"), ("run.mode=execute",)):
        with pytest.raises(ConfigError) as err:
            validate(compose(*refused, *args))
        assert "model.n_layers=70 does not split evenly over 12 stages" in str(err.value), str(err.value)


def test_a_given_global_batch_sets_the_micro_batch_count_by_default():
    """train.global_batch_size with the micro-batch size and no parallel.micro_batches (a published run's
    statement): the gradient accumulation steps follow, B / (b x dp), not a refusal for the count of 1."""
    from xpar.config.validate import validate
    spec = validate(compose("run.mode=estimate", "hardware=h100_80gb_64gpu", "train.global_batch_size=512",
                            "train.micro_batch_size=2"))
    assert (spec.layout.dp, spec.layout.micro_batches, spec.train.global_batch_size) == (64, 4, 512)
