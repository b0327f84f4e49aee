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
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("docs_hooks", module)
    spec.loader.exec_module(module)
    return module


def test_every_config_key_has_a_meaning_in_the_generated_reference():
    from dspark_precompute.write.config import schema as config

    comments = _hooks()._comments(ROOT / "dspark_precompute" / "write" / "config" / "schema.py")
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
