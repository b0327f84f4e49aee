"""The cache's names, versions, dtype tables, size limits and naming rules: the facts every
other module takes from here.

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
    .hydra/                    the Hydra record of the run that finished the cache

Sample ``i`` occupies ``[start[i], start[i] + length[i])`` on the token axis. Units own
whole chunks (each starts on a chunk boundary), so writers never share a chunk.
"""

from __future__ import annotations

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
TOKEN_ARRAYS = {INPUT_IDS: np.int32, LOSS_MASK: np.uint8}
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
# storage dtype name -> its safetensors dtype (the weights file holds the embedding in the storage dtype)
SAFETENSORS_DTYPES = {"bf16": "BF16", "fp16": "F16", "fp32": "F32"}
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
    """Raw bytes one real token costs on disk before compression (ids int32 + mask uint8 + states)."""
    return n_hidden_arrays * hidden_size * itemsize + 4 + 1


def is_int(v: object) -> bool:
    """An integer that is not a bool (JSON true would pass isinstance(v, int))."""
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def disk_dtype(storage_dtype: str) -> np.dtype:
    """The numpy dtype a storage dtype is written as (bf16 as its uint16 bits)."""
    return np.dtype(STORAGE_DTYPES[storage_dtype][0])


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
COMPRESSORS = ("blosc", "zstd")   # between ``bytes`` and ``crc32c``; none is fine too
