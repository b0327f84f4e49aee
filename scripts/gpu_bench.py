#!/usr/bin/env python
"""GPU benchmark: the tool end to end vs the bare forward vs the padded full-logits method, at real shapes.

Run by ``scripts/gpu_bench.sh`` (which installs the carried wheels first). For each shape
(random-weight Qwen3-0.6B and Qwen3-8B geometry, bf16, saved as a real local checkpoint with
Qwen3's real tokenizer, so the tool loads it through its ordinary ``model.path`` code), over
``mix.messages.jsonl`` at ``seq_length`` 2048:

1. ``limit``    the bare decoder forward over the tool's own batches (model already loaded);
2. ``tool``     ``run(cfg)`` end to end with ``storage.writers=1`` and with every core;
3. ``padded``   the reference method (NeMo AutoModel ``precompute_dspark``: padded batches of
               4, full CausalLM forward with vocabulary logits, synchronous shards), on the
               first ``--padded-rows`` rows and compared per real token;
4. accuracy     a few stored samples against an fp32 recompute of the same rows on the CPU:
               relative RMS error per captured layer and the teacher's top-1 agreement
               (``lm_head`` of the stored final state vs of the fp32 final state).

One repeat per method (the device time is short); forward and tool are timed after a warm-up.
Writes one JSON (``--out``) with tokens/s, GB/s of hidden states and the ratios, and prints a
markdown table. ``--shapes tiny --device cpu`` proves the whole script on a CPU in a minute.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import bench  # (scripts/bench.py: the limit, the padded method, case preparation)
import benchlib
from benchlib import logger

SHAPES: dict[str, dict[str, Any]] = {  # Qwen3 geometries (config.json of the public checkpoints)
    "tiny": dict(hidden_size=64, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 intermediate_size=128, tie_word_embeddings=True),
    "qwen3-0.6b": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, intermediate_size=3072, tie_word_embeddings=True),
    "qwen3-8b": dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, intermediate_size=12288, tie_word_embeddings=False),
}


log = logger("gpu-bench", clock=True)


def build_checkpoint(shape: str, tokenizer_dir: Path, out: Path, device: str, seed: int = 0) -> float:
    """A random-weight Qwen3 of ``shape`` in bf16, saved as safetensors with the tokenizer beside it."""
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = Qwen3Config(vocab_size=151936, max_position_embeddings=40960, rms_norm_eps=1e-6,
                         rope_theta=1000000.0, **SHAPES[shape])
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():  # the default init (std 0.02) makes a random net nearly constant
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 1.0 if "embed" in name else 0.5 / p.shape[-1] ** 0.5)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return time.perf_counter() - t0


def hidden_bytes_per_token(case: Any) -> int:
    arrays = len(case.info["layer_ids"]) + (0 if case.info["num_layers"] - 1 in case.info["layer_ids"] else 1)
    return arrays * case.info["hidden_size"] * 2


def accuracy(cache: Path, ckpt: Path, samples: int, max_tokens: int) -> dict[str, Any]:
    """Stored bf16 states (GPU, bf16 compute) vs an fp32 recompute of the same rows on the CPU."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from dspark_precompute import open_cache

    c = open_cache(str(cache))
    lengths = np.asarray(c.lengths())
    short = np.flatnonzero(lengths <= max_tokens)  # the CPU forward stays short
    pool = short if len(short) else np.argsort(lengths)[:1]
    pick = sorted(int(i) for i in np.random.default_rng(0).choice(pool, min(samples, len(pool)), replace=False))
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    head = model.get_output_embeddings()
    layer_ids = list(c.layer_ids)
    H = c.hidden_size
    err: dict[str, list[float]] = {str(lid): [] for lid in layer_ids}
    err["final_norm"] = []
    agree = total = 0
    tv: list[float] = []
    with torch.no_grad():
        for i in pick:
            s = c[i]
            hs = model(input_ids=s["input_ids"][None], output_hidden_states=True).hidden_states
            for j, lid in enumerate(layer_ids):
                want = hs[lid + 1][0]
                got = s["target_hidden_states"][:, j * H:(j + 1) * H].float()
                err[str(lid)].append(float((got - want).norm() / want.norm()))
            want_last, got_last = hs[-1][0], s["target_last_hidden_states"].float()
            err["final_norm"].append(float((got_last - want_last).norm() / want_last.norm()))
            t_logits, s_logits = head(want_last), head(got_last)
            agree += int((t_logits.argmax(-1) == s_logits.argmax(-1)).sum())
            total += len(want_last)
            tv.append(float(0.5 * (t_logits.softmax(-1) - s_logits.softmax(-1)).abs().sum(-1).mean()))
    del model
    gc.collect()
    return {"samples": pick, "tokens": total, "rel_rms_error": {k: float(np.mean(v)) for k, v in err.items()},
            "teacher_top1_agreement": agree / max(total, 1), "teacher_total_variation": float(np.mean(tv))}


def bench_shape(shape: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import torch

    ckpt = work / f"{shape}-ckpt"
    log(f"== {shape}: building a random bf16 checkpoint")
    build_s = build_checkpoint(shape, args.tokenizer, ckpt, "cuda" if args.device.startswith("cuda") else "cpu")
    extra = [f"model.path={ckpt}", f"model.tokenizer={ckpt}", "model.fingerprint=full", *args.set]
    dtype = args.dtype
    case = bench.make_case("hf", args.seq, args.rows or None, args.data, work / "prep", args.device, dtype, extra)
    log("   " + json.dumps(case.info))
    model = bench.load_model(case)
    inputs = bench.limit_inputs(case)
    bench.run_limit(model, inputs[:3], case.plan.device)  # warm-up
    limit = bench.run_limit(model, inputs, case.plan.device)
    log(f"   limit {limit['wall_s']:.2f} s")
    del inputs, model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    cores = os.cpu_count() or 1
    tools: dict[str, Any] = {}
    all_writers = max(1, cores - 1)  # every core but the forward loop's
    for label, writers in (("writers_1", 1), ("writers_all", all_writers)):
        path = work / f"{shape}-{label}"
        shutil.rmtree(path, ignore_errors=True)
        c2 = dataclasses.replace(case, overrides=[*case.overrides, f"storage.writers={writers}"])
        r = bench.run_tool(c2, path)
        r["writers"] = writers
        tools[label] = r
        log(f"   tool {label} {r['wall_s']:.2f} s (forward+write {r['timing'].get('forward_write_s', 0):.2f} s)")
        if label != "writers_1":
            keep = path
        else:
            shutil.rmtree(path, ignore_errors=True)
    acc = accuracy(keep, ckpt, args.check_samples, args.check_tokens) if args.check_samples else None
    shutil.rmtree(keep, ignore_errors=True)
    padded = None
    if args.padded_rows:
        pcase = bench.make_case("hf", args.seq, args.padded_rows, args.data, work / "prep-padded", args.device, dtype,
                                extra)
        padded = bench.run_padded(pcase, work / f"{shape}-padded")
        padded["tokens"] = pcase.tokens
        shutil.rmtree(work / f"{shape}-padded", ignore_errors=True)
        log(f"   padded {padded['wall_s']:.2f} s over {pcase.tokens} real tokens")
    shutil.rmtree(ckpt, ignore_errors=True)
    tokens, bpt = case.tokens, hidden_bytes_per_token(case)
    out: dict[str, Any] = {"shape": shape, "info": case.info, "build_checkpoint_s": build_s,
                           "limit": {**limit, "tok_s": tokens / limit["wall_s"],
                                     "hidden_gb_s": tokens * bpt / limit["wall_s"] / 1e9}}
    for label, r in tools.items():
        fw = r["timing"].get("forward_write_s", r["wall_s"])
        out[f"tool_{label}"] = {**r, "tok_s": tokens / r["wall_s"], "forward_write_tok_s": tokens / fw,
                                "hidden_gb_s": tokens * bpt / fw / 1e9,
                                "forward_write_vs_limit": limit["wall_s"] / fw,
                                "end_to_end_vs_limit": limit["wall_s"] / r["wall_s"]}
    if padded:
        padded["tok_s"] = padded["tokens"] / padded["wall_s"]
        out["padded"] = padded
        for label in tools:
            out[f"tool_{label}"]["vs_padded_per_token"] = out[f"tool_{label}"]["tok_s"] / padded["tok_s"]
    if acc:
        out["accuracy"] = acc
    return out


def markdown(results: list[dict[str, Any]]) -> str:
    rows = ["| shape | real tokens | limit tok/s | tool (1 writer) fwd+write / limit | tool (all) fwd+write / limit | "
            "tool (all) end to end / limit | tool (all) hidden GB/s | tool / padded per token | worst layer rel RMS | "
            "teacher top-1 |", "|" + "---|" * 10]
    for r in results:
        all_ = r["tool_writers_all"]
        acc = r.get("accuracy") or {}
        worst = max(acc.get("rel_rms_error", {"-": float("nan")}).values())
        rows.append(f"| {r['shape']} | {r['info']['tokens']:,} | {r['limit']['tok_s']:,.0f} | "
                    f"{r['tool_writers_1']['forward_write_vs_limit']:.2f}x | {all_['forward_write_vs_limit']:.2f}x | "
                    f"{all_['end_to_end_vs_limit']:.2f}x | {all_['hidden_gb_s']:.2f} | "
                    f"{all_.get('vs_padded_per_token', float('nan')):.1f}x | {worst:.4f} | "
                    f"{acc.get('teacher_top1_agreement', float('nan')):.4f} |")
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="qwen3-0.6b,qwen3-8b", help=f"comma list of {list(SHAPES)}")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--rows", type=int, default=0, help="rows of the data file for the tool and the limit (0 = all)")
    p.add_argument("--padded-rows", type=int, default=256, help="rows for the padded method (0 = skip it)")
    p.add_argument("--check-samples", type=int, default=4, help="samples recomputed in fp32 on the CPU (0 = skip)")
    p.add_argument("--check-tokens", type=int, default=512, help="longest sample the fp32 check picks")
    p.add_argument("--data", type=Path, required=True)
    p.add_argument("--tokenizer", type=Path, required=True)
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra override for the tool")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="dspark-gpu-bench-")) if args.workdir is None else args.workdir
    work.mkdir(parents=True, exist_ok=True)
    import torch

    results: dict[str, Any] = {"command": " ".join(["python", *sys.argv]), "machine": benchlib.machine(),
                               "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                               "cores": os.cpu_count(), "shapes": []}
    t0 = time.perf_counter()
    try:
        for shape in [s for s in args.shapes.split(",") if s]:
            results["shapes"].append(bench_shape(shape, args, work))
            args.out.write_text(json.dumps(results, indent=2, default=str) + "\n")  # partial results survive
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    results["wall_s"] = time.perf_counter() - t0
    results["markdown"] = markdown(results["shapes"])
    args.out.write_text(json.dumps(results, indent=2, default=str) + "\n")
    sys.stdout.write(results["markdown"])
    log(f"done in {results['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
