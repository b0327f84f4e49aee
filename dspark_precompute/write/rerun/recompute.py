"""``dspark-cache verify --recompute N``: rebuild the run from the manifest and rerun N samples.

Each picked sample is re-tokenized from its source row (ids and masks must match
exactly) and rerun in the very forward batch the pipeline wrote it in (rebuilt from the
layout with the pipeline's own batching), so hidden states must match within
``tolerance`` steps of the storage dtype (bit-exact for the built-in tiny target). An fp8
array is compared with the recomputation quantized by the pipeline's own rule (bits and
scales bit-exact for the tiny target), in e4m3 steps at its scale.

An image cache reruns through the whole image-text checkpoint: each row is re-encoded by its processor and each
batch gets the pixels of its samples' images, each image first checked against the images table's sha256 (a
changed or unreadable one is a problem of every sample whose batch needs it; the others are still compared).
:class:`ImageFeed` owns that feeding; ``--teacher`` and ``--precision`` feed each image sample's images to its
forward alone through it (:meth:`SampledTarget.image_inputs`).

Nothing read from the cache turns on remote code or points a loader at code: the
recorded ``model.trust_remote_code`` is replaced by the caller's own flag, and paths that
lie inside the cache are refused.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from dspark_precompute.contract.chunks import read_slots
from dspark_precompute.contract.fp8 import E4M3, E4M3_EPS, E4M3_MIN_NORMAL, dequantize
from dspark_precompute.contract.layout import Layout, build_layout
from dspark_precompute.contract.manifest import Manifest, identity_differences
from dspark_precompute.contract.opener import OpenedCache, open_stored
from dspark_precompute.contract.spec import (
    IMAGE_GRID,
    IMAGE_SAMPLE,
    IMAGE_SHA256,
    INPUT_IDS,
    LOSS_MASK,
    POSITION_IDS,
    SAMPLE_ARRAYS,
    VIDEO_GRID,
    VIDEO_SAMPLE,
    VIDEO_SHA256,
)
from dspark_precompute.contract.store import CacheStore
from dspark_precompute.contract.vocab import StorageDtype
from dspark_precompute.errors import CacheFormatError, DataError, DsparkError, TargetError
from dspark_precompute.tensors import torch_dtype
from dspark_precompute.write.config.compose import from_dict
from dspark_precompute.write.config.schema import TINY, PrecomputeConfig
from dspark_precompute.write.plan.prepare import Plan, prepare, row_encoder
from dspark_precompute.write.samples.chat import Encoded
from dspark_precompute.write.samples.files import resolve_source as resolve_data_source
from dspark_precompute.write.samples.images import (
    SampleImages,
    content_sha256,
    image_base,
    image_sources,
    video_sources,
)
from dspark_precompute.write.samples.images import resolve_source as resolve_image
from dspark_precompute.write.samples.media import MediaEncoder, MediaInputs, media_spec_for
from dspark_precompute.write.samples.normalize import Reject, normalize
from dspark_precompute.write.samples.rows import RawRow, read_rows
from dspark_precompute.write.store.batching import batch_inputs, make_batches
from dspark_precompute.write.store.transfer import quantize_e4m3
from dspark_precompute.write.target.capture import HiddenStateCapture
from dspark_precompute.write.target.load import (
    TargetInfo,
    inspect_target,
    load_target,
    load_tokenizer,
    resolve_compute_dtype,
    resolve_device,
)

# one step (unit in the last place, relative) of each storage dtype, and its smallest normal
STEP = {"bf16": (2.0 ** -7, 2.0 ** -126), "fp16": (2.0 ** -10, 2.0 ** -14), "fp32": (2.0 ** -23, 2.0 ** -126),
        E4M3: (E4M3_EPS, E4M3_MIN_NORMAL)}  # fp8: relative to its scale (the floor is scale x 2^-6)


@dataclass
class CheckResult:
    """What a check that reruns the target found: problems as dicts with ``check, message, array, chunk, sample,
    unit`` (the verify report's fields) and notes; ``check`` names it in each problem."""

    problems: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    check: ClassVar[str] = "recompute"

    def add(self, message: str, **where: Any) -> None:
        self.problems.append({"check": self.check, "message": message, **where})

    def add_unreadable(self, sample: int, exc: CacheFormatError) -> None:
        """Sample ``sample`` could not be read (a corrupt or missing chunk): a problem, and the check goes on."""
        self.add(f"sample {sample}: cannot read it ({exc})", sample=sample, array=getattr(exc, "array", None))


@dataclass
class RecomputeResult(CheckResult):
    """Problems as dicts with ``check, message, array, chunk, sample, unit`` (the verify report's fields)."""

    recomputed: int = 0
    exact: int = 0
    max_steps: float = 0.0


def paths_inside(cfgd: dict[str, Any], root: str) -> list[str]:
    """Config keys whose path lies inside the cache: a cache never holds the target, data or template."""
    inside = []
    base = Path(root).resolve()
    for section, key in (("model", "path"), ("model", "tokenizer"), ("data", "path"), ("data", "chat_template")):
        value = (cfgd.get(section) or {}).get(key)
        if not isinstance(value, str) or "{" in value or "://" in value:
            continue
        try:
            p = Path(value).expanduser().resolve()
        except (OSError, RuntimeError):
            continue
        if p == base or base in p.parents:
            inside.append(f"{section}.{key}={value!r}")
    return inside


def stored_as_torch(a: np.ndarray, storage_dtype: str, scale: np.ndarray | None = None) -> torch.Tensor:
    """Stored states as a tensor of their logical dtype; fp8 (with its ``scale``) dequantized to float32."""
    if storage_dtype == E4M3:
        assert scale is not None, "fp8 states need their scales"
        return torch.from_numpy(dequantize(a, scale))
    a = np.ascontiguousarray(a)
    return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16) if storage_dtype == "bf16" else torch.from_numpy(a)


def storage_steps(got: dict[str, np.ndarray], name: str, m: Manifest, want: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """How far stored array ``name`` (rows of ``got``) is from the recomputed ``want``, in steps of its storage
    dtype per value, and whether it is bit-exact (fp8: against ``want`` quantized by the pipeline's rule)."""
    sd = m.array_dtypes[name]
    step, floor = STEP[sd]
    if sd == E4M3:
        scale_name = m.scale_arrays[name]
        bits, scale = quantize_e4m3(want, m.fp8_group or m.hidden_size)
        exact = np.array_equal(got[name], bits.numpy()) and np.array_equal(got[scale_name], scale.numpy())
        got_f = stored_as_torch(got[name], sd, got[scale_name])
        want_f = stored_as_torch(bits.numpy(), sd, scale.numpy())
        cols = scale.shape[1]
        floors = (torch.from_numpy(got[scale_name]).float() * floor).repeat_interleave(want.shape[1] // cols, dim=1)
        return (got_f - want_f).abs() / (want_f.abs().maximum(floors) * step), exact
    got_t = stored_as_torch(got[name], sd)
    exact = torch.equal(got_t, want.to(torch_dtype(sd)))
    wf = want.float()
    return (got_t.float() - wf).abs() / (wf.abs().clamp_min(floor) * step), exact


def safe_run_config(m: Manifest, store: CacheStore, *, model: str | None = None, trust_remote_code: bool = False,
                    device: str | None = None, what: str = "recompute") -> tuple[dict[str, Any] | None, list[str],
                                                                               str | None]:
    """The manifest's resolved run config, made safe to load from: ``(config, notes, problem)``.

    The recorded ``model.trust_remote_code`` is replaced by the caller's own flag, ``model``
    (``--model PATH``) replaces the recorded target path, paths that lie inside the cache
    are refused (``problem``), the compute dtype is the recorded one and ``device`` the
    caller's. ``what`` names the command in the messages.
    """
    notes: list[str] = []
    cfgd = copy.deepcopy(m.config)
    if not isinstance(cfgd.get("storage"), dict) or not isinstance(cfgd.get("model"), dict):
        return None, notes, ("the manifest holds no resolved config (config.model, config.storage): the run cannot "
                             "be rebuilt")
    cfgd["storage"]["path"] = store.path
    cfgd.update(overwrite=False, progress=False)
    if cfgd["model"].get("trust_remote_code") and not trust_remote_code:
        notes.append(f"the cache was written with model.trust_remote_code=true; {what} loads without it "
                     "(pass --trust-remote-code to verify if you trust that code)")
    cfgd["model"]["trust_remote_code"] = bool(trust_remote_code)  # only the user's own flag
    if model:
        cfgd["model"]["path"] = model
    if not store.url:
        inside = paths_inside(cfgd, store.root)
        if inside:
            return None, notes, (f"the manifest points {', '.join(inside)} inside the cache itself; a cache never "
                                 "holds the target, its tokenizer, data or template, so nothing there is loaded. Pass "
                                 f"--model PATH for the target, or run {what} from the original run's files")
    recorded = StorageDtype.from_logical(str(m.identity.get("compute_dtype", "")))
    if recorded is not None and not recorded.is_fp8:
        cfgd["model"]["dtype"] = recorded.value  # same arithmetic as the run, whatever this machine's default
    if device:
        cfgd["model"]["device"] = device
    return cfgd, notes, None


def changed_identity(recorded: dict[str, Any], now: dict[str, Any], moved_target: bool) -> list[tuple[str, Any, Any]]:
    """Identity fields that differ; with ``--model PATH`` (``moved_target``) the target's path may differ, not its
    config or weights."""
    diffs = identity_differences(recorded, now)
    return [d for d in diffs if not (moved_target and d[0] == "target.path")]


def listed_differences(diffs: list[tuple[str, Any, Any]]) -> str:
    """The first few identity differences, as a problem message lists them."""
    return "; ".join(f"{k}: recorded {a!r}, now {b!r}" for k, a, b in diffs[:6])


@dataclass
class StoredRun:
    """A cache opened for a check that reruns its target: what it holds and which samples may be read."""

    opened: OpenedCache
    cfgd: dict[str, Any]  # the run's config, made safe (no code from the cache)
    lengths: np.ndarray
    start: np.ndarray
    readable: np.ndarray  # committed, not dropped
    source_row: np.ndarray

    @property
    def m(self) -> Manifest:
        return self.opened.manifest

    @property
    def store(self) -> CacheStore:
        return self.opened.store

    def read(self, names: list[str], a: int, b: int) -> dict[str, np.ndarray]:
        """Token slots ``[a, b)`` of the named arrays, as stored."""
        return read_slots(self.opened.source, names, a, b)

    def read_sample(self, names: list[str], s: int) -> dict[str, np.ndarray]:
        """Sample ``s``'s tokens of the named arrays, as stored."""
        a = int(self.start[s])
        return self.read(names, a, a + int(self.lengths[s]))


def open_for_rerun(path: str | Path, *, model: str | None, trust_remote_code: bool, device: str | None,
                what: str) -> tuple[StoredRun | None, list[str], str | None]:
    """The cache at ``path`` for ``what`` (a check that reruns the target): (run, notes, problem); a problem
    when the manifest, its config or the arrays cannot be trusted to rebuild the run."""
    try:
        opened = open_stored(str(path), allow_incomplete=True)
    except CacheFormatError as exc:
        return None, [], f"skipped: {exc}"
    m = opened.manifest
    cfgd, notes, problem = safe_run_config(m, opened.store, model=model, trust_remote_code=trust_remote_code,
                                           device=device, what=what)
    if problem or cfgd is None:
        return None, notes, problem or "the run cannot be rebuilt"
    tables = {name: opened.tables[name].astype(np.int64) for name in SAMPLE_ARRAYS}
    readable = opened.readable(None if m.complete else sorted(opened.committed))  # dropped ones: never compared
    return StoredRun(opened, cfgd, tables["samples/length"], tables["samples/start"], readable,
                     tables["samples/source_row"]), notes, None


@dataclass
class FoundTarget:
    """The target a manifest names, checked against the cache's identity, not loaded yet."""

    cfg: PrecomputeConfig
    tokenizer: Any  # the built-in tiny target's (its vocabulary size); None for a checkpoint (its config's)
    info: TargetInfo

    def load(self) -> tuple[Any, torch.device, torch.dtype]:
        """The target on the recorded (or requested) device, in the recorded compute dtype: (model, device, dtype)."""
        cfg, info = self.cfg, self.info
        dev = resolve_device(cfg.model.device)
        dtype = resolve_compute_dtype(cfg.model.dtype, dev)
        vocab = len(self.tokenizer) if self.tokenizer is not None else info.vocab_size
        return load_target(cfg.model, info, vocab, dev, dtype), dev, dtype


def stored_target(run: StoredRun, moved: bool, what: str) -> tuple[FoundTarget | None, str | None]:
    """The target the manifest names, unloaded: (found, problem); a problem when it cannot be found or is not the
    one the cache was made with (``what`` it would give)."""
    cfgd = {**run.cfgd, "data": {}}  # the stored input_ids are the inputs: the data need not exist any more
    try:
        cfg = from_dict(cfgd)
        tokenizer = load_tokenizer(cfg.model) if cfg.model.path == TINY else None
        info = inspect_target(cfg.model, tokenizer)
    except DsparkError as exc:
        return None, f"cannot load the target the manifest names: {exc}"
    m = run.m
    now = {"target": {**m.identity.get("target", {}), "path": info.path, "model_type": info.model_type,
                      "config_sha256": info.config_sha256, "weights_fingerprint": info.weights_fingerprint}}
    diffs = changed_identity({"target": m.identity.get("target", {})}, now, moved)
    if diffs:
        listed = listed_differences(diffs)
        return None, (f"the target changed since the cache was written ({listed}); its {what} would not "
                      "be the ones the cache was made with. Pass --model PATH for the original target")
    return FoundTarget(cfg, tokenizer, info), None


def sample_positions(lengths: np.ndarray, readable: np.ndarray, n: int, seed: int) -> list[tuple[int, int]]:
    """``n`` distinct (sample, token) pairs drawn uniformly over every token of the ``readable`` samples."""
    lens = lengths[readable].astype(np.int64)
    total = int(lens.sum())
    if total == 0 or n <= 0:
        return []
    flat = np.sort(np.random.default_rng(seed).choice(total, size=min(int(n), total), replace=False))
    ends = np.cumsum(lens)
    which = np.searchsorted(ends, flat, side="right")
    starts = ends - lens
    return [(int(readable[w]), int(f - starts[w])) for w, f in zip(which, flat)]


def positions_by_sample(picked: list[tuple[int, int]]) -> dict[int, list[int]]:
    """The picked (sample, token) pairs grouped by sample, in order: each sample is read and run once."""
    by_sample: dict[int, list[int]] = {}
    for s, t in picked:
        by_sample.setdefault(s, []).append(t)
    return by_sample


@dataclass
class SampledTarget:
    """A stored run, ``n`` seeded positions of it and its target loaded: what a position-wise check compares. An
    image cache's whole checkpoint is loaded, and ``feed`` gives each image sample its pixels again."""

    run: StoredRun
    picked: list[tuple[int, int]]
    target: Any  # a transformers CausalLM (an image cache's: the whole image-text checkpoint)
    dev: torch.device
    dtype: torch.dtype
    feed: ImageFeed | None = None
    gives: str = "states"  # what the check recomputes, as its problems name it

    def image_inputs(self, s: int, ids: np.ndarray) -> tuple[dict[str, Any] | None, str | None]:
        """Sample ``s``'s image inputs for a forward of it alone (None for a text sample), or the problem that
        keeps it from being rerun as it was captured (an image changed, vanished or gives another grid)."""
        if self.feed is None or not self.feed.holds(s):
            return None, None
        refs = self.feed.sample_images(s)
        if isinstance(refs, str):
            return None, image_problem(s, refs, self.gives)
        try:
            return self.feed.inputs(np.array([s]), {s: ids}, len(ids)), None
        except DataError as exc:  # an image changed between its hash and its read, or gives another grid
            return None, f"sample {s}: its images cannot be fed again ({exc})"


def open_sampled(out: CheckResult, path: str | Path, n: int, *, seed: int, device: str | None, model: str | None,
                 trust_remote_code: bool, what: str, gives: str) -> SampledTarget | None:
    """:func:`open_for_rerun`, :func:`stored_target`, :func:`sample_positions`, then the target loaded (an image
    cache's whole checkpoint, with its :class:`ImageFeed`); notes and a problem go into ``out``. ``None`` when there
    is nothing to compare (a problem, or no readable token: a note)."""
    run, notes, problem = open_for_rerun(path, model=model, trust_remote_code=trust_remote_code, device=device,
                                      what=what)
    out.notes += notes
    if problem or run is None:
        out.add(problem or "the run cannot be rebuilt")
        return None
    found, problem = stored_target(run, bool(model), gives)
    if problem or found is None:
        out.add(problem or "the target cannot be found")
        return None
    picked = sample_positions(run.lengths, run.readable, n, seed)
    feed: ImageFeed | None = None
    if run.m.media is not None:  # an image cache: the vision tower runs on the image samples' pixels
        if not has_images_table(run.opened.tables, bool(run.m.media.videos)):
            out.add(no_images_table(what))
            return None
        found.info.load_vision()
        feed, picked = sampled_feed(run, found, picked, out, gives)
    if not picked:
        out.notes.append(f"{what} found no readable token to compare")
        return None
    target, dev, dtype = found.load()
    return SampledTarget(run, picked, target, dev, dtype, feed, gives)


def sampled_feed(run: StoredRun, found: FoundTarget, picked: list[tuple[int, int]], out: CheckResult,
                 gives: str) -> tuple[ImageFeed | None, list[tuple[int, int]]]:
    """The image cache's :class:`ImageFeed` for a position-wise check, and the positions it can compare. When the
    feed cannot be built (the rows or the processor cannot be read), one problem names the image samples that
    cannot be rerun and their positions are left out; the text samples are still compared."""
    try:
        return ImageFeed.of_run(run, found), picked
    except (DsparkError, OSError) as exc:
        why = str(exc).rstrip(".")
    images = set(np.unique(run.opened.tables[IMAGE_SAMPLE]).tolist()) | set(
        np.unique(run.opened.tables.get(VIDEO_SAMPLE, np.zeros(0, dtype=np.int64))).tolist())
    hit = sorted({s for s, _ in picked if s in images})
    if hit:
        listed = ", ".join(str(s) for s in hit[:8]) + (", ..." if len(hit) > 8 else "")
        out.add(f"{len(hit)} sample(s) with images (samples {listed}) cannot be rerun with their images, so their "
                f"{gives} cannot be recomputed: {why}. Their images are found through the rows that name them: "
                "restore the run's data (the recorded data.path) and its images, or re-create the cache",
                sample=hit[0])
    return None, [(s, t) for s, t in picked if s not in images]


def recompute(path: str | Path, n: int, *, seed: int = 0, tolerance: float = 1.0, device: str | None = None,
              model: str | None = None, trust_remote_code: bool = False) -> RecomputeResult:
    """Rerun ``n`` random readable samples (chosen with ``seed``) of the cache at ``path``; compare."""
    out = RecomputeResult()
    run, notes, problem = open_for_rerun(path, model=model, trust_remote_code=trust_remote_code, device=device,
                                      what="recompute")
    out.notes += notes
    if problem or run is None:
        out.add(problem or "the run cannot be rebuilt")
        return out
    rebuilt = rebuild_plan(run, bool(model), out)
    if rebuilt is None:
        return out
    cfg, plan = rebuilt
    layout = build_layout(run.lengths, run.m.layout.chunk_tokens, run.m.layout.unit_tokens, run.m.format_version)
    readable = run.readable
    pick = np.sort(np.random.default_rng(seed).choice(readable, size=min(int(n), len(readable)), replace=False))
    rerun = _Rerun(run, cfg, plan, layout, tolerance, out)
    try:
        for s in (int(x) for x in pick):
            rerun.compare(s)
    finally:
        rerun.capture.close()
    return out


IMAGES_IDENTITY = "data.images_sha256"  # an image cache: checked image by image against the images table instead


def rebuild_plan(run: StoredRun, moved: bool, out: RecomputeResult) -> tuple[PrecomputeConfig, Plan] | None:
    """The run's config and plan, rebuilt from the manifest; ``None`` (a problem in ``out``) when it cannot be, or
    when the target, tokenizer or data changed since: a rerun would compare against another run. A changed image
    is not such a refusal: each sample's images are checked against the images table (a problem per sample)."""
    try:
        cfg = from_dict(run.cfgd)
        plan = prepare(cfg)
    except DsparkError as exc:
        out.add(f"cannot rebuild the run from the manifest's config: {exc}")
        return None
    diffs = changed_identity(run.m.identity, plan.identity, moved)
    if any(d[0] == IMAGES_IDENTITY for d in diffs):
        out.notes.append("an image the rows name changed or vanished since the cache was written (data.images_sha256 "
                         "differs): each recomputed sample's images are checked against the images table")
        diffs = [d for d in diffs if d[0] != IMAGES_IDENTITY]
    if diffs:
        out.add(f"the target, tokenizer or data named in the manifest changed since the cache was written "
                f"({listed_differences(diffs)}); recomputing would compare against a different run")
        return None
    if plan.media is not None and not has_images_table(run.opened.tables, bool(run.m.media and run.m.media.videos)):
        out.add(no_images_table("recompute"))
        return None
    return cfg, plan


@dataclass
class StoredImages:
    """An image cache's images table, by sample: the grids and content hashes the capture saw. A rerun feeds a
    sample's images to the vision tower only when each one's bytes still hash to the recorded sha256."""

    sample: np.ndarray  # each image's sample (sorted)
    grid: np.ndarray  # int64 [n_images, 3]
    sha256: list[str]

    @classmethod
    def of(cls, tables: dict[str, np.ndarray], videos: bool = False) -> StoredImages:
        """The images table, or (``videos``) the videos table, empty where the cache has none."""
        names = (VIDEO_SAMPLE, VIDEO_GRID, VIDEO_SHA256) if videos else (IMAGE_SAMPLE, IMAGE_GRID, IMAGE_SHA256)
        if videos and not all(n in tables for n in names):
            return cls(np.zeros(0, dtype=np.int64), np.zeros((0, 3), dtype=np.int64), [])
        return cls(tables[names[0]].astype(np.int64), tables[names[1]].astype(np.int64).reshape(-1, 3),
                   [bytes(row).hex() for row in tables[names[2]]])

    def span(self, s: int) -> tuple[int, int]:
        """Sample ``s``'s rows of the table: ``[lo, hi)`` (empty for a text sample)."""
        lo, hi = np.searchsorted(self.sample, [s, s + 1])
        return int(lo), int(hi)


def has_images_table(tables: dict[str, np.ndarray], videos: bool = False) -> bool:
    """Whether the images table (each image's sample, grid and sha256) could be read: a rerun feeds nothing else."""
    names = (IMAGE_SAMPLE, IMAGE_GRID, IMAGE_SHA256) + ((VIDEO_SAMPLE, VIDEO_GRID, VIDEO_SHA256) if videos else ())
    return all(name in tables for name in names)  # ``videos``: a cache with videos needs its videos table too


def no_images_table(what: str) -> str:
    """The problem of an image cache whose images table cannot be read, for ``what`` (the check)."""
    return (f"the cache holds rows with images (or videos) but its images table (images/sample, images/grid_thw, "
            "images/sha256) or videos table "
            f"cannot be read, so their images cannot be fed again and {what} stops; run `dspark-cache verify` "
            "alone to see the damage")


def image_problem(s: int, why: str, gives: str) -> str:
    """The problem of sample ``s`` whose image ``why`` (changed, vanished): its ``gives`` cannot be recomputed."""
    return (f"sample {s}: {why}, so its {gives} cannot be recomputed. Restore the image the cache was made from, or "
            "re-create the cache (a resume over a changed image is refused too)")


def _shown(where: str) -> str:
    return "a data: URL" if where.startswith("data:") else where


class ImageFeed:
    """An image cache's images fed to the whole image-text checkpoint again, as the capture fed them: each sample's
    sources (those its source row names, as many as the images table holds for it), each checked against its
    recorded sha256 first; the pixels come from the run's own processor, their grids checked against the table's."""

    def __init__(self, tables: dict[str, np.ndarray], source_row: np.ndarray, rows: list[RawRow], data_format: str,
                 root: str | None, media: MediaEncoder) -> None:
        self.images = StoredImages.of(tables)
        self.videos = StoredImages.of(tables, videos=True)  # a cache with videos: its videos table
        self.source_row, self.rows, self.data_format, self.root, self.media = source_row, rows, data_format, root, \
            media
        self._refs: dict[int, SampleImages | str | None] = {}

    @classmethod
    def of_run(cls, run: StoredRun, found: FoundTarget) -> ImageFeed:
        """The feed of a check that needs no plan (the stored ids are its inputs): the recorded config's rows and
        encoder, with the found target's processor; raises when they cannot be read."""
        cfg = from_dict(run.cfgd)
        spec = media_spec_for(found.info.local_dir, cfg.data.image, cfg.data.video)
        if spec is None:
            raise TargetError(f"model.path={cfg.model.path} has no image processor (preprocessor_config.json and a "
                              "vision_config) to read the images with")
        encoder = row_encoder(cfg, run.m.chat_template, spec)
        chat = encoder.build(load_tokenizer(cfg.model))
        rows = read_rows(resolve_data_source(cfg.data.path, cfg.data.split_slice()[0]), cfg.data)
        return cls(run.opened.tables, run.source_row, rows, cfg.data.format, encoder.data_root, chat.media)

    def holds(self, s: int) -> bool:
        """Whether sample ``s`` holds images or videos (the images or videos table lists one)."""
        lo, hi = self.images.span(s)
        vlo, vhi = self.videos.span(s)
        return hi > lo or vhi > vlo

    def sample_images(self, t: int) -> SampleImages | str | None:
        """Sample ``t``'s images as the capture read them, each checked against its recorded sha256: None for a text
        sample, a description of the first image that changed or is missing. Each sample is checked once."""
        if t not in self._refs:
            self._refs[t] = self._check_images(t)
        return self._refs[t]

    def _check_images(self, t: int) -> SampleImages | str | None:
        lo, hi = self.images.span(t)
        vlo, vhi = self.videos.span(t)
        if lo == hi and vlo == vhi:
            return None
        raw = self.rows[int(self.source_row[t])]
        conv = normalize(raw, self.data_format, media=True)
        base = image_base(self.root, raw.file)
        found: list[list[str]] = []
        for kind, table, a, b, names in (("image", self.images, lo, hi, image_sources),
                                         ("video", self.videos, vlo, vhi, video_sources)):
            named = [] if isinstance(conv, Reject) else names(conv.messages)
            where = [resolve_image(x, base) for x in named][:b - a]
            if len(where) < b - a:
                return f"source row {raw.row} names {len(named)} {kind}(s), the {kind}s table {b - a}"
            for k, (w, want) in enumerate(zip(where, table.sha256[a:b], strict=True)):
                now = content_sha256(w)
                if now.startswith("missing:"):
                    return f"{kind} {k} ({_shown(w)}) cannot be read ({now.removeprefix('missing:')})"
                if now != want:
                    return (f"{kind} {k} ({_shown(w)}) changed since the cache was written (sha256 recorded "
                            f"{want[:16]}..., now {now[:16]}...)")
            found.append(where)
        return SampleImages(tuple(found[0]), tuple(self.images.sha256[lo:hi]), self.images.grid[lo:hi],
                            tuple(found[1]), tuple(self.videos.sha256[vlo:vhi]), self.videos.grid[vlo:vhi])

    def inputs(self, batch: np.ndarray, ids_of: dict[int, np.ndarray], width: int) -> dict[str, Any] | None:
        """The forward's image inputs of ``batch`` (right-padded to ``width``; ``ids_of``: each sample's ids), as
        :class:`MediaInputs` gives the pipeline them; None when no sample of it holds an image. Raises
        :class:`DataError` when the processor's grids are not the recorded ones (its pixel settings changed)."""
        refs = {int(t): r for t in batch if isinstance(r := self.sample_images(int(t)), SampleImages)}
        if not refs:
            return None
        pixels = MediaInputs(refs, self.media).of_batch(batch, ids_of, width)
        assert pixels is not None  # a sample of the batch holds images
        want = np.concatenate([np.asarray(refs[int(t)].grid_thw).reshape(-1, 3) for t in batch if int(t) in refs])
        got = pixels["image_grid_thw"].numpy().astype(np.int64).reshape(-1, 3) if "image_grid_thw" in pixels \
            else np.zeros((0, 3), dtype=np.int64)  # the videos' grids: checked by MediaEncoder.pixel_inputs
        if not np.array_equal(got, want):
            raise DataError(f"the processor gives the images grids {got.tolist()}, the images table recorded "
                            f"{want.tolist()} (data.image.* or the checkpoint's preprocessor_config.json changed)")
        return pixels


class _Rerun:
    """The rebuilt run a sample is compared with: its source rows, encoder, layout, batching and target (hooked);
    an image cache's whole checkpoint, fed each batch's images again as the capture fed them."""

    def __init__(self, run: StoredRun, cfg: PrecomputeConfig, plan: Plan, layout: Layout, tolerance: float,
                 out: RecomputeResult) -> None:
        m = run.m
        self.run, self.cfg, self.plan, self.layout, self.tolerance, self.out = run, cfg, plan, layout, tolerance, out
        self.rows = read_rows(resolve_data_source(cfg.data.path, cfg.data.split_slice()[0]), cfg.data)
        self.spec = plan.encoding.spec  # the run's own row encoder: an image row goes through the processor
        self.encoder = self.spec.build(plan.tokenizer)
        self.feed = None if plan.media is None else ImageFeed(run.opened.tables, run.source_row, self.rows,
                                                              cfg.data.format, self.spec.data_root, self.encoder.media)
        target = load_target(cfg.model, plan.target, len(plan.tokenizer), plan.device, plan.compute_dtype)
        self.capture = HiddenStateCapture(target, plan.layer_ids, pre_norm=m.pre_norm_array is not None,
                                          media=self.feed is not None)
        self.names = {int(k): v for k, v in m.arrays.items() if k.lstrip("-").isdigit()}

    def compare(self, s: int) -> None:
        """Sample ``s``: its images against the images table, stored tokens against its source row re-encoded,
        stored states against its batch rerun (with the batch's images)."""
        run, m, out = self.run, self.run.m, self.out
        try:
            got = run.read_sample([INPUT_IDS, LOSS_MASK, *self._positions(), *m.hidden_array_names,
                                   *m.scale_arrays.values()], s)
        except CacheFormatError as exc:  # a corrupt or missing chunk
            out.add_unreadable(s, exc)
            return
        raw = self.rows[int(run.source_row[s])]
        refs = self.sample_images(s)
        if isinstance(refs, str):
            out.add(image_problem(s, refs, "states"), sample=s, unit=int(self.layout.unit[s]))
            return
        enc = self.spec.encode(self.encoder, raw, int(run.source_row[s]))
        if isinstance(enc, Reject):
            out.add(f"sample {s}: its source row {raw.row} no longer encodes ({enc.reason}: {enc.message})",
                    sample=s)
            return
        self._compare_tokens(s, got, enc, raw.row)
        batch = self._batch_of(s)
        for t in (int(x) for x in batch if int(x) != s):
            other = self.sample_images(t)
            if isinstance(other, str):
                out.add(f"sample {s}: its forward batch holds sample {t}, whose {other}; the batch cannot be rerun "
                        "as it was captured. Restore that image, or re-create the cache", sample=s,
                        unit=int(self.layout.unit[s]))
                return
        try:
            worst, exact = self._compare_states(s, got, batch)
        except DataError as exc:  # an image changed between its hash and its read, or gives another grid
            out.add(f"sample {s}: its batch's images cannot be fed again ({exc})", sample=s)
            return
        out.recomputed += 1
        out.exact += int(exact)
        out.max_steps = max(out.max_steps, worst)

    def _positions(self) -> list[str]:
        return [POSITION_IDS] if POSITION_IDS in self.run.opened.metas else []

    def sample_images(self, t: int) -> SampleImages | str | None:
        """Sample ``t``'s images, checked (:meth:`ImageFeed.sample_images`); None in a text cache."""
        return None if self.feed is None else self.feed.sample_images(t)

    def _compare_tokens(self, s: int, got: dict[str, np.ndarray], enc: Encoded, row: int) -> None:
        """Stored ids, masks (and positions) against the re-encoded row: a problem at the first token that differs."""
        a, u, ct = int(self.run.start[s]), int(self.layout.unit[s]), self.run.m.layout.chunk_tokens
        wants = [(INPUT_IDS, enc.input_ids), (LOSS_MASK, enc.loss_mask)]
        if POSITION_IDS in got:  # a text row's: the same count on every axis (as the capture writes it)
            rope = enc.position_ids
            wants.append((POSITION_IDS, rope if rope is not None else np.broadcast_to(
                np.arange(len(enc.input_ids), dtype=np.int32)[:, None], got[POSITION_IDS].shape)))
        for key, want in wants:
            have = np.asarray(got[key])
            want = np.asarray(want)
            if len(have) != len(want) or not np.array_equal(have, want):
                diff = (have[:len(want)] != want[:len(have)]).reshape(min(len(have), len(want)), -1).any(axis=1)
                pos = int(np.flatnonzero(diff)[0]) if diff.any() else min(len(have), len(want))
                self.out.add(f"sample {s}: stored {key} differs from re-tokenizing source row {row} (first at "
                             f"token {pos}, chunk {(a + pos) // ct})", sample=s, array=key, chunk=((a + pos) // ct,),
                             unit=u)

    def _batch_of(self, s: int) -> np.ndarray:
        """The forward batch the pipeline ran sample ``s`` in, rebuilt from the layout with its own batching."""
        cfg = self.cfg
        order = self.layout.unit_order[int(self.layout.unit[s])]
        return next(b for b in make_batches(order, self.run.lengths, cfg.batch.max_tokens, cfg.batch.max_samples)
                    if s in set(b.tolist()))

    def _rerun_batch(self, s: int, batch: np.ndarray) -> tuple[dict[int, torch.Tensor], torch.Tensor, int]:
        """``batch`` (sample ``s``'s) run again with the pipeline's inputs, its images' pixels included:
        (states by layer id, last state, the sample's row in the batch)."""
        run = self.run
        members = {int(t): run.read_sample([INPUT_IDS], int(t))[INPUT_IDS] for t in batch}
        ids, _ = batch_inputs(members, batch, run.lengths, self.plan.pad_id, self.plan.device)
        pixels = None if self.feed is None else self.feed.inputs(batch, members, ids.shape[1])
        states, last = self.capture(ids, media=pixels)
        return states, last, int(np.flatnonzero(batch == s)[0])

    def _compare_states(self, s: int, got: dict[str, np.ndarray], batch: np.ndarray) -> tuple[float, bool]:
        """Every stored state of sample ``s`` against the rerun, in steps of its storage dtype: (worst, bit-exact);
        a problem per array past the tolerance."""
        m, out = self.run.m, self.out
        a, length, u, ct = int(self.run.start[s]), int(self.run.lengths[s]), int(self.layout.unit[s]), \
            m.layout.chunk_tokens
        states, last, r = self._rerun_batch(s, batch)
        worst, exact = 0.0, True
        checks = [(f"layer {lid}", self.names[lid], states[lid]) for lid in self.plan.layer_ids]
        if m.last_array is not None:
            checks.append(("last (post-norm)", m.last_array, last))
        if m.pre_norm_array is not None:
            checks.append(("last (pre-norm)", m.pre_norm_array, states[m.num_hidden_layers]))
        for label, arr_name, t in checks:
            steps, same = storage_steps(got, arr_name, m, t[r, :length].detach().cpu())
            exact = exact and same
            sdtype = m.array_dtypes[arr_name]
            ms = float(steps.max()) if steps.numel() else 0.0
            worst = max(worst, ms)
            if ms > self.tolerance:
                pos = int(steps.amax(dim=-1).argmax())
                out.add(f"sample {s}, {label} (array {arr_name!r}): stored hidden states differ from the "
                        f"recomputation by {ms:.1f} {sdtype} steps (> tolerance {self.tolerance}), worst at token "
                        f"{pos} in chunk {((a + pos) // ct, 0)}", sample=s, array=arr_name,
                        chunk=((a + pos) // ct, 0), unit=u)
        return worst, exact
