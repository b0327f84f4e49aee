"""Numbers and problem lists as people read them in logs and errors (shared by every side; imports nothing)."""

from __future__ import annotations


def human_bytes(n: float) -> str:
    """Decimal units, as disks and object stores count: ``1.5 GB``."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} TB"


def human_seconds(s: float) -> str:
    s = int(max(0, s))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def listing(head: str, problems: list[str], tail: str) -> str:
    """One problem on one line; several as an indented list under a head that counts them, then the fix."""
    if len(problems) == 1:
        return f"{head}: {problems[0]}. {tail}"
    return f"{head} ({len(problems)} problems):\n" + "\n".join(f"  - {p}" for p in problems) + f"\n{tail}"
