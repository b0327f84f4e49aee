"""What ``verify`` found: problems (each naming array, chunk, sample and unit where it can) and notes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Problem:
    """One thing wrong, with the array, chunk and sample it concerns when there is one."""

    check: str
    message: str
    array: str | None = None
    chunk: tuple[int, ...] | None = None
    sample: int | None = None
    unit: int | None = None

    def __str__(self) -> str:
        return f"[{self.check}] {self.message}"


@dataclass
class VerifyReport:
    path: str
    problems: list[Problem] = field(default_factory=list)
    samples: int = 0
    tokens: int = 0
    chunks_checked: int = 0
    recomputed: int = 0
    recompute_exact: int = 0
    recompute_max_steps: float = 0.0
    teacher_positions: int = 0  # verify --teacher: positions whose logits were compared
    teacher_samples: int = 0
    teacher_top1: float | None = None  # share of positions where lm_head(stored state) has the target's argmax
    teacher_max_logit_diff: float | None = None
    teacher_tv_mean: float | None = None  # total-variation distance between the two softmaxes
    teacher_tv_max: float | None = None
    teacher_rel_error_mean: float | None = None  # ||target logits - lm_head(stored)|| / ||target logits||
    teacher_rel_error_max: float | None = None
    precision: dict[str, Any] | None = None  # verify --precision: per-array error against a recompute (its JSON)
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)  # worth knowing, not a problem

    @property
    def ok(self) -> bool:
        return not self.problems

    def teacher_json(self) -> dict[str, Any] | None:
        """The teacher check's numbers (``verify --teacher``), or None when it did not run."""
        if not self.teacher_positions:
            return None
        return {"positions": self.teacher_positions, "samples": self.teacher_samples,
                "top1_agreement": self.teacher_top1, "max_logit_diff": self.teacher_max_logit_diff,
                "tv_mean": self.teacher_tv_mean, "tv_max": self.teacher_tv_max,
                "rel_error_mean": self.teacher_rel_error_mean, "rel_error_max": self.teacher_rel_error_max}

    def damaged_units(self) -> list[int]:
        return sorted({p.unit for p in self.problems if p.unit is not None})

    def format(self) -> str:
        head = (f"{'OK' if self.ok else 'FAILED'}: {self.path}: {self.samples} samples, {self.tokens} tokens, "
                f"{self.chunks_checked} chunks checked")
        if self.recomputed:
            head += (f", {self.recomputed} samples recomputed ({self.recompute_exact} equal to the stored values bit "
                     f"for bit once rounded to the storage dtype; before rounding, the recompute is within "
                     f"{self.recompute_max_steps:.2f} of a storage-dtype step of them)")
        head += f" in {self.seconds:.1f}s"
        lines = [head]
        if self.teacher_positions:
            lines.append(f"  teacher: {self.teacher_positions} positions in {self.teacher_samples} samples, top-1 "
                         f"agreement {self.teacher_top1:.2%}, relative logit error mean "
                         f"{self.teacher_rel_error_mean:.3g} / max {self.teacher_rel_error_max:.3g}, max |logit "
                         f"difference| {self.teacher_max_logit_diff:.3g}, total variation mean "
                         f"{self.teacher_tv_mean:.3g} / max {self.teacher_tv_max:.3g}")
        if self.precision:
            p = self.precision
            lines.append(f"  precision: {p['positions']} positions in {p['samples']} samples against a "
                         f"{p['reference']}")
            for a in p["arrays"]:
                lines.append(f"    {a['layer']:<18} {a['dtype']:<9} relative RMS error {a['rel_rms']:.3%}, worst token "
                             f"{a['worst_token_rel']:.3%} (sample {a['worst_sample']}, token {a['worst_token']})")
            lines.append(f"    teacher from the stored final state: top-1 agreement {p['last_top1_agreement']:.2%}, "
                         f"total variation mean {p['last_tv_mean']:.3g} / max {p['last_tv_max']:.3g}, relative "
                         f"logit error {p['last_logit_rel_error']:.3g}")
        lines += [f"  note: {n}" for n in self.notes] + [f"  {p}" for p in self.problems]
        if self.problems:
            lines.append(f"{len(self.problems)} problem(s).")
        return "\n".join(lines)


class Collector:
    """Adds problems to a report, at most ``limit`` per check (the rest are counted in one line)."""

    def __init__(self, report: VerifyReport, limit: int):
        self.report, self.limit = report, limit
        self.per_check: dict[str, int] = {}

    def add(self, check: str, message: str, **where: Any) -> None:
        k = self.per_check.get(check, 0) + 1
        self.per_check[check] = k
        if k <= self.limit:
            self.report.problems.append(Problem(check, message, **where))
        elif k == self.limit + 1:
            self.report.problems.append(Problem(check, f"... more {check} problems not listed (limit {self.limit})"))
