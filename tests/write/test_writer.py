"""The writer: unit buffers shared with its process, whole units written, then committed."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dspark_precompute.contract.commits import CommitRecord, committed_units
from dspark_precompute.contract.layout import build_layout
from dspark_precompute.contract.store import CacheStore
from dspark_precompute.errors import StorageWriteError
from dspark_precompute.write import processes
from dspark_precompute.write.config import StorageConfig
from dspark_precompute.write.writer import SharedBuffer, UnitWriter, allocate, token_array_specs


def _fill(buf_bytes: SharedBuffer, value: int) -> None:
    buf_bytes.array((buf_bytes.nbytes,), np.uint8)[:] = value


def _child_reads_and_writes(buf: SharedBuffer, q) -> None:  # runs in the writer context's process
    arr = buf.array((buf.nbytes,), np.uint8)
    q.put(int(arr.sum()))
    arr[:] = 7


def test_a_unit_buffer_is_the_same_memory_in_the_writer_process():
    ctx = processes.context()
    buf = SharedBuffer(4096)
    _fill(buf, 1)
    q = ctx.SimpleQueue()
    p = ctx.Process(target=_child_reads_and_writes, args=(buf, q))
    p.start()
    assert q.get() == 4096  # the child saw what the parent wrote
    p.join(30)
    assert p.exitcode == 0 and int(buf.array((4096,), np.uint8).sum()) == 7 * 4096  # and the parent sees its writes
    buf.close()


def test_writing_units_gives_arrays_equal_to_the_buffers_and_a_commit_per_unit(tmp_path):
    import zarr

    lengths = np.asarray([300, 200, 120, 90, 40], dtype=np.int64)
    layout = build_layout(lengths, 64, 384)
    specs = token_array_specs([0, 1], num_layers=2, hidden=8, storage_dtype="bf16")
    store = CacheStore(tmp_path / "c")
    tables = {"samples/start": layout.start, "samples/length": layout.length}
    allocate(store, specs, layout, StorageConfig(), tables, {"format": "test"})
    rng = np.random.default_rng(0)
    expected = {s.name: np.zeros((layout.total_slots, *([s.width] if s.width else [])), dtype=s.dtype) for s in specs}
    writer = UnitWriter(store, specs, layout, n_slots=2)
    try:
        for u in range(layout.num_units):
            slot = writer.acquire()
            bufs = writer.buffers(slot)
            a, b = int(layout.unit_start[u]), int(layout.unit_stop[u])
            for s in specs:
                data = rng.integers(1, 1000, size=(b - a, *([s.width] if s.width else []))).astype(s.dtype)
                bufs[s.name][: b - a] = data
                expected[s.name][a:b] = data
            writer.submit(u, slot, b - a, CommitRecord(u, a, b, len(layout.unit_order[u])))
        writer.drain()
    finally:
        writer.close()
    g = zarr.open_group(str(tmp_path / "c"), mode="r")
    for s in specs:
        assert np.array_equal(np.asarray(g[s.name][:]), expected[s.name]), s.name
    assert committed_units(store) == set(range(layout.num_units))
    rec = json.loads(store.read_bytes("commits/u000000.json"))
    assert (rec["token_start"], rec["token_stop"]) == (int(layout.unit_start[0]), int(layout.unit_stop[0]))


def test_a_writer_that_cannot_write_reports_a_storage_error_and_commits_nothing(tmp_path):
    lengths = np.asarray([50], dtype=np.int64)
    layout = build_layout(lengths, 64, 64)
    specs = token_array_specs([0], num_layers=2, hidden=4, storage_dtype="fp32")
    store = CacheStore(tmp_path / "c")
    allocate(store, specs[:1], layout, StorageConfig(), {}, {"format": "test"})  # the hidden arrays are missing
    writer = UnitWriter(store, specs, layout, n_slots=1)
    try:
        slot = writer.acquire()
        writer.submit(0, slot, 50, CommitRecord(0, 0, 50, 1))
        with pytest.raises(StorageWriteError, match=r"opening .* for writing failed"):
            writer.drain()
    finally:
        writer.close()
    assert committed_units(store) == set()
