"""The training loader: whole batches equal to the per-sample path, block shuffles, resumable epochs, read-ahead.

Also the modules behind it: ``read/arena.py`` (the shared batch buffers), ``read/assemble.py``,
``read/chunks.py``, ``read/prefetch.py`` and ``contract/chunks.py``.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import pytest
import torch
from helpers import compose, drop_chunk, shm_left, shm_names, small
from test_reader import to_memory_fs

import dspark_precompute.read.assemble as assemble
from dspark_precompute import open_cache
from dspark_precompute.contract.chunks import ChunkRef
from dspark_precompute.errors import LoaderStateError
from dspark_precompute.read.assemble import BatchAssembler
from dspark_precompute.read.prefetch import ChunkPrefetcher, to_device
from dspark_precompute.read.training import (
    BATCH_KEYS,
    CacheBatchSampler,
    CacheDataset,
    CacheLoader,
    build_dataloader,
    collate,
)
from dspark_precompute.write.run import run


def per_sample(ds: CacheDataset, idx, pad_to=None, pad_to_multiple_of=None) -> dict[str, torch.Tensor]:
    """The reference: each sample read alone, stacked by NeMo's padding collate."""
    return collate([ds[i] for i in idx], ds.pad_token_id, pad_to, pad_to_multiple_of)


def assert_same_batch(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert tuple(got) == tuple(want) == BATCH_KEYS
    for k in BATCH_KEYS:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        assert torch.equal(got[k], want[k]), k


def rows(batch: dict[str, torch.Tensor]) -> list[tuple[int, ...]]:
    return [tuple(ids[m.bool()].tolist()) for ids, m in zip(batch["input_ids"], batch["attention_mask"], strict=True)]


def dtype_cache(tmp_path_factory, dt):
    """A cache stored as ``dt`` with a separately stored final norm (layers [0, 1] of 4): 3 samples."""
    base = tmp_path_factory.getbasetemp()
    return run(compose(small(base, f"storage.dtype={dt}", "model.layer_ids=[0,1]", "data.max_samples=3",
                             name=f"loader_{dt}"))).path


@pytest.fixture(scope="module", params=["fp16"])
def dtype_run(request, tmp_path_factory):
    """The fp16 cache (its fp32 twin: tests/e2e/test_read_loader.py)."""
    return request.param, dtype_cache(tmp_path_factory, request.param)


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    """32 rows cut to at most 192 tokens in chunks of 1024: several samples share each chunk, as in real caches."""
    base = tmp_path_factory.getbasetemp()
    overrides = [o for o in small(base, name="loader_short") if not o.startswith(("seq_length", "data.max_samples"))]
    return run(compose([*overrides, "seq_length=192", "data.max_samples=32", "storage.chunk_tokens=1024",
                        "storage.unit_tokens=4096"])).path


# -- part 1: whole batches ---------------------------------------------------------------------
@pytest.mark.parametrize("memory", ["plain", "shared"])
def test_an_assembled_batch_equals_what_the_per_sample_path_gives_for_the_same_indices(default_run, memory):
    _, result = default_run
    ds = CacheDataset(result.path)
    asm = BatchAssembler(ds.cache)
    groups = [[0, 7, 13], [5], list(range(len(ds))), [3, 3, 2]]
    for got, idx in zip(asm.build(groups, memory), groups, strict=True):  # one batch per group, none missing
        assert_same_batch(got, per_sample(ds, idx))
    for pad_to, multiple in ((ds.seq_length, None), (None, 64)):
        asm = BatchAssembler(ds.cache, pad_to=pad_to, pad_to_multiple_of=multiple)
        assert_same_batch(asm.build([[1, 4]], memory)[0], per_sample(ds, [1, 4], pad_to, multiple))
    sub = CacheDataset(result.path, layers=[3, 1, 3])
    assert_same_batch(BatchAssembler(sub.cache, layers=[3, 1, 3]).build([[2, 9]], memory)[0], per_sample(sub, [2, 9]))
    with pytest.raises(ValueError, match="a sample has .* tokens but pad_to=8"):
        BatchAssembler(ds.cache, pad_to=8).build([[0]])


def test_fp16_fp32_and_a_separate_final_norm_are_copied_bit_for_bit(dtype_run):
    assert_copied_bit_for_bit(*dtype_run)


def assert_copied_bit_for_bit(dt, path):
    ds = CacheDataset(path)
    assert ds.cache.array_names["last"].endswith("final_norm")
    got = BatchAssembler(ds.cache).build([[0, 1, 2], [2]], "shared")
    for g, idx in zip(got, ([0, 1, 2], [2]), strict=True):
        assert_same_batch(g, per_sample(ds, idx))
    assert got[0]["target_hidden_states"].dtype == {"fp16": torch.float16, "fp32": torch.float32}[dt]


def test_a_recycled_buffer_gets_every_pad_written(default_run, monkeypatch):
    """Pinned buffers come back from torch's host allocator holding old data: pads must be written, not assumed."""
    _, result = default_run
    ds = CacheDataset(result.path)

    def dirty(nbytes, memory):
        return torch.full((nbytes,), 0x5A, dtype=torch.uint8), False

    monkeypatch.setattr(assemble, "_buffer", dirty)
    idx = [0, 13, 6]
    assert_same_batch(BatchAssembler(ds.cache).build([idx])[0], per_sample(ds, idx))


def test_a_worker_batch_arrives_as_one_shared_buffer_without_a_name_in_dev_shm(default_run):
    _, result = default_run
    before = shm_names()
    got = BatchAssembler(CacheDataset(result.path).cache).build([[0, 1]], "shared")[0]
    storages = {t.untyped_storage().data_ptr() for t in got.values()}
    assert len(storages) == 1 and got["input_ids"].untyped_storage().is_shared()
    assert shm_left(before) == set()


@pytest.mark.parametrize("shuffle,workers", [(True, 0), (True, 2), ("block", 0), ("block", 2), (False, 0)])
def test_the_loader_yields_the_planned_batches_equal_to_the_per_sample_path(default_run, workers, shuffle):
    _, result = default_run
    ds = CacheDataset(result.path)
    for kw in ({"batch_size": 3}, {"max_tokens": 600}):
        loader = build_dataloader(ds, shuffle=shuffle, num_workers=workers, seed=5, block_chunks=2, window_blocks=2,
                                  **kw)
        plan = loader.sampler.batches()
        got = list(loader)
        assert len(got) == len(plan) == len(loader)
        for batch, idx in zip(got, plan, strict=True):
            assert_same_batch(batch, per_sample(ds, idx))
        assert sorted(i for b in plan for i in b) == list(range(len(ds)))


def test_the_device_prefetcher_delivers_the_same_batches(default_run):
    _, result = default_run
    loader = build_dataloader(result.path, batch_size=4, shuffle=False)
    ref = list(loader)
    assert len(ref) == len(loader) > 1 and sum(len(x["input_ids"]) for x in ref) == len(CacheDataset(result.path))
    moved = list(to_device(iter(ref), "cpu"))
    on_device = list(build_dataloader(result.path, batch_size=4, shuffle=False, device="cpu"))
    for got in (moved, on_device):
        for a, b in zip(got, ref, strict=True):
            assert_same_batch(a, b)
    assert list(to_device(iter([]), "cpu")) == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_batches_reach_the_gpu_from_pinned_memory_equal_to_the_host_batches(default_run):
    _, result = default_run
    for workers in (0, 2):
        host = list(build_dataloader(result.path, batch_size=4, shuffle=False, num_workers=workers))
        dev = list(build_dataloader(result.path, batch_size=4, shuffle=False, num_workers=workers, device="cuda"))
        assert len(host) > 1
        for a, b in zip(dev, host, strict=True):
            assert tuple(a) == tuple(b) == BATCH_KEYS
            assert all(a[k].is_cuda and torch.equal(a[k].cpu(), b[k]) for k in b)


def test_options_the_loader_cannot_honour_are_refused(default_run):
    _, result = default_run
    with pytest.raises(ValueError, match=r"\['collate_fn'\] cannot be passed to the cache loader"):
        build_dataloader(result.path, batch_size=2, collate_fn=lambda x: x)
    with pytest.raises(ValueError, match="shuffle='sometimes' is not a shuffle"):
        build_dataloader(result.path, batch_size=2, shuffle="sometimes")
    with pytest.raises(ValueError, match="exactly one of batch_size"):
        build_dataloader(result.path)


# -- part 2: block shuffle -----------------------------------------------------------------------
def synthetic(n=500, ct=64, seed=0):
    """Lengths and starts of n samples laid out contiguously (longest first per unit of ~40 samples)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(5, 300, size=n)
    starts = np.zeros(n, dtype=np.int64)
    pos = 0
    for u in range(0, n, 40):
        members = sorted(range(u, min(n, u + 40)), key=lambda i: -lengths[i])
        pos = -(-pos // ct) * ct  # units start on a chunk
        for i in members:
            starts[i] = pos
            pos += lengths[i]
    return lengths, starts, ct


@pytest.mark.parametrize("kw", [{"batch_size": 8}, {"max_tokens": 1024}, {"batch_size": 5, "drop_last": True}])
def test_the_block_shuffle_covers_every_sample_once_per_epoch_and_reorders_each_epoch(kw):
    lengths, starts, ct = synthetic()
    s = CacheBatchSampler(lengths, starts, ct, shuffle="block", seed=3, block_chunks=4, window_blocks=3, **kw)
    epochs = []
    for e in range(3):
        s.set_epoch(e)
        flat = [i for b in s for i in b]
        if kw.get("drop_last"):
            assert len(flat) == len(set(flat)) and len(flat) > len(lengths) - 5
        else:
            assert sorted(flat) == list(range(len(lengths)))
        epochs.append(flat)
        if "max_tokens" in kw:
            assert all(len(b) == 1 or len(b) * lengths[b].max() <= kw["max_tokens"] for b in s)
        elif not kw.get("drop_last"):
            assert all(len(b) == kw["batch_size"] for b in list(s)[:-1])
    assert epochs[0] != epochs[1] != epochs[2]
    again = CacheBatchSampler(lengths, starts, ct, shuffle="block", seed=3, block_chunks=4, window_blocks=3, **kw)
    again.set_epoch(2)
    assert [i for b in again for i in b] == epochs[2]  # same seed and epoch, same order
    other = CacheBatchSampler(lengths, starts, ct, shuffle="block", seed=4, block_chunks=4, window_blocks=3, **kw)
    assert [i for b in other for i in b] != epochs[0]


def test_a_block_window_reads_a_few_chunk_groups_and_its_batches_stay_inside_it():
    lengths, starts, ct = synthetic(ct=128)
    s = CacheBatchSampler(lengths, starts, ct, batch_size=8, shuffle="block", seed=1, block_chunks=8, window_blocks=3)
    span = 8 * ct
    # a window: the rest of a group the previous one cut, its own groups, and a few samples more to fill its last batch
    groups = [len({int(starts[i]) // span for b in task for i in b}) for task in s.tasks()]
    assert np.mean(groups) <= 3 + 1.5 and max(groups) <= 3 + 3
    exact = CacheBatchSampler(lengths, starts, ct, batch_size=8, shuffle=True, seed=1)
    spread = np.mean([len({int(starts[i]) // span for i in b}) for b in exact])
    local = np.mean([len({int(starts[i]) // span for i in b}) for b in s])
    assert local < spread / 2


@pytest.mark.parametrize("kw", [{"batch_size": 4}, {"max_tokens": 900}])
@pytest.mark.parametrize("drop_last", [False, True])
def test_the_block_shuffle_splits_samples_over_ranks_without_overlap_as_distributed_sampler_does(kw, drop_last):
    lengths, starts, ct = synthetic(n=203)
    for world in (2, 3):
        ranks = [CacheBatchSampler(lengths, starts, ct, shuffle="block", seed=9, num_replicas=world, rank=r,
                                   drop_last=drop_last, block_chunks=4, **kw) for r in range(world)]
        assert len({len(s) for s in ranks}) == 1  # every rank runs the same number of steps
        shares = [[i for b in s for i in b] for s in ranks]
        seen = Counter(i for share in shares for i in share)
        if "batch_size" in kw:
            m = 203 // world if drop_last else -(-203 // world)
            assert all(len(x) == m - (m % kw["batch_size"] if drop_last else 0) for x in shares)
        if drop_last:
            assert max(seen.values()) == 1  # disjoint
        else:
            assert set(seen) == set(range(203))  # everything, repeats only to even out the ranks
            if "batch_size" in kw:
                assert sum(seen.values()) - 203 == -(-203 // world) * world - 203
    s = ranks[0]
    assert s.all_batches() == [b for r in ranks for b in r.batches()]


@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")
@pytest.mark.parametrize("kw", [{"batch_size": 3}, {"max_tokens": 700}])
def test_the_block_shuffle_gives_the_same_batches_on_any_number_of_workers(default_run, kw):
    _, result = default_run
    c = open_cache(result.path)
    seqs = []
    for workers in (0, 2, 3):
        loader = build_dataloader(result.path, shuffle="block", seed=11, num_workers=workers, block_chunks=1,
                                  window_blocks=2, **kw)
        loader.set_epoch(1)
        seqs.append([rows(b) for b in loader])
    assert all(s == seqs[0] for s in seqs)
    assert sorted(r for b in seqs[0] for r in b) == sorted(tuple(x.tolist()) for x in
                                                           (c[i]["input_ids"] for i in range(len(c))))


def test_the_block_shuffle_decodes_each_chunk_about_once_per_epoch_the_exact_one_far_more(short_run, monkeypatch):
    from dspark_precompute.read.chunks import CacheChunks

    counts: Counter = Counter()
    real = CacheChunks.decode

    def counting(self, jobs, *a, **k):
        counts.update(j for j in jobs if j[0] == "input_ids")
        return real(self, jobs, *a, **k)

    monkeypatch.setattr(CacheChunks, "decode", counting)
    decodes = {}
    for shuffle in ("block", True):
        counts.clear()
        ds = CacheDataset(short_run, chunk_cache_bytes=0)
        list(build_dataloader(ds, batch_size=4, shuffle=shuffle, seed=2, block_chunks=2, window_blocks=2))
        decodes[shuffle] = sum(counts.values())
    chunks = open_cache(short_run).chunks.metas["input_ids"].num_chunks
    assert decodes["block"] <= chunks * 1.6 and decodes[True] > 2 * decodes["block"], (decodes, chunks)


# -- part 3: resumable epochs --------------------------------------------------------------------
@pytest.mark.parametrize("shuffle,workers", [(True, 0), ("block", 2), (False, 1)])
def test_a_restored_loader_continues_the_epoch_without_repeating_or_skipping(default_run, shuffle, workers):
    _, result = default_run
    make = lambda: build_dataloader(result.path, batch_size=2, shuffle=shuffle, seed=4, num_workers=workers,  # noqa
                                    block_chunks=1)
    full = make()
    full.set_epoch(3)
    whole = [rows(b) for b in full]
    first = make()
    first.set_epoch(3)
    it = iter(first)
    seen = [rows(next(it)) for _ in range(3)]
    state = json.loads(json.dumps(first.state_dict()))  # survives JSON (and torch.save)
    assert state["epoch"] == 3 and state["batches_done"] == 3
    second = make()
    second.load_state_dict(state)
    second.set_epoch(3)  # a training loop's own set_epoch keeps the restored position
    rest = [rows(b) for b in second]
    assert seen + rest == whole
    assert second.state_dict()["epoch"] == 4 and second.state_dict()["batches_done"] == 0
    nxt = [rows(b) for b in second]
    full.set_epoch(4)
    assert nxt == [rows(b) for b in full]


def test_a_state_from_another_plan_or_cache_is_refused(default_run, tmp_path):
    _, result = default_run
    loader = build_dataloader(result.path, batch_size=2, seed=1)
    state = loader.state_dict()
    with pytest.raises(LoaderStateError, match=r"another plan \(seed: saved 1, now 2\)"):
        build_dataloader(result.path, batch_size=2, seed=2).load_state_dict(state)
    with pytest.raises(LoaderStateError, match=r"shuffle: saved 'exact', now 'block'"):
        build_dataloader(result.path, batch_size=2, seed=1, shuffle="block").load_state_dict(state)
    with pytest.raises(LoaderStateError, match=r"num_replicas: saved 1, now 2"):
        build_dataloader(result.path, batch_size=2, seed=1, distributed=True, num_replicas=2,
                         rank=0).load_state_dict(state)
    with pytest.raises(LoaderStateError, match="batches_done=99 is outside"):
        loader.load_state_dict({**state, "batches_done": 99})
    with pytest.raises(LoaderStateError, match="another cache"):
        loader.load_state_dict({**state, "cache": "0" * 64})
    with pytest.raises(LoaderStateError, match="not a state from CacheLoader.state_dict"):
        loader.load_state_dict({"epoch": 0})


def test_a_pass_broken_off_starts_again_from_its_epochs_start_and_a_finished_one_moves_on(default_run):
    _, result = default_run
    loader = build_dataloader(result.path, batch_size=4, seed=0)
    first = [rows(b) for b in loader]
    assert loader.epoch == 1
    loader.set_epoch(0)
    peek = next(iter(loader))
    assert rows(peek) == first[0] and loader.state_dict()["batches_done"] == 1
    assert [rows(b) for b in loader] == first  # a new pass, not the rest of the broken one
    assert isinstance(loader, CacheLoader) and loader.epoch == 1


# -- part 4: read-ahead ---------------------------------------------------------------------------
class FakeStore:
    """Objects with random latency, counting requests in flight; ``wait_idle`` waits for every fetch to land."""

    def __init__(self, objects: dict[str, bytes], seed: int = 0):
        self.objects = objects
        self.pool = ThreadPoolExecutor(8)
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.inflight = self.peak = 0
        self.idle = threading.Condition()
        self.pending = 0  # fetches whose future is not resolved yet, or whose callbacks still run

    def fetch(self, ref: ChunkRef) -> Future:
        delay = self.rng.random() * 0.004
        key = ref.key
        out: Future = Future()
        with self.idle:
            self.pending += 1

        def one():
            with self.lock:
                self.inflight += 1
                self.peak = max(self.peak, self.inflight)
            time.sleep(delay)  # the latency being simulated, not a wait for something
            with self.lock:
                self.inflight -= 1
            data = self.objects.get(key)
            if key == "boom":
                out.set_exception(OSError("connection reset"))
            else:
                out.set_result(None if data is None else data[ref.start:ref.stop])  # runs the prefetcher's callback
            with self.idle:
                self.pending -= 1
                self.idle.notify_all()

        self.pool.submit(one)
        return out

    def wait_idle(self) -> None:
        """Until every fetch has landed and the prefetcher's callback on it has run (its bytes released)."""
        with self.idle:
            assert self.idle.wait_for(lambda: self.pending == 0, timeout=60), f"{self.pending} fetch(es) never landed"


def test_the_prefetcher_returns_every_object_in_plan_order_within_its_byte_and_request_bounds():
    rng = np.random.default_rng(0)
    objects = {f"k{i}": rng.bytes(int(rng.integers(100, 1000))) for i in range(200)}
    store = FakeStore(objects)
    pf = ChunkPrefetcher(store.fetch, max_bytes=4000, max_requests=3)
    order = [f"k{i}" for i in rng.permutation(200)] + ["k5", "k5"]
    pf.plan(ref(k, 1000) for k in order)
    held = []
    for k in order:
        assert pf.take(ref(k, 1000)) == objects[k]
        held.append(pf.held_bytes)
    assert pf.peak_bytes <= 4000 and max(held) <= 4000 and store.peak <= 3 and pf.peak_requests <= 3
    assert pf.requests == len(order) and pf.wasted == 0 and pf.held_bytes == 0


def test_a_wrong_plan_costs_requests_never_a_wrong_object_and_errors_reach_the_taker():
    objects = {f"k{i}": bytes([i]) * 50 for i in range(40)}
    store = FakeStore(objects, seed=1)
    pf = ChunkPrefetcher(store.fetch, max_bytes=300, max_requests=4)
    pf.plan(ref(f"k{i}", 60) for i in range(20))
    assert pf.take(ref("k7", 60)) == objects["k7"]  # k0..k6 dropped
    assert pf.take(ref("k30", 60)) == objects["k30"]  # unplanned: the plan is dropped, fetched now
    assert pf.take(ref("missing", 60)) is None
    assert pf.take(None) is None  # a chunk its shard's index says is absent: never fetched
    with pytest.raises(OSError, match="connection reset"):
        pf.take(ref("boom", 60))
    pf.plan([ref("k1", 60), None, ref("k2", 60)])
    pf.reset()
    store.wait_idle()  # the dropped fetches land and release what they reserved
    assert pf.held_bytes == 0 and pf.peak_bytes <= 300 and store.peak <= 4
    one_big = ChunkPrefetcher(store.fetch, max_bytes=10, max_requests=2)  # a chunk above the bound: alone
    assert one_big.take(ref("k3", 60)) == objects["k3"] and one_big.peak_bytes == 60


def ref(key: str, size: int, start: int = 0) -> ChunkRef:
    """The byte range ``[start, start + size)`` of object ``key``."""
    return ChunkRef(key, start, start + size, exact=False)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("shuffle", [True, "block"])
def test_a_cache_behind_a_url_is_read_ahead_into_the_same_batches_as_on_disk(default_run, workers, shuffle):
    import fsspec

    _, result = default_run
    url = to_memory_fs(result.path, f"loader-url-{workers}-{shuffle}")
    try:
        kw = dict(batch_size=3, shuffle=shuffle, seed=6, block_chunks=1, window_blocks=2)
        local = [b for b in build_dataloader(result.path, **kw)]
        remote = build_dataloader(url, num_workers=workers, prefetch_bytes=200_000, prefetch_requests=3, **kw)
        got = list(remote)
        assert len(got) == len(local)
        for a, b in zip(got, local, strict=True):
            assert_same_batch(a, b)
        if workers == 0:
            pf = remote.runner.prefetcher
            assert pf is not None and pf.requests > 0 and pf.peak_bytes <= 200_000 and pf.peak_requests <= 3
            assert pf.wasted == 0  # the plan was right: nothing fetched twice or thrown away
    finally:
        fsspec.filesystem("memory").rm(f"/loader-url-{workers}-{shuffle}", recursive=True)


# -- what a reader must never do ----------------------------------------------------------------
def drop_sample(path, victim: int) -> None:
    """Mark stored sample ``victim`` dropped (non-finite states), with counts that stay consistent."""
    import zarr

    m = json.loads((path / "manifest.json").read_text())
    g = zarr.open_group(str(path), mode="r")
    start, n = int(g["samples/start"][victim]), int(g["samples/length"][victim])
    c = m["counts"]
    c["samples"] -= 1
    c["tokens"] -= n
    c["supervised_tokens"] -= int(g["loss_mask"][start:start + n].sum())
    c["truncated_samples"] -= int(g["samples/untruncated_length"][victim] > n)
    c["rejected"] += 1
    c["rejected_by_reason"]["nonfinite_hidden_states"] = 1
    m["dropped_samples"] = [victim]
    (path / "manifest.json").write_text(json.dumps(m))


@pytest.mark.parametrize("shuffle,workers", [(True, 0), ("block", 2), (False, 0)])
def test_a_dropped_sample_never_comes_out_of_the_loader(cache_copy, shuffle, workers):
    drop_sample(cache_copy, 5)
    c = open_cache(cache_copy)
    assert 5 not in c.indices.tolist()
    want = Counter(tuple(c[i]["input_ids"].tolist()) for i in range(len(c)))
    for kw in ({"batch_size": 3}, {"max_tokens": 600}):
        loader = build_dataloader(cache_copy, shuffle=shuffle, num_workers=workers, block_chunks=1, **kw)
        assert Counter(r for b in loader for r in rows(b)) == want


# with workers: tests/e2e/test_read_loader.py (a DataLoader whose worker raised takes 2 x 5 s to shut them down)
@pytest.mark.parametrize("shuffle,workers", [(True, 0), ("block", 0)])
def test_a_missing_chunk_stops_the_loader_with_a_missing_chunk_error_never_zeros(cache_copy, shuffle, workers):
    assert_a_missing_chunk_stops_the_loader(cache_copy, shuffle, workers)


def assert_a_missing_chunk_stops_the_loader(cache_copy, shuffle, workers):
    from dspark_precompute.errors import MissingChunkError

    c = open_cache(cache_copy)
    layer = c.array_names[str(c.layer_ids[0])]
    drop_chunk(cache_copy, layer, 1)
    loader = build_dataloader(cache_copy, batch_size=4, shuffle=shuffle, num_workers=workers, block_chunks=1)
    with pytest.raises(MissingChunkError, match=rf"array '{layer}' chunk \(1, 0\) \(in shard {layer}/c.0.0\) is "
                                                r"missing"):
        list(loader)


def test_a_held_batch_is_never_overwritten_while_the_shared_region_recycles_and_overflows(default_run):
    _, result = default_run
    ds = CacheDataset(result.path)
    plan = build_dataloader(ds, batch_size=2, seed=1)
    biggest = max(BatchAssembler(ds.cache).nbytes(b) for b in plan.sampler.batches())
    loader = build_dataloader(ds, batch_size=2, seed=1, num_workers=2, shared_memory_bytes=4 * biggest)
    arena = loader.arena
    assert arena is not None
    kept = []
    for epoch in range(2):
        loader.set_epoch(epoch)
        for k, (batch, idx) in enumerate(zip(loader, loader.sampler.batches(epoch), strict=True)):
            assert_same_batch(batch, per_sample(ds, idx))
            if k % 3 == 0:
                kept.append((batch, idx))  # held, as a step (or a pending device copy) holds it
    for batch, idx in kept:  # still intact after every later batch was built
        assert_same_batch(batch, per_sample(ds, idx))
    assert arena.fallbacks > 0 and arena.peak <= arena.nbytes
    del kept, batch
    assert arena.in_use == 0  # every extent came back once its tensors were freed
