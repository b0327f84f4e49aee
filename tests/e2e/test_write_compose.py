"""The typed configuration through the command: bad values reported together with exit status 2, nothing created.

The whole-command part of tests/write/config/test_compose.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import compose, small

from dspark_precompute.errors import ConfigError
from dspark_precompute.write.config.compose import from_dict


def cli(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dspark_precompute", *overrides], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)


def test_wrongly_typed_values_are_all_reported_together_with_exit_2_and_nothing_created(tmp_path):
    target = tmp_path / "cache"
    bad = cli(tmp_path, f"storage.path={target}", "seq_length=true", "batch.max_tokens=null", "model.layer_ids=5",
              "data.max_invalid_fraction=abc", "storage.chunk_tokens=1.5")
    assert bad.returncode == 2, bad.stderr
    for key in ("seq_length=true", "batch.max_tokens=null", "model.layer_ids=5", "data.max_invalid_fraction=abc",
                "storage.chunk_tokens=1.5"):
        assert key in bad.stderr, key
    assert "Traceback" not in bad.stderr + bad.stdout
    assert "5 problem" in bad.stderr
    assert not target.exists() and not (tmp_path / "outputs").exists()


def test_a_word_where_a_number_belongs_is_one_clear_line(tmp_path):
    bad = cli(tmp_path, "seq_length=abc")
    assert bad.returncode == 2
    lines = [ln for ln in bad.stderr.splitlines() if ln.strip()]
    assert len(lines) == 2 and "seq_length=abc" in lines[1] and "integer" in lines[1], lines


@pytest.mark.parametrize("group,key", [("model=hf", "model.path"), ("data=jsonl", "data.path")])
def test_a_required_value_left_out_is_an_error_naming_the_key(tmp_path, group, key):
    bad = cli(tmp_path, group, f"storage.path={tmp_path / 'c'}")
    assert bad.returncode == 2 and f"{key} is required" in bad.stderr and "Traceback" not in bad.stderr
    assert not (tmp_path / "c").exists()
    with pytest.raises(ConfigError, match=f"{key} is required"):
        compose([group])


def test_a_misspelt_key_names_the_closest_valid_one(tmp_path):
    bad = cli(tmp_path, "model.pth=x", "storage.compresor=zstd")
    assert bad.returncode == 2
    assert "did you mean model.path?" in bad.stderr and "did you mean storage.compressor?" in bad.stderr
    with pytest.raises(ConfigError, match="did you mean data.max_samples"):
        from_dict({"data": {"max_sample": 3}})


def test_each_value_of_a_sweep_is_checked_before_the_first_job_runs(tmp_path):
    bad = cli(tmp_path, "-m", "seq_length=128,abc", f"storage.root={tmp_path}/caches")
    assert bad.returncode == 2 and "seq_length=abc" in bad.stderr
    assert not (tmp_path / "caches").exists()


def test_an_unknown_group_option_lists_the_available_ones(tmp_path):
    bad = cli(tmp_path, "model=qwen4")
    assert bad.returncode == 2 and "model/qwen4" in bad.stderr and "qwen3_0_6b" in bad.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_composes_on_a_machine_without_it_and_the_run_there_stops_naming_the_device_before_weights_load(
        tmp_path, monkeypatch):
    from dspark_precompute.cli.precompute import _preflight
    from dspark_precompute.write.run import run

    overrides = small(tmp_path, "model.device=cuda")
    assert compose(overrides).model.device == "cuda"  # a login node composes a GPU job
    _preflight(overrides)  # and the command's preflight lets it through (it exits on a problem)

    def boom(*a, **k):
        raise AssertionError("weights were loaded before the refusal")
    monkeypatch.setattr("dspark_precompute.write.run.load_target", boom)
    with pytest.raises(ConfigError) as err:
        run(compose(overrides))
    assert "model.device='cuda' but this machine has no usable CUDA device" in str(err.value)
    assert not (tmp_path / "cache").exists()
    bad = cli(tmp_path, f"storage.path={tmp_path / 'c'}", "model.device=cuda:1")  # the job, where it runs
    out = bad.stdout + bad.stderr  # the job's log (Hydra's console handler writes to stdout)
    assert bad.returncode == 2 and "model.device='cuda:1' but this machine has no usable CUDA device" in out
    assert "Traceback" not in out
    assert not (tmp_path / "c").exists()
