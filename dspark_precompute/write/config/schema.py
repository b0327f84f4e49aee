"""Typed run configuration, validated before anything heavy happens.

Hydra composes ``conf/`` into a DictConfig; :func:`from_dictconfig` turns it into these
dataclasses. Every dataclass lists its own problems; :class:`PrecomputeConfig` gathers
them in ``__post_init__`` and raises one :class:`~dspark_precompute.errors.ConfigError`
naming every bad key, its value and the fix.

Those checks read the values only (types, ranges, empty strings), so a config composes the
same on any machine: a SLURM job is composed on a login node without GPUs, and its paths
may exist only on the compute nodes. What the machine says about a value (a CUDA device,
whether a path exists and what it is) is :func:`host_problems`, which the run checks on
each rank before weights load (:func:`dspark_precompute.write.plan.prepare.prepare`).
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from dspark_precompute.contract.spec import MAX_CHUNK_TOKENS, MAX_SEQ_LENGTH
from dspark_precompute.contract.vocab import (
    Compressor,
    Fingerprint,
    LastState,
    LayerPreset,
    MaskRule,
    Shuffle,
    StorageDtype,
)
from dspark_precompute.errors import ConfigError
from dspark_precompute.write.config.layers import LAYER_PRESETS, layer_id_problems

EMBEDDED = "embedded"  # data.path value: the chat set shipped inside the package
TINY = "tiny"  # model.path value: a random-weight Qwen3 built from model.random
# model.random.model_type values: the decoder families the tiny builder knows (tests, benchmarks)
TINY_MODEL_TYPES = ("qwen3", "qwen3_moe", "deepseek_v4", "glm_moe_dsa")

FP8 = StorageDtype.fp8_e4m3


class ComputeDtype(StrEnum):
    """The dtype the target runs in (``model.dtype``): auto = bf16 on CUDA, fp32 on CPU."""

    auto = "auto"
    bf16 = "bf16"
    fp16 = "fp16"
    fp32 = "fp32"


class DataFormat(StrEnum):
    """How rows hold their conversation (``data.format``)."""

    auto = "auto"
    messages = "messages"  # OpenAI messages: role / content
    sharegpt = "sharegpt"  # conversations: from / value


class OnInvalid(StrEnum):
    """What a bad row does (``data.on_invalid``): a reject, or the run stops."""

    skip = "skip"
    error = "error"


class OnNonfinite(StrEnum):
    """What a sample with NaN/Inf hidden states does (``data.on_nonfinite``)."""

    reject = "reject"
    error = "error"


COMPUTE_DTYPES = tuple(d.value for d in ComputeDtype)
DATA_FORMATS = tuple(d.value for d in DataFormat)
MASK_RULES = tuple(d.value for d in MaskRule)
ON_INVALID = tuple(d.value for d in OnInvalid)
ON_NONFINITE = tuple(d.value for d in OnNonfinite)
_SPLIT_RE = re.compile(r"^(\w+)(?:\[(-?\d*):(-?\d*)\])?$")
_DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d+)?|mps)$")


def _device_problems(device: str) -> list[str]:
    """A CUDA device asked for on a machine that has none (or fewer) is a config error, not a late crash.

    About this machine, not the value: checked where the run runs (:func:`host_problems`).
    """
    if not str(device).startswith("cuda"):
        return []
    import torch

    if not torch.cuda.is_available():
        return [f"model.device={device!r} but this machine has no usable CUDA device (torch {torch.__version__}); "
                "use model.device=cpu, or model.device=auto to take a GPU when there is one"]
    index = int(device.split(":", 1)[1]) if ":" in device else 0
    if index >= torch.cuda.device_count():
        return [f"model.device={device!r} but only {torch.cuda.device_count()} CUDA device(s) are visible "
                f"(cuda:0..cuda:{torch.cuda.device_count() - 1})"]
    return []


def _looks_like_hub_id(value: str) -> bool:
    parts = value.split("/")
    return len(parts) == 2 and all(parts) and not value.startswith((".", "/", "~"))


@dataclass
class RandomTargetConfig:
    """Shape of the random-weight Qwen3 built when ``model.path=tiny`` (tests, demo, benchmarks)."""

    hidden_size: int = 64
    """Width H of the random target."""
    num_hidden_layers: int = 4
    """Decoder layers N (at least 2)."""
    num_attention_heads: int = 4
    """Query heads (a multiple of num_key_value_heads)."""
    num_key_value_heads: int = 2
    """Key/value heads (grouped-query attention)."""
    head_dim: int = 16
    """Width of one attention head."""
    intermediate_size: int = 128
    """Width of the MLP."""
    vocab_size: int | None = None
    """Rows of the embedding; null: the tokenizer's size."""
    tie_word_embeddings: bool = True
    """Whether lm_head shares the embedding's weights."""
    seed: int = 0
    """Seed of the random weights (the same seed gives the same target, bit for bit)."""
    model_type: str = "qwen3"
    """Which decoder family to build: qwen3 (dense), qwen3_moe, deepseek_v4 (hyper-connections) or glm_moe_dsa
    (GLM-5.2); the MoE ones have num_experts routed experts, 2 per token."""
    num_experts: int = 8
    """Routed experts of an MoE model_type (ignored by qwen3)."""

    def problems(self) -> list[str]:
        out = []
        if self.model_type not in TINY_MODEL_TYPES:
            out.append(f"model.random.model_type={self.model_type!r} is not one of {list(TINY_MODEL_TYPES)}")
        if self.num_experts < 2:
            out.append(f"model.random.num_experts={self.num_experts} must be >= 2 (2 experts are routed per token)")
        for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                     "head_dim", "intermediate_size"):
            if getattr(self, name) < 1:
                out.append(f"model.random.{name}={getattr(self, name)} must be >= 1")
        if self.num_hidden_layers < 2:
            out.append(f"model.random.num_hidden_layers={self.num_hidden_layers}: a target needs >= 2 layers")
        if self.num_key_value_heads >= 1 and self.num_attention_heads % self.num_key_value_heads:
            out.append(
                f"model.random.num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        return out


@dataclass
class ModelConfig:
    """The frozen target: where it comes from, how it runs, which layers are captured."""

    path: str = TINY
    """Hub id or local directory of safetensors; tiny: the built-in random Qwen3 (shaped by model.random)."""
    tokenizer: str | None = None
    """Tokenizer source when not the model's own; null: the tokenizer that ships with model.path."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) of model.path."""
    dtype: ComputeDtype = ComputeDtype.auto
    """Compute dtype of the forward; auto: bf16 on CUDA, fp32 on CPU."""
    device: str = "auto"
    """auto, cpu, cuda or cuda:N; auto: this rank's GPU when there is one, else the CPU."""
    device_map: str | None = None
    """auto spreads a large target over the node's GPUs (needs the accelerate extra); null: one device."""
    layer_ids: list[int] | None = None
    """Explicit layer ids to capture (-1: the embeddings, N-1: the post-norm state); null: the layer_preset's ids
    for draft_num_hidden_layers."""
    layer_preset: LayerPreset = LayerPreset.nemo
    """How ids are chosen when layer_ids is null: nemo (NeMo AutoModel's formula, N-1 included) or servable (no -1
    and no N-1, which a serving engine such as SGLang cannot capture). Part of the identity when not nemo."""
    draft_num_hidden_layers: int = 5
    """How many layers the preset chooses (the draft's k)."""
    attn_implementation: str | None = "auto"
    """auto: sdpa where transformers has it for the target's class, else eager (DeepSeek V4), chosen before the
    weights load and recorded in the identity and capture.attn_implementation; sdpa, eager, flash_attention_2, ...:
    that one, refused before the weights load when the class lacks it; null: transformers' own default."""
    trust_remote_code: bool = False
    """Run the checkpoint's own Python code (logged loudly); needed for code-only targets."""
    fingerprint: Fingerprint = Fingerprint.full
    """How much of each weight file the identity hashes: full (every byte, remembered per user so a checkpoint is
    read once) or sampled (headers, edges and 16 spread blocks: fast, but a change confined to a few tensors can
    slip between them)."""
    random: RandomTargetConfig = field(default_factory=RandomTargetConfig)
    """The random target's shape (model.path=tiny only)."""

    def problems(self) -> list[str]:
        out = []
        if self.dtype not in COMPUTE_DTYPES:
            out.append(f"model.dtype={self.dtype!r} is not one of {list(COMPUTE_DTYPES)}")
        if not _DEVICE_RE.match(str(self.device)):
            out.append(f"model.device={self.device!r} must be auto, cpu, cuda or cuda:N")
        if self.device_map not in (None, "auto"):
            out.append(f"model.device_map={self.device_map!r} must be null or 'auto'")
        if self.draft_num_hidden_layers < 1:
            out.append(f"model.draft_num_hidden_layers={self.draft_num_hidden_layers} must be >= 1")
        if self.layer_ids is not None:
            out += layer_id_problems(self.layer_ids)
        if self.layer_preset not in LAYER_PRESETS:
            out.append(f"model.layer_preset={self.layer_preset!r} is not one of {list(LAYER_PRESETS)} (nemo: NeMo "
                       "AutoModel's default ids; servable: ids a serving engine can capture, no -1 and no N-1)")
        elif self.layer_ids is not None and self.layer_preset != "nemo":
            out.append(f"model.layer_ids={list(self.layer_ids)} and model.layer_preset={self.layer_preset!r} both "
                       "choose the captured layers; drop model.layer_ids to use the preset, or drop "
                       "model.layer_preset to keep the explicit ids")
        if self.fingerprint not in ("sampled", "full"):
            out.append(f"model.fingerprint={self.fingerprint!r} must be 'full' or 'sampled'")
        if not str(self.path).strip():
            out.append("model.path='' is empty; give a hub id like 'Qwen/Qwen3-0.6B', a local model directory, "
                       "or tiny for the built-in random target")
        elif self.path != TINY:
            if self.random != RandomTargetConfig():
                out.append(
                    f"model.random.* is set but model.path={self.path!r}: the random shape applies only to the "
                    "built-in target (model.path=tiny); drop the model.random overrides"
                )
        else:
            out += self.random.problems()
        if self.tokenizer is not None and not str(self.tokenizer).strip():
            out.append("model.tokenizer='' is empty; give a hub id or a local tokenizer directory, or leave it "
                       "null for the model's own tokenizer")
        return out

    def host_problems(self) -> list[str]:
        """What this machine says about the values: the CUDA device, and whether the local paths exist."""
        return _device_problems(self.device) + self.path_problems()

    def path_problems(self) -> list[str]:
        """Whether ``model.path`` and ``model.tokenizer`` exist on this machine (or are hub ids)."""
        out: list[str] = []
        if self.path != TINY and str(self.path).strip():
            p = Path(self.path).expanduser()
            if not p.exists() and not _looks_like_hub_id(self.path):
                out.append(
                    f"model.path={self.path!r} is neither an existing directory on this machine nor a hub id like "
                    "'Qwen/Qwen3-0.6B'; fix the path, or use model=tiny for the built-in random target"
                )
            elif p.exists() and not p.is_dir():
                out.append(f"model.path={self.path!r} is a file on this machine; point it at the model directory")
        if self.tokenizer is not None and str(self.tokenizer).strip() \
                and not Path(self.tokenizer).expanduser().exists() and not _looks_like_hub_id(self.tokenizer):
            out.append(f"model.tokenizer={self.tokenizer!r} does not exist on this machine and is not a hub id; "
                       "fix the path, or leave it null for the model's own tokenizer")
        return out


@dataclass
class ImageConfig:
    """How rows with images are read when the target is an image-text checkpoint (its processor expands them)."""

    min_pixels: int | None = None
    """The image processor's lower resize bound in pixels (Qwen's min_pixels); null: the checkpoint's. Part of the
    identity when set."""
    max_pixels: int | None = None
    """The image processor's upper resize bound in pixels (Qwen's max_pixels: fewer vision tokens per image); null:
    the checkpoint's. Part of the identity when set."""
    max_input_pixels: int | None = None
    """An input image with more pixels (width x height) is an image_too_large reject before it is decoded; null:
    2^28 (a decompression-bomb guard). Part of the identity when set."""

    def problems(self) -> list[str]:
        out = []
        for name in ("min_pixels", "max_pixels", "max_input_pixels"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                out.append(f"data.image.{name}={v!r} must be a positive number of pixels or null")
        if isinstance(self.min_pixels, int) and isinstance(self.max_pixels, int) and self.min_pixels > self.max_pixels:
            out.append(f"data.image.min_pixels={self.min_pixels} is above data.image.max_pixels={self.max_pixels}")
        return out

    def identity(self) -> dict[str, int]:
        """The keys set (a cache written before they existed keeps its hash)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclass
class VideoConfig:
    """How rows with videos are read when the target is an image-text checkpoint whose processor has a video
    processor (transformers' need torchvision, decoding needs PyAV: ``pip install 'dspark-precompute[video]'``).
    Every key set is part of the identity; null keeps the checkpoint's ``video_preprocessor_config.json``."""

    fps: float | None = None
    """Frames sampled per second of video (Qwen3-VL's ``fps``)."""
    min_frames: int | None = None
    """The fewest frames sampled from a video."""
    max_frames: int | None = None
    """The most frames sampled from a video."""
    min_pixels: int | None = None
    """The video processor's lower resize bound (``size.shortest_edge``: pixels of all sampled frames together)."""
    max_pixels: int | None = None
    """The video processor's upper resize bound (``size.longest_edge``: fewer vision tokens per video)."""
    cap_pixels_per_frame: bool | None = None
    """Qwen3-VL's per-frame pixel cap of the reference implementation (qwen-vl-utils): true caps each frame, so a
    video's tokens grow with its duration; null: the checkpoint's setting (transformers 5.24: uncapped, with a
    warning)."""
    max_bytes: int | None = None
    """A video file larger than this is a video_too_large reject, never decoded; null: 256 MiB."""
    max_input_frames: int | None = None
    """A video whose stream holds more frames is a video_too_large reject before it is decoded; null: 100,000."""

    def problems(self) -> list[str]:
        out = []
        for name in ("min_frames", "max_frames", "min_pixels", "max_pixels", "max_bytes", "max_input_frames"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                out.append(f"data.video.{name}={v!r} must be a positive integer or null")
        if self.fps is not None and (isinstance(self.fps, bool) or not isinstance(self.fps, int | float)
                                     or not self.fps > 0):
            out.append(f"data.video.fps={self.fps!r} must be a positive number or null")
        if self.cap_pixels_per_frame is not None and not isinstance(self.cap_pixels_per_frame, bool):
            out.append(f"data.video.cap_pixels_per_frame={self.cap_pixels_per_frame!r} must be true, false or null")
        for lo, hi in (("min_frames", "max_frames"), ("min_pixels", "max_pixels")):
            a, b = getattr(self, lo), getattr(self, hi)
            if isinstance(a, int) and isinstance(b, int) and a > b:
                out.append(f"data.video.{lo}={a} is above data.video.{hi}={b}")
        return out

    def identity(self) -> dict[str, Any]:
        """The keys set (a cache written before they existed keeps its hash)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclass
class DataConfig:
    """The chat dataset and how its conversations become tokens and loss masks."""

    path: str = EMBEDDED
    """A .jsonl/.ndjson/.json/.parquet file, a directory of them, a saved HF dataset, a hub dataset id, or embedded
    (the bundled 60 conversations)."""
    format: DataFormat = DataFormat.auto
    """messages (OpenAI), sharegpt (conversations with from/value), or auto (told apart per row)."""
    split: str = "train"
    """Which split, with an optional slice after the shuffle: train, train[:1000], train[100:200]."""
    shuffle_seed: int | None = None
    """Shuffle the rows with this seed before the slice (the permutation datasets.shuffle gives); null: file order."""
    chat_template: str | None = None
    """Inline Jinja or a path (a .jinja file or tokenizer_config.json); null: the tokenizer's template."""
    mask_reasoning_content: bool = False
    """Leave reasoning tokens out of the loss mask (a row where that cannot be done is a mask_option_error reject)."""
    mask_generation_prompt: bool = False
    """Leave the assistant header out of the loss mask (a row where that cannot be done is a mask_option_error
    reject)."""
    mask_rule: MaskRule = MaskRule.nemo
    """nemo: NeMo AutoModel's rule (each assistant turn from its header to its end of turn); deepspec: DeepSpec's
    (content, end of turn and newline, no header; its default Qwen system prompt where a conversation has none;
    under 14 supervised tokens rejected; ChatML templates only); specforge: SpecForge 0.2.0's preparation for its
    qwen template (DeepSpec's spans and system prompt after its parser's message reduction: no reasoning_content,
    turns before the first user turn dropped, cut at a turn out of order; under 2 supervised tokens rejected).
    Part of the identity when not nemo."""
    max_samples: int | None = None
    """Keep at most this many rows of the selection; null: all."""
    on_invalid: OnInvalid = OnInvalid.skip
    """skip: a bad row goes to rejects.jsonl with its reason; error: stop at the first, naming file, row and line."""
    max_invalid_fraction: float = 0.01
    """With on_invalid=skip, stop when more than this share of the rows is invalid."""
    max_row_bytes: int = 1 << 20
    """A larger row is a row_too_large reject, read past without being parsed or tokenized (tokenizing costs up to
    about 400 bytes of memory per byte of row)."""
    num_workers: int | None = None
    """Tokenizing processes; null: the cores this rank may use. The first 2,000 rows are tokenized in-process, so a
    small selection never starts them; results are identical to one process, in order."""
    on_nonfinite: OnNonfinite = OnNonfinite.reject
    """A sample whose stored states hold NaN or Inf (after the cast to the storage dtype): reject (dropped, a
    nonfinite_hidden_states line in rejects.jsonl) or error (stop, naming the sample)."""
    image: ImageConfig = field(default_factory=ImageConfig)
    """Rows with images (OpenAI image parts, or <image> placeholders and an images list; relative paths resolve
    against the data file's folder): the processor's pixel limits."""
    video: VideoConfig = field(default_factory=VideoConfig)
    """Rows with videos (OpenAI video_url/video parts, or <video> placeholders and a videos list): the video
    processor's frame sampling and pixel limits, and what is decoded at all."""

    def problems(self) -> list[str]:
        out = self.image.problems() + self.video.problems()
        if self.num_workers is not None and self.num_workers < 0:
            out.append(f"data.num_workers={self.num_workers} must be >= 0 (0 tokenizes in this process) or null")
        if self.on_nonfinite not in ON_NONFINITE:
            out.append(f"data.on_nonfinite={self.on_nonfinite!r} must be one of {list(ON_NONFINITE)}")
        if self.format not in DATA_FORMATS:
            out.append(f"data.format={self.format!r} is not one of {list(DATA_FORMATS)}")
        if not _SPLIT_RE.match(str(self.split)):
            out.append(f"data.split={self.split!r} must look like 'train' or 'train[100:200]'")
        if self.max_samples is not None and self.max_samples < 1:
            out.append(f"data.max_samples={self.max_samples} must be >= 1 or null")
        if self.on_invalid not in ON_INVALID:
            out.append(f"data.on_invalid={self.on_invalid!r} must be 'skip' or 'error'")
        if self.mask_rule not in MASK_RULES:
            out.append(f"data.mask_rule={self.mask_rule!r} must be one of {list(MASK_RULES)} (nemo: NeMo AutoModel's "
                       "supervision; deepspec: DeepSpec's; specforge: SpecForge's)")
        elif self.mask_rule == MaskRule.specforge and self.mask_reasoning_content:
            out.append("data.mask_reasoning_content=true does nothing under data.mask_rule=specforge: SpecForge's "
                       "parser drops every message's reasoning_content before it renders (reasoning written inline "
                       "in the content stays supervised, as there); leave it false")
        if not 0.0 <= float(self.max_invalid_fraction) <= 1.0:
            out.append(f"data.max_invalid_fraction={self.max_invalid_fraction} must be in [0, 1]")
        if isinstance(self.max_row_bytes, bool) or not isinstance(self.max_row_bytes, int) or self.max_row_bytes < 1:
            out.append(f"data.max_row_bytes={self.max_row_bytes!r} must be a positive number of bytes "
                       "(memory per row grows with it: about 400 bytes per byte in the worst case)")
        if not str(self.path).strip():
            out.append("data.path='' is empty; give a .jsonl/.json/.parquet file, a dataset directory, a hub "
                       "dataset id, or embedded for the bundled chat set")
        return out

    def host_problems(self) -> list[str]:
        """Whether ``data.path`` exists on this machine (or is a hub dataset id)."""
        if self.path == EMBEDDED or not str(self.path).strip():
            return []
        if not Path(self.path).expanduser().exists() and not _looks_like_hub_id(self.path):
            return [f"data.path={self.path!r} does not exist on this machine (and is not a hub dataset id); "
                    "give a .jsonl/.json/.parquet file or a dataset directory"]
        return []

    def split_slice(self) -> tuple[str, slice]:
        m = _SPLIT_RE.match(self.split)
        assert m, self.split
        start, stop = m.group(2), m.group(3)
        return m.group(1), slice(int(start) if start else None, int(stop) if stop else None)


@dataclass
class StorageConfig:
    """Where the cache goes and how its arrays are laid out and compressed."""

    path: str | None = None
    """The cache's directory or s3:// URL; null: <root>/<model>/<data>/seq<S>-<hash of the settings>."""
    root: str = "caches"
    """Where derived paths go (storage=s3: $DSPARK_S3_ROOT)."""
    dtype: StorageDtype = StorageDtype.bf16
    """Storage dtype of the captured layers: bf16, fp16, fp32 (bf16 kept bit-exact as uint16), or fp8_e4m3 (e4m3
    bits with a float32 scale per token or per fp8_group channels)."""
    last_dtype: StorageDtype | None = None
    """Storage dtype of the final states (the trainer turns the post-norm state into the teacher distribution);
    null: storage.dtype, or bf16 when that is fp8_e4m3."""
    fp8_group: int | None = None
    """Channels per fp8 scale (must divide the hidden size, e.g. 128 for targets with outlier channels); null: one
    scale per token."""
    compressor: Compressor = Compressor.blosc_lz4hc
    """Lossless codec of the inner chunks (crc32c checksums are always on)."""
    compression_level: int = 1
    """The compressor's level."""
    shuffle: Shuffle = Shuffle.byte
    """blosc's shuffle of the 2- and 4-byte arrays."""
    fp8_shuffle: Shuffle = Shuffle.bit
    """blosc's shuffle of fp8 bit arrays (byte shuffle does nothing to one-byte values)."""
    chunk_tokens: int | None = None
    """Rows per inner chunk, the unit of decoding (smaller: less of a sample's neighbours decoded with it); null:
    about 256 KiB of the widest array, at least 128 tokens."""
    unit_tokens: int | None = None
    """Rows per commit unit (a multiple of chunk_tokens); null: as many chunks as fit in unit_mib."""
    unit_mib: int = 2048
    """Raw MiB of all arrays per commit unit (one shard per array), at most 131,072 tokens: larger means fewer
    files, more host memory per slot and more work a kill loses."""
    writer_slots: int = 2
    """Unit buffers in flight between the forward loop and the writers (host memory: slots x unit size)."""
    writers: int | None = None
    """Writer processes that compress and write shards in parallel; null: the cores this rank may use, less one (at
    least 1)."""
    fsync: bool = True
    """Make each shard and commit record durable before it counts; false keeps the atomic renames (safe against a
    killed process, not a power loss)."""
    window_units: int | None = None
    """Stream through a window: at most this many units on disk that the trainer (build_dataloader(path,
    stream=True)) has not released; the run waits for it when full. null: the full cache (the default)."""
    window_mib: int | None = None
    """A window's byte cap: at most this many MiB of hidden states in units not released (alone or with
    window_units)."""
    window_timeout_s: float | None = None
    """With a window: stop (resumable) after waiting this long without the trainer releasing a unit; null: wait and
    say so every minute."""

    def resolved_last_dtype(self) -> StorageDtype:
        """The post-norm state's storage dtype: ``last_dtype``, else ``dtype`` (bf16 for an fp8 ``dtype``).

        The trainer turns that state into the teacher distribution through ``lm_head``, so it
        stays bf16 unless asked otherwise.
        """
        return StorageDtype(self.last_dtype or (StorageDtype.bf16 if self.dtype == FP8 else self.dtype))

    def problems(self) -> list[str]:
        out = []
        dtypes = [d.value for d in StorageDtype]
        if self.dtype not in dtypes:
            out.append(f"storage.dtype={self.dtype!r} is not one of {dtypes}")
        if self.last_dtype is not None and self.last_dtype not in dtypes:
            out.append(f"storage.last_dtype={self.last_dtype!r} is not one of {dtypes} (the final states' storage "
                       "dtype), or null for storage.dtype (bf16 when storage.dtype=fp8_e4m3)")
        if self.fp8_group is not None:
            if isinstance(self.fp8_group, bool) or self.fp8_group < 1:
                out.append(f"storage.fp8_group={self.fp8_group!r} must be a positive number of channels per scale "
                           "(e.g. 128) that divides the hidden size, or null for one scale per token")
            elif FP8 not in (self.dtype, self.resolved_last_dtype()):
                out.append(f"storage.fp8_group={self.fp8_group} applies only to fp8 arrays, but storage.dtype="
                           f"{self.dtype} and storage.last_dtype={self.resolved_last_dtype()}: drop storage.fp8_group "
                           "or set storage.dtype=fp8_e4m3")
        for key, vocab in (("compressor", Compressor), ("shuffle", Shuffle), ("fp8_shuffle", Shuffle)):
            if getattr(self, key) not in [v.value for v in vocab]:
                out.append(f"storage.{key}={getattr(self, key)!r} is not one of {[v.value for v in vocab]}")
        if self.compressor == "zstd" and not -7 <= self.compression_level <= 22:
            out.append(f"storage.compression_level={self.compression_level} must be in [-7, 22] for zstd")
        if self.compressor.startswith("blosc") and not 0 <= self.compression_level <= 9:
            out.append(f"storage.compression_level={self.compression_level} must be in [0, 9] for blosc")
        if self.chunk_tokens is not None and self.chunk_tokens < 1:
            out.append(f"storage.chunk_tokens={self.chunk_tokens} must be >= 1 or null")
        if self.unit_tokens is not None:
            if self.unit_tokens < 1:
                out.append(f"storage.unit_tokens={self.unit_tokens} must be >= 1 or null")
            elif self.chunk_tokens is not None and self.unit_tokens % self.chunk_tokens:
                out.append(
                    f"storage.unit_tokens={self.unit_tokens} must be a multiple of "
                    f"storage.chunk_tokens={self.chunk_tokens} so units own whole chunks"
                )
        if self.chunk_tokens is not None and self.chunk_tokens > MAX_CHUNK_TOKENS:
            out.append(f"storage.chunk_tokens={self.chunk_tokens} is above {MAX_CHUNK_TOKENS}: readers decode whole "
                       "chunks, so random access would decompress that much per sample")
        if self.unit_mib < 1:
            out.append(f"storage.unit_mib={self.unit_mib} must be >= 1")
        if self.writer_slots < 1:
            out.append(f"storage.writer_slots={self.writer_slots} must be >= 1")
        if self.writers is not None and self.writers < 1:
            out.append(f"storage.writers={self.writers} must be >= 1, or null for one per spare core")
        out += self._window_problems()
        if not str(self.root).strip():
            out.append("storage.root='' is empty; give a directory (or s3:// prefix) under which caches are derived")
        if self.path is not None and not str(self.path).strip():
            out.append("storage.path='' is empty; give a directory for the cache, or leave storage.path null to "
                       "derive one under storage.root")
        return out

    def _window_problems(self) -> list[str]:
        out = []
        for key in ("window_units", "window_mib"):
            v = getattr(self, key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                out.append(f"storage.{key}={v!r} must be a positive whole number, or null for no window")
        if self.window_timeout_s is not None and not self.window_timeout_s > 0:
            out.append(f"storage.window_timeout_s={self.window_timeout_s!r} must be > 0 seconds, or null to wait for "
                       "the trainer indefinitely")
        return out

    @property
    def windowed(self) -> bool:
        return self.window_units is not None or self.window_mib is not None

    def host_problems(self) -> list[str]:
        """What this machine's filesystem says about ``storage.path`` (a file, a symlink loop)."""
        return _storage_path_problems(self.path) if self.path is not None and str(self.path).strip() else []


def fp8_group_problem(group: int, hidden: int) -> str:
    """storage.fp8_group must divide the target's hidden size (each scale covers a whole group)."""
    divisors = [d for d in (32, 64, 128, 256) if hidden % d == 0]
    hint = f"e.g. {divisors[-1]}" if divisors else "a divisor of it"
    return (f"storage.fp8_group={group} does not divide the target's hidden size {hidden}: each fp8 scale covers "
            f"a whole group of channels. Use {hint}, or null for one scale per token")


def _storage_path_problems(path: str) -> list[str]:
    if "://" in str(path):
        return []
    p = Path(path).expanduser()
    try:
        p.resolve(strict=False)
    except (RuntimeError, OSError) as exc:  # a symlink loop (3.11 raises RuntimeError), a too-long name
        return [f"storage.path={path!r} cannot be resolved on this machine ({exc}); give a real directory"]
    if p.exists() and not p.is_dir():
        return [f"storage.path={path!r} is a file on this machine; give a directory for the cache"]
    return []


@dataclass
class CaptureConfig:
    """Which final decoder states are stored (part of the cache identity)."""

    last_state: LastState = LastState.post_norm
    """post_norm: the final state after the target's final norm (NeMo, DeepSpec, SpecForge); pre_norm: the last
    decoder layer's output before it (vLLM speculators); both. Part of the identity when not post_norm."""

    def problems(self) -> list[str]:
        states = [v.value for v in LastState]
        if self.last_state not in states:
            return [f"capture.last_state={self.last_state!r} is not one of {states}"]
        return []


@dataclass
class BatchConfig:
    """How samples are grouped for each forward pass (not part of the cache identity)."""

    max_tokens: int = 16384
    """Padded tokens per forward (rows x longest row); must be >= seq_length."""
    max_samples: int | None = None
    """Cap on rows per forward; 1: no padding at all."""

    def problems(self) -> list[str]:
        out = []
        if self.max_tokens < 1:
            out.append(f"batch.max_tokens={self.max_tokens} must be >= 1")
        if self.max_samples is not None and self.max_samples < 1:
            out.append(f"batch.max_samples={self.max_samples} must be >= 1 or null")
        return out


@dataclass
class ParallelConfig:
    """How the target's weights are spread over the ranks (not part of the identity, except tp).

    The default (all 1) keeps one whole copy per rank. Under fsdp and ep every rank still runs
    its own batches and writes its own units; the ranks of a group only meet in the forward.
    Under tp the ranks of a tensor-parallel group run the same batches and the first of them writes.
    """

    fsdp: int = 1
    """Ranks sharing one FSDP2-sharded copy of the weights (each holds 1/fsdp of them); must divide the world
    size. The stored values are bit-identical to one copy."""
    ep: int = 1
    """Expert-parallel size of an MoE target: the routed experts are split over ep ranks (tokens exchanged
    all-to-all); must divide fsdp x tp and the number of routed experts. Bit-identical to one copy in bf16."""
    tp: int = 1
    """Tensor-parallel size: the ranks of a group (consecutive ranks) each hold 1/tp of every layer and run the same
    batches; the first writes. Must divide the key/value heads. Its values are NOT those of one copy (partial sums
    are rounded before the reduction: in bf16 46-49% of elements differ by more than one bf16 step, measured), so
    it is part of the cache identity (``tensor_parallel``): a cache resumes only under the same tp.
    parallel.fsdp (with parallel.ep for an MoE) shards as far with the values of one copy: prefer it."""

    @property
    def group(self) -> int:
        """Ranks that hold one copy of the weights together."""
        return self.fsdp * self.tp

    @property
    def sharded(self) -> bool:
        return self.group > 1 or self.ep > 1

    def problems(self) -> list[str]:
        out = [f"parallel.{k}={getattr(self, k)} must be >= 1" for k in ("fsdp", "ep", "tp") if getattr(self, k) < 1]
        if out:
            return out
        if self.ep > 1 and (self.ep % self.tp or self.group % self.ep):
            out.append(f"parallel.ep={self.ep} must be a multiple of parallel.tp={self.tp} and divide parallel.fsdp x "
                       f"parallel.tp={self.group} (the experts are split within one sharded copy); e.g. "
                       f"parallel.fsdp={self.ep} parallel.ep={self.ep}")
        return out


@dataclass
class PlanConfig:
    """What ``dry_run=true`` assumes when it estimates a run's time (not part of the cache identity)."""

    tokens_per_second: float | None = None
    """Real tokens/s of the whole job (as an earlier run's progress bar shows) for the dry run's time; null:
    estimated from the target's parameter count at an assumed 300 TFLOP/s per GPU."""

    def problems(self) -> list[str]:
        if self.tokens_per_second is not None and not float(self.tokens_per_second) > 0:
            return [f"plan.tokens_per_second={self.tokens_per_second} must be a positive rate (real tokens per "
                    "second, as the progress bar of an earlier run shows), or null to estimate it from the target's "
                    "parameter count"]
        return []


# -- regeneration (regenerate=none|server): the responses rewritten by the target before capture ---------------
class RegenEngine(StrEnum):
    """Who writes the responses (``regenerate.engine``): none (the dataset's own) or an OpenAI-compatible server."""

    none = "none"
    server = "server"


class Reasoning(StrEnum):
    """What regeneration does with thinking (``regenerate.reasoning``)."""

    disable = "disable"  # chat_template_kwargs.enable_thinking=false, the paper's non-thinking recipe
    save = "save"  # the template's default; the engine's reasoning kept as reasoning_content
    none = "none"  # the template's default; only the content kept


class Turns(StrEnum):
    """Which assistant turns are regenerated (``regenerate.turns``)."""

    all = "all"  # each one, against the regenerated history
    last = "last"  # the last one, against the recorded history


class OnLength(StrEnum):
    """What a response cut by regenerate.max_tokens (finish_reason=length) does: counted and kept, or a reject."""

    keep = "keep"
    reject = "reject"


# the settings that change what a regenerated row holds: a resume with other values is refused
REGEN_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "max_tokens", "seed", "reasoning", "turns",
                       "on_length", "return_token_ids")


@dataclass
class RegenerateConfig:
    """Regenerate every response with the target on a serving engine before capture (the DSpark paper's recipe)."""

    engine: RegenEngine = RegenEngine.none
    """none: capture the dataset's own responses; server: regenerate them first through OpenAI-compatible servers
    (vllm serve, SGLang, transformers serve)."""
    base_urls: list[str] = field(default_factory=list)
    """The servers' OpenAI base URLs (http://host:8000/v1); several are used as data parallel."""
    served_model: str | None = None
    """The model name sent in each request; null: the one model the first server lists at /v1/models."""
    api_key: str | None = None
    """The servers' API key; null: $OPENAI_API_KEY, else EMPTY (local servers take any)."""
    concurrency: int = 8
    """Requests in flight per server."""
    timeout: float = 600.0
    """Seconds one request may take before it is retried."""
    max_retries: int = 5
    """Retries of a request that timed out, could not connect or got 408/409/425/429/5xx (exponential backoff);
    then the row is a request_failed reject, asked again by the next run."""
    retry_backoff: float = 1.0
    """Seconds before the first retry (doubled each time, at most 60; a Retry-After header wins)."""
    temperature: float = 0.0
    """Sampling temperature (0: greedy, as NeMo AutoModel regenerates)."""
    top_p: float | None = None
    """Nucleus sampling; null: not sent (the engine's default)."""
    top_k: int | None = None
    """Top-k sampling (vLLM, SGLang); null: not sent (transformers serve refuses it)."""
    min_p: float | None = None
    """Min-p sampling (vLLM, SGLang); null: not sent."""
    max_tokens: int = 2048
    """Completion tokens per turn; a longer answer is cut (finish_reason=length, see on_length)."""
    seed: int | None = None
    """Sampling seed sent with each request, where the engine honours it; null: not sent."""
    reasoning: Reasoning = Reasoning.disable
    """disable: thinking off (chat_template_kwargs.enable_thinking=false); save: the template's default, the
    engine's reasoning kept as reasoning_content; none: the template's default, only the content kept."""
    turns: Turns = Turns.all
    """all: each assistant turn regenerated against the regenerated history; last: only the last one."""
    on_length: OnLength = OnLength.keep
    """A turn cut by max_tokens: keep (counted) or reject the row (a length reject)."""
    return_token_ids: bool = False
    """Ask for the engine's token ids (vLLM's return_token_ids) and check our rendering against them, counting every
    mismatch; transformers serve refuses the field."""
    output: str | None = None
    """The regenerated JSONL of messages; null: beside the cache, <cache path>.regenerated.jsonl."""
    only: bool = False
    """Regenerate and stop (no capture)."""

    def sampling(self) -> dict[str, Any]:
        """The settings a regenerated row depends on (its resume key, and part of the derived cache path)."""
        out: dict[str, Any] = json.loads(json.dumps({k: getattr(self, k) for k in REGEN_SAMPLING_KEYS}))
        return out

    def problems(self) -> list[str]:
        if self.engine == RegenEngine.none:
            return ["regenerate.only=true needs regenerate=server (and its base_urls): with regenerate=none there "
                    "is nothing to regenerate"] if self.only else []
        out = []
        if not self.base_urls:
            out.append("regenerate=server needs regenerate.base_urls, e.g. regenerate.base_urls=[http://127.0.0.1:"
                       "8000/v1] (the servers' OpenAI base URLs)")
        out += [f"regenerate.base_urls has {u!r}: give an http:// or https:// URL such as http://127.0.0.1:8000/v1"
                for u in self.base_urls if not str(u).startswith(("http://", "https://"))]
        for key, lo in (("concurrency", 1), ("max_tokens", 1), ("max_retries", 0)):
            if getattr(self, key) < lo:
                out.append(f"regenerate.{key}={getattr(self, key)} must be >= {lo}")
        for key in ("timeout", "retry_backoff"):
            if not float(getattr(self, key)) > 0:
                out.append(f"regenerate.{key}={getattr(self, key)} must be a positive number of seconds")
        if not 0.0 <= float(self.temperature) <= 2.0:
            out.append(f"regenerate.temperature={self.temperature} must be in [0, 2]")
        for key in ("top_p", "min_p"):
            value = getattr(self, key)
            if value is not None and not 0.0 <= float(value) <= 1.0:
                out.append(f"regenerate.{key}={value} must be in [0, 1], or null to leave it to the engine")
        if self.top_k is not None and self.top_k < -1:
            out.append(f"regenerate.top_k={self.top_k} must be >= 1 (-1 or 0: off), or null to leave it to the engine")
        if self.output is not None and ("://" in str(self.output) or not str(self.output).strip()):
            out.append(f"regenerate.output={self.output!r} must be a local file path (or null: beside the cache)")
        return out


@dataclass
class PrecomputeConfig:
    """One precompute run. Constructing it validates everything that needs no weights."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The frozen target."""
    data: DataConfig = field(default_factory=DataConfig)
    """The chat dataset."""
    storage: StorageConfig = field(default_factory=StorageConfig)
    """Where and how the cache is written."""
    capture: CaptureConfig = field(default_factory=CaptureConfig)
    """Which final states are stored."""
    batch: BatchConfig = field(default_factory=BatchConfig)
    """How samples are grouped for the forward."""
    plan: PlanConfig = field(default_factory=PlanConfig)
    """What the dry run assumes."""
    regenerate: RegenerateConfig = field(default_factory=RegenerateConfig)
    """Regenerate the responses with the target before capture (regenerate=server)."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """How the weights are sharded over the ranks (FSDP2, expert and tensor parallel)."""
    seq_length: int = 2048
    """Keep the first seq_length tokens of each conversation."""
    overwrite: bool = False
    """Replace an existing cache of this tool at storage.path instead of resuming or refusing (never a directory it
    did not write)."""
    dry_run: bool = False
    """Plan the run (data, tokens, rejects, exact bytes and files, estimated size and time) without weights; write
    nothing."""
    log_level: str = "INFO"
    """The command's log level (a library run() leaves logging to its caller)."""
    progress: bool = True
    """Show the progress bar (tokens/s, ETA, bytes written)."""

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ConfigError(problems)

    def problems(self) -> list[str]:
        out: list[str] = []
        if self.seq_length <= 0:
            out.append(f"seq_length={self.seq_length} must be a positive number of tokens")
        elif self.seq_length > MAX_SEQ_LENGTH:
            out.append(f"seq_length={self.seq_length} is above {MAX_SEQ_LENGTH}, the longest sample a cache may hold")
        elif self.batch.max_tokens >= 1 and self.batch.max_tokens < self.seq_length:
            out.append(
                f"batch.max_tokens={self.batch.max_tokens} is smaller than seq_length={self.seq_length}: "
                f"a sample of seq_length tokens would not fit in one forward; set batch.max_tokens "
                f">= {self.seq_length}"
            )
        if str(self.log_level).upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            out.append(f"log_level={self.log_level!r} must be DEBUG, INFO, WARNING or ERROR")
        for part in (self.model, self.data, self.storage, self.capture, self.batch, self.plan, self.regenerate,
                     self.parallel):
            out += part.problems()
        if self.parallel.sharded and self.model.device_map:
            out.append(f"model.device_map={self.model.device_map!r} and parallel.fsdp/ep/tp both place the weights; "
                       "drop model.device_map to shard over the ranks, or set parallel.* to 1 for one copy per node")
        group, hidden = self.storage.fp8_group, self.model.random.hidden_size
        if self.model.path == TINY and isinstance(group, int) and group >= 1 and hidden >= 1 and hidden % group:
            out.append(fp8_group_problem(group, hidden))
        return out

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON values (vocabulary members as their strings)."""
        out: dict[str, Any] = json.loads(json.dumps(dataclasses.asdict(self)))
        return out


def host_problems(cfg: PrecomputeConfig) -> list[str]:
    """What the machine that runs ``cfg`` says about it: CUDA devices, and the local paths' existence and kind.

    Never checked while composing (a SLURM job is composed on a login node that may have no GPU and
    not the compute nodes' paths); :func:`dspark_precompute.write.plan.prepare.prepare` checks it on every
    rank before weights load, together with its own problems.
    """
    return cfg.model.host_problems() + cfg.data.host_problems() + cfg.storage.host_problems()
