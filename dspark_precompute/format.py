"""The on-disk format, owned in one place: version, names, dtypes, chunking, manifest.

A cache is one zarr v3 group::

    manifest.json                   identity, config hash, layout, counts, ``complete``
    target_weights.safetensors      embed_tokens.weight (+ lm_head.weight unless tied)
    rejects.jsonl                   one line per input row that did not become a sample
    commits/u000000.json ...        one file per committed unit (its data is whole)
    input_ids            int32  [token]            ragged: real tokens only, no padding
    loss_mask            uint8  [token]
    hidden_states/layer_{i}   [token, hidden]  per captured layer (``embeddings`` for -1);
                                 bf16 is stored as its uint16 bit pattern
    hidden_states/final_norm  [token, hidden]  only when N-1 is not a captured layer
    samples/start        int64  [sample]  first token slot of sample i
    samples/length       int32  [sample]  its number of tokens
    samples/source_row   int64  [sample]  its row in the input selection
    samples/unit         int32  [sample]  the unit that writes it
    samples/untruncated_length int32 [sample]
    units/token_start, units/token_stop  int64 [unit]

Sample ``i`` occupies ``[start[i], start[i] + length[i])`` on the token axis. Units own
whole chunks (each starts on a chunk boundary), so writers never share a chunk.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import numpy as np

FORMAT_NAME = "dspark-precompute-cache"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
WEIGHTS = "target_weights.safetensors"
REJECTS = "rejects.jsonl"
COMMITS = "commits"
INPUT_IDS = "input_ids"
LOSS_MASK = "loss_mask"
HIDDEN_GROUP = "hidden_states"
FINAL_NORM = "final_norm"
SAMPLE_ARRAYS = {
    "samples/start": np.int64,
    "samples/length": np.int32,
    "samples/source_row": np.int64,
    "samples/unit": np.int32,
    "samples/untruncated_length": np.int32,
}
UNIT_ARRAYS = {"units/token_start": np.int64, "units/token_stop": np.int64}

# storage dtype name -> (numpy dtype stored on disk, logical dtype name)
STORAGE_DTYPES = {
    "bf16": (np.uint16, "bfloat16"),
    "fp16": (np.float16, "float16"),
    "fp32": (np.float32, "float32"),
}
# manifest fields that say when and by which command a cache was written: they differ between
# an uninterrupted run and a resumed one that end with bit-identical data
TIMING_FIELDS = ("created_at", "updated_at", "completed_at", "timing", "provenance")
COORD = "coord"  # failure markers of a multi-rank job
HYDRA_RECORD = ".hydra"  # the Hydra record (composed config, overrides) of the run that wrote the cache
LOCK = ".writer.lock"

# Every top-level entry this tool ever writes into a cache directory. overwrite=true (and the
# restart of an allocation a kill interrupted) deletes exactly these, and only in a directory
# that holds nothing else.
OWN_ENTRIES = frozenset({
    "zarr.json", MANIFEST, WEIGHTS, REJECTS, COMMITS, COORD, HYDRA_RECORD, LOCK,
    INPUT_IDS, LOSS_MASK, HIDDEN_GROUP, "samples", "units",
})


def is_own_temporary(name: str) -> bool:
    """A temporary of an atomic write of one of our files (``.manifest.json.<random>.tmp``)."""
    return name.startswith(".") and name.endswith(".tmp") and any(
        name.startswith(f".{own}.") for own in OWN_ENTRIES)


def foreign_entries(names: list[str] | set[str]) -> list[str]:
    """The entries of a directory listing that this tool did not write, sorted."""
    return sorted(n for n in names if n not in OWN_ENTRIES and not is_own_temporary(n))


def layer_array(layer_id: int) -> str:
    return f"{HIDDEN_GROUP}/embeddings" if layer_id == -1 else f"{HIDDEN_GROUP}/layer_{layer_id}"


def hidden_arrays(layer_ids: list[int], num_layers: int) -> dict[str, str]:
    """Array name per captured layer, plus ``"last"``: the post-norm state (stored once)."""
    names = {str(lid): layer_array(lid) for lid in layer_ids}
    names["last"] = names[str(num_layers - 1)] if (num_layers - 1) in layer_ids else f"{HIDDEN_GROUP}/{FINAL_NORM}"
    return names


def commit_key(unit: int) -> str:
    return f"{COMMITS}/u{unit:06d}.json"


def parse_commit_key(key: str) -> int | None:
    """The unit of a commit record key (``commits/u000012.json`` -> 12); None for anything else."""
    stem = key.rsplit("/", 1)[-1]
    if stem.startswith("u") and stem.endswith(".json") and stem[1:-5].isdigit():
        return int(stem[1:-5])
    return None


def auto_chunk_tokens(hidden_size: int, itemsize: int, target_bytes: int = 1 << 20) -> int:
    """Largest power of two with a chunk of the widest array <= ``target_bytes``, in [512, 65536].

    About 1 MiB keeps random access to one short sample cheap (a read decompresses whole
    chunks); the floor of 512 tokens keeps the file count sane for wide targets (4 MiB
    chunks at hidden size 4096).
    """
    n = max(1, target_bytes // max(1, hidden_size * itemsize))
    p = 1 << (n.bit_length() - 1)
    return int(min(max(p, 512), 65536))


def bytes_per_token(hidden_size: int, itemsize: int, n_hidden_arrays: int) -> int:
    return n_hidden_arrays * hidden_size * itemsize + 4 + 1


@dataclass
class Layout:
    """Where every sample lives: computed from sample lengths alone, before any forward."""

    chunk_tokens: int
    unit_tokens: int
    start: np.ndarray  # int64 [n]
    length: np.ndarray  # int32 [n]
    unit: np.ndarray  # int32 [n]
    unit_start: np.ndarray  # int64 [u]
    unit_stop: np.ndarray  # int64 [u]
    unit_order: list[np.ndarray]  # per unit: sample ids in on-disk (longest-first) order

    @property
    def num_units(self) -> int:
        return len(self.unit_start)

    @property
    def total_slots(self) -> int:
        if not self.num_units:
            return 0
        return int(-(-int(self.unit_stop[-1]) // self.chunk_tokens) * self.chunk_tokens)

    def unit_slots(self, u: int) -> int:
        """Token slots unit ``u`` owns (its tokens rounded up to whole chunks)."""
        n = int(self.unit_stop[u] - self.unit_start[u])
        return int(-(-n // self.chunk_tokens) * self.chunk_tokens)


def plan_layout(lengths: np.ndarray, chunk_tokens: int, unit_tokens: int) -> Layout:
    """Sort samples longest first (ties by index), pack them into units of <= unit_tokens.

    Length-sorted units make every forward batch nearly padding-free; the per-sample
    ``start`` table keeps sample ``i`` addressable in O(1) whatever the disk order.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    n = len(lengths)
    order = np.lexsort((np.arange(n), -lengths))
    start = np.zeros(n, dtype=np.int64)
    unit = np.zeros(n, dtype=np.int32)
    unit_start, unit_stop, unit_order = [], [], []
    cursor = 0
    i = 0
    while i < n:
        members = []
        used = 0
        while i < n and (not members or used + lengths[order[i]] <= unit_tokens):
            s = order[i]
            start[s] = cursor + used
            unit[s] = len(unit_start)
            used += int(lengths[s])
            members.append(s)
            i += 1
        unit_start.append(cursor)
        unit_stop.append(cursor + used)
        unit_order.append(np.asarray(members, dtype=np.int64))
        cursor += -(-used // chunk_tokens) * chunk_tokens
    return Layout(chunk_tokens, unit_tokens, start, lengths.astype(np.int32), unit,
                  np.asarray(unit_start, dtype=np.int64), np.asarray(unit_stop, dtype=np.int64), unit_order)


def config_hash(identity: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: d}


def identity_differences(recorded: dict[str, Any], requested: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """Each hashed field that differs, as (dotted key, recorded value, requested value)."""
    a, b = flatten(recorded), flatten(requested)
    return [(k, a.get(k), b.get(k)) for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)]


def manifest_problems(manifest: Any) -> list[str]:
    """Cheap structural checks of a manifest dict (every problem, not just the first)."""
    if not isinstance(manifest, dict):
        return ["manifest.json is not a JSON object"]
    problems = []
    if manifest.get("format") != FORMAT_NAME:
        problems.append(f"manifest format is {manifest.get('format')!r}, expected {FORMAT_NAME!r}")
    if manifest.get("format_version") != FORMAT_VERSION:
        problems.append(
            f"format_version {manifest.get('format_version')!r} is not supported (this reader reads "
            f"{FORMAT_VERSION}); upgrade dspark-precompute or re-create the cache"
        )
    for key in ("config_hash", "identity", "layer_ids", "hidden_size", "storage_dtype", "arrays", "layout",
                "counts", "complete"):
        if key not in manifest:
            problems.append(f"manifest lacks {key!r}")
    if manifest.get("storage_dtype") not in (None, *STORAGE_DTYPES):
        problems.append(f"manifest storage_dtype {manifest.get('storage_dtype')!r} is unknown")
    return problems
