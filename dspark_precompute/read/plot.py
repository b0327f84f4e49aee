"""One-page picture of a cache: lengths, supervision, per-layer activation scale.

matplotlib is an optional extra (``pip install 'dspark-precompute[plot]'``); the figure
is built without pyplot, so it renders headless and never opens a window.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np

from dspark_precompute.errors import DsparkError, MissingDependencyError, StorageWriteError
from dspark_precompute.read import summary
from dspark_precompute.read.reader import CacheReader, open_cache

log = logging.getLogger(__name__)


def _figure_class() -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise MissingDependencyError(
            "plotting a cache needs matplotlib, which is not installed; install the plot extra: "
            "pip install 'dspark-precompute[plot]'"
        ) from exc
    return Figure


def layer_rms(cache: CacheReader, indices: np.ndarray) -> dict[str, np.ndarray]:
    """Per-token RMS of every captured layer (and the post-norm state) over ``indices``.

    RMS over the hidden dimension is what a draft's input norm sees; a layer whose scale
    is off by orders of magnitude (or zero: a lost chunk) stands out at once.
    """
    last_name = cache.array_names.get("last")
    labels = [("embeddings" if lid < 0 else f"layer {lid}")
              + ("\n(post-norm)" if cache.array_names[str(lid)] == last_name else "") for lid in cache.layer_ids]
    separate_last = last_name is not None and all(cache.array_names[str(lid)] != last_name
                                                  for lid in cache.layer_ids)
    final = "final norm\n(post-norm)"
    out: dict[str, list[np.ndarray]] = {k: [] for k in labels + ([final] if separate_last else [])}
    h = cache.hidden_size
    for i in indices:
        s = cache.sample(int(i), as_numpy=True, last=separate_last)
        hid = s["target_hidden_states"].astype(np.float32)
        for j, label in enumerate(labels):
            x = hid[:, j * h:(j + 1) * h]
            out[label].append(np.sqrt((x * x).mean(axis=1)))
        if separate_last:
            x = s["target_last_hidden_states"].astype(np.float32)
            out[final].append(np.sqrt((x * x).mean(axis=1)))
    return {k: (np.concatenate(v) if v else np.zeros(0, dtype=np.float32)) for k, v in out.items()}


def plot_cache(cache: CacheReader | str | Path, path: str | Path | None = None, *, max_samples: int = 64,
               seed: int = 0, dpi: int = 110, allow_incomplete: bool = False) -> Any:
    """Three panels (length histogram, supervised fraction per sample, per-layer RMS).

    RMS uses ``max_samples`` random samples (seeded) so the plot costs seconds on any
    cache. Saves to ``path`` when given (format from its suffix); returns the Figure.
    """
    Figure = _figure_class()

    c = cache if isinstance(cache, CacheReader) else open_cache(cache, allow_incomplete=allow_incomplete)
    if len(c) == 0:
        raise DsparkError(f"{c.path} has no readable samples to plot")
    lengths = c.lengths().astype(np.int64)
    sup = c.supervised_counts()
    rng = np.random.default_rng(seed)
    pick = np.sort(rng.choice(len(c), size=min(max_samples, len(c)), replace=False))
    rms = layer_rms(c, pick)

    fig = Figure(figsize=(15, 4.4), dpi=dpi, layout="constrained")
    ax1, ax2, ax3 = fig.subplots(1, 3)
    _length_panel(ax1, c, lengths)
    _supervision_panel(ax2, sup, lengths)
    _rms_panel(ax3, rms, f"activation RMS per token ({len(pick)} of {len(c)} samples)")

    name = Path(str(c.path).rstrip("/")).name or str(c.path)
    rejected = c.rejects()
    fig.suptitle(f"{name}: {c.manifest.target_model} ({c.manifest.target_model_type}), "
                 f"{int(lengths.sum()):,} tokens, {c.storage_dtype}" + ("" if c.complete else " - INCOMPLETE")
                 + f"\nrejected {summary.rejects_line(c)}", fontsize=11,
                 color="#C44E52" if rejected["rejected"] else "black")
    if path is not None:
        try:
            fig.savefig(str(path))
        except OSError as exc:
            raise StorageWriteError.of(exc, f"writing the plot to {path}", "plot again",
                                       "give -o another path") from exc
        log.info("plot: wrote %s", path)
    return fig


def _length_panel(ax: Any, c: CacheReader, lengths: np.ndarray) -> None:
    """Histogram of sample lengths, with seq_length, the mean and how many were truncated."""
    from matplotlib.ticker import MaxNLocator

    bins = min(40, max(5, int(np.sqrt(len(lengths))) * 2))
    ax.hist(lengths, bins=bins, color="#4C72B0", edgecolor="white")
    if c.seq_length:
        ax.axvline(c.seq_length, color="#C44E52", linestyle="--", linewidth=1.2,
                   label=f"seq_length {c.seq_length}")
    ax.axvline(lengths.mean(), color="#333333", linestyle=":", linewidth=1.2, label=f"mean {lengths.mean():.0f}")
    truncated = int((c.untruncated_lengths() > lengths).sum())
    ax.set_title(f"sequence length ({len(lengths)} samples, {truncated} truncated)")
    ax.set_xlabel("tokens per sample")
    ax.set_ylabel("samples")
    ax.legend(loc="upper right", fontsize=8)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))


def _supervision_panel(ax: Any, sup: np.ndarray, lengths: np.ndarray) -> None:
    """Histogram of each sample's supervised-token share, with the share over all tokens."""
    from matplotlib.ticker import MaxNLocator

    frac = sup / np.maximum(lengths, 1)
    ax.hist(frac, bins=np.linspace(0, 1, 21), color="#55A868", edgecolor="white")
    overall = sup.sum() / max(1, lengths.sum())
    ax.axvline(overall, color="#333333", linestyle=":", linewidth=1.2, label=f"all tokens {overall:.1%}")
    ax.set_xlim(0, 1)
    ax.set_title("supervised-token fraction per sample")
    ax.set_xlabel("loss_mask = 1 share of the sample's tokens")
    ax.set_ylabel("samples")
    ax.legend(loc="upper left", fontsize=8)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))


def _rms_panel(ax: Any, rms: dict[str, np.ndarray], title: str) -> None:
    """Box plot of each layer's per-token RMS (log axis when the layers' scales differ by decades)."""
    labels = list(rms)
    data = [np.maximum(rms[k], 1e-12) for k in labels]
    ax.boxplot(data, showfliers=False, widths=0.6)
    ax.set_xticks(range(1, len(labels) + 1), labels, rotation=30 if len(labels) > 6 else 0,
                  fontsize=9 if len(labels) > 4 else 10)
    means = [float(np.mean(d)) if len(d) else 0.0 for d in data]
    ax.plot(range(1, len(labels) + 1), means, "o", color="#C44E52", markersize=4, label="mean")
    spread = [float(np.percentile(d, q)) for d in data if len(d) for q in (5, 95)]
    if spread and max(spread) / max(min(spread), 1e-12) > 30:  # scales differ by decades: log axis
        ax.set_yscale("log")
    ax.set_title(title)
    ax.set_ylabel("RMS over hidden dim")
    ax.legend(loc="upper left", fontsize=8)
