"""The training loader end to end: fp32 caches, a missing chunk under worker processes, a job killed mid-epoch.

The e2e part of tests/read/test_loader.py.
"""

from __future__ import annotations

import json
import time

import pytest
from test_loader import assert_a_missing_chunk_stops_the_loader, assert_copied_bit_for_bit, dtype_cache, rows

from dspark_precompute.read.training import build_dataloader


@pytest.fixture(scope="module")
def fp32_run(tmp_path_factory):
    return "fp32", dtype_cache(tmp_path_factory, "fp32")


def test_fp32_and_a_separate_final_norm_are_copied_bit_for_bit(fp32_run):
    assert_copied_bit_for_bit(*fp32_run)


def test_a_missing_chunk_stops_a_loader_with_workers_with_a_missing_chunk_error_never_zeros(cache_copy):
    """A DataLoader whose worker raised takes 2 x 5 s to shut its workers down (torch's join timeout)."""
    assert_a_missing_chunk_stops_the_loader(cache_copy, "block", 2)


TRAIN = r'''
import json, os, sys, time
from dspark_precompute.read.training import build_dataloader

path, ckpt, epochs = sys.argv[1], sys.argv[2], int(sys.argv[3])
loader = build_dataloader(path, batch_size=1, shuffle="block", seed=7, num_workers=2, block_chunks=1, window_blocks=2)
seen = []
if os.path.exists(ckpt):  # restart after preemption: the last checkpoint's history and loader position
    saved = json.load(open(ckpt))
    seen = saved["seen"]
    loader.load_state_dict(saved["loader"])
for epoch in range(loader.epoch, epochs):
    loader.set_epoch(epoch)
    for batch in loader:
        time.sleep(0.15)  # the step
        ids, mask = batch["input_ids"], batch["attention_mask"]
        seen.append([epoch, [ids[r][mask[r].bool()].tolist() for r in range(len(ids))]])
        tmp = ckpt + ".tmp"  # checkpoint after every step, atomically
        with open(tmp, "w") as f:
            json.dump({"seen": seen, "loader": loader.state_dict()}, f)
        os.replace(tmp, ckpt)
'''


def test_a_job_killed_mid_epoch_resumes_without_repeating_or_skipping_a_sample(default_run, tmp_path):
    import os
    import signal
    import subprocess
    import sys

    import psutil

    _, result = default_run
    ckpt = tmp_path / "ckpt.json"
    ref = build_dataloader(result.path, batch_size=1, shuffle="block", seed=7, block_chunks=1, window_blocks=2)
    want = []
    for epoch in range(2):
        ref.set_epoch(epoch)
        want += [[epoch, [list(r) for r in rows(b)]] for b in ref]
    per_epoch = len(want) // 2
    cmd = [sys.executable, "-c", TRAIN, str(result.path), str(ckpt), "2"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    job = subprocess.Popen(cmd, env=env)
    deadline = time.time() + 120
    done = 0
    while time.time() < deadline and job.poll() is None:
        if ckpt.exists():
            done = len(json.loads(ckpt.read_text())["seen"])
            if done >= per_epoch // 2:
                break
        time.sleep(0.02)
    workers = [p.pid for p in psutil.Process(job.pid).children(recursive=True)]
    job.send_signal(signal.SIGKILL)
    job.wait()
    killed_at = json.loads(ckpt.read_text())
    assert 0 < len(killed_at["seen"]) < per_epoch, "the kill did not land in the middle of the first epoch"
    assert killed_at["loader"]["epoch"] == 0 and killed_at["loader"]["batches_done"] == len(killed_at["seen"])
    assert len(workers) == 2
    gone = time.time() + 30  # orphaned workers notice their parent is gone and exit
    while time.time() < gone and any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"
                                     for p in workers):
        time.sleep(0.2)
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in workers)
    subprocess.run(cmd, env=env, check=True, timeout=300)
    assert json.loads(ckpt.read_text())["seen"] == want
