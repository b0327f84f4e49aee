"""``model.device_map=auto`` through a whole run: the same cache as the plain path.

The e2e part of tests/write/target/test_device_map.py.
"""

from __future__ import annotations

import accelerate  # noqa: F401 - in the [test] extra: model.device_map=auto needs it, a missing one fails here
import numpy as np
from helpers import compose

from dspark_precompute import open_cache
from dspark_precompute.contract import spec as fmt
from dspark_precompute.write.run import run


def _bf16_bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.int16).astype(np.int32)


def test_a_device_map_auto_run_writes_the_same_cache(saved_target, tmp_path):
    common = [f"model.path={saved_target}", "seq_length=256", "batch.max_tokens=1024", "data.max_samples=8",
              "storage.chunk_tokens=128", "storage.unit_tokens=256", "progress=false", "log_level=WARNING"]
    plain = run(compose([*common, f"storage.path={tmp_path / 'plain'}"]))
    mapped = run(compose([*common, f"storage.path={tmp_path / 'mapped'}", "model.device_map=auto"]))
    a, b = open_cache(plain.path), open_cache(mapped.path)
    # device_map is not part of the identity
    assert a.manifest.to_json()["config_hash"] == b.manifest.to_json()["config_hash"]
    assert b.manifest.to_json()["config"]["model"]["device_map"] == "auto" and len(a) == len(b) > 0
    assert a.manifest.to_json()["layer_ids"] == b.manifest.to_json()["layer_ids"]
    assert plain.units_written == mapped.units_written > 1
    assert a.store.read_bytes(fmt.WEIGHTS) == b.store.read_bytes(fmt.WEIGHTS)
    for i in range(len(a)):
        ra, rb = a.read_raw(i), b.read_raw(i)
        assert np.array_equal(ra["input_ids"], rb["input_ids"]) and np.array_equal(ra["loss_mask"], rb["loss_mask"])
        for k in ("target_hidden_states", "target_last_hidden_states"):
            if a.storage_dtype == "bf16":  # exact, or one bf16 ulp apart at most
                assert np.abs(_bf16_bits(ra[k]) - _bf16_bits(rb[k])).max() <= 1, (i, k)
            else:
                assert np.array_equal(ra[k], rb[k]), (i, k)
