"""The producer's side of a window: which caches a window may apply to, and the wait that keeps units inside it."""

from __future__ import annotations

import numpy as np
import pytest

from dspark_precompute.contract.store import CacheStore
from dspark_precompute.contract.window import StreamRecord, release
from dspark_precompute.errors import WindowError
from dspark_precompute.write.config.schema import StorageConfig
from dspark_precompute.write.store.window import WindowGate, check_window


def test_a_window_is_recorded_for_a_new_cache_and_none_without_one(tmp_path):
    store = CacheStore(tmp_path)
    assert check_window(store, StorageConfig(), False, 0, 4, False) is None
    assert check_window(store, StorageConfig(window_units=2), False, 0, 4, False) == StreamRecord(2, None)
    assert StreamRecord.read(store) == StreamRecord(2, None)


def test_a_windowed_cache_resumed_without_a_window_is_refused_naming_the_override(tmp_path):
    store = CacheStore(tmp_path)
    StreamRecord(3, None).write(store)
    with pytest.raises(WindowError, match="storage.window_units=3"):
        check_window(store, StorageConfig(), False, 1, 4, False)


def test_a_window_on_a_finished_full_cache_or_a_tensor_parallel_target_is_refused(tmp_path):
    store = CacheStore(tmp_path)
    with pytest.raises(WindowError, match="already written in full"):
        check_window(store, StorageConfig(window_units=2), True, 4, 4, False)
    with pytest.raises(WindowError, match=r"tensor parallel \(parallel.tp > 1\)"):
        check_window(store, StorageConfig(window_units=2), False, 0, 4, True)


def test_the_gate_lets_a_unit_in_once_the_trainer_released_enough(tmp_path):
    store = CacheStore(tmp_path)
    gate = WindowGate(store, StreamRecord(2, None), np.full(6, 10), None)
    assert gate.fits(1, 0) and not gate.fits(2, 0)
    release(store, 0, "g", 1, ["hidden_states/layer_0"])
    settled = []
    assert gate.wait(2, lambda: settled.append(1)) and settled == []  # fits at once: nothing drained


def test_a_gate_that_waits_too_long_stops_with_a_resumable_message(tmp_path):
    gate = WindowGate(CacheStore(tmp_path), StreamRecord(1, None), np.full(3, 10), 0.05)
    settled = []
    with pytest.raises(WindowError, match="released no unit for .* unit 0 is the next"):
        gate.wait(1, lambda: settled.append(1))
    assert settled == [1]  # the units in flight were committed before waiting


def test_window_settings_must_be_positive():
    problems = StorageConfig(window_units=0, window_mib=-1, window_timeout_s=0).problems()
    assert len([p for p in problems if "window" in p]) == 3
