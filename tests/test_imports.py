"""Code hygiene, read from the source alone (ast, no import, no subprocess): xpar's own modules are
imported at module tops except :data:`xpar.LAZY_IMPORTS`; no module docstring over 15 lines; no
notes of one machine's measurements or dated fit histories in xpar/ or conf/ (those live in
docs/accuracy/ and benchmarks/README.md); torch's and Hydra's private APIs only behind the
``*_internals`` modules."""
from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

from xpar import LAZY_IMPORTS

ROOT = Path(__file__).resolve().parents[1]
XPAR = ROOT / "xpar"
MAX_LOCAL_IMPORTS = 20
MAX_MODULE_DOC_LINES = 15


def _name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


@cache
def _modules() -> dict[str, Path]:
    return {_name(p): p for p in XPAR.rglob("*.py")}


@cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def _target(node: ast.AST, module: str) -> list[str]:
    """The modules an import statement in ``module`` names (relative imports resolved)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if not node.level:
        return [node.module]
    base = module.split(".")
    if _modules()[module].name != "__init__.py":
        base = base[:-1]
    return [".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module else []))]


@cache
def _imports(module: str) -> tuple[list[str], list[tuple[str, int]]]:
    """(modules imported at the top level, [(module, line)] imported inside a function)."""
    top, local = [], []

    def walk(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                for t in _target(child, module):
                    (local.append((t, child.lineno)) if in_function else top.append(t))
            walk(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    walk(_tree(_modules()[module]), False)
    return top, local


def function_local_xpar_imports() -> list[tuple[str, str, int]]:
    """[(importing module, imported xpar module, line)] of every import of xpar inside a function."""
    return [(m, t, line) for m in sorted(_modules()) for t, line in _imports(m)[1]
            if t == "xpar" or t.startswith("xpar.")]


@cache
def reached(module: str) -> frozenset[str]:
    """Every module importing ``module`` imports (through top-level imports, parent packages included),
    xpar's and other libraries' (the latter by the name imported, not walked further)."""
    seen, todo, out = set(), [module], set()
    while todo:
        m = todo.pop()
        if m in seen or m not in _modules():
            continue
        seen.add(m)
        parts = m.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]
        for t in _imports(m)[0]:
            out.add(t)
            todo += [t, t.rsplit(".", 1)[0]]
    return frozenset(out | seen)


def pulls_in(module: str, library: str) -> bool:
    """Whether importing ``module`` imports ``library`` (:func:`reached`)."""
    return any(t.split(".")[0] == library for t in reached(module) if not t.startswith("xpar"))


def test_function_local_imports_of_xpar_are_the_listed_few():
    found = function_local_xpar_imports()
    assert len(found) <= MAX_LOCAL_IMPORTS, f"{len(found)} function-local xpar imports (at most {MAX_LOCAL_IMPORTS})"
    unlisted = [f"{_modules()[m].relative_to(ROOT)}:{line} imports {t}" for m, t, line in found
                if t not in LAZY_IMPORTS.get(m, {})]
    assert not unlisted, "move these to the module's top (or list them in xpar.LAZY_IMPORTS, with the " \
                         "library they keep off the fast path):\n" + "\n".join(unlisted)


def test_every_listed_lazy_import_is_lazy_and_keeps_its_library_off():
    found = {(m, t) for m, t, _ in function_local_xpar_imports()}
    for module, targets in LAZY_IMPORTS.items():
        assert not pulls_in(module, "torch") and not pulls_in(module, "pandas"), module
        for target, library in targets.items():
            assert (module, target) in found, f"{module} imports {target} at its top now: drop it from LAZY_IMPORTS"
            assert pulls_in(target, library), f"{target} no longer imports {library}: import it at {module}'s top"


def test_the_fast_path_modules_are_torch_free_at_import():
    """``xpar --help`` and ``xpar plan`` import xpar.__main__, and through it the job and the planner."""
    for module in ("xpar.__main__", "xpar.run.job", "xpar.plan.command", "xpar.estimate.cost"):
        assert not pulls_in(module, "torch"), module
        assert not pulls_in(module, "mlflow") and not pulls_in(module, "matplotlib"), module


def test_the_launcher_leaves_the_workers_modules_to_the_fork_server():
    """xpar, the process that launches local workers, imports torch.multiprocessing and no more of torch:
    the engine and the parallel wrappers are imported once by the fork server the workers fork from."""
    for module in ("xpar.run.launch", "xpar.run.forkserver"):
        heavy = {"xpar.run.worker", "xpar.parallel.factory", "torch.distributed"} & reached(module)
        assert not heavy, (module, heavy)
    assert {"xpar.parallel.factory", "torch.distributed"} <= reached("xpar.run.worker")  # the walk sees them


def test_the_import_walk_sees_torch_where_it_is():
    assert pulls_in("xpar.run.worker", "torch") and pulls_in("xpar.track.compare", "pandas")
    assert not pulls_in("xpar.models.shapes", "torch")


def test_no_module_docstring_over_15_lines():
    long = []
    for name, path in sorted(_modules().items()):
        body = _tree(path).body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            n = body[0].end_lineno - body[0].lineno + 1
            if n > MAX_MODULE_DOC_LINES:
                long.append(f"{path.relative_to(ROOT)} ({n} lines)")
    assert not long, f"module docstrings over {MAX_MODULE_DOC_LINES} lines (the contract only; the rest to docs/):\n" \
                     + "\n".join(long)


MACHINE_NOTES = re.compile(r"measured here|\b2[- ]cores?\b|2-core machine|\b\d+ vcpus?\b|\bat load \d"
                           r"|\b20\d\d-[01]\d-[0-3]\d\b", re.IGNORECASE)
"""A note of one machine's measurements or a dated fit history (they go to docs/accuracy/fit_history.md
or benchmarks/README.md, dated)."""


def test_no_machine_notes_or_dated_fit_histories_in_code_or_presets():
    hits = []
    # not the presets `xpar calibrate` writes (conf/hardware/calibrated_*.yaml, git-ignored): a machine's own
    # measurements, dated and named for it by design (README's `xpar calibrate hardware=local --name here` failed
    # this test in the clone of every user who followed it)
    presets = [p for p in (ROOT / "conf").rglob("*.yaml") if not p.name.startswith("calibrated_")]
    for path in sorted([*XPAR.rglob("*.py"), *presets]):
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if m := MACHINE_NOTES.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{i}: {m.group(0)!r}")
    assert not hits, "move to docs/accuracy/fit_history.md or benchmarks/README.md:\n" + "\n".join(hits)


def test_the_notes_check_catches_what_it_names():
    for text in ("1.9 -> 1.0 s measured here", "on a busy 2-core machine", "2 vCPUs", "fitted on 2026-12-03"):
        assert MACHINE_NOTES.search(text), text
    assert not MACHINE_NOTES.search("does not fit this machine: 8 workers need 2 GB each")


PRIVATE_OWNERS = {"torch": "xpar.parallel.torch_internals", "hydra": "xpar.config.hydra_internals"}
PRIVATE_ATTRIBUTES = {"_compute_loss", "_flatten", "_unflatten", "_get_fsdp_state", "_fsdp_param_groups",
                      "_unsharded_param", "_current_autograd_node", "_c10d_functional",
                      "_set_params_and_buffers_to_ignore_for_model"}
"""Private attributes of torch objects that xpar reads (xpar.parallel.torch_internals)."""


def _private(dotted: str) -> bool:
    return any(p.startswith("_") and not p.startswith("__") for p in dotted.split("."))


def private_api_uses(module: str) -> list[str]:
    """Private torch/Hydra modules or names imported, private attributes read from a name bound to
    torch or Hydra, and :data:`PRIVATE_ATTRIBUTES` read from anything, in ``module``."""
    out, bound = [], set()
    for node in ast.walk(_tree(_modules()[module])):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in PRIVATE_OWNERS:
                    bound.add(a.asname or a.name.split(".")[0])
                    if _private(a.name):
                        out.append(f"{node.lineno}: import {a.name}")
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module.split(".")[0] in PRIVATE_OWNERS:
            bound.update(a.asname or a.name for a in node.names)
            out += [f"{node.lineno}: from {node.module} import {a.name}" for a in node.names
                    if _private(node.module) or _private(a.name)]
    for node in ast.walk(_tree(_modules()[module])):
        if isinstance(node, ast.Attribute) and (node.attr in PRIVATE_ATTRIBUTES or (
                _private(node.attr) and isinstance(node.value, ast.Name) and node.value.id in bound)):
            out.append(f"{node.lineno}: .{node.attr}")
    return out


def test_private_torch_and_hydra_apis_only_behind_the_internals_modules():
    found = [f"{_modules()[m].relative_to(ROOT)}:{use}" for m in sorted(_modules())
             if m not in PRIVATE_OWNERS.values() for use in private_api_uses(m)]
    assert not found, "private APIs outside xpar.parallel.torch_internals / xpar.config.hydra_internals:\n" \
                      + "\n".join(found)
    assert private_api_uses("xpar.parallel.torch_internals"), "the check finds nothing where private APIs are"
