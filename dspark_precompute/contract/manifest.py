"""The manifest: one typed record of what a cache holds, and the only code that reads its keys.

:data:`FIELDS` is the manifest's schema, one row per JSON key (dotted for nested records):
its type, range, whether it may be absent or null, since which format version, and what it
means. That one table drives the checks of a manifest read from disk (:func:`manifest_problems`:
the table's own type/range checks, then the named cross-field rules in :data:`RULES`), the
typed record (:class:`Manifest` and its parts, built from the checked JSON by
:meth:`Manifest.parse` and written back by :meth:`Manifest.to_json`) and the field table of
``docs/format.md`` (:func:`fields_markdown`). ``differences`` names the identity fields a
resume would change. The ``identity`` section is hashed into ``config_hash`` and its fields are
the write side's to choose (its plan); the reader takes only the few it shows.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from dspark_precompute.contract.fp8 import SCALE_DTYPE, scale_columns
from dspark_precompute.contract.spec import (
    FINAL_NORM,
    FORMAT_NAME,
    FORMAT_VERSION,
    HIDDEN_GROUP,
    LAST,
    MANIFEST,
    MAX_CHUNK_BYTES,
    MAX_CHUNK_TOKENS,
    MAX_HIDDEN_SIZE,
    MAX_NUM_LAYERS,
    MAX_POSITION_AXES,
    MAX_SAMPLE_BYTES,
    MAX_SEQ_LENGTH,
    MAX_SHARD_CHUNKS,
    MAX_TOKEN_SLOTS,
    MAX_VOCAB_SIZE,
    PRE_NORM,
    READABLE_FORMATS,
    WEIGHTS,
    array_dtypes,
    hidden_arrays,
    hidden_bytes_per_token,
    is_int,
    scale_array,
)
from dspark_precompute.contract.vocab import LastState, StorageDtype
from dspark_precompute.errors import CacheFormatError
from dspark_precompute.humanize import listing

if TYPE_CHECKING:
    from dspark_precompute.contract.store import CacheStore

# fields that say when and by which command a cache was written: an uninterrupted run and a
# resumed one that end with bit-identical data differ only in these
RUN_RECORD_FIELDS = ("created_at", "updated_at", "completed_at", "timing", "provenance")


# -- the schema ---------------------------------------------------------------------------------
class Kind(StrEnum):
    """The JSON type of a manifest field."""

    INT = "an integer"
    STR = "a string"
    BOOL = "true or false"
    OBJECT = "an object"
    INTS = "a list of integers"
    STRS = "a list of strings"
    SHA256 = "64 lowercase hex digits"
    COUNTS = "an object of name -> count (integer >= 0)"
    NAMES = "an object of string -> string"
    SECONDS = "an object of stage -> seconds"
    ANY = "any JSON value"


@dataclass(frozen=True)
class Field:
    """One manifest key: its type, range and meaning (a row of docs/format.md's field table)."""

    key: str  # dotted path ("layout.chunk_tokens")
    kind: Kind
    doc: str
    required: bool = True  # present in every manifest of a version >= ``since`` (when its parent is)
    null: bool = False  # may be null
    since: int = 1
    lo: int | None = None
    hi: int | None = None
    choices: tuple[str, ...] = ()
    derived: bool = False  # computed from other fields when written; a reader checks it, never uses it

    @property
    def parent(self) -> str:
        return self.key.rpartition(".")[0]

    @property
    def name(self) -> str:
        return self.key.rpartition(".")[2]


_DTYPES = tuple(StorageDtype)
_TOKENS = (0, MAX_TOKEN_SLOTS)
FIELDS: tuple[Field, ...] = (
    Field("format", Kind.STR, f"always {FORMAT_NAME!r}", choices=(FORMAT_NAME,)),
    Field("format_version", Kind.INT, "the layout version; bumped on any change a reader of the previous one "
          "would misread (see Versions)", lo=1, hi=1 << 16),
    Field("config_hash", Kind.STR, "sha256 of ``identity`` as canonical JSON (sorted keys, no spaces)"),
    Field("identity", Kind.OBJECT, "everything that changes a stored value or the layout (hashed into "
          "config_hash); a resume with any difference is refused"),
    Field("identity.target", Kind.OBJECT, "the target: path, model type, config and weight fingerprints, revision, "
          "attention implementation"),
    Field("identity.target.path", Kind.STR, "hub id or local directory of the target"),
    Field("identity.data", Kind.OBJECT, "the data: path, content sha256, selection, mask options"),
    Field("identity.data.path", Kind.ANY, "data.path"),
    Field("identity.data.split", Kind.ANY, "data.split"),
    Field("identity.data.shuffle_seed", Kind.ANY, "data.shuffle_seed", null=True),
    Field("identity.data.mask_reasoning_content", Kind.ANY, "data.mask_reasoning_content"),
    Field("config", Kind.OBJECT, "the resolved run configuration (to rebuild the run: verify --recompute)",
          required=False),
    Field("target_model", Kind.STR, "the target's path or hub id, as given"),
    Field("target_model_type", Kind.STR, "its transformers model type"),
    Field("target_vocab_size", Kind.INT, "rows of its embedding and lm_head", lo=1, hi=MAX_VOCAB_SIZE),
    Field("num_hidden_layers", Kind.INT, "decoder layers N", lo=1, hi=MAX_NUM_LAYERS),
    Field("hidden_size", Kind.INT, "H, the width of every hidden-state array", lo=1, hi=MAX_HIDDEN_SIZE),
    Field("layer_ids", Kind.INTS, "captured layer ids, strictly increasing in [-1, N-1]: id i is decoder layer i's "
          "output, -1 the embeddings, N-1 the post-final-norm state"),
    Field("seq_length", Kind.INT, "the longest sample, in tokens", lo=1, hi=MAX_SEQ_LENGTH),
    Field("storage_dtype", Kind.STR, "storage dtype of the captured layers", choices=_DTYPES),
    Field("last_dtype", Kind.STR, "storage dtype of the final states (post- and pre-norm) when it differs from "
          "storage_dtype", required=False, null=True, choices=_DTYPES),
    Field("fp8_group", Kind.INT, "channels per fp8 scale (absent: one scale per token)", required=False, null=True,
          lo=1, hi=MAX_HIDDEN_SIZE),
    Field("chat_template", Kind.STR, "the Jinja chat template the samples were rendered with"),
    Field("arrays", Kind.NAMES, "layer id (as a string) -> hidden array; ``last``: the post-norm state; "
          "``pre_norm``: the last decoder output before the final norm"),
    Field("layout", Kind.OBJECT, "where units and chunks lie on the token axis"),
    Field("layout.chunk_tokens", Kind.INT, "rows per inner chunk (the unit of decoding)", lo=1, hi=MAX_CHUNK_TOKENS),
    Field("layout.unit_tokens", Kind.INT, "token slots per commit unit; in format 2 also per shard: unit u owns "
          "slots [u x unit_tokens, (u+1) x unit_tokens)", lo=1, hi=MAX_TOKEN_SLOTS),
    Field("layout.num_units", Kind.INT, "commit units (format 2: shards per token array)", lo=0, hi=MAX_TOKEN_SLOTS),
    Field("layout.total_token_slots", Kind.INT, "length of the token axis: to the last unit's last chunk",
          lo=0, hi=MAX_TOKEN_SLOTS),
    Field("counts", Kind.OBJECT, "how the input rows were accounted for: rows_in = samples + rejected"),
    Field("counts.rows_in", Kind.INT, "rows of the input selection", lo=_TOKENS[0], hi=_TOKENS[1]),
    Field("counts.samples", Kind.INT, "readable samples", lo=_TOKENS[0], hi=_TOKENS[1]),
    Field("counts.rejected", Kind.INT, "rows in rejects.jsonl", lo=_TOKENS[0], hi=_TOKENS[1]),
    Field("counts.tokens", Kind.INT, "real tokens of the readable samples", lo=_TOKENS[0], hi=_TOKENS[1]),
    Field("counts.supervised_tokens", Kind.INT, "tokens with loss_mask 1", lo=_TOKENS[0], hi=_TOKENS[1]),
    Field("counts.truncated_samples", Kind.INT, "samples cut at seq_length", lo=_TOKENS[0], hi=_TOKENS[1]),
    Field("counts.rejected_by_reason", Kind.COUNTS, "reject reason -> rows", required=False),
    Field("complete", Kind.BOOL, "every unit is committed and the run finished; readers refuse an incomplete "
          "cache unless asked"),
    Field("tokens_stored", Kind.BOOL, "input_ids and loss_mask of every unit are written (a resume reads them "
          "instead of tokenizing again)", since=2),
    Field("tied_embeddings", Kind.BOOL, "the target ties lm_head to the embedding", required=False),
    Field("pad_token_id", Kind.INT, "the tokenizer's pad id", required=False, null=True, lo=0, hi=MAX_VOCAB_SIZE),
    Field("eos_token_id", Kind.INT, "the tokenizer's eos id", required=False, null=True, lo=0, hi=MAX_VOCAB_SIZE),
    Field("tool_version", Kind.STR, "dspark-precompute's version", required=False),
    Field("created_at", Kind.STR, "UTC time the cache was allocated", required=False),
    Field("updated_at", Kind.STR, "UTC time of the last manifest write", required=False),
    Field("completed_at", Kind.STR, "UTC time the run finished", required=False, null=True),
    Field("timing", Kind.SECONDS, "seconds per stage of the run that finished it", required=False, null=True),
    Field("weights_sha256", Kind.SHA256, f"sha256 of {WEIGHTS}", required=False, null=True),
    Field("dropped_samples", Kind.INTS, "stored samples whose states were not finite: never readable, counted as "
          "rejects", required=False, null=True),
    Field("nonfinite_values", Kind.COUNTS, "hidden array -> NaN/Inf values found (all in dropped samples)",
          required=False, null=True),
    Field("capture", Kind.OBJECT, "how the stored values were made", required=False, null=True),
    Field("capture.last_state", Kind.STR, "which final states are stored (format 1: post_final_norm)",
          required=False, null=True),
    Field("capture.final_norm_class", Kind.STR, "class of the target's final norm", required=False, null=True),
    Field("capture.layer_preset", Kind.STR, "nemo | servable | explicit", required=False, null=True),
    Field("capture.mask", Kind.OBJECT, "which rule made the loss masks", required=False, null=True),
    Field("capture.mask.rule", Kind.STR, "generation_template | nemo_prefix | deepspec | specforge", required=False,
          null=True),
    Field("capture.mask.fallback", Kind.STR, "full_render_alignment (nemo_prefix: turns a template rewrites)",
          required=False, null=True),
    Field("capture.mask.mask_reasoning_content", Kind.BOOL, "reasoning tokens unsupervised", required=False,
          null=True),
    Field("capture.mask.mask_generation_prompt", Kind.BOOL, "assistant headers unsupervised", required=False,
          null=True),
    Field("capture.mask.default_system_prompt", Kind.STR, "deepspec, specforge: the system prompt added to "
          "conversations without one", required=False, null=True),
    Field("capture.mask.min_supervised_tokens", Kind.INT, "deepspec, specforge: fewer supervised tokens make a "
          "reject",
          required=False, null=True, lo=0, hi=MAX_SEQ_LENGTH),
    Field("capture.target_weights_dtype", Kind.STR, "the checkpoint's floating dtype", required=False, null=True),
    Field("capture.weights_fingerprint", Kind.STR, "the identity's fingerprint of every weight file",
          required=False, null=True),
    Field("capture.fingerprint_kind", Kind.STR, "full | sampled", required=False, null=True),
    Field("capture.stream_reduction", Kind.STR, "mean: a layer emitting several hyper-connection streams (DeepSeek "
          "V4) is stored as their mean, NeMo AutoModel's rule; absent: one stream", required=False, null=True),
    Field("capture.attn_implementation", Kind.STR, "the attention implementation the target ran with (sdpa, eager, "
          "...; model.attn_implementation=auto chooses it from the class)", required=False, null=True),
    Field("capture.target_part", Kind.OBJECT, "what of an image-text checkpoint was loaded for text rows; absent: "
          "the whole causal LM", required=False, null=True),
    Field("capture.target_part.loaded", Kind.STR, "the module loaded (model.language_model)", required=False,
          null=True),
    Field("capture.target_part.checkpoint_class", Kind.STR, "the checkpoint's class (Qwen3VLForConditionalGeneration, "
          "...)", required=False, null=True),
    Field("capture.target_part.skipped_modules", Kind.STRS, "modules not built, their tensors not read "
          "(model.visual, ...)", required=False, null=True),
    Field("capture.target_part.skipped_bytes", Kind.INT, "stored bytes of the tensors left unread (the vision tower, "
          "an MTP head)", required=False, null=True, lo=0),
    Field("provenance", Kind.OBJECT, "which command, software and hosts wrote the cache (never hashed)",
          required=False, null=True),
    Field("provenance.argv", Kind.STRS, "command line of the run that finished it", required=False, null=True),
    Field("provenance.overrides", Kind.STRS, "its Hydra overrides", required=False, null=True),
    Field("provenance.versions", Kind.NAMES, "package -> version", required=False, null=True),
    Field("provenance.hosts", Kind.STRS, "every host that wrote a unit", required=False, null=True),
    Field("provenance.world_size", Kind.INT, "ranks of the finishing run", required=False, null=True, lo=1,
          hi=1 << 24),
    Field("provenance.regeneration", Kind.OBJECT, "regenerate=server: the engine and its version, the served "
          "model and its weights fingerprint, the sampling, the regenerated file's path and sha256, the counts",
          required=False, null=True),
    Field("provenance.parallel", Kind.COUNTS, "the finishing run's sharded layout of the target (fsdp, ep, tp: "
          "never a stored value's cause); absent: one copy per rank", required=False, null=True),
    Field("media", Kind.OBJECT, "image caches only (absent for text caches): what a consumer needs to use the "
          "image positions", required=False, null=True, since=3),
    Field("media.image_token_id", Kind.INT, "the image pad id (one per merged patch)", lo=0, hi=MAX_VOCAB_SIZE,
          since=3),
    Field("media.vision_token_ids", Kind.INTS, "every vision token id (pads and the start/end markers; loss mask "
          "0)", since=3),
    Field("media.position_axes", Kind.INT, "axes of position_ids (3 for Qwen's M-RoPE); 0: the model has no "
          "multi-axis positions and no position_ids array is stored", lo=0, hi=MAX_POSITION_AXES, since=3),
    Field("media.samples_with_images", Kind.INT, "stored samples holding at least one image", lo=_TOKENS[0],
          hi=_TOKENS[1], since=3),
    Field("media.images", Kind.INT, "rows of the images/* tables (every image kept after truncation)",
          lo=_TOKENS[0], hi=_TOKENS[1], since=3),
    Field("media.spatial_merge_size", Kind.INT, "patches merged per side into one image pad: a sample holds "
          "sum(t x h x w) / merge^2 pads", lo=1, hi=1 << 10, since=3),
    Field("media.video_token_id", Kind.INT, "caches with videos only: the video pad id (one per merged patch of a "
          "frame pair)", required=False, lo=0, hi=MAX_VOCAB_SIZE, since=3),
    Field("media.samples_with_videos", Kind.INT, "caches with videos only: stored samples holding at least one "
          "video", required=False, lo=_TOKENS[0], hi=_TOKENS[1], since=3),
    Field("media.videos", Kind.INT, "caches with videos only: rows of the videos/* tables (every video kept after "
          "truncation); absent: no videos/* tables", required=False, lo=_TOKENS[0], hi=_TOKENS[1], since=3),
    Field("bytes_per_token", Kind.INT, "raw bytes per real token (ids, mask, hidden arrays, fp8 scales)",
          required=False, derived=True),
    Field("target_hidden_dim", Kind.INT, "H x len(layer_ids) (NeMo's name)", required=False, derived=True),
    Field("target_last_hidden_dim", Kind.INT, "H (NeMo's name)", required=False, derived=True),
    Field("hidden_storage", Kind.OBJECT, "per hidden array: storage, disk and logical dtype, and an fp8 array's "
          "scale array", required=False, derived=True),
)
_BY_KEY = {f.key: f for f in FIELDS}


def fields_markdown() -> str:
    """The field table of docs/format.md, from :data:`FIELDS`."""
    rows = ["| key | type | required | since | meaning |", "| --- | --- | --- | --- | --- |"]
    for f in FIELDS:
        kind = f.kind.value + (f" in [{f.lo}, {f.hi}]" if f.lo is not None else "")
        kind += f"; one of {', '.join(f.choices)}" if f.choices else ""
        kind += " or null" if f.null else ""
        need = "derived" if f.derived else "yes" if f.required else "no"
        rows.append(f"| `{f.key}` | {kind} | {need} | {f.since} | {f.doc} |")
    return "\n".join(rows) + "\n"


# -- the typed record ---------------------------------------------------------------------------
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


def _record(cls: type, data: dict[str, Any]) -> Any:
    """A record dataclass from its checked JSON object (keys this version does not know are dropped)."""
    return cls(**{f.name: data.get(f.name, f.default if f.default is not dataclasses.MISSING else None)
                  for f in dataclasses.fields(cls)})


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


@dataclass(frozen=True)
class MaskPolicy:
    """Which rule made the loss masks, and the mask options (a trainer's answer to "what is supervised?").

    ``rule``: ``generation_template`` (the template's own ``{% generation %}`` assistant mask)
    or ``nemo_prefix`` (NeMo's prefix rule: each assistant turn from its role header to its
    end-of-turn token). ``fallback``: with ``nemo_prefix``, ``full_render_alignment``, how a
    turn is located where the template rewrites earlier turns and the prefix rule breaks.
    ``deepspec`` (``data.mask_rule=deepspec``): DeepSpec's rule, each assistant turn's content
    and end-of-turn marker without its header, ``default_system_prompt`` added to conversations
    without one, samples under ``min_supervised_tokens`` rejected. ``specforge``
    (``data.mask_rule=specforge``): the same spans after SpecForge's message reduction.
    """

    rule: str | None = None
    fallback: str | None = None
    mask_reasoning_content: bool | None = None
    mask_generation_prompt: bool | None = None
    default_system_prompt: str | None = None  # deepspec/specforge: the system prompt added where there is none
    min_supervised_tokens: int | None = None  # deepspec/specforge: fewer supervised tokens make a reject


@dataclass(frozen=True)
class Capture:
    """How the stored values were made: what a trainer needs to trust the cache without guessing.

    Every field follows from inputs the identity already hashes (the target's config and
    weights, the template, the mask options, the layer ids, ``capture.last_state``), so none of
    it is hashed itself. ``final_norm_class`` comes from the loaded model: it is set once a run
    has loaded it.
    """

    last_state: str | None = None  # a LastState value (format 1: "post_final_norm")
    final_norm_class: str | None = None  # e.g. Qwen3RMSNorm
    layer_preset: str | None = None  # nemo | servable | explicit (model.layer_ids given)
    mask: MaskPolicy | None = None
    target_weights_dtype: str | None = None  # the checkpoint's floating dtype (safetensors headers, else config)
    weights_fingerprint: str | None = None  # the identity's fingerprint of every weight file
    fingerprint_kind: str | None = None  # full (every byte) or sampled
    stream_reduction: str | None = None  # mean: a layer's hyper-connection streams averaged (DeepSeek V4, NeMo's rule)
    attn_implementation: str | None = None  # the attention the target ran with (sdpa, eager, ...)
    target_part: dict[str, Any] | None = None  # image-text checkpoint: its part loaded, the modules and bytes left out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Capture:
        kw = {f.name: d.get(f.name) for f in dataclasses.fields(cls)}
        mask = d.get("mask")
        kw["mask"] = _record(MaskPolicy, mask) if isinstance(mask, dict) else None
        return cls(**kw)


@dataclass(frozen=True)
class MediaInfo:
    """An image cache's media facts: the vision token ids, the stored position axes, how many images it holds."""

    image_token_id: int
    vision_token_ids: list[int]
    position_axes: int  # 0: no position_ids array (the model has no multi-axis positions)
    samples_with_images: int
    images: int
    spatial_merge_size: int = 2
    video_token_id: int | None = None  # a cache with videos: the video pad, its counts, its videos/* tables
    samples_with_videos: int | None = None
    videos: int | None = None


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
    # regenerate=server: the engine, its version, the served model and its weights' fingerprint, the sampling,
    # the regenerated file and its sha256, and the counts (write/regenerate/stage.py builds it)
    regeneration: dict[str, Any] | None = None
    parallel: dict[str, int] | None = None  # the finishing run's sharded layout (fsdp, ep, tp); absent: one copy

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RunProvenance:
        """From its JSON value (keys this version does not know are dropped)."""
        regeneration, par = d.get("regeneration"), d.get("parallel")
        return cls(argv=d.get("argv"), overrides=d.get("overrides"), versions=dict(d.get("versions") or {}),
                   hosts=list(d.get("hosts") or []), world_size=d.get("world_size"),
                   regeneration=dict(regeneration) if isinstance(regeneration, dict) else None,
                   parallel=dict(par) if isinstance(par, dict) else None)

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


# top-level fields written only when set (caches without them keep reading)
_OMIT_WHEN_NONE = tuple(f.key for f in FIELDS if "." not in f.key and f.null)


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
    format_version: int = FORMAT_VERSION
    tokens_stored: bool = False  # format 2: every unit's input_ids and loss_mask are written
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
    # the final states' storage dtype when it differs from storage_dtype (fp8 caches keep them bf16)
    last_dtype: str | None = None
    fp8_group: int | None = None  # channels per fp8 scale; null: one scale per token (the whole row)
    media: MediaInfo | None = None  # an image cache: vision ids, position axes, image counts (absent: text only)

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
    def dtype(self) -> StorageDtype:
        return StorageDtype(self.storage_dtype)

    @property
    def last_storage_dtype(self) -> StorageDtype:
        """The storage dtype of the final states (``last_dtype``, else ``storage_dtype``)."""
        return StorageDtype(self.last_dtype or self.storage_dtype)

    @property
    def array_dtypes(self) -> dict[str, StorageDtype]:
        """Storage dtype of each hidden array (the final states' may differ from the others')."""
        return array_dtypes(self.arrays, self.storage_dtype, self.last_dtype)

    @property
    def scale_arrays(self) -> dict[str, str]:
        """fp8 state array -> its scale array (``hidden_scales/...``), for every array stored as fp8."""
        return {name: scale_array(name) for name, d in self.array_dtypes.items() if d.is_fp8}

    @property
    def scale_columns(self) -> int:
        """Scales per token of each fp8 array: hidden_size / fp8_group (1: one per token)."""
        return scale_columns(self.hidden_size, self.fp8_group)

    @property
    def output_dtype(self) -> StorageDtype:
        """The dtype a reader returns ``target_hidden_states`` in (fp8 is dequantized to bf16)."""
        return self.dtype.output

    @property
    def last_output_dtype(self) -> StorageDtype:
        """The dtype a reader returns ``target_last_hidden_states`` (and the pre-norm state) in."""
        return self.last_storage_dtype.output

    def hidden_storage(self) -> dict[str, dict[str, Any]]:
        """Per hidden array: storage, on-disk and logical dtype, and an fp8 array's scale array (for other tools)."""
        return _hidden_storage(self.array_dtypes, self.scale_columns, self.fp8_group or self.hidden_size)

    @property
    def hidden_array_names(self) -> list[str]:
        """Every stored hidden-state array once (the last layer and ``last`` may be the same array)."""
        return list(dict.fromkeys(self.arrays.values()))

    @property
    def last_array(self) -> str | None:
        """The array of the post-norm state the trainer applies lm_head to (None: only the pre-norm state)."""
        return self.arrays.get(LAST)

    @property
    def pre_norm_array(self) -> str | None:
        """The array of the last decoder output before the final norm, when stored."""
        return self.arrays.get(PRE_NORM)

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
        out: dict[str, Any] = {"format": FORMAT_NAME}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is None and f.name in _OMIT_WHEN_NONE:
                continue
            if f.name == "tokens_stored" and self.format_version < 2:
                continue
            if isinstance(v, RunProvenance):
                out[f.name] = v.to_json()
            elif isinstance(v, MediaInfo):  # the video keys only where the cache holds videos
                out[f.name] = {k: x for k, x in dataclasses.asdict(v).items() if x is not None}
            elif dataclasses.is_dataclass(v) and not isinstance(v, type):
                out[f.name] = dataclasses.asdict(v)
            else:
                out[f.name] = v
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
        kw["layout"] = _record(ManifestLayout, data["layout"])
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
        if isinstance(data.get("media"), dict):
            kw["media"] = _record(MediaInfo, data["media"])
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
        """Atomically (the store writes a temporary, fsyncs it and renames it)."""
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


def _hidden_storage(dtypes: dict[str, StorageDtype], columns: int, group: int) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name, d in dtypes.items():
        entry: dict[str, Any] = {"dtype": d.value, "disk_dtype": d.disk.name, "logical_dtype": d.logical}
        if d.is_fp8:
            entry.update(scale_array=scale_array(name), scale_dtype=SCALE_DTYPE.name, scale_columns=columns,
                         channels_per_scale=group)
        out[name] = entry
    return out


# -- checks of the raw JSON ---------------------------------------------------------------------
def _kind(v: Any) -> str:
    return {bool: "a boolean", int: "an integer", str: "a string", float: "a float", list: "a list",
            dict: "an object", type(None): "null"}.get(type(v), type(v).__name__)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


_KIND_CHECKS: dict[Kind, Callable[[Any], bool]] = {
    Kind.INT: is_int,
    Kind.STR: lambda v: isinstance(v, str),
    Kind.BOOL: lambda v: isinstance(v, bool),
    Kind.OBJECT: lambda v: isinstance(v, dict),
    Kind.INTS: lambda v: isinstance(v, list) and all(is_int(x) for x in v),
    Kind.STRS: lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
    Kind.SHA256: lambda v: isinstance(v, str) and len(v) == 64 and set(v) <= set("0123456789abcdef"),
    Kind.COUNTS: lambda v: isinstance(v, dict) and all(isinstance(k, str) and is_int(x) and x >= 0
                                                       for k, x in v.items()),
    Kind.NAMES: lambda v: isinstance(v, dict) and all(isinstance(x, str) for x in v.values()),
    Kind.SECONDS: lambda v: isinstance(v, dict) and all(_is_number(x) for x in v.values()),
    Kind.ANY: lambda v: True,
}


def _lookup(data: dict[str, Any], key: str) -> tuple[bool, Any]:
    """(present, value) of a dotted key; absent when any parent is absent or not an object."""
    node: Any = data
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _field_problem(f: Field, data: dict[str, Any], version: int) -> str | None:
    """What is wrong with one field of the table in ``data`` (the table's own checks), or None."""
    parent_ok = not f.parent or isinstance(_lookup(data, f.parent)[1], dict)
    present, v = _lookup(data, f.key)
    if not present:
        return f"manifest lacks {f.key!r}" if f.required and version >= f.since and parent_ok else None
    if v is None:
        return None if f.null else f"manifest {f.key} = None (null) must be {f.kind.value}"
    if not _KIND_CHECKS[f.kind](v):
        return f"manifest {f.key} = {v!r:.80} ({_kind(v)}) must be {f.kind.value}" + (" or null" if f.null else "")
    if f.choices and v not in f.choices:
        return f"manifest {f.key} = {v!r:.80} is unknown (one of {[str(c) for c in f.choices]})"
    if f.lo is not None and f.hi is not None and not f.lo <= int(v) <= f.hi:
        return f"manifest {f.key} = {int(v)} is outside [{f.lo}, {f.hi}] ({f.doc})"
    return None


class _Checked:
    """The raw manifest after the table's checks: which keys passed, for the cross-field rules."""

    def __init__(self, data: dict[str, Any], bad: set[str]):
        self.data, self.bad = data, bad
        v: Any = data.get("format_version")
        self.version: int = int(v) if is_int(v) else FORMAT_VERSION

    def ok(self, *keys: str) -> bool:
        """Every key present and valid (a rule that needs them may run)."""
        return all(_lookup(self.data, k)[0] and k not in self.bad for k in keys)

    def __getitem__(self, key: str) -> Any:
        return _lookup(self.data, key)[1]

    def get(self, key: str, default: Any = None) -> Any:
        present, v = _lookup(self.data, key)
        return v if present and key not in self.bad else default


def _rule_version(c: _Checked) -> list[str]:
    """This version reads the format versions it knows (a newer one needs a newer reader)."""
    v = c.data.get("format_version")
    if v in READABLE_FORMATS or "format_version" in c.bad and not is_int(v):
        return []
    return [f"format_version {v!r} is not supported (this reader reads {list(READABLE_FORMATS)}); upgrade "
            "dspark-precompute or re-create the cache"]


def _rule_fp8_group(c: _Checked) -> list[str]:
    """fp8_group applies only to a cache with an fp8 array, and divides the hidden size."""
    group = c.get("fp8_group")
    if group is None or not c.ok("storage_dtype", "hidden_size"):
        return []
    dtypes = (c["storage_dtype"], c.get("last_dtype"))
    if StorageDtype.fp8_e4m3 not in dtypes:
        return [f"manifest fp8_group = {group!r} but no array is stored as fp8_e4m3 (storage_dtype "
                f"{c['storage_dtype']!r}, last_dtype {c.get('last_dtype')!r})"]
    if int(c["hidden_size"]) % int(group):
        return [f"manifest fp8_group = {group} does not divide hidden_size = {c['hidden_size']} (each scale covers a "
                "whole group of channels)"]
    return []


def _rule_layer_ids(c: _Checked) -> list[str]:
    """layer_ids: at least one, strictly increasing, in [-1, N-1]."""
    if not c.ok("layer_ids"):
        return []
    ids = c["layer_ids"]
    if not ids:
        return ["manifest layer_ids is empty: a cache captures at least one layer"]
    if any(b <= a for a, b in zip(ids, ids[1:])):
        return [f"manifest layer_ids = {ids} must be strictly increasing"]
    if c.ok("num_hidden_layers") and not all(-1 <= i < int(c["num_hidden_layers"]) for i in ids):
        top = int(c["num_hidden_layers"]) - 1
        return [f"manifest layer_ids = {ids} must lie in [-1, num_hidden_layers - 1 = {top}]"]
    return []


def _rule_array_names(c: _Checked) -> list[str]:
    """The arrays are exactly the naming rule's for these layer ids (so no layer is read under a wrong id)."""
    if not c.ok("arrays"):
        return []
    arrays = c["arrays"]
    bad = [f"manifest arrays[{k!r}] = {v!r:.80} is not an array under {HIDDEN_GROUP}/ (names are "
           f"{HIDDEN_GROUP}/layer_<i>, {HIDDEN_GROUP}/embeddings, {HIDDEN_GROUP}/{FINAL_NORM} or "
           f"{HIDDEN_GROUP}/{PRE_NORM}); the manifest was altered"
           for k, v in arrays.items() if not v.startswith(f"{HIDDEN_GROUP}/") or ".." in v or "\\" in v
           or v.count("/") != 1]
    if bad or not c.ok("layer_ids", "num_hidden_layers") or _rule_layer_ids(c):
        return bad
    ids, n = [int(i) for i in c["layer_ids"]], int(c["num_hidden_layers"])
    if c.version < 2 and LAST not in arrays:
        return [f"manifest arrays lacks {LAST!r} (format 1 always stores the post-norm state)"]
    want = hidden_arrays(ids, n, post_norm=LAST in arrays, pre_norm=PRE_NORM in arrays)
    return [f"manifest arrays[{k!r}] = {arrays.get(k)!r}, but the naming rule gives {want.get(k)!r} for layer_ids "
            f"{ids} of {n} layers: the manifest was altered (layers would be read under the wrong id). Re-create "
            "the cache" for k in sorted(want.keys() | arrays.keys()) if arrays.get(k) != want.get(k)]


def _itemsize(c: _Checked) -> int:
    return max(StorageDtype(d).disk.itemsize for d in (c["storage_dtype"], c.get("last_dtype") or c["storage_dtype"]))


def _rule_layout(c: _Checked) -> list[str]:
    """Units tile the token axis as the format says; no chunk is larger than a reader decodes at once."""
    keys = ("layout.chunk_tokens", "layout.unit_tokens", "layout.num_units", "layout.total_token_slots")
    if not c.ok(*keys):
        return []
    ct, ut, nu, total = (int(c[k]) for k in keys)
    p = []
    if c.version >= 2:
        if ut % ct or ut // ct > MAX_SHARD_CHUNKS:
            p.append(f"manifest layout.unit_tokens = {ut} is not a multiple of layout.chunk_tokens = {ct} within "
                     f"{MAX_SHARD_CHUNKS} chunks (a shard holds whole chunks)")
        in_last_shard = (nu - 1) * ut < total <= nu * ut if nu else total == 0
        if total % ct or not in_last_shard:
            p.append(f"manifest layout.total_token_slots = {total} does not end in the last of layout.num_units = "
                     f"{nu} shards of layout.unit_tokens = {ut} on a chunk boundary (one shard per unit)")
    else:
        if total % ct:
            p.append(f"manifest layout.total_token_slots = {total} is not a multiple of layout.chunk_tokens = {ct} "
                     "(units own whole chunks)")
        if (nu == 0) != (total == 0) or nu > total:
            p.append(f"manifest layout.num_units = {nu} cannot fill layout.total_token_slots = {total}")
    if c.ok("hidden_size", "storage_dtype"):
        chunk_bytes = ct * int(c["hidden_size"]) * _itemsize(c)
        if chunk_bytes > MAX_CHUNK_BYTES:
            p.append(f"manifest layout.chunk_tokens = {ct} x hidden_size = {c['hidden_size']} x {_itemsize(c)} bytes "
                     f"makes {chunk_bytes:,}-byte chunks, more than a reader decodes at once ({MAX_CHUNK_BYTES:,}); "
                     "the manifest is damaged or the cache was not written by this tool")
    return p


def _rule_sample_bytes(c: _Checked) -> list[str]:
    """One sample padded to seq_length fits what a reader allocates for it."""
    if not c.ok("hidden_size", "storage_dtype", "seq_length", "layer_ids"):
        return []
    fp8 = StorageDtype.fp8_e4m3 in (c["storage_dtype"], c.get("last_dtype"))
    per_token = (len(c["layer_ids"]) + 2) * int(c["hidden_size"]) * (_itemsize(c) + (4 if fp8 else 0)) + 5
    per_sample = int(c["seq_length"]) * per_token
    if per_sample <= MAX_SAMPLE_BYTES:
        return []
    return [f"manifest seq_length = {c['seq_length']} x hidden_size = {c['hidden_size']} makes one padded sample "
            f"{per_sample:,} bytes, more than a reader allocates for one sample ({MAX_SAMPLE_BYTES:,}); the "
            "manifest is damaged"]


def _rule_derived(c: _Checked) -> list[str]:
    """The derived fields (written for other tools) agree with the fields they come from."""
    if not c.ok("hidden_size", "storage_dtype", "arrays", "layer_ids") or _rule_array_names(c) or _rule_fp8_group(c):
        return []
    hidden, group = int(c["hidden_size"]), c.get("fp8_group")
    dtypes = array_dtypes(c["arrays"], c["storage_dtype"], c.get("last_dtype"))
    cols = scale_columns(hidden, group)
    want = {"bytes_per_token": hidden_bytes_per_token(hidden, list(dtypes.values()), cols) + 5,
            "hidden_storage": _hidden_storage(dtypes, cols, group or hidden),
            "target_hidden_dim": hidden * len(c["layer_ids"]), "target_last_hidden_dim": hidden}
    return [f"manifest {k} = {c.data[k]!r:.160} disagrees with the fields it is derived from, which give "
            f"{v!r:.160}; the manifest was altered" for k, v in want.items() if k in c.data and c.data[k] != v]


def _rule_counts(c: _Checked) -> list[str]:
    """The counts add up: rows_in = samples + rejected, per-reason counts sum to rejected, tokens in range."""
    got = {k: int(c[f"counts.{k}"]) for k in ("rows_in", "samples", "rejected", "tokens", "supervised_tokens",
                                              "truncated_samples") if c.ok(f"counts.{k}")}
    p = []
    by = c.get("counts.rejected_by_reason") or {}
    if by and "rejected" in got and sum(by.values()) != got["rejected"]:
        p.append(f"manifest counts.rejected_by_reason sums to {sum(by.values())}, counts.rejected is {got['rejected']}")
    if {"rows_in", "samples", "rejected"} <= got.keys() and got["rows_in"] != got["samples"] + got["rejected"]:
        p.append(f"manifest counts.rows_in = {got['rows_in']}, but samples + rejected = "
                 f"{got['samples'] + got['rejected']} (every input row is a sample or a reject)")
    if {"tokens", "samples"} <= got.keys() and not got["samples"] <= got["tokens"]:
        p.append(f"manifest counts.tokens = {got['tokens']} is below counts.samples = {got['samples']} (every sample "
                 "has a token)")
    if {"tokens", "samples"} <= got.keys() and c.ok("seq_length") and got["tokens"] > got["samples"] * int(
            c["seq_length"]):
        p.append(f"manifest counts.tokens = {got['tokens']} exceeds samples x seq_length")
    if {"tokens", "supervised_tokens"} <= got.keys() and got["supervised_tokens"] > got["tokens"]:
        p.append(f"manifest counts.supervised_tokens = {got['supervised_tokens']} exceeds counts.tokens = "
                 f"{got['tokens']}")
    if {"truncated_samples", "samples"} <= got.keys() and got["truncated_samples"] > got["samples"]:
        p.append(f"manifest counts.truncated_samples = {got['truncated_samples']} exceeds counts.samples")
    return p


def _rule_dropped(c: _Checked) -> list[str]:
    """Dropped samples are increasing sample ids inside the tables, and the samples fit the layout."""
    dropped: list[int] = c.get("dropped_samples") or []
    p: list[str] = []
    if dropped and (not all(0 <= i < MAX_TOKEN_SLOTS for i in dropped)
                    or any(b <= a for a, b in zip(dropped, dropped[1:]))):
        return [f"manifest dropped_samples = {dropped!r:.80} must be increasing sample ids"]
    if not c.ok("counts.samples"):
        return p
    stored = int(c["counts.samples"]) + len(dropped)
    if dropped and dropped[-1] >= stored:
        p.append(f"manifest dropped_samples names sample {dropped[-1]}, but the tables hold {stored} "
                 "(counts.samples + dropped)")
    if c.ok("layout.num_units", "layout.total_token_slots"):
        nu, total = int(c["layout.num_units"]), int(c["layout.total_token_slots"])
        if not nu <= stored <= total or (stored == 0) != (nu == 0):
            extra = f" (+ {len(dropped)} dropped)" if dropped else ""
            p.append(f"manifest counts.samples = {c['counts.samples']}{extra} does not fit layout.num_units = {nu} "
                     f"and layout.total_token_slots = {total}")
        if c.ok("counts.tokens") and int(c["counts.tokens"]) > total:
            p.append(f"manifest counts.tokens = {c['counts.tokens']} exceeds layout.total_token_slots = {total}")
    return p


def _rule_capture(c: _Checked) -> list[str]:
    """Format 2 names its final states with the LastState vocabulary, consistent with the arrays."""
    state = c.get("capture.last_state")
    if c.version < 2 or state is None:
        return []
    if state not in tuple(LastState):
        return [f"manifest capture.last_state = {state!r} is unknown (one of {[s.value for s in LastState]})"]
    arrays = c.get("arrays") or {}
    if LastState(state).pre != (PRE_NORM in arrays):
        return [f"manifest capture.last_state = {state!r} but arrays {'lacks' if LastState(state).pre else 'has'} "
                f"{PRE_NORM!r}"]
    return []


def _rule_media(c: _Checked) -> list[str]:
    """An image cache's counts: images >= samples with images, which are stored samples; the image pad a vision id."""
    keys = ("media.samples_with_images", "media.images")
    if not c.ok(*keys):
        return []
    with_images, images = int(c["media.samples_with_images"]), int(c["media.images"])
    p = []
    if images < with_images or (with_images == 0) != (images == 0):
        p.append(f"manifest media.images = {images} cannot fill media.samples_with_images = {with_images} (each such "
                 "sample holds at least one image)")
    if c.ok("counts.samples"):
        stored = int(c["counts.samples"]) + len(c.get("dropped_samples") or [])
        if with_images > stored:
            p.append(f"manifest media.samples_with_images = {with_images} exceeds the {stored} stored samples")
    if c.ok("media.image_token_id", "media.vision_token_ids") and c["media.image_token_id"] not in c[
            "media.vision_token_ids"]:
        p.append(f"manifest media.image_token_id = {c['media.image_token_id']} is not among media.vision_token_ids")
    vkeys = ("media.samples_with_videos", "media.videos", "media.video_token_id")
    present = [k for k in vkeys if c.get(k) is not None]
    if present and len(present) != len(vkeys):
        p.append(f"manifest names {present} but not {[k for k in vkeys if k not in present]} (a cache with videos "
                 "records all three)")
    elif present and c.ok(*vkeys):
        with_videos, videos = int(c["media.samples_with_videos"]), int(c["media.videos"])
        if videos < with_videos or (with_videos == 0) != (videos == 0):
            p.append(f"manifest media.videos = {videos} cannot fill media.samples_with_videos = {with_videos} (each "
                     "such sample holds at least one video)")
        if c.ok("media.vision_token_ids") and c["media.video_token_id"] not in c["media.vision_token_ids"]:
            p.append(f"manifest media.video_token_id = {c['media.video_token_id']} is not among "
                     "media.vision_token_ids")
    return p


RULES: tuple[Callable[[_Checked], list[str]], ...] = (
    _rule_version, _rule_fp8_group, _rule_layer_ids, _rule_array_names, _rule_layout, _rule_sample_bytes,
    _rule_derived, _rule_counts, _rule_dropped, _rule_capture, _rule_media,
)


def manifest_problems(manifest: Any) -> list[str]:
    """Every problem with a manifest's structure, field types and ranges (not just the first).

    Each field of :data:`FIELDS` is checked for presence, type, range and choices; then each
    rule of :data:`RULES` checks what ties fields together (the array names against the naming
    rule, counts and layout against each other), using only fields that passed. An empty list
    means the values are safe to compute with; the tables and arrays are checked against them
    by ``table_problems`` and ``array_meta_problems``.
    """
    if not isinstance(manifest, dict):
        return [f"manifest.json is not a JSON object (it holds {_kind(manifest)}); it is damaged or not a "
                "dspark-precompute manifest"]
    v: Any = manifest.get("format_version")
    version = int(v) if is_int(v) else FORMAT_VERSION
    problems: list[str] = []
    bad: set[str] = set()
    for f in FIELDS:
        problem = _field_problem(f, manifest, version)
        if problem:
            problems.append(problem)
            bad.add(f.key)
    checked = _Checked(manifest, bad)
    for rule in RULES:
        problems += rule(checked)
    return problems
