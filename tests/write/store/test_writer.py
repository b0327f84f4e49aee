"""The writer: unit buffers shared with its processes, one shard per array per unit, then the commit record."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dspark_precompute.contract.commits import CommitRecord, committed_units
from dspark_precompute.contract.layout import build_layout
from dspark_precompute.contract.store import CacheStore
from dspark_precompute.errors import StorageWriteError
from dspark_precompute.write.config.schema import StorageConfig
from dspark_precompute.write.parallel import processes
from dspark_precompute.write.plan.array_specs import token_array_specs
from dspark_precompute.write.store.allocate import allocate, shard_key, write_tokens
from dspark_precompute.write.store.buffers import SharedBuffer
from dspark_precompute.write.store.writer import UnitWriter


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


LENGTHS = np.asarray([320, 64, 200, 120, 90, 40], dtype=np.int64)  # unit 0 fills its shard: 320 + 64 = 384


def _write_units(path, writers=1, storage=None):
    """Random units through the writers (and the token pre-pass); the values each array should hold."""
    storage = storage or StorageConfig()
    layout = build_layout(LENGTHS, 64, 384)
    specs = token_array_specs([0, 1], num_layers=2, hidden=8, storage_dtype="bf16")
    store = CacheStore(path)
    tables = {"samples/start": layout.start, "samples/length": layout.length}
    allocate(store, specs, layout, storage, tables, {"format": "test"})
    rng = np.random.default_rng(0)
    expected = {s.name: np.zeros((layout.total_slots, *([s.width] if s.width else [])), dtype=s.dtype) for s in specs}
    samples = {}
    for s in range(len(LENGTHS)):
        ids = rng.integers(1, 1000, size=LENGTHS[s]).astype(np.int32)
        mask = rng.integers(0, 2, size=LENGTHS[s]).astype(np.uint8)
        samples[s] = type("Enc", (), {"input_ids": ids, "loss_mask": mask})
        a = int(layout.start[s])
        expected["input_ids"][a:a + len(ids)], expected["loss_mask"][a:a + len(ids)] = ids, mask
    write_tokens(store, layout, storage, specs, samples, range(layout.num_units))
    with UnitWriter(store, specs, layout, storage, writers=writers) as writer:
        for u in range(layout.num_units):
            slot = writer.acquire()
            bufs = writer.buffers(slot)
            a, b = int(layout.unit_start[u]), int(layout.unit_stop[u])
            for s in specs[2:]:
                data = rng.integers(1, 1000, size=(b - a, s.width)).astype(s.dtype)
                bufs[s.name][: b - a] = data
                expected[s.name][a:b] = data
            writer.submit(u, slot, b - a, CommitRecord(u, a, b, len(layout.unit_order[u])))
        writer.drain()
    return store, layout, expected


def test_writing_units_gives_arrays_plain_zarr_reads_back_equal_and_a_commit_per_unit(tmp_path):
    import zarr

    store, layout, expected = _write_units(tmp_path / "c")
    g = zarr.open_group(str(tmp_path / "c"), mode="r")
    for name, want in expected.items():
        assert np.array_equal(np.asarray(g[name][:]), want), name
    assert committed_units(store) == set(range(layout.num_units))
    rec = json.loads(store.read_bytes("commits/u000000.json"))
    assert (rec["token_start"], rec["token_stop"]) == (int(layout.unit_start[0]), int(layout.unit_stop[0]))
    # one object per unit per array, beside each other: no directory per chunk
    assert sorted(p.name for p in (tmp_path / "c" / "hidden_states" / "layer_1").iterdir()) == \
        ["c.0.0", "c.1.0", "c.2.0", "zarr.json"]


def test_a_shard_the_writers_encode_is_byte_for_byte_the_shard_zarr_writes(tmp_path):
    """Writers build shards without zarr; a full shard is exactly zarr's (a partial one holds only its chunks)."""
    import zarr

    store, layout, expected = _write_units(tmp_path / "ours")
    mine = zarr.open_group(str(tmp_path / "ours"), mode="r")
    oracle = zarr.open_group(str(tmp_path / "zarr"), mode="w")
    for name, want in expected.items():
        a = mine[name]
        z = oracle.create_array(name, shape=a.shape, chunks=a.chunks, shards=a.shards, dtype=a.dtype,
                                fill_value=a.fill_value, compressors=a.compressors, serializer=a.serializer,
                                chunk_key_encoding={"name": "default", "separator": "."})
        z[:384] = want[:384]  # unit 0: its shard is full
        key = shard_key(name, 0, a.ndim == 2)
        assert (tmp_path / "zarr" / key).read_bytes() == (tmp_path / "ours" / key).read_bytes(), name


def test_three_writers_write_the_same_bytes_as_one(tmp_path):
    _write_units(tmp_path / "one", writers=1)
    _write_units(tmp_path / "three", writers=3)
    files = {p.relative_to(tmp_path / "one") for p in (tmp_path / "one").rglob("*") if p.is_file()}
    files -= {p for p in files if p.name == "zarr.json"}  # zarr's own metadata (same content, checked elsewhere)
    assert files == {p.relative_to(tmp_path / "three") for p in (tmp_path / "three").rglob("*")
                     if p.is_file() and p.name != "zarr.json"}
    for f in files:
        assert (tmp_path / "one" / f).read_bytes() == (tmp_path / "three" / f).read_bytes(), f


def test_every_shard_and_record_is_fsynced_with_its_directory_before_it_counts(tmp_path, monkeypatch):
    import os

    synced: list[str] = []
    real = os.fsync

    def spy(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    store = CacheStore(tmp_path / "c")
    store.write_parts("input_ids/c.0", [b"abc", memoryview(b"def")])
    assert (tmp_path / "c" / "input_ids" / "c.0").read_bytes() == b"abcdef"
    assert any(p.endswith(".tmp") for p in synced)  # the data, before the rename
    assert synced[-1] == str(tmp_path / "c" / "input_ids")  # then the directory holding the new name
    synced.clear()
    store.write_parts("input_ids/c.1", [b"x"], fsync=False)
    assert synced == []  # storage.fsync=false: kill-safe (atomic rename), not power-safe


def test_a_writer_that_cannot_write_reports_a_storage_error_and_commits_nothing(tmp_path):
    lengths = np.asarray([50], dtype=np.int64)
    layout = build_layout(lengths, 64, 64)
    specs = token_array_specs([0], num_layers=2, hidden=4, storage_dtype="fp32")
    store = CacheStore(tmp_path / "c")
    allocate(store, specs, layout, StorageConfig(), {}, {"format": "test"})
    import shutil

    shutil.rmtree(tmp_path / "c" / "hidden_states" / "layer_0")
    (tmp_path / "c" / "hidden_states" / "layer_0").write_text("a file where the array's directory was")
    with UnitWriter(store, specs, layout, StorageConfig(writer_slots=1)) as writer:
        slot = writer.acquire()
        writer.submit(0, slot, 50, CommitRecord(0, 0, 50, 1))
        with pytest.raises(StorageWriteError, match=r"writing unit 0 of .* failed: (FileExistsError|NotADirectory)"):
            writer.drain()
    assert committed_units(store) == set()
