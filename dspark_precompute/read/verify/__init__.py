"""``verify_cache(path)``: prove a cache is whole and consistent, reporting every problem.

Checks, in order (``checks.py``, one function each):

* manifest: present, parseable, a supported format version, every field of the right
  type and range (the reader's own check), complete;
* structure: every array's zarr.json matches the manifest (dtype, shape, chunks, layer id,
  the writer's codec chain), every table chunk reads;
* offsets: the sample and unit tables are exactly the layout the recorded lengths imply,
  every sample inside its unit, none overlapping;
* commits: one record per committed unit, agreeing with the unit table;
* binding (format 3): ``commits/tokens.json`` binds every unit's token shards, as the commit
  records do (older formats: a note that nothing binds their shards to their places);
* entries: every file under the arrays, groups and ``commits/`` is one the cache lists (no
  stray shard past the last unit, no key an array does not have);
* chunks: every chunk a committed unit owns exists (a deleted chunk would read back as
  zeros) and decodes with a matching crc32c; in format 3 each shard and chunk is the one its
  unit's commit record binds to its place; ids in the vocabulary, masks 0/1, states finite
  (fp8: no NaN bits, every scale finite and positive);
* counts: samples, tokens, supervised tokens, rejects and truncations match the manifest;
* weights: the recorded sha256 (a note when none was recorded) and the manifest's shapes;
  an incomplete cache whose run stopped before writing them (no unit committed) lacks them
  without damage;
* progress (an incomplete cache): a note saying what its run has written and what it writes later.

Recomputing samples with the target (``dspark-cache verify --recompute N``) is the write
side's (``dspark_precompute.write.rerun.recompute``); ``repair`` marks damaged units for the next run.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from dspark_precompute.contract.store import CacheStore
from dspark_precompute.read.verify import checks
from dspark_precompute.read.verify.repair import mark_for_recompute
from dspark_precompute.read.verify.report import Collector, Problem, VerifyReport

log = logging.getLogger(__name__)

__all__ = ["Problem", "VerifyReport", "mark_for_recompute", "verify_cache"]


def verify_cache(path: str | Path, *, allow_incomplete: bool = False, max_problems_per_check: int = 20
                 ) -> VerifyReport:
    """Check the cache at ``path``; ``report.ok`` is true only if nothing is wrong.

    A malformed cache is reported as problems, never raised.
    """
    t0 = time.perf_counter()
    report = VerifyReport(str(path))
    bad = Collector(report, max_problems_per_check)
    try:
        ctx = checks.Context(CacheStore(str(path)), report, bad, allow_incomplete)
        if checks.check_manifest(ctx) and checks.check_structure(ctx):
            checks.check_offsets(ctx)
            checks.check_commits(ctx)
            checks.check_binding(ctx)
            checks.check_entries(ctx)
            checks.check_chunks(ctx)
            checks.check_images(ctx)
            checks.check_counts(ctx)
        if ctx.m is not None:
            checks.check_weights(ctx)
            checks.note_progress(ctx)
    except Exception as exc:  # noqa: BLE001 - a crafted cache must end in a report, not a traceback
        log.debug("verify stopped", exc_info=True)
        bad.add("verify", f"verify stopped at {type(exc).__name__}: {exc}; the cache is malformed in a way the "
                          "checks before did not name. Re-create it (re-run the precompute command with "
                          "overwrite=true)")
    finally:
        report.seconds = time.perf_counter() - t0
    return report
