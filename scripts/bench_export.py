"""Export throughput and memory, every trainer's layout side by side, one run.

    python scripts/bench_export.py                           # bench_mid cache of 200 chat rows under /tmp
    python scripts/bench_export.py --rows 400 --repeats 5 --markdown export.md --json export.json

One cache (``scripts/conf/model/bench_mid.yaml``: random Qwen3, hidden 512, 12 layers, 5
captured, Qwen3's tokenizer) over the first ``--rows`` rows of the shared chat mix at
``--seq-length``. Each export (``nemo``, ``deepspec``, ``specforge``, ``speculators``) runs
in its own process so its peak RSS is its own (``VmHWM`` of that process); the order of the
targets rotates in every repeat and the medians over the repeats are reported, since this
machine is shared and noisy: compare the ratios, not the absolute numbers. *Written GB/s* is
the bytes the export put on disk over its wall time; *read GB/s* is the cache's decoded bytes
per token (ids, mask, the exported states) times the tokens exported, over the same time.

The cache is written with ``capture.last_state=both`` (the post-norm and the pre-norm last
state), so every export reads what it would from a user's cache: speculators the pre-norm one.
Nothing here asserts a time; tests never do.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchlib import DEFAULT_DATA, build_cache, dir_bytes, log, md_table, median, output_args, rotated, save

TARGETS = ("nemo", "deepspec", "specforge", "speculators")

# run in a child process: one export, its result as JSON on stdout
CHILD = r"""
import json, sys
cache, out, to = sys.argv[1], sys.argv[2], sys.argv[3]
from dspark_precompute.read.export import export
r = export(cache, out, to=to, progress=False)
# VmHWM: this process's own peak (ru_maxrss would carry the forking parent's over exec)
hwm = next(int(x.split()[1]) for x in open("/proc/self/status") if x.startswith("VmHWM:")) * 1024
print(json.dumps({"samples": r.num_samples, "bytes": r.bytes_written, "seconds": r.seconds, "files": r.num_shards,
                  "peak_rss": hwm}))
"""


def run_one(cache: Path, out: Path, to: str) -> dict[str, Any]:
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(cache), str(out), to], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    stdout, stderr = proc.stdout.read(), proc.stderr.read()  # type: ignore[union-attr]
    proc.stdout.close(), proc.stderr.close()  # type: ignore[union-attr]
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"export {to} failed:\n{stderr[-3000:]}")
    r = json.loads(stdout.strip().splitlines()[-1])
    r.update(wall=wall, cpu=usage.ru_utime + usage.ru_stime, on_disk=dir_bytes(out))
    shutil.rmtree(out, ignore_errors=True)
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", type=Path, default=Path("/tmp/dspark_bench_export/cache"))
    ap.add_argument("--target", default="bench_mid", help="model group of the cache built when --cache is absent")
    ap.add_argument("--data", default=str(DEFAULT_DATA), help="data.path, or 'embedded'")
    ap.add_argument("--seq-length", type=int, default=1024)
    ap.add_argument("--rows", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--to", default=",".join(TARGETS))
    ap.add_argument("--out", type=Path, default=None, help="where exports go (default: beside the cache)")
    output_args(ap)
    args = ap.parse_args()

    from dspark_precompute import open_cache

    if not (args.cache / "manifest.json").exists():
        # speculators trains on the pre-norm state, the others the post-norm
        build_cache(args.cache, args.target, args.data, args.seq_length, args.rows, ["capture.last_state=both"])
    c = open_cache(args.cache)
    tokens = int(c.lengths().sum())
    per_token = 5 + c.hidden_size * 2 * (len(c.layer_ids) + 1)  # ids, mask, the layers and the last state, bf16
    cache_bytes = dir_bytes(args.cache)
    targets = [t for t in args.to.split(",") if t]
    out_root = args.out or args.cache.parent / "exports"
    out_root.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict[str, Any]]] = {t: [] for t in targets}
    for rep in range(args.repeats):
        for to in rotated(targets, rep):
            r = run_one(args.cache, out_root / to, to)
            runs[to].append(r)
            log(f"repeat {rep + 1}/{args.repeats} {to}: {r['seconds']:.2f}s, {r['bytes'] / 1e6:.0f} MB, "
                f"peak RSS {r['peak_rss'] / 2**20:.0f} MiB")

    table = {}
    for to, rs in runs.items():
        secs = median([r["seconds"] for r in rs])
        table[to] = {
            "seconds": secs, "wall_seconds": median([r["wall"] for r in rs]),
            "cpu_seconds": median([r["cpu"] for r in rs]),
            "bytes": rs[0]["bytes"], "on_disk": rs[0]["on_disk"], "files": rs[0]["files"],
            "samples": rs[0]["samples"], "written_gb_s": median([r["bytes"] / r["seconds"] / 1e9 for r in rs]),
            "read_gb_s": median([tokens * per_token / r["seconds"] / 1e9 for r in rs]),
            "peak_rss_mib": median([r["peak_rss"] / 2**20 for r in rs]),
        }
    base = table.get("nemo")
    out = {
        "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
        f"{platform.python_implementation()} {platform.python_version()}", "load_1min": os.getloadavg()[0],
        "cache": {"path": str(args.cache), "samples": len(c), "tokens": tokens, "hidden": c.hidden_size,
                  "layers": c.layer_ids, "bytes_on_disk": cache_bytes, "decoded_bytes_per_token": per_token},
        "repeats": args.repeats, "exports": table,
    }
    lines = [f"Cache: {len(c)} samples, {tokens:,} tokens, hidden {c.hidden_size}, layers {c.layer_ids}, "
             f"{cache_bytes / 1e6:.0f} MB on disk ({per_token:,} B/token decoded). {out['machine']}, "
             f"{out['date']}, load {out['load_1min']:.1f}; medians of {args.repeats} alternating repeats.", ""]
    lines += md_table(["export", "files", "written", "median s", "written GB/s", "read GB/s", "x nemo time",
                       "peak RSS"],
                      ([to, f"{t['files']:,}", f"{t['bytes'] / 1e6:,.0f} MB", f"{t['seconds']:.2f}",
                        f"{t['written_gb_s']:.2f}", f"{t['read_gb_s']:.2f}",
                        f"{t['seconds'] / base['seconds']:.2f}x" if base else "-", f"{t['peak_rss_mib']:.0f} MiB"]
                       for to, t in table.items()), spaced_rule=True)
    text = "\n".join(lines) + "\n"
    sys.stdout.write(text)
    save(args, out, text)


if __name__ == "__main__":
    main()
