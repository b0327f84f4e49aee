"""The run plan: everything decided before any weights load.

``prepare(cfg)`` checks what this machine says about the config (its CUDA devices, the
paths it names: :func:`~dspark_precompute.write.config.schema.host_problems`, on every rank, as
composing on a login node could not), then resolves the storage path, the tokenizer and
chat template, the target's identity (config, weight fingerprint, layer ids, whether it
fits the device), the array specs, chunk and unit sizes, and the identity hashed into
``config_hash``; every problem is reported together as one ConfigError. ``Plan.manifest``
builds the cache's manifest.
"""

from __future__ import annotations

import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dspark_precompute.contract.layout import Layout
from dspark_precompute.contract.manifest import Capture, Counts, Manifest, ManifestLayout, MediaInfo, config_hash, now
from dspark_precompute.contract.spec import (
    FORMAT_VERSION,
    MAX_CHUNK_BYTES,
    auto_chunk_tokens,
    disk_dtype,
    hidden_arrays,
    unit_tokens,
)
from dspark_precompute.contract.store import CacheStore
from dspark_precompute.contract.vocab import LastState
from dspark_precompute.errors import ConfigError, DataError, TargetError
from dspark_precompute.version import __version__
from dspark_precompute.write.config.layers import layer_id_problems, resolve_layer_ids
from dspark_precompute.write.config.schema import (
    EMBEDDED,
    FP8,
    DataConfig,
    PrecomputeConfig,
    StorageConfig,
    fp8_group_problem,
    host_problems,
)
from dspark_precompute.write.plan.array_specs import ArraySpec, position_spec, token_array_specs
from dspark_precompute.write.plan.provenance import plan_capture
from dspark_precompute.write.samples.chat import mask_rule_problem, resolve_chat_template, sha256_text
from dspark_precompute.write.samples.encode import RowEncoder
from dspark_precompute.write.samples.files import resolve_source
from dspark_precompute.write.samples.images import data_root
from dspark_precompute.write.samples.media import MediaSpec, described, images_sha256, media_spec_for
from dspark_precompute.write.samples.tokenize import RowEncoding
from dspark_precompute.write.target import sharding
from dspark_precompute.write.target.load import (
    TargetInfo,
    fit_problem,
    inspect_target,
    load_tokenizer,
    resolve_compute_dtype,
    resolve_device,
    tokenizer_sha256,
)

# storage settings that change what is stored (the rest: where, and how fast it is written)
STORED_STORAGE_KEYS = ("dtype", "compressor", "compression_level", "shuffle")


def stored_dtype_knobs(s: StorageConfig) -> dict[str, Any]:
    """``last_dtype``, ``fp8_group`` and ``fp8_shuffle`` as the identity records them: only when they mean something
    (the post-norm state stored in another dtype than the others; any fp8 array), so caches written before they
    existed keep their hash and path."""
    out: dict[str, Any] = {}
    if s.resolved_last_dtype() != s.dtype:
        out["last_dtype"] = s.resolved_last_dtype().value
    if FP8 in (s.dtype, s.resolved_last_dtype()):
        out.update(fp8_group=s.fp8_group, fp8_shuffle=str(s.fp8_shuffle))
    return out


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_")[:64] or "x"


def default_storage_path(cfg: PrecomputeConfig) -> str:
    """``<root>/<model>/<data>/seq<S>-<hash>``: swept values give separate caches, same values the same one.

    The short hash covers the settings that change stored values (layers, masks, dtype,
    split, template, chunking) but not file contents, so a changed data file under the
    same settings maps to the same path and is refused rather than silently forked.
    """
    m, d, s = cfg.model, cfg.data, cfg.storage
    model = "tiny" if m.path == "tiny" else Path(m.path.rstrip("/")).name
    if m.path == "tiny":
        r = m.random
        model = f"tiny-h{r.hidden_size}-l{r.num_hidden_layers}"
    data = "embedded" if d.path == EMBEDDED else Path(d.path.rstrip("/")).stem
    knobs = {
        "model": {k: v for k, v in cfg.to_dict()["model"].items()
                  if k in ("path", "tokenizer", "revision", "dtype", "layer_ids", "draft_num_hidden_layers", "random")
                  or (k == "layer_preset" and v != "nemo")},  # the default keeps the paths of earlier caches
        "data": {k: v for k, v in cfg.to_dict()["data"].items()
                 if k in ("path", "format", "split", "shuffle_seed", "chat_template", "mask_reasoning_content",
                          "mask_generation_prompt", "max_samples")
                 or (k == "max_row_bytes" and v != DataConfig.max_row_bytes)
                 or (k == "mask_rule" and v != DataConfig.mask_rule)},
        "storage": {**{k: getattr(s, k) for k in (*STORED_STORAGE_KEYS, "chunk_tokens", "unit_tokens", "unit_mib")},
                    **stored_dtype_knobs(s)},
        "seq_length": cfg.seq_length,
        # the default keeps the paths of earlier configurations
        **({"last_state": str(cfg.capture.last_state)} if cfg.capture.last_state != LastState.post_norm else {}),
        # regenerated responses: another recipe, another cache (the default keeps the paths of earlier caches)
        **({"regenerate": cfg.regenerate.sampling()} if cfg.regenerate.engine != "none" else {}),
    }
    tag = config_hash(knobs)[:8]
    root = s.root.rstrip("/")
    return f"{root}/{_slug(model)}/{_slug(data)}/seq{cfg.seq_length}-{tag}"


@dataclass(frozen=True)
class Plan:
    """Everything known before the target's weights load (fixed from then on)."""

    cfg: PrecomputeConfig
    path: str
    store: CacheStore
    tokenizer: Any
    template: str
    target: TargetInfo
    layer_ids: list[int]
    device: torch.device
    compute_dtype: torch.dtype
    identity: dict[str, Any]
    config_hash: str
    specs: list[ArraySpec]
    names: dict[str, str]
    chunk_tokens: int
    unit_tokens: int
    data_sha256: str
    capture: Capture | None = None  # the manifest's capture facts known before weights load
    fit: str | None = None  # a dry run: why this rank's share of the weights would not fit here (None: it fits)
    media: MediaSpec | None = None  # an image-text target: rows with images go through its processor

    def manifest(self, layout: Layout, counts: Counts, created_at: str = "",
                 image_samples: Any = None, video_samples: Any = None) -> Manifest:
        """The cache's manifest for this plan (incomplete until the run marks it complete); ``image_samples``: the
        ``images/sample`` table of an image cache (its media section counts it); ``video_samples``: the
        ``videos/sample`` table where a sample keeps a video."""
        t, m = self.target, self.media
        videos = video_samples is not None and len(video_samples) > 0
        media = None if m is None else MediaInfo(
            m.image_token_id, list(m.vision_token_ids), m.position_axes,
            len(np.unique(image_samples)) if image_samples is not None else 0,
            len(image_samples) if image_samples is not None else 0, m.spatial_merge_size,
            m.video_token_id if videos else None, len(np.unique(video_samples)) if videos else None,
            len(video_samples) if videos else None)
        return Manifest(
            config_hash=self.config_hash, identity=self.identity, config=self.cfg.to_dict(),
            target_model=t.path, target_model_type=t.model_type, target_vocab_size=t.vocab_size,
            num_hidden_layers=t.num_hidden_layers, hidden_size=t.hidden_size, layer_ids=list(self.layer_ids),
            seq_length=self.cfg.seq_length, storage_dtype=str(self.cfg.storage.dtype), chat_template=self.template,
            last_dtype=stored_dtype_knobs(self.cfg.storage).get("last_dtype"),
            fp8_group=stored_dtype_knobs(self.cfg.storage).get("fp8_group"),
            arrays=dict(self.names),
            layout=ManifestLayout(layout.chunk_tokens, layout.unit_tokens, layout.num_units, layout.total_slots),
            counts=counts, complete=False, tied_embeddings=t.tied,
            pad_token_id=getattr(self.tokenizer, "pad_token_id", None),
            eos_token_id=getattr(self.tokenizer, "eos_token_id", None),
            tool_version=__version__, created_at=created_at or now(), capture=self.capture,
            format_version=FORMAT_VERSION, media=media,
        )

    @property
    def encoding(self) -> RowEncoding:
        """How this plan turns rows into samples (what tokenizing takes, not the whole plan)."""
        return RowEncoding(row_encoder(self.cfg, self.template, self.media), self.tokenizer)

    @property
    def pad_id(self) -> int:
        """The id right-padded batches use (the tokenizer's pad, else eos, else 0; never seen by real tokens)."""
        pad = getattr(self.tokenizer, "pad_token_id", None)
        return int(pad if pad is not None else (getattr(self.tokenizer, "eos_token_id", None) or 0))


def row_encoder(cfg: PrecomputeConfig, template: str, media: MediaSpec | None) -> RowEncoder:
    """How a run of ``cfg`` turns rows into samples with ``template`` (and ``media``, an image-text target's
    processor; relative image paths then start from the data's folder): the run's and a rerun's own encoder."""
    d = cfg.data
    root = data_root(str(d.path)) if media is not None else None
    return RowEncoder(template, cfg.seq_length, d.mask_reasoning_content, d.mask_generation_prompt, d.format,
                      d.mask_rule, media, root)


def prepare(cfg: PrecomputeConfig, fingerprint: bool = True, world: int | None = None) -> Plan:
    """Resolve paths, tokenizer, template and target identity; validate it all together.

    ``fingerprint=False`` (a dry run) leaves the weight files unhashed: the identity then
    lacks their fingerprint and must not be compared with a cache's. ``world`` (the run's
    ranks) is checked against ``parallel.*``; None (a dry run on a login node) skips that.
    """
    path = cfg.storage.path or default_storage_path(cfg)
    data_sha, tokenizer, template, target, problems = _resolve_inputs(cfg, fingerprint)
    layer_ids: list[int] = []
    if target is not None and tokenizer is not None:
        layer_ids = _layer_ids(cfg, target, tokenizer, problems)
    device = resolve_device(cfg.model.device)
    compute_dtype = resolve_compute_dtype(cfg.model.dtype, device)
    fit: str | None = None
    media: MediaSpec | None = None
    images = ""
    if target is not None:
        problems += sharding.layout_problems(cfg.parallel, target.model_type, target.extra,
                                             cfg.parallel.group if world is None else world)
        media = media_spec_for(target.local_dir, cfg.data.image, cfg.data.video)
        if media is not None and data_sha:
            images = images_sha256(cfg.data, data_root(str(cfg.data.path)))
        if images and media is not None and template is not None:
            media = described(media, tokenizer, template)  # its vision ids and position axes, for the manifest
        if images:
            target.load_vision()  # the vision tower runs on the rows' pixels: loaded, and counted in the fit
            if importlib.util.find_spec("PIL") is None:
                problems.append(f"data.path={cfg.data.path} holds rows with images, which need Pillow to be "
                                "decoded; install the vision extra: pip install 'dspark-precompute[vision]'")
        else:
            media = None  # text rows: the processor is never loaded (MiniMax M3's needs torchvision)
        fit = _target_storage_problems(cfg, target, device, compute_dtype, problems, refuse_fit=fingerprint)
    if problems:
        raise ConfigError(problems)
    assert tokenizer is not None and template is not None and target is not None  # else a problem was listed
    store = CacheStore(path)  # resolves a local path: after the checks of it (a symlink loop would raise)
    state = LastState(cfg.capture.last_state)
    specs, names, chunk, unit = array_layout(cfg, layer_ids, target, state)
    if media is not None and media.position_axes:
        specs.append(position_spec(media.position_axes))  # the model's positions, stored with the token ids
    identity = cache_identity(cfg, target, tokenizer, template, data_sha, layer_ids, compute_dtype, chunk, unit,
                              images)
    return Plan(cfg, path, store, tokenizer, template, target, layer_ids, device, compute_dtype, identity,
                config_hash(identity), specs, names, chunk, unit, data_sha,
                plan_capture(cfg.model, cfg.data, template, target, cfg.model.fingerprint, state), fit, media)


def _resolve_inputs(cfg: PrecomputeConfig, fingerprint: bool) -> tuple[str, Any, str | None, TargetInfo | None,
                                                                     list[str]]:
    """The data's content hash, the tokenizer, the template and the target's facts, as far as this machine (this
    rank) lets them be found: (data_sha256, tokenizer, template, target, problems). A part whose paths it refuses
    is not resolved further, so one missing path gives one problem, not a cascade."""
    model_paths, data_host = cfg.model.path_problems(), cfg.data.host_problems()
    problems = host_problems(cfg)
    data_sha = ""
    if not data_host:
        try:
            data_sha = resolve_source(cfg.data.path, cfg.data.split_slice()[0]).content_sha256()
        except DataError as exc:
            problems.append(str(exc))
    tokenizer: Any = None
    template: str | None = None
    target: TargetInfo | None = None
    if not model_paths:
        try:
            tokenizer = load_tokenizer(cfg.model)
            template = resolve_chat_template(tokenizer, cfg.data.chat_template)
            if (problem := mask_rule_problem(template, cfg.data.mask_rule)) is not None:
                problems.append(problem)
        except (TargetError, ValueError, OSError) as exc:
            problems.append(str(exc))
    if tokenizer is not None:
        try:
            target = inspect_target(cfg.model, tokenizer, fingerprint)
        except TargetError as exc:
            problems.append(str(exc))
    return data_sha, tokenizer, template, target, problems


def _layer_ids(cfg: PrecomputeConfig, target: TargetInfo, tokenizer: Any, problems: list[str]) -> list[int]:
    """The captured layer ids (resolved only when nothing else is wrong yet), and a tokenizer too large for the
    target's embedding; problems go into ``problems``."""
    layer_ids: list[int] = []
    if cfg.model.layer_ids is not None:
        problems += layer_id_problems(cfg.model.layer_ids, target.num_hidden_layers)
    if not problems:
        try:
            layer_ids = resolve_layer_ids(cfg.model.layer_ids, target.num_hidden_layers,
                                          cfg.model.draft_num_hidden_layers, cfg.model.layer_preset)
        except ConfigError as exc:
            problems += exc.problems
        except ValueError as exc:
            problems.append(str(exc))
    if len(tokenizer) > target.vocab_size:
        what = "model.random.vocab_size" if cfg.model.path == "tiny" else "the target's vocab_size (config.json)"
        problems.append(
            f"{what} is {target.vocab_size} but the tokenizer has {len(tokenizer)} tokens: ids from "
            f"{target.vocab_size} up would index past the embedding. "
            + ("Raise model.random.vocab_size or leave it null (the tokenizer's size)" if cfg.model.path == "tiny"
               else "Point model.tokenizer at the target's own tokenizer")
        )
    return layer_ids


def _target_storage_problems(cfg: PrecomputeConfig, target: TargetInfo, device: torch.device,
                             compute_dtype: torch.dtype, problems: list[str], refuse_fit: bool = True) -> str | None:
    """An fp8 group that does not divide the hidden size; then, when nothing else is wrong, weights that do not fit
    the device. Problems go into ``problems``; a misfit is returned instead when not ``refuse_fit`` (a dry run,
    often on a login node: it reports the fit and the layout that would, and plans on)."""
    group = cfg.storage.fp8_group
    if group and "fp8_group" in stored_dtype_knobs(cfg.storage) and target.hidden_size % group:
        problems.append(fp8_group_problem(group, target.hidden_size))
    if not problems:
        try:
            problem = fit_problem(cfg.model, target, device, compute_dtype, par=cfg.parallel)
        except TargetError as exc:  # the weights could not be counted: never only a report
            problems.append(str(exc))
            return None
        if problem and refuse_fit:
            problems.append(problem)
        return problem
    return None


def array_layout(cfg: PrecomputeConfig, layer_ids: list[int], target: TargetInfo,
                 state: LastState) -> tuple[list[ArraySpec], dict[str, str], int, int]:
    """The token arrays (specs and manifest names) and the chunk and unit sizes they are stored in:
    (specs, names, chunk_tokens, unit_tokens). A chunk readers would refuse is a ConfigError."""
    hidden = target.hidden_size
    knobs = stored_dtype_knobs(cfg.storage)
    specs = token_array_specs(layer_ids, target.num_hidden_layers, hidden, cfg.storage.dtype,
                              knobs.get("last_dtype"), knobs.get("fp8_group"), state)
    names = hidden_arrays(layer_ids, target.num_hidden_layers, post_norm=state.post, pre_norm=state.pre)
    # the widest hidden array sizes the chunk (an fp8 cache keeping the post-norm state bf16: 2 bytes)
    itemsize = max(disk_dtype(s.storage).itemsize for s in specs if s.storage)
    chunk = cfg.storage.chunk_tokens or auto_chunk_tokens(hidden, itemsize)
    if chunk * hidden * itemsize > MAX_CHUNK_BYTES:
        raise ConfigError([f"storage.chunk_tokens={chunk} makes {chunk * hidden * itemsize / 2**30:.1f} GiB chunks "
                           f"at hidden size {hidden}; readers refuse chunks over {MAX_CHUNK_BYTES >> 30} GiB. "
                           f"Use at most {MAX_CHUNK_BYTES // (hidden * itemsize)} (or null: about 1 MiB)"])
    per_token = sum(s.row_bytes for s in specs)
    unit = unit_tokens(per_token, chunk, cfg.storage.unit_mib, cfg.seq_length, cfg.storage.unit_tokens)
    return specs, names, chunk, unit


def cache_identity(cfg: PrecomputeConfig, target: TargetInfo, tokenizer: Any, template: str, data_sha: str,
                   layer_ids: list[int], compute_dtype: torch.dtype, chunk: int, unit: int, images_sha: str = ""
                   ) -> dict[str, Any]:
    """What ``config_hash`` covers: everything that changes a stored value or the layout, nothing else.

    ``images_sha``: every image the rows name, hashed (:func:`~dspark_precompute.write.samples.media.images_sha256`).

    A key added later is recorded only when it is not its default, so caches written before it existed keep their
    hash (and a resume of them is not refused).
    """
    knobs = stored_dtype_knobs(cfg.storage)
    state = LastState(cfg.capture.last_state)
    storage_knobs = {k: str(getattr(cfg.storage, k)) if k != "compression_level" else cfg.storage.compression_level
                     for k in STORED_STORAGE_KEYS}
    storage_knobs.update(chunk_tokens=chunk, unit_tokens=unit, **knobs)
    identity = {
        "format_version": FORMAT_VERSION,
        "target": {
            "path": target.path, "model_type": target.model_type, "config_sha256": target.config_sha256,
            "weights_fingerprint": target.weights_fingerprint, "fingerprint_kind": cfg.model.fingerprint,
            "revision": cfg.model.revision,
            # eager / sdpa / flash attention round differently: part of what the values are
            "attn_implementation": target.attn_implementation,  # the chosen one (model.attn_implementation=auto)
        },
        "compute_dtype": str(compute_dtype).replace("torch.", ""),
        "tokenizer_sha256": tokenizer_sha256(tokenizer),
        "chat_template_sha256": sha256_text(template),
        "data": {
            "path": str(cfg.data.path), "content_sha256": data_sha, "format": cfg.data.format,
            "split": cfg.data.split, "shuffle_seed": cfg.data.shuffle_seed, "max_samples": cfg.data.max_samples,
            "mask_reasoning_content": cfg.data.mask_reasoning_content,
            "mask_generation_prompt": cfg.data.mask_generation_prompt,
            # which rows are rejected as too large; recorded only when not the default, so caches
            # written before the limit existed keep their hash
            **({"max_row_bytes": cfg.data.max_row_bytes}
               if cfg.data.max_row_bytes != DataConfig.max_row_bytes else {}),
            # the supervision rule; recorded only when not NeMo's (the default), likewise
            **({"mask_rule": cfg.data.mask_rule} if cfg.data.mask_rule != DataConfig.mask_rule else {}),
            # rows with images (an image-text target): their content and the processor's pixel limits; recorded
            # only when there are images / a limit is set, so every text cache keeps its hash
            **({"images_sha256": images_sha} if images_sha else {}),
            **({"image": cfg.data.image.identity()} if cfg.data.image.identity() else {}),
            **({"video": cfg.data.video.identity()} if cfg.data.video.identity() else {}),
        },
        "seq_length": cfg.seq_length,
        "layer_ids": layer_ids,
        **({"last_state": str(state)} if state != LastState.post_norm else {}),
        # the preset that chose them; recorded only when not NeMo's, so earlier caches keep their hash
        **({"layer_preset": cfg.model.layer_preset} if cfg.model.layer_preset != "nemo" else {}),
        "storage": storage_knobs,
        # tensor parallel rounds partial sums before its reduction: other values than one copy's (fsdp and ep
        # are bit-identical and stay out); recorded only above 1, so every other cache keeps its hash
        **({"tensor_parallel": cfg.parallel.tp} if cfg.parallel.tp > 1 else {}),
    }
    return dict(json.loads(json.dumps(identity)))  # plain JSON values (vocabulary members as their strings)
