"""The bench scripts share one library: each imports ``scripts/benchlib.py`` and no other script's helpers.

``bench.py`` dispatches to its sub-benchmarks and ``gpu_bench.py`` runs ``bench.py``'s methods;
nothing else crosses between scripts, so no import runs in a circle.
"""

from __future__ import annotations

import ast

from helpers import REPO

SCRIPTS = REPO / "scripts"
ALLOWED = {("bench", "bench_write"), ("bench", "bench_tokenize"), ("bench", "bench_scale"), ("gpu_bench", "bench")}


def _script_imports() -> set[tuple[str, str]]:
    """(importer, imported) for every import of one script by another, found in the source (any depth)."""
    names = {p.stem for p in SCRIPTS.glob("*.py")}
    edges = set()
    for path in SCRIPTS.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            edges |= {(path.stem, m) for m in mods if m in names and m != path.stem}
    return edges


def test_every_bench_script_imports_benchlib_and_no_other_scripts_helpers():
    edges = _script_imports()
    assert {a for a, b in edges if b == "benchlib"} == {p.stem for p in SCRIPTS.glob("*.py")} - {"benchlib"}
    assert {e for e in edges if e[1] != "benchlib"} <= ALLOWED, edges
    assert not any(a == "benchlib" for a, _ in edges)  # the library imports no script


def test_no_import_between_the_scripts_runs_in_a_circle():
    edges = _script_imports()
    reach = {a: {b for x, b in edges if x == a} for a, _ in edges}
    for _ in range(len(reach)):  # transitive closure
        reach = {a: bs | {c for b in bs for c in reach.get(b, ())} for a, bs in reach.items()}
    assert not [a for a, bs in reach.items() if a in bs], reach
