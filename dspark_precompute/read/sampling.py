"""Which samples go into which batch, in which order, on which rank.

``TokenBudgetBatchSampler`` packs length-grouped batches under a token budget; the plans
of :class:`CacheBatchSampler` (used by the loader) cover the exact shuffle, the
chunk-aware block shuffle and index order, for fixed-size or token-budget batches, and
group an epoch's batches into *tasks*: the batches one worker builds together.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import Sampler


def padding_fraction(batches: Sequence[Sequence[int]], lengths: Sequence[int] | np.ndarray,
                     pad_to: int | None = None) -> float:
    """Share of the padded token slots that are padding, for batches padded to their longest."""
    lengths = np.asarray(lengths)
    real = padded = 0
    for batch in batches:
        ls = lengths[np.asarray(batch, dtype=np.int64)]
        real += int(ls.sum())
        padded += len(ls) * (int(pad_to) if pad_to else int(ls.max()))
    return 1.0 - real / padded if padded else 0.0


def pack_longest_first(ids: np.ndarray, lengths: np.ndarray, max_tokens: int, max_batch_size: int | None = None,
                       pad_to: int | None = None) -> list[list[int]]:
    """Greedy batches over ``ids`` sorted longest first (stable: ties keep their order in ``ids``).

    ``rows x padded length <= max_tokens`` (padded length: the batch's longest sample, or
    ``pad_to``); a sample longer than the budget gets a batch of its own.
    """
    order = ids[np.argsort(-lengths[ids], kind="stable")]
    cap = max_batch_size or len(order) or 1
    out: list[list[int]] = []
    cur: list[int] = []
    width = 0
    for s in order.tolist():
        w = pad_to or max(width, int(lengths[s]))
        if cur and ((len(cur) + 1) * w > max_tokens or len(cur) >= cap):
            out.append(cur)
            cur, w = [], pad_to or int(lengths[s])
        cur.append(s)
        width = w
    if cur:
        out.append(cur)
    return out


def _dist_defaults(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    if num_replicas is None or rank is None:
        import torch.distributed as dist

        ready = dist.is_available() and dist.is_initialized()
        num_replicas = num_replicas if num_replicas is not None else (dist.get_world_size() if ready else 1)
        rank = rank if rank is not None else (dist.get_rank() if ready else 0)
    if not 0 <= rank < num_replicas:
        raise ValueError(f"rank={rank} is outside [0, num_replicas={num_replicas}); pass 0 <= rank < num_replicas")
    return int(num_replicas), int(rank)


class TokenBudgetBatchSampler(Sampler[list[int]]):
    """Length-grouped batches under a token budget: ``rows x padded length <= max_tokens``.

    Each epoch shuffles the samples (seeded by ``seed + epoch``), cuts the permutation into
    buckets of ``bucket_batches`` batches' worth of samples, sorts each bucket by length and
    packs it greedily, then shuffles the batch order: batches are random but their rows
    have similar lengths, so little compute goes to padding. A sample longer than the
    budget gets a batch of its own.

    With ``num_replicas`` > 1 (default: the torch.distributed world) every rank builds the
    same batches and takes every ``num_replicas``-th one; when the count does not divide,
    the first batches are repeated (or the tail dropped with ``drop_last``) so all ranks run
    the same number of steps, as ``DistributedSampler`` does. Call :meth:`set_epoch`.
    """

    def __init__(self, lengths: Sequence[int] | np.ndarray, max_tokens: int, *, max_batch_size: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False, num_replicas: int | None = None,
                 rank: int | None = None, bucket_batches: int = 64, pad_to: int | None = None):
        self.lengths = np.asarray(lengths, dtype=np.int64)
        if max_tokens < 1:
            raise ValueError(f"max_tokens={max_tokens} must be >= 1 (padded tokens per batch)")
        if max_batch_size is not None and max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size} must be >= 1 or None")
        if bucket_batches < 1:
            raise ValueError(f"bucket_batches={bucket_batches} must be >= 1")
        if pad_to is not None and len(self.lengths) and int(self.lengths.max()) > pad_to:
            raise ValueError(f"pad_to={pad_to} is shorter than the longest sample ({int(self.lengths.max())} tokens)")
        self.max_tokens = int(max_tokens)
        self.max_batch_size = max_batch_size
        self.shuffle = shuffle
        self.seed = int(seed)
        self.drop_last = drop_last
        self.num_replicas, self.rank = _dist_defaults(num_replicas, rank)
        self.bucket_batches = int(bucket_batches)
        self.pad_to = pad_to
        self.epoch = 0
        self._memo: tuple[int, list[list[int]]] | None = None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def _pack(self, ids: np.ndarray) -> list[list[int]]:
        """Greedy batches over ``ids`` sorted longest first."""
        return pack_longest_first(ids, self.lengths, self.max_tokens, self.max_batch_size, self.pad_to)

    def all_batches(self) -> list[list[int]]:
        """This epoch's batches over every rank, before they are dealt out."""
        if self._memo is not None and self._memo[0] == self.epoch:
            return self._memo[1]
        n = len(self.lengths)
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        perm = torch.randperm(n, generator=g).numpy() if self.shuffle else np.arange(n)
        if self.shuffle:
            typical = max(1, int(np.median(self.lengths))) if n else 1
            per_batch = max(1, self.max_tokens // (self.pad_to or typical))
            if self.max_batch_size:
                per_batch = min(per_batch, self.max_batch_size)
            bucket = max(1, per_batch * self.bucket_batches)
            batches = [b for k in range(0, n, bucket) for b in self._pack(perm[k:k + bucket])]
            order = torch.randperm(len(batches), generator=g).tolist()
            batches = [batches[k] for k in order]
        else:
            batches = self._pack(perm)
        self._memo = (self.epoch, batches)
        return batches

    def _mine(self) -> list[list[int]]:
        batches = self.all_batches()
        r = self.num_replicas
        if r > 1:
            if self.drop_last:
                batches = batches[: len(batches) // r * r]
            elif len(batches) % r:
                extra = r - len(batches) % r
                batches = batches + [batches[k % len(batches)] for k in range(extra)]
        return batches[self.rank::r]

    def __iter__(self) -> Iterator[list[int]]:
        yield from self._mine()

    def __len__(self) -> int:
        return len(self._mine())


# -- the loader's plans ---------------------------------------------------------------------
SHUFFLES = ("exact", "block", "none")
DEFAULT_WINDOW_BLOCKS = 4
MIN_BLOCK_CHUNKS = 4


def shuffle_mode(shuffle: bool | str | None) -> str:
    """``True``/``"exact"``, ``"block"`` or ``False``/``"none"`` as one of :data:`SHUFFLES`."""
    if shuffle is True or shuffle == "exact":
        return "exact"
    if shuffle is False or shuffle is None or shuffle == "none":
        return "none"
    if shuffle == "block":
        return "block"
    raise ValueError(f"shuffle={shuffle!r} is not a shuffle: pass True or 'exact' (every sample in a uniformly random "
                     "order), 'block' (random chunk groups, samples shuffled within a window of a few: each chunk "
                     "is decoded once per epoch) or False/'none' (index order)")


def default_block_chunks(chunk_row_bytes: int, target_bytes: int = 16 << 20) -> int:
    """Chunks per block: about ``target_bytes`` of decoded token rows, at least :data:`MIN_BLOCK_CHUNKS`.

    A block's last sample usually runs into the next block's first chunk, which is then
    decoded by both: at least 4 chunks a block keeps that under about a quarter extra.
    """
    return max(MIN_BLOCK_CHUNKS, -(-int(target_bytes) // max(1, int(chunk_row_bytes))))


def _cut(order: Sequence[int], batch_size: int, drop_last: bool) -> list[list[int]]:
    order = list(order)
    out = [order[k:k + batch_size] for k in range(0, len(order), batch_size)]
    if out and drop_last and len(out[-1]) < batch_size:
        out.pop()
    return out


class CacheBatchSampler(Sampler[list[int]]):
    """This rank's batches for an epoch, grouped into *tasks*: the batches one worker builds together.

    ``shuffle``:

    * ``True``/``"exact"``: every sample in a uniformly random order (seeded by ``seed + epoch``);
      fixed-size batches split over ranks exactly as ``DistributedSampler`` + ``DataLoader``
      do, token-budget batches as :class:`TokenBudgetBatchSampler`. One batch per task.
    * ``"block"``: the samples are cut into *blocks* (the samples starting in a run of
      ``block_chunks`` chunks, in disk order), the blocks are put in a seeded random order,
      the ranks take equal contiguous shares of that sequence (padded by repeating its start,
      or cut with ``drop_last``, as ``DistributedSampler`` does), and each rank's share is
      cut into *windows* of ``window_blocks`` blocks whose samples are shuffled (fixed size:
      cut into batches; token budget: packed longest first, then the batch order shuffled).
      A window is one task, so one worker decodes each of its chunks once.
      The randomness given up: a batch draws its samples from one window (``window_blocks x
      block_chunks x chunk_tokens`` tokens) rather than from the whole dataset, so two samples
      share a batch only if they lie that close on disk, where neighbours come from
      neighbouring input rows and, inside a unit, have similar lengths. Every order of the
      blocks stays possible, and a window's samples come in any order.
    * ``False``/``"none"``: index order.

    Plans depend only on the cache's tables, the arguments and the epoch: every process
    (and any number of workers) computes the same batches.
    """

    def __init__(self, lengths: Sequence[int] | np.ndarray, starts: Sequence[int] | np.ndarray | None = None,
                 chunk_tokens: int | None = None, *, batch_size: int | None = None, max_tokens: int | None = None,
                 shuffle: bool | str = True, seed: int = 0, drop_last: bool = False,
                 num_replicas: int | None = None, rank: int | None = None, pad_to: int | None = None,
                 max_batch_size: int | None = None, block_chunks: int = MIN_BLOCK_CHUNKS,
                 window_blocks: int = DEFAULT_WINDOW_BLOCKS, bucket_batches: int = 64):
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.mode = shuffle_mode(shuffle)
        if (batch_size is None) == (max_tokens is None):
            raise ValueError(f"pass exactly one of batch_size={batch_size} or max_tokens={max_tokens}")
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"max_tokens={max_tokens} must be >= 1 (padded tokens per batch)")
        if block_chunks < 1 or window_blocks < 1:
            raise ValueError(f"block_chunks={block_chunks} and window_blocks={window_blocks} must be >= 1")
        if pad_to is not None and len(self.lengths) and int(self.lengths.max()) > pad_to:
            raise ValueError(f"pad_to={pad_to} is shorter than the longest sample ({int(self.lengths.max())} tokens); "
                             "raise it or leave it None to pad each batch to its longest sample")
        if self.mode == "block":
            if starts is None or chunk_tokens is None:
                raise ValueError("shuffle='block' needs the samples' starts and the cache's chunk_tokens")
            self.starts = np.asarray(starts, dtype=np.int64)
            if len(self.starts) != len(self.lengths):
                raise ValueError(f"{len(self.starts)} starts for {len(self.lengths)} samples")
        else:
            self.starts = np.zeros(0, dtype=np.int64) if starts is None else np.asarray(starts, dtype=np.int64)
        self.chunk_tokens = int(chunk_tokens or 1)
        self.batch_size = batch_size
        self.max_tokens = max_tokens
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.num_replicas, self.rank = _dist_defaults(num_replicas, rank)
        self.pad_to = pad_to
        self.max_batch_size = max_batch_size
        self.block_chunks = int(block_chunks)
        self.window_blocks = int(window_blocks)
        self.bucket_batches = int(bucket_batches)
        self.epoch = 0
        self._memo: dict[tuple[int, int], list[list[list[int]]]] = {}

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def describe(self) -> dict[str, object]:
        """Everything the plan depends on besides the tables (what a saved loader state must match)."""
        return {"shuffle": self.mode, "batch_size": self.batch_size, "max_tokens": self.max_tokens,
                "seed": self.seed, "drop_last": self.drop_last, "num_replicas": self.num_replicas,
                "rank": self.rank, "pad_to": self.pad_to, "max_batch_size": self.max_batch_size,
                "block_chunks": self.block_chunks, "window_blocks": self.window_blocks,
                "bucket_batches": self.bucket_batches, "samples": len(self.lengths)}

    # -- plans -----------------------------------------------------------------------------
    def tasks(self, epoch: int | None = None, rank: int | None = None) -> list[list[list[int]]]:
        """The tasks of ``rank`` (default: this one) in ``epoch`` (default: the current one)."""
        epoch = self.epoch if epoch is None else int(epoch)
        rank = self.rank if rank is None else int(rank)
        key = (epoch, rank)
        if key not in self._memo:
            if len(self._memo) > 4:
                self._memo.clear()
            if self.mode == "block":
                self._memo[key] = self._block_tasks(epoch, rank)
            else:
                self._memo[key] = [[b] for b in self._sample_batches(epoch, rank)]
        return self._memo[key]

    def batches(self, epoch: int | None = None) -> list[list[int]]:
        """This rank's batches of the epoch, in order."""
        return [b for task in self.tasks(epoch) for b in task]

    def all_batches(self) -> list[list[int]]:
        """This epoch's batches over every rank."""
        return [b for r in range(self.num_replicas) for task in self.tasks(rank=r) for b in task]

    def __iter__(self) -> Iterator[list[int]]:
        yield from self.batches()

    def __len__(self) -> int:
        return sum(len(t) for t in self.tasks())

    def _sample_batches(self, epoch: int, rank: int) -> list[list[int]]:
        shuffle = self.mode == "exact"
        n = len(self.lengths)
        if self.max_tokens is not None:
            tb = TokenBudgetBatchSampler(self.lengths, self.max_tokens, max_batch_size=self.max_batch_size,
                                         shuffle=shuffle, seed=self.seed, drop_last=self.drop_last,
                                         num_replicas=self.num_replicas, rank=rank,
                                         bucket_batches=self.bucket_batches, pad_to=self.pad_to)
            tb.set_epoch(epoch)
            return list(tb)
        from torch.utils.data.distributed import DistributedSampler

        ds: DistributedSampler[int] = DistributedSampler(
            range(n), num_replicas=self.num_replicas, rank=rank, shuffle=shuffle,  # type: ignore[arg-type]
            seed=self.seed, drop_last=self.drop_last)
        ds.set_epoch(epoch)
        assert self.batch_size is not None
        return _cut(list(ds), self.batch_size, self.drop_last)

    def _block_sequence(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """Every sample, blocks in a seeded random order, disk order inside a block; and each one's block."""
        disk = np.argsort(self.starts, kind="stable")
        block = self.starts[disk] // (self.block_chunks * self.chunk_tokens)
        cuts = np.flatnonzero(np.diff(block)) + 1
        groups = np.split(disk, cuts) if len(disk) else []
        rng = np.random.default_rng([self.seed, epoch, 0])
        order = rng.permutation(len(groups))
        if not len(groups):
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        seq = np.concatenate([groups[k] for k in order])
        which = np.repeat(np.arange(len(groups)), [len(groups[k]) for k in order])
        return seq, which

    def _rank_share(self, seq: np.ndarray, which: np.ndarray, rank: int) -> tuple[np.ndarray, np.ndarray]:
        r, n = self.num_replicas, len(seq)
        if r == 1 or n == 0:
            return seq, which
        if self.drop_last:
            m = n // r
        else:
            m = -(-n // r)
            pad = m * r - n  # repeat the start, as DistributedSampler does
            reps = -(-pad // n) if pad else 0
            seq = np.concatenate([seq, np.tile(seq, reps)[:pad]])
            which = np.concatenate([which, np.tile(which, reps)[:pad] + len(which)])  # repeats are new runs
        return seq[rank * m:(rank + 1) * m], which[rank * m:(rank + 1) * m]

    def _windows(self, seq: np.ndarray, which: np.ndarray) -> list[np.ndarray]:
        """``seq`` cut after every ``window_blocks`` runs of one block, rounded up to whole batches."""
        n = len(seq)
        bounds = np.concatenate([np.flatnonzero(np.diff(which)) + 1, [n]]) if n else np.zeros(0, np.int64)
        mult = self.batch_size or 1
        out: list[np.ndarray] = []
        i = 0
        while i < n:
            k = int(np.searchsorted(bounds, i, side="right"))  # bounds[k] is the end of the run holding i
            end = int(bounds[min(k + self.window_blocks - 1, len(bounds) - 1)])
            end = min(n, i + -(-(end - i) // mult) * mult)
            out.append(seq[i:end])
            i = end
        return out

    def _window_batches(self, windows: list[np.ndarray], rng: np.random.Generator) -> list[list[list[int]]]:
        tasks: list[list[list[int]]] = []
        for w in windows:
            mixed = w[rng.permutation(len(w))]
            if self.batch_size is not None:
                batches = _cut(mixed.tolist(), self.batch_size, self.drop_last)
            else:
                assert self.max_tokens is not None
                packed = pack_longest_first(mixed, self.lengths, self.max_tokens, self.max_batch_size, self.pad_to)
                batches = [packed[k] for k in rng.permutation(len(packed))]
            if batches:
                tasks.append(batches)
        return tasks

    def _block_tasks(self, epoch: int, rank: int) -> list[list[list[int]]]:
        seq, which = self._block_sequence(epoch)

        def of(r: int) -> list[list[list[int]]]:
            share, runs = self._rank_share(seq, which, r)
            return self._window_batches(self._windows(share, runs), np.random.default_rng([self.seed, epoch, 1 + r]))

        mine = of(rank)
        if self.max_tokens is None or self.num_replicas == 1:
            return mine
        # token budgets make batch counts differ between ranks: every rank runs the same number of steps
        counts = [sum(len(t) for t in (mine if r == rank else of(r))) for r in range(self.num_replicas)]
        have = counts[rank]
        if self.drop_last:
            keep, out = min(counts), []
            for task in mine:
                if keep <= 0:
                    break
                out.append(task[:keep])
                keep -= len(out[-1])
            return out
        flat = [b for t in mine for b in t]
        extra = [[flat[k % len(flat)]] for k in range(max(counts) - have)] if flat else []
        return mine + extra
