"""The window records of a streamed cache: what the producer waits on, who releases, what a release deletes."""

from __future__ import annotations

import numpy as np

from dspark_precompute.contract import spec
from dspark_precompute.contract.store import CacheStore
from dspark_precompute.contract.window import (
    StreamRecord,
    TrainerClaim,
    WindowStatus,
    done_marks,
    finish_releases,
    first_unreleased,
    mark_done,
    release,
    released_key,
    released_units,
    unit_shard_keys,
)

HIDDEN = ["hidden_states/layer_0", "hidden_scales/layer_0"]


def _shards(store: CacheStore, units: range) -> None:
    for u in units:
        for key in [*unit_shard_keys(HIDDEN, u), f"input_ids/c.{u}"]:
            store.write_bytes(key, b"x" * 10)


def test_a_unit_fits_the_window_only_within_n_units_of_the_first_not_released():
    w = StreamRecord(units=2)
    sizes = np.full(10, 100)
    assert [u for u in range(10) if w.admits(u, 3, sizes)] == [0, 1, 2, 3, 4]
    assert w.admits(0, 0, sizes) and w.admits(1, 0, sizes) and not w.admits(2, 0, sizes)


def test_a_byte_cap_admits_units_while_their_states_fit_and_always_the_first():
    w = StreamRecord(mib=1)
    sizes = np.array([600 << 10, 600 << 10, 100, 5 << 20])
    assert w.admits(0, 0, sizes) and not w.admits(1, 0, sizes)  # 1.2 MiB over units 0..1
    assert w.admits(2, 1, sizes) and not w.admits(3, 1, sizes)
    assert w.admits(3, 3, sizes)  # one unit larger than the cap still goes, alone


def test_the_window_starts_at_the_first_unit_without_a_release_record():
    assert first_unreleased({0, 1, 3}, 5) == 2
    assert first_unreleased(set(), 5) == 0
    assert first_unreleased(range(5), 5) == 5


def test_a_release_writes_its_record_first_then_deletes_only_the_hidden_shards(tmp_path):
    store = CacheStore(tmp_path)
    _shards(store, range(2))
    deleted = release(store, 1, "g", 1, HIDDEN)
    assert deleted == ["hidden_states/layer_0/c.1.0", "hidden_scales/layer_0/c.1.0"]
    assert released_units(store) == {1}
    assert not any(store.exists(k) for k in deleted)
    assert store.exists("input_ids/c.1")  # the tokens stay
    assert all(store.exists(k) for k in unit_shard_keys(HIDDEN, 0))


def test_a_kill_between_the_record_and_the_deletes_is_finished_on_the_next_start(tmp_path):
    store = CacheStore(tmp_path)
    _shards(store, range(3))
    store.write_bytes(released_key(0), b'{"unit": 0}')  # the record, then a kill: shards still there
    for r in (0, 1):
        mark_done(store, 1, r, "g")  # both ranks done with unit 1, then a kill before its release
    mark_done(store, 2, 0, "g")  # rank 1 not done with unit 2 yet
    assert finish_releases(store, "g", 2, HIDDEN, 3) == [1]
    assert released_units(store) == {0, 1}
    assert not any(store.exists(k) for u in (0, 1) for k in unit_shard_keys(HIDDEN, u))
    assert all(store.exists(k) for k in unit_shard_keys(HIDDEN, 2))


def test_done_markers_are_counted_per_unit_and_rank_and_foreign_names_are_ignored(tmp_path):
    store = CacheStore(tmp_path)
    mark_done(store, 3, 0, "g")
    mark_done(store, 3, 1, "g")
    mark_done(store, 4, 1, "g")
    store.write_bytes("window/done/notes.txt", b"")
    assert done_marks(store) == {3: {0, 1}, 4: {1}}


def test_the_records_round_trip_and_a_damaged_one_reads_as_absent(tmp_path):
    store = CacheStore(tmp_path)
    StreamRecord(3, None).write(store)
    assert StreamRecord.read(store) == StreamRecord(3, None)
    store.write_bytes("window/stream.json", b'{"format": "dspark-window", "units": -1}')
    assert StreamRecord.read(store) is None
    TrainerClaim("g", 2, {"passes": 2}).write(store)
    assert TrainerClaim.read(store) == TrainerClaim("g", 2, {"passes": 2})


def test_the_window_status_counts_captured_released_resident_and_each_ranks_position(tmp_path):
    store = CacheStore(tmp_path)
    StreamRecord(2, None).write(store)
    TrainerClaim("g", 2).write(store)
    for r in (0, 1):
        mark_done(store, 0, r, "g")
    mark_done(store, 1, 0, "g")
    release(store, 0, "g", 2, HIDDEN)
    status = WindowStatus.read(store, {0, 1, 2}, 6)
    assert status is not None
    assert (status.captured, status.released, status.resident, status.position) == (3, 1, [1, 2], {0: 2, 1: 1})
    lines = status.lines(6)
    assert "captured 3 of 6, released 1, resident 2 (1, 2)" in lines[0] and "group 'g' (2 rank(s))" in lines[1]


def test_window_records_are_the_tools_own_entries_so_overwrite_may_delete_them():
    assert spec.WINDOW in spec.OWN_ENTRIES
    keys = ["window/stream.json", "window/trainer.json", "window/done/u000001.r0002.json",
            "window/released/u000001.json", "window/done/.u000001.r0002.json.abcd1234.tmp"]
    assert spec.foreign_nested(keys) == []
    assert spec.foreign_nested(["window/notes.md"]) == ["window/notes.md"]
