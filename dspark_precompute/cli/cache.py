"""``dspark-cache``: inspect, verify, export and plot caches from the shell.

::

    dspark-cache info PATH [--json]
    dspark-cache verify PATH [--recompute N] [--teacher N] [--precision N] [--repair]
    dspark-cache export CACHE OUT --to nemo|deepspec|specforge|speculators [--layers ...] [--max-length L]
    dspark-cache export-nemo CACHE OUT [--shard-size 256] [--overwrite]     (the same as export --to nemo)
    dspark-cache plot PATH -o report.png

Exit status: 0 success, 1 ``verify`` found problems, 2 the command could not run (the
message on stderr says why and what to do).
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from dspark_precompute import signals
from dspark_precompute.errors import DsparkError, ExportError, StoppedBySignal

log = logging.getLogger("dspark_precompute")


def _out(text: str) -> None:
    sys.stdout.write(text if text.endswith("\n") else text + "\n")


def _layers(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--layers={text!r} must be comma-separated layer ids, e.g. 1,14,27") from None


def _info(args: argparse.Namespace) -> int:
    from dspark_precompute.contract.commits import committed_units
    from dspark_precompute.contract.store import CacheStore
    from dspark_precompute.contract.window import StreamRecord, WindowStatus
    from dspark_precompute.read.reader import open_cache

    streamed = StreamRecord.read(CacheStore(args.path)) is not None  # a stream's released units are no damage
    c = open_cache(args.path, allow_incomplete=args.allow_incomplete or streamed)
    n = c.num_units
    window = WindowStatus.read(c.store, committed_units(c.store, n), n) if streamed else None
    if args.json:
        summary = c.summary()
        if window is not None:
            summary["window"] = {"units": window.window.units, "mib": window.window.mib, "captured": window.captured,
                                 "released": window.released, "resident": window.resident,
                                 "trainer": None if window.trainer is None else window.trainer.group,
                                 "position": {str(r): k for r, k in window.position.items()}}
        _out(json.dumps(summary, indent=2, sort_keys=True, default=str))
    else:
        _out(c.describe() + ("" if window is None else "\n" + "\n".join(window.lines(n))))
    return 0


def _rerun(report: Any, check: str, run: Callable[[], Any]) -> Any | None:
    """Run a check that reruns the target unless the structure or offsets are broken; its problems, notes and
    time go into the report, and its result comes back (None when skipped)."""
    from dspark_precompute.read.verify import Problem

    if any(p.check in ("structure", "offsets") for p in report.problems):
        report.problems.append(Problem(check, "skipped: the cache's structure or offsets are broken, fix those first"))
        return None
    t0 = time.perf_counter()
    r = run()
    report.problems += [Problem(**p) for p in r.problems]
    report.notes += r.notes
    report.seconds += time.perf_counter() - t0
    return r


def _verify(args: argparse.Namespace) -> int:
    from dspark_precompute.read.verify import mark_for_recompute, verify_cache

    report = verify_cache(args.path, allow_incomplete=args.allow_incomplete)
    common = {"seed": args.seed, "device": args.device, "model": args.model,
              "trust_remote_code": args.trust_remote_code}
    if args.recompute > 0:
        from dspark_precompute.write.rerun.recompute import recompute

        r = _rerun(report, "recompute", lambda: recompute(args.path, args.recompute, tolerance=args.tolerance,
                                                          **common))
        if r is not None:
            report.recomputed, report.recompute_exact, report.recompute_max_steps = r.recomputed, r.exact, r.max_steps
    if args.teacher > 0:
        from dspark_precompute.write.rerun.teacher import teacher_check

        t = _rerun(report, "teacher", lambda: teacher_check(
            args.path, args.teacher, min_top1=args.teacher_min_top1, max_tv=args.teacher_max_tv,
            max_rel=args.teacher_max_rel, **common))
        if t is not None:
            report.teacher_positions, report.teacher_samples = len(t.positions), t.samples
            report.teacher_top1, report.teacher_max_logit_diff = t.top1_agreement, t.max_logit_diff
            report.teacher_tv_mean, report.teacher_tv_max = t.tv_mean, t.tv_max
            report.teacher_rel_error_mean, report.teacher_rel_error_max = t.rel_error_mean, t.rel_error_max
    if args.precision > 0:
        from dspark_precompute.write.rerun.precision import precision_check

        pr = _rerun(report, "precision", lambda: precision_check(
            args.path, args.precision, max_rel_rms=args.precision_max_rel_rms, min_top1=args.teacher_min_top1,
            max_tv=args.teacher_max_tv, **common))
        if pr is not None:
            report.precision = pr.to_json()
    if args.json:
        _out(json.dumps({"ok": report.ok, "path": report.path, "samples": report.samples, "tokens": report.tokens,
                         "chunks_checked": report.chunks_checked, "recomputed": report.recomputed,
                         "recompute_exact": report.recompute_exact,
                         "recompute_max_steps": report.recompute_max_steps, "teacher": report.teacher_json(),
                         "precision": report.precision,
                         "notes": report.notes,
                         "problems": [p.__dict__ for p in report.problems]}, indent=2, default=list))
    else:
        _out(report.format())
    if args.repair and not report.ok:
        units = report.damaged_units()
        rest = [p for p in report.problems if p.unit is None]
        if units:
            tokens = any(p.array in ("input_ids", "loss_mask") for p in report.problems if p.unit is not None)
            removed = mark_for_recompute(args.path, units, retokenize=tokens)
            _out(f"repair: units {units} marked for recomputation ({len(removed)} commit record(s) removed, manifest "
                 "set incomplete" + ("; token ids and masks to be written again" if tokens else "") + "). Re-run "
                 f"the precompute command that wrote this cache (same overrides, storage.path={args.path}) to "
                 "rewrite exactly those units, then verify again.")
        if rest:
            _out(f"repair: {len(rest)} problem(s) are not confined to a unit (manifest, tables, weights); they need "
                 "the cache re-created (re-run the precompute command with overwrite=true).")
    return 0 if report.ok else 1


def _dropped(r: Any) -> str:
    lines = [f"left out {k} sample(s): {why} (max_length={r.max_length})" for why, k in sorted(r.dropped.items())]
    lines += [f"note: {n}" for n in r.notes]
    return "".join(line + "\n" for line in lines)


_USE = {
    "nemo": "recipe_args.cached_target_path={path}",
    "deepspec": "data.target_cache_path={path} (its model.target_layer_ids, hidden size and "
                "model.target_model_name_or_path must equal the manifest's)",
    "specforge": "training.strategy=dspark, data.hidden_states_path={path}",
    "speculators": "ArrowDataset(max_len, \"{path}\") / --data-path {path}",
}


def _export_to(args: argparse.Namespace) -> int:
    from dspark_precompute.read.export import export

    options: dict[str, Any] = {"layers": args.layers, "max_length": args.max_length, "overwrite": args.overwrite,
                               "skip_image_rows": args.skip_image_rows}
    if args.to == "nemo":
        options["shard_size"] = args.shard_size
    if args.to == "deepspec":
        if args.shard_bytes is not None:
            options["shard_bytes"] = args.shard_bytes
        options["target_model_name_or_path"] = args.target_name
    elif args.target_name is not None:
        raise ExportError("--target-name applies to --to deepspec only (the name its trainer compares)")
    r = export(args.cache, args.out, to=args.to, **options)
    _out(f"exported {r.num_samples} samples ({r.target}, layers {r.layers}) in {r.num_shards} file(s), "
         f"{r.bytes_written / 1e6:.1f} MB, to {r.path} in {r.seconds:.1f}s\n" + _dropped(r)
         + "use it with: " + _USE[r.target].format(path=r.path))
    return 0


def _plot(args: argparse.Namespace) -> int:
    from dspark_precompute.read.plot import plot_cache

    plot_cache(args.path, args.output, max_samples=args.max_samples, seed=args.seed,
               allow_incomplete=args.allow_incomplete)
    _out(f"wrote {args.output}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dspark-cache", description="Inspect, verify, export and plot dspark-precompute "
                                                                  "hidden-state caches.")
    p.add_argument("-v", "--verbose", action="store_true", help="log progress (INFO) to stderr")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser("info", help="print a cache's summary")
    _info_options(s)
    s.set_defaults(fn=_info)

    s = sub.add_parser("verify", help="check structure, offsets, counts and every chunk's checksum")
    _verify_options(s)
    s.set_defaults(fn=_verify)

    s = sub.add_parser("export", help="write the layout a DSpark / EAGLE-3 trainer reads (NeMo, DeepSpec, "
                                      "SpecForge, vLLM speculators)")
    _export_options(s)
    s.set_defaults(fn=_export_to)

    s = sub.add_parser("export-nemo", help="write NeMo AutoModel's DSpark offline cache layout (the same as "
                                           "export --to nemo)")
    _export_nemo_options(s)
    s.set_defaults(fn=_export_to, to="nemo", shard_bytes=None, target_name=None)

    s = sub.add_parser("plot", help="length histogram, supervised fraction and per-layer RMS as one image")
    _plot_options(s)
    s.set_defaults(fn=_plot)
    return p


def _info_options(s: argparse.ArgumentParser) -> None:
    """``info PATH``: the summary, or its JSON."""
    s.add_argument("path", help="cache directory or fsspec URL")
    s.add_argument("--json", action="store_true", help="machine-readable summary")
    s.add_argument("--allow-incomplete", action="store_true", help="describe the committed part of an unfinished cache")


def _verify_options(s: argparse.ArgumentParser) -> None:
    """``verify PATH``: the reruns of the target beyond the structure and checksum checks, their bounds,
    the target to rerun, repair."""
    s.add_argument("path")
    s.add_argument("--recompute", type=int, default=0, metavar="N",
                   help="reload the target and recompute N random samples (needs the target and data)")
    s.add_argument("--teacher", type=int, default=0, metavar="N",
                   help="reload the target and compare its own logits with lm_head applied to the stored final state "
                        "at N sampled positions (top-1 agreement, logit difference, total variation); needs the "
                        "target, and on an image cache the data too (its rows name the images fed again)")
    s.add_argument("--teacher-min-top1", type=float, default=0.95, metavar="SHARE",
                   help="--teacher fails below this top-1 agreement (default 0.95)")
    s.add_argument("--teacher-max-tv", type=float, default=0.1, metavar="TV",
                   help="--teacher fails above this mean total-variation distance (default 0.1)")
    s.add_argument("--teacher-max-rel", type=float, default=None, metavar="ERR",
                   help="--teacher fails above this mean relative logit error (default: 4 steps of the storage and "
                        "compute dtypes, 0.031 for bf16 storage of an fp32 forward)")
    s.add_argument("--precision", type=int, default=0, metavar="N",
                   help="reload the target, recompute N sampled token positions and report what the storage dtype "
                        "costs: relative RMS error per stored array, the worst token, and for the final state the "
                        "teacher's (lm_head) top-1 agreement and total-variation distance; needs what --teacher "
                        "does")
    s.add_argument("--precision-max-rel-rms", type=float, default=0.05, metavar="ERR",
                   help="--precision fails above this relative RMS error of any array (default 0.05); its final-state "
                        "check uses --teacher-min-top1 and --teacher-max-tv")
    s.add_argument("--seed", type=int, default=0,
                   help="which samples --recompute and positions --teacher / --precision pick")
    s.add_argument("--tolerance", type=float, default=1.0,
                   help="largest allowed difference, in steps of the storage dtype (default 1)")
    s.add_argument("--device", default=None,
                   help="device for --recompute, --teacher and --precision (default: the manifest's model.device)")
    s.add_argument("--model", default=None, metavar="PATH",
                   help="target for --recompute, --teacher and --precision (default: the path recorded in the "
                        "manifest)")
    s.add_argument("--trust-remote-code", action="store_true",
                   help="let --recompute / --teacher run code shipped with the target checkpoint (never taken from "
                        "the cache)")
    s.add_argument("--allow-incomplete", action="store_true", help="check the committed part of an unfinished cache")
    s.add_argument("--repair", action="store_true",
                   help="mark damaged units for recomputation by the next run of the precompute command")
    s.add_argument("--json", action="store_true")


def _export_options(s: argparse.ArgumentParser) -> None:
    """``export CACHE OUT --to TRAINER``: the layout, the samples and layers written, each trainer's own options."""
    s.add_argument("cache")
    s.add_argument("out", help="output directory (created; must be empty or hold a previous export)")
    s.add_argument("--to", required=True, choices=("nemo", "deepspec", "specforge", "speculators"),
                   help="the trainer whose layout to write")
    s.add_argument("--layers", type=_layers, default=None, help="export only these captured layer ids, e.g. 1,14,27")
    s.add_argument("--max-length", type=int, default=None, metavar="L",
                   help="cut every sample at L tokens; samples left with no supervised token are left out (counted)")
    s.add_argument("--overwrite", action="store_true", help="replace a previous export in OUT")
    s.add_argument("--skip-image-rows", action="store_true",
                   help="leave out the rows with images whose positions an M-RoPE target (Qwen3-VL, Qwen3.5) moved: "
                        "every trainer here builds positions 0, 1, 2, ... (docs/trainers.md); the count left out is "
                        "recorded in the export's marker")
    s.add_argument("--shard-size", type=int, default=256, help="nemo: samples per shard (NeMo's default 256)")
    s.add_argument("--shard-bytes", type=int, default=None,
                   help="deepspec: bytes per shard file (DeepSpec's default 64 GiB)")
    s.add_argument("--target-name", default=None, metavar="NAME",
                   help="deepspec: target_model_name_or_path to record, which DeepSpec's trainer compares with its "
                        "config (default: the model.path the cache was made with)")


def _export_nemo_options(s: argparse.ArgumentParser) -> None:
    """``export-nemo CACHE OUT``: NeMo's layout, its shard size, the samples and layers written."""
    s.add_argument("cache")
    s.add_argument("out", help="output directory (use as recipe_args.cached_target_path)")
    s.add_argument("--shard-size", type=int, default=256, help="samples per shard (NeMo's default 256)")
    s.add_argument("--layers", type=_layers, default=None, help="export only these captured layer ids, e.g. 1,14,27")
    s.add_argument("--max-length", type=int, default=None, metavar="L",
                   help="cut every sample (and the padding) at L tokens; samples left with no supervised token are "
                        "left out (counted)")
    s.add_argument("--overwrite", action="store_true", help="replace a previous export in OUT")
    s.add_argument("--skip-image-rows", action="store_true",
                   help="leave out the rows with images whose positions an M-RoPE target moved (NeMo builds "
                        "positions 0, 1, 2, ...); the count left out is in the marker")


def _plot_options(s: argparse.ArgumentParser) -> None:
    """``plot PATH -o FILE``: the image and the samples its RMS panel reads."""
    s.add_argument("path")
    s.add_argument("-o", "--output", required=True, help="image file (png, svg, pdf)")
    s.add_argument("--max-samples", type=int, default=64, help="samples used for the RMS panel")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--allow-incomplete", action="store_true")


def main(argv: Sequence[str] | None = None) -> int:
    """The command, callable in-process: the signal handlers are in place from its first line to its last."""
    previous: dict[int, Any] = {}
    command = "dspark-cache"
    try:
        previous = signals.install()  # before the arguments are read and any command's imports run
        args = build_parser().parse_args(argv)
        command = f"dspark-cache {args.command}"
        if not logging.getLogger().handlers and not log.handlers:
            h = logging.StreamHandler(sys.stderr)
            h.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
            log.addHandler(h)
        log.setLevel(logging.INFO if args.verbose else logging.WARNING)
        return int(args.fn(args))
    except StoppedBySignal as exc:  # Ctrl-C: files are written under temporary names, renamed when whole
        sys.stderr.write(f"{command}: stopped by {signal.Signals(exc.signum).name}; no file was "
                         "left half-written\n")
        return exc.exit_code
    except DsparkError as exc:
        sys.stderr.write(f"{command}: {exc}\n")
        return exc.exit_code
    except ValueError as exc:  # bad arguments surfaced by the library (layer ids, shard size, ...)
        sys.stderr.write(f"{command}: {exc}\n")
        return 2
    except OSError as exc:  # the library types the writes it makes; this is any other (a cache that cannot be read)
        sys.stderr.write(f"{command}: {exc}. Check that path: it exists, its permissions, the "
                         "disk under it\n")
        return 2
    except KeyboardInterrupt:  # the caller's handler, before ours were installed
        sys.stderr.write(f"{command}: stopped by SIGINT; no file was left half-written\n")
        return 130
    finally:
        signals.restore(previous)


def console() -> None:
    """The ``dspark-cache`` command: ``main`` (also callable in-process), then exit.

    Once the command is over, a Ctrl-C or SIGTERM while the interpreter shuts down ends the
    process at once instead of printing a KeyboardInterrupt from an exit hook.
    """
    try:
        signals.install()  # main puts these back when it returns: a signal then is still one line
        code = main()
        signals.exiting()
    except (StoppedBySignal, KeyboardInterrupt) as exc:  # between main's return and exiting()
        code = getattr(exc, "exit_code", 130)
    sys.exit(code)


if __name__ == "__main__":
    console()
