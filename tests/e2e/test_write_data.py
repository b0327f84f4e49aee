"""A run over a huge row, watched from outside: its memory stays bounded.

The e2e part of tests/write/samples/test_data.py.
"""

import json
import subprocess
import sys
import time

from test_data import big_row, good


def _tree_rss(proc) -> int:
    import psutil

    try:
        p = psutil.Process(proc.pid)
        return sum(x.memory_info().rss for x in [p, *p.children(recursive=True)])
    except psutil.Error:
        return 0


def test_a_run_over_a_50_mb_row_stays_within_a_few_hundred_mb(tmp_path):
    """Before the limit this run tokenized the whole message and passed 6 GiB; now the row is a reject."""
    data = tmp_path / "big.jsonl"
    with open(data, "wb") as f:
        f.write(big_row(50_000_000) + b"\n")
        f.writelines(json.dumps(good(i)).encode() + b"\n" for i in range(3))
    cmd = [sys.executable, "-m", "dspark_precompute", "data=jsonl", f"data.path={data}",
           f"storage.path={tmp_path / 'c'}", "seq_length=2048", "progress=false", "data.max_invalid_fraction=0.5"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    cap, peak, deadline = 1536 << 20, 0, time.time() + 300
    while proc.poll() is None and time.time() < deadline:
        peak = max(peak, _tree_rss(proc))
        if peak > cap:
            proc.kill()
            break
        time.sleep(0.05)
    out = proc.communicate(timeout=60)[0].decode(errors="replace")
    assert proc.returncode == 0, (peak >> 20, out[-3000:])
    assert peak < 1 << 30, f"peak RSS {peak >> 20} MiB"  # ~0.4 GiB with the tiny target and its writer
    rejects = [json.loads(x) for x in (tmp_path / "c" / "rejects.jsonl").read_text().splitlines()]
    assert [r["reason"] for r in rejects] == ["row_too_large"]
