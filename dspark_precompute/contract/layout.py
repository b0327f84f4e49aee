"""Where every sample lives on the token axis, and the checks that the stored tables say so.

The layout is a pure function of the sample lengths and two sizes (``build_layout``):
samples sorted longest first (ties by index), packed greedily into units of at most
``unit_tokens``, each unit starting on a chunk boundary. Readers and ``verify`` check the
stored tables against exactly that (:func:`table_problems`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from dspark_precompute.contract.spec import SAMPLE_ARRAYS, UNIT_ARRAYS

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

    @property
    def num_units(self) -> int:
        return len(self.unit_start)

    @property
    def total_slots(self) -> int:
        if not self.num_units:
            return 0
        return int(-(-int(self.unit_stop[-1]) // self.chunk_tokens) * self.chunk_tokens)

    def unit_slots(self, u: int) -> int:
        """Token slots unit ``u`` owns (its tokens rounded up to whole chunks)."""
        n = int(self.unit_stop[u] - self.unit_start[u])
        return int(-(-n // self.chunk_tokens) * self.chunk_tokens)


def build_layout(lengths: np.ndarray, chunk_tokens: int, unit_tokens: int) -> Layout:
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
        cursor += -(-used // chunk_tokens) * chunk_tokens
    return Layout(chunk_tokens, unit_tokens, start, lengths.astype(np.int32), unit,
                  np.asarray(unit_start, dtype=np.int64), np.asarray(unit_stop, dtype=np.int64), unit_order)



def table_problems(m: Manifest, tables: dict[str, np.ndarray]) -> list[str]:
    """Every way the sample/unit tables disagree with the manifest or with :func:`build_layout`.

    Vectorised (a sort, no per-sample Python): lengths within ``[1, seq_length]``,
    ``untruncated_length >= length``, source rows increasing, each unit's samples tiling
    ``[units/token_start, units/token_stop)`` with no gap or overlap, units starting on
    chunk boundaries in order, the disk order being exactly ``build_layout``'s (longest
    first, ties by sample index, greedy packing under ``unit_tokens``), and the counts.
    """
    layout, counts = m.layout, m.counts
    ct, ut = layout.chunk_tokens, layout.unit_tokens
    nu, total, seq = layout.num_units, layout.total_token_slots, m.seq_length
    n = m.stored_samples
    p: list[str] = []
    for name in SAMPLE_ARRAYS:
        if len(tables[name]) != n:
            p.append(f"table {name} has {len(tables[name])} rows, manifest counts.samples is {n}"
                     + (f" with the dropped samples ({counts.samples} + {n - counts.samples})"
                        if n != counts.samples else ""))
    for name in UNIT_ARRAYS:
        if len(tables[name]) != nu:
            p.append(f"table {name} has {len(tables[name])} rows, manifest layout.num_units is {nu}")
    if p:
        return p
    start, length = tables["samples/start"].astype(np.int64), tables["samples/length"].astype(np.int64)
    unit, untrunc = tables["samples/unit"].astype(np.int64), tables["samples/untruncated_length"].astype(np.int64)
    source = tables["samples/source_row"].astype(np.int64)
    us, ue = tables["units/token_start"].astype(np.int64), tables["units/token_stop"].astype(np.int64)

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
    rows_in = counts.rows_in
    bad = np.flatnonzero((source < 0) | (source >= max(rows_in, 1)) | np.r_[False, np.diff(source) <= 0])
    if len(bad):
        p.append(f"samples/source_row: {len(bad)} value(s) out of order or outside [0, counts.rows_in={rows_in}) "
                 "(samples are stored in input order): " + _examples(bad, lambda i: f"sample {i} has row {source[i]}"))
    if p:
        return p

    if nu:
        bad = np.flatnonzero((us % ct != 0) | (ue <= us))
        if len(bad):
            p.append(f"units/token_start, units/token_stop: {len(bad)} unit(s) not starting on a chunk boundary of "
                     f"{ct} tokens or empty: " + _examples(bad, lambda u: f"unit {u} spans [{us[u]}, {ue[u]})"))
        slots = -(-ue // ct) * ct
        want_start = np.r_[0, slots[:-1]]
        bad = np.flatnonzero(us != want_start)
        if len(bad) and not p:
            p.append(f"units/token_start: {len(bad)} unit(s) not packed in order after the previous unit's chunks: "
                     + _examples(bad, lambda u: f"unit {u} starts at {us[u]}, expected {want_start[u]}"))
        if not p and int(slots[-1]) != total:
            p.append(f"layout.total_token_slots = {total}, but the units end at token slot {int(slots[-1])}")
    if p:
        return p

    order = np.argsort(start)  # the one sort: everything below is a pass over neighbours
    ss, sl, su = start[order], length[order], unit[order]
    if n:
        if (np.diff(su) < 0).any():
            k = int(np.flatnonzero(np.diff(su) < 0)[0])
            p.append(f"samples/unit, samples/start: units are not in token order: sample {order[k]} (unit {su[k]}) "
                     f"lies before sample {order[k + 1]} (unit {su[k + 1]})")
            return p
        members = np.bincount(unit, minlength=nu)
        bad = np.flatnonzero(members == 0)
        if len(bad):
            p.append(f"samples/unit: {len(bad)} unit(s) hold no sample: " + _examples(bad, lambda u: f"unit {u}"))
            return p
        first = np.r_[True, su[1:] != su[:-1]]
        last = np.r_[su[1:] != su[:-1], True]
        bad = np.flatnonzero(first & (ss != us[su]))
        if len(bad):
            p.append(f"samples/start: {len(bad)} unit(s) whose first sample does not start at units/token_start: "
                     + _examples(bad, lambda k: f"sample {order[k]} starts at {ss[k]}, its unit {su[k]} at "
                                               f"{us[su[k]]}"))
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
        if p:
            return p
        # disk order must be build_layout's: length descending, ties by sample index ascending
        in_order = (sl[:-1] > sl[1:]) | ((sl[:-1] == sl[1:]) & (order[:-1] < order[1:]))
        if not in_order.all():
            want = np.lexsort((np.arange(n), -length))
            bad = np.flatnonzero(order != want)
            k = int(bad[0])
            p.append(f"samples/start: the disk order is not the layout of the recorded lengths (longest first, ties "
                     f"by sample index): token slot {ss[k]} holds sample {order[k]} (length {length[order[k]]}) where "
                     f"the layout puts sample {want[k]} (length {length[want[k]]}); {len(bad)} sample(s) are out of "
                     "place, so they would read other samples' tokens. The offset table was altered: re-create the "
                     "cache")
            return p
        size = ue - us
        bad = np.flatnonzero((size > ut) & (members > 1))
        if len(bad):
            p.append(f"units: {len(bad)} unit(s) hold more than layout.unit_tokens = {ut} tokens in several samples: "
                     + _examples(bad, lambda u: f"unit {u} holds {size[u]}"))
        nxt = sl[first][1:]
        bad = np.flatnonzero(size[:-1] + nxt <= ut)
        if len(bad):
            p.append("units: the samples are not packed as the layout packs them (a unit stops although the next "
                     f"sample fits in layout.unit_tokens = {ut}): " + _examples(bad, lambda u: f"unit {u}"))
    keep = np.ones(n, dtype=bool)  # the counts describe the readable samples: dropped ones are rejects
    keep[np.asarray(m.dropped_samples or [], dtype=np.int64)] = False
    for key, got in (("tokens", int(length[keep].sum())), ("truncated_samples",
                                                            int((untrunc > length)[keep].sum()))):
        if getattr(counts, key) != got:
            p.append(f"manifest counts.{key} = {getattr(counts, key)}, the tables give {got}")
    return p


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


