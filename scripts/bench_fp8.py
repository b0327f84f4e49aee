#!/usr/bin/env python
"""FP8 storage: what it saves on disk and what it costs in precision, measured on one target and data.

Runs the tool over the same rows of the same target (default: the random-weight Qwen3
``bench_mid``, hidden 512, 12 layers, 5 captured layers [1, 4, 6, 8, 11] with 11 = N-1 the
post-norm state) once per storage setting:

``fp32``      storage.dtype=fp32: on a CPU the compute dtype, so these are the exact states (the reference)
``bf16``      the default
``fp8``       storage.dtype=fp8_e4m3 (one float32 scale per token; the post-norm state kept bf16)
``fp8-g128``  the same with storage.fp8_group=128
``fp8-last``  storage.dtype=fp8_e4m3 storage.last_dtype=fp8_e4m3 (every array fp8)

and reports:

* hidden-array bytes on disk after compression (every file under ``hidden_states/`` and
  ``hidden_scales/``) and their ratio to the bf16 cache's;
* per stored array, the relative RMS error ``sqrt(sum (s - r)^2 / sum r^2)`` over *every*
  token against the fp32 cache, and ``dspark-cache verify --precision N`` (the command's own
  numbers: a recompute at N sampled positions, the worst token, and for the post-norm state
  the teacher's top-1 agreement and total-variation distance after lm_head);
* a codec sweep: the stored arrays of each cache recompressed chunk by chunk with the
  writer's chain under other ``storage.shuffle`` / ``compression_level`` settings.

Usage::

    python scripts/bench_fp8.py                                   # ~20 min on 2 CPU cores
    python scripts/bench_fp8.py --rows 20 --positions 32           # a quick run
    python scripts/bench_fp8.py --json fp8.json --markdown fp8.md
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from benchlib import DEFAULT_DATA, compose, dir_bytes, logger, machine, output_args, save, tool_overrides

VARIANTS = {
    "fp32": ["storage.dtype=fp32"],
    "bf16": [],
    "fp8": ["storage.dtype=fp8_e4m3"],
    "fp8-g128": ["storage.dtype=fp8_e4m3", "storage.fp8_group=128"],
    "fp8-last": ["storage.dtype=fp8_e4m3", "storage.last_dtype=fp8_e4m3"],
}
SWEEP = [("blosc_zstd", 1, "byte"), ("blosc_zstd", 1, "bit"), ("blosc_zstd", 1, "none"), ("blosc_zstd", 3, "byte"),
         ("blosc_zstd", 5, "bit"), ("zstd", 3, "none"), ("blosc_lz4", 1, "byte")]


log = logger("bench_fp8", clock=True)


def hidden_bytes(path: Path) -> int:
    return sum(dir_bytes(path / d) for d in ("hidden_states", "hidden_scales") if (path / d).exists())


def arrays_of(c: Any) -> dict[str, tuple[str, str | None]]:
    """Stored hidden array -> (its storage dtype, its scale array or None)."""
    m = c.manifest
    return {name: (d, m.scale_arrays.get(name)) for name, d in m.array_dtypes.items()}


def rel_errors(ref: Any, c: Any) -> dict[str, float]:
    """Relative RMS error of every stored array of ``c`` against the same array of the fp32 cache, all tokens.

    Sample by sample: the caches' token axes differ where their chunk sizes do (an all-fp8 cache's chunks
    hold twice the tokens)."""
    from dspark_precompute.contract.fp8 import to_float32

    assert np.array_equal(ref.source_row, c.source_row) and np.array_equal(ref.lengths(), c.lengths())
    err: dict[str, float] = {}
    den: dict[str, float] = {}
    r0, c0, n = ref.starts(), c.starts(), c.lengths()
    for i in np.argsort(c0):  # disk order: each chunk decoded once
        for name, (d, scale) in arrays_of(c).items():
            a, b = int(r0[i]), int(r0[i] + n[i])
            want = ref.chunks.read([name], a, b)[name].astype(np.float64)
            a, b = int(c0[i]), int(c0[i] + n[i])
            got = c.chunks.read([name] + ([scale] if scale else []), a, b)
            g = to_float32(got[name], d, got[scale] if scale else None).astype(np.float64)
            err[name] = err.get(name, 0.0) + float(((g - want) ** 2).sum())
            den[name] = den.get(name, 0.0) + float((want ** 2).sum())
    return {name: float(np.sqrt(err[name] / den[name])) for name in err}


def codec_bytes(c: Any, compressor: str, level: int, shuffle: str) -> int:
    """The hidden arrays of ``c`` recompressed chunk by chunk with the writer's chain under these settings."""
    from numcodecs import Blosc, Zstd

    if compressor == "zstd":
        codec: Any = Zstd(level=level)
    else:
        codec = Blosc(cname=compressor.split("_", 1)[1], clevel=level, blocksize=1 << 20,
                      shuffle={"none": Blosc.NOSHUFFLE, "byte": Blosc.SHUFFLE, "bit": Blosc.BITSHUFFLE}[shuffle])
    ct = c.chunk_tokens
    stored = sorted({k for a, b in c.chunks.unit_spans() if b > a  # format 2 stores no chunk past a
                     for k in range(int(a) // ct, (int(b) - 1) // ct + 1)})  # unit's last token
    n = 0
    for name, (_, scale) in arrays_of(c).items():
        for arr in [name] + ([scale] if scale else []):
            for a in (k * ct for k in stored):
                chunk = c.chunks.read([arr], a, a + ct)[arr]  # as stored: blosc's typesize is its itemsize
                n += len(codec.encode(np.ascontiguousarray(chunk))) + 4  # + the crc32c
    return n


def run_variant(name: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from dspark_precompute.write.run import run

    path = workdir / name
    if args.reuse and (path / "manifest.json").exists():
        from dspark_precompute import open_cache

        c = open_cache(path)
        log(f"{name}: reusing {path}")
        return {"path": str(path), "tokens": int(c.lengths().sum()), "samples": len(c),
                "seconds": (c.manifest.timing or {}).get("wall_s"), "hidden_bytes": hidden_bytes(path),
                "total_bytes": c.store.nbytes()}
    cfg = compose(tool_overrides(args.model, args.data, args.seq_length, args.rows, path, "cpu", "auto",
                                 [f"model.draft_num_hidden_layers={args.layers}", *VARIANTS[name], *args.set]))
    t0 = time.perf_counter()
    result = run(cfg)
    log(f"{name}: {result.tokens:,} tokens in {time.perf_counter() - t0:.1f}s, hidden bytes "
        f"{hidden_bytes(path):,}")
    return {"path": str(path), "tokens": result.tokens, "samples": result.samples, "seconds": result.wall_seconds,
            "hidden_bytes": hidden_bytes(path), "total_bytes": result.bytes_on_disk}


def bench(args: argparse.Namespace) -> dict[str, Any]:
    from dspark_precompute import open_cache
    from dspark_precompute.write.rerun.precision import precision_check

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench_fp8-"))
    workdir.mkdir(parents=True, exist_ok=True)
    runs = {name: run_variant(name, args, workdir) for name in VARIANTS}
    ref = open_cache(runs["fp32"]["path"])
    caches = {name: open_cache(r["path"]) for name, r in runs.items()}
    m = ref.manifest
    out: dict[str, Any] = {"machine": machine(), "args": {k: (str(v) if isinstance(v, Path) else v)
                                                          for k, v in vars(args).items()},
                           "layer_ids": m.layer_ids, "hidden_size": m.hidden_size, "target": m.target_model,
                           "num_hidden_layers": m.num_hidden_layers, "chunk_tokens": {}, "variants": {}}
    bf16_bytes = runs["bf16"]["hidden_bytes"]
    for name, r in runs.items():
        c = caches[name]
        entry: dict[str, Any] = {**r, "ratio_vs_bf16": r["hidden_bytes"] / bf16_bytes,
                                 "hidden_B_per_token": r["hidden_bytes"] / r["tokens"],
                                 "raw_hidden_B_per_token": c.manifest.bytes_per_token - 5,
                                 "chunk_tokens": c.chunk_tokens, "storage": arrays_of(c)}
        if name != "fp32":
            t0 = time.perf_counter()
            entry["rel_rms_all_tokens"] = rel_errors(ref, c)
            log(f"{name}: errors over every token in {time.perf_counter() - t0:.1f}s: "
                + ", ".join(f"{k.rsplit('/', 1)[-1]} {v:.4f}" for k, v in entry["rel_rms_all_tokens"].items()))
        if name != "fp32" and args.positions:
            t0 = time.perf_counter()
            pr = precision_check(r["path"], args.positions, seed=0, device="cpu")
            entry["precision"] = pr.to_json()
            entry["precision_problems"] = pr.problems
            entry["precision_seconds"] = time.perf_counter() - t0
            log(f"{name}: verify --precision {args.positions} in {entry['precision_seconds']:.1f}s")
        if name != "fp32":
            entry["codecs"] = {f"{comp} L{lvl} {shuf}": codec_bytes(c, comp, lvl, shuf) for comp, lvl, shuf in SWEEP}
        out["variants"][name] = entry
    if not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)
    return out


def markdown(res: dict[str, Any], command: str) -> str:
    v = res["variants"]
    mach = res["machine"]
    lines = [
        f"Target: `{res['args']['model']}` random-weight Qwen3 ({res['num_hidden_layers']} layers, hidden "
        f"{res['hidden_size']}), captured layers {res['layer_ids']} (the last one is the post-norm state); "
        f"{v['bf16']['samples']:,} samples, {v['bf16']['tokens']:,} real tokens of the shared chat mix; compute "
        f"dtype float32 on {mach['nproc']} CPU cores ({mach['cpu']}), torch {mach['torch']}, zarr {mach['zarr']}, "
        f"numcodecs {mach['numcodecs']}. Command: `{command}`.",
        "",
        "| storage | arrays (dtype) | chunk tokens | raw hidden B/token | hidden B/token on disk | **vs bf16** | "
        "rel. RMS error per array, all tokens (vs fp32) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, e in v.items():
        dtypes = ", ".join(f"{k.rsplit('/', 1)[-1]} {d}" for k, (d, _) in e["storage"].items())
        errs = ", ".join(f"{k.rsplit('/', 1)[-1]} {x:.2%}" for k, x in e.get("rel_rms_all_tokens", {}).items()) \
            or "(the reference)"
        lines.append(f"| {name} | {dtypes} | {e['chunk_tokens']:,} | {e['raw_hidden_B_per_token']:,} | "
                     f"{e['hidden_B_per_token']:,.0f} | **{e['ratio_vs_bf16']:.3f}x** | {errs} |")
    if any("precision" in e for e in v.values()):
        lines += ["", "`dspark-cache verify --precision N` on each cache (a recompute in float32 at N seeded "
                      "positions; per array: relative RMS error / worst token, and the teacher after lm_head):", "",
                  "| storage | positions | per array: rel. RMS error (worst token) | teacher top-1 agreement | "
                  "teacher TV mean / max | rel. logit error |", "|---|---|---|---|---|---|"]
        for name, e in v.items():
            p = e.get("precision")
            if not p:
                continue
            arrays = ", ".join(f"{a['layer']}: {a['rel_rms']:.2%} ({a['worst_token_rel']:.2%})" for a in p["arrays"])
            lines.append(f"| {name} | {p['positions']} | {arrays} | {p['last_top1_agreement']:.2%} | "
                         f"{p['last_tv_mean']:.2e} / {p['last_tv_max']:.2e} | {p['last_logit_rel_error']:.2%} |")
    sweep = list(next(e["codecs"] for n, e in v.items() if "codecs" in e))
    lines += ["", "A random-weight target's teacher is one-hot (the post-norm state points at the input token's "
                  "tied embedding), so top-1 and TV cannot move; the relative logit error shows what the stored "
                  "final state costs.", "",
              "Codec sweep: the stored hidden arrays (scales included) recompressed chunk by chunk with the "
              "writer's chain, every array under the same setting (the writer itself gives fp8 bits "
              "`storage.fp8_shuffle=bit` and the rest `storage.shuffle=byte`: the main table); bytes relative to "
              "the bf16 cache under the default (blosc_zstd L1 byte):", "",
              "| storage | " + " | ".join(sweep) + " |", "|---|" + "---|" * len(sweep)]
    base = v["bf16"]["codecs"]["blosc_zstd L1 byte"]
    for name, e in v.items():
        if "codecs" in e:
            lines.append(f"| {name} | " + " | ".join(f"{e['codecs'][k] / base:.3f}x" for k in sweep) + " |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="bench_mid", help="scripts/conf/model group (bench_mid: hidden 512)")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA)
    p.add_argument("--rows", type=int, default=300, help="rows of the data file (0 = all)")
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--layers", type=int, default=5, help="model.draft_num_hidden_layers (captured layers)")
    p.add_argument("--positions", type=int, default=256, help="verify --precision N (0 skips it)")
    p.add_argument("--set", action="append", default=[], help="extra Hydra overrides for every run")
    p.add_argument("--workdir", default=None)
    p.add_argument("--keep", action="store_true", help="keep the caches")
    p.add_argument("--reuse", action="store_true", help="reuse complete caches already in --workdir")
    output_args(p)
    p.add_argument("--from-json", type=Path, default=None, help="only print the tables of a saved --json run")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json:  # re-render a saved run's tables
        res = json.loads(args.from_json.read_text())
        sys.stdout.write(markdown(res, res.get("command", "python scripts/bench_fp8.py")))
        return 0
    res = bench(args)
    command = "python scripts/bench_fp8.py " + " ".join(sys.argv[1:] if argv is None else argv)
    res["command"] = command.strip()
    md = markdown(res, command.strip())
    save(args, res, md)
    sys.stdout.write(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
