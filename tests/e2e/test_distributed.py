"""Data parallel: torchrun ranks (gloo, CPU) write one cache identical to a single process."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
from helpers import assert_same_cache, compose, small

from dspark_precompute.write.parallel.distributed import assign_units
from dspark_precompute.write.run import run

UNITS = ("storage.chunk_tokens=256", "storage.unit_tokens=1024")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(tmp_path: Path, n: int, overrides: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={n}", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", "-m", "dspark_precompute", *overrides]
    return subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def test_units_are_balanced_by_tokens_and_each_goes_to_exactly_one_rank():
    tokens = np.asarray([900, 100, 500, 500, 300, 700])
    parts = assign_units(tokens, 2)
    assert sorted(u for p in parts for u in p) == list(range(6))
    loads = [int(tokens[p].sum()) for p in parts]
    assert abs(loads[0] - loads[1]) <= 100
    assert assign_units(tokens, 1) == [list(range(6))]


def test_two_torchrun_ranks_write_a_cache_bit_identical_to_one_process(tmp_path):
    run(compose(small(tmp_path, *UNITS, "data.max_samples=24", name="single")))
    proc = torchrun(tmp_path, 2, small(tmp_path, *UNITS, "data.max_samples=24", name="ddp"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert_same_cache(str(tmp_path / "single"), str(tmp_path / "ddp"))
    hosts = {__import__("json").loads(p.read_text())["host"] for p in (tmp_path / "ddp" / "commits").glob("u*.json")}
    assert hosts  # commit records name who wrote them
    assert not (tmp_path / "ddp" / "coord").exists()
    # only rank 0 wrote Hydra's output dir
    assert len(list((tmp_path / "outputs").rglob(".hydra"))) == 1


def test_a_ddp_run_killed_on_one_rank_resumes_with_another_world_size(tmp_path):
    overrides = small(tmp_path, *UNITS, "data.max_samples=24", name="ddp")
    proc = torchrun(tmp_path, 2, overrides, env={"DSPARK_FAULT": "unit_submitted=2"})
    assert proc.returncode != 0
    resumed = run(compose(overrides))  # one process finishes what two started
    assert resumed.complete and resumed.units_written >= 1
    run(compose(small(tmp_path, *UNITS, "data.max_samples=24", name="single")))
    assert_same_cache(str(tmp_path / "single"), str(tmp_path / "ddp"))


def test_a_failing_rank_stops_the_others_promptly_and_leaves_a_resumable_cache(tmp_path):
    import time

    overrides = small(tmp_path, *UNITS, "data.max_samples=24", name="ddp")
    t0 = time.perf_counter()
    proc = torchrun(tmp_path, 2, overrides, env={"DSPARK_FAULT": "unit_submitted=1:raise", "DSPARK_FAULT_RANK": "1"})
    assert proc.returncode != 0
    assert time.perf_counter() - t0 < 120  # no barrier hang
    assert "injected fault" in proc.stderr + proc.stdout
    assert run(compose(overrides)).complete
