"""Read a cache: ``open_cache(path)[i]`` -> one sample's tensors, no padding.

Depends only on the format module, the store, zarr, numpy and torch (never on
transformers), so training jobs and notebooks can read caches without the target.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from dspark_precompute import format as fmt
from dspark_precompute.errors import CacheFormatError, ChecksumError, IncompleteCacheError
from dspark_precompute.store import CacheStore

_CRC_RE = re.compile(r"checksum", re.IGNORECASE)


def _to_torch(a: np.ndarray, logical: str) -> torch.Tensor:
    if logical == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a))


class Cache:
    """A read-only view of one cache (``len``, ``c[i]``, ``c[a:b]``, ``c[[i, j]]``)."""

    def __init__(self, path: str, allow_incomplete: bool = False):
        import zarr

        self.store = CacheStore(path)
        self.path = self.store.path
        if not self.store.exists(fmt.MANIFEST):
            raise CacheFormatError(f"{path}: no {fmt.MANIFEST}; this is not a dspark-precompute cache")
        try:
            self.manifest: dict[str, Any] = json.loads(self.store.read_bytes(fmt.MANIFEST))
        except json.JSONDecodeError as exc:
            raise CacheFormatError(f"{path}/{fmt.MANIFEST} is not valid JSON: {exc}") from exc
        problems = fmt.manifest_problems(self.manifest)
        if problems:
            raise CacheFormatError(f"{path}: " + "; ".join(problems))
        self.complete = bool(self.manifest["complete"])
        if not self.complete and not allow_incomplete:
            raise IncompleteCacheError(
                f"{path} is incomplete ({self._committed_fraction()} units committed): the precompute run has "
                "not finished. Re-run it with the same command to finish, or open_cache(..., "
                "allow_incomplete=True) to read the committed samples only."
            )
        self.group = zarr.open_group(self.store.zarr_store(read_only=True), mode="r")
        self.layer_ids: list[int] = list(self.manifest["layer_ids"])
        self.hidden_size = int(self.manifest["hidden_size"])
        self.storage_dtype = self.manifest["storage_dtype"]
        self.logical_dtype = fmt.STORAGE_DTYPES[self.storage_dtype][1]
        self._names: dict[str, str] = self.manifest["arrays"]
        self._arrays: dict[str, Any] = {}
        self.chunk_tokens = int(self.manifest["layout"]["chunk_tokens"])
        self._start = self._table("samples/start")
        self._length = self._table("samples/length")
        self.source_row = self._table("samples/source_row")
        units = self._table("samples/unit")
        if self.complete:
            self.indices = np.arange(len(self._start))
        else:
            committed = {int(k.rsplit("u", 1)[1].split(".")[0]) for k in self.store.list_keys(fmt.COMMITS)}
            self.indices = np.flatnonzero(np.isin(units, sorted(committed)))

    def _committed_fraction(self) -> str:
        n = len(self.store.list_keys(fmt.COMMITS))
        return f"{n}/{self.manifest.get('layout', {}).get('num_units', '?')}"

    def _table(self, name: str) -> np.ndarray:
        return self._read(name, slice(None))

    def _array(self, name: str) -> Any:
        if name not in self._arrays:
            self._arrays[name] = self.group[name]
        return self._arrays[name]

    def _read(self, name: str, sel: Any) -> np.ndarray:
        try:
            return np.asarray(self._array(name)[sel])
        except ValueError as exc:
            if _CRC_RE.search(str(exc)):
                if isinstance(sel, slice) and sel.start is not None:
                    c0, c1 = sel.start // self.chunk_tokens, max(sel.start, sel.stop - 1) // self.chunk_tokens
                    chunk: Any = (c0,) if c0 == c1 else f"one of {c0}..{c1}"
                else:
                    chunk = "unknown"
                raise ChecksumError(name, chunk, str(exc)) from None
            raise

    # -- sequence protocol --------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, key: int | slice | Sequence[int]) -> Any:
        if isinstance(key, slice):
            return [self.sample(i) for i in range(*key.indices(len(self)))]
        if isinstance(key, (list, tuple, np.ndarray)):
            return [self.sample(int(i)) for i in key]
        return self.sample(int(key))

    def __iter__(self):
        for i in range(len(self)):
            yield self.sample(i)

    def sample(self, i: int, layers: Sequence[int] | None = None, as_numpy: bool = False) -> dict[str, Any]:
        """Sample ``i``: input_ids, loss_mask, target_hidden_states (chosen layers), last state.

        ``layers`` picks a subset of the captured layer ids (only their arrays are read);
        ``as_numpy`` returns numpy arrays (bf16 as ``ml_dtypes``-free uint16 bits is avoided:
        floats come back as float32 for bf16 caches) for notebooks.
        """
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range for a cache of {len(self)} samples")
        s = int(self.indices[i])
        a, n = int(self._start[s]), int(self._length[s])
        sel = slice(a, a + n)
        chosen = self.layer_ids if layers is None else list(layers)
        missing = [lid for lid in chosen if lid not in self.layer_ids]
        if missing:
            raise KeyError(f"layers {missing} were not captured; this cache holds {self.layer_ids}")
        ids = self._read(fmt.INPUT_IDS, sel).astype(np.int64)
        mask = self._read(fmt.LOSS_MASK, sel).astype(np.int64)
        parts = {lid: self._read(self._names[str(lid)], sel) for lid in chosen}
        last_name = self._names["last"]
        last_lid = next((lid for lid in chosen if self._names[str(lid)] == last_name), None)
        last = parts[last_lid] if last_lid is not None else self._read(last_name, sel)
        hidden = np.concatenate([parts[lid] for lid in chosen], axis=1) if chosen else \
            np.zeros((n, 0), dtype=last.dtype)
        if as_numpy:
            conv = (lambda x: (x.astype(np.uint32) << 16).view(np.float32)) if self.logical_dtype == "bfloat16" \
                else (lambda x: x)
            return {"input_ids": ids, "loss_mask": mask, "target_hidden_states": conv(hidden),
                    "target_last_hidden_states": conv(last)}
        return {
            "input_ids": torch.from_numpy(ids),
            "loss_mask": torch.from_numpy(mask),
            "target_hidden_states": _to_torch(hidden, self.logical_dtype),
            "target_last_hidden_states": _to_torch(last, self.logical_dtype),
        }

    # -- description ----------------------------------------------------------------------
    def lengths(self) -> np.ndarray:
        return self._length[self.indices]

    def summary(self) -> dict[str, Any]:
        counts = self.manifest["counts"]
        on_disk = self.store.nbytes()
        raw = int(counts.get("tokens", 0)) * int(self.manifest.get("bytes_per_token", 0))
        return {
            "path": self.path,
            "complete": self.complete,
            "samples": len(self),
            "tokens": int(self.lengths().sum()),
            "supervised_fraction": (counts.get("supervised_tokens", 0) / max(1, counts.get("tokens", 0))),
            "layer_ids": self.layer_ids,
            "hidden_size": self.hidden_size,
            "target_hidden_dim": self.hidden_size * len(self.layer_ids),
            "dtype": self.storage_dtype,
            "bytes_on_disk": on_disk,
            "compression_ratio": (raw / on_disk) if on_disk else None,
            "target": self.manifest["identity"]["target"]["path"],
        }

    def __repr__(self) -> str:
        s = self.summary()
        return (
            f"<dspark cache {s['path']!r}: {s['samples']} samples, {s['tokens']} tokens "
            f"({s['supervised_fraction']:.1%} supervised), layers {s['layer_ids']} x {s['hidden_size']}, "
            f"{s['dtype']}, {s['bytes_on_disk'] / 1e6:.1f} MB on disk"
            + (f" ({s['compression_ratio']:.2f}x)" if s["compression_ratio"] else "")
            + ("" if s["complete"] else ", INCOMPLETE") + ">"
        )


def open_cache(path: str, allow_incomplete: bool = False) -> Cache:
    """Open a cache written by ``python -m dspark_precompute`` (a local path or fsspec URL)."""
    return Cache(str(path), allow_incomplete=allow_incomplete)
