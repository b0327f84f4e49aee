"""The stream loader over a windowed cache (here: a finished cache given a window record, so no producer runs):
ranks split units without overlap, a unit is released once every rank is done, a saved state resumes exactly,
a reader that opened a unit before its release never reads garbage, a wait that can never end is refused."""

from __future__ import annotations

import shutil
from collections import Counter

import pytest
import torch
from helpers import compose, small

from dspark_precompute.contract.commits import commit_key
from dspark_precompute.contract.store import CacheStore
from dspark_precompute.contract.window import StreamRecord, done_marks, released_units
from dspark_precompute.errors import LoaderStateError, ReleasedUnitError, WindowError
from dspark_precompute.read.reader import open_cache
from dspark_precompute.read.stream import StreamLoader
from dspark_precompute.read.training import build_dataloader


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    from dspark_precompute.write.run import run

    tmp = tmp_path_factory.mktemp("stream")
    run(compose(small(tmp, "storage.chunk_tokens=256", "storage.unit_tokens=512", name="full")))
    return tmp / "full"


@pytest.fixture
def stream(finished, tmp_path):
    path = tmp_path / "s"
    shutil.copytree(finished, path)
    StreamRecord(units=2).write(CacheStore(str(path)))
    return str(path)


def rows(batch: dict[str, torch.Tensor]) -> list[tuple[int, ...]]:
    return [tuple(ids[m.bool()].tolist()) for ids, m in zip(batch["input_ids"], batch["attention_mask"], strict=True)]


def all_rows(path: str, passes: int) -> Counter:
    c = open_cache(path)
    return Counter({tuple(c[i]["input_ids"].tolist()): passes for i in range(len(c))})


def test_two_ranks_split_every_pass_of_a_unit_without_overlap_and_a_unit_goes_only_when_both_are_done(stream):
    want = all_rows(stream, 2)
    ranks = [build_dataloader(stream, stream=True, batch_size=1, passes=2, seed=1, num_replicas=2, rank=r,
                              distributed=True, release="delivery") for r in (0, 1)]
    c = ranks[0].reader
    for u in range(ranks[0].num_units):
        for p in range(2):
            shares = [{i for b in rk.unit_batches(u, p) for i in b} for rk in ranks]
            mine = {i for i in range(len(c)) if c.units()[i] == u}
            assert len(shares[0]) == len(shares[1]) > 0 and shares[0] | shares[1] == mine
            assert not shares[0] & shares[1] or len(mine) % 2  # an odd unit repeats one sample to even the ranks
    got: list[Counter] = [Counter(), Counter()]
    for b in ranks[0]:  # rank 0 runs through the whole stream alone: nothing is released without rank 1
        got[0].update(rows(b))
    store = CacheStore(stream)
    assert released_units(store) == set() and len(done_marks(store)) == ranks[0].num_units
    for b in ranks[1]:
        got[1].update(rows(b))
    assert released_units(store) == set(range(ranks[0].num_units))
    both = got[0] + got[1]
    assert set(both) == set(want) and all(both[k] >= v for k, v in want.items())
    assert sum(both.values()) - sum(want.values()) <= 2 * ranks[0].num_units  # at most one padding sample a pass


def test_a_saved_state_resumes_with_the_next_batch_and_nothing_repeated(stream, tmp_path):
    other = str(tmp_path / "o")
    shutil.copytree(stream, other)
    whole = [rows(b) for b in build_dataloader(other, stream=True, batch_size=2, passes=2, seed=3)]
    first = build_dataloader(stream, stream=True, batch_size=2, passes=2, seed=3)
    head, state = [], None
    for b in first:
        head.append(rows(b))
        state = first.state_dict()
        if len(head) == 5:
            break
    again = build_dataloader(stream, stream=True, batch_size=2, passes=2, seed=3)
    again.load_state_dict(state)
    assert len(whole) > 6 and head + [rows(b) for b in again] == whole
    with pytest.raises(LoaderStateError, match="another plan"):
        build_dataloader(stream, stream=True, batch_size=2, passes=2, seed=4).load_state_dict(state)


def test_with_checkpoints_a_unit_is_released_only_after_a_state_past_it_was_taken_and_the_next_batch_asked(stream):
    loader = build_dataloader(stream, stream=True, batch_size=1, seed=0)
    store = CacheStore(stream)
    n0 = len(loader.unit_batches(0, 0))
    it = iter(loader)
    for _ in range(n0 + 1):  # unit 0 delivered, the first batch of unit 1 too, no state taken
        next(it)
    assert released_units(store) == set()
    loader.state_dict()  # past unit 0; it goes when the next batch is asked for (the state is saved by then)
    assert released_units(store) == set()
    next(it)
    assert released_units(store) == {0}


def test_a_trainer_that_would_wait_forever_for_a_unit_its_own_release_blocks_is_refused(stream):
    store = CacheStore(stream)
    n = open_cache(stream).num_units
    for u in range(2, n):  # the producer has written units 0 and 1 (the window) and waits for unit 0's release
        store.delete(commit_key(u))
    loader = StreamLoader(stream, batch_size=1, poll_s=0.01)
    with pytest.raises(WindowError, match="checkpoint more often"):
        for _ in loader:
            pass  # never calls state_dict(): unit 0 is never released


def test_a_reader_that_opened_a_unit_before_its_release_reads_its_bytes_or_a_released_error_never_garbage(stream):
    c = open_cache(stream)
    units = c.units()
    early = [i for i in range(len(c)) if units[i] == 0]
    other = [i for i in range(len(c)) if units[i] == 1]
    before = c[early[0]]
    loader = build_dataloader(stream, stream=True, batch_size=1, release="delivery")
    it = iter(loader)
    for _ in range(len(loader.unit_batches(0, 0)) + len(loader.unit_batches(1, 0)) + 1):
        next(it)  # units 0 and 1 delivered: released and deleted
    assert {0, 1} <= released_units(CacheStore(stream))
    try:
        again = c[early[0]]  # its shards were open: the old bytes, or a clear error
    except ReleasedUnitError:
        pass
    else:
        assert all(torch.equal(again[k], before[k]) for k in before)
    with pytest.raises(ReleasedUnitError, match="released by the stream's trainer"):
        c[other[0]]
    with pytest.raises(Exception, match="streamed through a window"):
        open_cache(stream)
    assert len(open_cache(stream, allow_incomplete=True)) == len(c) - len(early) - len(other)
