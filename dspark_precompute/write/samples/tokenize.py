"""Rows -> samples: tokenize the selection with NeMo's masks and account for every row.

Rank r of a data-parallel job tokenizes rows r, r+W, ...; all ranks then agree on the
sample tables (lengths, source rows) from which the layout is planned. Every row becomes a
sample or a typed reject; too many invalid rows stop the run, and many rejects warn.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dspark_precompute.errors import CacheFormatError, DataError, InvalidRowError
from dspark_precompute.faults import fault_point
from dspark_precompute.write.config.schema import DataConfig
from dspark_precompute.write.parallel import processes
from dspark_precompute.write.parallel.distributed import Ranks
from dspark_precompute.write.samples.chat import Encoded
from dspark_precompute.write.samples.encode import EncoderPool, RowEncoder
from dspark_precompute.write.samples.files import resolve_source
from dspark_precompute.write.samples.images import SampleImages
from dspark_precompute.write.samples.normalize import Reason, Reject
from dspark_precompute.write.samples.rows import RawRow, iter_rows

log = logging.getLogger(__name__)

# Rows that are well-formed but leave nothing to train on at this seq_length: recorded in
# the rejects file, never counted as invalid data.
FILTERED_REASONS = {Reason.NO_SUPERVISED_TOKENS, Reason.TOO_FEW_SUPERVISED_TOKENS}
REJECT_WARN_FRACTION = 0.10  # above this share of rejected rows the run warns, with the likely fixes
REJECT_FIXES = {
    Reason.NO_SUPERVISED_TOKENS: "raise seq_length (the assistant turns start after the first seq_length tokens)",
    Reason.TOO_FEW_SUPERVISED_TOKENS: "expected under data.mask_rule=deepspec or specforge for short answers (that "
                                      "trainer drops them too); raise seq_length if the answers are cut off",
    Reason.MASK_OPTION_ERROR: "check data.chat_template against these rows, or turn off data.mask_generation_prompt"
                              " / data.mask_reasoning_content",
    Reason.MALFORMED_JSON: "fix the listed lines of the data file (each must be one JSON object)",
    Reason.INVALID_UTF8: "re-encode the data file as UTF-8",
    Reason.MISSING_MESSAGES: "set data.format (messages or sharegpt) or fix the rows' keys",
    Reason.UNKNOWN_ROLE: "map the roles to system/user/assistant/tool, or use data.format=sharegpt",
    Reason.NON_TEXT_CONTENT: "capture rows with images through an image-text checkpoint (model.path), or drop "
                             "their image/audio parts",
    Reason.NO_ASSISTANT_TURN: "the rows have nothing to supervise; check the role names",
    Reason.TEMPLATE_ERROR: "check data.chat_template against these rows",
    Reason.UNMASKABLE: "use a chat template with {% generation %} blocks (data.chat_template)",
}


@dataclass
class Tokenized:
    """The selection after tokenization: per-sample tables (global) and this rank's encodings."""

    rows_in: int
    sample_rows: np.ndarray  # selection index of each sample
    lengths: np.ndarray
    untruncated: np.ndarray
    supervised: np.ndarray
    rejects: list[Reject]
    encoded: dict[int, Encoded]  # sample id -> tokens, for the samples this rank tokenized
    images: dict[int, SampleImages] = field(default_factory=dict)  # sample id -> its images (every rank's)


@dataclass(frozen=True)
class RowEncoding:
    """What tokenizing needs of the plan: how rows become samples, and the tokenizer that does it."""

    spec: RowEncoder
    tokenizer: Any


def _check_invalid(data: DataConfig, raw: RawRow, item: Encoded | Reject) -> None:
    if isinstance(item, Reject) and data.on_invalid == "error" and item.reason not in FILTERED_REASONS:
        where = ", ".join(x for x in (f"file {raw.file}" if raw.file else "",
                                      f"line {raw.line}" if raw.line else "") if x)
        raise InvalidRowError(str(data.path), raw.row, item.reason,
                              item.message + (f" ({where})" if where else ""))


START_ROWS = 2000  # rows tokenized here before workers start: a small selection never pays for them
INLINE_ROWS: int | None = None  # at most this many rows here (then wait for the workers); None: until they are ready
CHUNK_ROWS = 64  # rows per task sent to a worker


def tokenizing_workers(data: DataConfig) -> int:
    """``data.num_workers``: null = the cores this rank may use (the forward has not started yet)."""
    n = data.num_workers
    if n is not None:
        return int(n)
    cores = processes.available_cores()
    return cores if cores > 1 else 0


def encode_selection(enc: RowEncoding, data: DataConfig, pairs: Iterator[tuple[int, RawRow]], workers: int | None = None
                     ) -> Iterator[tuple[int, RawRow | None, Encoded | Reject]]:
    """Encode ``(selection index, row)`` pairs in order; the first rows in this process, the rest in workers.

    Past ``START_ROWS`` rows the workers start in the background (each rebuilds the tokenizer,
    seconds), and this process goes on encoding until they are ready, so their start costs no
    wall time. Results are identical to encoding every row here (the same tokenizer and
    template in each worker), in the same order; memory holds at most two chunks per worker
    beyond what the caller keeps. The raw row comes back only for rows encoded here (for
    ``on_invalid=error``).
    """
    spec = enc.spec
    encoder = spec.build(enc.tokenizer)
    workers = tokenizing_workers(data) if workers is None else workers
    pairs = iter(pairs)  # one pass: the rows left at the hand-over go to the workers
    pool: EncoderPool | None = None
    started = 0.0
    try:
        here = 0
        for sel, raw in pairs:
            if workers > 0 and pool is None and here >= START_ROWS:
                log.info("starting %d tokenizing worker processes (data.num_workers); this process tokenizes until "
                         "they are ready", workers)
                pool, started = EncoderPool(spec, enc.tokenizer, workers), time.perf_counter()
            if pool is not None and (pool.ready() or (INLINE_ROWS is not None and here >= INLINE_ROWS)):
                log.info("the tokenizing workers take over after %d rows here (%.1f s after they started)", here,
                         time.perf_counter() - started)
                yield from _pooled(data, pool, itertools.chain([(sel, raw)], pairs))
                return
            fault_point("tokenize_row")
            item = spec.encode(encoder, raw, sel)
            _check_invalid(data, raw, item)
            here += 1
            yield sel, raw, item
    finally:
        if pool is not None:
            pool.close()


def _pooled(data: DataConfig, pool: EncoderPool, pairs: Iterator[tuple[int, RawRow]]
            ) -> Iterator[tuple[int, RawRow | None, Encoded | Reject]]:
    def chunks() -> Iterator[list[tuple[int, RawRow]]]:
        while True:
            chunk = list(itertools.islice(pairs, CHUNK_ROWS))
            if not chunk:
                return
            yield chunk

    raws: dict[int, RawRow] = {}
    for sel, item in pool.map(_remember(chunks(), raws)):
        raw = raws.pop(sel)
        _check_invalid(data, raw, item)
        yield sel, None, item


def _remember(chunks: Iterator[list[tuple[int, RawRow]]], raws: dict[int, RawRow]
              ) -> Iterator[list[tuple[int, RawRow]]]:
    """Keep each in-flight row's source position (not its record) for error messages."""
    for chunk in chunks:
        for sel, raw in chunk:
            raws[sel] = RawRow(raw.row, raw.line, file=raw.file, file_row=raw.file_row)
        yield chunk


def tokenize(enc: RowEncoding, data: DataConfig, ranks: Ranks | None = None) -> Tokenized:
    """Tokenize the selection (rank r takes rows r, r+W, ...) and agree on the sample tables."""
    ranks = ranks or Ranks()

    def mine() -> tuple[int, list[tuple[int, Any]], dict[int, Encoded]]:
        info: list[tuple[int, Any]] = []  # (row, reject or (length, untruncated, supervised[, images]))
        own: dict[int, Encoded] = {}
        counter = {"n": 0}

        def pairs() -> Iterator[tuple[int, RawRow]]:
            for sel, raw in enumerate(iter_rows(resolve_source(data.path), data)):
                counter["n"] += 1
                if sel % ranks.world == ranks.rank:
                    yield sel, raw

        for sel, _raw, item in encode_selection(enc, data, pairs()):
            if isinstance(item, Reject):
                info.append((sel, item))
            else:
                own[sel] = item
                stats = (len(item.input_ids), item.untruncated_length, int(item.loss_mask.sum()))
                info.append((sel, stats if item.images is None else (*stats, item.images)))
        return counter["n"], info, own

    n, info, own = ranks.together(mine)
    merged = sorted((x for part in ranks.gather(info) for x in part), key=lambda x: x[0])
    rejects = [r for _, r in merged if isinstance(r, Reject)]
    kept = [(sel, r) for sel, r in merged if not isinstance(r, Reject)]
    if n == 0:
        raise DataError(f"data.path={data.path!r} with split={data.split!r} selects no rows")
    invalid = [r for r in rejects if r.reason not in FILTERED_REASONS]
    if invalid and len(invalid) / n > data.max_invalid_fraction:
        by = reason_counts(invalid)
        raise DataError(
            f"{len(invalid)} of {n} rows ({len(invalid) / n:.1%}) are invalid, above "
            f"data.max_invalid_fraction={data.max_invalid_fraction}: "
            + ", ".join(f"{k}={v}" for k, v in sorted(by.items()))
            + f". First: row {invalid[0].row}{_where(invalid[0])}: {invalid[0].message}. Fix the data or raise "
            "the threshold."
        )
    if not kept:
        counted = ", ".join(f"{k}={v}" for k, v in sorted(reason_counts(rejects).items()))
        first = f" First: row {rejects[0].row}{_where(rejects[0])}: {rejects[0].message}" if rejects else ""
        raise DataError(f"no row of data.path={data.path!r} became a sample ({counted or 'none read'}).{first}")
    sample_rows = np.asarray([sel for sel, _ in kept], dtype=np.int64)
    stats = np.asarray([r[:3] for _, r in kept], dtype=np.int64).reshape(-1, 3)
    sample_of = {int(sel): i for i, sel in enumerate(sample_rows)}
    encoded = {sample_of[sel]: e for sel, e in own.items()}
    images = {i: r[3] for i, (_, r) in enumerate(kept) if len(r) > 3}
    return Tokenized(n, sample_rows, stats[:, 0], stats[:, 1], stats[:, 2], rejects, encoded, images)


def ensure_encoded(enc: RowEncoding, data: DataConfig, tok: Tokenized, sample_ids: set[int]) -> None:
    """Tokenize the samples this rank will forward but another rank tokenized."""
    missing = {int(tok.sample_rows[s]): s for s in sample_ids if s not in tok.encoded}
    if not missing:
        return
    wanted = set(missing)
    pairs = ((sel, raw) for sel, raw in enumerate(iter_rows(resolve_source(data.path), data))
             if sel in wanted)
    for sel, _raw, item in encode_selection(enc, data, pairs):
        if not isinstance(item, Encoded):
            raise CacheFormatError(f"row {sel} of data.path encoded differently on a second read ({item.reason}); "
                                   "the data or tokenizer changed during the run")
        tok.encoded[missing.pop(sel)] = item
    if missing:
        raise CacheFormatError(f"rows {sorted(missing)[:5]} vanished from data.path between two reads")


def _where(r: Reject) -> str:
    parts = [f"file {r.file}" if r.file else "", f"line {r.line}" if r.line else ""]
    return f" ({', '.join(x for x in parts if x)})" if any(parts) else ""


def reason_counts(rejects: list[Reject]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in rejects:
        out[r.reason] = out.get(r.reason, 0) + 1
    return out


def warn_about_rejects(tok: Tokenized) -> None:
    """Many rejects deserve more than an INFO line: counts per reason and the likely fix."""
    if not tok.rejects:
        return
    share = len(tok.rejects) / max(1, tok.rows_in)
    by = reason_counts(tok.rejects)
    listed = ", ".join(f"{k}={v}" for k, v in sorted(by.items(), key=lambda kv: -kv[1]))
    if share <= REJECT_WARN_FRACTION:
        log.info("%d of %d rows rejected (%.1f%%): %s (see rejects.jsonl)", len(tok.rejects), tok.rows_in,
                 100 * share, listed)
        return
    fixes = [f"{k}: {REJECT_FIXES[Reason(k)]}" for k in sorted(by, key=lambda k: -by[k]) if k in REJECT_FIXES]
    log.warning("%d of %d rows (%.1f%%) were rejected and will not be in the cache: %s. %s Each row is listed "
                "in rejects.jsonl.", len(tok.rejects), tok.rows_in, 100 * share, listed,
                " ".join(f"Likely fix for {f}." for f in fixes))
