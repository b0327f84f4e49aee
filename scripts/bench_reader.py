"""Reader throughput: our training loader vs NeMo AutoModel's cached loader over our NeMo export, one run.

    python scripts/bench_reader.py                       # builds the bench_read cache + export under /tmp
    python scripts/bench_reader.py --repeats 3 --markdown docs/reader.md --json reader.json
    python scripts/bench_reader.py --s3                  # plus object storage (a moto server on 127.0.0.1)

One cache (``scripts/conf/model/bench_read.yaml``: random Qwen3 with hidden 1024 and Qwen3's
real tokenizer, layers [0, 1, 2] of 3 captured, so 3 hidden arrays: 6 KB of bf16 hidden
states per token) over ``../shared/data/chat/mix.messages.jsonl`` at seq_length 1024, and its
NeMo export. Every case is warmed up with one whole epoch (another seed), then one whole epoch
is timed; cases alternate within each repeat and the medians are reported:

* ours: ``build_dataloader`` with 0, 1 and 2 workers, exact and block shuffle, fixed batch 8
  and a token budget;
* NeMo: ``CachedDSparkDataset`` + its collate re-implemented from its source (as
  ``tests/read/test_training.py`` does), fixed batch 8, shuffle, 2 persistent workers;
* the decode limit: one core reading, checking (crc32c) and decoding every chunk of the
  cache, once, times the number of workers (0 workers counts as 1).

Each delivered batch is consumed the way a training step would find it: its real tokens
counted and every memory page of every tensor read once (a host-to-device copy reads
them all). Throughput is real (unpadded) tokens per second; GB/s is that times the bytes a
token takes in the cache decoded (ids, mask, the 3 hidden arrays: 6,149 B). CPU per token
counts this process and its workers; *decode share of CPU* is the decode limit's CPU time per
token over the loader's, a ratio that other jobs on the machine change much less than wall time. The page cache is
warmed with both datasets before timing. ``--s3`` adds the loader over the same cache
uploaded to a moto S3 server (a separate process), with and without read-ahead, as it is
and with a delay added to every request (``--s3-latency-ms``, a remote store's latency).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import benchlib
import torch
from benchlib import DEFAULT_DATA, REPO, log, model_overrides
from benchlib import cpu_pressure_total as cpu_pressure

NEMO_KEYS = ("input_ids", "attention_mask", "loss_mask", "target_hidden_states", "target_last_hidden_states")


# -- the cache and its export -------------------------------------------------------------------
def build_cache(path: Path, target: str, data: str, seq_length: int, rows: int | None) -> None:
    benchlib.build_cache(path, target, data, seq_length, rows, overwrite=False)  # never over a cache already there


def v1_checkout() -> Path:
    """A git worktree of the last commit before format 2 (the parent of the first commit whose contract writes
    format 2), made once under the temp directory; SystemExit when this is not a git checkout with its history."""
    def git(*a: str) -> str:
        return subprocess.run(["git", "-C", str(REPO), *a], check=True, capture_output=True, text=True).stdout.strip()

    try:
        git("rev-parse", "--show-toplevel")
        first = git("log", "--reverse", "--format=%H", "-S", "FORMAT_VERSION = 2", "--",
                    "dspark_precompute/contract/spec.py").splitlines()
        if not first:
            raise SystemExit("--v1: no commit introducing format 2 is in this checkout's history; pass --v1-cache PATH")
    except (FileNotFoundError, subprocess.CalledProcessError) as exc:
        raise SystemExit(f"--v1 builds a format 1 cache with the commit before format 2, which needs a git checkout "
                         f"of this repository with its history ({REPO} is not one: {exc}); pass --v1-cache PATH (a "
                         "format 1 cache of the same data) instead") from None
    return benchlib.worktree(f"{first[0]}^")


def build_v1_cache(path: Path, target: str, data: str, seq_length: int, rows: int | None) -> None:
    """The same run with the release before format 2 (its own code on PYTHONPATH, its own command line)."""
    tree = v1_checkout()
    overrides = [*model_overrides(target), f"seq_length={seq_length}", f"storage.path={path}", "progress=false",
                 f"hydra.run.dir={path.parent / (path.name + '_hydra')}"]
    overrides += ["data=embedded"] if data == "embedded" else ["data=jsonl", f"data.path={data}"]
    if rows:
        overrides.append(f"data.max_samples={rows}")
    log(f"building the format 1 cache with {tree}: {' '.join(overrides)}")
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.run([sys.executable, "-m", "dspark_precompute", *overrides], cwd=tree, env=env,
                          capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"building the format 1 cache failed:\n{proc.stderr[-3000:]}")


def random_reads(caches: dict[str, Path], reads: int, repeats: int) -> dict[str, Any]:
    """``reads`` random single-sample reads (``c[i]`` of one ``open_cache`` per cache and repeat) of each cache,
    the caches alternating repeat by repeat (which goes first rotates), the same indices for each."""
    import numpy as np

    from dspark_precompute import open_cache

    names = list(caches)
    times: dict[str, list[float]] = {k: [] for k in names}
    for rep in range(repeats):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            c = open_cache(caches[name])
            idx = np.random.default_rng(rep).integers(0, len(c), size=reads)
            t0 = time.perf_counter()
            for i in idx:
                c[int(i)]
            times[name].append(time.perf_counter() - t0)
            c.close()
            log(f"  random reads, {name}: {reads / times[name][-1]:,.0f} samples/s")
    first, other = names[0], names[1:]
    out: dict[str, Any] = {"reads": reads, "repeats": repeats, "seconds": times,
                           "samples_per_s": {k: reads / statistics.median(v) for k, v in times.items()}}
    for name in other:  # >1: the first cache is slower than this one
        out[f"{first}_time_over_{name}_paired"] = statistics.median(a / b for a, b in zip(times[first], times[name]))
    return out


def warm(*dirs: Path) -> int:
    """Read every file once (page cache); returns the bytes read."""
    total = 0
    for d in dirs:
        for f in sorted(Path(d).rglob("*")):
            if f.is_file():
                with open(f, "rb", buffering=0) as fh:
                    while block := fh.read(1 << 24):
                        total += len(block)
    return total


class NemoDataset(torch.utils.data.Dataset):
    """NeMo AutoModel's ``CachedDSparkDataset``: ``safe_open(shard).get_slice(key)[i % shard_size]`` per key."""

    def __init__(self, d: Path):
        from safetensors import safe_open

        m = json.loads((d / "manifest.json").read_text())
        self.n, self.shard_size = int(m["num_samples"]), int(m["shard_size"])
        shards = -(-self.n // self.shard_size)
        self.handles = {k: safe_open(str(d / f"shard-{k:06d}.safetensors"), framework="pt") for k in range(shards)}

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        h = self.handles[i // self.shard_size]
        return {key: h.get_slice(key)[i % self.shard_size] for key in NEMO_KEYS}


def nemo_collate(features: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """NeMo's ``_collate_cached``: stack each key."""
    return {key: torch.stack([f[key] for f in features], dim=0) for key in NEMO_KEYS}


# -- measuring ---------------------------------------------------------------------------------
def cpu_seconds() -> float:
    """CPU time of this process and its children (workers), user + system."""
    import psutil

    p = psutil.Process()
    t = p.cpu_times()
    total = t.user + t.system
    for c in p.children(recursive=True):
        try:
            ct = c.cpu_times()
            total += ct.user + ct.system
        except psutil.Error:
            pass
    return total


def consume(batch: dict[str, torch.Tensor]) -> int:
    """Real tokens of the batch, after reading one byte of every 4 KiB page of every tensor."""
    for v in batch.values():
        flat = v.reshape(-1)
        if flat.dtype in (torch.bfloat16, torch.float16):
            flat = flat.view(torch.int16)
        flat.view(torch.uint8)[::4096].sum()
    return int(batch["attention_mask"].sum())


def time_epoch(loader: Any, epoch: int, set_epoch: Any = None) -> dict[str, float]:
    """Warm the loader up with one whole epoch of another seed (workers started, batch memory touched, as in
    every epoch of a training run after the first), then time one whole epoch."""
    (set_epoch or loader.set_epoch)(1000 + epoch)
    for _ in loader:
        pass
    (set_epoch or loader.set_epoch)(epoch)
    p0, c0, t0 = cpu_pressure(), cpu_seconds(), time.perf_counter()
    tokens = batches = 0
    for batch in loader:
        tokens += consume(batch)
        batches += 1
    wall = time.perf_counter() - t0
    cpu, p1 = cpu_seconds() - c0, cpu_pressure()
    out = {"tokens": tokens, "batches": batches, "wall_s": wall, "tokens_per_s": tokens / wall,
           "cpu_us_per_token": cpu / max(1, tokens) * 1e6}
    if p0 is not None and p1 is not None:
        out["contention"] = (p1 - p0) / 1e6 / wall
    return out


def stored_chunks(cache: Any) -> list[int]:
    """The chunk numbers (along the token axis) that hold tokens: each unit's, up to its last token (format 2
    leaves the chunks past a unit's last token out of its shard; format 1 packs units back to back)."""
    ct = cache.chunk_tokens
    out: set[int] = set()
    for a, b in cache.chunks.unit_spans():
        if b > a:
            out.update(range(int(a) // ct, (int(b) - 1) // ct + 1))
    return sorted(out)


def decode_limit(cache: Any) -> dict[str, float]:
    """One core: read (as the reader does: ``pread`` of a shard's byte range, or the chunk's file in format 1),
    crc32c-check and decode every stored chunk of every token array once."""
    from dspark_precompute.contract.chunks import ChunkSource, decode_chunk

    names = list(dict.fromkeys(["input_ids", "loss_mask", *cache.array_names.values()]))
    chunks = stored_chunks(cache)
    source = ChunkSource(cache.store, dict(cache.chunks.metas), cache.chunks.zstore)  # own handles, no index
    t0, c0 = time.perf_counter(), time.thread_time()
    nbytes = 0
    for name in names:
        m = cache.chunks.metas[name]
        per = int(m.shard_chunks or 1)
        for k in range(0, len(chunks), per):  # one shard's worth (or one chunk) at a time
            jobs = [(name, c) for c in chunks[k:k + per]]
            for (_, c), raw in zip(jobs, source.read(jobs)):
                nbytes += decode_chunk(m, m.chunk_index(c), raw).nbytes
    wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    source.close()
    slots = len(chunks) * cache.chunk_tokens
    return {"wall_s": wall, "tokens_per_s": slots / wall, "cpu_us_per_token": cpu / slots * 1e6,
            "decoded_bytes": nbytes, "slots": slots}


# -- object storage ------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


MOTO = r"""
import re, sys, time
from urllib.parse import unquote
from werkzeug.serving import run_simple
from moto.core import DEFAULT_ACCOUNT_ID
from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
from moto.s3.models import s3_backends
host, port, control = sys.argv[1], int(sys.argv[2]), sys.argv[3]
app = DomainDispatcherApplication(create_backend_app)
RANGE = re.compile(r"bytes=(\d+)-(\d+)$")
def ranged(environ, start_response):
    # moto answers a range GET by reading (and copying) the whole object first (FakeKey.value), which a real store
    # does not: O(object) per request, 268 MB per 1 MiB chunk of a format 2 shard. Read only the range, as S3 does.
    m = RANGE.match(environ.get("HTTP_RANGE", ""))
    parts = environ.get("PATH_INFO", "").lstrip("/").split("/", 1)
    if environ["REQUEST_METHOD"] != "GET" or not m or len(parts) != 2 or environ.get("QUERY_STRING"):
        return None
    acct = s3_backends.bucket_accounts.get(parts[0], ("aws", DEFAULT_ACCOUNT_ID))[1]
    key = s3_backends[acct]["global"].get_object(parts[0], unquote(parts[1]))
    if key is None or key.size == 0:
        return None
    a, b = int(m.group(1)), min(int(m.group(2)), key.size - 1)
    if a > b:
        return None
    with key.lock:
        etag = key.etag  # computed once (it reads the object), then kept
        key._value_buffer.seek(a)
        body = key._value_buffer.read(b - a + 1)
    start_response("206 Partial Content", [("Content-Type", "binary/octet-stream"), ("Content-Length", str(len(body))),
                                           ("Content-Range", f"bytes {a}-{b}/{key.size}"), ("ETag", etag),
                                           ("Accept-Ranges", "bytes"),
                                           ("Last-Modified", key.last_modified_RFC1123)])
    return [body]
def delayed(environ, start_response):  # a remote store's first-byte latency (ms in the control file), no CPU used
    with open(control) as f:
        delay = float(f.read() or 0) / 1000
    if delay:
        time.sleep(delay)
    return ranged(environ, start_response) or app(environ, start_response)
run_simple(host, port, delayed, threaded=True, request_handler=MotoRequestHandler)
"""


def start_moto(tmp: Path, control: Path) -> tuple[subprocess.Popen, str]:
    """moto's S3 server in its own process (threaded, as ``moto_server`` runs it); each request is delayed by
    the milliseconds written in ``control``."""
    port = free_port()
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
           "AWS_DEFAULT_REGION": "us-east-1"}
    proc = subprocess.Popen([sys.executable, "-c", MOTO, "127.0.0.1", str(port), str(control)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=tmp)
    endpoint = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, endpoint
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("moto server did not start")


def upload(local: Path, url: str) -> float:
    from dspark_precompute.contract.store import CacheStore

    store = CacheStore(url)
    t0 = time.perf_counter()
    files = [f for f in sorted(local.rglob("*")) if f.is_file() and not f.name.startswith(".")]
    puts = {f"{store.root}/{f.relative_to(local).as_posix()}": f.read_bytes() for f in files}
    store.fs.pipe(puts)
    return time.perf_counter() - t0


# -- the run -----------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", type=Path, default=Path("/tmp/dspark_bench_reader/cache"))
    ap.add_argument("--nemo", type=Path, default=None, help="its NeMo export (default: made next to it)")
    ap.add_argument("--target", default="bench_read", help="model group of the cache built when --cache is absent")
    ap.add_argument("--data", default=str(DEFAULT_DATA), help="data.path, or 'embedded'")
    ap.add_argument("--seq-length", type=int, default=1024)
    ap.add_argument("--rows", type=int, default=None, help="data.max_samples (default: every row)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=8192)
    ap.add_argument("--workers", default="0,1,2")
    ap.add_argument("--s3", action="store_true", help="also read the cache from a moto S3 server")
    ap.add_argument("--s3-batches", type=int, default=60, help="batches timed per S3 case")
    ap.add_argument("--s3-latency-ms", default="0,25", help="delays added to every S3 request (a remote store's)")
    ap.add_argument("--s3-only", action="store_true", help="only the S3 cases")
    ap.add_argument("--v1-cache", type=Path, default=None,
                    help="a format 1 cache of the same data: random single-sample reads side by side with --cache")
    ap.add_argument("--v1", action="store_true",
                    help="build that format 1 cache (next to --cache) with a git worktree of the last commit before "
                         "format 2")
    ap.add_argument("--reads", type=int, default=2000, help="random single-sample reads per repeat and cache")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--markdown", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)

    from dspark_precompute import open_cache
    from dspark_precompute.read.export import export_nemo
    from dspark_precompute.read.training import build_dataloader

    if not (args.cache / "manifest.json").exists():
        build_cache(args.cache, args.target, args.data, args.seq_length, args.rows)
    nemo_dir = args.nemo or args.cache.with_name(args.cache.name + "_nemo")
    if not (nemo_dir / "manifest.json").exists():
        t0 = time.perf_counter()
        r = export_nemo(args.cache, nemo_dir, overwrite=True)
        log(f"exported {r.num_samples} samples ({r.bytes_written / 1e9:.1f} GB) in {time.perf_counter() - t0:.0f}s")
    if args.v1 and args.v1_cache is None:
        args.v1_cache = args.cache.with_name(args.cache.name + "_format1")
        if not (args.v1_cache / "manifest.json").exists():
            build_v1_cache(args.v1_cache, args.target, args.data, args.seq_length, args.rows)
    cache = open_cache(args.cache)
    log(f"warming the page cache: {warm(args.cache, nemo_dir, *([args.v1_cache] if args.v1_cache else [])) / 1e9:.1f}"
        " GB read")
    lengths = cache.lengths()
    token_bytes = cache.chunks.token_bytes()
    workers = [int(w) for w in args.workers.split(",") if w.strip()]
    if args.s3_only:
        s3 = run_s3(args, build_dataloader, token_bytes)
        md = s3_markdown(s3, args)
        sys.stdout.write(md)
        if args.json:
            args.json.write_text(json.dumps({"s3": s3, "repeats": args.repeats}, indent=1))
        if args.markdown:
            args.markdown.write_text(md)
        return

    def ours(shuffle: str, w: int, **kw: Any) -> Any:
        return lambda: build_dataloader(args.cache, shuffle=shuffle, num_workers=w, seed=0, **kw)

    def nemo() -> Any:
        ds = NemoDataset(nemo_dir)
        sampler = torch.utils.data.RandomSampler(ds, generator=torch.Generator().manual_seed(0))
        return torch.utils.data.DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=2,
                                           collate_fn=nemo_collate, persistent_workers=True)

    cases: dict[str, Any] = {}
    for shuffle in ("exact", "block"):
        for w in workers:
            cases[f"ours {shuffle}, batch {args.batch_size}, {w} workers"] = ours(shuffle, w,
                                                                                  batch_size=args.batch_size)
        cases[f"ours {shuffle}, max_tokens {args.max_tokens}, {max(workers)} workers"] = ours(
            shuffle, max(workers), max_tokens=args.max_tokens)
    cases[f"NeMo CachedDSparkDataset, batch {args.batch_size}, 2 workers"] = nemo
    results: dict[str, list[dict[str, float]]] = {k: [] for k in cases}
    limits = []
    for rep in range(args.repeats):
        limits.append(decode_limit(cache))
        log(f"repeat {rep + 1}/{args.repeats}: decode limit {limits[-1]['tokens_per_s']:,.0f} tokens/s per core")
        for name, make in cases.items():
            loader = make()
            set_epoch = None
            if isinstance(loader, torch.utils.data.DataLoader):  # NeMo's: a new permutation each pass
                def set_epoch(e: int, s: Any = loader.sampler) -> None:
                    s.generator.manual_seed(e)
            results[name].append(time_epoch(loader, rep, set_epoch))
            r = results[name][-1]
            log(f"  {name}: {r['tokens_per_s']:,.0f} tokens/s, {r['cpu_us_per_token']:.1f} CPU us/token, "
                f"contention {r.get('contention', float('nan')):.0%}")
            del loader

    limit = statistics.median(x["tokens_per_s"] for x in limits)
    limit_cpu = statistics.median(x["cpu_us_per_token"] for x in limits)
    table = []
    for name, rs in results.items():
        tps = statistics.median(r["tokens_per_s"] for r in rs)
        w = 2 if name.startswith("NeMo") else int(name.rsplit(", ", 1)[1].split()[0])
        table.append({"case": name, "workers": w, "tokens_per_s": tps, "GBps": tps * token_bytes / 1e9,
                      "cpu_us_per_token": statistics.median(r["cpu_us_per_token"] for r in rs),
                      "contention": statistics.median(r.get("contention", 0.0) for r in rs),
                      "of_decode_limit": tps / (limit * max(1, w)), "repeats": [r["tokens_per_s"] for r in rs],
                      # what each timed epoch delivered: every real token once, in this many batches
                      "epoch_tokens": [int(r["tokens"]) for r in rs], "epoch_batches": [int(r["batches"]) for r in rs]})
        cpu = table[-1]["cpu_us_per_token"]  # 0 on a tiny cache: CPU times tick in 10 ms
        table[-1]["decode_share_of_cpu"] = limit_cpu / cpu if cpu > 0 else float("nan")
    by = {row["case"]: row for row in table}
    nemo_tps = by[f"NeMo CachedDSparkDataset, batch {args.batch_size}, 2 workers"]["tokens_per_s"]
    nemo_reps = by[f"NeMo CachedDSparkDataset, batch {args.batch_size}, 2 workers"]["repeats"]
    limit_reps = [x["tokens_per_s"] for x in limits]
    for row in table:  # paired: each repeat's ratio, then the median (load that drifts between repeats cancels)
        row["vs_nemo"] = row["tokens_per_s"] / nemo_tps
        row["vs_nemo_paired"] = statistics.median(a / b for a, b in zip(row["repeats"], nemo_reps))
        row["of_decode_limit_paired"] = statistics.median(a / (b * max(1, row["workers"]))
                                                          for a, b in zip(row["repeats"], limit_reps))
    reads = None
    if args.v1_cache is not None:
        v1 = open_cache(args.v1_cache)
        log(f"random single-sample reads: {args.cache} against the format 1 cache {args.v1_cache}")
        reads = random_reads({"format 2": args.cache, "format 1": args.v1_cache}, args.reads, args.repeats)
        reads["format 1 cache"] = {"path": str(args.v1_cache), "format_version": v1.manifest.format_version,
                                   "samples": len(v1), "tokens": int(v1.lengths().sum()),
                                   "chunk_tokens": v1.chunk_tokens, "files": sum(1 for f in args.v1_cache.rglob("*"))}
        reads["format 2 cache"] = {"format_version": cache.manifest.format_version, "samples": len(cache),
                                   "tokens": int(lengths.sum()), "chunk_tokens": cache.chunk_tokens,
                                   "files": sum(1 for f in args.cache.rglob("*"))}
        v1.close()
    s3 = run_s3(args, build_dataloader, token_bytes) if args.s3 else None
    out = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__},
           "cache": {"path": str(args.cache), "samples": len(cache), "tokens": int(lengths.sum()),
                     "mean_length": float(lengths.mean()), "seq_length": cache.seq_length,
                     "layers": cache.layer_ids, "hidden": cache.hidden_size, "token_bytes": token_bytes,
                     "chunk_tokens": cache.chunk_tokens,
                     "bytes_on_disk": sum(f.stat().st_size for f in args.cache.rglob("*") if f.is_file()),
                     "nemo_bytes": sum(f.stat().st_size for f in nemo_dir.rglob("*") if f.is_file())},
           "decode_limit_tokens_per_s": limit, "decode_limit_cpu_us_per_token": limit_cpu,
           "decode_limit_bytes": [int(x["decoded_bytes"]) for x in limits],
           "decode_limit_repeats": limit_reps, "cases": table,
           "s3": s3, "random_reads": reads, "repeats": args.repeats}
    md = markdown(out, args)
    sys.stdout.write(md)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    if args.markdown:
        args.markdown.write_text(md)


def run_s3(args: argparse.Namespace, build_dataloader: Any, token_bytes: int) -> dict[str, Any]:
    import tempfile
    import uuid

    tmp = Path(tempfile.mkdtemp(prefix="dspark-moto-"))
    control = tmp / "latency_ms"
    control.write_text("0")
    proc, endpoint = start_moto(tmp, control)
    saved = {k: os.environ.get(k) for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                            "AWS_DEFAULT_REGION")}
    os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
                      AWS_DEFAULT_REGION="us-east-1")
    try:
        import s3fs

        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        s3fs.S3FileSystem(endpoint_url=endpoint).mkdir(bucket)
        url = f"s3://{bucket}/cache"
        up = upload(args.cache, url)
        log(f"uploaded the cache to moto in {up:.0f}s")
        latencies = [float(x) for x in args.s3_latency_ms.split(",") if x.strip()]
        cases = {(lat, shuffle, pf): f"{shuffle}, +{lat:g} ms per request, read-ahead "
                 + (f"{pf >> 20} MiB / 16 requests" if pf else "off")
                 for lat in latencies for shuffle in ("exact", "block") for pf in (0, 256 << 20)}
        res: dict[str, list[dict[str, float]]] = {k: [] for k in cases.values()}
        for _ in range(args.repeats):
            for (lat, shuffle, pf), name in cases.items():
                control.write_text(f"{lat:g}")
                loader = build_dataloader(url, batch_size=args.batch_size, shuffle=shuffle, num_workers=2,
                                          prefetch_bytes=pf)
                it = iter(loader)
                for _ in range(4):
                    next(it)
                t0, tokens = time.perf_counter(), 0
                for _ in range(args.s3_batches):
                    b = next(it, None)
                    if b is None:
                        break
                    tokens += consume(b)
                res[name].append({"tokens_per_s": tokens / (time.perf_counter() - t0)})
                log(f"  s3 {name}: {res[name][-1]['tokens_per_s']:,.0f} tokens/s")
                del it, loader
        return {"endpoint": "moto (separate process) on 127.0.0.1", "upload_s": up, "batches": args.s3_batches,
                "cases": {k: {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in v),
                              "GBps": statistics.median(r["tokens_per_s"] for r in v) * token_bytes / 1e9}
                          for k, v in res.items()}}
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        proc.kill()
        proc.wait()


def markdown(out: dict[str, Any], args: argparse.Namespace) -> str:
    c = out["cache"]
    lim = out["decode_limit_tokens_per_s"]
    lines = [
        f"Cache: {c['samples']:,} samples, {c['tokens']:,} real tokens (mean {c['mean_length']:.0f}, seq_length "
        f"{c['seq_length']}), layers {c['layers']} x {c['hidden']} bf16, {c['token_bytes']:,} B per token decoded, "
        f"chunks of {c['chunk_tokens']} tokens; {c['bytes_on_disk'] / 1e9:.2f} GB on disk, NeMo export "
        f"{c['nemo_bytes'] / 1e9:.1f} GB. Machine: {out['machine']['cpus']} CPUs. Medians of {out['repeats']} "
        "alternating repeats of one whole epoch each after a warm-up epoch, warm page cache.",
        "",
        f"Decode limit (one core reading, checking and decoding every chunk once): **{lim:,.0f} tokens/s** "
        f"({lim * c['token_bytes'] / 1e9:.2f} GB/s) per core; {out['decode_limit_cpu_us_per_token']:.1f} CPU us per "
        "token slot.",
        "",
        "| loader | real tokens/s | GB/s | vs NeMo (paired) | of decode limit x workers (paired) | CPU us / token "
        "| decode share of CPU | CPU contention |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in out["cases"]:
        lines.append(f"| {row['case']} | {row['tokens_per_s']:,.0f} | {row['GBps']:.2f} | {row['vs_nemo']:.2f}x "
                     f"({row['vs_nemo_paired']:.2f}x) | {row['of_decode_limit']:.0%} "
                     f"({row['of_decode_limit_paired']:.0%}) | {row['cpu_us_per_token']:.1f} | "
                     f"{row['decode_share_of_cpu']:.0%} | {row['contention']:.0%} |")
    rr = out.get("random_reads")
    if rr:
        f1, f2 = rr["format 1 cache"], rr["format 2 cache"]
        lines += ["", f"Random single-sample reads ({rr['reads']:,} per repeat, one `open_cache` per cache and repeat, "
                      "medians of "
                      f"{rr['repeats']} alternating repeats): format 2 {rr['samples_per_s']['format 2']:,.0f} "
                      "samples/s "
                      f"({f2['files']:,} files and directories), format 1 {rr['samples_per_s']['format 1']:,.0f} "
                      f"samples/s ({f1['files']:,}; {f1['samples']:,} samples, {f1['tokens']:,} tokens, chunks of "
                      f"{f1['chunk_tokens']}); **format 2 time / format 1 time: "
                      f"{rr['format 2_time_over_format 1_paired']:.2f}x** (paired)."]
    if out.get("s3"):
        lines += ["", *s3_markdown(out["s3"], args).splitlines()]
    return "\n".join(lines) + "\n"


def s3_markdown(s3: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [f"Object storage ({s3['endpoint']}; 2 workers, batch {args.batch_size}, {s3['batches']} batches timed "
             f"after 4, medians of {args.repeats}):", "", "| case | real tokens/s | GB/s |", "|---|---:|---:|"]
    for name, r in s3["cases"].items():
        lines.append(f"| {name} | {r['tokens_per_s']:,.0f} | {r['GBps']:.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
