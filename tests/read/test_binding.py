"""Format 3 binds every shard to its place: a shard moved to another unit, copied from another cache, or given
its chunks in another order (each crc32c still valid) is a DamagedShardError naming array, shard and samples,
from the reader, the DataLoader (local and behind a URL) and ``verify``; and ``verify`` names entries a finished
cache must not hold. Each damage below read back as plausible numbers, with ``verify`` passing, in format 2.

Two caches are made with the same settings from different rows, each also without compression (equal-sized
chunks: shards of two full units, and their indexes, are then byte-for-byte the same length).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import google_crc32c
import numpy as np
import pytest
from helpers import ABSENT, compose, shard_digest, shard_geometry, shard_index, small, write_shard_index
from test_damage import holders, tables
from test_reader import to_memory_fs, zarr_sample

from dspark_precompute import open_cache
from dspark_precompute.cli.cache import main
from dspark_precompute.errors import DamagedShardError
from dspark_precompute.read.training import build_dataloader
from dspark_precompute.write.run import run

UNIT = 1024  # token slots per unit (and per shard), in 4 chunks of 256
SETTINGS = ("storage.chunk_tokens=256", f"storage.unit_tokens={UNIT}")


@pytest.fixture(scope="module")
def caches(tmp_path_factory) -> dict[str, Path]:
    """``a`` and ``b``: the same settings, rows [0, 16) and [16, 32); ``raw_a``/``raw_b`` the same uncompressed."""
    tmp = tmp_path_factory.mktemp("binding")
    out = {}
    raw = ("storage.compressor=none",)
    for name, rows, extra in [("a", "[:16]", ()), ("b", "[16:32]", ()), ("raw_a", "[:16]", raw),
                              ("raw_b", "[16:32]", raw)]:
        out[name] = Path(run(compose(small(tmp, *SETTINGS, f"data.split='train{rows}'", "data.max_samples=null",
                                           *extra, name=name))).path)
    return out


@pytest.fixture
def copy(caches, tmp_path):
    def make(name: str) -> Path:
        dst = tmp_path / name
        shutil.copytree(caches[name], dst)
        return dst
    return make


def shard(path: Path, array: str, unit: int) -> Path:
    two_d = len(json.loads((path / array / "zarr.json").read_text())["shape"]) == 2
    return path / array / (f"c.{unit}" + (".0" if two_d else ""))


def unit_samples(path: Path, unit: int) -> list[int]:
    t = tables(path)
    return holders(path, int(t["units/token_start"][unit]), int(t["units/token_stop"][unit]))


def swap(a: Path, b: Path) -> None:
    blob = a.read_bytes()
    a.write_bytes(b.read_bytes())
    b.write_bytes(blob)


def swap_chunks(f: Path, j: int = 0, k: int = 1) -> None:
    """Inner chunks j < k of a shard trade places, its index rewritten in token order with a valid crc32c."""
    n = 4
    index = shard_index(f, n)
    blob = f.read_bytes()
    parts = [blob[int(o):int(o) + int(s)] for o, s in index if o != ABSENT]
    parts[j], parts[k] = parts[k], parts[j]
    body = b"".join(parts)
    offsets = np.cumsum([0] + [len(p) for p in parts[:-1]])
    table = np.full((n, 2), ABSENT, dtype="<u8")
    table[:len(parts), 0], table[:len(parts), 1] = offsets, [len(p) for p in parts]
    raw = table.tobytes()
    f.write_bytes(body + raw + int(google_crc32c.value(raw)).to_bytes(4, "little"))
    assert shard_index(f, n)[:len(parts), 0].tolist() == sorted(shard_index(f, n)[:len(parts), 0].tolist())


def equal_length_units(path: Path, array: str) -> tuple[int, int]:
    """Two units whose shards of ``array`` are the same number of bytes (uncompressed: the same chunk count)."""
    sizes = {}
    for f in sorted((path / array).glob("c.*")):
        sizes.setdefault(f.stat().st_size, []).append(int(f.name.split(".")[1]))
    pairs = [u for u in sizes.values() if len(u) >= 2]
    assert pairs, sizes
    return pairs[0][0], pairs[0][1]


def _swap_units(array: str):
    def go(caches, path: Path) -> int:
        swap(shard(path, array, 0), shard(path, array, 1))
        return 0
    return go


def _from_other_cache(other: str):
    def go(caches, path: Path) -> int:
        src = shard(caches[other], "hidden_states/layer_1", 0)
        assert src.read_bytes() != shard(path, "hidden_states/layer_1", 0).read_bytes()
        shutil.copyfile(src, shard(path, "hidden_states/layer_1", 0))
        return 0
    return go


def _chunks_swapped(caches, path: Path) -> int:
    swap_chunks(shard(path, "hidden_states/layer_2", 1))
    return 1


def _same_length_shard(caches, path: Path) -> int:
    u, v = equal_length_units(path, "hidden_states/layer_1")
    before = shard_index(shard(path, "hidden_states/layer_1", u), 4)
    shutil.copyfile(shard(path, "hidden_states/layer_1", v), shard(path, "hidden_states/layer_1", u))
    assert np.array_equal(shard_index(shard(path, "hidden_states/layer_1", u), 4), before)  # the very same index
    return u


# (cache, damage, array, where it is caught: its index when loaded, or a chunk when decoded)
DAMAGES = {
    "hidden shards of units 0 and 1 swapped": ("a", _swap_units("hidden_states/layer_1"), "hidden_states/layer_1",
                                               "index"),
    "input_ids shards of units 0 and 1 swapped": ("a", _swap_units("input_ids"), "input_ids", "index"),
    "a shard from the other cache": ("a", _from_other_cache("b"), "hidden_states/layer_1", "index"),
    "two chunks swapped, index rewritten": ("a", _chunks_swapped, "hidden_states/layer_2", "index"),
    "uncompressed: a shard from the other cache": ("raw_a", _from_other_cache("raw_b"), "hidden_states/layer_1",
                                                   "chunk"),
    "uncompressed: two chunks swapped, index rewritten": ("raw_a", _chunks_swapped, "hidden_states/layer_2", "chunk"),
    "uncompressed: a same-length shard of another unit": ("raw_a", _same_length_shard, "hidden_states/layer_1",
                                                          "chunk"),
}
WORDS = {"index": r"is not the shard that was written there: its index has crc32c [0-9a-f]{8}, the commit record of "
                  r"unit \d+ binds [0-9a-f]{8}",
         "chunk": r"holds at its inner chunk \d a chunk with crc32c [0-9a-f]{8}, the commit record of unit \d+ binds "
                  r"[0-9a-f]{8} there"}


@pytest.mark.parametrize("case", list(DAMAGES))
def test_a_shard_in_the_wrong_place_is_a_damaged_shard_error_naming_array_shard_and_samples(caches, copy, capsys,
                                                                                           case):
    name, damage, array, stage = DAMAGES[case]
    path = copy(name)
    unit = damage(caches, path)
    victims = unit_samples(path, unit)
    key = shard(path, array, unit).relative_to(path).as_posix()
    c = open_cache(path)
    with pytest.raises(DamagedShardError, match=rf"array '{array}' shard \({unit},(?: 0)?\) \(object {key}\) "
                                                + WORDS[stage]) as info:
        c[victims[0]]
    err = info.value
    assert (err.array, err.shard[0], err.misplaced, list(err.samples)) == (array, unit, True, victims)
    assert "dspark-cache verify --repair" in str(err)
    damaged = {unit, 1 - unit} if "swapped" in case and "units" in case else {unit}
    sound = [s for s in range(len(c)) if int(tables(path)["samples/unit"][s]) not in damaged]
    for s in sound[:3]:  # the other units' samples still read exactly what zarr holds
        assert np.array_equal(c.sample(s, as_numpy=True)["input_ids"], zarr_sample(str(path), s)["input_ids"])
    with pytest.raises(DamagedShardError):
        for _ in build_dataloader(path, batch_size=4, shuffle=False):
            pass
    assert main(["verify", str(path), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    hits = [p for p in report["problems"] if p["check"] == "binding"]
    assert hits and {p["unit"] for p in hits} == damaged and {p["array"] for p in hits} == {array}, report
    assert all(p["sample"] in victims for p in hits if p["unit"] == unit)


def test_a_moved_shard_is_refused_behind_a_url_too_by_the_reader_and_the_read_ahead_loader(caches, copy):
    import fsspec

    path = copy("a")
    swap(shard(path, "hidden_states/layer_3", 0), shard(path, "hidden_states/layer_3", 1))
    url = to_memory_fs(str(path), "binding-url-test")
    try:
        c = open_cache(url)
        with pytest.raises(DamagedShardError, match=r"array 'hidden_states/layer_3' shard \(0, 0\) .*is not the shard "
                                                    r"that was written there") as info:
            c[unit_samples(path, 0)[0]]
        assert list(info.value.samples) == unit_samples(path, 0)
        with pytest.raises(DamagedShardError, match="is not the shard that was written there"):
            for _ in build_dataloader(url, batch_size=4, shuffle=False):
                pass
    finally:
        fsspec.filesystem("memory").rm("/binding-url-test", recursive=True)


def test_every_record_binds_the_bytes_on_disk_and_the_token_record_the_token_shards(caches):
    """Oracle: each shard's digest read from its own bytes (index crc32c, each present chunk's last 4 bytes)."""
    for name in ("a", "raw_a"):
        path = caches[name]
        m = json.loads((path / "manifest.json").read_text())
        arrays = ["input_ids", "loss_mask", *dict.fromkeys(m["arrays"].values())]
        tokens = json.loads((path / "commits" / "tokens.json").read_text())["arrays"]
        assert sorted(tokens) == ["input_ids", "loss_mask"]
        for u in range(m["layout"]["num_units"]):
            rec = json.loads((path / "commits" / f"u{u:06d}.json").read_text())
            assert sorted(rec["shards"]) == sorted(arrays)
            for array in arrays:
                _, per = shard_geometry(path, array)
                want = shard_digest(shard(path, array, u), per)
                assert rec["shards"][array] == want and (array not in tokens or tokens[array][u] == want)
            assert len(rec["shards"]["input_ids"]) == 8 * (1 + int((shard_index(shard(path, "input_ids", u), 4)[:, 0]
                                                                    != ABSENT).sum()))


def test_a_shard_whose_record_lost_its_digest_is_not_read(caches, copy):
    path = copy("a")
    f = path / "commits" / "u000001.json"
    rec = json.loads(f.read_text())
    del rec["shards"]["hidden_states/layer_2"]
    f.write_text(json.dumps(rec))
    with pytest.raises(DamagedShardError, match=r"shard \(1, 0\) .*is not bound to its place: the commit record of "
                                                r"unit 1 \(commits/u000001.json\) holds no valid digest of it"):
        open_cache(path)[unit_samples(path, 1)[0]]


@pytest.mark.parametrize("stray", ["hidden_states/layer_1/c.10.0", "input_ids/c.10", "input_ids/c.0.0",
                                   "hidden_states/layer_1/notes.txt", "commits/u000001.json.bak"])
def test_verify_names_an_entry_a_finished_cache_must_not_hold(caches, copy, capsys, stray):
    path = copy("a")
    src = shard(path, "hidden_states/layer_1" if stray.startswith("hidden") else "input_ids", 3)
    shutil.copyfile(src if "commits" not in stray else path / "commits" / "u000001.json", path / stray)
    assert main(["verify", str(path), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert [p["check"] for p in report["problems"]] == ["structure"], report
    assert report["problems"][0]["message"].startswith(f"{stray} is not an entry of this cache"), report
    assert len(open_cache(path)[:]) == len(tables(path)["samples/start"])  # readers never look at it


def test_a_cut_index_keeps_its_own_error_before_the_binding(caches, copy):
    """Damage the index's own checks catch (a cut object) is still named as such: the binding comes after."""
    path = copy("a")
    f = shard(path, "loss_mask", 2)
    index = shard_index(f, 4)
    index[0] = (len(f.read_bytes()), index[0][1])
    write_shard_index(f, index)
    with pytest.raises(DamagedShardError, match=r"has an index entry for inner chunk 0 .* points outside") as info:
        open_cache(path)[unit_samples(path, 2)[0]]
    assert not info.value.misplaced
