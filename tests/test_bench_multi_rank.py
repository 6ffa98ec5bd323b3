"""benchmarks/bench_multi_rank.py runs end to end on the CPU with tiny settings and prints every row.

docs/benchmarks.md ("Several ranks") quotes its output; timings are never asserted, only that each
path's row is there with positive numbers.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_multi_rank_prints_every_path() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_multi_rank.py"), "--device", "cpu", "--ranks", "2,3",
         "--batches", "1,64", "--rounds", "1", "--blocks", "1", "--block", "2", "--warm", "1"],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split() for line in done.stdout.splitlines() if line.split() and line.split()[0].isdigit()]
    paths = ("independent", "one-process", "ring", "copies")
    assert [(int(r[0]), int(r[1]), r[2]) for r in rows] == [
        (b, n, p) for b in (1, 64) for n in (2, 3) for p in paths]
    for r in rows:
        assert float(r[3]) > 0 and float(r[5]) > 0, r
        assert r[4] == "-" if r[2] == "copies" else float(r[4]) > 0, r
