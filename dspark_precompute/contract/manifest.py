"""The manifest: one typed record of what a cache holds, and the only code that reads its keys.

``Manifest.parse`` checks a manifest.json (every field's type and range, the array names
against the naming rule, counts and layout against each other: :func:`manifest_problems`)
before anything is computed from it; ``Manifest.read``/``write`` move it through a store;
``differences`` names the identity fields a resume would change. The ``identity``
section is hashed into ``config_hash`` and its fields are the write side's to choose
(its plan); the reader takes only the few it shows through the properties below.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from dspark_precompute.contract.fp8 import E4M3, SCALE_DTYPE, scale_columns
from dspark_precompute.contract.spec import (
    FINAL_NORM,
    FORMAT_NAME,
    FORMAT_VERSION,
    HIDDEN_GROUP,
    MANIFEST,
    MAX_CHUNK_BYTES,
    MAX_CHUNK_TOKENS,
    MAX_HIDDEN_SIZE,
    MAX_NUM_LAYERS,
    MAX_SAMPLE_BYTES,
    MAX_SEQ_LENGTH,
    MAX_TOKEN_SLOTS,
    MAX_VOCAB_SIZE,
    OUTPUT_DTYPES,
    STORAGE_DTYPES,
    WEIGHTS,
    array_dtypes,
    bytes_per_token,
    disk_dtype,
    hidden_arrays,
    hidden_bytes_per_token,
    is_int,
    scale_array,
)
from dspark_precompute.errors import CacheFormatError

if TYPE_CHECKING:
    from dspark_precompute.contract.store import CacheStore

_HEX = frozenset("0123456789abcdef")
# fields that say when and by which command a cache was written: an uninterrupted run and a
# resumed one that end with bit-identical data differ only in these
RUN_RECORD_FIELDS = ("created_at", "updated_at", "completed_at", "timing", "provenance")


def config_hash(identity: dict[str, Any]) -> str:
    """sha256 of the identity as canonical JSON (sorted keys, no spaces)."""
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


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


@dataclass(frozen=True)
class ManifestLayout:
    """Where units and chunks lie on the token axis."""

    chunk_tokens: int
    unit_tokens: int
    num_units: int
    total_token_slots: int


@dataclass(frozen=True)
class Counts:
    """How the input rows were accounted for: ``rows_in = samples + rejected``."""

    rows_in: int
    samples: int
    rejected: int
    tokens: int
    supervised_tokens: int
    truncated_samples: int
    rejected_by_reason: dict[str, int] = field(default_factory=dict)


LAST_STATE_POST_NORM = "post_final_norm"  # Capture.last_state: the decoder's output after its final norm


@dataclass(frozen=True)
class MaskPolicy:
    """Which rule made the loss masks, and the mask options (a trainer's answer to "what is supervised?").

    ``rule``: ``generation_template`` (the template's own ``{% generation %}`` assistant mask)
    or ``nemo_prefix`` (NeMo's prefix rule: each assistant turn from its role header to its
    end-of-turn token). ``fallback``: with ``nemo_prefix``, ``full_render_alignment``, how a
    turn is located where the template rewrites earlier turns and the prefix rule breaks.
    ``deepspec`` (``data.mask_rule=deepspec``): DeepSpec's rule, each assistant turn's content
    and end-of-turn marker without its header, ``default_system_prompt`` added to conversations
    without one, samples under ``min_supervised_tokens`` rejected.
    """

    rule: str | None = None
    fallback: str | None = None
    mask_reasoning_content: bool | None = None
    mask_generation_prompt: bool | None = None
    default_system_prompt: str | None = None  # deepspec: the system prompt added where a conversation has none
    min_supervised_tokens: int | None = None  # deepspec: fewer supervised tokens make a reject


@dataclass(frozen=True)
class Capture:
    """How the stored values were made: what a trainer needs to trust the cache without guessing.

    Every field follows from inputs the identity already hashes (the target's config and
    weights, the template, the mask options, the layer ids), so none of it is hashed itself.
    ``final_norm_class`` comes from the loaded model: it is set once a run has loaded it.
    """

    last_state: str | None = None  # LAST_STATE_POST_NORM: ``last`` is taken after the final norm
    final_norm_class: str | None = None  # e.g. Qwen3RMSNorm
    layer_preset: str | None = None  # nemo | servable | explicit (model.layer_ids given)
    mask: MaskPolicy | None = None
    target_weights_dtype: str | None = None  # the checkpoint's floating dtype (safetensors headers, else config)
    weights_fingerprint: str | None = None  # the identity's fingerprint of every weight file
    fingerprint_kind: str | None = None  # full (every byte) or sampled

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Capture:
        kw = {f.name: d.get(f.name) for f in dataclasses.fields(cls)}
        mask = d.get("mask")
        kw["mask"] = MaskPolicy(**{f.name: mask.get(f.name) for f in dataclasses.fields(MaskPolicy)}) \
            if isinstance(mask, dict) else None
        return cls(**kw)


@dataclass(frozen=True)
class RunProvenance:
    """Which command, software and machines wrote the cache (a run record: never hashed).

    ``argv`` and ``overrides`` are the command line and Hydra overrides of the run that
    finished the cache; ``versions`` its torch, transformers, zarr, numcodecs and
    dspark_precompute; ``hosts`` every host that wrote a unit (from this run's ranks and the
    commit records of units an earlier run wrote); ``world_size`` the finishing run's ranks.
    """

    argv: list[str] | None = None
    overrides: list[str] | None = None
    versions: dict[str, str] = field(default_factory=dict)
    hosts: list[str] = field(default_factory=list)
    world_size: int | None = None

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RunProvenance:
        """From its JSON value (keys this version does not know are dropped)."""
        return cls(argv=d.get("argv"), overrides=d.get("overrides"), versions=dict(d.get("versions") or {}),
                   hosts=list(d.get("hosts") or []), world_size=d.get("world_size"))

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclass
class Manifest:
    """A cache's manifest.json as typed fields (build it, parse it, write it; never index a dict)."""

    config_hash: str
    identity: dict[str, Any]
    target_model: str
    target_model_type: str
    target_vocab_size: int
    num_hidden_layers: int
    hidden_size: int
    layer_ids: list[int]
    seq_length: int
    storage_dtype: str
    chat_template: str
    arrays: dict[str, str]
    layout: ManifestLayout
    counts: Counts
    complete: bool
    config: dict[str, Any] = field(default_factory=dict)  # the resolved run config (to rebuild the run)
    tied_embeddings: bool = True
    pad_token_id: int | None = None
    eos_token_id: int | None = None
    tool_version: str = ""
    created_at: str = ""
    updated_at: str = ""
    completed_at: str | None = None
    timing: dict[str, float] | None = None
    weights_sha256: str | None = None
    provenance: RunProvenance | None = None
    capture: Capture | None = None  # absent in caches written before it was recorded
    dropped_samples: list[int] | None = None  # stored samples whose states were not finite: not readable
    nonfinite_values: dict[str, int] | None = None  # array -> NaN/Inf values found (all in dropped samples)
    # the post-norm state's storage dtype when it differs from storage_dtype (fp8 caches keep it bf16)
    last_dtype: str | None = None
    fp8_group: int | None = None  # channels per fp8 scale; null: one scale per token (the whole row)

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (to DataLoader workers, inside a dataset) without the run record: it says which command and
        software wrote the cache, which no reader of samples needs, and it names libraries a worker must not
        be suspected of carrying (a pickle holding "zarr" would hint at a pickled zarr handle)."""
        state = dict(self.__dict__)
        state["provenance"] = None
        return state

    # -- derived facts ----------------------------------------------------------------------
    @property
    def stored_samples(self) -> int:
        """Rows of the sample tables: the readable samples and the dropped ones."""
        return self.counts.samples + len(self.dropped_samples or [])

    @property
    def disk_dtype(self) -> np.dtype:
        return disk_dtype(self.storage_dtype)

    @property
    def logical_dtype(self) -> str:
        return STORAGE_DTYPES[self.storage_dtype][1]

    @property
    def last_storage_dtype(self) -> str:
        """The storage dtype of the post-norm state (``last_dtype``, else ``storage_dtype``)."""
        return self.last_dtype or self.storage_dtype

    @property
    def array_dtypes(self) -> dict[str, str]:
        """Storage dtype of each hidden array (the post-norm state's may differ from the others')."""
        return array_dtypes(self.arrays, self.storage_dtype, self.last_dtype)

    @property
    def scale_arrays(self) -> dict[str, str]:
        """fp8 state array -> its scale array (``hidden_scales/...``), for every array stored as fp8."""
        return {name: scale_array(name) for name, d in self.array_dtypes.items() if d == E4M3}

    @property
    def scale_columns(self) -> int:
        """Scales per token of each fp8 array: hidden_size / fp8_group (1: one per token)."""
        return scale_columns(self.hidden_size, self.fp8_group)

    @property
    def output_dtype(self) -> str:
        """The dtype a reader returns ``target_hidden_states`` in (fp8 is dequantized to bf16)."""
        return OUTPUT_DTYPES[self.storage_dtype]

    @property
    def last_output_dtype(self) -> str:
        """The dtype a reader returns ``target_last_hidden_states`` in."""
        return OUTPUT_DTYPES[self.last_storage_dtype]

    def hidden_storage(self) -> dict[str, dict[str, Any]]:
        """Per hidden array: storage, on-disk and logical dtype, and an fp8 array's scale array (for other tools)."""
        return _hidden_storage(self.array_dtypes, self.scale_columns, self.fp8_group or self.hidden_size)

    @property
    def hidden_array_names(self) -> list[str]:
        """Every stored hidden-state array once (the last layer and ``last`` may be the same array)."""
        return list(dict.fromkeys(self.arrays.values()))

    @property
    def last_array(self) -> str:
        """The array of the post-norm state the trainer applies lm_head to."""
        return self.arrays["last"]

    @property
    def bytes_per_token(self) -> int:
        return hidden_bytes_per_token(self.hidden_size, list(self.array_dtypes.values()), self.scale_columns) + 5

    @property
    def target_hidden_dim(self) -> int:
        return self.hidden_size * len(self.layer_ids)

    @property
    def pad_id(self) -> int:
        """The id NeMo pads with: the tokenizer's pad token, else its eos token, else 0."""
        for v in (self.pad_token_id, self.eos_token_id):
            if v is not None:
                return int(v)
        return 0

    def data_identity(self, key: str, default: Any = None) -> Any:
        """One recorded fact about the input data (path, split, shuffle_seed, mask options)."""
        return self.identity.get("data", {}).get(key, default)

    # -- JSON -------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name in ("completed_at", "timing", "weights_sha256", "provenance", "capture", "dropped_samples",
                          "nonfinite_values", "last_dtype", "fp8_group") and v is None:
                continue
            if isinstance(v, RunProvenance):
                out[f.name] = v.to_json()
                continue
            out[f.name] = dataclasses.asdict(v) if dataclasses.is_dataclass(v) and not isinstance(v, type) else v
        # derived, written for other tools (NeMo-style readers) and for people reading the file
        out.update(bytes_per_token=self.bytes_per_token, target_hidden_dim=self.target_hidden_dim,
                   target_last_hidden_dim=self.hidden_size, hidden_storage=self.hidden_storage())
        return out

    def to_bytes(self) -> bytes:
        return (json.dumps(self.to_json(), indent=2, sort_keys=True) + "\n").encode()

    @classmethod
    def parse(cls, data: Any, where: str = MANIFEST) -> Manifest:
        """A manifest from its JSON value, after :func:`manifest_problems` found nothing; else CacheFormatError."""
        problems = manifest_problems(data)
        if problems:
            raise CacheFormatError(listing(f"{where} is invalid", problems,
                                           "The manifest was altered or is damaged: re-create the cache (re-run the "
                                           "precompute command with overwrite=true)."))
        kw = {f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data}
        kw["layout"] = ManifestLayout(**{k: int(data["layout"][k]) for k in
                                         ("chunk_tokens", "unit_tokens", "num_units", "total_token_slots")})
        c = data["counts"]
        kw["counts"] = Counts(**{k: int(c[k]) for k in ("rows_in", "samples", "rejected", "tokens",
                                                        "supervised_tokens", "truncated_samples")},
                              rejected_by_reason={str(k): int(v) for k, v in c.get("rejected_by_reason", {}).items()})
        kw["layer_ids"] = [int(i) for i in data["layer_ids"]]
        if data.get("dropped_samples") is not None:
            kw["dropped_samples"] = [int(i) for i in data["dropped_samples"]]
        if isinstance(data.get("provenance"), dict):
            kw["provenance"] = RunProvenance.from_json(data["provenance"])
        if isinstance(data.get("capture"), dict):
            kw["capture"] = Capture.from_json(data["capture"])
        return cls(**kw)

    @classmethod
    def read(cls, store: CacheStore) -> Manifest:
        """The store's manifest, checked; CacheFormatError when absent, unreadable or invalid."""
        m = cls.read_if_present(store)
        if m is None:
            raise CacheFormatError(
                f"{store.path}: no {MANIFEST}; this is not a dspark-precompute cache (or its run never "
                "started). Point it at the storage.path of a precompute run.")
        return m

    @classmethod
    def read_if_present(cls, store: CacheStore) -> Manifest | None:
        if not store.exists(MANIFEST):
            return None
        try:
            data = json.loads(store.read_bytes(MANIFEST))
        except (ValueError, UnicodeDecodeError) as exc:
            raise CacheFormatError(f"{store.path}/{MANIFEST} is not valid JSON ({exc}); re-create the cache "
                                   "(re-run the precompute command with overwrite=true)") from None
        return cls.parse(data, f"{store.path}: {MANIFEST}")

    def write(self, store: CacheStore) -> None:
        """Atomically (the store writes a temporary and renames it)."""
        self.updated_at = now()
        store.write_bytes(MANIFEST, self.to_bytes())

    def differences(self, identity: dict[str, Any]) -> list[tuple[str, Any, Any]]:
        """The identity fields ``identity`` would change, as (dotted key, recorded, requested)."""
        return identity_differences(self.identity, identity)

    def mark_incomplete(self) -> None:
        """So the next precompute run resumes it (and rewrites every unit without a commit record)."""
        self.complete = False
        self.completed_at = None

    def mark_complete(self, timing: dict[str, float] | None = None, weights_sha256: str | None = None,
                      provenance: RunProvenance | dict[str, Any] | None = None) -> None:
        self.complete = True
        self.completed_at = now()
        if isinstance(provenance, dict):
            provenance = RunProvenance.from_json(provenance)
        self.timing, self.weights_sha256, self.provenance = timing, weights_sha256, provenance

    def run_independent_json(self) -> dict[str, Any]:
        """The JSON without the fields that record when and by which command it was written."""
        out = self.to_json()
        for k in RUN_RECORD_FIELDS:
            out.pop(k, None)
        return out


def _hidden_storage(dtypes: dict[str, str], columns: int, group: int) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name, d in dtypes.items():
        disk, logical = STORAGE_DTYPES[d]
        entry: dict[str, Any] = {"dtype": d, "disk_dtype": np.dtype(disk).name, "logical_dtype": logical}
        if d == E4M3:
            entry.update(scale_array=scale_array(name), scale_dtype=SCALE_DTYPE.name, scale_columns=columns,
                         channels_per_scale=group)
        out[name] = entry
    return out


def listing(head: str, problems: list[str], tail: str) -> str:
    if len(problems) == 1:
        return f"{head}: {problems[0]}. {tail}"
    return f"{head} ({len(problems)} problems):\n" + "\n".join(f"  - {p}" for p in problems) + f"\n{tail}"


# -- checks of the raw JSON ------------------------------------------------------------------------
def _kind(v: Any) -> str:
    return {bool: "a boolean", int: "an integer", str: "a string", float: "a float", list: "a list",
            dict: "an object", type(None): "null"}.get(type(v), type(v).__name__)


def _int_problem(where: str, v: Any, lo: int, hi: int, what: str) -> str | None:
    if not is_int(v):
        return f"manifest {where} = {v!r} ({_kind(v)}) must be an integer in [{lo}, {hi}] ({what})"
    if not lo <= int(v) <= hi:
        return f"manifest {where} = {int(v)} is outside [{lo}, {hi}] ({what})"
    return None


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
    if manifest.get("last_dtype") not in (None, *STORAGE_DTYPES):
        problems.append(f"manifest last_dtype {manifest.get('last_dtype')!r} is unknown "
                        f"(one of {sorted(STORAGE_DTYPES)}, or null for storage_dtype)")

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
    identity: Any = manifest.get("identity")
    if "identity" in manifest and typed("identity", identity, dict, "an object"):
        target: Any = identity.get("target")
        if typed("identity.target", target, dict, "an object"):
            typed("identity.target.path", target.get("path"), str, "a string (the target's path or name)")
        data: Any = identity.get("data")
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
    sha: Any = manifest.get("weights_sha256")
    if "weights_sha256" in manifest and not (isinstance(sha, str) and len(sha) == 64 and set(sha) <= _HEX):
        problems.append(f"manifest weights_sha256 = {sha!r:.80} must be 64 lowercase hex digits (the sha256 of "
                        f"{WEIGHTS})")

    problems += _capture_problems(manifest.get("capture")) if manifest.get("capture") is not None else []
    problems += _provenance_problems(manifest.get("provenance")) if manifest.get("provenance") is not None else []

    hidden_ok = "hidden_size" in manifest and check_int("hidden_size", manifest["hidden_size"], 1, MAX_HIDDEN_SIZE,
                                                        "width of every hidden-state array")
    layers_ok = "num_hidden_layers" in manifest and check_int(
        "num_hidden_layers", manifest["num_hidden_layers"], 1, MAX_NUM_LAYERS, "decoder layers of the target")
    seq_ok = "seq_length" in manifest and check_int("seq_length", manifest["seq_length"], 1, MAX_SEQ_LENGTH,
                                                    "longest sample, in tokens")
    dtype_ok = manifest.get("storage_dtype") in STORAGE_DTYPES and manifest.get("last_dtype") in (None, *STORAGE_DTYPES)
    itemsize = max(disk_dtype(d).itemsize for d in (manifest["storage_dtype"], manifest.get("last_dtype")
                                                     or manifest["storage_dtype"])) if dtype_ok else 0
    group: Any = manifest.get("fp8_group")
    group_ok = group is None
    if group is not None and dtype_ok:
        if E4M3 not in (manifest["storage_dtype"], manifest.get("last_dtype")):
            problems.append(f"manifest fp8_group = {group!r} but no array is stored as {E4M3} (storage_dtype "
                            f"{manifest['storage_dtype']!r}, last_dtype {manifest.get('last_dtype')!r})")
        elif hidden_ok and check_int("fp8_group", group, 1, int(manifest["hidden_size"]), "channels per fp8 scale"):
            if int(manifest["hidden_size"]) % int(group):
                problems.append(f"manifest fp8_group = {group} does not divide hidden_size = "
                                f"{manifest['hidden_size']} (each scale covers a whole group of channels)")
            else:
                group_ok = True

    ids: Any = manifest.get("layer_ids")
    ids_ok = False
    if "layer_ids" in manifest and typed("layer_ids", ids, list, "a list of layer ids"):
        if not ids:
            problems.append("manifest layer_ids is empty: a cache captures at least one layer")
        elif not all(is_int(i) for i in ids):
            problems.append(f"manifest layer_ids = {ids!r:.80} must be integers")
        elif any(b <= a for a, b in zip(ids, ids[1:])):
            problems.append(f"manifest layer_ids = {ids} must be strictly increasing")
        elif layers_ok and not all(-1 <= i < int(manifest["num_hidden_layers"]) for i in ids):
            problems.append(f"manifest layer_ids = {ids} must lie in [-1, num_hidden_layers - 1 = "
                            f"{int(manifest['num_hidden_layers']) - 1}]")
        else:
            ids_ok = layers_ok

    arrays: Any = manifest.get("arrays")
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

    layout: Any = manifest.get("layout")
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
                chunk_bytes = ct * int(manifest["hidden_size"]) * itemsize
                if chunk_bytes > MAX_CHUNK_BYTES:
                    problems.append(
                        f"manifest layout.chunk_tokens = {ct} x hidden_size = {manifest['hidden_size']} x {itemsize} "
                        f"bytes makes {chunk_bytes:,}-byte chunks, more than a reader decodes at once "
                        f"({MAX_CHUNK_BYTES:,}); the manifest is damaged or the cache was not written by this tool")
                    layout_ok = False

    if hidden_ok and dtype_ok and seq_ok and isinstance(ids, list):
        # fp8 arrays hold at most as many scales as channels (4 bytes each): bound them by 4 more bytes per value
        per_sample = int(manifest["seq_length"]) * bytes_per_token(int(manifest["hidden_size"]), itemsize + (
            4 if E4M3 in (manifest["storage_dtype"], manifest.get("last_dtype")) else 0), len(ids) + 1)
        if per_sample > MAX_SAMPLE_BYTES:
            problems.append(
                f"manifest seq_length = {manifest['seq_length']} x hidden_size = {manifest['hidden_size']} makes one "
                f"padded sample {per_sample:,} bytes, more than a reader allocates for one sample "
                f"({MAX_SAMPLE_BYTES:,}); the manifest is damaged")
    if hidden_ok and dtype_ok and arrays_ok and group_ok:
        hidden = int(manifest["hidden_size"])
        dtypes = array_dtypes(arrays, manifest["storage_dtype"], manifest.get("last_dtype"))
        cols = scale_columns(hidden, group)
        want_bpt = hidden_bytes_per_token(hidden, list(dtypes.values()), cols) + 5
        if "bytes_per_token" in manifest and manifest["bytes_per_token"] != want_bpt:
            problems.append(f"manifest bytes_per_token = {manifest['bytes_per_token']!r}, the arrays it names store "
                            f"{want_bpt} bytes per token")
        want_storage = _hidden_storage(dtypes, cols, group or hidden)
        if "hidden_storage" in manifest and manifest["hidden_storage"] != want_storage:
            problems.append(f"manifest hidden_storage = {manifest['hidden_storage']!r:.160} disagrees with "
                            f"storage_dtype, last_dtype and fp8_group, which give {want_storage!r:.160}; the manifest "
                            "was altered")
    if hidden_ok and isinstance(ids, list):
        for key, want_dim in (("target_hidden_dim", int(manifest["hidden_size"]) * len(ids)),
                              ("target_last_hidden_dim", int(manifest["hidden_size"]))):
            if key in manifest and manifest[key] != want_dim:
                problems.append(f"manifest {key} = {manifest[key]!r}, hidden_size x layers gives {want_dim}")

    counts: Any = manifest.get("counts")
    if "counts" in manifest and typed("counts", counts, dict, "an object"):
        got = {}
        for k in ("rows_in", "samples", "rejected", "tokens", "supervised_tokens", "truncated_samples"):
            if k not in counts:
                problems.append(f"manifest lacks counts.{k}")
            elif check_int(f"counts.{k}", counts[k], 0, MAX_TOKEN_SLOTS, "a count"):
                got[k] = int(counts[k])
        by: Any = counts.get("rejected_by_reason", {})
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
        dropped: Any = manifest.get("dropped_samples")
        n_dropped = 0
        if dropped is not None and typed("dropped_samples", dropped, list, "a list of sample ids"):
            if not all(is_int(i) and 0 <= i < MAX_TOKEN_SLOTS for i in dropped) or any(
                    b <= a for a, b in zip(dropped, dropped[1:])):
                problems.append(f"manifest dropped_samples = {dropped!r:.80} must be increasing sample ids")
            else:
                n_dropped = len(dropped)
                if "samples" in got and dropped and dropped[-1] >= got["samples"] + n_dropped:
                    problems.append(f"manifest dropped_samples names sample {dropped[-1]}, but the tables hold "
                                    f"{got['samples'] + n_dropped} (counts.samples + dropped)")
        nonfinite: Any = manifest.get("nonfinite_values")
        if nonfinite is not None and typed("nonfinite_values", nonfinite, dict, "an object of array -> values") \
                and not all(isinstance(k, str) and is_int(v) and v >= 0 for k, v in nonfinite.items()):
            problems.append(f"manifest nonfinite_values = {nonfinite!r:.80} must map array names to counts")
        if layout_ok and "samples" in got:
            nu, total = int(layout["num_units"]), int(layout["total_token_slots"])
            stored = got["samples"] + n_dropped
            if not nu <= stored <= total or (stored == 0) != (nu == 0):
                extra = f" (+ {n_dropped} dropped)" if n_dropped else ""
                problems.append(f"manifest counts.samples = {got['samples']}{extra} does not fit "
                                f"layout.num_units = {nu} and layout.total_token_slots = {total}")
            if "tokens" in got and got["tokens"] > total:
                problems.append(f"manifest counts.tokens = {got['tokens']} exceeds layout.total_token_slots = {total}")
    return problems



def _optional_types(where: str, d: dict[str, Any], fields: dict[str, tuple[type, ...]],
                    what: dict[str, str]) -> list[str]:
    """Each present, non-null key of ``d`` whose value is not one of its types (bools are not ints)."""
    out = []
    for k, types in fields.items():
        v = d.get(k)
        if v is None:
            continue
        if not isinstance(v, types) or (isinstance(v, bool) and bool not in types):
            out.append(f"manifest {where}.{k} = {v!r:.80} ({_kind(v)}) must be {what[k]} or null")
    return out


def _str_list_problem(where: str, v: Any) -> str | None:
    if v is None or (isinstance(v, list) and all(isinstance(x, str) for x in v)):
        return None
    return f"manifest {where} = {v!r:.80} ({_kind(v)}) must be a list of strings or null"


def _capture_problems(cap: Any) -> list[str]:
    """Types of the optional ``capture`` section (what the stored values are: post-norm, masks, dtype)."""
    if not isinstance(cap, dict):
        return [f"manifest capture = {cap!r:.80} ({_kind(cap)}) must be an object or null"]
    text = {k: "a string" for k in ("last_state", "final_norm_class", "layer_preset", "target_weights_dtype",
                                    "weights_fingerprint", "fingerprint_kind")}
    out = _optional_types("capture", cap, {k: (str,) for k in text}, text)
    mask = cap.get("mask")
    if mask is not None:
        if not isinstance(mask, dict):
            out.append(f"manifest capture.mask = {mask!r:.80} ({_kind(mask)}) must be an object or null")
        else:
            what = {"rule": "a string", "fallback": "a string", "mask_reasoning_content": "true or false",
                    "mask_generation_prompt": "true or false", "default_system_prompt": "a string",
                    "min_supervised_tokens": "an integer"}
            out += _optional_types("capture.mask", mask, {"rule": (str,), "fallback": (str,),
                                                          "mask_reasoning_content": (bool,),
                                                          "mask_generation_prompt": (bool,),
                                                          "default_system_prompt": (str,),
                                                          "min_supervised_tokens": (int,)}, what)
    return out


def _provenance_problems(prov: Any) -> list[str]:
    """Types of the optional ``provenance`` run record (command line, versions, hosts, world size)."""
    if not isinstance(prov, dict):
        return [f"manifest provenance = {prov!r:.80} ({_kind(prov)}) must be an object or null"]
    out = [p for k in ("argv", "overrides", "hosts") if (p := _str_list_problem(f"provenance.{k}", prov.get(k)))]
    versions = prov.get("versions")
    if versions is not None and not (isinstance(versions, dict)
                                     and all(isinstance(v, str) for v in versions.values())):
        out.append(f"manifest provenance.versions = {versions!r:.80} must map package names to version strings")
    ws = prov.get("world_size")
    if ws is not None and (p := _int_problem("provenance.world_size", ws, 1, 1 << 24, "ranks that wrote the cache")):
        out.append(p)
    return out


def weights_problems(shapes: dict[str, tuple[int, ...]], m: Manifest,
                     metadata: dict[str, str] | None = None) -> list[str]:
    """What is wrong with the weights file's tensors (names and shapes) for this manifest."""
    problems = []
    want = (m.target_vocab_size, m.hidden_size)
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
