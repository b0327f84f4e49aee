"""What a cache holds, in numbers and a few lines of text (``info``, ``describe()``, notebooks).

Counts come from the manifest and tables in hand; ``summary`` also walks the store once
for the bytes on disk (``repr`` never does).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from dspark_precompute.contract.spec import HIDDEN_GROUP, INPUT_IDS, LOSS_MASK
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

def summary(c: CacheReader) -> dict[str, Any]:
    """What is in the cache and what it costs on disk (for ``info`` and notebooks; walks the store)."""
    m = c.manifest
    lengths = c.lengths()
    tokens = int(lengths.sum())
    supervised = m.counts.supervised_tokens if c.complete else int(c.supervised_counts().sum())
    on_disk = c.store.nbytes()
    token_disk = sum(_bytes_under(c, p) for p in (INPUT_IDS, LOSS_MASK, HIDDEN_GROUP))
    raw = tokens * m.bytes_per_token
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
        "truncated_samples": int((c.untruncated_lengths() > lengths).sum()) if len(lengths) else 0,
        **rejects(c),
        "layer_ids": c.layer_ids,
        "hidden_size": c.hidden_size,
        "target_hidden_dim": c.hidden_size * len(c.layer_ids),
        "num_hidden_layers": m.num_hidden_layers,
        "dtype": c.storage_dtype,
        "chunk_tokens": c.chunk_tokens,
        "units_committed": len(c._committed_units()),
        "num_units": c.num_units,
        "bytes_on_disk": on_disk,
        "token_bytes_on_disk": token_disk,
        "raw_token_bytes": raw,
        "compression_ratio": (raw / token_disk) if token_disk else None,
        "target": m.target_model,
        "target_model_type": m.target_model_type,
        "target_vocab_size": m.target_vocab_size,
    }

def describe(c: CacheReader) -> str:
    """The summary as a few aligned lines of text (``dspark-cache info``, ``print(c.describe())``)."""
    s = summary(c)
    m = c.manifest
    last = m.last_array
    last_src = next((f"layer {lid}" for lid in m.layer_ids if m.arrays[str(lid)] == last), "final norm")
    ratio = f"{s['compression_ratio']:.2f}x" if s["compression_ratio"] else "n/a"
    status = "complete" if s["complete"] else f"INCOMPLETE: {s['units_committed']}/{s['num_units']} units committed"
    lines = [
        f"dspark cache {s['path']} ({status})",
        f"  target      {s['target']} ({s['target_model_type']}), {s['num_hidden_layers']} layers, "
        f"hidden {s['hidden_size']}, vocab {s['target_vocab_size']}",
        f"  samples     {s['samples']:,}  tokens {s['tokens']:,} (mean {s['mean_length']:.1f}, max "
        f"{s['max_length']}, seq_length {s['seq_length']}; {s['truncated_samples']} truncated)",
        f"  rejected    {rejects_line(c)}",
        f"  supervised  {s['supervised_tokens']:,} tokens ({s['supervised_fraction']:.1%})",
        f"  layers      {s['layer_ids']} -> target_hidden_states [T, {s['target_hidden_dim']}], "
        f"target_last_hidden_states [T, {s['hidden_size']}] ({last_src})",
        f"  storage     {s['dtype']}, {s['chunk_tokens']} tokens per chunk, {s['num_units']} unit(s)",
        f"  on disk     {human_bytes(s['bytes_on_disk'])} (token arrays {human_bytes(s['token_bytes_on_disk'])}"
        f" = {ratio} compression of {human_bytes(s['raw_token_bytes'])})",
    ]
    return "\n".join(lines)
