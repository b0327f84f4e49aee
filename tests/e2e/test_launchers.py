"""Hydra launchers: a 2x2 sweep, and submitit's local executor running 2 tasks as 2 ranks."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import yaml
from helpers import assert_same_cache, compose, small

from dspark_precompute.write.run import run

UNITS = ("storage.chunk_tokens=256", "storage.unit_tokens=1024")


def cli(tmp_path, *args, timeout=600):
    return subprocess.run([sys.executable, "-m", "dspark_precompute", *args], cwd=tmp_path, capture_output=True,
                          text=True, timeout=timeout)


def test_a_2x2_sweep_writes_four_caches_each_with_its_manifest_and_hydra_record(tmp_path):
    base = [o for o in small(tmp_path) if not o.startswith(("storage.path", "seq_length"))]
    proc = cli(tmp_path, "-m", "seq_length=128,256", "model.layer_ids=[0,3],[1,2]", f"storage.root={tmp_path}/c",
               *base, "data.max_samples=3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    manifests = sorted((tmp_path / "c").rglob("manifest.json"))
    assert len(manifests) == 4
    seen = set()
    for m in manifests:
        man = json.loads(m.read_text())
        overrides = yaml.safe_load((m.parent / ".hydra" / "overrides.yaml").read_text())
        assert f"seq_length={man['seq_length']}" in overrides
        seen.add((man["seq_length"], tuple(man["layer_ids"])))
    assert seen == {(s, ids) for s in (128, 256) for ids in ((0, 3), (1, 2))}


def test_submitits_local_executor_runs_two_tasks_as_two_ranks_into_one_cache(tmp_path):
    overrides = small(tmp_path, *UNITS, "data.max_samples=16", name="slurm")
    proc = cli(tmp_path, "-m", "hydra/launcher=local_tasks", *overrides)
    assert proc.returncode == 0, proc.stderr[-3000:]
    logs = sorted(tmp_path.rglob("*_log.out"))
    assert len(logs) == 2 and all("global_rank=" in p.read_text() for p in logs)
    run(compose(small(tmp_path, *UNITS, "data.max_samples=16", name="single")))
    assert_same_cache(str(tmp_path / "single"), str(tmp_path / "slurm"))


@pytest.mark.slow  # 22 s here; the submitit local executor test above keeps the launcher in the default lane
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a GPU job submitted from a machine without")
def test_a_gpu_sweep_submitted_from_a_machine_without_cuda_is_launched_and_each_task_checks_its_own_device(tmp_path):
    """The SLURM path from a login node: composing and submitting do not look at this machine's GPUs; every
    task (here: submitit's local executor, 2 tasks as 2 ranks) checks the device where it runs, before weights."""
    proc = cli(tmp_path, "-m", "hydra/launcher=local_tasks", *small(tmp_path, "model.device=cuda", name="gpu"),
               timeout=300)
    logs = sorted(tmp_path.rglob("*_log.out"))
    assert len(logs) == 2, proc.stderr[-3000:]  # submitted: two tasks ran
    for log in logs:
        assert "model.device='cuda' but this machine has no usable CUDA device" in log.read_text(), log
    assert proc.returncode != 0 and "invalid configuration" in proc.stdout + proc.stderr
    assert not (tmp_path / "gpu").exists()
