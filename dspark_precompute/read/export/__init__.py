"""Exports of a cache to the layouts other DSpark / EAGLE-3 trainers read, one module per trainer.

``nemo`` (NeMo AutoModel), ``deepspec`` (the DSpark paper's trainer), ``specforge``
(SpecForge 0.2.0, ``training.strategy: dspark``) and ``speculators`` (vLLM speculators
0.9.0); ``common`` holds what they share. :func:`export` picks one by name.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from dspark_precompute.errors import ExportError
from dspark_precompute.read.export.common import (
    EXPORT_MARKER,
    TARGETS,
    ExportResult,
    SafetensorsStreamWriter,
    select_export,
)
from dspark_precompute.read.export.deepspec import export_deepspec
from dspark_precompute.read.export.nemo import (
    NEMO_FORMAT_VERSION,
    NEMO_MANIFEST,
    NEMO_SHARD_KEYS,
    NEMO_WEIGHTS,
    export_nemo,
    nemo_manifest,
    shard_name,
)
from dspark_precompute.read.export.specforge import export_specforge
from dspark_precompute.read.export.speculators import export_speculators
from dspark_precompute.read.reader import CacheReader

_EXPORTERS: dict[str, Callable[..., ExportResult]] = {
    "nemo": export_nemo, "deepspec": export_deepspec, "specforge": export_specforge,
    "speculators": export_speculators}


def export(cache: str | Path | CacheReader, out: str | Path, *, to: str, **options: Any) -> ExportResult:
    """Export ``cache`` to ``out`` in trainer ``to``'s layout (one of :data:`TARGETS`); options as that exporter's."""
    if to not in _EXPORTERS:
        raise ExportError(f"to={to!r} is not a known export target; choose one of {', '.join(TARGETS)}")
    return _EXPORTERS[to](cache, out, **options)


__all__ = [
    "EXPORT_MARKER", "NEMO_FORMAT_VERSION", "NEMO_MANIFEST", "NEMO_SHARD_KEYS", "NEMO_WEIGHTS", "TARGETS",
    "ExportResult", "SafetensorsStreamWriter", "export", "export_deepspec", "export_nemo",
    "export_specforge", "export_speculators", "nemo_manifest", "select_export", "shard_name",
]
