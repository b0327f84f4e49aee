"""What the tests share besides fixtures: paths, composed configs, cache comparisons."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import numpy as np
import pytest

from dspark_precompute.contract import spec as fmt
from dspark_precompute.contract.manifest import RUN_RECORD_FIELDS

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"
SHARED = REPO.parent / "shared" / "data"
QWEN3_TOKENIZER = SHARED / "tokenizers" / "qwen3"
CHAT = SHARED / "chat"

# weight hashes are remembered per user: keep the suite's out of the real ~/.cache
os.environ.setdefault("DSPARK_CACHE_DIR", tempfile.mkdtemp(prefix="dspark-test-hashes-"))


def compose(overrides: list[str] | None = None):
    """The typed config for ``overrides`` as the CLI would build it (ConfigError listing every problem)."""
    from dspark_precompute.write.config import compose as compose_config

    return compose_config(overrides)


def small(tmp_path: Path, *extra: str, name: str = "cache") -> list[str]:
    """Overrides for a fast run of the tiny target on the embedded data."""
    return [
        f"storage.path={tmp_path / name}",
        "seq_length=256",
        "batch.max_tokens=1024",
        "data.max_samples=16",
        "progress=false",
        "log_level=WARNING",
        *extra,
    ]


def chat_rows(name: str) -> list[dict]:
    path = CHAT / f"{name}.messages.jsonl"
    if not path.exists():
        pytest.skip(f"chat fixture {path} not present")
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def arrays_of(path: str) -> dict[str, np.ndarray]:
    """Every array of a cache, by path inside the group."""
    import zarr

    g = zarr.open_group(path, mode="r")
    out = {}

    def walk(group, prefix=""):
        for name, arr in group.arrays():
            out[prefix + name] = np.asarray(arr[:])
        for name, sub in group.groups():
            walk(sub, f"{prefix}{name}/")
    walk(g)
    return out


def stable_manifest(path: str) -> dict:
    m = json.loads((Path(path) / fmt.MANIFEST).read_text())
    for k in RUN_RECORD_FIELDS:
        m.pop(k, None)
    return m


def assert_same_cache(a: str, b: str, *, process_counts: bool = False) -> None:
    """Bit-identical arrays and weights; the same manifest apart from timing and the path (and, with
    ``process_counts``, the writer and tokenizer process counts, which change how a cache is made, not what)."""
    xa, xb = arrays_of(a), arrays_of(b)
    assert sorted(xa) == sorted(xb)
    for k in xa:
        assert np.array_equal(xa[k], xb[k]), k
    assert (Path(a) / fmt.WEIGHTS).read_bytes() == (Path(b) / fmt.WEIGHTS).read_bytes()
    ma, mb = stable_manifest(a), stable_manifest(b)
    for m in (ma, mb):
        m["config"]["storage"].pop("path")
        if process_counts:
            m["config"]["storage"].pop("writers"), m["config"]["data"].pop("num_workers")
    assert ma == mb


def poison_second_batch(monkeypatch) -> None:
    """The first real token of the second forward batch gets an Inf in its first captured layer."""
    from dspark_precompute.write.capture import HiddenStateCapture

    real = HiddenStateCapture.__call__
    calls = {"n": 0}

    def poisoned(self, input_ids, attention_mask=None):
        states, last = real(self, input_ids, attention_mask)
        calls["n"] += 1
        if calls["n"] == 2:
            k = min(states)
            states[k] = states[k].clone()
            states[k][0, 0, 0] = float("inf")
        return states, last
    monkeypatch.setattr(HiddenStateCapture, "__call__", poisoned)
