"""Whole padded batches built straight from decoded chunks, one buffer per batch.

The per-sample path (``CacheDataset`` + ``collate``) copies every token three times
(chunk -> sample arrays -> padded batch -> the pipe to the training process) and sends a
DataLoader worker's batch as many small tensors. Here a batch is laid out in one buffer
(``input_ids``, ``attention_mask``, ``loss_mask``, then the hidden states, each 64-byte
aligned) and every token is copied once, from its decoded chunk to its place in the batch:

* ``memory="shared"`` (a DataLoader worker): the buffer is an anonymous shared-memory file
  (``memfd``; never named in ``/dev/shm``, so a killed job leaves nothing behind). The
  batch then reaches the training process as one file descriptor, with no copy.
* ``memory="pinned"``: page-locked, for asynchronous host-to-device copies (CUDA).
* ``memory="plain"``: ordinary memory.

Fresh shared and plain buffers read as zeros, so only ``input_ids`` pads are written;
pinned buffers are recycled by torch's host allocator and every pad is written.
The batches equal what ``collate`` makes of ``CacheDataset`` items (tested).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dspark_precompute.contract.fp8 import convert
from dspark_precompute.contract.spec import INPUT_IDS, LOSS_MASK, disk_dtype
from dspark_precompute.read.arena import BatchArena, SharedBatch, views
from dspark_precompute.read.dataset import BATCH_KEYS
from dspark_precompute.read.reader import CacheReader
from dspark_precompute.tensors import torch_dtype

MEMORY_KINDS = ("plain", "shared", "pinned")
_ALIGN = 64

RawSource = Callable[[list[tuple[str, int]]], list[bytes | None]]  # chunk jobs -> their stored bytes, in order


def _shared_storage(nbytes: int) -> tuple[torch.UntypedStorage, bool]:
    """Anonymous shared memory of ``nbytes`` (zero-filled): a memfd where the platform has one."""
    make = getattr(torch.UntypedStorage, "_new_shared_fd_cpu", None)
    memfd = getattr(os, "memfd_create", None)
    strategy = torch.multiprocessing.get_sharing_strategy()  # type: ignore[no-untyped-call]  # unannotated in torch
    if make is not None and memfd is not None and strategy == "file_descriptor":
        fd = memfd("dspark-batch", getattr(os, "MFD_CLOEXEC", 0))
        try:
            os.ftruncate(fd, max(1, nbytes))
            return make(fd, max(1, nbytes)), True  # the storage owns the descriptor from here on
        except BaseException:
            os.close(fd)
            raise
    return torch.UntypedStorage._new_shared(max(1, nbytes)), True  # type: ignore[no-untyped-call]  # torch's own (named, unlinked at once)


def _buffer(nbytes: int, memory: str) -> tuple[torch.Tensor, bool]:
    """A flat uint8 tensor of ``nbytes`` and whether it is known to read as zeros."""
    if memory == "shared":
        storage, zeroed = _shared_storage(nbytes)
        return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (nbytes,), (1,)), zeroed
    if memory == "pinned":
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), False
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)), True  # calloc: the kernel's zero pages


def _zero(a: np.ndarray) -> None:
    """Zero a contiguous array with memset: about twice as fast as numpy's ``a[...] = 0`` on batch-sized pads."""
    if a.size:
        assert a.flags.c_contiguous
        ctypes.memset(a.ctypes.data, 0, a.nbytes)


@dataclass(frozen=True)
class _Field:
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


class BatchAssembler:
    """Builds NeMo-shaped padded batches for lists of readable sample indices of one opened cache.

    ``layers`` picks (and orders) the captured layers in ``target_hidden_states``;
    ``pad_to`` / ``pad_to_multiple_of`` fix or round the padded length as ``collate`` does.
    """

    def __init__(self, reader: CacheReader, layers: Sequence[int] | None = None, pad_to: int | None = None,
                 pad_to_multiple_of: int | None = None):
        self.reader = reader
        chosen = reader.check_layers(layers)
        names = reader.array_names
        self.layer_names = [names[str(lid)] for lid in chosen]
        if "last" not in names:
            raise ValueError(f"{reader.path} stores no post-norm state (capture.last_state=pre_norm), which batches "
                             "carry as target_last_hidden_states; read it with sample(..., pre_norm=True) instead")
        self.last_name = names["last"]
        m = reader.manifest
        # each hidden array's storage dtype and scale array (fp8): converted to the output dtype as copied
        self.stored = {nm: m.array_dtypes[nm] for nm in [*self.layer_names, self.last_name]}
        self.scales = {nm: m.scale_arrays[nm] for nm in self.stored if nm in m.scale_arrays}
        self.arrays = list(dict.fromkeys([INPUT_IDS, LOSS_MASK, *self.layer_names, self.last_name,
                                          *self.scales.values()]))
        self.hidden = int(reader.hidden_size)
        self.out = {"target_hidden_states": reader.output_dtype, "target_last_hidden_states": reader.last_output_dtype}
        self.pad_id = int(reader.pad_token_id)
        self.pad_to = None if pad_to is None else int(pad_to)
        self.pad_to_multiple_of = None if not pad_to_multiple_of else int(pad_to_multiple_of)
        self.ct = int(reader.chunk_tokens)
        self._starts = reader.starts().astype(np.int64)
        self._lengths = reader.lengths().astype(np.int64)
        # a batch's buffer layout depends on its row count and width alone: worked out once per shape
        self._layouts: dict[tuple[int, int], tuple[list[_Field], int, tuple[tuple[str, str, tuple[int, ...], int, int],
                                                                          ...]]] = {}
        self._itemsize = {dt: torch.empty(0, dtype=dt).element_size()
                          for dt in (torch.int64, *(torch_dtype(d) for d in self.out.values()))}

    # -- what a batch needs ------------------------------------------------------------------
    def width(self, batch: Sequence[int]) -> int:
        longest = int(self._lengths[np.asarray(batch, dtype=np.int64)].max())
        width = longest if self.pad_to is None else self.pad_to
        if longest > width:
            raise ValueError(f"a sample has {longest} tokens but pad_to={self.pad_to}; raise pad_to to at least "
                             f"{longest} (the cache's seq_length bounds every sample) or leave it None to pad to "
                             "the longest")
        if self.pad_to_multiple_of:
            width = -(-width // self.pad_to_multiple_of) * self.pad_to_multiple_of
        return width

    def rows(self, batch: Sequence[int]) -> list[int]:
        """Chunk numbers (along the token axis) holding the batch's tokens, in order of first use."""
        out: dict[int, None] = {}
        for i in batch:
            a, n = int(self._starts[i]), int(self._lengths[i])
            for c in range(a // self.ct, (a + n - 1) // self.ct + 1):
                out[c] = None
        return list(out)

    def jobs(self, batches: Sequence[Sequence[int]]) -> list[tuple[str, int]]:
        """Every chunk ``(array, number)`` the batches read, in the order :meth:`build` decodes them."""
        seen: set[int] = set()
        out: list[tuple[str, int]] = []
        for batch in batches:
            fresh = [c for c in self.rows(batch) if c not in seen]
            seen.update(fresh)
            out += [(name, c) for c in fresh for name in self.arrays]
        return out

    def layout(self, b: int, width: int) -> tuple[list[_Field], int]:
        fields, total, _ = self._layout(b, width)
        return fields, total

    def _layout(self, b: int, width: int) -> tuple[list[_Field], int, tuple[tuple[str, str, tuple[int, ...], int, int],
                                                                            ...]]:
        """The fields of a ``b`` x ``width`` batch in its buffer, the buffer's size, and the fields as described to
        :func:`~dspark_precompute.read.arena.views` (kept per shape: every batch of a shape is laid out alike)."""
        known = self._layouts.get((b, width))
        if known is not None:
            return known
        h, nl = self.hidden, len(self.layer_names)
        fields: list[tuple[str, torch.dtype, tuple[int, ...]]] = [
            (k, torch.int64, (b, width)) for k in ("input_ids", "attention_mask", "loss_mask")]
        fields += [("target_hidden_states", torch_dtype(self.out["target_hidden_states"]), (b, width, nl * h)),
                   ("target_last_hidden_states", torch_dtype(self.out["target_last_hidden_states"]), (b, width, h))]
        out, off = [], 0
        for key, dtype, shape in fields:
            nbytes = int(np.prod(shape)) * self._itemsize[dtype]
            out.append(_Field(key, dtype, shape, off, nbytes))
            off += -(-nbytes // _ALIGN) * _ALIGN
        described = tuple((f.key, str(f.dtype), f.shape, f.offset, f.nbytes) for f in out)
        if len(self._layouts) >= 4096:
            self._layouts.clear()
        self._layouts[(b, width)] = (out, off, described)
        return out, off, described

    # -- building ----------------------------------------------------------------------------
    def nbytes(self, batch: Sequence[int]) -> int:
        """The size of ``batch``'s buffer."""
        return self._layout(len(batch), self.width(batch))[1]

    def build(self, batches: Sequence[Sequence[int]], memory: str = "plain", raws: RawSource | None = None,
              threads: bool = True, arena: BatchArena | None = None,
              offsets: Sequence[int | None] | None = None) -> list[dict[str, torch.Tensor] | SharedBatch]:
        """The padded batches for ``batches`` (lists of readable indices), in order.

        Each chunk is decoded once for all the batches given (kept until its last batch is
        built, then let go at once; not through the reader's LRU); ``raws`` supplies the stored
        bytes of the chunks, in :meth:`jobs` order, when they were fetched ahead (object storage).
        A batch with an offset in ``offsets`` is written into that extent of ``arena``: tensors
        in the process that owns the arena, a :class:`SharedBatch` to send it in any other (a
        worker); the others go to fresh ``memory``.
        """
        if memory not in MEMORY_KINDS:
            raise ValueError(f"memory={memory!r} is not one of {MEMORY_KINDS}")
        n = len(self._lengths)
        for b in batches:
            if len(b) == 0:
                raise ValueError("a batch holds no sample; a sampler yielded an empty batch")
            ids = np.asarray(b, dtype=np.int64)
            if int(ids.min()) < 0 or int(ids.max()) >= n:
                raise IndexError(f"batch {list(b)[:8]} names samples outside [0, {n}): this cache has {n} readable "
                                 "samples; the sampler was built for another cache")
        rows = [self.rows(b) for b in batches]
        last_use: dict[int, int] = {}
        for k, rs in enumerate(rows):
            for c in rs:
                last_use[c] = k
        decoded: dict[tuple[str, int], np.ndarray] = {}

        def need(jobs: list[tuple[str, int]]) -> None:
            todo = [job for job in jobs if job not in decoded]
            if todo:
                # no LRU: a chunk is kept here until its last batch, and the LRU's copies would keep
                # its buffer from going back to the pool while it is still in the CPU's cache
                got = self.reader.chunks.decoded(todo, raws=None if raws is None else raws(todo), threads=threads,
                                                 reuse=False)
                decoded.update(zip(todo, got))

        out = []
        for k, batch in enumerate(batches):
            if threads:  # every chunk of the batch at once, on the decode threads
                need([(name, c) for c in rows[k] for name in self.arrays])
            off = None if offsets is None else offsets[k]

            def used(c: int, k: int = k) -> None:  # chunk c's last use: let its buffers go back to the pool
                if last_use[c] == k:
                    for name in self.arrays:
                        decoded.pop((name, c), None)

            out.append(self._one(batch, decoded, need, used, memory, None if off is None else arena, off))
        return out

    def _one(self, batch: Sequence[int], decoded: dict[tuple[str, int], np.ndarray],
             need: Callable[[list[tuple[str, int]]], None], used: Callable[[int], None], memory: str,
             arena: BatchArena | None = None, offset: int | None = None) -> dict[str, torch.Tensor] | SharedBatch:
        b, width = len(batch), self.width(batch)
        fields, total, described = self._layout(b, width)
        if arena is not None and offset is not None:
            flat, zeroed = arena.array(offset, total), False
        else:
            buf, zeroed = _buffer(total, memory)
            flat = buf.numpy()
        arrays = {}
        for f in fields:
            dt = np.dtype(np.int64) if f.dtype == torch.int64 else disk_dtype(self.out[f.key])  # bits, no casts
            arrays[f.key] = flat[f.offset:f.offset + f.nbytes].view(dt).reshape(f.shape)
        self._pads(batch, arrays, zeroed)
        self._fill(batch, arrays, decoded, need, used)
        if arena is not None and offset is not None:
            return views(arena.tensor(offset, total), described) if arena.mine else SharedBatch(
                arena.id, offset, total, described)
        tensors = views(buf, described)
        return {k: tensors[k] for k in BATCH_KEYS}

    def _pads(self, batch: Sequence[int], arrays: dict[str, np.ndarray], zeroed: bool) -> None:
        """Each row's attention mask and pads (every pad unless the buffer is known to read as zeros)."""
        ids, att, mask = arrays["input_ids"], arrays["attention_mask"], arrays["loss_mask"]
        hid, last = arrays["target_hidden_states"], arrays["target_last_hidden_states"]
        for r, i in enumerate(batch):
            n = int(self._lengths[i])
            att[r, :n] = 1
            ids[r, n:] = self.pad_id
            if not zeroed:
                for pads in (att[r, n:], mask[r, n:], hid[r, n:], last[r, n:]):
                    _zero(pads)

    def _fill(self, batch: Sequence[int], arrays: dict[str, np.ndarray], decoded: dict[tuple[str, int], np.ndarray],
              need: Callable[[list[tuple[str, int]]], None], used: Callable[[int], None]) -> None:
        """Every token of ``batch`` copied once, chunk by chunk: a chunk is decoded (unless it is in hand),
        copied to every row that holds part of it while it is still in the CPU's cache, then let go after its
        last use."""
        ids, mask = arrays["input_ids"], arrays["loss_mask"]
        hid, last = arrays["target_hidden_states"], arrays["target_last_hidden_states"]
        h, ct = self.hidden, self.ct
        where: dict[int, list[tuple[int, int, int]]] = {}  # chunk -> (row, first slot, length) of its samples
        for r, i in enumerate(batch):
            a, n = int(self._starts[i]), int(self._lengths[i])
            for c in range(a // ct, (a + n - 1) // ct + 1):
                where.setdefault(c, []).append((r, a, n))
        for c, holders in where.items():
            need([(name, c) for name in self.arrays])
            for r, a, n in holders:
                lo, hi = max(a, c * ct), min(a + n, (c + 1) * ct)
                src, dst = slice(lo - c * ct, hi - c * ct), slice(lo - a, hi - a)
                ids[r, dst] = decoded[(INPUT_IDS, c)][src]
                mask[r, dst] = decoded[(LOSS_MASK, c)][src]
                for j, name in enumerate(self.layer_names):
                    hid[r, dst, j * h:(j + 1) * h] = self._states(decoded, name, c, src, "target_hidden_states")
                last[r, dst] = self._states(decoded, self.last_name, c, src, "target_last_hidden_states")
            used(c)

    def _states(self, decoded: dict[tuple[str, int], np.ndarray], name: str, c: int, src: slice,
                key: str) -> np.ndarray:
        """Rows ``src`` of chunk ``c`` of hidden array ``name`` in ``key``'s dtype (fp8 dequantized, as the
        reader does: ``contract.fp8``); the stored block itself when the dtypes agree."""
        scale = decoded[(self.scales[name], c)][src] if name in self.scales else None
        return convert(decoded[(name, c)][src], self.stored[name], self.out[key], scale)
