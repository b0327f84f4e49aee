"""How many files and directories a format 3 cache holds: exact arithmetic from its layout.

A cluster filesystem caps inodes per project and every listing, copy or sync walks them, so
the count is part of the contract: the dry run prints it (and per TB of raw hidden states),
and the tests check that a real run holds exactly that many. Per commit unit a cache holds
one shard per token array and one commit record; everything else is a fixed few dozen (the
token record ``commits/tokens.json`` among them).
"""

from __future__ import annotations

from dataclasses import dataclass

from dspark_precompute.contract.spec import IMAGE_ARRAYS, MAX_TABLE_CHUNK_ROWS, SAMPLE_ARRAYS, UNIT_ARRAYS, VIDEO_ARRAYS

ROOT_FILES = 4  # zarr.json, manifest.json, target_weights.safetensors, rejects.jsonl
HYDRA_FILES = 3  # .hydra/config.yaml, hydra.yaml, overrides.yaml (written by the command line's run)
TB = 10**12


@dataclass(frozen=True)
class Inventory:
    """Files and directories under a cache's root (the root itself not counted)."""

    files: int
    directories: int

    @property
    def entries(self) -> int:
        return self.files + self.directories

    def per_tb(self, raw_hidden_bytes: int) -> float:
        """Entries per 10^12 bytes of raw (uncompressed) hidden states."""
        return self.entries * TB / max(1, raw_hidden_bytes)


def inventory(token_arrays: int, num_units: int, samples: int, fp8: bool, hydra_files: int = HYDRA_FILES,
              images: int | None = None, videos: int = 0) -> Inventory:
    """The entries of a finished format 3 cache.

    ``token_arrays``: ids, mask and every hidden and scale array; each is a directory with its
    zarr.json and one shard per unit. The sample and unit tables are a directory, a zarr.json
    and one chunk per 2^20 rows each; the groups (``samples``, ``units``, ``hidden_states``, and
    ``hidden_scales`` with fp8) a directory and a zarr.json; ``commits/`` one record per unit and
    the token record; ``.hydra/`` the run record, when the command line wrote it. ``images``: an image
    cache's image count (None: not one): the ``images`` group and its per-image tables, counted alike;
    ``videos``: its video count (the ``videos`` group and tables where > 0).
    """
    groups = (4 if fp8 else 3) + (images is not None) + (videos > 0)
    table_chunks = len(SAMPLE_ARRAYS) * -(-samples // MAX_TABLE_CHUNK_ROWS) \
        + len(UNIT_ARRAYS) * -(-num_units // MAX_TABLE_CHUNK_ROWS) \
        + len(IMAGE_ARRAYS) * -(-(images or 0) // MAX_TABLE_CHUNK_ROWS) \
        + len(VIDEO_ARRAYS) * -(-videos // MAX_TABLE_CHUNK_ROWS)
    tables = len(SAMPLE_ARRAYS) + len(UNIT_ARRAYS) + (len(IMAGE_ARRAYS) if images is not None else 0) \
        + (len(VIDEO_ARRAYS) if videos else 0)
    files = (ROOT_FILES + groups + token_arrays * (1 + num_units) + tables + table_chunks + num_units + 1
             + hydra_files)
    directories = groups + token_arrays + tables + 1 + (1 if hydra_files else 0)
    return Inventory(files, directories)
