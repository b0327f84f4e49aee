"""The package version: one owner (pyproject.toml reads it; the manifest and provenance record it)."""

__version__ = "0.3.0"
