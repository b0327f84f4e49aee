"""The cache's names, versions, size limits and naming rules: the facts every other module takes from here.

A cache (format 3) is one zarr v3 group; ``docs/format.md`` is the full specification::

    zarr.json                       the group (attributes: format, format_version, manifest)
    manifest.json                   identity, config hash, layout, counts, ``complete``
    target_weights.safetensors      embed_tokens.weight (+ lm_head.weight unless tied)
    rejects.jsonl                   one line per input row that did not become a sample
    commits/u000000.json ...        one file per committed unit (its data is whole and durable; its shards' digests)
    commits/tokens.json             the digests of every unit's input_ids and loss_mask shard, as written
    input_ids/c.<u>                 int32 [token]            ragged: real tokens only, no padding
    loss_mask/c.<u>                 uint8 [token]
    position_ids/c.<u>.0            int32 [token, axes]   image caches of a multi-axis-rotary model (M-RoPE)
    hidden_states/layer_{i}/c.<u>.0 [token, hidden]  per captured layer (``embeddings`` for -1);
                                    bf16 as its uint16 bit pattern
    hidden_states/final_norm        [token, hidden]  the post-norm state when N-1 is not a captured layer
    hidden_states/pre_norm          [token, hidden]  the last decoder layer's output before the final norm
    hidden_scales/<array>           float32 [token, hidden / fp8_group]  per fp8 array (``contract/fp8.py``)
    samples/{start,length,source_row,unit,untruncated_length}/c.0   [sample] tables
    units/{token_start,token_stop}/c.0                              [unit] tables
    images/{sample,grid_thw,sha256}/c.0                             [image] tables (image caches only)
    .hydra/                         the Hydra record of the run that finished the cache

Every token array is stored with zarr v3's sharding codec: one shard (one object) per commit
unit ``u`` holds that unit's token slots ``[u * unit_tokens, (u+1) * unit_tokens)`` as inner
chunks of ``chunk_tokens`` rows, each compressed and crc32c-checksummed, with a checksummed
index at the shard's end. Sample ``i`` occupies ``[start[i], start[i] + length[i])``.

Format 1 (dspark-precompute 0.2) stored one object per chunk (``c/<k>/0``), units packed
back to back on the token axis; format 2 is format 3 without the shard digests that bind each
shard to its place (commit records and ``commits/tokens.json``); readers still read and verify both.
"""

from __future__ import annotations

import re

import numpy as np

from dspark_precompute.contract.vocab import StorageDtype

FORMAT_NAME = "dspark-precompute-cache"
FORMAT_VERSION = 3  # what this version writes; bump on any change a reader of the old version would misread
READABLE_FORMATS = (1, 2, 3)  # what this version reads and verifies (it resumes only FORMAT_VERSION)
BOUND_FORMAT = 3  # from this version on, commit records bind every shard to its place (a reader checks them)
MANIFEST = "manifest.json"
WEIGHTS = "target_weights.safetensors"
REJECTS = "rejects.jsonl"
COMMITS = "commits"
TOKEN_DIGESTS = f"{COMMITS}/tokens.json"
INPUT_IDS = "input_ids"
LOSS_MASK = "loss_mask"
HIDDEN_GROUP = "hidden_states"
SCALE_GROUP = "hidden_scales"  # the per-token (per-group) scales of fp8 arrays, one array per fp8 array
FINAL_NORM = "final_norm"
PRE_NORM = "pre_norm"
LAST = "last"  # the manifest's ``arrays`` key of the post-norm state
TOKEN_ARRAYS = {INPUT_IDS: np.int32, LOSS_MASK: np.uint8}
POSITION_IDS = "position_ids"  # optional: a multi-axis rotary model's positions of an image cache (int32 [T, axes])
POSITION_DTYPE = np.int32
# the token arrays written before the first forward (commits/tokens.json binds their shards until commit)
TOKENS_FIRST = (*TOKEN_ARRAYS, POSITION_IDS)
MAX_POSITION_AXES = 16
SAMPLE_ARRAYS = {
    "samples/start": np.int64,
    "samples/length": np.int32,
    "samples/source_row": np.int64,
    "samples/unit": np.int32,
    "samples/untruncated_length": np.int32,
}
UNIT_ARRAYS = {"units/token_start": np.int64, "units/token_stop": np.int64}
IMAGE_GROUP = "images"
IMAGE_SAMPLE, IMAGE_GRID, IMAGE_SHA256 = "images/sample", "images/grid_thw", "images/sha256"
# the per-image tables of an image cache: name -> (dtype, row width; None: 1-D)
IMAGE_ARRAYS: dict[str, tuple[type[np.generic], int | None]] = {
    IMAGE_SAMPLE: (np.int64, None), IMAGE_GRID: (np.int32, 3), IMAGE_SHA256: (np.uint8, 32)}
VIDEO_GROUP = "videos"
VIDEO_SAMPLE, VIDEO_GRID, VIDEO_SHA256 = "videos/sample", "videos/grid_thw", "videos/sha256"
# the per-video tables of a cache holding videos (manifest media.videos > 0): the columns of the image tables
VIDEO_ARRAYS: dict[str, tuple[type[np.generic], int | None]] = {
    VIDEO_SAMPLE: (np.int64, None), VIDEO_GRID: (np.int32, 3), VIDEO_SHA256: (np.uint8, 32)}
TABLES = (*SAMPLE_ARRAYS, *UNIT_ARRAYS, *IMAGE_ARRAYS, *VIDEO_ARRAYS)
GROUPS = ("samples", "units", HIDDEN_GROUP, SCALE_GROUP)  # an image cache also has IMAGE_GROUP (and VIDEO_GROUP)
KEY_SEPARATOR = "."  # format 2 chunk keys: ``c.3.0``, files beside each other (format 1: ``c/3/0``, a dir each)
COORD = "coord"  # failure markers of a multi-rank job
WINDOW = "window"  # a streamed cache's window records (contract/window.py)
HYDRA_RECORD = ".hydra"  # the Hydra record (composed config, overrides) of the run that wrote the cache
LOCK = ".writer.lock"

# Every top-level entry this tool ever writes into a cache directory. overwrite=true (and the
# restart of an allocation a kill interrupted) deletes exactly these, and only in a directory
# that holds nothing else.
OWN_ENTRIES = frozenset({
    "zarr.json", MANIFEST, WEIGHTS, REJECTS, COMMITS, COORD, HYDRA_RECORD, LOCK,
    INPUT_IDS, LOSS_MASK, HIDDEN_GROUP, SCALE_GROUP, "samples", "units", WINDOW, POSITION_IDS, IMAGE_GROUP,
    VIDEO_GROUP,
})


# what CacheStore.write_parts names a temporary: a dot, the target's name, mkstemp's 8 random characters, .tmp
TEMPORARY = re.compile(r"^\.(?P<target>[^/]+)\.[a-z0-9_]{8}\.tmp$")
# what the tool writes inside its own directories: zarr.json, chunks and shards, commit records, the Hydra
# record, a multi-rank job's failure markers
_OWN_INNER = re.compile(r"^(zarr\.json|c(\.\d+)+|u\d{6,}\.json|tokens\.json|failed-\d+\.json|"
                        r"(config|hydra|overrides)\.yaml|stream\.json|trainer\.json|u\d{6,}\.r\d{4,}\.json)$")


def is_own_temporary(name: str) -> bool:
    """A temporary of an atomic write of one of our top-level files (``.manifest.json.<8 random>.tmp``)."""
    m = TEMPORARY.match(name)
    return m is not None and m["target"] in OWN_ENTRIES


def is_own_temporary_key(key: str) -> bool:
    """A temporary (its key in the cache) an interrupted write of this tool can have left: named for a file the
    tool writes (``input_ids/.c.3.<8 random>.tmp``), under one of the tool's own top-level entries. A file
    named otherwise, or in a directory the tool does not write, is someone else's and is never removed."""
    parts = key.split("/")
    if len(parts) == 1:
        return is_own_temporary(key)
    m = TEMPORARY.match(parts[-1])
    return m is not None and parts[0] in OWN_ENTRIES and _OWN_INNER.match(m["target"]) is not None


def foreign_entries(names: list[str] | set[str]) -> list[str]:
    """The entries of a directory listing that this tool did not write, sorted."""
    return sorted(n for n in names if n not in OWN_ENTRIES and not is_own_temporary(n))


# what the tool (or zarr, for metadata) writes below each of its top-level entries, as paths relative to that entry:
# format 2's shards (c.<u>, c.<u>.0), format 1's chunks (c/3/0), zarr's interrupted metadata writes
_ARRAY_FILES = r"(zarr\.json|zarr\.[0-9a-f]{32}\.partial|c(\.\d+)+|c(/\d+)+)"
_GROUP_FILES = rf"(zarr\.json|zarr\.[0-9a-f]{{32}}\.partial|[a-z_]+/{_ARRAY_FILES})"
_STATE_NAMES = rf"(layer_\d+|embeddings|{FINAL_NORM}|{PRE_NORM})"  # what layer_array and array_names give
_STATE_FILES = rf"(zarr\.json|zarr\.[0-9a-f]{{32}}\.partial|{_STATE_NAMES}/{_ARRAY_FILES})"
_OWN_NESTED = {
    INPUT_IDS: re.compile(rf"^{_ARRAY_FILES}$"), LOSS_MASK: re.compile(rf"^{_ARRAY_FILES}$"),
    POSITION_IDS: re.compile(rf"^{_ARRAY_FILES}$"), IMAGE_GROUP: re.compile(rf"^{_GROUP_FILES}$"),
    VIDEO_GROUP: re.compile(rf"^{_GROUP_FILES}$"),
    HIDDEN_GROUP: re.compile(rf"^{_STATE_FILES}$"), SCALE_GROUP: re.compile(rf"^{_STATE_FILES}$"),
    "samples": re.compile(rf"^{_GROUP_FILES}$"), "units": re.compile(rf"^{_GROUP_FILES}$"),
    COMMITS: re.compile(r"^(u\d{6,}|tokens)\.json$"), COORD: re.compile(r"^[^/]+/failed-\d+\.json$"),
    HYDRA_RECORD: re.compile(r"^(config|hydra|overrides)\.yaml$"),
    WINDOW: re.compile(r"^(stream|trainer)\.json$|^done/u\d{6,}\.r\d{4,}\.json$|^released/u\d{6,}\.json$"),
}


def foreign_nested(keys: list[str]) -> list[str]:
    """Files (keys, relative to the cache) under the tool's own top-level entries that it never writes there,
    sorted: a user's ``hidden_states/README.md`` or ``input_ids/notes/zarr.json`` that deleting the entry would
    take along. Each file is matched by its whole path below the entry, not by its name alone."""
    out = []
    for key in keys:
        top, _, rest = key.partition("/")
        rule = _OWN_NESTED.get(top)
        if rest and top in OWN_ENTRIES and not ((rule is not None and rule.match(rest))
                                                 or is_own_temporary_key(key)):
            out.append(key)
    return sorted(out)


def layer_array(layer_id: int) -> str:
    return f"{HIDDEN_GROUP}/embeddings" if layer_id == -1 else f"{HIDDEN_GROUP}/layer_{layer_id}"


def hidden_arrays(layer_ids: list[int], num_layers: int, post_norm: bool = True,
                  pre_norm: bool = False) -> dict[str, str]:
    """Array name per captured layer (keyed by the id as a string), plus the final states.

    ``"last"``: the post-norm state, stored once (as ``layer_{N-1}`` when N-1 is captured, else as
    ``final_norm``; absent when neither N-1 is captured nor ``post_norm`` asked for);
    ``"pre_norm"``: the last decoder layer's output before the final norm, when ``pre_norm``.
    """
    names = {str(lid): layer_array(lid) for lid in layer_ids}
    if (num_layers - 1) in layer_ids:
        names[LAST] = names[str(num_layers - 1)]
    elif post_norm:
        names[LAST] = f"{HIDDEN_GROUP}/{FINAL_NORM}"
    if pre_norm:
        names[PRE_NORM] = f"{HIDDEN_GROUP}/{PRE_NORM}"
    return names


def array_layer_id(name: str, arrays: dict[str, str], num_layers: int) -> int:
    """The ``layer_id`` attribute of a hidden array: its id, or N-1 for ``final_norm`` and ``pre_norm``.

    Both final states come from decoder layer N-1 (``final_state`` attribute: after or before the
    final norm); a captured id N-1 means the post-norm state, as in NeMo AutoModel.
    """
    for key, value in arrays.items():
        if value == name and key not in (LAST, PRE_NORM):
            return int(key)
    return num_layers - 1


def final_state(name: str, arrays: dict[str, str]) -> str | None:
    """``post_norm``/``pre_norm`` for the arrays that hold only a final state (its ``final_state`` attribute)."""
    if name == arrays.get(PRE_NORM):
        return "pre_norm"
    if name == f"{HIDDEN_GROUP}/{FINAL_NORM}":
        return "post_norm"
    return None


def scale_array(state_array: str) -> str:
    """The scale array of an fp8 state array: ``hidden_states/layer_3`` -> ``hidden_scales/layer_3``."""
    return f"{SCALE_GROUP}/{state_array.rsplit('/', 1)[-1]}"


def array_dtypes(names: dict[str, str], storage_dtype: str, last_dtype: str | None) -> dict[str, StorageDtype]:
    """Storage dtype of each hidden array: the final states' (post- and pre-norm) are ``last_dtype``
    (None: ``storage_dtype``)."""
    finals = {names.get(LAST), names.get(PRE_NORM)}
    return {name: StorageDtype((last_dtype or storage_dtype) if name in finals else storage_dtype)
            for name in dict.fromkeys(names.values())}


def auto_chunk_tokens(hidden_size: int, itemsize: int, target_bytes: int = 256 << 10) -> int:
    """Largest power of two with a chunk of the widest array <= ``target_bytes``, in [128, 65536].

    A read decompresses whole inner chunks, so a sample costs its own tokens plus what its
    first and last chunks hold of its neighbours: short chunks keep that small. Measured on
    the loader (exact shuffle, batch 8, 491-token samples, hidden 1024, docs/benchmarks.md):
    512-token chunks decoded 1.6x the chunks an epoch holds, 128-token ones 1.2x. The
    floor of 128 tokens keeps wide targets' chunks (1 MiB at hidden 4096 in bf16) large
    enough for the codec and the per-chunk work.
    """
    n = max(1, target_bytes // max(1, hidden_size * itemsize))
    p = 1 << (n.bit_length() - 1)
    return int(min(max(p, 128), 65536))


UNIT_TOKENS = 1 << 17  # the most tokens an automatically sized unit holds (units of wide targets hit unit_mib first)


def unit_tokens(row_bytes: int, chunk_tokens: int, unit_mib: int, seq_length: int, explicit: int | None = None) -> int:
    """Token slots per commit unit (and per shard): ``unit_mib`` MiB of raw rows of ``row_bytes``, at most
    :data:`UNIT_TOKENS`, in whole chunks, never shorter than one sample of ``seq_length``.

    Larger units mean fewer files (one shard per array per unit) but more host memory for the
    unit buffers and more work a kill loses; the token cap keeps both small for narrow targets.
    """
    auto = min((int(unit_mib) << 20) // max(1, row_bytes), UNIT_TOKENS) // chunk_tokens * chunk_tokens
    unit = int(explicit) if explicit else max(chunk_tokens, auto)
    return max(unit, -(-int(seq_length) // chunk_tokens) * chunk_tokens)


def bytes_per_token(hidden_size: int, itemsize: int, n_hidden_arrays: int) -> int:
    """Raw bytes one real token costs on disk before compression (ids int32 + mask uint8 + states)."""
    return n_hidden_arrays * hidden_size * itemsize + 4 + 1


def hidden_bytes_per_token(hidden_size: int, dtypes: list[str], scale_columns: int) -> int:
    """Raw bytes per token of the hidden arrays of ``dtypes`` (one per array), fp8 scales (float32) included."""
    return sum(hidden_size * StorageDtype(d).disk.itemsize + (4 * scale_columns if StorageDtype(d).is_fp8 else 0)
               for d in dtypes)


def is_int(v: object) -> bool:
    """An integer that is not a bool (JSON true would pass isinstance(v, int))."""
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def disk_dtype(storage_dtype: str) -> np.dtype:
    """The numpy dtype a storage dtype is written as (bf16 as its uint16 bits)."""
    return StorageDtype(storage_dtype).disk


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
MAX_SHARD_CHUNKS = 1 << 20        # inner chunks per shard (its index is 16 bytes each)
MAX_RECORD_BYTES = 1 << 26        # one commit record (its shard digests: 8 hex digits per inner chunk)
MAX_VOCAB_SIZE = 1 << 31
