"""The regeneration stage: source rows -> servers -> log -> the ordered regenerated JSONL, with its record.

Every cheap check comes first (the servers answer and serve the model, the log's settings match),
then only the rows the log lacks are sent. Beside the output: ``.rejects.jsonl`` (one line per
source row without a regenerated row: its row, reason and the engine's message) and ``.meta.json``
(the engine record and the counts).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from dspark_precompute.contract.vocab import RejectReason
from dspark_precompute.write.config.schema import TINY, OnLength, PrecomputeConfig, Reasoning, Turns
from dspark_precompute.write.regenerate.accounting import RegenCounts, RegenReason, RowRejected
from dspark_precompute.write.regenerate.boundaries import mismatch
from dspark_precompute.write.regenerate.client import Pool, Reply, RequestFailed, Server
from dspark_precompute.write.regenerate.engine import EngineInfo, probe
from dspark_precompute.write.regenerate.request import InlineImages, Sampling
from dspark_precompute.write.regenerate.splice import Spliced, empty_answer, splice
from dspark_precompute.write.regenerate.store import ResumeStore, atomic_write, canonical, row_key
from dspark_precompute.write.samples.files import resolve_source
from dspark_precompute.write.samples.images import data_root, image_base, image_sources, video_sources
from dspark_precompute.write.samples.images import resolve_source as resolve_source_of_image
from dspark_precompute.write.samples.media import media_spec_for
from dspark_precompute.write.samples.normalize import Conversation, Reject, normalize
from dspark_precompute.write.samples.rows import iter_rows
from dspark_precompute.write.target.load import sha256_file

log = logging.getLogger(__name__)


@dataclass
class Regenerated:
    """What the stage made: the output file, its counts, its record for the manifest, and this run's failures."""

    output: Path
    counts: RegenCounts
    record: dict[str, Any]
    failed: list[dict[str, Any]] = field(default_factory=list)


def sibling(output: Path, suffix: str) -> Path:
    """A file beside the output (``.rejects.jsonl``, ``.meta.json``)."""
    return output.with_name(output.name.removesuffix(".jsonl") + suffix)


class _Job(NamedTuple):
    """One source row to ask: its key, its row in the selection, its conversation."""

    key: str
    row: int
    conv: Conversation


@dataclass
class _Done:
    """A row the servers answered: the regenerated conversation and its cut turns."""

    spliced: Spliced
    cut: int


@dataclass
class _Rejected:
    """A row the engine's answer rejects (final: logged), with the turns cut before it."""

    reject: RowRejected
    cut: int


@dataclass
class _Turn:
    """One row's regeneration, asked on one server."""

    server: Server
    sampling: Sampling
    model: str
    on_length: OnLength
    reasoning: Reasoning
    cut: int = 0

    def __call__(self, history: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> Reply:
        reply = self.server.ask(self.sampling.kwargs(self.model, history, tools))
        if reply.refusal or reply.finish_reason == "content_filter":
            raise RowRejected(RegenReason.REFUSAL, reply.refusal or f"finish_reason={reply.finish_reason}")
        if reply.finish_reason == "length":
            self.cut += 1
            if self.on_length == OnLength.reject:
                raise RowRejected(RegenReason.LENGTH, f"a turn was cut at regenerate.max_tokens "
                                                      f"({reply.completion_tokens} tokens)")
        if (why := empty_answer(reply, self.reasoning)) is not None:
            raise RowRejected(RegenReason.EMPTY_ANSWER, why)
        return reply


def _settings(cfg: PrecomputeConfig, info: EngineInfo) -> dict[str, Any]:
    """What the logged rows depend on: a resume with any other value is refused."""
    return {"sampling": cfg.regenerate.sampling(), "served_model": info.served_model,
            "served_weights_fingerprint": info.weights_fingerprint, "target": cfg.model.path,
            "chat_template": cfg.data.chat_template}


class _Checker:
    """The engine's token ids against our rendering (only when asked for: it needs the tokenizer)."""

    def __init__(self, cfg: PrecomputeConfig):
        self.tokenizer: Any = None
        self.template = ""
        if cfg.regenerate.return_token_ids:
            from dspark_precompute.write.samples.chat import resolve_chat_template
            from dspark_precompute.write.target.load import load_tokenizer

            self.tokenizer = load_tokenizer(cfg.model)
            self.template = resolve_chat_template(self.tokenizer, cfg.data.chat_template)

    def stats(self, spliced: Spliced, tools: list[dict[str, Any]] | None, row: int) -> dict[str, int]:
        out = {"turns": len(spliced.replies), "token_checked_turns": 0, "token_mismatches": 0,
               "tool_mismatches": spliced.tool_mismatches,
               "prompt_tokens": sum(r.prompt_tokens for _, _, r in spliced.replies),
               "completion_tokens": sum(r.completion_tokens for _, _, r in spliced.replies)}
        for history, turn, reply in spliced.replies:
            if self.tokenizer is None or reply.token_ids is None or any(
                    isinstance(m.get("content"), list) for m in history):
                continue  # a history with images renders through the processor's expansion, not this template
            out["token_checked_turns"] += 1
            why = mismatch(self.tokenizer, self.template, history, turn, reply, tools)
            if why is not None:
                out["token_mismatches"] += 1
                log.warning("row %d: the engine's token ids differ from our template's rendering at %s", row, why)
        return out


def _record(job: _Job, result: _Done | _Rejected | BaseException, checker: _Checker) -> dict[str, Any] | None:
    """The log record of one finished row; None for a failed request (not final: asked again next run)."""
    if isinstance(result, RequestFailed):
        return None
    if isinstance(result, _Rejected):
        reject = {"reason": str(result.reject.reason), "message": result.reject.message[:2000]}
        return {"key": job.key, "reject": reject, "stats": {"cut_turns": result.cut}}
    if isinstance(result, BaseException):
        raise result
    stats = {**checker.stats(result.spliced, job.conv.tools, job.row), "cut_turns": result.cut}
    row_out: dict[str, Any] = {"messages": result.spliced.messages,
                               **({"tools": job.conv.tools} if job.conv.tools else {})}
    return {"key": job.key, "row": row_out, "stats": stats}


@dataclass
class _Selection:
    """The source rows: the key of each valid one (source order), the keys left to ask, the invalid ones.

    No conversation is kept: :func:`_pending` reads the source again and hands the missing rows to
    the servers as they are needed, so memory holds keys, not rows.
    """

    keys: list[tuple[int, str]] = field(default_factory=list)  # (selection row, key)
    pending: dict[str, int] = field(default_factory=dict)  # key -> first row with it, not in the log yet
    invalid: list[dict[str, Any]] = field(default_factory=list)


def _rows(cfg: PrecomputeConfig, settings_sha: str, images: InlineImages) -> Iterator[tuple[int, str,
                                                                                         Conversation | Any]]:
    """(row, key, conversation) of every source row; an invalid one has an empty key and its reason in place of the
    conversation. Its images are hashed through ``images`` (once per run: both passes over the rows need them)."""
    source = resolve_source(cfg.data.path, cfg.data.split_slice()[0])
    media = asks_images(cfg)
    root = data_root(str(cfg.data.path)) if media else None
    for i, raw in enumerate(iter_rows(source, cfg.data)):
        conv: Conversation | Reject = normalize(raw, str(cfg.data.format), media=media)
        hashes = ""
        if isinstance(conv, Conversation) and conv.media:
            conv, hashes = _with_images(conv, image_base(root, raw.file), raw, images)
        yield i, (row_key(raw.record, settings_sha + hashes) if isinstance(conv, Conversation) else ""), conv


def asks_images(cfg: PrecomputeConfig) -> bool:
    """Whether rows with images are asked with their images: unless the target is a local checkpoint that reads
    none (then they stay invalid rows, as the capture would reject them). A hub id is asked: the server knows."""
    path = Path(cfg.model.path).expanduser()
    if cfg.model.path == TINY:
        return False
    return media_spec_for(path, cfg.data.image, cfg.data.video) is not None if path.is_dir() else True


def _with_images(conv: Conversation, base: Path | None, raw: Any, images: InlineImages
                 ) -> tuple[Conversation | Reject, str]:
    """The conversation with every image named absolutely (the regenerated file lives elsewhere; the capture reads
    the images from it again), and the images' content hashes (part of the row's key: a changed image is asked
    again); a missing image makes the row invalid, as the capture would reject it. Videos alike (their hashes
    follow the images', marked, so a row of images keeps its key)."""
    sources = [resolve_source_of_image(src, base) for src in image_sources(conv.messages)]
    hashes = [images.sha256(src) for src in sources]
    missing = [src for src, h in zip(sources, hashes, strict=True) if h.startswith("missing:")]
    if missing:
        return Reject(raw.row, RejectReason.IMAGE_MISSING, f"image {missing[0][:200]!r} cannot be read",
                      raw.line, raw.file_row, raw.file), ""
    clips = [resolve_source_of_image(src, base) for src in video_sources(conv.messages)]
    clip_hashes = [images.sha256(src) for src in clips]
    missing = [src for src, h in zip(clips, clip_hashes, strict=True) if h.startswith("missing:")]
    if missing:
        return Reject(raw.row, RejectReason.VIDEO_MISSING, f"video {missing[0][:200]!r} cannot be read",
                      raw.line, raw.file_row, raw.file), ""
    it, vit = iter(sources), iter(clips)
    messages = [{**m, "content": [{"type": "image", "image": next(it)} if p.get("type") == "image" else
                                  {"type": "video", "video": next(vit)} if p.get("type") == "video" else p
                                  for p in m["content"]]} if isinstance(m.get("content"), list) else m
                for m in conv.messages]
    videos = "\0video\0" + "\0".join(clip_hashes) if clip_hashes else ""
    return Conversation(messages, conv.tools, media=True), "\0" + "\0".join(hashes) + videos


def _select(cfg: PrecomputeConfig, store: ResumeStore, images: InlineImages) -> _Selection:
    """Read and normalize the selection as capture would; rows already in the log are not asked again."""
    sel = _Selection()
    for i, key, conv in _rows(cfg, store.settings_sha, images):
        if not isinstance(conv, Conversation):
            sel.invalid.append({"row": i, "file": conv.file, "line": conv.line, "reason": conv.reason,
                                "message": conv.message})
            continue
        sel.keys.append((i, key))
        if key not in store and key not in sel.pending:
            sel.pending[key] = i
    return sel


def _pending(cfg: PrecomputeConfig, store: ResumeStore, sel: _Selection, images: InlineImages) -> Iterator[_Job]:
    """The rows to ask, read from the source again in source order, as the servers take them.

    A source that cannot be read again (deleted, renamed) ends the rows here: those not asked are then
    failures of this run (``_ask``), and the same command asks them again."""
    if not sel.pending:
        return
    try:
        for i, key, conv in _rows(cfg, store.settings_sha, images):
            if isinstance(conv, Conversation) and sel.pending.get(key) == i:
                yield _Job(key, i, conv)
    except OSError as exc:
        log.warning("reading %s again failed (%s): the rows not asked yet are left for the next run",
                    cfg.data.path, exc)


def _ask(cfg: PrecomputeConfig, servers: list[Server], info: EngineInfo, store: ResumeStore,
         sel: _Selection, images: InlineImages) -> dict[str, str]:
    """Send the missing rows, logging each finished one as it comes; the failed requests' messages by key."""
    r = cfg.regenerate
    sampling, checker = Sampling.of(r), _Checker(cfg)
    turns, reasoning = Turns(r.turns), Reasoning(r.reasoning)

    def work(server: Server, job: _Job) -> _Done | _Rejected:
        ask = _Turn(server, sampling, info.served_model, OnLength(r.on_length), reasoning)
        try:
            return _Done(splice(job.conv.messages, job.conv.tools, turns, reasoning, ask, images), ask.cut)
        except RowRejected as exc:
            return _Rejected(exc, ask.cut)

    failed: dict[str, str] = {}
    total, step = len(sel.pending), max(1, len(sel.pending) // 10)
    log.info("regenerating %d row(s) on %d server(s) (%d already in %s)", total, len(servers),
             len(sel.keys) - total, store.parts)
    for n, (job, result) in enumerate(Pool(servers, r.concurrency).run(_pending(cfg, store, sel, images), work), 1):
        record = _record(job, result, checker)
        if record is None:
            failed[job.key] = str(result)
            log.warning("row %d: %s", job.row, result)
        else:
            store.append(record)
        if n % step == 0:
            log.info("regenerated %d/%d row(s), %d failed", n, total, len(failed))
    for key, row in sel.pending.items():  # the source changed under the run: its row was never read again
        if key not in store and key not in failed:
            failed[key] = (f"row {row} of {cfg.data.path} changed or could not be read again while it was being "
                           "regenerated; run the same command again once the data stays put")
    log.info("finished %d of %d row(s) asked, %d failed", total - len(failed), total, len(failed))
    return failed


def _build_and_account(sel: _Selection, store: ResumeStore,
                       failed: dict[str, str]) -> tuple[RegenCounts, list[dict[str, Any]]]:
    """The output (source order) and the counts and rejects over every source row (``rows_in = regenerated +
    rejected``), from one pass over the log."""
    counts = RegenCounts(rows_in=len(sel.keys) + len(sel.invalid), asked_now=len(sel.pending))
    rejects = list(sel.invalid)
    for item in sel.invalid:
        counts.add_reject(str(item["reason"]))
    logged = [(row, key) for row, key in sel.keys if key not in failed]
    for row, key in sel.keys:
        if key in failed:
            counts.add_reject(RegenReason.REQUEST_FAILED)
            rejects.append({"row": row, "reason": str(RegenReason.REQUEST_FAILED), "message": failed[key]})
    rows = iter(row for row, _ in logged)

    def seen(record: dict[str, Any]) -> None:
        row = next(rows)
        counts.add_row(record)
        if record.get("reject") is not None:
            rejects.append({"row": row, **record["reject"]})

    store.build([k for _, k in logged], seen)
    assert next(rows, None) is None and counts.rows_in == counts.regenerated + counts.rejected
    return counts, sorted(rejects, key=lambda x: int(x["row"]))


def regenerate(cfg: PrecomputeConfig, output: Path) -> Regenerated:
    """Regenerate ``cfg``'s selection into ``output`` (resuming what the log beside it holds)."""
    r = cfg.regenerate
    key = r.api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY"
    servers = [Server(u, key, r.timeout, r.max_retries, r.retry_backoff) for u in r.base_urls]
    info = probe(servers, r.served_model, cfg.model)
    if (warning := info.warning(cfg.model.path)) is not None:
        log.warning("WARNING: %s", warning)
    output.parent.mkdir(parents=True, exist_ok=True)
    store = ResumeStore(output, _settings(cfg, info)).open()
    try:  # the lock is held until the output and its rejects are written
        images = InlineImages()  # each image read and hashed once, its bytes kept (bounded) for its requests
        sel = _select(cfg, store, images)
        failed = _ask(cfg, servers, info, store, sel, images)
        counts, rejects = _build_and_account(sel, store, failed)
        atomic_write(sibling(output, ".rejects.jsonl"), (canonical(x) + b"\n" for x in rejects))
    finally:
        store.close()
    record = {"engine": info.engine, "engine_version": info.version, "served_model": info.served_model,
              "served_weights_fingerprint": info.weights_fingerprint, "target": cfg.model.path,
              "target_weights_fingerprint": info.target_fingerprint, "same_model": info.same_model,
              "warning": warning, "base_urls": list(r.base_urls), "sampling": r.sampling(), "output": str(output),
              "output_sha256": sha256_file(output), "counts": counts.to_json()}
    atomic_write(sibling(output, ".meta.json"), [json.dumps(record, indent=1, sort_keys=True).encode() + b"\n"])
    log.info("regenerated %d of %d row(s) into %s (%d rejected: %s; %d turn(s) cut at max_tokens, %d token "
             "mismatch(es) in %d checked turn(s))", counts.regenerated, counts.rows_in, output, counts.rejected,
             counts.reasons or "none", counts.cut_turns, counts.token_mismatches, counts.token_checked_turns)
    return Regenerated(output, counts, record, [x for x in rejects if x["reason"] == RegenReason.REQUEST_FAILED])
