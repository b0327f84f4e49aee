"""mkdocs hooks: the pages' generated parts, made from the code that owns them (never hand-copied).

``<!-- generated: NAME -->`` in a page is replaced by the table ``NAME`` builds: the manifest's fields
(``contract/manifest.py`` FIELDS), the reject reasons (``contract/vocab.py``), and the configuration
reference (the dataclasses of ``write/config/schema.py``, their defaults and the comment or docstring beside
each field).
"""

from __future__ import annotations

import ast
import dataclasses
import io
import re
import tokenize
from enum import Enum
from pathlib import Path
from typing import Any

MARKER = re.compile(r"<!-- generated: ([a-z-]+) -->")
CONFIG_PY = Path(__file__).resolve().parents[1] / "dspark_precompute" / "write" / "config" / "schema.py"


def _manifest_fields() -> str:
    from dspark_precompute.contract.manifest import fields_markdown

    return fields_markdown()


def _reject_reasons() -> str:
    from dspark_precompute.contract.vocab import RejectReason

    comments = _comments(Path(__file__).resolve().parents[1] / "dspark_precompute" / "contract" / "vocab.py")
    rows = ["| reason | meaning |", "| --- | --- |"]
    rows += [f"| `{r.value}` | {comments.get(('RejectReason', r.name), '')} |" for r in RejectReason]
    return "\n".join(rows) + "\n"


def _comments(path: Path) -> dict[tuple[str, str], str]:
    """(class, attribute) -> the comment on the attribute's line, or the docstring literal after it."""
    source = path.read_text(encoding="utf-8")
    line_comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            line_comments[tok.start[0]] = tok.string.lstrip("# ").strip()
    code_lines = {n.lineno for n in ast.walk(ast.parse(source)) if isinstance(n, ast.stmt)}
    out: dict[tuple[str, str], str] = {}
    for cls in (n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef)):
        for k, node in enumerate(cls.body):
            target = node.target if isinstance(node, ast.AnnAssign) else (
                node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None)
            if not isinstance(target, ast.Name):
                continue
            doc = line_comments.get(node.lineno, "")  # a comment on the field's own line
            above = node.lineno - 1
            if not doc and above in line_comments and above not in code_lines:  # or a comment line above it
                doc = line_comments[above]
            nxt = cls.body[k + 1] if k + 1 < len(cls.body) else None
            if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
                doc = " ".join(nxt.value.value.split())  # an attribute docstring wins
            out[(cls.name, target.id)] = doc.replace("|", "\\|")
    return out


def _type_name(t: Any) -> str:
    text = t if isinstance(t, str) else getattr(t, "__name__", str(t))
    return text.replace("typing.", "").replace("|", "or").replace("  ", " ")


def _default(f: dataclasses.Field[Any]) -> str:
    if f.default is not dataclasses.MISSING:
        v = f.default
        if isinstance(v, bool):
            return f"`{str(v).lower()}`"  # as YAML and the command line spell it
        return f"`{v.value if isinstance(v, Enum) else v!r}`".replace("'", "") if v is not None else "`null`"
    return "(section)"


def _sections(prefix: str, cls: type) -> list[tuple[str, type]]:
    """``(key prefix, dataclass)`` of ``cls`` and of every section nested in it (model.random, ...), in order."""
    out = [(prefix, cls)]
    for f in dataclasses.fields(cls):
        if f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(f.default_factory):
            out += _sections(f"{prefix}.{f.name}" if prefix else f.name, f.default_factory)  # type: ignore[arg-type]
    return out


def _config_reference() -> str:
    from dspark_precompute.write.config import schema as config

    comments = _comments(CONFIG_PY)
    parts = []
    for prefix, cls in _sections("", config.PrecomputeConfig):
        rows = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
        for f in dataclasses.fields(cls):
            if f.default_factory is not dataclasses.MISSING:
                continue  # a section of its own
            key = f"{prefix}.{f.name}" if prefix else f.name
            choices = ""
            if isinstance(f.default, Enum):
                choices = " (" + ", ".join(f"`{m.value}`" for m in type(f.default)) + ")"
            rows.append(f"| `{key}` | {_type_name(f.type)}{choices} | {_default(f)} | "
                        f"{comments.get((cls.__name__, f.name), '')} |")
        doc = " ".join((cls.__doc__ or "").split())
        parts.append(f"### `{prefix or 'top level'}`\n\n{doc}\n\n" + "\n".join(rows) + "\n")
    return "\n".join(parts)


GENERATORS = {"manifest-fields": _manifest_fields, "reject-reasons": _reject_reasons,
              "config-reference": _config_reference}


def on_page_markdown(markdown: str, **_: Any) -> str:
    def fill(m: re.Match[str]) -> str:
        name = m.group(1)
        if name not in GENERATORS:
            raise KeyError(f"no generator for <!-- generated: {name} --> (known: {sorted(GENERATORS)})")
        return GENERATORS[name]()

    return MARKER.sub(fill, markdown)
