"""Read a cache: ``open_cache(path)[i]`` -> one sample's tensors, no padding.

Depends only on the contract (``dspark_precompute.contract``), zarr, numpy and torch
(never on transformers or the write side), so training jobs and notebooks can read caches
without the target.

Opening (``contract.opener.open_stored``) checks what is cheap and already in hand before
anything is read: the manifest's fields, every array's zarr.json against it and the
sample/unit tables against the layout; a cache that fails any of them is refused with a
:class:`CacheFormatError` listing every problem, so nothing sized by a crafted value is ever
allocated.

Token slots and inner chunks are read by ``reader.chunks`` (:class:`~dspark_precompute.read.chunks.CacheChunks`):
found through the shard indexes, decoded and checked, a missing one a :class:`MissingChunkError`
and a damaged one a :class:`DamagedShardError`, each naming the array and the samples, through a
small LRU of decoded chunks (a sample touches only the chunks that hold its tokens; neighbours
reuse them). :meth:`CacheReader.close` stops its decode threads.

``max_length=L`` serves a cache made at a longer ``seq_length`` as one made at ``L``: a causal
target's states for the first ``L`` tokens do not depend on what follows, so each sample is
cut at ``L`` and samples left with no supervised token are dropped (``cut_dropped`` counts
them).

An fp8 cache (``storage.dtype=fp8_e4m3``) reads like a bf16 one: its states are dequantized
to bf16 by ``contract.fp8`` (exactly as documented there); :meth:`CacheReader.read_fp8` gives
the stored e4m3 bits and scales instead.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dspark_precompute.contract.commits import committed_units
from dspark_precompute.contract.fp8 import bf16_bits_to_float32, convert
from dspark_precompute.contract.opener import open_stored
from dspark_precompute.contract.spec import (
    IMAGE_GRID,
    IMAGE_SAMPLE,
    IMAGE_SHA256,
    INPUT_IDS,
    LAST,
    LOSS_MASK,
    POSITION_IDS,
    PRE_NORM,
    VIDEO_GRID,
    VIDEO_SAMPLE,
    VIDEO_SHA256,
    WEIGHTS,
)
from dspark_precompute.contract.vocab import StorageDtype
from dspark_precompute.contract.weights import weights_problems
from dspark_precompute.errors import CacheFormatError, ChecksumError
from dspark_precompute.humanize import listing
from dspark_precompute.read import summary
from dspark_precompute.read.chunks import CacheChunks

SAMPLE_KEYS = ("input_ids", "loss_mask", "target_hidden_states", "target_last_hidden_states")
PRE_NORM_KEY = "target_pre_norm_hidden_states"
DEFAULT_CHUNK_CACHE_BYTES = 64 << 20
_MASK_WINDOW = 1 << 22  # loss_mask tokens read at a time when counting supervised tokens


def to_torch(a: np.ndarray, storage_dtype: str) -> torch.Tensor:
    """A stored hidden-state array as a tensor of its logical dtype (bf16 bits viewed back)."""
    a = np.ascontiguousarray(a)
    if StorageDtype(storage_dtype) is StorageDtype.bf16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _check_max_length(max_length: int | None, seq_length: int) -> int | None:
    if max_length is None:
        return None
    if isinstance(max_length, bool) or not isinstance(max_length, (int, np.integer)) or not \
            1 <= int(max_length) <= seq_length:
        raise ValueError(f"max_length={max_length!r} must be a number of tokens in [1, seq_length={seq_length}] "
                         "(a cache serves any length up to the one it was made at), or None")
    return None if int(max_length) == seq_length else int(max_length)


class CacheReader:
    """A read-only view of one cache (``len``, ``c[i]``, ``c[a:b]``, ``c[[i, j]]``).

    Index ``i`` is the i-th *readable* sample: every sample of a complete cache, in input
    order; for an incomplete cache opened with ``allow_incomplete=True``, the samples of
    committed units only. A context manager: :meth:`close` (or leaving the ``with``) stops
    its decode threads and closes its files.
    """

    def __init__(self, path: str | Path, allow_incomplete: bool = False,
                 chunk_cache_bytes: int = DEFAULT_CHUNK_CACHE_BYTES, max_length: int | None = None,
                 _units: list[int] | None = None):
        opened = open_stored(str(path), allow_incomplete=allow_incomplete)
        self.store, self.manifest = opened.store, opened.manifest
        self.path: str = opened.path
        self.complete: bool = self.manifest.complete and _units is None and not opened.released
        m = self.manifest
        self.layer_ids: list[int] = list(m.layer_ids)
        self.hidden_size: int = m.hidden_size
        self.storage_dtype = m.dtype
        # what samples hold: the storage dtype, except fp8 (dequantized to bf16); the final states may differ
        self.output_dtype: StorageDtype = m.output_dtype
        self.last_output_dtype: StorageDtype = m.last_output_dtype
        self.seq_length: int = m.seq_length
        self.chunk_tokens: int = m.layout.chunk_tokens
        self.max_length = _check_max_length(max_length, self.seq_length)
        self._names: dict[str, str] = dict(m.arrays)
        self._dtypes = m.array_dtypes  # hidden array -> storage dtype
        self._scales = m.scale_arrays  # fp8 array -> its scale array
        self.chunks = CacheChunks(opened, chunk_cache_bytes)  # token slots and inner chunks (read/chunks.py)
        self._owned: dict[str, Any] = {"chunks": self.chunks, "opened": opened}  # released by close() or finalizer
        self._finalizer = weakref.finalize(self, _shutdown, self._owned)
        t = opened.tables
        self._start, self._length, self._unit = t["samples/start"], t["samples/length"], t["samples/unit"]
        self._source_row, self._untruncated = t["samples/source_row"], t["samples/untruncated_length"]
        # an image cache: each image's sample, grid and content hash (empty for a text cache)
        self._image_sample = t.get(IMAGE_SAMPLE, np.zeros(0, dtype=np.int64))
        self._image_grid = t.get(IMAGE_GRID, np.zeros((0, 3), dtype=np.int32)).reshape(-1, 3)
        self._image_sha = t.get(IMAGE_SHA256, np.zeros((0, 32), dtype=np.uint8))
        self._video_sample = t.get(VIDEO_SAMPLE, np.zeros(0, dtype=np.int64))  # a cache with videos: the same
        self._video_grid = t.get(VIDEO_GRID, np.zeros((0, 3), dtype=np.int32)).reshape(-1, 3)
        self._video_sha = t.get(VIDEO_SHA256, np.zeros((0, 32), dtype=np.uint8))
        self.has_positions: bool = POSITION_IDS in opened.metas  # position_ids stored (an M-RoPE image cache)
        units = _units if _units is not None else (
            None if m.complete and not opened.released else sorted(opened.committed - opened.released))
        self._readable_units = units
        self.indices = opened.readable(units)
        self._cut = self._cut_lengths()
        self._stored = self.indices  # before the cut: what the cache holds for this view
        self.cut_dropped = 0  # samples dropped by max_length (too few supervised tokens left)
        if self.max_length is not None:
            keep = self._supervised_within(self.indices) >= self._min_supervised()
            self.cut_dropped = int((~keep).sum())
            self.indices = self.indices[keep]
        self._supervised: np.ndarray | None = None

    def _min_supervised(self) -> int:
        """The fewest supervised tokens a sample keeps (1; the mask rule's minimum where it has one, e.g. DeepSpec's),
        so a cut cache holds the samples a run at ``max_length`` would have."""
        mask = self.manifest.capture.mask if self.manifest.capture is not None else None
        return max(1, int(mask.min_supervised_tokens or 1) if mask is not None else 1)

    def _cut_lengths(self) -> np.ndarray:
        """Tokens each stored sample gives a reader: its length, at most ``max_length``."""
        return self._length if self.max_length is None else np.minimum(self._length, self.max_length)

    # -- metadata --------------------------------------------------------------------------
    @property
    def num_units(self) -> int:
        return self.manifest.layout.num_units

    @property
    def pad_token_id(self) -> int:
        """The id NeMo pads with: the tokenizer's pad token, else its eos token, else 0."""
        return self.manifest.pad_id

    @property
    def source_row(self) -> np.ndarray:
        """Row of the input selection each readable sample came from."""
        return np.asarray(self._source_row[self.indices])

    @property
    def array_names(self) -> dict[str, str]:
        """Layer id (as a string, plus ``"last"`` and ``"pre_norm"`` when stored) -> zarr array name."""
        return dict(self._names)

    @property
    def has_pre_norm(self) -> bool:
        """Whether the last decoder output before the final norm is stored (``capture.last_state``)."""
        return PRE_NORM in self._names

    @property
    def group(self) -> Any:
        """The cache as a zarr group (read-only), for inspection with zarr's own API."""
        import zarr

        return zarr.open_group(self.store.zarr_store(read_only=True), mode="r")

    def close(self) -> None:
        """Stop the decode threads and close the shard files (the reader can still be used: they come back)."""
        self.chunks.close()

    def __enter__(self) -> CacheReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- sequence protocol -----------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, key: int | slice | Sequence[int] | np.ndarray) -> Any:
        if isinstance(key, slice):
            return [self.sample(i) for i in range(*key.indices(len(self)))]
        if isinstance(key, (list, tuple, np.ndarray, range)):
            return [self.sample(int(i)) for i in key]
        if isinstance(key, (int, np.integer)):
            return self.sample(int(key))
        raise TypeError(f"cache indices must be an int, a slice or a list of ints, not {type(key).__name__}")

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for i in range(len(self)):
            yield self.sample(i)

    def _resolve(self, i: int) -> int:
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"sample {i} is out of range for a cache of {n} readable samples")
        return int(self.indices[i])

    def check_layers(self, layers: Sequence[int] | None) -> list[int]:
        """The layer ids ``layers`` names (all captured ones for None); refuses ids not captured."""
        if layers is None:
            return list(self.layer_ids)
        chosen = [int(x) for x in layers]
        missing = [lid for lid in chosen if lid not in self.layer_ids]
        if missing:
            raise ValueError(f"layers={list(layers)}: {missing} were not captured; this cache holds layer ids "
                             f"{self.layer_ids}. Pick a subset of those.")
        return chosen

    def _final_name(self, key: str) -> str:
        name = self._names.get(key)
        if name is None:
            what = ("the post-norm state (target_last_hidden_states)" if key == LAST else
                    "the pre-norm last decoder output (target_pre_norm_hidden_states)")
            fix = "post_norm or both" if key == LAST else "pre_norm or both"
            raise ValueError(f"{self.path} does not store {what}; re-run the precompute with "
                             f"capture.last_state={fix}, or pass {'last' if key == LAST else 'pre_norm'}=False")
        return name

    def read_raw(self, i: int, layers: Sequence[int] | None = None, *, last: bool = True,
                 pre_norm: bool = False) -> dict[str, np.ndarray]:
        """Sample ``i`` as stored: int32 ids, uint8 mask, hidden states in the output dtype.

        bf16 stays as its uint16 bit pattern: the cheapest form to copy elsewhere (export).
        fp8 states come dequantized, as bf16 bits (``contract.fp8``); a layer stored in
        another dtype than the rest (the final states under ``storage.last_dtype``) is
        converted to ``output_dtype`` in ``target_hidden_states``. ``pre_norm`` adds
        ``target_pre_norm_hidden_states`` (the last decoder output before the final norm).
        """
        s = self._resolve(i)
        chosen = self.check_layers(layers)
        a, n = int(self._start[s]), int(self._cut[s])
        layer_names = [self._names[str(lid)] for lid in chosen]
        finals = {key: self._final_name(name) for key, name, want in ((LAST, LAST, last), (PRE_NORM, PRE_NORM,
                                                                                          pre_norm)) if want}
        names = [INPUT_IDS, LOSS_MASK, *layer_names, *finals.values()]
        extra = [POSITION_IDS] if self.has_positions else []
        got = self.chunks.read(names + [self._scales[nm] for nm in names if nm in self._scales] + extra, a, a + n)

        def states(nm: str, to: str) -> np.ndarray:
            scale = got[self._scales[nm]] if nm in self._scales else None
            return convert(got[nm], self._dtypes[nm], to, scale)

        if layer_names:
            parts = [states(nm, self.output_dtype) for nm in layer_names]
            hidden = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)
        else:
            hidden = np.zeros((n, 0), dtype=self.output_dtype.disk)
        out = {"input_ids": got[INPUT_IDS], "loss_mask": got[LOSS_MASK], "target_hidden_states": hidden}
        if LAST in finals:
            out["target_last_hidden_states"] = states(finals[LAST], self.last_output_dtype)
        if PRE_NORM in finals:
            out[PRE_NORM_KEY] = states(finals[PRE_NORM], self.last_output_dtype)
        if self.has_positions:
            out[POSITION_IDS] = got[POSITION_IDS]
        return out

    def image_rows(self) -> np.ndarray:
        """The readable samples (indices ``i``) that hold an image or a video: empty for a text cache."""
        held = np.concatenate([self._image_sample, self._video_sample])
        return np.flatnonzero(np.isin(self.indices, held)).astype(np.int64)

    def videos(self, i: int) -> dict[str, Any]:
        """Sample ``i``'s videos, in order: ``grid_thw`` int64 [n, 3] (the video processor's grid of each: frame
        pairs, height and width in patches) and ``sha256`` (of each video file's bytes); none where it holds none."""
        s = self._resolve(i)
        lo, hi = np.searchsorted(self._video_sample, [s, s + 1])
        return {"grid_thw": self._video_grid[lo:hi].astype(np.int64),
                "sha256": [bytes(row).hex() for row in self._video_sha[lo:hi]]}

    def images(self, i: int) -> dict[str, Any]:
        """Sample ``i``'s images, in order: ``grid_thw`` int64 [n, 3] (the processor's patch grid of each) and
        ``sha256`` (the hex digest of each image's bytes); none for a text sample or a text cache."""
        s = self._resolve(i)
        lo, hi = np.searchsorted(self._image_sample, [s, s + 1])
        return {"grid_thw": self._image_grid[lo:hi].astype(np.int64),
                "sha256": [bytes(row).hex() for row in self._image_sha[lo:hi]]}

    def read_fp8(self, i: int, layers: Sequence[int] | None = None, *, last: bool = True) -> dict[str, Any]:
        """Sample ``i``'s fp8 states as stored: e4m3 bits and their float32 scales (numpy), nothing dequantized.

        ``target_hidden_states`` is ``uint8 [T, L*H]`` (view it as ``torch.float8_e4m3fn``),
        ``target_hidden_scales`` ``float32 [T, L*H/g]``: channel ``c`` of the row is
        ``E4M3[bits[t, c]] * scales[t, c // g]`` with ``g = fp8_group`` (``contract.fp8``).
        ``layers`` None takes every captured layer stored as fp8 (``layer_ids`` says which: the
        post-norm state under ``storage.last_dtype=bf16`` is not); the post-norm state is
        included (``target_last_hidden_states``/``_scales``) when ``last`` and it is fp8.
        """
        if not any(d.is_fp8 for d in self._dtypes.values()):
            raise ValueError(f"{self.path} stores no fp8 states (storage dtype {self.storage_dtype}); use sample()")
        if layers is None:
            chosen = [lid for lid in self.layer_ids if self._dtypes[self._names[str(lid)]].is_fp8]
        else:
            chosen = self.check_layers(layers)
            other = [lid for lid in chosen if not self._dtypes[self._names[str(lid)]].is_fp8]
            if other:
                raise ValueError(f"layers {other} are stored as {self._dtypes[self._names[str(other[0])]]}, not fp8 "
                                 "(the post-norm state keeps storage.last_dtype); read them with sample()")
        s = self._resolve(i)
        a, n = int(self._start[s]), int(self._cut[s])
        layer_names = [self._names[str(lid)] for lid in chosen]
        last_name = self._names.get(LAST)
        with_last = last and last_name is not None and self._dtypes[last_name].is_fp8
        names = [*layer_names] + ([last_name] if with_last and last_name else [])
        got = self.chunks.read([INPUT_IDS, LOSS_MASK, *names, *(self._scales[nm] for nm in names)], a, a + n)

        def joined(arrays: list[np.ndarray], dtype: Any) -> np.ndarray:
            return np.concatenate(arrays, axis=1) if arrays else np.zeros((n, 0), dtype=dtype)

        out: dict[str, Any] = {
            "input_ids": got[INPUT_IDS], "loss_mask": got[LOSS_MASK], "layer_ids": chosen,
            "fp8_group": self.manifest.fp8_group or self.hidden_size,
            "target_hidden_states": joined([got[nm] for nm in layer_names], np.uint8),
            "target_hidden_scales": joined([got[self._scales[nm]] for nm in layer_names], np.float32),
        }
        if with_last and last_name:
            out["target_last_hidden_states"] = got[last_name]
            out["target_last_hidden_scales"] = got[self._scales[last_name]]
        return out

    def sample(self, i: int, layers: Sequence[int] | None = None, *, as_numpy: bool = False,
               last: bool = True, pre_norm: bool = False) -> dict[str, Any]:
        """Sample ``i``: input_ids, loss_mask, target_hidden_states (chosen layers), last state.

        ``layers`` picks a subset (and order) of the captured layer ids; only their arrays'
        chunks are read. ``last=False`` skips the post-norm state, ``pre_norm=True`` adds the
        pre-norm one. Torch output (training) keeps the storage dtype (bf16/fp16/fp32; fp8
        dequantized to bf16) with int64 ids and mask, as NeMo does; ``as_numpy=True``
        (notebooks) gives float32 for bf16 caches, numpy having no bf16. An image cache of a multi-axis rotary model
        adds ``position_ids`` (int64 [T, axes]: the positions its forward used, what the draft's rotary needs).
        """
        raw = self.read_raw(i, layers, last=last, pre_norm=pre_norm)
        ids = raw["input_ids"].astype(np.int64)
        mask = raw["loss_mask"].astype(np.int64)
        pos = {POSITION_IDS: raw[POSITION_IDS].astype(np.int64)} if POSITION_IDS in raw else {}
        dtypes = {"target_hidden_states": self.output_dtype, "target_last_hidden_states": self.last_output_dtype,
                  PRE_NORM_KEY: self.last_output_dtype}
        floats: dict[str, np.ndarray] = {k: raw[k] for k in dtypes if k in raw}
        if as_numpy:
            floats = {k: bf16_bits_to_float32(v) if dtypes[k] is StorageDtype.bf16 else v for k, v in floats.items()}
            return {"input_ids": ids, "loss_mask": mask, **floats, **pos}
        return {"input_ids": torch.from_numpy(ids), "loss_mask": torch.from_numpy(mask),
                **{k: to_torch(v, dtypes[k]) for k, v in floats.items()},
                **{k: torch.from_numpy(v) for k, v in pos.items()}}

    def target_weights(self) -> dict[str, torch.Tensor]:
        """``embed_tokens.weight`` (+ ``lm_head.weight`` when untied) from the cache's weights file.

        The file's sha256 must equal the manifest's ``weights_sha256`` (:class:`ChecksumError`
        otherwise; caches written before it was recorded are read unchecked) and its tensors
        must have the manifest's shapes (:class:`CacheFormatError`).
        """
        from safetensors.torch import load as st_load

        if not self.store.exists(WEIGHTS):
            raise CacheFormatError(f"{self.path}: {WEIGHTS} is missing; training and export need the target's "
                                   "embedding and lm_head. Re-run the precompute job with the same command to "
                                   "rewrite it.")
        blob = self.store.read_bytes(WEIGHTS)
        want = self.manifest.weights_sha256
        if want is not None:
            got = hashlib.sha256(blob).hexdigest()
            if got != want:
                raise ChecksumError(WEIGHTS, file=f"{self.path}/{WEIGHTS}",
                                    detail=f"its sha256 is {got}, the manifest records {want}")
        try:
            tensors = st_load(blob)
        except Exception as exc:  # safetensors raises its own error types
            raise CacheFormatError(f"{self.path}/{WEIGHTS} cannot be read ({exc}); re-run the precompute "
                                   "job") from exc
        problems = weights_problems({k: tuple(v.shape) for k, v in tensors.items()}, self.manifest)
        if problems:
            raise CacheFormatError(listing(f"{self.path}/{WEIGHTS} does not fit the manifest", problems,
                                           "Re-create the cache."))
        return tensors

    # -- description -----------------------------------------------------------------------
    def lengths(self) -> np.ndarray:
        """Tokens per readable sample (int32; at most ``max_length``)."""
        return np.asarray(self._cut[self.indices].astype(np.int32))

    def stored_lengths(self) -> np.ndarray:
        """Tokens the cache stores for the samples this view could read, uncut and dropped ones included (int32)."""
        return np.asarray(self._length[self._stored].astype(np.int32))

    def starts(self) -> np.ndarray:
        """First token slot of each readable sample (int64): sort by it to read in disk order."""
        return np.asarray(self._start[self.indices])

    def units(self) -> np.ndarray:
        """The commit unit of each readable sample (int64): what ``verify --repair`` marks and a run rewrites."""
        return np.asarray(self._unit[self.indices])

    def untruncated_lengths(self) -> np.ndarray:
        return np.asarray(self._untruncated[self.indices])

    def _supervised_within(self, ids: np.ndarray) -> np.ndarray:
        """Supervised tokens of samples ``ids`` within their (cut) lengths, from the stored masks (one pass per
        unit, a bounded window of ``loss_mask`` at a time; never the hidden states)."""
        counts = np.zeros(len(self._start), dtype=np.int64)
        members = self._unit[ids]
        window = max(self.chunk_tokens, _MASK_WINDOW // self.chunk_tokens * self.chunk_tokens)
        for u in np.unique(members):
            mine = ids[members == u]
            s0 = self._start[mine].astype(np.int64)
            s1 = s0 + self._cut[mine]
            u0, u1 = int(self.chunks.unit_start[u]), int(self.chunks.unit_stop[u])
            for w0 in range(u0, u1, window):
                w1 = min(w0 + window, u1)
                mask = self.chunks.read([LOSS_MASK], w0, w1)[LOSS_MASK]
                csum = np.concatenate([[0], np.cumsum(mask, dtype=np.int64)])
                lo, hi = np.clip(s0 - w0, 0, w1 - w0), np.clip(s1 - w0, 0, w1 - w0)
                counts[mine] += csum[hi] - csum[lo]
        return np.asarray(counts[ids])

    def supervised_counts(self) -> np.ndarray:
        """Supervised (loss_mask=1) tokens per readable sample, from the stored masks."""
        if self._supervised is None:
            self._supervised = self._supervised_within(self.indices)
        return self._supervised

    def rejects(self) -> dict[str, Any]:
        """Input rows that did not become samples: counts, share and counts per reason."""
        return summary.rejects(self)

    def summary(self) -> dict[str, Any]:
        """What is in the cache and what it costs on disk (for ``info`` and notebooks; walks the store)."""
        return summary.summary(self)

    def describe(self) -> str:
        """The summary as a few aligned lines of text (``dspark-cache info``, ``print(c.describe())``)."""
        return summary.describe(self)

    def __repr__(self) -> str:
        """What is in hand (no store walk: ``summary()`` lists every file, which a repr must not)."""
        tokens = int(self.lengths().sum())
        sup = f"{self.manifest.counts.supervised_tokens / max(1, tokens):.1%} supervised, " \
            if self.complete and self.max_length is None else ""
        r = self.rejects()
        cut = f", cut at {self.max_length}" if self.max_length else ""
        return (f"<dspark cache {self.path!r}: {len(self)} samples, {tokens} tokens ({sup}{r['rejected']} of "
                f"{r['rows_in']} rows rejected), layers {self.layer_ids} x {self.hidden_size}, {self.storage_dtype}"
                + cut + ("" if self.complete else ", INCOMPLETE") + ">")

    # -- re-opening in another process (DataLoader workers) ---------------------------------
    def _fingerprint(self) -> str:
        """What a re-opened handle must find unchanged: identity, layout and the sample tables."""
        h = hashlib.sha256()
        m = self.manifest
        keep = {"config_hash": m.config_hash, "created_at": m.created_at, "layout": dataclasses.asdict(m.layout),
                "arrays": m.arrays, "max_length": self.max_length}
        h.update(json.dumps(keep, sort_keys=True).encode())
        for t in (self._start, self._length, self._unit, self._source_row):
            h.update(np.ascontiguousarray(t).tobytes())
        return h.hexdigest()

    def handle_state(self) -> dict[str, Any]:
        """A small picklable description from which :meth:`reopen` rebuilds this very view elsewhere."""
        units = None if self.complete else sorted({int(u) for u in self._unit[self.indices]})
        return {"path": self.path, "chunk_cache_bytes": self.chunks.lru.max_bytes, "complete": self.complete,
                "units": units, "samples": len(self), "fingerprint": self._fingerprint(),
                "max_length": self.max_length}

    @classmethod
    def reopen(cls, state: dict[str, Any]) -> CacheReader:
        """Open the cache of ``state`` (from :meth:`handle_state`) afresh: the same samples under the same indices.

        Refuses (:class:`CacheFormatError`) a cache rewritten or repaired since: a worker
        must never read different samples under the indices its parent handed out.
        """
        units = state["units"]
        fresh = cls(state["path"], allow_incomplete=True, chunk_cache_bytes=state["chunk_cache_bytes"],
                    max_length=state.get("max_length"), _units=units)
        if fresh._fingerprint() != state["fingerprint"]:
            raise CacheFormatError(f"{state['path']} changed since it was opened (it was re-created or its tables "
                                   "rewritten): samples would not be the ones the opening process indexed. Open it "
                                   "again (restart the DataLoader or training job).")
        lost = sorted(set(units) - committed_units(fresh.store, fresh.num_units)) if units is not None and not \
            fresh.manifest.complete else []
        if lost:
            raise CacheFormatError(f"{state['path']}: units {lost[:10]} were readable when the cache was opened and "
                                   "have no commit record now (marked for repair?); open it again once the "
                                   "precompute run has rewritten them.")
        if len(fresh) != state["samples"]:
            raise CacheFormatError(f"{state['path']}: {len(fresh)} samples are readable now, {state['samples']} "
                                   "were when it was opened; open it again.")
        return fresh

    def __getstate__(self) -> dict[str, Any]:
        return self.handle_state()

    def __setstate__(self, state: dict[str, Any]) -> None:
        fresh = CacheReader.reopen(state)
        fresh._finalizer.detach()  # its resources become this object's
        self.__dict__.update(fresh.__dict__)
        self._finalizer = weakref.finalize(self, _shutdown, self._owned)


def _shutdown(owned: dict[str, Any]) -> None:
    """What a reader owns, released when it is garbage-collected without :meth:`CacheReader.close`."""
    owned["chunks"].release()
    owned["opened"].close()


def open_cache(path: str | Path, allow_incomplete: bool = False,
               chunk_cache_bytes: int = DEFAULT_CHUNK_CACHE_BYTES, max_length: int | None = None) -> CacheReader:
    """Open a cache written by ``python -m dspark_precompute`` (a local path or fsspec URL).

    An unfinished cache raises :class:`IncompleteCacheError` unless ``allow_incomplete``;
    ``chunk_cache_bytes`` bounds the decoded chunks kept for reuse (0 disables it);
    ``max_length`` cuts every sample at that many tokens and drops those left with no
    supervised token (``c.cut_dropped`` counts them). A cache whose manifest, array metadata or
    tables are inconsistent raises :class:`CacheFormatError` listing every problem.
    """
    return CacheReader(path, allow_incomplete=allow_incomplete, chunk_cache_bytes=chunk_cache_bytes,
                       max_length=max_length)


Cache = CacheReader  # the name before 0.2
