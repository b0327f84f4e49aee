"""The notebook API: samples read back exactly what zarr holds, subsets, slices, summaries, refusals."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from helpers import compose, flip_chunk_byte, small

from dspark_precompute import open_cache
from dspark_precompute.errors import CacheFormatError, ChecksumError, IncompleteCacheError
from dspark_precompute.write.run import run


def zarr_sample(path: str, i: int) -> dict[str, np.ndarray]:
    """Oracle: sample ``i`` straight from the zarr arrays, by the documented names and offsets."""
    g = zarr.open_group(path, mode="r")
    m = json.loads((Path(path) / "manifest.json").read_text())
    a, n = int(g["samples/start"][i]), int(g["samples/length"][i])
    out = {"input_ids": np.asarray(g["input_ids"][a:a + n]), "loss_mask": np.asarray(g["loss_mask"][a:a + n])}
    for lid in m["layer_ids"]:
        out[lid] = np.asarray(g[f"hidden_states/layer_{lid}"][a:a + n])
    last = m["num_hidden_layers"] - 1
    out["last"] = out[last] if last in m["layer_ids"] else np.asarray(g["hidden_states/final_norm"][a:a + n])
    return out


def bf16(bits: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(bits).view(np.int16)).view(torch.bfloat16)


@pytest.fixture(scope="module")
def final_norm_run(tmp_path_factory):
    """Layers [0, 1] of 4 (the post-norm state lives in its own array), untied head.

    Built once per session under the base temp dir; test_export reuses it (a second run
    with the same config finds it complete and returns at once).
    """
    base = tmp_path_factory.getbasetemp()
    return run(compose(small(base, "model.layer_ids=[0,1]", "model.random.tie_word_embeddings=false",
                             "data.max_samples=3", "storage.compressor=zstd", "storage.compression_level=3",
                             name="layers01_untied")))


def test_every_sample_reads_back_exactly_what_zarr_holds_at_its_offsets(default_run):
    _, result = default_run
    c = open_cache(result.path)
    assert len(c) == result.samples > 0
    for i in range(len(c)):
        want, got = zarr_sample(result.path, i), c[i]
        assert sorted(got) == ["input_ids", "loss_mask", "target_hidden_states", "target_last_hidden_states"]
        assert got["input_ids"].dtype == torch.int64 and got["loss_mask"].dtype == torch.int64
        assert torch.equal(got["input_ids"], torch.from_numpy(want["input_ids"].astype(np.int64)))
        assert torch.equal(got["loss_mask"], torch.from_numpy(want["loss_mask"].astype(np.int64)))
        assert got["target_hidden_states"].dtype == torch.bfloat16
        assert torch.equal(got["target_hidden_states"], bf16(np.concatenate([want[lid] for lid in (1, 2, 3)], axis=1)))
        assert torch.equal(got["target_last_hidden_states"], bf16(want["last"]))


def test_a_separately_stored_final_norm_is_the_last_state(final_norm_run):
    c = open_cache(final_norm_run.path)
    assert c.array_names["last"] == "hidden_states/final_norm"
    assert len(c) == final_norm_run.samples > 0
    for i in range(len(c)):
        want, got = zarr_sample(final_norm_run.path, i), c[i]
        assert torch.equal(got["target_hidden_states"], bf16(np.concatenate([want[0], want[1]], axis=1)))
        assert torch.equal(got["target_last_hidden_states"], bf16(want["last"]))
        assert not torch.equal(got["target_last_hidden_states"], got["target_hidden_states"][:, 64:])


def test_a_layer_subset_reads_only_those_layers_chunks_in_the_order_asked(default_run):
    _, result = default_run
    c = open_cache(result.path)
    i = 4
    want = zarr_sample(result.path, i)
    got = c.sample(i, layers=[3, 1], last=False)
    assert "target_last_hidden_states" not in got
    assert torch.equal(got["target_hidden_states"], bf16(np.concatenate([want[3], want[1]], axis=1)))
    c2 = open_cache(result.path)
    c2.sample(i, layers=[2], last=False)
    g = zarr.open_group(result.path, mode="r")
    a, n = int(g["samples/start"][i]), int(g["samples/length"][i])
    chunks = set(range(a // c2.chunk_tokens, (a + n - 1) // c2.chunk_tokens + 1))
    fetched = set(c2.chunks.lru.items)
    assert {name for name, _ in fetched} == {"input_ids", "loss_mask", "hidden_states/layer_2"}
    assert {k for _, k in fetched} == chunks


def test_slices_and_index_lists_give_the_samples_single_indexing_gives(default_run):
    _, result = default_run
    c = open_cache(result.path)
    n = len(c)

    def same(a, b):
        return all(torch.equal(a[k], b[k]) for k in a) and a.keys() == b.keys()

    assert [x["input_ids"].shape[0] for x in c[2:5]] == [c[i]["input_ids"].shape[0] for i in (2, 3, 4)]
    assert all(same(x, c[i]) for x, i in zip(c[2:5], (2, 3, 4), strict=True))
    assert all(same(x, c[i]) for x, i in zip(c[[7, 3]], (7, 3), strict=True))
    assert all(same(x, c[i]) for x, i in zip(c[::5], range(0, n, 5), strict=True))
    assert same(c[-1], c[n - 1]) and same(c[np.int64(2)], c[2]) and same(c[np.array([1])][0], c[1])
    assert len(list(iter(c))) == n
    with pytest.raises(IndexError, match=f"sample {n} is out of range for a cache of {n}"):
        c[n]
    with pytest.raises(ValueError, match=r"\[9\] were not captured; this cache holds layer ids \[1, 2, 3\]"):
        c.sample(0, layers=[1, 9])
    with pytest.raises(TypeError, match="not str"):
        c["0"]


def test_numpy_output_is_float32_holding_the_exact_bf16_values(default_run):
    _, result = default_run
    c = open_cache(result.path)
    t, a = c.sample(1), c.sample(1, as_numpy=True)
    assert a["target_hidden_states"].dtype == np.float32 and a["input_ids"].dtype == np.int64
    assert np.array_equal(a["target_hidden_states"], t["target_hidden_states"].float().numpy())
    assert np.array_equal(a["target_last_hidden_states"], t["target_last_hidden_states"].float().numpy())


def test_the_readers_flags_are_keywords_so_a_bare_true_cannot_mean_another_one(default_run):
    """``sample(i, layers, True)`` once meant as_numpy and ``read_raw(i, layers, False)`` last: now each is named."""
    _, result = default_run
    c = open_cache(result.path)
    calls = (lambda: c.sample(0, None, True), lambda: c.read_raw(0, None, False), lambda: c.read_fp8(0, None, True))
    for call in calls:
        with pytest.raises(TypeError, match="positional argument"):
            call()
    assert "target_last_hidden_states" not in c.read_raw(0, None, last=False)


def test_the_chunk_cache_size_never_changes_what_is_read(default_run):
    _, result = default_run
    ref = open_cache(result.path)
    for size in (0, 1, 40_000):  # off, too small to hold a chunk, a couple of chunks
        c = open_cache(result.path, chunk_cache_bytes=size)
        for i in (5, 0, 5, len(c) - 1, 3):
            assert all(torch.equal(c[i][k], ref[i][k]) for k in ref[i])
        assert c.chunks.lru.nbytes <= max(size, 0)


def test_an_incomplete_cache_is_refused_unless_asked_and_then_reads_committed_units_only(cache_copy):
    m = json.loads((cache_copy / "manifest.json").read_text())
    m["complete"] = False
    (cache_copy / "manifest.json").write_text(json.dumps(m))
    (cache_copy / "commits" / "u000001.json").unlink()
    with pytest.raises(IncompleteCacheError, match=r"incomplete \(3/4 units committed\).*allow_incomplete=True"):
        open_cache(cache_copy)
    c = open_cache(cache_copy, allow_incomplete=True)
    units = np.asarray(zarr.open_group(str(cache_copy), mode="r")["samples/unit"][:])
    expected = np.flatnonzero(units != 1)
    assert len(c) == len(expected) and list(c.indices) == list(expected)
    for j, i in enumerate(expected):
        assert torch.equal(c[j]["input_ids"], torch.from_numpy(zarr_sample(str(cache_copy), i)["input_ids"]).long())
    s = c.summary()
    assert not s["complete"] and s["units_committed"] == 3 and "INCOMPLETE" in repr(c)
    want_sup = sum(int(zarr_sample(str(cache_copy), i)["loss_mask"].sum()) for i in expected)
    assert s["supervised_tokens"] == want_sup


def test_summary_counts_agree_with_an_independent_count_of_the_arrays(default_run):
    _, result = default_run
    c = open_cache(result.path)
    s = c.summary()
    g = zarr.open_group(result.path, mode="r")
    lengths = np.asarray(g["samples/length"][:])
    sup = sum(int(zarr_sample(result.path, i)["loss_mask"].sum()) for i in range(len(lengths)))
    disk = sum(f.stat().st_size for f in Path(result.path).rglob("*") if f.is_file())
    token_disk = sum(f.stat().st_size for d in ("input_ids", "loss_mask", "hidden_states")
                     for f in (Path(result.path) / d).rglob("*") if f.is_file())
    assert (s["samples"], s["tokens"], s["supervised_tokens"]) == (len(lengths), int(lengths.sum()), sup)
    assert s["supervised_fraction"] == pytest.approx(sup / lengths.sum())
    assert s["layer_ids"] == [1, 2, 3] and s["hidden_size"] == 64 and s["target_hidden_dim"] == 192
    assert s["dtype"] == "bf16" and s["complete"] and s["seq_length"] == 256
    assert s["bytes_on_disk"] == disk and s["token_bytes_on_disk"] == token_disk
    # raw payload per token: int32 id + uint8 mask + 3 bf16 layers of 64
    assert s["compression_ratio"] == pytest.approx(lengths.sum() * (4 + 1 + 3 * 64 * 2) / token_disk)
    assert c.supervised_counts().sum() == sup
    text = c.describe()
    assert f"samples     {len(lengths)}" in text and f"{sup:,} tokens" in text and "bf16" in text
    assert f"{len(lengths)} samples" in repr(c) and "complete" in text


def test_a_corrupt_chunk_raises_a_checksum_error_naming_array_and_chunk(cache_copy):
    flip_chunk_byte(cache_copy, "hidden_states/layer_2", 1)
    c = open_cache(cache_copy)
    starts = np.asarray(zarr.open_group(str(cache_copy), mode="r")["samples/start"][:])
    victim = int(np.flatnonzero((starts >= 256) & (starts < 512))[0])
    with pytest.raises(ChecksumError, match=r"'hidden_states/layer_2', chunk \(1, 0\)") as info:
        c[victim]
    assert info.value.array == "hidden_states/layer_2" and info.value.chunk == (1, 0)
    other = int(np.flatnonzero(starts >= 1024)[0])
    c.sample(other)  # other chunks still read
    c.sample(victim, layers=[1, 3])  # and the victim's other layers too


def to_memory_fs(local: str, prefix: str) -> str:
    """Copy a cache into fsspec's in-memory filesystem; returns its URL."""
    import fsspec

    fs = fsspec.filesystem("memory")
    for f in Path(local).rglob("*"):
        if f.is_file():
            fs.pipe_file(f"/{prefix}/{f.relative_to(local).as_posix()}", f.read_bytes())
    return f"memory://{prefix}"


def test_a_cache_behind_an_fsspec_url_reads_the_same_as_on_disk(default_run):
    import fsspec

    _, result = default_run
    url = to_memory_fs(result.path, "reader-url-test")
    try:
        remote, local = open_cache(url), open_cache(result.path)
        assert remote.path == url and remote.store.url  # range requests through fsspec, not local files
        assert len(remote) == len(local) == result.samples > 0
        for i in range(len(local)):
            assert all(torch.equal(remote[i][k], local[i][k]) for k in local[i])
        s_remote, s_local = remote.summary(), local.summary()
        assert all(s_remote[k] == s_local[k] for k in ("tokens", "supervised_tokens", "bytes_on_disk",
                                                        "token_bytes_on_disk", "compression_ratio"))
    finally:
        fsspec.filesystem("memory").rm("/reader-url-test", recursive=True)


def test_a_directory_without_a_manifest_is_not_a_cache(tmp_path):
    with pytest.raises(CacheFormatError, match="no manifest.json; this is not a dspark-precompute cache"):
        open_cache(tmp_path)


def test_describe_summary_and_repr_show_the_rejected_rows_and_their_reasons(default_run):
    from collections import Counter

    _, result = default_run
    c = open_cache(result.path)
    lines = (Path(result.path) / "rejects.jsonl").read_text().splitlines()
    by = Counter(json.loads(line)["reason"] for line in lines if line.strip())
    rejected = sum(by.values())
    rows_in = len(c) + rejected
    assert (rejected, rows_in) == (2, 16)  # the embedded data has two rows with nothing to supervise
    s = c.summary()
    assert (s["rows_in"], s["rejected"], s["rejected_by_reason"]) == (rows_in, rejected, dict(by))
    assert s["rejected_fraction"] == pytest.approx(rejected / rows_in)
    assert "  rejected    2 of 16 rows (12.5%): no_supervised_tokens=2" in c.describe().splitlines()
    assert "2 of 16 rows rejected" in repr(c)


def test_the_rejects_line_lists_reasons_most_frequent_first_with_thousands_separators(cache_copy):
    m = json.loads((cache_copy / "manifest.json").read_text())
    m["counts"].update(rows_in=1400, rejected=1386,
                       rejected_by_reason={"malformed_json": 186, "no_supervised_tokens": 1200})
    (cache_copy / "manifest.json").write_text(json.dumps(m))
    c = open_cache(cache_copy)
    assert ("  rejected    1,386 of 1,400 rows (99.0%): no_supervised_tokens=1,200, malformed_json=186"
            in c.describe().splitlines())
    assert list(c.summary()["rejected_by_reason"]) == ["no_supervised_tokens", "malformed_json"]
