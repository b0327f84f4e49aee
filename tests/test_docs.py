"""The documentation's generated tables are complete and its links resolve (the site itself: mkdocs build --strict)."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "scripts" / "docs_hooks.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("docs_hooks", module)
    spec.loader.exec_module(module)
    return module


def test_every_config_key_has_a_meaning_in_the_generated_reference():
    from dspark_precompute.write import config

    comments = _hooks()._comments(ROOT / "dspark_precompute" / "write" / "config.py")
    classes = [config.PrecomputeConfig, config.ModelConfig, config.RandomTargetConfig, config.DataConfig,
               config.StorageConfig, config.CaptureConfig, config.BatchConfig, config.PlanConfig]
    undocumented = [f"{cls.__name__}.{f.name}" for cls in classes for f in dataclasses.fields(cls)
                    if not comments.get((cls.__name__, f.name))]
    assert undocumented == []


def test_every_reject_reason_has_a_meaning():
    table = _hooks()._reject_reasons()
    rows = [line for line in table.splitlines()[2:] if line.startswith("| `")]
    from dspark_precompute.contract.vocab import RejectReason

    assert len(rows) == len(RejectReason)
    assert all(not line.rstrip().endswith("|  |") for line in rows), [r for r in rows if r.rstrip().endswith("|  |")]


def test_every_generated_marker_in_the_docs_has_a_generator():
    hooks = _hooks()
    used = {m for page in (ROOT / "docs").glob("*.md") for m in hooks.MARKER.findall(page.read_text())}
    assert used == set(hooks.GENERATORS)  # none unknown, none unused
    for name in used:
        assert hooks.GENERATORS[name]().count("\n") > 3


@pytest.mark.parametrize("page", ["README.md", "CONTRIBUTING.md", "CHANGELOG.md"])
def test_relative_links_of_the_top_level_pages_point_at_files_that_exist(page):
    text = (ROOT / page).read_text()
    targets = [t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", text) if "://" not in t]
    missing = [t for t in targets if t and not (ROOT / t).exists()]
    assert targets and missing == []


# -- every file, test and section the docs and comments name exists --------------------------------------------

PKG, TESTS = ROOT / "dspark_precompute", ROOT / "tests"
SKIP_DIRS = {".git", ".venv", "__pycache__", ".mypy_cache", ".pytest_cache", ".ruff_cache", ".hypothesis", "site"}
# Another project's files that trainers.md names as read in that project's code, under a folder name we have too
FOREIGN = {"scripts/data/prepare_target_cache.py": "DeepSpec's writer",
           "scripts/prepare_hidden_states.py": "SpecForge's writer"}
PATH_RE = re.compile(r"(?<![\w./~*<>{}:-])((?:[\w.-]+/)*[\w.-]+\.(?:py|md|yaml|yml|toml|sh|ipynb))"
                     r"((?:::[\w.\[\]-]+)*)")
DIR_RE = re.compile(r"`((?:[\w.-]+/)+)`")  # a folder, only as code: `tests/e2e/`
SECTION_RE = re.compile(r"\b(README|CONTRIBUTING)(?:\.md)? \"([^\"]+)\"")  # README "Configuration"


def _texts() -> list[tuple[Path, str]]:
    """The pages (README, CONTRIBUTING, docs/*.md) whole, and the comments of conf/**/*.yaml and pyproject.toml."""
    pages = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
    out = [(p, p.read_text(encoding="utf-8")) for p in pages]
    for f in [*sorted((ROOT / "conf").rglob("*.yaml")), ROOT / "pyproject.toml"]:
        lines = f.read_text(encoding="utf-8").splitlines()
        out.append((f, "\n".join(line.split("#", 1)[1] for line in lines if "#" in line)))
    return [(f, re.sub(r"\S*(?:://|github\.com/)\S*", " ", text)) for f, text in out]  # URLs name others' files


def _ours() -> set[str]:
    """First path components that are this repository's: its top level, the package's and the tests' folders."""
    return {p.name for base in (ROOT, PKG, TESTS) for p in base.iterdir() if p.name not in SKIP_DIRS}


def _basenames() -> set[str]:
    return {p.name for base in (PKG, TESTS, ROOT / "scripts", ROOT / "docs", ROOT / "examples") for p in base.rglob("*")
            if not SKIP_DIRS & set(p.parts)} | {p.name for p in ROOT.iterdir()}


def _resolve(page: Path, name: str) -> Path | None:
    """A path as the docs write it: from the checkout, the page's folder, the package or the tests."""
    for base in (ROOT, page.parent, PKG, TESTS):
        if (base / name).exists():
            return base / name
    return None


def _defines(path: Path, names: list[str]) -> bool:
    """``path`` defines ``names[0]`` (a function or class; a test's parameters in [...] aside), ``names[1]`` inside
    it, and so on."""
    import ast

    body = ast.parse(path.read_text(encoding="utf-8")).body
    for name in names:
        found = [n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                 and n.name == name.split("[")[0]]
        if not found:
            return False
        body = getattr(found[0], "body", [])
    return True


def _broken_references(texts: list[tuple[Path, str]]) -> list[str]:
    ours, basenames, broken = _ours(), _basenames(), []
    for page, text in texts:
        where = page.relative_to(ROOT) if page.is_relative_to(ROOT) else page.name
        for m in PATH_RE.finditer(text):
            name, members = m.group(1), [x for x in m.group(2).split("::") if x]
            first = name.split("/")[0]
            if name in FOREIGN or (first not in ours if "/" in name else not name.endswith(".py")):
                continue  # another project's, a cache's (.hydra/config.yaml), a command's output (--markdown x.md)
            found = _resolve(page, name) if "/" in name else None
            if found is None and "/" not in name and name in basenames:
                continue  # a module named by its file name alone (`spec.py`)
            if found is None:
                broken.append(f"{where}: {name} does not exist")
            elif members and not (found.suffix == ".py" and _defines(found, members)):
                broken.append(f"{where}: {name} has no {'.'.join(members)}")
        for m in DIR_RE.finditer(text):
            if m.group(1).split("/")[0] in ours and _resolve(page, m.group(1)) is None:
                broken.append(f"{where}: the folder {m.group(1)} does not exist")
        for m in SECTION_RE.finditer(text):
            headings = re.findall(r"^#+\s+(.+?)\s*$", (ROOT / f"{m.group(1)}.md").read_text(), re.M)
            if m.group(2) not in headings:
                broken.append(f"{where}: {m.group(1)}.md has no section {m.group(2)!r} (its sections: {headings})")
    return broken


def test_every_file_test_and_section_the_docs_and_config_comments_name_exists():
    """README, CONTRIBUTING, docs/*.md and the comments of conf/ and pyproject.toml: every repository file they name
    (from the checkout, the page, the package or tests/), every ``path::name`` (a function, class or test defined
    there) and every README/CONTRIBUTING section quoted by name."""
    assert _broken_references(_texts()) == []


def test_the_reference_check_finds_a_missing_file_test_and_section(tmp_path):
    """The oracle for the check above: it finds each kind of stale pointer and passes what exists or is not ours."""
    text = ("`tests/test_docs.py::no_such_test`, `dspark_precompute/write/gone.py`, `tests/nowhere/`, "
            "see README \"No such section\"; `tests/test_docs.py::test_every_reject_reason_has_a_meaning`, "
            "`read/test_damage.py`, `contract/spec.py`, `spec.py`, `manifest.json`, `.hydra/config.yaml`, "
            "`deepspec/data/parser.py`, scripts/data/prepare_target_cache.py, https://github.com/a/b/blob/x/c.py, "
            "README \"Use it\"")
    broken = [b.split(": ", 1)[1] for b in _broken_references([(tmp_path / "page.md", text)])]
    assert broken[:3] == ["tests/test_docs.py has no no_such_test", "dspark_precompute/write/gone.py does not exist",
                          "the folder tests/nowhere/ does not exist"]
    assert len(broken) == 4 and broken[3].startswith("README.md has no section 'No such section'"), broken
