"""Allocating a cache, and writing what is known before the first forward.

:func:`allocate` creates the group and every array at its final shape (zarr writes the
metadata; format 2 token arrays are sharded, one shard per unit) and writes the sample/unit
tables. :func:`write_tokens` then writes ``input_ids`` and ``loss_mask`` (and an image cache's ``position_ids``) of
the given units,
one shard per unit, so a resumed run reads them back instead of tokenizing again, and returns
the digest of each shard as written (what binds it to its place: ``commits/tokens.json``, then
each unit's commit record). Every file
is made durable (fsync, and the directory after a rename) before the manifest that points at
it is written, unless ``storage.fsync=false``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

from dspark_precompute.contract.arrays import chunk_encoder, codec_chain
from dspark_precompute.contract.layout import Layout
from dspark_precompute.contract.shards import EncodedShard, encode_shard
from dspark_precompute.contract.spec import (
    IMAGE_ARRAYS,
    INPUT_IDS,
    KEY_SEPARATOR,
    LOSS_MASK,
    MAX_TABLE_CHUNK_ROWS,
    POSITION_IDS,
    UNIT_ARRAYS,
    VIDEO_ARRAYS,
)
from dspark_precompute.contract.store import CacheStore, fsync_dir
from dspark_precompute.faults import fault_point
from dspark_precompute.write.config.schema import StorageConfig
from dspark_precompute.write.plan.array_specs import ArraySpec, array_codec

KEY_ENCODING: dict[str, Any] = {"name": "default", "separator": KEY_SEPARATOR}


def shard_key(name: str, unit: int, two_d: bool) -> str:
    """The key of unit ``unit``'s shard of array ``name`` (``hidden_states/layer_3/c.12.0``, ``input_ids/c.12``)."""
    return f"{name}/c{KEY_SEPARATOR}{unit}" + (f"{KEY_SEPARATOR}0" if two_d else "")


def encode_unit_shard(rows: np.ndarray, chunk: int, chunks_per_shard: int,
                      encode: Callable[[np.ndarray], tuple[Any, bytes]]) -> EncodedShard:
    """The parts of one unit's shard: ``rows`` (whole chunks, the unit's used slots) as inner chunks, then the index;
    each chunk is encoded as it is written. Once written, its ``digest`` is what was written."""
    return encode_shard((encode(rows[k:k + chunk]) for k in range(0, len(rows), chunk)), chunks_per_shard)


def _attributes(s: ArraySpec) -> dict[str, Any]:
    attrs: dict[str, Any] = {"logical_dtype": s.logical_dtype or s.dtype}
    if s.layer_id is not None:
        attrs["layer_id"] = s.layer_id
    if s.final is not None:
        attrs["final_state"] = s.final
    if s.scale is not None:
        attrs["scale_array"] = s.scale
    if s.scale_of is not None:
        attrs.update(scale_of=s.scale_of, channels_per_scale=s.group)
    return attrs


def _width_name(s: ArraySpec) -> str:
    return "axis" if s.name == POSITION_IDS else "scale" if s.scale_of else "hidden"


def _table_dims(name: str, values: np.ndarray) -> tuple[str, ...]:
    """A table's dimension names: ``unit``, ``sample`` or (the images/* tables) ``image`` and its row."""
    if name in IMAGE_ARRAYS or name in VIDEO_ARRAYS:
        row = "image" if name in IMAGE_ARRAYS else "video"
        return (row,) if values.ndim == 1 else (row, "thw" if values.shape[1] == 3 else "byte")
    return ("unit",) if name in UNIT_ARRAYS else ("sample",)


def _metadata_keys(root: Path) -> list[Path]:
    return sorted(root.rglob("zarr.json"))


def allocate(store: CacheStore, specs: list[ArraySpec], layout: Layout, storage: StorageConfig,
             tables: dict[str, np.ndarray], attributes: dict[str, Any]) -> None:
    """Create the group and every array at its final shape, and write the sample/unit tables (durably)."""
    import zarr

    group = zarr.create_group(store.zarr_store(), overwrite=False, attributes=attributes)
    total, chunk, unit = layout.total_slots, layout.chunk_tokens, layout.unit_tokens
    for i, s in enumerate(specs):
        if i == 2:
            fault_point("allocate")
        width = () if s.width is None else (s.width,)
        group.create_array(
            s.name, shape=(total, *width), chunks=(chunk, *width), shards=(unit, *width), dtype=s.dtype,
            fill_value=s.fill, compressors=codec_chain(*array_codec(storage, s)), chunk_key_encoding=KEY_ENCODING,
            dimension_names=("token",) if s.width is None else ("token", _width_name(s)),
            attributes=_attributes(s))
    tables = {**tables, "units/token_start": layout.unit_start, "units/token_stop": layout.unit_stop}
    for name, values in tables.items():
        values = np.ascontiguousarray(values)
        rows = max(1, min(len(values), MAX_TABLE_CHUNK_ROWS))
        codec = (storage.compressor, storage.compression_level, storage.shuffle, values.dtype.itemsize)
        width = values.shape[1:]
        group.create_array(name, shape=values.shape, chunks=(rows, *width), dtype=values.dtype, fill_value=0,
                           compressors=codec_chain(*codec), chunk_key_encoding=KEY_ENCODING,
                           dimension_names=_table_dims(name, values))
        encode = chunk_encoder(*codec)
        for k in range(0, len(values), rows):
            block = np.zeros((rows, *width), dtype=values.dtype)  # zarr stores an edge chunk whole, fill-padded
            block[:len(values[k:k + rows])] = values[k:k + rows]
            key = f"{name}/c{KEY_SEPARATOR}{k // rows}" + f"{KEY_SEPARATOR}0" * len(width)
            store.write_parts(key, list(encode(block)), storage.fsync)
    if storage.fsync and not store.url:  # zarr wrote the metadata without fsync: make it durable
        root = Path(store.root)
        for meta in _metadata_keys(root):
            with open(meta, "rb") as fh:
                os.fsync(fh.fileno())
        for d in sorted({p.parent for p in _metadata_keys(root)} | {root}, key=lambda p: -len(p.parts)):
            fsync_dir(d)


def write_tokens(store: CacheStore, layout: Layout, storage: StorageConfig, specs: list[ArraySpec],
                 samples: Any, units: Iterable[int]) -> tuple[int, dict[int, dict[str, str]]]:
    """``input_ids``, ``loss_mask`` (and ``position_ids``, where stored) of ``units``: one shard each, from
    ``samples[s]`` (an Encoded); the bytes written and, per unit, each array's shard digest (hex) as written.

    Slots past a unit's last token (inside its last chunk) hold 0; inner chunks past it are
    absent from the shard.
    """
    chunk, per = layout.chunk_tokens, layout.unit_tokens // layout.chunk_tokens
    by_name = {s.name: s for s in specs}
    axes = int(by_name[POSITION_IDS].width or 0) if POSITION_IDS in by_name else 0
    names = (INPUT_IDS, LOSS_MASK, *((POSITION_IDS,) if axes else ()))
    encoders = {name: chunk_encoder(*array_codec(storage, by_name[name])) for name in names}
    written = 0
    digests: dict[int, dict[str, str]] = {}
    for u in units:
        base, n = int(layout.unit_start[u]), int(layout.unit_stop[u] - layout.unit_start[u])
        n_slots = -(-n // chunk) * chunk
        rows: dict[str, np.ndarray] = {INPUT_IDS: np.zeros(n_slots, dtype=np.int32),
                                       LOSS_MASK: np.zeros(n_slots, dtype=np.uint8)}
        if axes:
            rows[POSITION_IDS] = np.zeros((n_slots, axes), dtype=np.int32)
        for s in layout.unit_order[u]:
            a = int(layout.start[s]) - base
            enc = samples[int(s)]
            rows[INPUT_IDS][a:a + len(enc.input_ids)] = enc.input_ids
            rows[LOSS_MASK][a:a + len(enc.loss_mask)] = enc.loss_mask
            if axes:  # a text sample: the model's positions of a text row, the same count on every axis
                pos = enc.position_ids
                rows[POSITION_IDS][a:a + len(enc.input_ids)] = pos if pos is not None else np.arange(
                    len(enc.input_ids), dtype=np.int32)[:, None]
        digests[int(u)] = {}
        for name, values in rows.items():
            shard = encode_unit_shard(values, chunk, per, encoders[name])
            written += store.write_parts(shard_key(name, u, two_d=values.ndim == 2), shard, storage.fsync)
            digests[int(u)][name] = shard.digest.hex()
        fault_point("tokens_unit")
    return written, digests
