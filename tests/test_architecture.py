"""The package's plan, enforced: the contract stands alone, the write and read sides depend on it only.

Every ``import`` in the package (at module level and inside functions alike) is checked
against the layer rules below, and the package's import graph must have no cycle, so the
reader-plot circle and verify's reach into the write side cannot come back.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from helpers import REPO

PKG = REPO / "dspark_precompute"
SHARED = {"dspark_precompute.errors", "dspark_precompute.faults", "dspark_precompute.humanize",
          "dspark_precompute.signals", "dspark_precompute.version", "dspark_precompute.progress"}
# torch-facing leaves over the contract (the contract's vocabulary as torch objects): both sides may import them;
# they import only the contract and the shared leaves
BRIDGES = {"dspark_precompute.tensors"}
# side -> the sides (package prefixes) it may import, besides the shared leaf modules
ALLOWED = {
    "contract": ("dspark_precompute.contract",),
    "write": ("dspark_precompute.contract", "dspark_precompute.write"),
    "read": ("dspark_precompute.contract", "dspark_precompute.read"),
    "cli": ("dspark_precompute",),
}
NEVER = {"contract": ("torch", "transformers"), "read": ("transformers",), "bridge": ("transformers",)}


def module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    """Every module a file imports, resolved to absolute names (relative imports included)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    me = module_name(path).split(".")
    package = me if path.name == "__init__.py" else me[:-1]
    out = set()
    type_only = {id(n) for node in ast.walk(tree)  # `if TYPE_CHECKING:` imports: annotations, no runtime dependency
                 if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                 for child in node.body for n in ast.walk(child)}
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)  # `from pkg import module`
    return out


def package_modules() -> dict[str, Path]:
    return {module_name(p): p for p in PKG.rglob("*.py")}


def own_imports(path: Path, modules: dict[str, Path]) -> set[str]:
    return {m for m in imports_of(path) if m in modules and m != module_name(path)}


def side_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 and parts[1] in ALLOWED else None


def test_every_side_imports_only_what_the_layer_rules_allow():
    modules = package_modules()
    assert {"contract", "write", "read", "cli"} <= {side_of(m) for m in modules}
    broken = []
    for name, path in modules.items():
        side = side_of(name)
        imported = imports_of(path)
        for target in own_imports(path, modules):
            if target in SHARED or target == "dspark_precompute":
                continue
            if name in BRIDGES and not target.startswith(ALLOWED["contract"]):
                broken.append(f"{name} (a torch-facing leaf) imports {target}")
            elif target in BRIDGES:
                continue
            elif name in SHARED:
                broken.append(f"{name} (a shared leaf module) imports {target}")
            elif side is not None and not target.startswith(ALLOWED[side]):
                broken.append(f"{name} ({side} side) imports {target}")
        for lib in NEVER.get("bridge" if name in BRIDGES else side or "", ()):
            if any(m == lib or m.startswith(lib + ".") for m in imported):
                broken.append(f"{name} ({side} side) imports {lib}")
    assert not broken, "\n".join(broken)


def test_the_package_import_graph_has_no_cycle():
    modules = package_modules()
    graph = {name: own_imports(path, modules) - {"dspark_precompute"} for name, path in modules.items()}
    seen: dict[str, int] = {}  # 1 = on the stack, 2 = done
    cycles = []

    def visit(node: str, stack: list[str]) -> None:
        seen[node] = 1
        for nxt in sorted(graph[node]):
            if seen.get(nxt) == 1:
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in seen:
                visit(nxt, stack + [nxt])
        seen[node] = 2

    for name in sorted(graph):
        if name not in seen:
            visit(name, [name])
    # a package's __init__ importing its own children (lazily, for a short public name) is not a cycle
    cycles = [c for c in cycles if not all(p.startswith(c.split(" -> ")[0]) for p in c.split(" -> "))]
    assert not cycles, "\n".join(cycles)


# The write side's stages, upstream first: a stage imports only the stages before it (and itself).
WRITE_STAGES = ["config", "parallel", "target", "samples", "regenerate", "plan", "store", "rerun"]
WRITE_DOORS = {"run", "dryrun"}  # write/run.py and write/dryrun.py drive the stages: nothing imports them upward


def write_stage(module: str) -> int | None:
    """The rank of a write-side module's stage (the doors come last); None outside the write side."""
    parts = module.split(".")
    if parts[:2] != ["dspark_precompute", "write"] or len(parts) < 3:
        return None
    if parts[2] in WRITE_DOORS and len(parts) == 3:
        return len(WRITE_STAGES)
    return WRITE_STAGES.index(parts[2]) if parts[2] in WRITE_STAGES else -1


def test_the_write_side_is_its_stages_and_its_doors():
    """Every write module sits in a stage folder (or is one of the doors): the tree shows the flow."""
    stray = [m for m in package_modules() if write_stage(m) == -1]
    assert not stray, "write-side modules outside the stage folders: " + ", ".join(sorted(stray))
    folders = {p.name for p in (PKG / "write").iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == set(WRITE_STAGES)


def test_each_write_stage_docstring_names_its_place_in_the_enforced_order():
    """``Stage N`` at the head of write/<stage>/__init__.py is that stage's place in WRITE_STAGES (from 1)."""
    found = {}
    for stage in WRITE_STAGES:
        doc = ast.get_docstring(ast.parse((PKG / "write" / stage / "__init__.py").read_text())) or ""
        head = re.match(r"Stage (\d+),", doc)
        found[stage] = int(head.group(1)) if head else None
    assert found == {stage: i for i, stage in enumerate(WRITE_STAGES, 1)}


def test_the_write_side_flows_one_way():
    """config -> parallel -> target -> samples -> regenerate -> plan -> store -> rerun, then the doors (run,
    dryrun): nothing downstream is imported upstream."""
    modules = package_modules()
    upstream = [f"{a} imports {b}" for a in modules for b in own_imports(modules[a], modules)
                if (ra := write_stage(a)) is not None and (rb := write_stage(b)) is not None and rb > ra]
    assert not upstream, "\n".join(upstream)


MAX_FUNCTION_LINES = 60


def test_no_function_in_the_package_is_longer_than_60_lines():
    """A function past a screenful does several things: split it into named steps, each saying why it exists."""
    long = []
    for path in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}: {lines} lines")
    assert not long, f"over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)


def test_the_e2e_marker_is_the_e2e_directory():
    """tests/e2e/conftest.py marks everything there; a test elsewhere that needs the marker belongs there instead."""
    tests = REPO / "tests"
    marked = []
    for path in sorted(tests.rglob("*.py")):
        if (tests / "e2e") in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr == "e2e" and isinstance(node.value, ast.Attribute) \
                    and node.value.attr == "mark":
                marked.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not marked, "e2e markers outside tests/e2e/ (move those tests there):\n" + "\n".join(marked)


# Tests mirror the package: a module's tests are in a file named for it (``test_<module>.py``, anywhere under
# tests/, tests/e2e/test_<side>_<module>.py included), or, for a module exercised through a larger one, in the
# test file listed here, which must name the module or one of its top-level functions or classes.
TESTED_BY = {
    "cli/cache.py": "cli/test_cache_cli.py", "cli/precompute.py": "e2e/test_hostile_runs.py",
    "contract/chunks.py": "contract/test_buffer_pool.py", "contract/commits.py": "write/plan/test_resume.py",
    "contract/inventory.py": "e2e/test_bench_smoke.py", "contract/opener.py": "read/test_independent_readers.py",
    "contract/spec.py": "contract/test_manifest.py", "contract/vocab.py": "contract/test_manifest.py",
    "contract/weights.py": "read/test_damage.py", "errors.py": "e2e/test_hostile_runs.py",
    "faults.py": "e2e/test_reliability.py", "progress.py": "e2e/test_s3.py",
    "version.py": "write/plan/test_provenance.py",
    "read/arena.py": "read/test_loader.py", "read/assemble.py": "read/test_loader.py",
    "read/chunks.py": "read/test_loader.py", "read/dataset.py": "read/test_training.py",
    "read/export/common.py": "read/test_export.py", "read/export/deepspec.py": "read/test_export.py",
    "read/export/nemo.py": "read/test_export.py", "read/export/specforge.py": "read/test_export.py",
    "read/export/speculators.py": "read/test_export.py", "read/plot.py": "cli/test_cache_cli.py",
    "read/prefetch.py": "read/test_loader.py", "read/sampling.py": "read/test_training.py",
    "read/summary.py": "read/test_damage.py", "read/verify/checks.py": "read/test_damage.py",
    "read/verify/repair.py": "read/test_damage.py", "read/verify/report.py": "read/test_damage.py",
    "write/config/schema.py": "write/config/test_compose.py", "write/dryrun.py": "write/test_dry_run.py",
    "write/parallel/processes.py": "write/store/test_writer.py",
    "write/plan/array_specs.py": "write/store/test_writer.py", "write/plan/prepare.py": "write/config/test_compose.py",
    "write/plan/regenerated.py": "write/regenerate/test_regenerate.py",
    "write/regenerate/accounting.py": "write/regenerate/test_regenerate.py",
    "write/regenerate/boundaries.py": "write/regenerate/test_regenerate.py",
    "write/regenerate/client.py": "write/regenerate/test_regenerate.py",
    "write/regenerate/engine.py": "e2e/test_write_regenerate.py",
    "write/regenerate/request.py": "write/regenerate/test_regenerate.py",
    "write/regenerate/splice.py": "write/regenerate/test_regenerate.py",
    "write/regenerate/stage.py": "write/regenerate/test_regenerate.py",
    "write/rerun/precision.py": "write/rerun/test_teacher.py",
    "write/samples/encode.py": "write/samples/test_tokenize.py", "write/samples/files.py": "write/samples/test_data.py",
    "write/samples/json_scan.py": "write/samples/test_data.py",
    "write/samples/normalize.py": "write/samples/test_chat.py",
    "write/samples/rows.py": "write/samples/test_data.py", "write/store/allocate.py": "write/store/test_writer.py",
    "write/store/buffers.py": "write/store/test_writer.py",
    "write/target/capture.py": "write/target/test_target.py", "write/target/load.py": "write/target/test_device_map.py",
    "write/target/sharding.py": "e2e/test_write_sharded.py", "write/target/tiny.py": "write/target/test_target.py",
}


def _names_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.ClassDef) and not n.name.startswith("_")}


def test_every_module_has_a_test_file_named_for_it_or_one_listed_that_exercises_it():
    tests = {p.stem for p in (REPO / "tests").rglob("test_*.py")}
    problems = []
    for path in sorted(PKG.rglob("*.py")):
        if path.name in ("__init__.py", "__main__.py"):
            continue
        rel = str(path.relative_to(PKG))
        side = rel.split("/")[0] if "/" in rel else ""
        named = f"test_{path.stem}" in tests or f"test_{side}_{path.stem}" in tests
        listed = TESTED_BY.get(rel)
        if named and listed:
            problems.append(f"{rel}: has tests named for it; drop its TESTED_BY entry")
        elif not named and listed is None:
            problems.append(f"{rel}: no test_{path.stem}.py and no TESTED_BY entry")
        elif listed is not None:
            test = REPO / "tests" / listed
            text = test.read_text(encoding="utf-8") if test.is_file() else ""
            words = set(re.findall(r"[A-Za-z_][A-Za-z_0-9]*", text))
            if not text:
                problems.append(f"{rel}: TESTED_BY names {listed}, which does not exist")
            elif module_name(path) not in text and f"``{rel}``" not in text and not (_names_of(path) & words):
                problems.append(f"{rel}: {listed} names neither the module nor any of its functions or classes")
    assert not problems, "\n".join(problems)
    assert not set(TESTED_BY) - {str(p.relative_to(PKG)) for p in PKG.rglob("*.py")}, "entries for removed modules"
