"""Where every sample lives on the token axis, and the checks that the stored tables say so.

The layout is a pure function of the sample lengths, two sizes and the format version
(``build_layout``): samples sorted longest first (ties by index), packed greedily into units
of at most ``unit_tokens``. In format 2 unit ``u`` starts at token slot ``u * unit_tokens``
(one shard per unit; the slots past its last chunk are never written and cost nothing); in
format 1 each unit started at the chunk boundary after the previous one. Readers and
``verify`` check the stored tables against exactly that (:func:`table_problems`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from dspark_precompute.contract.spec import FORMAT_VERSION, SAMPLE_ARRAYS, UNIT_ARRAYS

if TYPE_CHECKING:
    from dspark_precompute.contract.manifest import Manifest

_LISTED = 3  # examples named per problem


def _examples(ids: np.ndarray, describe: Any, limit: int = _LISTED) -> str:
    ids = np.asarray(ids)
    shown = "; ".join(describe(int(i)) for i in ids[:limit])
    return shown + (f"; and {len(ids) - limit} more" if len(ids) > limit else "")


@dataclass
class Layout:
    """Where every sample lives: computed from sample lengths alone, before any forward."""

    chunk_tokens: int
    unit_tokens: int
    start: np.ndarray  # int64 [n]
    length: np.ndarray  # int32 [n]
    unit: np.ndarray  # int32 [n]
    unit_start: np.ndarray  # int64 [u]
    unit_stop: np.ndarray  # int64 [u]
    unit_order: list[np.ndarray]  # per unit: sample ids in on-disk (longest-first) order
    version: int = FORMAT_VERSION

    @property
    def num_units(self) -> int:
        return len(self.unit_start)

    @property
    def total_slots(self) -> int:
        return total_slots(self.unit_stop, self.chunk_tokens, self.unit_tokens, self.version)

    def unit_slots(self, u: int) -> int:
        """Token slots unit ``u`` owns (its tokens rounded up to whole chunks)."""
        n = int(self.unit_stop[u] - self.unit_start[u])
        return int(-(-n // self.chunk_tokens) * self.chunk_tokens)


def total_slots(unit_stop: np.ndarray, chunk_tokens: int, unit_tokens: int, version: int = FORMAT_VERSION) -> int:
    """Length of the token axis: up to the end of the last unit's last chunk.

    In format 2 the last unit starts at ``(n-1) * unit_tokens`` and its shard is an edge shard
    (zarr's regular grid cuts it at the array's end), so a cache smaller than one unit is no
    longer than its chunks.
    """
    if not len(unit_stop):
        return 0
    if version >= 2:
        last = (len(unit_stop) - 1) * int(unit_tokens)
        return last + int(-(-(int(unit_stop[-1]) - last) // chunk_tokens) * chunk_tokens)
    return int(-(-int(unit_stop[-1]) // chunk_tokens) * chunk_tokens)


def unit_starts(unit_stop: np.ndarray, chunk_tokens: int, unit_tokens: int, version: int = FORMAT_VERSION
                ) -> np.ndarray:
    """Where each unit must start given where each ends: ``u * unit_tokens`` (format 2), or after the
    previous unit's last chunk (format 1)."""
    n = len(unit_stop)
    if version >= 2:
        return np.arange(n, dtype=np.int64) * int(unit_tokens)
    slots = -(-np.asarray(unit_stop, dtype=np.int64) // chunk_tokens) * chunk_tokens
    return np.r_[0, slots[:-1]].astype(np.int64) if n else np.zeros(0, dtype=np.int64)


def build_layout(lengths: np.ndarray, chunk_tokens: int, unit_tokens: int, version: int = FORMAT_VERSION) -> Layout:
    """Sort samples longest first (ties by index), pack them into units of <= unit_tokens.

    Length-sorted units make every forward batch nearly padding-free; the per-sample
    ``start`` table keeps sample ``i`` addressable in O(1) whatever the disk order.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    n = len(lengths)
    order = np.lexsort((np.arange(n), -lengths))
    start = np.zeros(n, dtype=np.int64)
    unit = np.zeros(n, dtype=np.int32)
    unit_start: list[int] = []
    unit_stop: list[int] = []
    unit_order: list[np.ndarray] = []
    cursor = 0
    i = 0
    while i < n:
        members: list[int] = []
        used = 0
        while i < n and (not members or used + lengths[order[i]] <= unit_tokens):
            s = order[i]
            start[s] = cursor + used
            unit[s] = len(unit_start)
            used += int(lengths[s])
            members.append(s)
            i += 1
        unit_start.append(cursor)
        unit_stop.append(cursor + used)
        unit_order.append(np.asarray(members, dtype=np.int64))
        cursor += unit_tokens if version >= 2 else -(-used // chunk_tokens) * chunk_tokens
    return Layout(chunk_tokens, unit_tokens, start, lengths.astype(np.int32), unit,
                  np.asarray(unit_start, dtype=np.int64), np.asarray(unit_stop, dtype=np.int64), unit_order, version)



@dataclass
class _Tables:
    """The stored tables as int64, with the manifest facts the rules check them against."""

    m: Manifest
    start: np.ndarray
    length: np.ndarray
    unit: np.ndarray
    untrunc: np.ndarray
    source: np.ndarray
    us: np.ndarray
    ue: np.ndarray
    order: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # sample ids by start

    @property
    def n(self) -> int:
        return len(self.start)

    @property
    def nu(self) -> int:
        return self.m.layout.num_units


def _row_counts(m: Manifest, tables: dict[str, np.ndarray]) -> list[str]:
    n, nu = m.stored_samples, m.layout.num_units
    p = [f"table {name} has {len(tables[name])} rows, manifest counts.samples is {n}"
         + (f" with the dropped samples ({m.counts.samples} + {n - m.counts.samples})" if n != m.counts.samples
            else "") for name in SAMPLE_ARRAYS if len(tables[name]) != n]
    return p + [f"table {name} has {len(tables[name])} rows, manifest layout.num_units is {nu}"
                for name in UNIT_ARRAYS if len(tables[name]) != nu]


def _sample_values(t: _Tables) -> list[str]:
    """Lengths in [1, seq_length], untruncated lengths no shorter, units that exist, source rows increasing."""
    p, seq, nu, rows_in = [], t.m.seq_length, t.nu, t.m.counts.rows_in
    length, unit, source, untrunc = t.length, t.unit, t.source, t.untrunc
    bad = np.flatnonzero((length < 1) | (length > seq))
    if len(bad):
        p.append(f"samples/length: {len(bad)} sample(s) outside [1, seq_length={seq}]: "
                 + _examples(bad, lambda i: f"sample {i} has length {length[i]}"))
    bad = np.flatnonzero(untrunc < length)
    if len(bad):
        p.append(f"samples/untruncated_length: {len(bad)} sample(s) shorter than stored: "
                 + _examples(bad, lambda i: f"sample {i} has {untrunc[i]} < length {length[i]}"))
    bad = np.flatnonzero((unit < 0) | (unit >= nu))
    if len(bad):
        p.append(f"samples/unit: {len(bad)} sample(s) name no unit in [0, {nu}): "
                 + _examples(bad, lambda i: f"sample {i} has unit {unit[i]}"))
    bad = np.flatnonzero((source < 0) | (source >= max(rows_in, 1)) | np.r_[False, np.diff(source) <= 0])
    if len(bad):
        p.append(f"samples/source_row: {len(bad)} value(s) out of order or outside [0, counts.rows_in={rows_in}) "
                 "(samples are stored in input order): " + _examples(bad, lambda i: f"sample {i} has row {source[i]}"))
    return p


def _unit_placement(t: _Tables) -> list[str]:
    """Units start where the format puts them (chunk-aligned, in order) and the token axis ends after the last."""
    layout, us, ue = t.m.layout, t.us, t.ue
    ct, ut, total = layout.chunk_tokens, layout.unit_tokens, layout.total_token_slots
    if not t.nu:
        return []
    bad = np.flatnonzero((us % ct != 0) | (ue <= us))
    if len(bad):
        return [f"units/token_start, units/token_stop: {len(bad)} unit(s) not starting on a chunk boundary of "
                f"{ct} tokens or empty: " + _examples(bad, lambda u: f"unit {u} spans [{us[u]}, {ue[u]})")]
    version = t.m.format_version
    want = unit_starts(ue, ct, ut, version)
    bad = np.flatnonzero(us != want)
    if len(bad):
        rule = "each unit at u x layout.unit_tokens" if version >= 2 else "in order after the previous unit's chunks"
        return [f"units/token_start: {len(bad)} unit(s) not placed {rule}: "
                + _examples(bad, lambda u: f"unit {u} starts at {us[u]}, expected {want[u]}")]
    if version >= 2 and (ue - us > ut).any():
        u = int(np.flatnonzero(ue - us > ut)[0])
        return [f"units/token_stop: unit {u} spans [{us[u]}, {ue[u]}), more than its shard of layout.unit_tokens = "
                f"{ut} slots"]
    end = total_slots(ue, ct, ut, version)
    return [] if end == total else [f"layout.total_token_slots = {total}, but the units end at token slot {end}"]


def _tiling(t: _Tables) -> list[str]:
    """Each unit's samples tile [token_start, token_stop) with no gap or overlap, units in token order."""
    ss, sl, su = t.start[t.order], t.length[t.order], t.unit[t.order]
    order, us, ue = t.order, t.us, t.ue
    if (np.diff(su) < 0).any():
        k = int(np.flatnonzero(np.diff(su) < 0)[0])
        return [f"samples/unit, samples/start: units are not in token order: sample {order[k]} (unit {su[k]}) "
                f"lies before sample {order[k + 1]} (unit {su[k + 1]})"]
    bad = np.flatnonzero(np.bincount(t.unit, minlength=t.nu) == 0)
    if len(bad):
        return [f"samples/unit: {len(bad)} unit(s) hold no sample: " + _examples(bad, lambda u: f"unit {u}")]
    p = []
    first, last = np.r_[True, su[1:] != su[:-1]], np.r_[su[1:] != su[:-1], True]
    bad = np.flatnonzero(first & (ss != us[su]))
    if len(bad):
        p.append(f"samples/start: {len(bad)} unit(s) whose first sample does not start at units/token_start: "
                 + _examples(bad, lambda k: f"sample {order[k]} starts at {ss[k]}, its unit {su[k]} at {us[su[k]]}"))
    bad = np.flatnonzero(~first[1:] & (ss[1:] != ss[:-1] + sl[:-1]))
    if len(bad):
        p.append(f"samples/start, samples/length: {len(bad)} gap(s) or overlap(s) between neighbouring samples "
                 "(a sample would read another's tokens): "
                 + _examples(bad, lambda k: f"sample {order[k]} ends at {ss[k] + sl[k]}, sample {order[k + 1]} "
                                           f"starts at {ss[k + 1]}"))
    bad = np.flatnonzero(last & (ss + sl != ue[su]))
    if len(bad):
        p.append(f"samples/length, units/token_stop: {len(bad)} unit(s) whose last sample does not end at "
                 "units/token_stop: " + _examples(bad, lambda k: f"sample {order[k]} ends at {ss[k] + sl[k]}, "
                                                                f"unit {su[k]} at {ue[su[k]]}"))
    return p


def _disk_order(t: _Tables) -> list[str]:
    """The disk order is build_layout's: length descending, ties by sample index ascending."""
    order, sl, ss = t.order, t.length[t.order], t.start[t.order]
    if ((sl[:-1] > sl[1:]) | ((sl[:-1] == sl[1:]) & (order[:-1] < order[1:]))).all():
        return []
    want = np.lexsort((np.arange(t.n), -t.length))
    bad = np.flatnonzero(order != want)
    k = int(bad[0])
    return [f"samples/start: the disk order is not the layout of the recorded lengths (longest first, ties by "
            f"sample index): token slot {ss[k]} holds sample {order[k]} (length {t.length[order[k]]}) where the "
            f"layout puts sample {want[k]} (length {t.length[want[k]]}); {len(bad)} sample(s) are out of place, so "
            "they would read other samples' tokens. The offset table was altered: re-create the cache"]


def _packing(t: _Tables) -> list[str]:
    """Units are packed greedily under unit_tokens (a unit stops only when the next sample does not fit)."""
    ut, size = t.m.layout.unit_tokens, t.ue - t.us
    members = np.bincount(t.unit, minlength=t.nu)
    p = []
    bad = np.flatnonzero((size > ut) & (members > 1))
    if len(bad):
        p.append(f"units: {len(bad)} unit(s) hold more than layout.unit_tokens = {ut} tokens in several samples: "
                 + _examples(bad, lambda u: f"unit {u} holds {size[u]}"))
    su = t.unit[t.order]
    nxt = t.length[t.order][np.r_[True, su[1:] != su[:-1]]][1:]
    bad = np.flatnonzero(size[:-1] + nxt <= ut)
    if len(bad):
        p.append("units: the samples are not packed as the layout packs them (a unit stops although the next "
                 f"sample fits in layout.unit_tokens = {ut}): " + _examples(bad, lambda u: f"unit {u}"))
    return p


def _counts(t: _Tables) -> list[str]:
    """The manifest's token and truncation counts describe the readable samples (dropped ones are rejects)."""
    keep = np.ones(t.n, dtype=bool)
    keep[np.asarray(t.m.dropped_samples or [], dtype=np.int64)] = False
    got = {"tokens": int(t.length[keep].sum()), "truncated_samples": int((t.untrunc > t.length)[keep].sum())}
    return [f"manifest counts.{k} = {getattr(t.m.counts, k)}, the tables give {v}"
            for k, v in got.items() if getattr(t.m.counts, k) != v]


# the rules, in order; a rule runs only when every one before it found nothing (it relies on them)
_RULES = (_sample_values, _unit_placement, _tiling, _disk_order, _packing)


def table_problems(m: Manifest, tables: dict[str, np.ndarray]) -> list[str]:
    """Every way the sample/unit tables disagree with the manifest or with :func:`build_layout`.

    Vectorised (one sort, no per-sample Python): the named rules above, in order, each run
    only when the ones before found nothing, then the counts.
    """
    p = _row_counts(m, tables)
    if p:
        return p
    i64 = {k: v.astype(np.int64) for k, v in tables.items()}
    t = _Tables(m, i64["samples/start"], i64["samples/length"], i64["samples/unit"],
                i64["samples/untruncated_length"], i64["samples/source_row"], i64["units/token_start"],
                i64["units/token_stop"])
    t.order = np.argsort(t.start)
    for rule in _RULES:
        if rule in (_tiling, _disk_order, _packing) and not t.n:
            continue
        p = rule(t)
        if p:
            return p
    return _counts(t)


class SampleIndex:
    """Which samples hold token slots ``[a, b)`` (to name the samples a damaged chunk carries)."""

    def __init__(self, start: np.ndarray, length: np.ndarray):
        self.order = np.argsort(start, kind="stable")
        self.start = np.asarray(start, dtype=np.int64)[self.order]
        self.end = self.start + np.asarray(length, dtype=np.int64)[self.order]

    def in_range(self, a: int, b: int) -> np.ndarray:
        hi = np.searchsorted(self.start, b, side="left")
        lo = np.searchsorted(self.end, a, side="right")  # ends are increasing: samples do not overlap
        return np.sort(self.order[lo:hi])


