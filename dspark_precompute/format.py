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
import math
from dataclasses import dataclass
from typing import Any, NamedTuple

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


# -- what a reader accepts ------------------------------------------------------------------
# A cache's own metadata sizes every allocation a reader makes (a chunk, a sample, a padded
# export row), so values past these bounds are refused before anything is read. They are
# far above anything the writer produces for a real target.
MAX_SEQ_LENGTH = 1 << 24          # tokens in one sample
MAX_HIDDEN_SIZE = 1 << 17
MAX_NUM_LAYERS = 1 << 16
MAX_CHUNK_TOKENS = 1 << 24
MAX_CHUNK_BYTES = 1 << 30         # one decoded chunk of the widest array
MAX_SAMPLE_BYTES = 1 << 36        # one sample padded to seq_length, every array (what an export row holds)
MAX_TOKEN_SLOTS = 1 << 48
MAX_TABLE_CHUNK_ROWS = 1 << 20    # the writer's sample/unit table chunk
MAX_VOCAB_SIZE = 1 << 31
TOKEN_ARRAYS = {INPUT_IDS: np.int32, LOSS_MASK: np.uint8}
COMPRESSORS = ("blosc", "zstd")   # between ``bytes`` and ``crc32c``; none is fine too
_HEX = frozenset("0123456789abcdef")
_LISTED = 3  # examples named per problem


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _kind(v: Any) -> str:
    return {bool: "a boolean", int: "an integer", str: "a string", float: "a float", list: "a list",
            dict: "an object", type(None): "null"}.get(type(v), type(v).__name__)


def _int_problem(where: str, v: Any, lo: int, hi: int, what: str) -> str | None:
    if not _is_int(v):
        return f"manifest {where} = {v!r} ({_kind(v)}) must be an integer in [{lo}, {hi}] ({what})"
    if not lo <= int(v) <= hi:
        return f"manifest {where} = {int(v)} is outside [{lo}, {hi}] ({what})"
    return None


def _examples(ids: np.ndarray, describe: Any, limit: int = _LISTED) -> str:
    ids = np.asarray(ids)
    shown = "; ".join(describe(int(i)) for i in ids[:limit])
    return shown + (f"; and {len(ids) - limit} more" if len(ids) > limit else "")


def manifest_problems(manifest: Any) -> list[str]:
    """Every problem with a manifest's structure, field types and ranges (not just the first).

    Everything a reader takes from the manifest is checked here: types (an int is an int,
    not a bool, float or string), ranges (the bounds above), the array names against the
    naming rule (:func:`hidden_arrays`), and the counts and layout against each other.
    An empty list means the values are safe to compute with; the tables and arrays are
    checked against them by :func:`table_problems` and :func:`array_meta_problems`.
    """
    if not isinstance(manifest, dict):
        return [f"manifest.json is not a JSON object (it holds {_kind(manifest)}); it is damaged or not a "
                "dspark-precompute manifest"]
    problems = []
    if manifest.get("format") != FORMAT_NAME:
        problems.append(f"manifest format is {manifest.get('format')!r}, expected {FORMAT_NAME!r}")
    if manifest.get("format_version") != FORMAT_VERSION:
        problems.append(
            f"format_version {manifest.get('format_version')!r} is not supported (this reader reads "
            f"{FORMAT_VERSION}); upgrade dspark-precompute or re-create the cache"
        )
    for key in ("config_hash", "identity", "layer_ids", "hidden_size", "storage_dtype", "arrays", "layout",
                "counts", "complete", "seq_length", "num_hidden_layers", "target_model", "target_model_type",
                "target_vocab_size", "chat_template"):
        if key not in manifest:
            problems.append(f"manifest lacks {key!r}")
    if manifest.get("storage_dtype") not in (None, *STORAGE_DTYPES):
        problems.append(f"manifest storage_dtype {manifest.get('storage_dtype')!r} is unknown "
                        f"(one of {sorted(STORAGE_DTYPES)})")

    def check_int(where: str, v: Any, lo: int, hi: int, what: str) -> bool:
        p = _int_problem(where, v, lo, hi, what)
        if p:
            problems.append(p)
        return p is None

    def typed(where: str, v: Any, types: type | tuple[type, ...], what: str) -> bool:
        if not isinstance(v, types):
            problems.append(f"manifest {where} = {v!r:.80} ({_kind(v)}) must be {what}")
            return False
        return True

    if "config_hash" in manifest:
        typed("config_hash", manifest["config_hash"], str, "a string (the sha256 of the identity)")
    if "complete" in manifest:
        typed("complete", manifest["complete"], bool, "true or false")
    identity = manifest.get("identity")
    if "identity" in manifest and typed("identity", identity, dict, "an object"):
        target = identity.get("target")
        if typed("identity.target", target, dict, "an object"):
            typed("identity.target.path", target.get("path"), str, "a string (the target's path or name)")
        data = identity.get("data")
        if typed("identity.data", data, dict, "an object"):
            for k in ("path", "split", "shuffle_seed", "mask_reasoning_content"):
                if k not in data:
                    problems.append(f"manifest identity.data lacks {k!r}")
    for key in ("target_model", "target_model_type", "chat_template"):
        if key in manifest:
            typed(key, manifest[key], str, "a string")
    if "tied_embeddings" in manifest:
        typed("tied_embeddings", manifest["tied_embeddings"], bool, "true or false")
    if "target_vocab_size" in manifest:
        check_int("target_vocab_size", manifest["target_vocab_size"], 1, MAX_VOCAB_SIZE, "the target's vocabulary")
    for key in ("pad_token_id", "eos_token_id"):
        if manifest.get(key) is not None:
            check_int(key, manifest[key], 0, MAX_VOCAB_SIZE, "a token id, or null")
    sha = manifest.get("weights_sha256")
    if "weights_sha256" in manifest and not (isinstance(sha, str) and len(sha) == 64 and set(sha) <= _HEX):
        problems.append(f"manifest weights_sha256 = {sha!r:.80} must be 64 lowercase hex digits (the sha256 of "
                        f"{WEIGHTS})")

    hidden_ok = "hidden_size" in manifest and check_int("hidden_size", manifest["hidden_size"], 1, MAX_HIDDEN_SIZE,
                                                        "width of every hidden-state array")
    layers_ok = "num_hidden_layers" in manifest and check_int(
        "num_hidden_layers", manifest["num_hidden_layers"], 1, MAX_NUM_LAYERS, "decoder layers of the target")
    seq_ok = "seq_length" in manifest and check_int("seq_length", manifest["seq_length"], 1, MAX_SEQ_LENGTH,
                                                    "longest sample, in tokens")
    dtype_ok = manifest.get("storage_dtype") in STORAGE_DTYPES

    ids = manifest.get("layer_ids")
    ids_ok = False
    if "layer_ids" in manifest and typed("layer_ids", ids, list, "a list of layer ids"):
        if not ids:
            problems.append("manifest layer_ids is empty: a cache captures at least one layer")
        elif not all(_is_int(i) for i in ids):
            problems.append(f"manifest layer_ids = {ids!r:.80} must be integers")
        elif any(b <= a for a, b in zip(ids, ids[1:])):
            problems.append(f"manifest layer_ids = {ids} must be strictly increasing")
        elif layers_ok and not all(-1 <= i < int(manifest["num_hidden_layers"]) for i in ids):
            problems.append(f"manifest layer_ids = {ids} must lie in [-1, num_hidden_layers - 1 = "
                            f"{int(manifest['num_hidden_layers']) - 1}]")
        else:
            ids_ok = layers_ok

    arrays = manifest.get("arrays")
    arrays_ok = False
    if "arrays" in manifest and typed("arrays", arrays, dict, "an object of layer id -> array name"):
        for k, v in arrays.items():
            if not isinstance(v, str) or not v.startswith(f"{HIDDEN_GROUP}/") or ".." in v or "\\" in v \
                    or v.count("/") != 1:
                problems.append(f"manifest arrays[{k!r}] = {v!r:.80} is not an array under {HIDDEN_GROUP}/ (names "
                                f"are {HIDDEN_GROUP}/layer_<i>, {HIDDEN_GROUP}/embeddings or "
                                f"{HIDDEN_GROUP}/{FINAL_NORM}); the manifest was altered")
        if ids_ok and not problems:
            want = hidden_arrays([int(i) for i in ids], int(manifest["num_hidden_layers"]))
            for k in sorted(want.keys() | arrays.keys()):
                if arrays.get(k) != want.get(k):
                    problems.append(
                        f"manifest arrays[{k!r}] = {arrays.get(k)!r}, but the naming rule gives {want.get(k)!r} "
                        f"for layer_ids {list(ids)} of {manifest['num_hidden_layers']} layers: the manifest was "
                        "altered (layers would be read under the wrong id). Re-create the cache")
            arrays_ok = not any(arrays.get(k) != want.get(k) for k in want.keys() | arrays.keys())

    layout = manifest.get("layout")
    layout_ok = False
    if "layout" in manifest and typed("layout", layout, dict, "an object"):
        ok = True
        for k, lo, hi, what in (("chunk_tokens", 1, MAX_CHUNK_TOKENS, "tokens per chunk"),
                                ("unit_tokens", 1, MAX_TOKEN_SLOTS, "tokens per commit unit"),
                                ("num_units", 0, MAX_TOKEN_SLOTS, "commit units"),
                                ("total_token_slots", 0, MAX_TOKEN_SLOTS, "length of the token axis")):
            if k not in layout:
                problems.append(f"manifest lacks layout.{k}")
                ok = False
            else:
                ok = check_int(f"layout.{k}", layout[k], lo, hi, what) and ok
        if ok:
            ct, total, nu = int(layout["chunk_tokens"]), int(layout["total_token_slots"]), int(layout["num_units"])
            layout_ok = True
            if total % ct:
                problems.append(f"manifest layout.total_token_slots = {total} is not a multiple of "
                                f"layout.chunk_tokens = {ct} (units own whole chunks)")
                layout_ok = False
            if (nu == 0) != (total == 0) or nu > total:
                problems.append(f"manifest layout.num_units = {nu} cannot fill layout.total_token_slots = {total}")
                layout_ok = False
            if hidden_ok and dtype_ok:
                itemsize = np.dtype(STORAGE_DTYPES[manifest["storage_dtype"]][0]).itemsize
                chunk_bytes = ct * int(manifest["hidden_size"]) * itemsize
                if chunk_bytes > MAX_CHUNK_BYTES:
                    problems.append(
                        f"manifest layout.chunk_tokens = {ct} x hidden_size = {manifest['hidden_size']} x {itemsize} "
                        f"bytes makes {chunk_bytes:,}-byte chunks, more than a reader decodes at once "
                        f"({MAX_CHUNK_BYTES:,}); the manifest is damaged or the cache was not written by this tool")
                    layout_ok = False

    if hidden_ok and dtype_ok and seq_ok and isinstance(ids, list):
        itemsize = np.dtype(STORAGE_DTYPES[manifest["storage_dtype"]][0]).itemsize
        per_sample = int(manifest["seq_length"]) * bytes_per_token(int(manifest["hidden_size"]), itemsize,
                                                                   len(ids) + 1)
        if per_sample > MAX_SAMPLE_BYTES:
            problems.append(
                f"manifest seq_length = {manifest['seq_length']} x hidden_size = {manifest['hidden_size']} makes one "
                f"padded sample {per_sample:,} bytes, more than a reader allocates for one sample "
                f"({MAX_SAMPLE_BYTES:,}); the manifest is damaged")
    if hidden_ok and dtype_ok and arrays_ok and "bytes_per_token" in manifest:
        itemsize = np.dtype(STORAGE_DTYPES[manifest["storage_dtype"]][0]).itemsize
        want_bpt = bytes_per_token(int(manifest["hidden_size"]), itemsize, len(set(arrays.values())))
        if manifest["bytes_per_token"] != want_bpt:
            problems.append(f"manifest bytes_per_token = {manifest['bytes_per_token']!r}, the arrays it names store "
                            f"{want_bpt} bytes per token")
    if hidden_ok and isinstance(ids, list):
        for key, want in (("target_hidden_dim", int(manifest["hidden_size"]) * len(ids)),
                          ("target_last_hidden_dim", int(manifest["hidden_size"]))):
            if key in manifest and manifest[key] != want:
                problems.append(f"manifest {key} = {manifest[key]!r}, hidden_size x layers gives {want}")

    counts = manifest.get("counts")
    if "counts" in manifest and typed("counts", counts, dict, "an object"):
        got = {}
        for k in ("rows_in", "samples", "rejected", "tokens", "supervised_tokens", "truncated_samples"):
            if k not in counts:
                problems.append(f"manifest lacks counts.{k}")
            elif check_int(f"counts.{k}", counts[k], 0, MAX_TOKEN_SLOTS, "a count"):
                got[k] = int(counts[k])
        by = counts.get("rejected_by_reason", {})
        if typed("counts.rejected_by_reason", by, dict, "an object of reason -> rows"):
            if all(_int_problem("", v, 0, MAX_TOKEN_SLOTS, "") is None for v in by.values()):
                if "rejected" in got and sum(int(v) for v in by.values()) != got["rejected"] and by:
                    problems.append(f"manifest counts.rejected_by_reason sums to {sum(int(v) for v in by.values())}, "
                                    f"counts.rejected is {got['rejected']}")
            else:
                problems.append(f"manifest counts.rejected_by_reason = {by!r:.120} must map reasons to row counts")
        if {"rows_in", "samples", "rejected"} <= got.keys() and got["rows_in"] != got["samples"] + got["rejected"]:
            problems.append(f"manifest counts.rows_in = {got['rows_in']}, but samples + rejected = "
                            f"{got['samples'] + got['rejected']} (every input row is a sample or a reject)")
        if {"tokens", "samples"} <= got.keys() and not got["samples"] <= got["tokens"]:
            problems.append(f"manifest counts.tokens = {got['tokens']} is below counts.samples = {got['samples']} "
                            "(every sample has a token)")
        if {"tokens", "samples"} <= got.keys() and seq_ok and got["tokens"] > got["samples"] * int(
                manifest["seq_length"]):
            problems.append(f"manifest counts.tokens = {got['tokens']} exceeds samples x seq_length")
        if {"tokens", "supervised_tokens"} <= got.keys() and got["supervised_tokens"] > got["tokens"]:
            problems.append(f"manifest counts.supervised_tokens = {got['supervised_tokens']} exceeds counts.tokens = "
                            f"{got['tokens']}")
        if {"truncated_samples", "samples"} <= got.keys() and got["truncated_samples"] > got["samples"]:
            problems.append(f"manifest counts.truncated_samples = {got['truncated_samples']} exceeds counts.samples")
        if layout_ok and "samples" in got:
            nu, total = int(layout["num_units"]), int(layout["total_token_slots"])
            if not nu <= got["samples"] <= total or (got["samples"] == 0) != (nu == 0):
                problems.append(f"manifest counts.samples = {got['samples']} does not fit layout.num_units = {nu} "
                                f"and layout.total_token_slots = {total}")
            if "tokens" in got and got["tokens"] > total:
                problems.append(f"manifest counts.tokens = {got['tokens']} exceeds layout.total_token_slots = {total}")
    return problems


# -- the arrays' own metadata (their zarr.json) ----------------------------------------------
@dataclass(frozen=True)
class ArrayMeta:
    """What a reader needs to find and decode one array's chunks, from a checked zarr.json."""

    name: str
    dtype: np.dtype          # little-endian
    shape: tuple[int, ...]
    chunks: tuple[int, ...]
    compressor: str | None   # "blosc", "zstd" or None (bytes -> [compressor] -> crc32c)
    separator: str
    v2_keys: bool

    @property
    def chunk_nbytes(self) -> int:
        return math.prod(self.chunks) * self.dtype.itemsize

    @property
    def num_chunks(self) -> int:
        """Chunks along the token (or sample) axis; the other axis is always one chunk."""
        return -(-self.shape[0] // self.chunks[0]) if self.shape[0] else 0

    def chunk_index(self, c: int) -> tuple[int, ...]:
        return (c,) + (0,) * (len(self.shape) - 1)

    def chunk_key(self, idx: tuple[int, ...]) -> str:
        """The chunk's key relative to the array (``c/3/0`` with zarr v3's default encoding)."""
        parts = [str(i) for i in idx]
        return self.separator.join(parts) if self.v2_keys else self.separator.join(["c", *parts])

    def max_stored_bytes(self) -> int:
        """The largest a stored chunk can be: incompressible data plus codec framing and the crc."""
        return self.chunk_nbytes + self.chunk_nbytes // 8 + (1 << 16)


class ExpectedArray(NamedTuple):
    """What the manifest implies for one array; ``chunks`` is None for a table (any row count up to a bound)."""

    dtype: np.dtype
    shape: tuple[int, ...]
    chunks: tuple[int, ...] | None
    attrs: dict[str, Any]
    shape_from: str  # the manifest fields the shape comes from, for messages


def expected_arrays(manifest: dict[str, Any]) -> dict[str, ExpectedArray]:
    """Every array a cache must hold, by name. Only call this on a manifest :func:`manifest_problems` accepts."""
    layout, hidden = manifest["layout"], int(manifest["hidden_size"])
    total, ct = int(layout["total_token_slots"]), int(layout["chunk_tokens"])
    disk, logical = STORAGE_DTYPES[manifest["storage_dtype"]]
    out: dict[str, ExpectedArray] = {}
    for name, dt in TOKEN_ARRAYS.items():
        out[name] = ExpectedArray(np.dtype(dt), (total,), (ct,), {"logical_dtype": np.dtype(dt).name},
                                  "layout.total_token_slots")
    layer_of = {v: int(k) for k, v in manifest["arrays"].items() if k != "last"}
    for name in dict.fromkeys(manifest["arrays"].values()):
        lid = layer_of.get(name, int(manifest["num_hidden_layers"]) - 1)  # final_norm: the post-norm state
        out[name] = ExpectedArray(np.dtype(disk), (total, hidden), (ct, hidden),
                                  {"logical_dtype": logical, "layer_id": lid},
                                  "layout.total_token_slots x hidden_size")
    n, units = int(manifest["counts"]["samples"]), int(layout["num_units"])
    for name, dt in SAMPLE_ARRAYS.items():
        out[name] = ExpectedArray(np.dtype(dt), (n,), None, {}, "counts.samples")
    for name, dt in UNIT_ARRAYS.items():
        out[name] = ExpectedArray(np.dtype(dt), (units,), None, {}, "layout.num_units")
    return out


def array_meta_problems(name: str, meta: Any, want: ExpectedArray) -> tuple[ArrayMeta | None, list[str]]:
    """Check one array's zarr.json against what the manifest implies; the parsed meta when it passes.

    The codec chain must be one the writer writes (``bytes`` little-endian, then ``blosc``,
    ``zstd`` or nothing, then ``crc32c``): the reader decodes exactly that and nothing else.
    """
    dtype, shape, chunks, attrs, shape_from = want
    where = f"array {name!r} ({name}/zarr.json)"
    if not isinstance(meta, dict):
        return None, [f"{where} is not a JSON object; the array's metadata is damaged"]
    problems: list[str] = []
    if meta.get("zarr_format") != 3 or meta.get("node_type") != "array":
        problems.append(f"{where} is not zarr v3 array metadata (zarr_format={meta.get('zarr_format')!r}, "
                        f"node_type={meta.get('node_type')!r})")
    if meta.get("data_type") != dtype.name:
        problems.append(f"{where} has data_type {meta.get('data_type')!r}, the manifest implies {dtype.name!r}")
    got_shape = meta.get("shape")
    if not (isinstance(got_shape, list) and all(_is_int(x) for x in got_shape)) or tuple(got_shape) != shape:
        problems.append(f"{where} has shape {got_shape!r:.80}, the manifest implies {list(shape)} ({shape_from})")
    grid = meta.get("chunk_grid")
    got_chunks = grid.get("configuration", {}).get("chunk_shape") if isinstance(grid, dict) and isinstance(
        grid.get("configuration"), dict) else None
    if not isinstance(grid, dict) or grid.get("name") != "regular" or not isinstance(got_chunks, list) or not all(
            _is_int(x) for x in got_chunks) or len(got_chunks) != len(shape):
        problems.append(f"{where} has chunk grid {grid!r:.120}, expected a regular grid of {len(shape)} dimension(s)")
        got_chunks = None
    elif chunks is not None and tuple(got_chunks) != chunks:
        problems.append(f"{where} has chunk shape {got_chunks}, the manifest implies {list(chunks)} "
                        "(layout.chunk_tokens[, hidden_size])")
    elif chunks is None and not 1 <= int(got_chunks[0]) <= MAX_TABLE_CHUNK_ROWS:
        problems.append(f"{where} has chunk shape {got_chunks}, outside [1, {MAX_TABLE_CHUNK_ROWS}] rows")
    enc = meta.get("chunk_key_encoding")
    sep, v2 = "/", False
    if isinstance(enc, dict) and enc.get("name") in ("default", "v2"):
        v2 = enc["name"] == "v2"
        conf = enc.get("configuration") or {}
        sep = conf.get("separator", "." if v2 else "/") if isinstance(conf, dict) else None
        if sep not in ("/", "."):
            problems.append(f"{where} has chunk key separator {sep!r}, expected '/' or '.'")
    else:
        problems.append(f"{where} has chunk key encoding {enc!r:.80}, expected zarr's 'default'")
    if meta.get("storage_transformers") not in (None, []):
        problems.append(f"{where} has storage transformers {meta.get('storage_transformers')!r:.80}; this tool "
                        "never writes any")
    compressor, chain_problem = _codec_chain(meta.get("codecs"), dtype)
    if chain_problem:
        problems.append(f"{where} {chain_problem}")
    got_attrs = meta.get("attributes") or {}
    if not isinstance(got_attrs, dict):
        problems.append(f"{where} attributes are not an object")
    else:
        for k, v in attrs.items():
            if got_attrs.get(k) != v:
                problems.append(f"{where} has attribute {k}={got_attrs.get(k)!r}, the manifest implies {v!r}"
                                + (": the array holds another layer than the manifest names" if k == "layer_id"
                                   else ""))
    if problems:
        return None, problems
    parsed = ArrayMeta(name, dtype.newbyteorder("<"), shape, tuple(int(x) for x in got_chunks), compressor, sep, v2)
    if parsed.chunk_nbytes > MAX_CHUNK_BYTES:
        return None, [f"{where} has {parsed.chunk_nbytes:,}-byte chunks, more than a reader decodes at once "
                      f"({MAX_CHUNK_BYTES:,})"]
    return parsed, []


def _codec_chain(codecs: Any, dtype: np.dtype) -> tuple[str | None, str | None]:
    """(compressor, None) for a chain the writer writes, else (None, why not)."""
    names = [c.get("name") if isinstance(c, dict) else repr(c) for c in codecs] if isinstance(codecs, list) else None
    writes = "bytes (little-endian) -> blosc|zstd|none -> crc32c"
    if names is None:
        return None, f"has codecs {codecs!r:.80}, expected a list ({writes})"
    unknown = [n for n in names if n not in ("bytes", "crc32c", *COMPRESSORS)]
    if unknown:
        return None, (f"uses codec {unknown[0]!r}, which this tool never writes (its chain is {writes}); a reader "
                      "would not decode it. The cache was altered or written by something else: re-create it")
    if len(names) not in (2, 3) or names[0] != "bytes" or names[-1] != "crc32c" or (
            len(names) == 3 and names[1] not in COMPRESSORS):
        return None, f"has codec chain {' -> '.join(names)}, which this tool never writes (it writes {writes})"
    conf = codecs[0].get("configuration") or {}
    endian = conf.get("endian") if isinstance(conf, dict) else "?"
    if endian not in ("little", None) or (endian is None and dtype.itemsize > 1):
        return None, f"stores {endian!r}-endian bytes; this tool writes little-endian ({writes})"
    return (names[1] if len(names) == 3 else None), None


def compressed_size_problem(compressor: str | None, body: bytes | memoryview | np.ndarray, expected: int) -> str | None:
    """Why a chunk's compressed body cannot decode to exactly ``expected`` bytes (from its header), or None.

    Checked before decompressing into a buffer of ``expected`` bytes, so a crafted header
    can neither make a reader allocate what it claims nor decode to a short chunk.
    """
    b = bytes(body[:32])
    if compressor is None:
        n = len(body)
        return None if n == expected else f"holds {n:,} bytes, a chunk of this array is {expected:,}"
    if compressor == "blosc":
        if len(b) < 16:
            return f"is {len(body)} bytes, shorter than a blosc header"
        nbytes, cbytes = int.from_bytes(b[4:8], "little"), int.from_bytes(b[12:16], "little")
        if nbytes != expected:
            return f"has a blosc header declaring {nbytes:,} decompressed bytes, a chunk of this array is {expected:,}"
        if cbytes != len(body):
            return f"has a blosc header declaring {cbytes:,} compressed bytes, the chunk holds {len(body):,}"
        return None
    if compressor == "zstd":
        size = _zstd_content_size(b)
        if size is None:
            return "has no zstd frame header with a content size"
        if size != expected:
            return f"has a zstd frame declaring {size:,} decompressed bytes, a chunk of this array is {expected:,}"
        return None
    return f"uses compressor {compressor!r}, which this tool never writes"


def _zstd_content_size(b: bytes) -> int | None:
    """Frame_Content_Size of a zstd frame (RFC 8878 3.1.1.1), or None when absent or not zstd."""
    if len(b) < 6 or b[:4] != b"\x28\xb5\x2f\xfd":
        return None
    fhd = b[4]
    fcs_flag, single, dict_flag = fhd >> 6, (fhd >> 5) & 1, fhd & 3
    pos = 5 + (0 if single else 1) + (0, 1, 2, 4)[dict_flag]
    size = (1 if single else 0, 2, 4, 8)[fcs_flag]
    if size == 0 or len(b) < pos + size:
        return None
    value = int.from_bytes(b[pos:pos + size], "little")
    return value + 256 if size == 2 else value


# -- the sample and unit tables ---------------------------------------------------------------
def table_problems(manifest: dict[str, Any], tables: dict[str, np.ndarray]) -> list[str]:
    """Every way the sample/unit tables disagree with the manifest or with :func:`plan_layout`.

    Vectorised (a sort, no per-sample Python): lengths within ``[1, seq_length]``,
    ``untruncated_length >= length``, source rows increasing, each unit's samples tiling
    ``[units/token_start, units/token_stop)`` with no gap or overlap, units starting on
    chunk boundaries in order, the disk order being exactly ``plan_layout``'s (longest
    first, ties by sample index, greedy packing under ``unit_tokens``), and the counts.
    Only call this on a manifest :func:`manifest_problems` accepts.
    """
    layout, counts = manifest["layout"], manifest["counts"]
    ct, ut = int(layout["chunk_tokens"]), int(layout["unit_tokens"])
    nu, total, seq = int(layout["num_units"]), int(layout["total_token_slots"]), int(manifest["seq_length"])
    n = int(counts["samples"])
    p: list[str] = []
    for name in SAMPLE_ARRAYS:
        if len(tables[name]) != n:
            p.append(f"table {name} has {len(tables[name])} rows, manifest counts.samples is {n}")
    for name in UNIT_ARRAYS:
        if len(tables[name]) != nu:
            p.append(f"table {name} has {len(tables[name])} rows, manifest layout.num_units is {nu}")
    if p:
        return p
    start, length = tables["samples/start"].astype(np.int64), tables["samples/length"].astype(np.int64)
    unit, untrunc = tables["samples/unit"].astype(np.int64), tables["samples/untruncated_length"].astype(np.int64)
    source = tables["samples/source_row"].astype(np.int64)
    us, ue = tables["units/token_start"].astype(np.int64), tables["units/token_stop"].astype(np.int64)

    bad = np.flatnonzero((length < 1) | (length > seq))
    if len(bad):
        p.append(f"samples/length: {len(bad)} sample(s) outside [1, seq_length={seq}]: "
                 + _examples(bad, lambda i: f"sample {i} has length {length[i]}"))
    bad = np.flatnonzero(untrunc < length)
    if len(bad):
        p.append(f"samples/untruncated_length: {len(bad)} sample(s) shorter than stored: "
                 + _examples(bad, lambda i: f"sample {i} has {untrunc[i]} < length {length[i]}"))
    bad = np.flatnonzero((unit < 0) | (unit >= nu))
    if len(bad):
        p.append(f"samples/unit: {len(bad)} sample(s) name no unit in [0, {nu}): "
                 + _examples(bad, lambda i: f"sample {i} has unit {unit[i]}"))
    rows_in = int(counts["rows_in"])
    bad = np.flatnonzero((source < 0) | (source >= max(rows_in, 1)) | np.r_[False, np.diff(source) <= 0])
    if len(bad):
        p.append(f"samples/source_row: {len(bad)} value(s) out of order or outside [0, counts.rows_in={rows_in}) "
                 "(samples are stored in input order): " + _examples(bad, lambda i: f"sample {i} has row {source[i]}"))
    if p:
        return p

    if nu:
        bad = np.flatnonzero((us % ct != 0) | (ue <= us))
        if len(bad):
            p.append(f"units/token_start, units/token_stop: {len(bad)} unit(s) not starting on a chunk boundary of "
                     f"{ct} tokens or empty: " + _examples(bad, lambda u: f"unit {u} spans [{us[u]}, {ue[u]})"))
        slots = -(-ue // ct) * ct
        want_start = np.r_[0, slots[:-1]]
        bad = np.flatnonzero(us != want_start)
        if len(bad) and not p:
            p.append(f"units/token_start: {len(bad)} unit(s) not packed in order after the previous unit's chunks: "
                     + _examples(bad, lambda u: f"unit {u} starts at {us[u]}, expected {want_start[u]}"))
        if not p and int(slots[-1]) != total:
            p.append(f"layout.total_token_slots = {total}, but the units end at token slot {int(slots[-1])}")
    if p:
        return p

    order = np.argsort(start)  # the one sort: everything below is a pass over neighbours
    ss, sl, su = start[order], length[order], unit[order]
    if n:
        if (np.diff(su) < 0).any():
            k = int(np.flatnonzero(np.diff(su) < 0)[0])
            p.append(f"samples/unit, samples/start: units are not in token order: sample {order[k]} (unit {su[k]}) "
                     f"lies before sample {order[k + 1]} (unit {su[k + 1]})")
            return p
        members = np.bincount(unit, minlength=nu)
        bad = np.flatnonzero(members == 0)
        if len(bad):
            p.append(f"samples/unit: {len(bad)} unit(s) hold no sample: " + _examples(bad, lambda u: f"unit {u}"))
            return p
        first = np.r_[True, su[1:] != su[:-1]]
        last = np.r_[su[1:] != su[:-1], True]
        bad = np.flatnonzero(first & (ss != us[su]))
        if len(bad):
            p.append(f"samples/start: {len(bad)} unit(s) whose first sample does not start at units/token_start: "
                     + _examples(bad, lambda k: f"sample {order[k]} starts at {ss[k]}, its unit {su[k]} at {us[su[k]]}"))
        bad = np.flatnonzero(~first[1:] & (ss[1:] != ss[:-1] + sl[:-1]))
        if len(bad):
            p.append(f"samples/start, samples/length: {len(bad)} gap(s) or overlap(s) between neighbouring samples "
                     "(a sample would read another's tokens): "
                     + _examples(bad, lambda k: f"sample {order[k]} ends at {ss[k] + sl[k]}, sample {order[k + 1]} "
                                               f"starts at {ss[k + 1]}"))
        bad = np.flatnonzero(last & (ss + sl != ue[su]))
        if len(bad):
            p.append(f"samples/length, units/token_stop: {len(bad)} unit(s) whose last sample does not end at "
                     "units/token_stop: " + _examples(bad, lambda k: f"sample {order[k]} ends at {ss[k] + sl[k]}, "
                                                                    f"unit {su[k]} at {ue[su[k]]}"))
        if p:
            return p
        # disk order must be plan_layout's: length descending, ties by sample index ascending
        in_order = (sl[:-1] > sl[1:]) | ((sl[:-1] == sl[1:]) & (order[:-1] < order[1:]))
        if not in_order.all():
            want = np.lexsort((np.arange(n), -length))
            bad = np.flatnonzero(order != want)
            k = int(bad[0])
            p.append(f"samples/start: the disk order is not the layout of the recorded lengths (longest first, ties "
                     f"by sample index): token slot {ss[k]} holds sample {order[k]} (length {length[order[k]]}) where "
                     f"the layout puts sample {want[k]} (length {length[want[k]]}); {len(bad)} sample(s) are out of "
                     "place, so they would read other samples' tokens. The offset table was altered: re-create the "
                     "cache")
            return p
        size = ue - us
        bad = np.flatnonzero((size > ut) & (members > 1))
        if len(bad):
            p.append(f"units: {len(bad)} unit(s) hold more than layout.unit_tokens = {ut} tokens in several samples: "
                     + _examples(bad, lambda u: f"unit {u} holds {size[u]}"))
        nxt = sl[first][1:]
        bad = np.flatnonzero(size[:-1] + nxt <= ut)
        if len(bad):
            p.append("units: the samples are not packed as the layout packs them (a unit stops although the next "
                     f"sample fits in layout.unit_tokens = {ut}): " + _examples(bad, lambda u: f"unit {u}"))
    for key, got in (("tokens", int(length.sum())), ("truncated_samples", int((untrunc > length).sum()))):
        if int(counts[key]) != got:
            p.append(f"manifest counts.{key} = {counts[key]}, the tables give {got}")
    return p


class SampleIndex:
    """Which samples hold token slots ``[a, b)`` (to name the samples a damaged chunk carries)."""

    def __init__(self, start: np.ndarray, length: np.ndarray):
        self.order = np.argsort(start, kind="stable")
        self.start = np.asarray(start, dtype=np.int64)[self.order]
        self.end = self.start + np.asarray(length, dtype=np.int64)[self.order]

    def in_range(self, a: int, b: int) -> np.ndarray:
        hi = np.searchsorted(self.start, b, side="left")
        lo = np.searchsorted(self.end, a, side="right")  # ends are increasing: samples do not overlap
        return np.sort(self.order[lo:hi])


def weights_problems(shapes: dict[str, tuple[int, ...]], manifest: dict[str, Any],
                     metadata: dict[str, str] | None = None) -> list[str]:
    """What is wrong with the weights file's tensors (names and shapes) for this manifest."""
    problems = []
    want = (int(manifest.get("target_vocab_size") or 0), int(manifest["hidden_size"]))
    if "embed_tokens.weight" not in shapes:
        problems.append(f"{WEIGHTS} has no embed_tokens.weight (keys {sorted(shapes)})")
    for k, shape in shapes.items():
        if k in ("embed_tokens.weight", "lm_head.weight") and tuple(shape) != want:
            problems.append(f"{WEIGHTS}: {k} has shape {list(shape)}, expected [target_vocab_size, hidden_size] "
                            f"= {list(want)}")
    tied = (metadata or {}).get("tied")
    if tied is not None and (tied == "true") != ("lm_head.weight" not in shapes):
        problems.append(f"{WEIGHTS}: metadata tied={tied} but lm_head.weight is "
                        f"{'absent' if 'lm_head.weight' not in shapes else 'present'}")
    return problems
