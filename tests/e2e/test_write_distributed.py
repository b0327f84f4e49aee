"""Data parallel: torchrun ranks (gloo, CPU) write one cache identical to a single process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import assert_same_cache, compose, small

from dspark_precompute.write.parallel.distributed import Ranks, assign_units, unit_share
from dspark_precompute.write.run import run

UNITS = ("storage.chunk_tokens=256", "storage.unit_tokens=1024")


def torchrun_cmd(n: int, *args: str) -> list[str]:
    """torchrun on this host, ``n`` ranks: ``--standalone``, so its agent binds the rendezvous store on a port the
    kernel picks and the ranks join that store. A port picked here and bound later by torchrun (the old
    ``--master_port=<free port>``) could be taken meanwhile by another run on this shared machine."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", *args]


def torchrun(tmp_path: Path, n: int, overrides: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = torchrun_cmd(n, "-m", "dspark_precompute", *overrides)
    return subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def test_units_are_balanced_by_tokens_and_each_goes_to_exactly_one_rank():
    tokens = np.asarray([900, 100, 500, 500, 300, 700])
    parts = assign_units(tokens, 2)
    assert sorted(u for p in parts for u in p) == list(range(6))
    loads = [int(tokens[p].sum()) for p in parts]
    assert abs(loads[0] - loads[1]) <= 100
    assert assign_units(tokens, 1) == [list(range(6))]


def test_a_tensor_parallel_group_forwards_the_same_units_and_only_its_first_rank_writes():
    tokens = np.asarray([900, 100, 500, 500, 300, 700])
    todo = [0, 2, 3, 5]  # 1 and 4 are already committed
    shares = [unit_share(todo, tokens, Ranks(rank=r, world=4), tp=2) for r in range(4)]
    assert shares[0][0] == shares[1][0] and shares[2][0] == shares[3][0]
    assert [w for _, w in shares] == [True, False, True, False]
    assert sorted(shares[0][0] + shares[2][0]) == todo
    assert [s for s, _ in (unit_share(todo, tokens, Ranks(rank=r, world=2)) for r in range(2))] == [
        [todo[i] for i in part] for part in assign_units(tokens[todo], 2)]


def test_two_torchrun_ranks_write_a_cache_bit_identical_to_one_process(tmp_path):
    run(compose(small(tmp_path, *UNITS, "data.max_samples=24", name="single")))
    proc = torchrun(tmp_path, 2, small(tmp_path, *UNITS, "data.max_samples=24", name="ddp"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert_same_cache(str(tmp_path / "single"), str(tmp_path / "ddp"))
    hosts = {json.loads(p.read_text())["host"] for p in (tmp_path / "ddp" / "commits").glob("u*.json")}
    assert hosts  # commit records name who wrote them
    assert not (tmp_path / "ddp" / "coord").exists()
    # only rank 0 wrote Hydra's output dir
    assert len(list((tmp_path / "outputs").rglob(".hydra"))) == 1


@pytest.mark.slow  # moved out of the default lane to keep it under 10 minutes (CONTRIBUTING)
def test_a_ddp_run_killed_on_one_rank_resumes_with_another_world_size(tmp_path):
    overrides = small(tmp_path, *UNITS, "data.max_samples=24", name="ddp")
    proc = torchrun(tmp_path, 2, overrides, env={"DSPARK_FAULT": "unit_submitted=2"})
    assert proc.returncode != 0
    resumed = run(compose(overrides))  # one process finishes what two started
    assert resumed.complete and resumed.units_written >= 1
    run(compose(small(tmp_path, *UNITS, "data.max_samples=24", name="single")))
    assert_same_cache(str(tmp_path / "single"), str(tmp_path / "ddp"))


def units_per_rank(cache: Path, world: int) -> list[list[int]]:
    """Each rank's units in a fresh run, from a complete cache of the same rows and layout."""
    records = [json.loads(p.read_text()) for p in sorted((cache / "commits").glob("u*.json"))]
    tokens = np.zeros(len(records), dtype=np.int64)
    for r in records:
        tokens[r["unit"]] = r["token_stop"] - r["token_start"]
    return assign_units(tokens, world)


@pytest.mark.slow  # moved out of the default lane to keep it under 10 minutes (CONTRIBUTING)
def test_a_failing_rank_stops_the_others_at_their_next_unit_and_every_unit_handed_to_the_writers_is_committed(
        tmp_path):
    overrides = small(tmp_path, *UNITS, "data.max_samples=24", name="ddp")
    run(compose(small(tmp_path, *UNITS, "data.max_samples=24", name="single")))
    share = units_per_rank(tmp_path / "single", 2)
    assert all(len(units) >= 2 for units in share), share
    # Rank 1 fails right after handing its first unit to its writers. Rank 0 waits before its second unit until
    # rank 1's failure marker exists, so it then reads that marker at the unit boundary: no timing decides.
    env = {"DSPARK_FAULT": "unit_submitted=1:raise@1,unit_start=2:await@0",
           "DSPARK_FAULT_AWAIT": str(tmp_path / "ddp" / "coord" / "*" / "failed-1.json")}
    proc = torchrun(tmp_path, 2, overrides, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "injected fault at unit_submitted" in out and "waited" not in out
    committed = {int(p.stem[1:]) for p in (tmp_path / "ddp" / "commits").glob("u*.json")}
    # both ranks' first units were handed to the writers before the stop, and both are kept
    assert committed == {share[0][0], share[1][0]}, (committed, share)
    marker = json.loads((next((tmp_path / "ddp" / "coord").glob("*/failed-0.json"))).read_text())
    assert "rank 1 failed, so rank 0 stops too" in marker["error"]
    resumed = run(compose(overrides))
    assert resumed.complete and resumed.resumed_units == 2
    assert_same_cache(str(tmp_path / "single"), str(tmp_path / "ddp"))
