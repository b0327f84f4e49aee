"""Every closed vocabulary of the cache contract, one ``StrEnum`` each.

A value read from a manifest, a config or a pipe is one of these, never a bare string
compared in several places. Each member's value is the string written to disk (so a
``StrEnum`` member is usable wherever its string is, JSON included), and a vocabulary
that implies more (a storage dtype's disk dtype, its logical name, its torch dtype) carries
it here, so no other module keeps a table of its own.
"""

from __future__ import annotations

from enum import StrEnum

import numpy as np


class StorageDtype(StrEnum):
    """How one hidden-state array is stored (``storage.dtype``, ``storage.last_dtype``, the manifest)."""

    bf16 = "bf16"
    fp16 = "fp16"
    fp32 = "fp32"
    fp8_e4m3 = "fp8_e4m3"  # e4m3 bits plus a float32 scale array (contract/fp8.py)

    @property
    def disk(self) -> np.dtype:
        """The numpy dtype written to disk (bf16 as its uint16 bit pattern: zarr has no bfloat16)."""
        return np.dtype(_NAMES[self.value][0])

    @property
    def logical(self) -> str:
        """The ``logical_dtype`` attribute of its arrays (what the bits mean)."""
        return _NAMES[self.value][1]

    @property
    def output(self) -> StorageDtype:
        """What readers, the loader and exports return it as: itself, except fp8 (dequantized to bf16)."""
        return StorageDtype.bf16 if self is StorageDtype.fp8_e4m3 else self

    @property
    def torch_name(self) -> str:
        """The name of the torch dtype its output is (``getattr(torch, name)``; the contract imports no torch)."""
        return self.output.logical

    @property
    def safetensors(self) -> str:
        """The safetensors dtype code of its output (the weights file and exports)."""
        return _NAMES[self.output.value][2]

    @property
    def is_fp8(self) -> bool:
        return self is StorageDtype.fp8_e4m3

    @classmethod
    def from_logical(cls, name: str) -> StorageDtype | None:
        """The storage dtype whose bits mean ``name`` (its ``logical``, torch's name: ``bfloat16`` -> bf16), or None:
        the inverse of the table, derived from it."""
        return next((d for d in cls if d.logical == name), None)


# storage dtype -> (disk dtype, logical dtype, safetensors code): the one table of their names, each inverse derived
_NAMES: dict[str, tuple[type[np.generic], str, str]] = {
    "bf16": (np.uint16, "bfloat16", "BF16"), "fp16": (np.float16, "float16", "F16"),
    "fp32": (np.float32, "float32", "F32"), "fp8_e4m3": (np.uint8, "float8_e4m3fn", "F8_E4M3")}


class Compressor(StrEnum):
    """The lossless codec of every stored chunk (``storage.compressor``); crc32c always follows it."""

    none = "none"
    zstd = "zstd"
    blosc_zstd = "blosc_zstd"
    blosc_lz4 = "blosc_lz4"
    blosc_lz4hc = "blosc_lz4hc"

    @property
    def codec(self) -> str | None:
        """The zarr v3 codec name it writes (``blosc``, ``zstd``), None for no compressor."""
        return None if self is Compressor.none else "zstd" if self is Compressor.zstd else "blosc"

    @property
    def cname(self) -> str | None:
        """blosc's inner compressor (``zstd``, ``lz4``); None for the others."""
        return self.value.split("_", 1)[1] if self.codec == "blosc" else None


class Shuffle(StrEnum):
    """blosc's shuffle filter (``storage.shuffle``, ``storage.fp8_shuffle``)."""

    none = "none"
    byte = "byte"
    bit = "bit"

    @property
    def blosc(self) -> str:
        """The name zarr's blosc codec configuration uses."""
        return {"none": "noshuffle", "byte": "shuffle", "bit": "bitshuffle"}[self.value]

    @property
    def numcodecs(self) -> int:
        """numcodecs.Blosc's integer for it."""
        return {"none": 0, "byte": 1, "bit": 2}[self.value]


class LastState(StrEnum):
    """Which final decoder state is stored (``capture.last_state``)."""

    post_norm = "post_norm"  # after the final norm: what lm_head takes (NeMo, DeepSpec, SpecForge)
    pre_norm = "pre_norm"    # the last decoder layer's output before the final norm (vLLM speculators)
    both = "both"

    @property
    def post(self) -> bool:
        return self in (LastState.post_norm, LastState.both)

    @property
    def pre(self) -> bool:
        return self in (LastState.pre_norm, LastState.both)


class LayerPreset(StrEnum):
    """How the captured layer ids are chosen when none are given (``model.layer_preset``; ``capture.layer_preset``)."""

    nemo = "nemo"  # NeMo AutoModel's formula, N-1 (the post-norm state) included
    servable = "servable"  # no -1 and no N-1: ids a serving engine (SGLang) can capture; DeepSpec's DFlash rule


class MaskRule(StrEnum):
    """Which tokens the loss mask supervises (``data.mask_rule``; ``capture.mask.rule`` records what applied)."""

    nemo = "nemo"  # NeMo AutoModel's: each assistant turn from its role header to its end-of-turn token
    deepspec = "deepspec"  # DeepSpec's: assistant content and end-of-turn token, no header
    specforge = "specforge"  # SpecForge's qwen template: DeepSpec's spans after its parser's message reduction


class Fingerprint(StrEnum):
    """How much of each weight file the cache identity hashes (``model.fingerprint``)."""

    full = "full"
    sampled = "sampled"


class RejectReason(StrEnum):
    """Why an input row did not become a sample: the ``reason`` of each ``rejects.jsonl`` line (stable codes)."""

    MALFORMED_JSON = "malformed_json"
    """Not one JSON object (also: nesting too deep to parse, integers too long)."""
    INVALID_UTF8 = "invalid_utf8"
    """Bytes that are not UTF-8, or text holding an unpaired UTF-16 surrogate (the message names the field)."""
    ROW_TOO_LARGE = "row_too_large"
    """More than data.max_row_bytes; read past without being held or parsed."""
    MISSING_MESSAGES = "missing_messages"
    """No messages (or ShareGPT conversations) list in the row."""
    UNKNOWN_ROLE = "unknown_role"
    """A role other than system, user, assistant or tool (after ShareGPT's names are mapped)."""
    NON_TEXT_CONTENT = "non_text_content"
    """An image, audio or other non-text content part: only text targets are captured."""
    EMPTY_CONVERSATION = "empty_conversation"
    """A messages list with no message."""
    NO_ASSISTANT_TURN = "no_assistant_turn"
    """Nothing to supervise: no assistant message."""
    TEMPLATE_ERROR = "template_error"
    """The chat template raised, or rendered an empty string, for this row."""
    UNMASKABLE = "unmaskable_template"
    """The assistant turns could not be located in the render (no generation blocks, and NeMo's prefix rule and
    the full-render alignment both failed)."""
    NO_SUPERVISED_TOKENS = "no_supervised_tokens"
    """No supervised token left after truncation to seq_length (not counted as invalid)."""
    TOO_FEW_SUPERVISED_TOKENS = "too_few_supervised_tokens"
    """data.mask_rule=deepspec or specforge: fewer supervised tokens than that trainer's minimum (DeepSpec 14,
    SpecForge 2), which it drops as well."""
    MASK_OPTION_ERROR = "mask_option_error"
    """data.mask_generation_prompt or mask_reasoning_content could not be applied to this row (rendering a part of
    the conversation failed), so its header or reasoning would have stayed supervised."""
    IMAGE_MISSING = "image_missing"
    """An image the row names cannot be read (no such file, a web URL, more placeholders than images)."""
    IMAGE_UNDECODABLE = "image_undecodable"
    """An image whose bytes do not decode (not an image, a broken file or base64 payload)."""
    IMAGE_TOO_LARGE = "image_too_large"
    """An image file over 64 MiB, or with more pixels than data.image.max_input_pixels."""
    VIDEO_UNSUPPORTED = "video_unsupported"
    """A video part or <video> placeholder where no video processor runs: transformers' video processors need
    torchvision (and decoding needs PyAV), or the checkpoint has no video processor."""
    VIDEO_MISSING = "video_missing"
    """A video the row names cannot be read (no such file, a web or data: URL, more placeholders than videos)."""
    VIDEO_UNDECODABLE = "video_undecodable"
    """A video whose bytes do not decode (not a video, a truncated or broken file)."""
    VIDEO_TOO_LARGE = "video_too_large"
    """A video file over data.video.max_bytes, or with more frames than data.video.max_input_frames."""
    NONFINITE = "nonfinite_hidden_states"
    """NaN or Inf in a stored state, found after the forward; the sample is dropped from the cache."""


class Check(StrEnum):
    """The checks ``verify`` runs; each problem it reports names one."""

    manifest = "manifest"
    structure = "structure"
    offsets = "offsets"
    commits = "commits"
    checksum = "checksum"
    binding = "binding"  # format 3: a shard (or a chunk in it) is not what its unit's commit record binds there
    missing_chunk = "missing-chunk"
    values = "values"
    counts = "counts"
    weights = "weights"
    recompute = "recompute"
    teacher = "teacher"
    precision = "precision"


class Message(StrEnum):
    """What helper processes (writers, tokenizers) report over their pipes."""

    ready = "ready"
    done = "done"
    error = "error"
