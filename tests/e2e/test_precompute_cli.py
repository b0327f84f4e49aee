"""The Hydra entry point: every config group composes, the CLI runs, multirun makes one cache per value."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import CONF, REPO, compose, small

from dspark_precompute.errors import ConfigError
from dspark_precompute.write.plan.prepare import default_storage_path

BENCH_CONF = REPO / "scripts" / "conf"  # the benchmark targets, composable with hydra.searchpath
# group options that leave a required key (???) to the command line, and a value for it
REQUIRED = {"model/hf": ["model.path=Qwen/Qwen3-0.6B"], "data/jsonl": [f"data.path={REPO / 'pyproject.toml'}"]}


def group_options(root, group: str) -> list[str]:
    return sorted(p.stem for p in (root / group).glob("*.yaml"))


def _leaves(values, prefix: str = "") -> dict:
    if isinstance(values, dict):
        return {k: v for key, sub in values.items() for k, v in _leaves(sub, f"{prefix}{key}.").items()}
    return {prefix[:-1]: values}


OPTIONS = [pytest.param(CONF, g, o, id=f"{g}={o}") for g in ("model", "data", "storage", "batch")
           for o in group_options(CONF, g)]
OPTIONS += [pytest.param(BENCH_CONF, "model", o, id=f"scripts/conf model={o}")
            for o in group_options(BENCH_CONF, "model")]


@pytest.mark.parametrize("root,group,option", OPTIONS)
def test_every_config_group_option_composes_into_the_typed_config_with_each_value_its_file_sets(root, group, option):
    from omegaconf import OmegaConf

    required = REQUIRED.get(f"{group}/{option}", [])
    search = [] if root == CONF else [f"hydra.searchpath=[file://{root}]"]
    cfg = compose([*search, f"{group}={option}", *required])
    written = OmegaConf.to_container(OmegaConf.load(root / group / f"{option}.yaml"), resolve=True)
    expected = {k: v for k, v in _leaves(written, f"{group}.").items() if v != "???"}
    expected.update(o.split("=", 1) for o in required)
    if not expected:  # a file of comments only stands for the schema's defaults of its group
        part = getattr(cfg, group)
        assert part == type(part)(), f"{group}/{option}.yaml sets nothing, yet {group} is not the schema's defaults"
    got = _leaves(cfg.to_dict())
    assert {k: got.get(k, "<not in the typed config>") for k in expected} == expected


def test_an_option_whose_required_value_is_missing_names_the_key_to_set():
    for option, (override,) in REQUIRED.items():
        key = override.split("=", 1)[0]
        with pytest.raises(ConfigError, match=f"{key} is required and has no value"):
            compose([option.replace("/", "=")])


@pytest.mark.parametrize("option", group_options(CONF, "hydra/launcher"))
def test_every_launcher_option_reaches_hydra_with_each_value_its_file_sets(option):
    """The hydra/launcher files configure Hydra itself (submitit), not the typed config: compose with Hydra's."""
    import hydra_plugins.hydra_submitit_launcher  # noqa: F401 - the [test] extra has it: missing, this fails
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    from dspark_precompute.write.config.compose import CONF_DIR, register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = hydra_compose(config_name="config", overrides=[f"hydra/launcher={option}"], return_hydra_config=True)
    written = OmegaConf.to_container(OmegaConf.load(CONF / "hydra" / "launcher" / f"{option}.yaml"))
    written.pop("defaults")
    launcher = OmegaConf.to_container(cfg.hydra.launcher)
    assert written and {k: launcher.get(k) for k in written} == written
    assert launcher["_target_"].startswith("hydra_plugins.hydra_submitit_launcher")


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
    assert "seq_length=-1 must be a positive number of tokens" in out
    assert "storage.dtype=int4: it must be one of [bf16, fp16, fp32, fp8_e4m3]" in out  # as typed, with the choices


def test_a_run_from_a_read_only_directory_says_where_hydra_would_write_and_how_to_move_it(tmp_path, read_only_dir):
    overrides = small(tmp_path)  # the cache itself is writable: only Hydra's record of the run would fail
    proc = subprocess.run([sys.executable, "-m", "dspark_precompute", *overrides], cwd=read_only_dir,
                          capture_output=True, text=True, timeout=300)
    why = "the file system is read-only" if os.geteuid() == 0 else "permission denied"
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.startswith(f"dspark-precompute: writing Hydra's record of the run under {read_only_dir}/"
                                  f"outputs failed: {why} (")
    assert proc.stderr.endswith("run it from a writable directory (or pass hydra.run.dir=DIR), then run the command "
                                "again.\n") and proc.stderr.count("\n") == 1
    assert not (tmp_path / "cache").exists()  # refused before anything was written
    moved = subprocess.run([sys.executable, "-m", "dspark_precompute", *overrides,
                            f"hydra.run.dir={tmp_path}/hydra"], cwd=read_only_dir, capture_output=True, text=True,
                           timeout=300)
    assert moved.returncode == 0, moved.stderr[-3000:]


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
