"""What a cache holds, in numbers and a few lines of text (``info``, ``describe()``, notebooks).

Counts come from the manifest and tables in hand; ``summary`` also walks the store once
for the bytes on disk (``repr`` never does).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dspark_precompute.contract.commits import committed_units
from dspark_precompute.contract.spec import HIDDEN_GROUP, INPUT_IDS, LOSS_MASK, SCALE_GROUP
from dspark_precompute.humanize import human_bytes

if TYPE_CHECKING:
    from dspark_precompute.read.reader import CacheReader


def _bytes_under(c: CacheReader, prefix: str) -> int:
    if c.store.url:
        full = f"{c.store.root}/{prefix}"
        return int(sum(c.store.fs.du(full, total=False).values())) if c.store.fs.exists(full) else 0
    root = Path(c.store.root) / prefix
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file()) if root.exists() else 0

def rejects(c: CacheReader) -> dict[str, Any]:
    """Input rows that did not become samples: counts, share and counts per reason (from the manifest)."""
    counts = c.manifest.counts
    rows_in, rejected = counts.rows_in, counts.rejected
    by = dict(counts.rejected_by_reason)
    return {"rows_in": rows_in, "rejected": rejected, "rejected_fraction": rejected / rows_in if rows_in else 0.0,
            "rejected_by_reason": dict(sorted(by.items(), key=lambda kv: (-kv[1], kv[0])))}

def rejects_line(c: CacheReader) -> str:
    """``1,234 of 1,400 rows (88.1%): no_supervised_tokens=1,200, malformed_json=34``."""
    r = rejects(c)
    line = f"{r['rejected']:,} of {r['rows_in']:,} rows ({r['rejected_fraction']:.1%})"
    if r["rejected_by_reason"]:
        line += ": " + ", ".join(f"{k}={v:,}" for k, v in r["rejected_by_reason"].items())
    return line

def provenance(c: CacheReader) -> dict[str, Any]:
    """How the stored values were made and by what (the manifest's ``capture`` and ``provenance``).

    Fields a cache written before they were recorded lacks are None.
    """
    m = c.manifest
    cap, prov = m.capture, m.provenance
    mask = cap.mask if cap is not None else None
    return {
        "last_state": cap.last_state if cap else None,
        "final_norm_class": cap.final_norm_class if cap else None,
        "layer_preset": cap.layer_preset if cap else None,
        "mask_policy": dataclasses.asdict(mask) if mask is not None else None,
        "target_weights_dtype": cap.target_weights_dtype if cap else None,
        "weights_fingerprint": cap.weights_fingerprint if cap else m.identity.get("target", {}).get(
            "weights_fingerprint"),
        "fingerprint_kind": cap.fingerprint_kind if cap else m.identity.get("target", {}).get("fingerprint_kind"),
        "compute_dtype": m.identity.get("compute_dtype"),
        "argv": prov.argv if prov else None,
        "overrides": prov.overrides if prov else None,
        "versions": dict(prov.versions) if prov and prov.versions else None,
        "hosts": list(prov.hosts) if prov and prov.hosts else None,
        "world_size": prov.world_size if prov else None,
    }


def provenance_lines(c: CacheReader) -> list[str]:
    """``describe()``'s provenance lines (``not recorded`` for what an older cache lacks, ``not yet`` for the run
    record of an unfinished one)."""
    p = provenance(c)
    unknown = "not recorded"
    norm = p["final_norm_class"] or "norm class not recorded"
    last = {"post_final_norm": f"after the final norm ({norm})", "post_norm": f"after the final norm ({norm})",
            "pre_norm": f"before the final norm ({norm}) only", "both": f"after and before the final norm ({norm})"
            }.get(p["last_state"] or "", p["last_state"] or unknown)
    mask = p["mask_policy"]
    if mask:
        rule = {"generation_template": "the template's {% generation %} mask",
                "nemo_prefix": "NeMo's prefix rule",
                "deepspec": "DeepSpec's rule (content and end of turn, no header)",
                "specforge": "SpecForge's qwen-template rule (content and end of turn, no header)",
                }.get(mask["rule"], str(mask["rule"]))
        if mask.get("fallback") == "full_render_alignment":
            rule += " (turns a template rewrites are aligned in the full render)"
        masks = (f"{rule}; reasoning masked {'yes' if mask['mask_reasoning_content'] else 'no'}, generation "
                 f"prompt masked {'yes' if mask['mask_generation_prompt'] else 'no'}")
    else:
        masks = unknown
    fp = p["weights_fingerprint"]
    weights = (f"{p['target_weights_dtype'] or 'dtype ' + unknown}, computed in {p['compute_dtype'] or unknown}; "
               f"fingerprint {fp[:16] + '...' if fp else unknown} ({p['fingerprint_kind'] or unknown})")
    if p["versions"]:
        v = p["versions"]
        software = ", ".join(f"{k} {v[k]}" for k in ("dspark_precompute", "torch", "transformers", "zarr",
                                                   "numcodecs") if k in v)
        where = f"{', '.join(p['hosts'] or []) or 'host ' + unknown} (world size {p['world_size'] or '?'})"
        written = f"{software} on {where}"
    else:
        written = unknown
    command = " ".join(p["argv"]) if p["argv"] else unknown
    if not c.manifest.complete and not p["argv"] and not p["versions"]:  # recorded with the final manifest
        written = command = "not yet: recorded when the run finishes"
    return [
        f"  last state  {last}; layer preset {p['layer_preset'] or unknown}",
        f"  masks       {masks}",
        f"  weights     {weights}",
        f"  written by  {written}",
        f"  command     {command}",
    ]


def summary(c: CacheReader) -> dict[str, Any]:
    """What is in the cache and what it costs on disk (for ``info`` and notebooks; walks the store)."""
    m = c.manifest
    lengths = c.lengths()
    tokens = int(lengths.sum())
    whole = c.complete and c.max_length is None  # the manifest's counts describe exactly this view
    supervised = m.counts.supervised_tokens if whole else int(c.supervised_counts().sum())
    on_disk = c.store.nbytes()
    entries = c.store.entries()
    token_disk = sum(_bytes_under(c, p) for p in (INPUT_IDS, LOSS_MASK, HIDDEN_GROUP, SCALE_GROUP))
    raw = int(c.stored_lengths().sum()) * m.bytes_per_token  # what the token arrays hold, whatever the view cuts
    return {
        "path": c.path,
        "complete": c.complete,
        "samples": len(c),
        "tokens": tokens,
        "supervised_tokens": supervised,
        "supervised_fraction": supervised / max(1, tokens),
        "mean_length": float(lengths.mean()) if len(lengths) else 0.0,
        "max_length": int(lengths.max()) if len(lengths) else 0,
        "seq_length": c.seq_length,
        "cut_at": c.max_length,
        "cut_dropped": c.cut_dropped,
        "truncated_samples": int((c.untruncated_lengths() > lengths).sum()) if len(lengths) else 0,
        **rejects(c),
        "layer_ids": c.layer_ids,
        "hidden_size": c.hidden_size,
        "target_hidden_dim": c.hidden_size * len(c.layer_ids),
        "num_hidden_layers": m.num_hidden_layers,
        "dtype": str(c.storage_dtype),
        "last_dtype": str(m.last_storage_dtype),
        "fp8_group": (m.fp8_group or m.hidden_size) if m.scale_arrays else None,
        "chunk_tokens": c.chunk_tokens,
        "units_committed": len(committed_units(c.store, c.num_units)),
        "files": entries[0],
        "directories": entries[1],
        "format_version": m.format_version,
        "num_units": c.num_units,
        "bytes_on_disk": on_disk,
        "token_bytes_on_disk": token_disk,
        "raw_token_bytes": raw,
        "compression_ratio": (raw / token_disk) if token_disk else None,
        "target": m.target_model,
        "target_model_type": m.target_model_type,
        "target_vocab_size": m.target_vocab_size,
        **provenance(c),
    }

def _dtype_line(s: dict[str, Any]) -> str:
    """``fp8_e4m3 (a float32 scale per 128 channels; last state bf16)``, or just the dtype."""
    extra = []
    if s["fp8_group"]:
        per = "token" if s["fp8_group"] == s["hidden_size"] else f"{s['fp8_group']} channels"
        extra.append(f"a float32 scale per {per}")
    if s["last_dtype"] != s["dtype"]:
        extra.append(f"last state {s['last_dtype']}")
    return str(s["dtype"]) + (f" ({'; '.join(extra)})" if extra else "")


def describe(c: CacheReader) -> str:
    """The summary as a few aligned lines of text (``dspark-cache info``, ``print(c.describe())``)."""
    s = summary(c)
    m = c.manifest
    last = m.last_array
    last_src = next((f"layer {lid}" for lid in m.layer_ids if m.arrays[str(lid)] == last),
                    "final norm" if last else "not stored")
    pre = ", the pre-norm state too" if m.pre_norm_array else ""
    ratio = f"{s['compression_ratio']:.2f}x" if s["compression_ratio"] else "n/a"
    status = "complete" if s["complete"] else f"INCOMPLETE: {s['units_committed']}/{s['num_units']} units committed"
    lines = [
        f"dspark cache {s['path']} ({status})",
        f"  target      {s['target']} ({s['target_model_type']}), {s['num_hidden_layers']} layers, "
        f"hidden {s['hidden_size']}, vocab {s['target_vocab_size']}",
        f"  samples     {s['samples']:,}  tokens {s['tokens']:,} (mean {s['mean_length']:.1f}, max "
        f"{s['max_length']}, seq_length {s['seq_length']}; {s['truncated_samples']} truncated)",
        *([f"  cut         read at max_length {s['cut_at']}: {s['cut_dropped']:,} samples dropped (no supervised "
           "token left within it); the counts above and below are the cut view's"] if s["cut_at"] else []),
        f"  rejected    {rejects_line(c)}",
        f"  supervised  {s['supervised_tokens']:,} tokens ({s['supervised_fraction']:.1%})",
        f"  layers      {s['layer_ids']} -> target_hidden_states [T, {s['target_hidden_dim']}], "
        f"target_last_hidden_states [T, {s['hidden_size']}] ({last_src}{pre})",
        f"  storage     {_dtype_line(s)}, format {s['format_version']}: {s['chunk_tokens']} tokens per chunk, "
        f"{s['num_units']} unit(s) (a shard each per array); {s['files']:,} files, {s['directories']:,} directories",
        f"  on disk     {human_bytes(s['bytes_on_disk'])} (token arrays {human_bytes(s['token_bytes_on_disk'])}"
        f" = {ratio} compression of {human_bytes(s['raw_token_bytes'])})",
        *provenance_lines(c),
    ]
    return "\n".join(lines)
