"""The training side: lazy dataset, NeMo-shaped padded batches, token-budget length grouping."""

from __future__ import annotations

import json
import os
import pickle
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from dspark_precompute import open_cache
from dspark_precompute.read.export import export_nemo
from dspark_precompute.read.training import (
    BATCH_KEYS,
    CacheDataset,
    PadCollator,
    TokenBudgetBatchSampler,
    build_dataloader,
    collate,
    padding_fraction,
)

NEMO_KEYS = ("input_ids", "attention_mask", "loss_mask", "target_hidden_states", "target_last_hidden_states")


def real_rows(batch: dict[str, torch.Tensor]) -> list[tuple[int, ...]]:
    """Each row's unpadded token ids, via its attention mask."""
    return [tuple(ids[m.bool()].tolist()) for ids, m in zip(batch["input_ids"], batch["attention_mask"], strict=True)]


class NemoReference:
    """What NeMo's CachedDSparkDataset + _collate_cached do, re-implemented from their source.

    Reads ``manifest.json`` (format_version 1), requires shards 0..ceil(N/shard_size)-1,
    and returns ``safe_open(shard).get_slice(key)[i % shard_size]`` for its five keys;
    the collate stacks them.
    """

    def __init__(self, cache_dir: Path):
        from safetensors import safe_open

        self.dir = cache_dir
        self.manifest = json.loads((cache_dir / "manifest.json").read_text())
        assert self.manifest["format_version"] == 1
        self.shard_size, self.n = int(self.manifest["shard_size"]), int(self.manifest["num_samples"])
        found = sorted(int(p.name[6:12]) for p in cache_dir.glob("shard-*.safetensors"))
        assert found == list(range(-(-self.n // self.shard_size)))
        self.handles = {k: safe_open(str(cache_dir / f"shard-{k:06d}.safetensors"), framework="pt") for k in found}

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        h = self.handles[i // self.shard_size]
        return {key: h.get_slice(key)[i % self.shard_size] for key in NEMO_KEYS}

    @staticmethod
    def collate(features):
        return {key: torch.stack([f[key] for f in features], dim=0) for key in NEMO_KEYS}


def test_a_padded_batch_equals_what_nemos_dataset_and_collate_give_for_the_same_samples(default_run, tmp_path):
    _, result = default_run
    out = tmp_path / "nemo"
    export_nemo(result.path, out, shard_size=4)
    nemo = NemoReference(out)
    ds = CacheDataset(result.path)
    for idx in ([0, 7, 13], [5], list(range(len(ds)))):
        ours = ds.collator(pad_to=ds.seq_length)([ds[i] for i in idx])
        theirs = nemo.collate([nemo[i] for i in idx])
        assert tuple(ours) == tuple(theirs) == BATCH_KEYS
        for k in NEMO_KEYS:
            assert ours[k].dtype == theirs[k].dtype and ours[k].shape == theirs[k].shape, k
            assert torch.equal(ours[k], theirs[k]), k
    assert theirs["loss_mask"][theirs["attention_mask"] == 0].abs().sum() == 0


def test_collate_pads_each_key_to_the_longest_sample_or_to_pad_to():
    def feat(n, h=3, start=1):
        return {"input_ids": torch.arange(start, start + n), "loss_mask": torch.ones(n, dtype=torch.int64),
                "target_hidden_states": torch.full((n, 2 * h), 0.5, dtype=torch.bfloat16),
                "target_last_hidden_states": torch.full((n, h), -1.0, dtype=torch.bfloat16)}

    b = collate([feat(2), feat(4, start=10)], pad_token_id=99)
    assert b["input_ids"].tolist() == [[1, 2, 99, 99], [10, 11, 12, 13]]
    assert b["attention_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    assert b["loss_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    assert b["target_hidden_states"].shape == (2, 4, 6) and b["target_hidden_states"].dtype == torch.bfloat16
    assert b["target_hidden_states"][0, 2:].abs().sum() == 0 and b["target_last_hidden_states"][0, :2].eq(-1).all()
    assert all(b[k].dtype == torch.int64 for k in ("input_ids", "attention_mask", "loss_mask"))
    fixed = PadCollator(pad_token_id=0, pad_to=6)([feat(2)])
    assert fixed["input_ids"].shape == (1, 6) and fixed["target_last_hidden_states"].shape == (1, 6, 3)
    assert collate([feat(5)], pad_to_multiple_of=8)["input_ids"].shape == (1, 8)
    with pytest.raises(ValueError, match="a sample has 4 tokens but pad_to=3; raise pad_to to at least 4"):
        collate([feat(4)], pad_to=3)


def test_a_dataloader_with_two_workers_and_two_distributed_replicas_covers_every_sample_once(default_run):
    _, result = default_run
    ds = CacheDataset(result.path)
    want = Counter(tuple(ds.cache[i]["input_ids"].tolist()) for i in range(len(ds)))
    assert len(want) == len(ds)  # every sample is distinct, so rows identify samples
    seen: Counter = Counter()
    per_rank = []
    for rank in (0, 1):
        sampler = DistributedSampler(ds, num_replicas=2, rank=rank, shuffle=True, seed=3)
        loader = DataLoader(ds, batch_size=3, sampler=sampler, num_workers=2, collate_fn=ds.collator())
        rows = [r for batch in loader for r in real_rows(batch)]
        per_rank.append(len(rows))
        seen.update(rows)
    assert len(ds) % 2 == 0 and per_rank == [len(ds) // 2] * 2
    assert seen == want


def test_the_dataset_pickles_without_open_handles_and_reads_the_same_after(default_run):
    _, result = default_run
    ds = CacheDataset(result.path, layers=[2])
    first = ds[3]
    blob = pickle.dumps(ds)
    assert len(blob) < 200_000 and b"zarr" not in blob
    back = pickle.loads(blob)
    assert back._cache is None and len(back) == len(ds)
    assert all(torch.equal(back[3][k], first[k]) for k in first)
    assert back[3]["target_hidden_states"].shape[1] == 64  # one layer of 64
    with pytest.raises(ValueError, match="were not captured"):
        CacheDataset(result.path, layers=[7])


def test_a_forked_process_reads_through_its_own_handle_and_keeps_every_inherited_one(default_run):
    """Each process re-opens the cache; the handles of the processes above it stay referenced there (collecting one
    would close another process's object-store sessions), the parent's and the grandparent's alike."""
    _, result = default_run
    ds = CacheDataset(result.path, layers=[2])
    first = ds[3]
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child, then grandchild: each reads, then reports what it holds
        code = 1
        try:
            same = all(torch.equal(ds[3][k], first[k]) for k in first)
            if os.fork() == 0:
                same = same and all(torch.equal(ds[3][k], first[k]) for k in first)
                held = [id(h) for h in ds._inherited]
                os.write(write_fd, json.dumps({"same": same, "held": held, "own": id(ds._cache)}).encode())
            else:
                os.wait()
            code = 0
        finally:
            os._exit(code)
    os.close(write_fd)
    report = json.loads(os.read(read_fd, 4096))
    os.waitpid(pid, 0)
    assert report["same"] and len(report["held"]) == 2 and report["held"][0] == id(ds._cache)
    assert report["own"] not in report["held"] and ds._inherited == []  # the parent itself holds nothing extra
    assert pickle.loads(pickle.dumps(ds))._inherited == []


def test_the_token_budget_sampler_keeps_every_batch_within_budget_and_every_sample_once():
    rng = np.random.default_rng(0)
    lengths = rng.integers(20, 900, size=500)
    lengths[7] = 1500  # longer than the budget: a batch of its own
    s = TokenBudgetBatchSampler(lengths, max_tokens=1024, seed=5)
    batches = list(s)
    assert len(batches) == len(s)
    for b in batches:
        assert len(b) == 1 or len(b) * lengths[b].max() <= 1024
    assert [7] in batches
    assert sorted(i for b in batches for i in b) == list(range(500))
    assert list(TokenBudgetBatchSampler(lengths, max_tokens=1024, seed=5)) == batches  # deterministic
    s.set_epoch(1)
    assert list(s) != batches and sorted(i for b in s for i in b) == list(range(500))
    capped = TokenBudgetBatchSampler(lengths, max_tokens=10**6, max_batch_size=8)
    assert max(len(b) for b in capped) == 8
    fixed = TokenBudgetBatchSampler(lengths, max_tokens=3000, pad_to=1500)
    assert {len(b) for b in fixed} <= {1, 2}


def test_length_grouping_wastes_far_less_on_padding_than_random_batches():
    rng = np.random.default_rng(1)
    lengths = rng.integers(16, 2048, size=2000)
    grouped = list(TokenBudgetBatchSampler(lengths, max_tokens=16384, seed=0))
    perm = rng.permutation(len(lengths))
    size = round(len(lengths) / len(grouped))
    random_batches = [perm[k:k + size] for k in range(0, len(perm), size)]
    g, r = padding_fraction(grouped, lengths), padding_fraction(random_batches, lengths)
    assert g < 0.1 and r > 0.3 and g < r / 4


def test_the_token_budget_sampler_deals_the_same_number_of_batches_to_every_replica():
    lengths = np.random.default_rng(2).integers(10, 500, size=301)
    ranks = [TokenBudgetBatchSampler(lengths, max_tokens=2000, num_replicas=3, rank=r, seed=4) for r in range(3)]
    total = len(ranks[0].all_batches())
    assert len({len(s) for s in ranks}) == 1 and len(ranks[0]) == -(-total // 3)
    ids = Counter(i for s in ranks for b in s for i in b)
    assert set(ids) == set(range(301))  # all covered; repeats only from padding the last round
    dropped = [TokenBudgetBatchSampler(lengths, max_tokens=2000, num_replicas=3, rank=r, seed=4, drop_last=True)
               for r in range(3)]
    flat = [i for s in dropped for b in s for i in b]
    assert len(flat) == len(set(flat)) and len({len(s) for s in dropped}) == 1
    with pytest.raises(ValueError, match="rank=3 is outside"):
        TokenBudgetBatchSampler(lengths, max_tokens=2000, num_replicas=3, rank=3)


def test_build_dataloader_with_a_token_budget_yields_nemo_keys_within_budget(default_run):
    _, result = default_run
    c = open_cache(result.path)
    loader = build_dataloader(c, max_tokens=600, seed=1)
    assert len(c) == result.samples > 0
    rows = []
    for batch in loader:
        assert tuple(batch) == BATCH_KEYS
        b, t = batch["input_ids"].shape
        assert b == 1 or b * t <= 600
        assert batch["target_hidden_states"].shape == (b, t, 192)
        assert batch["target_hidden_states"].dtype == torch.bfloat16
        rows += real_rows(batch)
    assert Counter(rows) == Counter(tuple(c[i]["input_ids"].tolist()) for i in range(len(c)))
    fixed = next(iter(build_dataloader(c, batch_size=4, pad_to=256, shuffle=False)))
    assert fixed["input_ids"].shape == (4, 256)
    assert fixed["input_ids"][0, c.lengths()[0]:].eq(c.pad_token_id).all()
    with pytest.raises(ValueError, match="exactly one of batch_size"):
        build_dataloader(c)
