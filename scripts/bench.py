#!/usr/bin/env python
"""Benchmark: this tool vs the limit vs the padded full-logits baseline, in one process run.

For every (target, seq_length) case, on the same target weights, tokenizer, data and
seq_length, and alternating the methods repeat by repeat (medians reported):

1. ``tool``     ``dspark_precompute.write.run.run(cfg)`` end to end: tokenize, load the
               target, forward, capture, compress, write, commit.
2. ``limit``    the bare decoder forward over the very batches the tool runs (same unit
               grouping, same ``make_batches``), with no capture, copies or writes. The
               inputs are built before the clock starts and the model is already loaded.
3. ``padded``   the reference tool's method (NeMo AutoModel ``precompute_dspark``),
               re-implemented here: tokenize, load, write embed+lm_head, then every sample
               padded to seq_length, fixed batch size (4), the full CausalLM forward
               (vocabulary logits included), the chosen layers captured with hooks and
               concatenated, moved to host, cast to bf16, and written synchronously as one
               ``shard-%06d.safetensors`` per 256 samples with int64 ids and masks.

It also sweeps the compressors on the hidden states the tool just wrote (ratio, write
and read MB/s), reads the cache back (random-access samples/s, sequential MB/s, next to
the padded shards' random access), and measures the tool's peak memory on N and 10*N
rows in subprocesses (psutil-sampled PSS of the process tree, and VmHWM).

Usage (from anywhere; paths default to the repository's ``../shared`` fixtures)::

    python scripts/bench.py                                  # full bench (~12 min on 2 CPU cores)
    python scripts/bench.py --targets tiny --seq-lengths 512 --repeats 3 --no-rss
    python scripts/bench.py --device cuda --dtype bf16 --rows tiny=0 --rows mid=0   # GPU, all rows
    python scripts/bench.py --set storage.unit_mib=32        # extra Hydra overrides for the tool
    python scripts/bench.py --json bench.json --markdown bench.md
    python scripts/bench.py write-path --json write.json     # the writer alone: GB/s per writer count and codec
    python scripts/bench.py tokenize --json tok.json         # tokenization: one process vs data.num_workers
    python scripts/bench.py scale --json scale.json          # 10,000 vs 100,000 rows: every cost grows linearly

``--rows NAME=N`` limits the rows of the data file used for target NAME (0 = all); all
three methods always see the same rows.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchlib import (
    DEFAULT_DATA,
    PeakRSS,
    compose,
    contention,
    cpu_pressure,
    dir_bytes,
    embedded_data,
    load_average,
    log,
    machine,
    md_table,
    median,
    output_args,
    rotated,
    save,
    tool_overrides,
)

# bench target name -> conf/model group ("byte": the built-in byte-level tiny target, used by the smoke test)
TARGETS = {"tiny": "bench_tiny", "mid": "bench_mid", "byte": "tiny"}
# Rows per case so that the default full bench stays under ~15 minutes on 2 CPU cores: the
# padded baseline computes 151,936 logits for every *padded* position (0.4-1.4 ms per
# position for the tiny target, ~7 ms for the mid one on this CPU), so its cases are small;
# the "scale" cases (tool vs limit only) run on every row.
DEFAULT_CASES = "tiny@512=192,tiny@2048=16,mid@512=8,mid@2048=4"
DEFAULT_SCALE = "tiny@512=0"
DEFAULT_SWEEP_ON = "tiny@512,mid@512"
BASELINE_BATCH = 4  # NeMo precompute_dspark --batch-size default
BASELINE_SHARD = 256  # NeMo precompute_dspark --shard-size default
COMPRESSORS = [  # (label, storage.compressor, level, shuffle)
    ("none", "none", 0, "none"),
    ("blosc_lz4 L1 byte-shuffle", "blosc_lz4", 1, "byte"),
    ("blosc_lz4 L5 byte-shuffle", "blosc_lz4", 5, "byte"),
    ("blosc_zstd L1 byte-shuffle (default)", "blosc_zstd", 1, "byte"),
    ("blosc_zstd L3 byte-shuffle", "blosc_zstd", 3, "byte"),
    ("blosc_zstd L5 byte-shuffle", "blosc_zstd", 5, "byte"),
    ("blosc_zstd L1 bit-shuffle", "blosc_zstd", 1, "bit"),
    ("zstd L1 (no shuffle)", "zstd", 1, "none"),
    ("zstd L3 (no shuffle)", "zstd", 3, "none"),
]


# --------------------------------------------------------------------------------------
# helpers


def _sync(device: Any) -> None:
    import torch

    if getattr(device, "type", str(device)) == "cuda":
        torch.cuda.synchronize()


def padded_layout_bytes(n_samples: int, seq_length: int, hidden: int, n_layers: int,
                        itemsize: int = 2) -> int:
    """Bytes of the reference tool's shards for ``n_samples`` (safetensors headers aside).

    Per padded position: input_ids, attention_mask and loss_mask as int64, the
    concatenated captured layers and the final post-norm state in bf16.
    """
    per_position = 3 * 8 + (n_layers + 1) * hidden * itemsize
    return n_samples * seq_length * per_position


# --------------------------------------------------------------------------------------
# one case: shared inputs for the limit and the baseline


@dataclass
class Case:
    target: str
    seq_length: int
    rows: int | None
    cfg: Any
    plan: Any
    samples: list
    lengths: Any
    batches: list  # per forward: sample ids (the tool's batches)
    pad_id: int
    tokens: int
    workdir: Path
    overrides: list[str]
    info: dict[str, Any] = field(default_factory=dict)


def make_case(target: str, seq: int, rows: int | None, data: Path | None, workdir: Path, device: str = "auto",
              dtype: str = "auto", extra: list[str] | None = None) -> Case:
    """Tokenize once and plan the tool's batches (used by the limit; nothing here is timed)."""
    import numpy as np

    from dspark_precompute.contract.layout import build_layout
    from dspark_precompute.write.plan.prepare import prepare
    from dspark_precompute.write.store.batching import make_batches

    group = TARGETS.get(target, target)
    overrides = tool_overrides(group, data, seq, rows, workdir / "prep", device, dtype, extra)
    cfg = compose(overrides)
    plan = prepare(cfg)
    samples, rows_in, n_rejects = tokenize_samples(plan)
    lengths = np.asarray([len(s.input_ids) for s in samples], dtype=np.int64)
    layout = build_layout(lengths, plan.chunk_tokens, plan.unit_tokens)
    batches = []
    for u in range(layout.num_units):
        batches += make_batches(layout.unit_order[u], lengths, cfg.batch.max_tokens, cfg.batch.max_samples)
    pad = plan.pad_id
    t = plan.target
    info = {"rows_in": rows_in, "samples": len(samples), "rejected": n_rejects, "tokens": int(lengths.sum()),
            "hidden_size": t.hidden_size, "num_layers": t.num_hidden_layers, "vocab_size": t.vocab_size,
            "layer_ids": list(plan.layer_ids), "device": str(plan.device),
            "compute_dtype": str(plan.compute_dtype).replace("torch.", ""), "chunk_tokens": plan.chunk_tokens,
            "unit_tokens": plan.unit_tokens, "units": layout.num_units, "forward_batches": len(batches),
            "padding_fraction": 1.0 - float(lengths.sum()) / (len(samples) * seq)}
    return Case(target, seq, rows, cfg, plan, samples, lengths, batches, pad, int(lengths.sum()), workdir,
                overrides, info)


def tokenize_samples(plan: Any) -> tuple[list, int, int]:
    """The package's own tokenization of the selection: (samples in selection order, rows, rejects)."""
    from dspark_precompute.write.samples.tokenize import tokenize

    tok = tokenize(plan.encoding, plan.cfg.data)
    return [tok.encoded[i] for i in range(len(tok.lengths))], int(tok.rows_in), len(tok.rejects)


def load_model(case: Case) -> Any:
    from dspark_precompute.write.target.load import load_target

    p = case.plan
    return _count_lm_head(load_target(case.cfg.model, p.target, len(p.tokenizer), p.device, p.compute_dtype))


# --------------------------------------------------------------------------------------
# 1. the tool


def run_tool(case: Case, path: Path) -> dict[str, Any]:
    from dspark_precompute.contract.spec import WEIGHTS
    from dspark_precompute.write.run import run

    cfg = compose([o for o in case.overrides if not o.startswith("storage.path=")] + [f"storage.path={path}"])
    t0 = time.perf_counter()
    result = run(cfg)
    wall = time.perf_counter() - t0
    weights = (path / WEIGHTS).stat().st_size if (path / WEIGHTS).exists() else 0
    total = dir_bytes(path, exclude=(".writer.lock",))
    return {"wall_s": wall, "timing": dict(result.timing), "tokens": result.tokens, "samples": result.samples,
            "bytes_total": total, "bytes_weights": weights, "bytes_data": total - weights}


# --------------------------------------------------------------------------------------
# 2. the limit


def limit_inputs(case: Case) -> list[tuple[Any, Any]]:
    """The tool's forward inputs, built by the pipeline's own ``batch_inputs`` (right-padded, no mask),
    so the limit always runs exactly the tool's forward."""
    from dspark_precompute.write.store.batching import batch_inputs

    device = case.plan.device
    ids_of = {i: s.input_ids for i, s in enumerate(case.samples)}
    return [(batch_inputs(ids_of, batch, case.lengths, case.pad_id, device)[0], None) for batch in case.batches]


def run_limit(model: Any, inputs: list[tuple[Any, Any]], device: Any) -> dict[str, Any]:
    """Bare decoder forward (no hooks, no lm_head, no copies, no writes) over ``inputs``."""
    import torch

    from dspark_precompute.write.target.capture import decoder_of

    decoder = decoder_of(model)
    _sync(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        for ids, attn in inputs:
            decoder(input_ids=ids, attention_mask=attn, use_cache=False)
    _sync(device)
    return {"wall_s": time.perf_counter() - t0}


# --------------------------------------------------------------------------------------
# 3. the padded full-logits baseline (NeMo AutoModel precompute_dspark's method)


def _nemo_capture(model: Any, layer_ids: list[int]):
    """Hooks as in NeMo's HFDSparkTargetModel.generate_batch: layers, embeddings, final norm."""
    from dspark_precompute.write.target.capture import decoder_of

    dec = decoder_of(model)
    last = len(dec.layers) - 1
    captured: dict[Any, Any] = {}

    def hook(key):
        def fn(_m, _i, out):
            captured[key] = out[0] if isinstance(out, tuple) else out
        return fn

    handles = []
    if -1 in layer_ids:
        handles.append(model.get_input_embeddings().register_forward_hook(hook("embed")))
    for lid in layer_ids:
        if 0 <= lid < last:
            handles.append(dec.layers[lid].register_forward_hook(hook(lid)))
    handles.append(dec.norm.register_forward_hook(hook("norm")))

    def feature(lid: int) -> Any:
        return captured["embed"] if lid == -1 else captured["norm"] if lid == last else captured[lid]

    return captured, handles, feature


def run_padded(case: Case, out_dir: Path, batch_size: int = BASELINE_BATCH, shard_size: int = BASELINE_SHARD,
               storage_dtype: str = "bf16", model: Any = None, tokenize: bool = True) -> dict[str, Any]:
    """The reference method end to end: tokenize, load, weights, padded forward, sync shards.

    ``model``/``tokenize=False`` reuse the case's model and samples (the smoke test);
    the benchmark passes neither, so tokenization and loading are timed like the tool's.
    """
    import numpy as np
    import torch
    from safetensors.torch import save_file

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[storage_dtype]
    device = case.plan.device
    S = case.seq_length
    t_start = time.perf_counter()
    samples = tokenize_samples(case.plan)[0] if tokenize else case.samples
    t_tok = time.perf_counter()
    if model is None:
        model = load_model(case)
    t_load = time.perf_counter()
    out_dir.mkdir(parents=True, exist_ok=True)

    def atomic(path: Path, tensors: dict[str, Any]) -> None:
        tmp = str(path) + ".tmp"
        save_file(tensors, tmp)
        os.replace(tmp, path)

    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    atomic(out_dir / "target_weights.safetensors",
           {"embed_tokens.weight": emb.detach().to(dtype).cpu().contiguous().clone(),
            "lm_head.weight": head.detach().to(dtype).cpu().contiguous().clone()})
    (out_dir / "manifest.json").write_text(json.dumps({"seq_length": S, "num_samples": len(samples),
                                                      "shard_size": shard_size, "dtype": storage_dtype}))
    captured, handles, feature = _nemo_capture(model, case.plan.layer_ids)
    t_forward = t_d2h = t_write = 0.0
    chunks: list[dict[str, Any]] = []
    buffered = shard = 0

    def flush() -> None:
        nonlocal chunks, buffered, shard, t_write
        if not buffered:
            return
        w0 = time.perf_counter()
        merged = {k: torch.cat([c[k] for c in chunks], dim=0)[:shard_size].contiguous() for k in chunks[0]}
        atomic(out_dir / f"shard-{shard:06d}.safetensors", merged)
        t_write += time.perf_counter() - w0
        chunks, buffered, shard = [], 0, shard + 1

    try:
        with torch.no_grad():
            for i in range(0, len(samples), batch_size):
                group = samples[i:i + batch_size]
                ids = torch.full((len(group), S), case.pad_id, dtype=torch.long)
                attn = torch.zeros((len(group), S), dtype=torch.long)
                loss = torch.zeros((len(group), S), dtype=torch.long)
                for r, s in enumerate(group):
                    n = len(s.input_ids)
                    ids[r, :n] = torch.from_numpy(s.input_ids.astype(np.int64))
                    attn[r, :n] = 1
                    loss[r, :n] = torch.from_numpy(s.loss_mask.astype(np.int64))
                f0 = time.perf_counter()
                ids_d, attn_d, loss_d = ids.to(device), attn.to(device), loss.to(device)
                captured.clear()
                out = model(input_ids=ids_d, attention_mask=attn_d, use_cache=False)  # logits included
                hidden = torch.cat([feature(lid) for lid in case.plan.layer_ids], dim=-1)
                last = captured["norm"]
                _sync(device)
                f1 = time.perf_counter()
                chunks.append({
                    "input_ids": ids_d.to(torch.long).cpu(),
                    "attention_mask": attn_d.to(torch.long).cpu(),
                    "loss_mask": loss_d.to(torch.long).cpu(),
                    "target_hidden_states": hidden.to(dtype).cpu(),
                    "target_last_hidden_states": last.to(dtype).cpu(),
                })
                del out, hidden, last
                captured.clear()
                t_forward, t_d2h = t_forward + (f1 - f0), t_d2h + (time.perf_counter() - f1)
                buffered += len(group)
                if buffered >= shard_size:
                    flush()
            flush()
    finally:
        for h in handles:
            h.remove()
    wall = time.perf_counter() - t_start
    shards = sorted(out_dir.glob("shard-*.safetensors"))
    weights = (out_dir / "target_weights.safetensors").stat().st_size
    total = dir_bytes(out_dir)
    return {"wall_s": wall, "tokenize_s": t_tok - t_start, "load_target_s": t_load - t_tok,
            "forward_s": t_forward, "d2h_s": t_d2h, "write_s": t_write, "shards": len(shards),
            "samples": len(samples), "bytes_total": total, "bytes_weights": weights, "bytes_data": total - weights}


# --------------------------------------------------------------------------------------
# compressor sweep and read-back


def hidden_sample(cache_path: Path, max_bytes: int = 96 << 20) -> tuple[Any, int]:
    """Real captured hidden states from a cache (no chunk-tail zeros): up to ``max_bytes`` of bf16 rows."""
    import numpy as np
    import zarr

    manifest = json.loads((cache_path / "manifest.json").read_text())
    chunk = int(manifest["layout"]["chunk_tokens"])
    g = zarr.open_group(str(cache_path), mode="r")
    names = sorted(set(manifest["arrays"].values()))
    starts, stops = np.asarray(g["units/token_start"][:]), np.asarray(g["units/token_stop"][:])
    row_bytes = int(manifest["hidden_size"]) * 2
    budget = max(1, max_bytes // len(names) // row_bytes)  # rows per array
    parts = []
    for name in names:
        left = budget
        for a, b in zip(starts, stops):
            if left <= 0:
                break
            n = min(int(b - a), left)
            parts.append(np.asarray(g[name][int(a):int(a) + n]))
            left -= n
    data = np.concatenate(parts, axis=0)
    if len(data) >= chunk:  # whole chunks only: a partial last chunk is stored padded and skews the ratio
        data = data[: len(data) // chunk * chunk]
    else:
        chunk = len(data)
    return data, chunk


def sweep_compressors(data: Any, chunk: int, workdir: Path, repeats: int) -> list[dict[str, Any]]:
    """Write (and read) ``data`` with every compressor, alternating them across repeats."""
    import numpy as np
    import zarr

    from dspark_precompute.contract.arrays import codec_chain

    raw = data.nbytes
    res: dict[str, dict[str, list[float]]] = {c[0]: {"w": [], "r": [], "ratio": []} for c in COMPRESSORS}
    for rep in range(repeats):
        for label, name, level, shuffle in rotated(COMPRESSORS, rep):
            path = workdir / f"sweep-{name}-{level}-{shuffle}"
            shutil.rmtree(path, ignore_errors=True)
            arr = zarr.create_array(str(path), shape=data.shape, chunks=(chunk, data.shape[1]), dtype=data.dtype,
                                    fill_value=0, compressors=codec_chain(name, level, shuffle, data.dtype.itemsize))
            t0 = time.perf_counter()
            arr[:] = data
            t1 = time.perf_counter()
            back = np.asarray(zarr.open_array(str(path), mode="r")[:])
            t2 = time.perf_counter()
            assert back.shape == data.shape
            stored = dir_bytes(path, exclude=("zarr.json",))
            res[label]["w"].append(raw / (t1 - t0) / 1e6)
            res[label]["r"].append(raw / (t2 - t1) / 1e6)
            res[label]["ratio"].append(raw / max(1, stored))
            shutil.rmtree(path, ignore_errors=True)
    return [{"compressor": label, "ratio": median(res[label]["ratio"]), "write_MBps": median(res[label]["w"]),
             "read_MBps": median(res[label]["r"]), "raw_MB": raw / 1e6} for label, *_ in COMPRESSORS]


def _tensor_bytes(sample: dict[str, Any]) -> int:
    return int(sum(getattr(v, "nbytes", 0) for v in sample.values()))


def readback(cache_path: Path, padded_dir: Path | None, seconds: float = 3.0, seed: int = 0) -> dict[str, Any]:
    """Random-access samples/s and sequential (on-disk order) MB/s of the cache; the shards' random access."""
    import numpy as np

    from dspark_precompute import open_cache

    rng = np.random.default_rng(seed)
    out: dict[str, Any] = {}
    cache = open_cache(str(cache_path))
    n = len(cache)
    idx = rng.permutation(n)
    t0 = time.perf_counter()
    k = nbytes = 0
    while k < n and (time.perf_counter() - t0) < seconds:
        nbytes += _tensor_bytes(cache[int(idx[k])])
        k += 1
    dt = time.perf_counter() - t0
    out.update(random_samples_per_s=k / dt, random_MBps=nbytes / dt / 1e6, random_samples=k)
    cache = open_cache(str(cache_path))  # cold chunk cache for the sequential pass
    starts = cache.starts() if hasattr(cache, "starts") else None
    order = np.argsort(np.asarray(starts), kind="stable") if starts is not None else np.arange(n)
    t0 = time.perf_counter()
    k = nbytes = 0
    for i in order:
        nbytes += _tensor_bytes(cache[int(i)])
        k += 1
        if time.perf_counter() - t0 > 2 * seconds:
            break
    dt = time.perf_counter() - t0
    out.update(sequential_MBps=nbytes / dt / 1e6, sequential_samples_per_s=k / dt, sequential_samples=k)
    if padded_dir is not None and padded_dir.exists():
        from safetensors import safe_open

        meta = json.loads((padded_dir / "manifest.json").read_text())
        shard, total = int(meta["shard_size"]), int(meta["num_samples"])
        handles: dict[int, Any] = {}
        idx = rng.permutation(total)
        keys = ("input_ids", "loss_mask", "target_hidden_states", "target_last_hidden_states")
        t0 = time.perf_counter()
        k = nbytes = 0
        while k < total and (time.perf_counter() - t0) < seconds:
            i = int(idx[k])
            s = i // shard
            if s not in handles:
                handles[s] = safe_open(str(padded_dir / f"shard-{s:06d}.safetensors"), framework="pt")
            item = {key: handles[s].get_slice(key)[i % shard] for key in keys}
            nbytes += _tensor_bytes(item)
            k += 1
        dt = time.perf_counter() - t0
        out.update(padded_random_samples_per_s=k / dt, padded_random_MBps=nbytes / dt / 1e6)
    return out


# --------------------------------------------------------------------------------------
# peak memory vs dataset size (subprocesses)


def _vm_hwm() -> int:
    """This process's peak RSS (VmHWM, bytes): unlike ru_maxrss it is not inherited across fork+exec."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _rss_child(args: argparse.Namespace) -> None:
    """Child mode: one tool run; prints its peak RSS as JSON (the parent samples the whole tree)."""
    from dspark_precompute.write.run import run

    cfg = compose(json.loads(args.rss_child))
    t0 = time.perf_counter()
    r = run(cfg)
    wall = time.perf_counter() - t0
    print("RSS_JSON " + json.dumps({"hwm_main": _vm_hwm(), "tokens": r.tokens, "samples": r.samples,
                                    "wall_s": wall, "timing": r.timing}), flush=True)


def repeated_jsonl(src: Path, dst: Path, factor: int) -> int:
    lines = [ln for ln in src.read_text(encoding="utf-8").splitlines() if ln.strip()]
    with open(dst, "w", encoding="utf-8") as fh:
        for _ in range(factor):
            fh.write("\n".join(lines) + "\n")
    return len(lines) * factor


def measure_rss(target: str, seq: int, rows: int, factor: int, data: Path | None, workdir: Path, device: str,
                dtype: str, extra: list[str]) -> list[dict[str, Any]]:
    if data is None:  # the embedded demo set
        data = embedded_data()
    big = workdir / "rss-data.jsonl"
    n_lines = repeated_jsonl(data, big, -(-rows * factor // max(1, sum(1 for _ in open(data)))))
    out = []
    for n in (rows, rows * factor):
        assert n <= n_lines
        path = workdir / f"rss-cache-{n}"
        ov = tool_overrides(TARGETS.get(target, target), big, seq, n, path, device, dtype, extra)
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--rss-child", json.dumps(ov)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        with PeakRSS(proc.pid) as mon:
            stdout, stderr = proc.communicate()
        if proc.returncode:
            raise RuntimeError(f"RSS child failed ({proc.returncode}):\n{stderr[-4000:]}")
        rec = json.loads(next(ln for ln in stdout.splitlines() if ln.startswith("RSS_JSON "))[9:])
        rec.update(rows=n, peak_pss_tree=mon.peak_pss, peak_rss_tree=mon.peak_rss)
        try:
            rec["units"] = json.loads((path / "manifest.json").read_text())["layout"]["num_units"]
        except (OSError, KeyError, ValueError):
            pass
        out.append(rec)
        shutil.rmtree(path, ignore_errors=True)
    big.unlink(missing_ok=True)
    return out


# --------------------------------------------------------------------------------------
# driver


@dataclass
class Spec:
    target: str
    seq: int
    rows: int  # 0 = all rows of the data file
    baseline: bool  # False: tool vs limit only (the "scale" tier)
    sweep: bool = False  # run the compressor sweep on this case's cache

    @property
    def key(self) -> str:
        return f"{self.target}@{self.seq}"


def parse_specs(text: str, baseline: bool) -> list[Spec]:
    """``tiny@512=256,mid@2048=4`` -> specs (``=N`` optional: 0, all rows)."""
    out = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        name, _, rows = item.partition("=")
        target, _, seq = name.partition("@")
        out.append(Spec(target, int(seq), int(rows or 0), baseline))
    return out


LM_HEAD_CALLS = {"n": 0}  # forwards through the target's lm_head, counted by a hook on every model loaded


def _count_lm_head(model: Any) -> Any:
    def hook(_module: Any, _inputs: Any, _output: Any) -> None:
        LM_HEAD_CALLS["n"] += 1

    head = model.get_output_embeddings()
    if head is not None:
        head.register_forward_hook(hook)
    return model


def _counting_tool_loads() -> None:
    """Every target the tool loads gets the lm_head counter (the tool must never call it)."""
    import dspark_precompute.write.run as run_module

    real = run_module.load_target
    if getattr(real, "_counts_lm_head", False):
        return

    def load(*a: Any, **k: Any) -> Any:
        return _count_lm_head(real(*a, **k))

    load._counts_lm_head = True  # type: ignore[attr-defined]
    run_module.load_target = load


def bench_case(spec: Spec, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    import gc

    import torch

    _counting_tool_loads()

    target, seq, rows = spec.target, spec.seq, spec.rows or None
    tier = "tool vs limit vs padded" if spec.baseline else "tool vs limit (scale)"
    log(f"== {spec.key} rows={rows or 'all'} [{tier}]: preparing")
    case = make_case(target, seq, rows, args.data, workdir, args.device, args.dtype, args.set)
    log("   " + json.dumps(case.info))
    model = load_model(case)
    inputs = limit_inputs(case)
    run_limit(model, inputs[:2], case.plan.device)  # warm-up (allocator, kernels), not recorded
    methods = ["tool", "limit", "padded"] if spec.baseline and not args.no_baseline else ["tool", "limit"]
    rec: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
    tool_path, padded_dir = workdir / "tool-cache", workdir / "padded-cache"
    for rep in range(args.repeats):
        for m in rotated(methods, rep):
            gc.collect()
            calls_before = LM_HEAD_CALLS["n"]
            if m == "tool":
                shutil.rmtree(tool_path, ignore_errors=True)
                r = run_tool(case, tool_path)
            elif m == "limit":
                r = run_limit(model, inputs, case.plan.device)
            else:
                shutil.rmtree(padded_dir, ignore_errors=True)
                r = run_padded(case, padded_dir)
            r["lm_head_calls"] = LM_HEAD_CALLS["n"] - calls_before
            rec[m].append(r)
            log(f"   repeat {rep + 1}/{args.repeats} {m:6s} {r['wall_s']:8.2f} s")
    del inputs, model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    out: dict[str, Any] = {"target": target, "seq_length": seq, "rows": spec.rows, "tier": tier,
                           "baseline": "padded" in rec, "info": case.info, "raw": rec}
    tokens = case.tokens
    tool_wall = median([r["wall_s"] for r in rec["tool"]])
    limit_wall = median([r["wall_s"] for r in rec["limit"]])
    keys = sorted({k for r in rec["tool"] for k in r["timing"]})
    timing = {k: median([r["timing"].get(k, 0.0) for r in rec["tool"]]) for k in keys}
    shares = {k: median([r["timing"].get(k, 0.0) / r["wall_s"] for r in rec["tool"]]) for k in keys}
    tool = rec["tool"][-1]
    best = {m: min(r["wall_s"] for r in rec[m]) for m in rec}
    summary = {
        "lm_head_calls": {m: max(r.get("lm_head_calls", 0) for r in rec[m]) for m in rec},
        "best_wall_s": best, "tool_over_limit_best": best["tool"] / best["limit"],
        "tokens": tokens, "samples": case.info["samples"],
        "tool_wall_s": tool_wall, "limit_wall_s": limit_wall,
        "tool_tok_s": tokens / tool_wall, "limit_tok_s": tokens / limit_wall,
        "tool_over_limit": tool_wall / limit_wall,
        "tool_forward_write_s": timing.get("forward_write_s", float("nan")),
        "tool_forward_write_over_limit": median([r["timing"].get("forward_write_s", float("nan")) / lim["wall_s"]
                                                 for r, lim in zip(rec["tool"], rec["limit"])]),
        "tool_bytes_total": tool["bytes_total"], "tool_bytes_data": tool["bytes_data"],
        "tool_B_per_tok_total": tool["bytes_total"] / tokens, "tool_B_per_tok_data": tool["bytes_data"] / tokens,
        "tool_timing_median": timing, "tool_share_median": shares,
        "padded_layout_B_per_tok": padded_layout_bytes(case.info["samples"], seq, case.info["hidden_size"],
                                                       len(case.info["layer_ids"])) / tokens,
    }
    if "padded" in rec:
        pw = median([r["wall_s"] for r in rec["padded"]])
        steady = [r["forward_s"] + r["d2h_s"] + r["write_s"] for r in rec["padded"]]
        pad = rec["padded"][-1]
        summary.update({
            "padded_wall_s": pw, "padded_tok_s": tokens / pw, "tool_over_padded_speed": pw / tool_wall,
            "tool_over_padded_speed_best": best["padded"] / best["tool"],
            "padded_steady_s": median(steady),
            "steady_speedup": median(steady) / summary["tool_forward_write_s"],
            "padded_timing_median": {k: median([r[k] for r in rec["padded"]])
                                     for k in ("tokenize_s", "load_target_s", "forward_s", "d2h_s", "write_s")},
            "padded_bytes_total": pad["bytes_total"], "padded_bytes_data": pad["bytes_data"],
            "padded_B_per_tok_total": pad["bytes_total"] / tokens, "padded_B_per_tok_data": pad["bytes_data"] / tokens,
            "bytes_ratio_data": tool["bytes_data"] / pad["bytes_data"],
            "bytes_ratio_total": tool["bytes_total"] / pad["bytes_total"],
        })
    out["summary"] = summary
    if not args.no_sweep and spec.sweep:
        log("   compressor sweep")
        data, chunk = hidden_sample(tool_path, args.sweep_mib << 20)
        out["sweep"] = sweep_compressors(data, chunk, workdir, args.sweep_repeats)
        del data
    if not args.no_readback:
        log("   read-back")
        out["readback"] = readback(tool_path, padded_dir if "padded" in rec else None)
    shutil.rmtree(tool_path, ignore_errors=True)
    shutil.rmtree(padded_dir, ignore_errors=True)
    shutil.rmtree(workdir / "prep", ignore_errors=True)
    return out


# --------------------------------------------------------------------------------------
# report


def _fmt(x: float, nd: int = 2) -> str:
    if x != x:
        return "-"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.{nd}f}"


def markdown(results: dict[str, Any]) -> str:
    nan = float("nan")
    cases = results["cases"]
    three = [c for c in cases if c["baseline"]]
    scale = [c for c in cases if not c["baseline"]]
    L: list[str] = []
    reps = results["args"]["repeats"]
    def psi(c: dict[str, Any]) -> str:
        v = c.get("cpu_pressure")
        return "-" if v is None else f"{100 * v:.0f}%"

    if three:
        L.append(f"### Speed: tool vs limit vs padded baseline (median of {reps} alternating repeats)\n")
        L.append("| target | seq | samples | real tokens | padding in padded layout | tool s | limit s | padded s "
                 "| tool tok/s | padded tok/s | **tool / padded** speed | (best-of) | steady state "
                 "| **tool / limit** wall | (best-of) | tool fwd+write / limit | CPU contention |")
        L.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for c in three:
            s = c["summary"]
            L.append(f"| {c['target']} | {c['seq_length']} | {s['samples']} | {s['tokens']:,} "
                     f"| {100 * c['info']['padding_fraction']:.0f}% | {_fmt(s['tool_wall_s'])} "
                     f"| {_fmt(s['limit_wall_s'])} | {_fmt(s.get('padded_wall_s', nan))} "
                     f"| {_fmt(s['tool_tok_s'], 0)} | {_fmt(s.get('padded_tok_s', nan), 0)} "
                     f"| **{_fmt(s.get('tool_over_padded_speed', nan), 1)}x** "
                     f"| {_fmt(s.get('tool_over_padded_speed_best', nan), 1)}x "
                     f"| {_fmt(s.get('steady_speedup', nan), 1)}x "
                     f"| **{_fmt(s['tool_over_limit'])}x** | {_fmt(s['tool_over_limit_best'])}x "
                     f"| {_fmt(s['tool_forward_write_over_limit'])}x | {psi(c)} |")
        L.append("\n*tool / padded*: ratio of real tokens/s (= padded wall / tool wall), end to end for both "
                 "(tokenize, load, forward, write). *best-of*: the same ratio from each method's fastest repeat. "
                 "*steady state*: the baseline's forward + to-host + shard writes vs the tool's `forward_write_s` "
                 "(both without tokenization, target loading and setup). *tool fwd+write / limit*: the tool's "
                 "forward/capture/copy/write phase vs the bare forward, paired by repeat. *CPU contention*: share "
                 "of the case's wall time in which some task on the machine waited for a CPU (PSI); other "
                 "jobs shared this machine.\n")
    if scale:
        L.append(f"### Speed at scale: tool vs limit (median of {reps} alternating repeats)\n")
        L += md_table(["target", "seq", "samples", "real tokens", "tool s", "limit s", "tool tok/s", "limit tok/s",
                       "**tool / limit** wall", "(best-of)", "tool fwd+write / limit", "units", "CPU contention"],
                      ([c["target"], c["seq_length"], s["samples"], f"{s['tokens']:,}", _fmt(s["tool_wall_s"]),
                        _fmt(s["limit_wall_s"]), _fmt(s["tool_tok_s"], 0), _fmt(s["limit_tok_s"], 0),
                        f"**{_fmt(s['tool_over_limit'])}x**", f"{_fmt(s['tool_over_limit_best'])}x",
                        f"{_fmt(s['tool_forward_write_over_limit'])}x", c["info"]["units"], psi(c)]
                       for c in scale for s in [c["summary"]]))
    L.append("\n### Bytes on disk per real token\n")
    L.append("| target | seq | samples | padding in padded layout | tool data B/tok | padded data B/tok "
             "| **ratio (data)** | tool total B/tok | padded total B/tok | ratio (total) |")
    L.append("|---|---|---|---|---|---|---|---|---|---|")
    for c in cases:
        s = c["summary"]
        if c["baseline"]:
            pd, pt = s.get("padded_B_per_tok_data", nan), s.get("padded_B_per_tok_total", nan)
            rd, rt, tag = s.get("bytes_ratio_data", nan), s.get("bytes_ratio_total", nan), ""
        else:  # analytic padded layout (checked against the written shards in the smoke test and 3-way cases)
            weights = 2 * c["info"]["vocab_size"] * c["info"]["hidden_size"] * 2
            pd = s["padded_layout_B_per_tok"]
            pt = pd + weights / s["tokens"]
            rd, rt, tag = s["tool_B_per_tok_data"] / pd, s["tool_B_per_tok_total"] / pt, " (analytic)"
        L.append(f"| {c['target']} | {c['seq_length']} | {s['samples']} | {100 * c['info']['padding_fraction']:.0f}% "
                 f"| {_fmt(s['tool_B_per_tok_data'], 0)} | {_fmt(pd, 0)}{tag} | **{_fmt(rd, 3)}x** "
                 f"| {_fmt(s['tool_B_per_tok_total'], 0)} | {_fmt(pt, 0)}{tag} | {_fmt(rt, 3)}x |")
    L.append("\n*data*: everything but `target_weights.safetensors` (hidden states, ids, masks, tables, "
             "manifest); *total*: the whole directory (the baseline stores embed **and** lm_head, the tool "
             "stores a tied lm_head once). *analytic*: the padded layout's exact size (3 int64 arrays + "
             "(layers+1) x hidden bf16 per padded position), which the written shards match to <1%.\n")
    L.append("### Where the tool's time goes (median share of its wall time)\n")
    stages = ["tokenize_s", "load_target_s", "batch_s", "forward_s", "copy_s", "writer_wait_s"]
    L.append("| target | seq | samples | " + " | ".join(s.removesuffix("_s") for s in stages)
             + " | other (setup, weights, writer start/stop, manifest) | writer busy (overlapped) |")
    L.append("|---|---|---|" + "---|" * (len(stages) + 2))
    for c in cases:
        sh = c["summary"]["tool_share_median"]
        other = 1.0 - sum(sh.get(k, 0.0) for k in stages)
        L.append(f"| {c['target']} | {c['seq_length']} | {c['summary']['samples']} | "
                 + " | ".join(f"{100 * sh.get(k, 0.0):.1f}%" for k in stages)
                 + f" | {100 * other:.1f}% | {100 * sh.get('writer_busy_s', 0.0):.1f}% |")
    if three:
        L.append("\n### Where the padded baseline's time goes (median seconds)\n")
        L += md_table(["target", "seq", "tokenize", "load", "forward (with logits)", "to host", "write shards",
                       "total"],
                      ([c["target"], c["seq_length"], *(_fmt(t[k]) for k in ("tokenize_s", "load_target_s",
                                                                             "forward_s", "d2h_s", "write_s")),
                        _fmt(c["summary"]["padded_wall_s"])]
                       for c in three for t in [c["summary"]["padded_timing_median"]]))
    sweeps = [c for c in cases if c.get("sweep")]
    if sweeps:
        L.append(f"\n### Compressors (hidden states the tool captured, bf16; median of "
                 f"{results['args']['sweep_repeats']})\n")
        L += md_table(["target", "seq", "compressor", "ratio", "write MB/s", "read MB/s"],
                      ([c["target"], c["seq_length"], r["compressor"], f"{r['ratio']:.3f}", _fmt(r["write_MBps"], 0),
                        _fmt(r["read_MBps"], 0)] for c in sweeps for r in c["sweep"]))
        L.append("\nRaw MB per compressor: " + ", ".join(f"{c['target']}@{c['seq_length']}: "
                                                        f"{c['sweep'][0]['raw_MB']:.0f}" for c in sweeps)
                 + " (single process, zarr's own codec threads; crc32c included).")
    rb = [c for c in cases if c.get("readback")]
    if rb:
        L.append("\n### Read-back (warm page cache)\n")
        L += md_table(["target", "seq", "samples", "random samples/s", "random MB/s", "sequential MB/s",
                       "padded shards random samples/s", "padded random MB/s"],
                      ([c["target"], c["seq_length"], c["summary"]["samples"],
                        *(_fmt(r.get(k, nan), 0) for k in ("random_samples_per_s", "random_MBps", "sequential_MBps",
                                                           "padded_random_samples_per_s", "padded_random_MBps"))]
                       for c in rb for r in [c["readback"]]))
        L.append("\nMB/s counts the tensors returned (the padded shards return seq_length rows per sample).")
    if results.get("rss"):
        rs = results["rss"]
        L.append(f"\n### Peak memory vs dataset size ({rs['target']}, seq {rs['seq_length']}, separate processes)\n")
        L += md_table(["rows", "real tokens", "units", "wall s", "peak PSS (process tree)", "peak RSS sum (tree)",
                       "VmHWM main process"],
                      ([f"{r['rows']:,}", f"{r['tokens']:,}", r.get("units", "?"), f"{r['wall_s']:.1f}",
                        *(f"{r[k] / 2**20:.0f} MiB" for k in ("peak_pss_tree", "peak_rss_tree", "hwm_main"))]
                       for r in rs["runs"]))
        a, b = rs["runs"][0], rs["runs"][-1]
        L.append(f"\n{b['rows'] // a['rows']}x the rows: **peak PSS {b['peak_pss_tree'] / a['peak_pss_tree']:.2f}x**, "
                 f"main-process VmHWM {b['hwm_main'] / a['hwm_main']:.2f}x (PSS counts the shared unit buffers "
                 "once; the RSS sum counts them in both processes; sampled every 0.1 s).")
    return "\n".join(L) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default=DEFAULT_CASES,
                   help="tool vs limit vs padded: TARGET@SEQ=ROWS,... (ROWS 0 = all; TARGET tiny, mid or a "
                        f"conf/model group); default {DEFAULT_CASES}")
    p.add_argument("--scale-cases", default=DEFAULT_SCALE,
                   help=f"tool vs limit only, on more rows; default {DEFAULT_SCALE} ('' to skip)")
    p.add_argument("--targets", default=None, help="keep only these targets (comma list), e.g. tiny")
    p.add_argument("--seq-lengths", default=None, help="keep only these seq_lengths (comma list), e.g. 512")
    p.add_argument("--rows", action="append", default=[], metavar="TARGET[@SEQ]=N",
                   help="override the rows of matching cases (0 = all)")
    p.add_argument("--repeats", type=int, default=3, help="alternating repeats per method (median reported)")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA,
                   help="chat jsonl (messages or sharegpt), or 'embedded' for the package's demo set")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--dtype", default="auto", help="compute dtype: auto (bf16 on CUDA, fp32 on CPU), bf16, fp32")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra Hydra override for the tool (and the limit's batching), e.g. storage.unit_mib=32")
    p.add_argument("--no-baseline", action="store_true", help="skip the padded baseline")
    p.add_argument("--no-sweep", action="store_true", help="skip the compressor sweep")
    p.add_argument("--sweep-on", default=DEFAULT_SWEEP_ON,
                   help=f"cases (TARGET@SEQ) whose cache feeds the compressor sweep ('' = every case); "
                        f"default {DEFAULT_SWEEP_ON}")
    p.add_argument("--sweep-mib", type=int, default=96, help="MiB of hidden states per compressor in the sweep")
    p.add_argument("--sweep-repeats", type=int, default=3)
    p.add_argument("--no-readback", action="store_true")
    p.add_argument("--no-rss", action="store_true", help="skip the peak-memory-vs-dataset-size runs")
    p.add_argument("--rss-target", default="tiny")
    p.add_argument("--rss-seq", type=int, default=512)
    p.add_argument("--rss-rows", type=int, default=300, help="N: the runs use N and factor*N rows")
    p.add_argument("--rss-factor", type=int, default=10)
    p.add_argument("--workdir", type=Path, default=None, help="scratch directory (default: a temp dir)")
    output_args(p)
    p.add_argument("--rss-child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.sweep_on = [x for x in args.sweep_on.split(",") if x]
    return args


def select_specs(args: argparse.Namespace) -> list[Spec]:
    specs = parse_specs(args.cases, True) + parse_specs(args.scale_cases, False)
    if args.targets:
        keep = set(args.targets.split(","))
        specs = [s for s in specs if s.target in keep]
    if args.seq_lengths:
        keep_s = {int(x) for x in args.seq_lengths.split(",")}
        specs = [s for s in specs if s.seq in keep_s]
    for item in args.rows:
        name, _, n = item.partition("=")
        for s in specs:
            if name in (s.target, s.key):
                s.rows = int(n)
    # the sweep runs once per listed key, on the matching case with the most rows
    for key in (args.sweep_on or sorted({s.key for s in specs})):
        cands = [s for s in specs if s.key == key]
        if cands:
            max(cands, key=lambda s: s.rows or float("inf")).sweep = True
    return specs


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["write-path"], ["tokenize"], ["scale"]):  # scripts/bench_{write,tokenize,scale}.py
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        if argv[0] == "tokenize":
            from bench_tokenize import main as sub
        elif argv[0] == "scale":
            from bench_scale import main as sub
        else:
            from bench_write import main as sub

        return sub(argv[1:])
    args = parse_args(argv)
    if args.rss_child is not None:
        _rss_child(args)
        return 0
    args.data = None if str(args.data) == "embedded" else args.data.expanduser().resolve()
    specs = select_specs(args)
    own = args.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="dspark-bench-")) if own else args.workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    results: dict[str, Any] = {"machine": machine(), "args": {k: str(v) if isinstance(v, Path) else v
                                                             for k, v in vars(args).items()},
                               "command": " ".join(["python", *sys.argv]), "cases": []}
    log(json.dumps(results["machine"]))
    p_start, results["load_average_start"] = cpu_pressure(), load_average()
    try:
        for i, spec in enumerate(specs):
            p0 = cpu_pressure()
            results["cases"].append(bench_case(spec, args, workdir / f"case{i}-{spec.target}-{spec.seq}"))
            results["cases"][-1]["cpu_pressure"] = contention(p0, cpu_pressure())
        if not args.no_rss:
            log(f"== peak memory: {args.rss_target} seq {args.rss_seq}, {args.rss_rows} and "
                f"{args.rss_rows * args.rss_factor} rows")
            results["rss"] = {"target": args.rss_target, "seq_length": args.rss_seq,
                              "runs": measure_rss(args.rss_target, args.rss_seq, args.rss_rows, args.rss_factor,
                                                  args.data, workdir, args.device, args.dtype, args.set)}
    finally:
        if own:
            shutil.rmtree(workdir, ignore_errors=True)
    results["bench_wall_s"] = time.perf_counter() - t0
    results["cpu_pressure"], results["load_average_end"] = contention(p_start, cpu_pressure()), load_average()
    md = markdown(results)
    print(md)
    log(f"bench wall time: {results['bench_wall_s']:.0f} s")
    save(args, results, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
