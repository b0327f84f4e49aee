"""The Hydra entry point: every config group composes, the CLI runs, multirun makes one cache per value."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import CONF, REPO, compose, small

from dspark_precompute.write.config import PrecomputeConfig
from dspark_precompute.write.plan import default_storage_path

pytestmark = pytest.mark.e2e  # runs the commands as processes / whole runs


def group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.mark.parametrize("group", ["model", "data", "storage", "batch"])
def test_every_config_group_option_composes_into_a_valid_typed_config(group, tmp_path):
    required = {"hf": ["model.path=Qwen/Qwen3-0.6B"], "jsonl": [f"data.path={REPO / 'pyproject.toml'}"]}
    options = group_options(group)
    assert options
    for option in options:
        text = (CONF / group / f"{option}.yaml").read_text()
        if "../shared/" in text and not (REPO.parent / "shared" / "data").exists():
            continue  # the benchmark targets use the shared Qwen3 tokenizer fixture
        cfg = compose([f"{group}={option}", *required.get(option, [])])
        assert isinstance(cfg, PrecomputeConfig), option


def test_the_shipped_defaults_are_the_documented_ones():
    cfg = compose()
    assert cfg.seq_length == 2048 and cfg.storage.dtype == "bf16" and cfg.model.path == "tiny"
    assert cfg.data.path == "embedded" and cfg.model.draft_num_hidden_layers == 5 and not cfg.overwrite
    assert cfg.model.trust_remote_code is False and cfg.model.layer_ids is None


def test_derived_storage_paths_differ_for_swept_values_and_not_otherwise():
    base = compose()
    paths = {default_storage_path(compose(o)) for o in (
        [], ["seq_length=1024"], ["model.layer_ids=[1,3]"], ["data.mask_reasoning_content=true"],
        ["storage.dtype=fp16"])}
    assert len(paths) == 5
    assert default_storage_path(compose(["batch.max_tokens=4096", "model.device=cpu"])) == \
        default_storage_path(base)


def test_the_cli_runs_and_reports_bad_values_with_exit_code_2(tmp_path):
    ok = subprocess.run([sys.executable, "-m", "dspark_precompute", *small(tmp_path, "log_level=INFO")],
                        cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert "open_cache(" in ok.stdout + ok.stderr and (tmp_path / "cache" / "manifest.json").exists()
    bad = subprocess.run([sys.executable, "-m", "dspark_precompute", "seq_length=-1", "storage.dtype=int4"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2
    out = bad.stdout + bad.stderr
    assert "seq_length=-1" in out and "storage.dtype='int4'" in out


def test_a_multirun_over_two_sequence_lengths_writes_two_caches(tmp_path):
    overrides = [o for o in small(tmp_path) if not o.startswith(("storage.path", "seq_length"))]
    proc = subprocess.run(
        [sys.executable, "-m", "dspark_precompute", "-m", "seq_length=128,256", f"storage.root={tmp_path}/caches",
         "data.max_samples=4", *overrides],
        cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    manifests = sorted((tmp_path / "caches").rglob("manifest.json"))
    assert len(manifests) == 2
    assert sorted(json.loads(m.read_text())["seq_length"] for m in manifests) == [128, 256]
    assert len({m.parent for m in manifests}) == 2
