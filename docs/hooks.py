"""MkDocs hooks: the pages that are generated, not typed.

``<!-- xpar:NAME -->`` in a page is replaced at build time by :data:`GENERATORS`' ``NAME``: the
configuration reference from the structured config schema (:mod:`xpar.config.schema`: type,
default, the field's docstring, valid values from :mod:`xpar.config.checks` and the presets in
``conf/``), the package layers from each package's docstring, and the framework profiles from
their files' headers. tests/test_docs.py builds the site strictly and checks every schema key.
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def field_docs(cls) -> dict[str, str]:
    """The attribute docstrings of a dataclass (the string right under each field), by field."""
    tree = ast.parse(Path(inspect.getsourcefile(cls)).read_text())
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
    out, body = {}, node.body
    for i, stmt in enumerate(body[:-1]):
        nxt = body[i + 1]
        if isinstance(stmt, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            out[stmt.target.id] = " ".join(str(nxt.value.value).split())
    return out


def _plain(text: str) -> str:
    """Sphinx roles (:class:`x`) as code (`x`), double backticks as single."""
    return re.sub(r":(?:mod|func|class|data|meth|attr):`~?([^`]+)`", r"`\1`", text).replace("``", "`")


def _type(f) -> str:
    t = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    return t.replace("Optional[", "").replace("]", " or None") if t.startswith("Optional[") else t


def _default(f) -> str:
    if f.default is not dataclasses.MISSING:
        return repr(f.default)
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return repr(f.default_factory())  # type: ignore[misc]
    return "required"


def _choices() -> dict[str, tuple]:
    from xpar.config.checks.config import CHOICES
    from xpar.config.checks.framework import CHOICES as FRAMEWORK_CHOICES
    return {**CHOICES, **{k if "." in k else f"framework.{k}": v for k, v in FRAMEWORK_CHOICES.items()}}


def config_reference() -> str:
    """Markdown: one table per group of :class:`xpar.config.schema.XparConfig`, a row per key."""
    from xpar.config import schema
    from xpar.config.presets import presets
    choices, out = _choices(), []
    for group in dataclasses.fields(schema.XparConfig):
        cls = group.default_factory  # type: ignore[misc]
        out.append(f"## `{group.name}`\n\n{_plain(' '.join((cls.__doc__ or '').split()))}\n")
        names = presets(group.name) if (ROOT / "conf" / group.name).is_dir() else []
        if names:
            out.append("Presets: " + ", ".join(f"`{group.name}={n}`" for n in names) + "\n")
        out.append("| key | type | default | meaning | valid values |\n|---|---|---|---|---|")
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            key = f"{group.name}.{f.name}"
            valid = ", ".join(f"`{v}`" for v in choices.get(key, ()))
            meaning = _plain(docs.get(f.name, "")).replace("|", "\\|")
            out.append(f"| `{key}` | {_type(f)} | `{_default(f)}` | {meaning} | {valid} |")
        out.append("")
    return "\n".join(out)


LAYERS = ("config", "models", "parallel", "estimate", "track", "plan", "run", "calibrate")


def _stems(folder: Path) -> list[str]:
    return sorted(p.stem for p in folder.glob("*.py") if p.stem != "__init__")


def layers() -> str:
    """Markdown: each package of ``xpar/``, lowest layer first, with its docstring."""
    rows = []
    for i, pkg in enumerate(LAYERS, 1):
        doc = ast.get_docstring(ast.parse((ROOT / "xpar" / pkg / "__init__.py").read_text())) or ""
        mods = [f"`{m}`" for m in _stems(ROOT / "xpar" / pkg)]
        mods += [f"`{p.parent.name}/` ({', '.join(_stems(p.parent))})" for p in (ROOT / "xpar" / pkg).glob("*/__init__.py")]
        doc = _plain(doc)
        rows.append(f"### {i}. `xpar/{pkg}/`\n\n{doc}\n\nModules: " + ", ".join(sorted(mods)) + "\n")
    return "\n".join(rows)


def frameworks() -> str:
    """Markdown: each framework profile (conf/framework/*.yaml) with the sources in its header."""
    out = []
    for path in sorted((ROOT / "conf" / "framework").glob("*.yaml")):
        header = [ln[2:] if ln.startswith("# ") else ln[1:] for ln in path.read_text().splitlines()
                  if ln.startswith("#")]
        out.append(f"### `framework={path.stem}`\n\n" + "\n".join(header) + "\n")
    return "\n".join(out)


def metrics() -> str:
    """Markdown: the summary metrics of every run."""
    from xpar.config.schema import SUMMARY_METRICS
    return "\n".join(f"- `{m}`" for m in SUMMARY_METRICS) + "\n"


GENERATORS = {"config-reference": config_reference, "layers": layers, "frameworks": frameworks, "metrics": metrics}


def on_page_markdown(markdown: str, page, config, files) -> str:
    """MkDocs hook: replace each ``<!-- xpar:NAME -->`` by its generated markdown."""
    return re.sub(r"<!-- xpar:([a-z-]+) -->", lambda m: GENERATORS[m.group(1)](), markdown)
