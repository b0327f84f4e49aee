"""Capture and training at once through a window: the producer and a trainer as separate processes, each killed
(DSPARK_FAULT) and restarted; what the trainer received equals a full cache of the same rows, each sample
``passes`` times, and the window's records leave a cache ``verify`` and ``info`` accept."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import compose, small
from test_s3 import bucket, local_reference, s3_endpoint, tiny_run  # noqa: F401 - fixtures

from dspark_precompute.contract.store import CacheStore
from dspark_precompute.contract.window import StreamRecord, released_units
from dspark_precompute.errors import WindowError
from dspark_precompute.read.reader import open_cache
from dspark_precompute.read.verify import verify_cache
from dspark_precompute.write.run import run

UNITS = ("storage.chunk_tokens=256", "storage.unit_tokens=512", "data.max_samples=16")
PASSES = 2

TRAIN = r'''
import hashlib, json, os, sys
import torch
from dspark_precompute.read.training import build_dataloader

def bits(t):  # a state's exact bf16 bits: the oracle (a resumed run promises the same bytes as one never stopped)
    return hashlib.sha256(t.contiguous().view(torch.int16).numpy().tobytes()).hexdigest()[:20]

path, ckpt = sys.argv[1], sys.argv[2]
loader = build_dataloader(path, stream=True, batch_size=1, passes=int(sys.argv[3]), seed=5, poll_s=0.05)
seen = []
if os.path.exists(ckpt):  # a restart: the last checkpoint's history and the stream position
    saved = json.load(open(ckpt))
    seen = saved["seen"]
    loader.load_state_dict(saved["loader"])
for batch in loader:
    ids, mask = batch["input_ids"], batch["attention_mask"]
    for r in range(len(ids)):
        m = mask[r].bool()
        hid, last = batch["target_hidden_states"][r][m], batch["target_last_hidden_states"][r][m]
        seen.append([ids[r][m].tolist(), bits(hid), bits(last),  # the key; the sums only say by how much it differs
                     float(hid.double().sum()), float(last.double().sum())])
    tmp = ckpt + ".tmp"  # a checkpoint after every step, atomically
    with open(tmp, "w") as f:
        json.dump({"seen": seen, "loader": loader.state_dict()}, f)
    os.replace(tmp, ckpt)
loader.close()
'''


def _bits(t: torch.Tensor) -> str:
    """TRAIN's ``bits``: the sha256 of a state's bf16 bits (exact: no float sum whose order could matter)."""
    return hashlib.sha256(t.contiguous().view(torch.int16).numpy().tobytes()).hexdigest()[:20]


def delivered(seen: list) -> Counter:
    """What TRAIN's checkpoint says the trainer received: (ids, hidden bits, post-norm bits) -> times."""
    return Counter((tuple(ids), h, last) for ids, h, last, *_ in seen)


def _expected(path: str) -> Counter:
    """What a trainer must receive from the cache at ``path`` (written in full): each sample ``PASSES`` times, keyed
    as :func:`delivered` keys it. Exact bits, not a tolerance: the capture is bit-identical from run to run
    (same batches per unit wherever a run resumed: ``write/store/batching.py``), and docs/reliability.md promises a
    resumed run's bytes are an uninterrupted run's."""
    c = open_cache(path)
    out: Counter = Counter()
    for i in range(len(c)):
        s = c[i]
        out[(tuple(s["input_ids"].tolist()), _bits(s["target_hidden_states"]),
             _bits(s["target_last_hidden_states"]))] += PASSES
    return out


def deliveries_differ(got: Counter, want: Counter, seen: list, path: str) -> str:
    """Why ``got`` is not ``want``, sample by sample: its unit in the full cache at ``path``, the times received
    against promised, and whether its states' bits differ (with the sums, to tell one rounding from garbage)."""
    c = open_cache(path)
    units = c.units()
    where = {tuple(s["input_ids"].tolist()): (i, int(units[i]), float(s["target_hidden_states"].double().sum()))
             for i, s in enumerate(c)}
    sums = {(tuple(ids), h, last): (a, b) for ids, h, last, a, b in seen}
    lines = []
    for key in sorted(set(got) | set(want), key=lambda k: where.get(k[0], (-1, -1, 0.0))):
        if got[key] == want[key]:
            continue
        i, unit, ref_sum = where.get(key[0], (-1, -1, float("nan")))
        state = "states as the full cache's" if key in want else (
            f"states NOT the full cache's (hidden sum {sums[key][0]!r}, full cache's {ref_sum!r})")
        lines.append(f"sample {i} (unit {unit}, {len(key[0])} tokens, ids {list(key[0][:6])}...): received "
                     f"{got[key]} times, promised {want[key]}; {state}")
    return "\n".join(lines)


def _supervise(commands: dict[str, list[list[str]]], faults: dict[str, list[str | None]], cwd: Path,
               deadline_s: float = 400, kill_when: dict[str, list[tuple[Any, float]]] | None = None
               ) -> dict[str, list[int]]:
    """Run each side's command, restarting it with its next fault (None: none) each time it is killed, until every
    side exits 0; the exit codes of each side's runs. ``kill_when``: a side's k-th run is SIGKILLed ``delay``
    seconds after ``condition()`` first holds (a kill wherever it then is, not at a named point); the runs after
    the list's end go on to the end."""
    kill_when = kill_when or {}
    armed: dict[str, float | None] = {}
    env0 = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    env0.pop("DSPARK_FAULT", None)
    codes: dict[str, list[int]] = {k: [] for k in commands}
    logs = {k: (cwd / f"{k}.log").open("w") for k in commands}

    def start(side: str) -> subprocess.Popen:
        fault = faults[side][len(codes[side])]
        env = {**env0, **({"DSPARK_FAULT": fault} if fault else {})}
        return subprocess.Popen(commands[side][0], cwd=cwd, env=env, stdout=logs[side], stderr=subprocess.STDOUT)

    procs = {side: start(side) for side in commands}
    end = time.time() + deadline_s
    while procs and time.time() < end:
        for side, p in list(procs.items()):
            rc = p.poll()
            plan = kill_when.get(side, [])
            if rc is None and len(codes[side]) < len(plan):
                condition, delay = plan[len(codes[side])]
                if armed.get(side) is None and condition():
                    armed[side] = time.time() + delay
                at = armed.get(side)
                if at is not None and time.time() >= at:
                    p.kill()
                    rc = p.wait()
            if rc is not None:
                armed[side] = None
            if rc is None:
                continue
            codes[side].append(rc)
            if rc == 0 or len(codes[side]) >= len(faults[side]):
                del procs[side]
            else:
                procs[side] = start(side)
        time.sleep(0.05)
    for p in procs.values():
        p.kill()
    for f in logs.values():
        f.close()
    return codes


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("full")
    run(compose(small(tmp, *UNITS, name="full")))
    return str(tmp / "full")


def test_producer_and_trainer_each_killed_and_resumed_deliver_every_sample_the_promised_times(tmp_path, full):
    cache, ckpt = tmp_path / "c", tmp_path / "ckpt.json"
    produce = [sys.executable, "-m", "dspark_precompute", *small(tmp_path, *UNITS, name="c"),
               "storage.window_units=2", "log_level=INFO"]
    train = [sys.executable, "-c", TRAIN, str(cache), str(ckpt), str(PASSES)]
    faults = {"producer": ["unit_submitted=3", None], "trainer": ["stream_batch=5", "window_release=2", None]}
    codes = _supervise({"producer": [produce], "trainer": [train]}, faults, tmp_path)
    logs = {k: (tmp_path / f"{k}.log").read_text() for k in codes}
    assert codes == {"producer": [-9, 0], "trainer": [-9, -9, 0]}, logs
    assert "waits until the trainer releases unit" in logs["producer"]
    seen = json.loads(ckpt.read_text())["seen"]
    got, want = delivered(seen), _expected(full)
    assert len(want) > 0 and got == want, f"{deliveries_differ(got, want, seen, full)}\n{codes}\n{logs}"
    store = CacheStore(str(cache))
    n = json.loads((cache / "manifest.json").read_text())["layout"]["num_units"]
    assert n >= 5 and released_units(store, n) == set(range(n))
    assert not list((cache / "hidden_states").rglob("c.*"))  # every unit's states deleted once consumed
    report = verify_cache(str(cache))
    assert report.ok and any("released by the trainer" in note for note in report.notes), report.format()
    info = subprocess.run([sys.executable, "-m", "dspark_precompute.cli.cache", "info", str(cache)],
                          capture_output=True, text=True, check=True).stdout
    assert f"units captured {n} of {n}, released {n}, resident 0" in info


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_producer_and_trainer_killed_at_random_moments_still_deliver_every_sample_the_promised_times(
        tmp_path, full, seed):
    """SIGKILL at seeded random moments (not at named points): starting up, forwarding, writing, committing,
    releasing, deleting, checkpointing. Whatever the moment, what the trainer's checkpoints say it received equals
    the full cache, every sample ``passes`` times."""
    import random

    rng = random.Random(seed)
    cache, ckpt = tmp_path / "c", tmp_path / "ckpt.json"
    produce = [sys.executable, "-m", "dspark_precompute", *small(tmp_path, *UNITS, name="c"),
               "storage.window_units=2", "log_level=INFO"]
    train = [sys.executable, "-c", TRAIN, str(cache), str(ckpt), str(PASSES)]

    def commits(k: int):  # the producer has committed k units (this run or an earlier one)
        return lambda: len(list((cache / "commits").glob("u*.json"))) >= k

    def received(k: int):  # the trainer's checkpoint holds k samples
        return lambda: ckpt.exists() and len(json.loads(ckpt.read_text() or "{}").get("seen", [])) >= k

    kills = {"producer": [(commits(k), rng.uniform(0.0, 1.0)) for k in (1, 2, 3)],
             "trainer": [(received(k), rng.uniform(0.0, 0.6)) for k in (2, 5, 9, 14)]}
    faults = {side: [None] * (len(k) + 1) for side, k in kills.items()}
    codes = _supervise({"producer": [produce], "trainer": [train]}, faults, tmp_path, deadline_s=600,
                       kill_when=kills)
    logs = {k: (tmp_path / f"{k}.log").read_text()[-3000:] for k in codes}
    assert codes["producer"][-1] == 0 and codes["trainer"][-1] == 0, (codes, logs)
    # every planned kill landed: the trainer waits for the producer, and the window holds the producer back
    assert codes == {"producer": [-9, -9, -9, 0], "trainer": [-9, -9, -9, -9, 0]}, codes
    seen = json.loads(ckpt.read_text())["seen"]
    got, want = delivered(seen), _expected(full)
    assert got == want, f"{deliveries_differ(got, want, seen, full)}\n{codes}\n{logs}"
    n = json.loads((cache / "manifest.json").read_text())["layout"]["num_units"]
    assert released_units(CacheStore(str(cache)), n) == set(range(n))
    assert verify_cache(str(cache)).ok


def test_a_window_on_a_cache_written_in_full_is_refused_saying_so(full):
    with pytest.raises(WindowError, match="already written in full"):
        run(compose([*small(Path(full).parent, *UNITS, name="full"), "storage.window_units=2"]))


def test_a_trainer_that_never_comes_back_stops_the_producer_with_a_resumable_message(tmp_path):
    cfg = compose(small(tmp_path, *UNITS, name="c") + ["storage.window_units=1", "storage.window_timeout_s=1"])
    with pytest.raises(WindowError, match="released no unit for .* re-run the same command"):
        run(cfg)
    assert StreamRecord.read(CacheStore(str(tmp_path / "c"))) == StreamRecord(1, None)
    c = open_cache(str(tmp_path / "c"), allow_incomplete=True)
    assert 0 < c.num_units and len(c) > 0  # the units written so far are committed and readable


def test_a_second_trainer_group_is_refused_and_the_first_one_resumes(tmp_path):
    from dspark_precompute.read.training import build_dataloader

    cfg = compose(small(tmp_path, *UNITS, name="c") + ["storage.window_units=1", "storage.window_timeout_s=1"])
    with pytest.raises(WindowError):
        run(cfg)
    path = str(tmp_path / "c")
    first = build_dataloader(path, stream=True, batch_size=1, group="a")
    with pytest.raises(WindowError, match="streamed to trainer group 'a'"):
        build_dataloader(path, stream=True, batch_size=1, group="b")
    with pytest.raises(WindowError, match="started with 1 rank"):
        build_dataloader(path, stream=True, batch_size=1, group="a", num_replicas=2, rank=0, distributed=True)
    assert first.state_dict()["unit"] == 0


def test_a_stream_on_s3_is_trained_while_written_and_every_unit_is_deleted_once_consumed(
        bucket, local_reference, tmp_path):  # noqa: F811 - test_s3's fixtures
    from dspark_precompute.read.training import build_dataloader

    url = f"s3://{bucket}/w"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    producer = subprocess.Popen([sys.executable, "-m", "dspark_precompute", *tiny_run(url), "storage.window_units=2"],
                                cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        loader = build_dataloader(url, stream=True, batch_size=1, release="delivery", poll_s=0.05,
                                  wait_timeout_s=300)
        got = Counter(tuple(ids[m.bool()].tolist()) for b in loader
                      for ids, m in zip(b["input_ids"], b["attention_mask"], strict=True))
        out, _ = producer.communicate(timeout=300)
    finally:
        producer.kill()
    assert producer.returncode == 0, out
    ref = open_cache(local_reference)
    assert len(ref) > 0 and got == Counter(tuple(ref[i]["input_ids"].tolist()) for i in range(len(ref)))
    store = CacheStore(url)
    n = ref.num_units
    assert n >= 3 and released_units(store, n) == set(range(n))
    assert [k for k in store.file_keys(["hidden_states"]) if "/c." in k] == []
    assert verify_cache(url).ok
