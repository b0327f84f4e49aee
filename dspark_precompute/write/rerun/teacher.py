"""``dspark-cache verify --teacher N``: is the stored final state the one the trainer needs?

A DSpark / EAGLE-3 trainer gets the target's logits by applying ``lm_head`` to
``target_last_hidden_states``. This check loads the target, runs its own full forward
with the vocabulary projection (the CausalLM's logits, unpadded, one sample at a time) on N
token positions sampled across the cache's samples (seeded), and compares them with the
target's ``lm_head`` applied to the stored final state at the same positions: top-1
agreement, the largest logit difference and the total-variation distance between the two
softmaxes. A state taken before the final norm, from another layer or at the wrong
position fails it.

The target is rebuilt under :mod:`dspark_precompute.write.rerun.recompute`'s rules: the user's
``--trust-remote-code`` only, never a path inside the cache, ``--model PATH`` for a target
that moved (its config and weights must still be the recorded ones). The stored ``input_ids``
are the inputs, so a text cache needs no data. An image cache loads the whole image-text
checkpoint and feeds each image sample its images again (read from the paths its source row
names, each checked against the images table's sha256 first): the forward is the checkpoint's
own on the capture's input, vision tower and multi-axis positions included. A changed or missing
image is a problem of its sample.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from dspark_precompute.contract.spec import INPUT_IDS
from dspark_precompute.errors import CacheFormatError
from dspark_precompute.write.plan.provenance import final_norm_of
from dspark_precompute.write.rerun.recompute import (
    STEP,
    CheckResult,
    SampledTarget,
    open_sampled,
    positions_by_sample,
    stored_as_torch,
)

log = logging.getLogger(__name__)

DEFAULT_MIN_TOP1 = 0.95  # share of positions whose argmax must agree
DEFAULT_MAX_TV = 0.10  # largest mean total-variation distance between the two softmaxes
# Largest mean relative logit error ||t - s|| / ||t||, in steps (eps) of the storage and compute dtypes:
# 4 x (2^-7 + 2^-23) = 0.031 for bf16 storage of an fp32 forward, 0.0625 for a bf16 forward. Measured on the
# tiny target (fp32 forward, bf16 storage): 0.0015 for the stored post-norm state; 0.069 for the last decoder
# layer's output before the norm; 0.13-0.16 for another layer's output. Top-1 and TV alone cannot tell those
# apart there (a random target's near-unit norm keeps every argmax), real targets' pre-norm states have other
# scales altogether.
REL_STEPS = 4
POSITIONS_PER_FORWARD = 512  # logits of at most this many positions at once (memory: positions x vocab)


@dataclass
class TeacherResult(CheckResult):
    """What the check measured; problems as dicts with ``check, message, array, sample`` (the verify report's)."""

    check: ClassVar[str] = "teacher"
    positions: list[tuple[int, int]] = field(default_factory=list)  # (sample, token) pairs compared
    samples: int = 0
    top1_agreement: float | None = None  # share of positions whose argmax agrees
    max_logit_diff: float | None = None  # largest |logit difference| over positions and vocabulary
    tv_mean: float | None = None  # total-variation distance between the softmaxes, mean over positions
    tv_max: float | None = None
    rel_error_mean: float | None = None  # ||teacher - stored logits|| / ||teacher logits||, mean over positions
    rel_error_max: float | None = None
    normed_top1_agreement: float | None = None  # diagnosis: agreement after applying the final norm once more


def agreement(teacher: torch.Tensor, student: torch.Tensor) -> tuple[list[bool], list[float]]:
    """Per position: do the two logits' argmaxes agree, and the total-variation distance of their softmaxes."""
    top1 = (teacher.argmax(-1) == student.argmax(-1)).tolist()
    tv = (0.5 * (torch.softmax(teacher, -1) - torch.softmax(student, -1)).abs().sum(-1)).tolist()
    return top1, tv


def _teacher_logits(model: Any, ids: torch.Tensor, pos: torch.Tensor,
                    media: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """The CausalLM's own logits at ``pos`` of one unpadded sequence (float32, ``[len(pos), vocab]``); ``media``: an
    image sample's pixel inputs, for the image-text checkpoint's own forward (vision tower, multi-axis positions)."""
    logits: torch.Tensor
    extra = {k: v.to(ids.device) for k, v in (media or {}).items()}
    try:
        out = model(input_ids=ids[None], use_cache=False, logits_to_keep=pos, **extra)
        logits = out.logits[0].float()
    except TypeError:  # a model class without logits_to_keep: project every position, keep the picked ones
        logits = model(input_ids=ids[None], use_cache=False, **extra).logits[0, pos].float()
    return logits


def teacher_check(path: str | Path, n: int, *, seed: int = 0, device: str | None = None, model: str | None = None,
                  trust_remote_code: bool = False, min_top1: float = DEFAULT_MIN_TOP1,
                  max_tv: float = DEFAULT_MAX_TV, max_rel: float | None = None) -> TeacherResult:
    """Compare the target's own logits with ``lm_head(stored final state)`` at ``n`` seeded positions.

    It fails (a problem) when the top-1 agreement is below ``min_top1``, the mean total-variation
    distance above ``max_tv`` or the mean relative logit error above ``max_rel`` (default:
    :data:`REL_STEPS` steps of the storage and compute dtypes).
    """
    out = TeacherResult()
    sampled = open_sampled(out, path, n, seed=seed, device=device, model=model, trust_remote_code=trust_remote_code,
                           what="the teacher check", gives="logits")
    if sampled is None:
        return out
    m = sampled.run.m
    norm = final_norm_of(sampled.target)
    norm_class = type(norm).__name__ if norm is not None else None
    recorded_norm = m.capture.final_norm_class if m.capture is not None else None
    if recorded_norm and norm_class and recorded_norm != norm_class:
        out.notes.append(f"the manifest records the final norm as {recorded_norm}, the loaded target's is "
                         f"{norm_class}")
    if m.last_array is None:
        out.add("this cache stores no post-norm state (capture.last_state=pre_norm): there is no teacher "
                "distribution to check")
        return out
    acc = _compare_logits(sampled, norm, out)
    if not acc.positions:
        return out
    tol = max_rel if max_rel is not None else REL_STEPS * (acc.storage_eps + float(torch.finfo(sampled.dtype).eps))
    acc.finish(out)
    _judge(out, acc, m.last_array, norm_class, min_top1=min_top1, max_tv=max_tv, max_rel=max_rel, tol=tol)
    log.info("teacher check: %d positions in %d samples, top-1 agreement %.2f%%, mean relative logit error %.3g, "
             "mean TV %.3g", len(out.positions), out.samples, 100 * (out.top1_agreement or 0.0),
             out.rel_error_mean, out.tv_mean)
    return out


def _compare_logits(sampled: SampledTarget, norm: Any, out: TeacherResult) -> _Accumulator:
    """The target's own logits against ``lm_head`` of the stored final state (and of it normed once more, the
    diagnosis of a state taken before the norm) at every sampled position, one sample's forward at a time."""
    run, target, dev, dtype = sampled.run, sampled.target, sampled.dev, sampled.dtype
    m = run.m
    last = m.last_array
    assert last is not None
    head = target.get_output_embeddings()
    last_scale = m.scale_arrays.get(last)
    acc = _Accumulator()
    with torch.inference_mode():
        for s, toks in positions_by_sample(sampled.picked).items():
            try:
                got = run.read_sample([INPUT_IDS, last, *([last_scale] if last_scale else [])], s)
            except CacheFormatError as exc:
                out.add_unreadable(s, exc)
                continue
            media, problem = sampled.image_inputs(s, got[INPUT_IDS])
            if problem:
                out.add(problem, sample=s)
                continue
            ids = torch.from_numpy(got[INPUT_IDS].astype(np.int64)).to(dev)
            for b in range(0, len(toks), POSITIONS_PER_FORWARD):
                block = toks[b:b + POSITIONS_PER_FORWARD]
                teacher = _teacher_logits(target, ids, torch.tensor(block, dtype=torch.long, device=dev), media)
                stored = stored_as_torch(got[last][block], m.last_storage_dtype,
                                         got[last_scale][block] if last_scale else None)
                acc.storage_eps = STEP[m.last_storage_dtype][0]
                stored = stored.to(dev, dtype)
                normed = head(norm(stored)).float() if norm is not None else None
                acc.add(s, block, teacher, head(stored).float(), normed)
    return acc


def _judge(out: TeacherResult, acc: _Accumulator, last: str, norm_class: str | None, *, min_top1: float,
           max_tv: float, max_rel: float | None, tol: float) -> None:
    """One problem naming every bound the measurement broke (and, when normalizing the stored state once more
    would pass, that it was taken before the final norm)."""
    failed = []
    if out.top1_agreement is not None and out.top1_agreement < min_top1:
        failed.append(f"top-1 agreement {out.top1_agreement:.1%} (at least {min_top1:.0%} required)")
    if out.tv_mean is not None and out.tv_mean > max_tv:
        failed.append(f"mean total-variation distance {out.tv_mean:.3g} (at most {max_tv:g})")
    if out.rel_error_mean is not None and out.rel_error_mean > tol:
        why = f", {REL_STEPS} steps of the storage and compute dtypes" if max_rel is None else ""
        failed.append(f"mean relative logit error {out.rel_error_mean:.3g} (at most {tol:.3g}{why})")
    if not failed:
        return
    hint = ""
    if acc.normed_rel and float(np.mean(acc.normed_rel)) <= tol and (out.normed_top1_agreement or 0) >= min_top1:
        hint = (f" Applying the target's {norm_class} to the stored state once more brings the relative error to "
                f"{float(np.mean(acc.normed_rel)):.3g}: the stored state was taken before the final norm.")
    s_w, t_w, rel_w = acc.worst
    out.add(f"lm_head applied to the stored final state ({last!r}) does not reproduce the target's own logits "
            f"over {len(out.positions)} positions in {out.samples} samples: {'; '.join(failed)}; largest logit "
            f"difference {out.max_logit_diff:.3g}, worst at sample {s_w}, token {t_w} (relative error "
            f"{rel_w:.3g}). The stored state is not the target's post-norm state at the right position, so a "
            "trainer would learn from wrong target logits. Re-create the cache (re-run the precompute command "
            f"with overwrite=true).{hint}", array=last, sample=s_w)


class _Accumulator:
    """Per-position comparisons of teacher and stored-state logits, summed up into a :class:`TeacherResult`."""

    def __init__(self) -> None:
        self.positions: list[tuple[int, int]] = []
        self.top1: list[bool] = []
        self.normed_top1: list[bool] = []
        self.tv: list[float] = []
        self.rel: list[float] = []
        self.normed_rel: list[float] = []
        self.max_diff = 0.0
        self.worst = (-1, -1, -1.0)  # (sample, token, relative error)
        self.storage_eps = 0.0

    def add(self, sample: int, tokens: list[int], teacher: torch.Tensor, student: torch.Tensor,
            normed: torch.Tensor | None) -> None:
        scale = teacher.norm(dim=-1).clamp_min(torch.finfo(teacher.dtype).tiny)
        rel = ((teacher - student).norm(dim=-1) / scale).tolist()
        self.positions += [(sample, t) for t in tokens]
        top1, tv = agreement(teacher, student)
        self.top1 += top1
        self.tv += tv
        self.rel += rel
        self.max_diff = max(self.max_diff, float((teacher - student).abs().max()))
        k = int(np.argmax(rel))
        if rel[k] > self.worst[2]:
            self.worst = (sample, tokens[k], float(rel[k]))
        if normed is not None:
            self.normed_top1 += (teacher.argmax(-1) == normed.argmax(-1)).tolist()
            self.normed_rel += ((teacher - normed).norm(dim=-1) / scale).tolist()

    def finish(self, out: TeacherResult) -> None:
        out.positions = list(self.positions)
        out.samples = len({s for s, _ in self.positions})
        out.top1_agreement = float(np.mean(self.top1))
        out.max_logit_diff = self.max_diff
        out.tv_mean, out.tv_max = float(np.mean(self.tv)), float(np.max(self.tv))
        out.rel_error_mean, out.rel_error_max = float(np.mean(self.rel)), float(np.max(self.rel))
        out.normed_top1_agreement = float(np.mean(self.normed_top1)) if self.normed_top1 else None
