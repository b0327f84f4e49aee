"""``dspark-cache verify --precision N``: what the storage dtype costs, measured against a recompute.

The target is rebuilt as for ``--teacher`` (:mod:`dspark_precompute.write.rerun.teacher`: the recorded
config and weights, ``--model PATH`` for a target that moved, remote code only on the user's
flag; the stored ``input_ids`` are the inputs, a text cache needs no data; an image sample gets
its images again, checked against the images table's sha256). N token positions are
drawn across the readable samples (seeded); each sample holding one is run alone through the
decoder (an image sample through the whole image-text checkpoint, with its pixels) in the
recorded compute dtype, and at those positions every stored array (fp8
dequantized exactly as a reader does) is compared with the recomputed state:

* per array, the relative RMS error ``sqrt(sum (stored - ref)^2 / sum ref^2)`` over the
  positions and channels, and the worst token by its own relative error ``||s - r|| / ||r||``;
* for the post-norm state, what the trainer sees: the teacher distribution
  ``softmax(lm_head(state))`` from the stored state against the recomputed one, as the mean and
  largest total-variation distance and the top-1 agreement, and the relative logit error
  ``||l_s - l_r|| / ||l_r||`` (a random-weight target's teacher is nearly one-hot, so its TV
  says little; the logit error still shows what the stored state costs).

The reference is the sample run alone (the pipeline ran it in a right-padded batch), so a
bf16 cache shows its own rounding (about 0.2-0.3% relative) and next to nothing else.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from dspark_precompute.contract.manifest import Manifest
from dspark_precompute.contract.spec import INPUT_IDS
from dspark_precompute.errors import CacheFormatError
from dspark_precompute.write.rerun.recompute import (
    CheckResult,
    SampledTarget,
    open_sampled,
    positions_by_sample,
    stored_as_torch,
)
from dspark_precompute.write.rerun.teacher import DEFAULT_MAX_TV, DEFAULT_MIN_TOP1, POSITIONS_PER_FORWARD, agreement
from dspark_precompute.write.target.capture import HiddenStateCapture

log = logging.getLogger(__name__)

DEFAULT_MAX_REL_RMS = 0.05  # the bound for fp8 intermediate layers; bf16 storage is about 0.003


@dataclass
class ArrayError:
    """One stored array's error against the recompute, over the sampled positions."""

    array: str
    layer: str  # "layer 3", "embeddings", "last (post-norm)"
    dtype: str  # its storage dtype
    rel_rms: float = 0.0
    worst_rel: float = 0.0  # the largest per-token relative error
    worst_sample: int = -1
    worst_token: int = -1
    _err2: float = 0.0
    _ref2: float = 0.0

    def add(self, sample: int, tokens: list[int], stored: torch.Tensor, ref: torch.Tensor) -> None:
        diff2 = (stored - ref).pow(2).sum(-1)
        ref2 = ref.pow(2).sum(-1)
        self._err2 += float(diff2.sum())
        self._ref2 += float(ref2.sum())
        rel = (diff2.sqrt() / ref2.sqrt().clamp_min(torch.finfo(torch.float32).tiny)).tolist()
        k = int(np.argmax(rel))
        if rel[k] > self.worst_rel or self.worst_sample < 0:
            self.worst_rel, self.worst_sample, self.worst_token = float(rel[k]), sample, tokens[k]
        self.rel_rms = math.sqrt(self._err2 / self._ref2) if self._ref2 > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {"array": self.array, "layer": self.layer, "dtype": self.dtype, "rel_rms": self.rel_rms,
                "worst_token_rel": self.worst_rel, "worst_sample": self.worst_sample, "worst_token": self.worst_token}


@dataclass
class PrecisionResult(CheckResult):
    """What ``--precision`` measured; problems as dicts with ``check, message, array, sample`` (the verify report's)."""

    check: ClassVar[str] = "precision"
    positions: int = 0
    samples: int = 0
    compute_dtype: str = ""
    arrays: list[ArrayError] = field(default_factory=list)
    top1_agreement: float | None = None  # argmax of lm_head(stored last) == argmax of lm_head(recomputed last)
    tv_mean: float | None = None  # total variation between the two teacher distributions
    tv_max: float | None = None
    logit_rel_error: float | None = None  # mean over positions of ||l_s - l_r|| / ||l_r||

    def to_json(self) -> dict[str, Any] | None:
        if not self.positions:
            return None
        return {"positions": self.positions, "samples": self.samples, "reference": f"recompute in "
                f"{self.compute_dtype}", "arrays": [a.to_json() for a in self.arrays],
                "last_top1_agreement": self.top1_agreement, "last_tv_mean": self.tv_mean, "last_tv_max": self.tv_max,
                "last_logit_rel_error": self.logit_rel_error}


def precision_check(path: str | Path, n: int, *, seed: int = 0, device: str | None = None, model: str | None = None,
                    trust_remote_code: bool = False, max_rel_rms: float = DEFAULT_MAX_REL_RMS,
                    min_top1: float = DEFAULT_MIN_TOP1, max_tv: float = DEFAULT_MAX_TV) -> PrecisionResult:
    """Compare every stored array with the target's recomputed states at ``n`` seeded positions.

    A problem when an array's relative RMS error is above ``max_rel_rms``, or the teacher
    distribution from the stored final state agrees on top-1 less than ``min_top1`` or has a
    mean total-variation distance above ``max_tv``.
    """
    out = PrecisionResult()
    sampled = open_sampled(out, path, n, seed=seed, device=device, model=model, trust_remote_code=trust_remote_code,
                           what="the precision check", gives="states")
    if sampled is None:
        return out
    m = sampled.run.m
    out.compute_dtype = str(sampled.dtype).replace("torch.", "")
    layer_of = _capture_keys(m)
    errors = [ArrayError(name, _array_label(m, name, layer_of), m.array_dtypes[name]) for name in m.hidden_array_names]
    teacher = _measure(sampled, layer_of, errors, out)
    if not out.positions:
        return out
    out.arrays = errors
    top1, tv, logit_rel = teacher
    out.top1_agreement, out.tv_mean, out.tv_max = float(np.mean(top1)), float(np.mean(tv)), float(np.max(tv))
    out.logit_rel_error = float(np.mean(logit_rel))
    _judge(out, m, max_rel_rms=max_rel_rms, min_top1=min_top1, max_tv=max_tv)
    return out


def _capture_keys(m: Manifest) -> dict[str, int]:
    """Each stored array's key in the capture's states (the pre-norm state's is the layer count)."""
    layer_of = {v: int(k) for k, v in m.arrays.items() if k.lstrip("-").isdigit()}
    if m.pre_norm_array is not None:
        layer_of[m.pre_norm_array] = m.num_hidden_layers  # the capture's key of the pre-norm state
    return layer_of


def _array_label(m: Manifest, name: str, layer_of: dict[str, int]) -> str:
    """How the report names a stored array: "layer 3", "embeddings", "pre-norm", "final norm", "(post-norm)"."""
    lid = layer_of.get(name, m.num_hidden_layers - 1)
    label = "embeddings" if lid == -1 else "pre-norm" if name == m.pre_norm_array else f"layer {lid}" \
        if name in layer_of else "final norm"
    return label + (" (post-norm)" if name == m.last_array else "")


def _measure(sampled: SampledTarget, layer_of: dict[str, int], errors: list[ArrayError],
             out: PrecisionResult) -> tuple[list[bool], list[float], list[float]]:
    """Run each sample holding a sampled position alone; add every array's error at those positions to ``errors``
    and return the teacher comparison from the stored final state: (top-1 agreement, TV, relative logit error)."""
    run, target, dev, dtype = sampled.run, sampled.target, sampled.dev, sampled.dtype
    m = run.m
    head = target.get_output_embeddings()
    capture = HiddenStateCapture(target, m.layer_ids, pre_norm=m.pre_norm_array is not None,
                                 media=sampled.feed is not None)
    last_id = m.num_hidden_layers - 1
    scales = m.scale_arrays
    top1: list[bool] = []
    tv: list[float] = []
    logit_rel: list[float] = []
    try:
        with torch.inference_mode():
            for s, toks in positions_by_sample(sampled.picked).items():
                try:
                    got = run.read_sample([INPUT_IDS, *m.hidden_array_names, *scales.values()], s)
                except CacheFormatError as exc:
                    out.add_unreadable(s, exc)
                    continue
                media, problem = sampled.image_inputs(s, got[INPUT_IDS])
                if problem:
                    out.add(problem, sample=s)
                    continue
                ids = torch.from_numpy(got[INPUT_IDS].astype(np.int64)).to(dev)
                states, last = capture(ids[None], media=media)
                pos = torch.tensor(toks, dtype=torch.long)
                for e in errors:
                    lid = layer_of.get(e.array, last_id)
                    ref = (last if e.array == m.last_array else states[lid])[0].index_select(0, pos.to(dev))
                    stored = stored_as_torch(got[e.array][toks], e.dtype,
                                             got[scales[e.array]][toks] if e.array in scales else None)
                    e.add(s, toks, stored.float(), ref.float().cpu())
                ref_last = last[0].index_select(0, pos.to(dev))
                name = m.last_array or m.pre_norm_array or ""
                stored_last = stored_as_torch(got[name][toks], m.array_dtypes[name],
                                              got[scales[name]][toks] if name in scales else None).to(dev, dtype)
                for b in range(0, len(toks), POSITIONS_PER_FORWARD):
                    teacher = head(ref_last[b:b + POSITIONS_PER_FORWARD]).float()
                    student = head(stored_last[b:b + POSITIONS_PER_FORWARD]).float()
                    agree, dist = agreement(teacher, student)
                    top1 += agree
                    tv += dist
                    logit_rel += ((teacher - student).norm(dim=-1) / teacher.norm(dim=-1).clamp_min(1e-30)).tolist()
                out.positions += len(toks)
                out.samples += 1
    finally:
        capture.close()
    return top1, tv, logit_rel


def _judge(out: PrecisionResult, m: Manifest, *, max_rel_rms: float, min_top1: float, max_tv: float) -> None:
    """A problem per array past ``max_rel_rms`` and one for a distorted teacher; the measurements logged."""
    assert out.top1_agreement is not None and out.tv_mean is not None
    for e in out.arrays:
        if e.rel_rms > max_rel_rms:
            out.add(f"{e.layer} (array {e.array!r}, stored as {e.dtype}): relative RMS error {e.rel_rms:.3%} against "
                    f"the recompute in {out.compute_dtype} over {out.positions} positions (at most {max_rel_rms:.1%}); "
                    f"worst at sample {e.worst_sample}, token {e.worst_token} ({e.worst_rel:.3%}). Store it in a wider "
                    "dtype (storage.dtype / storage.last_dtype), or try storage.fp8_group=128 for targets with "
                    "outlier channels", array=e.array, sample=e.worst_sample)
    if out.top1_agreement < min_top1 or out.tv_mean > max_tv:
        out.add(f"the teacher distribution from the stored final state ({m.last_array!r}, {m.last_storage_dtype}) "
                f"agrees on top-1 at {out.top1_agreement:.2%} of {out.positions} positions (at least {min_top1:.0%}) "
                f"with a mean total-variation distance of {out.tv_mean:.3g} (at most {max_tv:g}) against the "
                "recomputed one: a trainer would learn from a distorted teacher. Keep storage.last_dtype=bf16",
                array=m.last_array)
    for e in out.arrays:
        log.info("precision: %s (%s): relative RMS error %.4f, worst token %.4f at sample %d token %d", e.layer,
                 e.dtype, e.rel_rms, e.worst_rel, e.worst_sample, e.worst_token)
    log.info("precision: teacher from the stored final state: top-1 agreement %.2f%%, TV mean %.3g / max %.3g, "
             "relative logit error %.3g", 100 * out.top1_agreement, out.tv_mean, out.tv_max, out.logit_rel_error)
