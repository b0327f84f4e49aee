"""What the tests share besides fixtures: paths, composed configs, cache comparisons."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest

from dspark_precompute.contract import spec as fmt
from dspark_precompute.contract.manifest import RUN_RECORD_FIELDS, Counts, Manifest, ManifestLayout

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"
SHARED = REPO.parent / "shared" / "data"
QWEN3_TOKENIZER = SHARED / "tokenizers" / "qwen3"
CHAT = SHARED / "chat"

# weight hashes are remembered per user: keep the suite's out of the real ~/.cache, and remove them when it ends
if "DSPARK_CACHE_DIR" not in os.environ:
    os.environ["DSPARK_CACHE_DIR"] = tempfile.mkdtemp(prefix="dspark-test-hashes-")
    atexit.register(shutil.rmtree, os.environ["DSPARK_CACHE_DIR"], ignore_errors=True)


SHM = Path("/dev/shm")


def shm_names() -> set[str]:
    """The names in /dev/shm now (what :func:`shm_left` compares against)."""
    return set(os.listdir(SHM))


def shm_left(before: set[str]) -> set[str]:
    """Names in /dev/shm made since ``before`` that no other live process maps: what this process or the dead
    processes under test left there. The machine is shared: another run's loader workers, semaphores and servers
    make (and map) their own names meanwhile, and counting those failed the "nothing left" checks under load."""
    new = shm_names() - before
    if not new:
        return new
    mapped: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        if maps.parent.name == str(os.getpid()):
            continue
        try:
            text = maps.read_text()
        except OSError:  # ended meanwhile, or not ours to read
            continue
        for line in text.splitlines():
            at = line.find(f"{SHM}/")
            if at >= 0:
                mapped.add(line[at + len(str(SHM)) + 1:].split(" ")[0])
    return new - mapped


def tiny_manifest(**fields) -> Manifest:
    """A typed manifest a tiny run could write (4 layers of 64, layers [1, 2, 3], bf16, one unit), ``fields``
    replacing its defaults: the one manifest factory of the contract tests."""
    base = dict(
        config_hash="cd" * 32, identity={"target": {"path": "tiny"}, "data": {
            "path": "embedded", "split": "train", "shuffle_seed": None, "mask_reasoning_content": False}},
        target_model="tiny", target_model_type="qwen3", target_vocab_size=263, num_hidden_layers=4,
        hidden_size=64, layer_ids=[1, 2, 3], seq_length=256, storage_dtype="bf16", chat_template="{{ x }}",
        arrays=fmt.hidden_arrays([1, 2, 3], 4), layout=ManifestLayout(256, 1024, 1, 1024),
        counts=Counts(rows_in=3, samples=2, rejected=1, tokens=300, supervised_tokens=100, truncated_samples=1,
                      rejected_by_reason={"no_supervised_tokens": 1}),
        complete=True)
    return Manifest(**{**base, **fields})


def compose(overrides: list[str] | None = None):
    """The typed config for ``overrides`` as the CLI would build it (ConfigError listing every problem)."""
    from dspark_precompute.write.config.compose import compose as compose_config

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


def data_files(path: str) -> dict[str, bytes]:
    """Every file of a cache but the run record (manifest, .hydra/), by relative path, with its bytes."""
    root = Path(path)
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != fmt.MANIFEST and fmt.HYDRA_RECORD not in p.relative_to(root).parts}


def assert_same_cache(a: str, b: str, *, process_counts: bool = False, layout: bool = False) -> None:
    """Byte-identical files (every shard, table, commit record, zarr.json, the weights and rejects) and the
    same arrays as zarr reads them; the same manifest apart from timing and the path (and, with
    ``process_counts``, the writer and tokenizer process counts, which change how a cache is made, not what;
    with ``layout``, the recorded ``parallel`` layout of the target's weights)."""
    fa, fb = data_files(a), data_files(b)
    assert fa and sorted(fa) == sorted(fb)
    for k in fa:
        assert fa[k] == fb[k], k
    xa, xb = arrays_of(a), arrays_of(b)
    assert xa and sorted(xa) == sorted(xb)
    for k in xa:
        assert np.array_equal(xa[k], xb[k]), k
    assert (Path(a) / fmt.WEIGHTS).read_bytes() == (Path(b) / fmt.WEIGHTS).read_bytes()
    ma, mb = stable_manifest(a), stable_manifest(b)
    for m in (ma, mb):
        m["config"]["storage"].pop("path")
        if process_counts:
            m["config"]["storage"].pop("writers"), m["config"]["data"].pop("num_workers")
        if layout:
            m["config"].pop("parallel")
    assert ma == mb


def poison_second_batch(monkeypatch) -> None:
    """The first real token of the second forward batch gets an Inf in its first captured layer."""
    from dspark_precompute.write.target.capture import HiddenStateCapture

    real = HiddenStateCapture.__call__
    calls = {"n": 0}

    def poisoned(self, input_ids, attention_mask=None, media=None):
        states, last = real(self, input_ids, attention_mask, media)
        calls["n"] += 1
        if calls["n"] == 2:
            k = min(states)
            states[k] = states[k].clone()
            states[k][0, 0, 0] = float("inf")
        return states, last
    monkeypatch.setattr(HiddenStateCapture, "__call__", poisoned)


def refuse_building_weights(monkeypatch) -> None:
    """Fail the test if any target model gets real weights: loaded (``from_pretrained``) or built (the tiny target).

    Guarded at transformers itself, not at a name of ours, so it holds wherever the loading code lives; a
    build on the meta device (counting parameters, no weights) is allowed.
    """
    import torch
    from transformers import AutoModelForCausalLM, PreTrainedModel

    init = PreTrainedModel.__init__

    def guarded_init(self, *args, **kwargs):
        if torch.get_default_device().type != "meta":
            pytest.fail(f"{type(self).__name__} was built with real weights")
        init(self, *args, **kwargs)

    def guarded_load(cls, *args, **kwargs):
        pytest.fail(f"{cls.__name__}.from_pretrained loaded weights")

    monkeypatch.setattr(PreTrainedModel, "__init__", guarded_init)
    for cls in (PreTrainedModel, AutoModelForCausalLM):
        monkeypatch.setattr(cls, "from_pretrained", classmethod(guarded_load))


# -- shards, read and damaged without our code (the zarr v3 sharding layout: chunks, then the index) -----------
ABSENT = 2**64 - 1


def shard_geometry(cache, array: str) -> tuple[int, int]:
    """(rows per inner chunk, inner chunks per shard) of a format 2 token array, from its zarr.json."""
    meta = json.loads((Path(cache) / array / "zarr.json").read_text())
    outer = meta["chunk_grid"]["configuration"]["chunk_shape"][0]
    inner = meta["codecs"][0]["configuration"]["chunk_shape"][0]
    return inner, outer // inner


def shard_file(cache, array: str, c: int) -> Path:
    """The shard file holding inner chunk ``c`` of ``array``."""
    _, per = shard_geometry(cache, array)
    two_d = len(json.loads((Path(cache) / array / "zarr.json").read_text())["shape"]) == 2
    return Path(cache) / array / (f"c.{c // per}" + (".0" if two_d else ""))


def shard_index(path: Path, n: int) -> np.ndarray:
    """A shard's index: uint64 [n, 2] (offset, nbytes), read from its last 16 n + 4 bytes."""
    return np.frombuffer(path.read_bytes()[-(16 * n + 4):-4], dtype="<u8").reshape(n, 2).copy()


def write_shard_index(path: Path, index: np.ndarray) -> None:
    """Replace a shard's index (with a valid crc32c: the damage a careless rewrite does, not a torn write)."""
    import google_crc32c

    blob = path.read_bytes()
    body = np.ascontiguousarray(index, dtype="<u8").tobytes()
    path.write_bytes(blob[:-(len(body) + 4)] + body + int(google_crc32c.value(body)).to_bytes(4, "little"))


def chunk_span(cache, array: str, c: int) -> tuple[Path, int, int]:
    """(shard file, offset, nbytes) of inner chunk ``c`` of ``array``."""
    _, per = shard_geometry(cache, array)
    f = shard_file(cache, array, c)
    off, n = shard_index(f, per)[c % per]
    assert off != ABSENT, f"chunk {c} of {array} is not in {f}"
    return f, int(off), int(n)


def shard_digest(path: Path, n: int) -> str:
    """Oracle of a shard's digest, from its bytes alone: its last 4 bytes (the index's crc32c), then the last 4
    bytes of each present inner chunk in index order, as hex."""
    blob = path.read_bytes()
    crcs = [blob[int(o) + int(k) - 4:int(o) + int(k)] for o, k in shard_index(path, n) if o != ABSENT]
    return (blob[-4:] + b"".join(crcs)).hex()


def rebind(cache, array: str, unit: int) -> None:
    """Record unit ``unit``'s shard of ``array`` as its bytes now are, in the unit's commit record (and, for ids and
    masks, the token record): the cache a writer that wrote those bytes would have left (format 3; older formats
    bind nothing). What is left to catch is the damage itself, not a shard that moved since its unit committed."""
    root = Path(cache)
    if json.loads((root / fmt.MANIFEST).read_text())["format_version"] < 3:
        return
    _, per = shard_geometry(cache, array)
    digest = shard_digest(shard_file(cache, array, unit * per), per)
    record = root / "commits" / f"u{unit:06d}.json"
    if record.exists():
        rec = json.loads(record.read_text())
        rec["shards"][array] = digest
        record.write_text(json.dumps(rec, sort_keys=True))
    tokens = root / "commits" / "tokens.json"
    if array in fmt.TOKENS_FIRST and tokens.exists():
        rec = json.loads(tokens.read_text())
        rec["arrays"][array][unit] = digest
        tokens.write_text(json.dumps(rec, sort_keys=True))


def drop_chunk(cache, array: str, c: int) -> None:
    """Mark inner chunk ``c`` absent in its shard's index (re-checksummed, and rebound: a writer that skipped the
    chunk), so plain zarr would read the fill value."""
    _, per = shard_geometry(cache, array)
    f = shard_file(cache, array, c)
    index = shard_index(f, per)
    index[c % per] = ABSENT
    write_shard_index(f, index)
    rebind(cache, array, c // per)


def flip_chunk_byte(cache, array: str, c: int, at: int = 40) -> None:
    """Flip one bit inside inner chunk ``c``'s stored bytes (its crc32c then fails)."""
    f, off, n = chunk_span(cache, array, c)
    blob = bytearray(f.read_bytes())
    blob[off + min(at, n - 5)] ^= 0x10
    f.write_bytes(bytes(blob))


def stopped_after_units(overrides: list[str], monkeypatch, units: int) -> None:
    """Run ``overrides`` until ``units`` units were handed to the writers, then stop it with an error (a fault
    point), and leave the environment as it was: the cache is then a resumable, unfinished one."""
    import pytest

    from dspark_precompute import faults
    from dspark_precompute.write.run import run

    monkeypatch.setenv("DSPARK_FAULT", f"unit_submitted={units}:raise")
    faults.reload()
    with pytest.raises(Exception, match="fault"):
        run(compose(overrides))
    monkeypatch.delenv("DSPARK_FAULT")
    faults.reload()
