"""The issue-#6 benchmark scripts run end to end on the CPU, with tiny settings, and print every row.

docs/benchmarks.md quotes these scripts' output; a script that no longer runs (an API it calls
changed, a row it drops) fails here rather than on the GPU machine. Timings are never asserted
(performance lives in benchmarks, not tests): only that each row is there with positive numbers.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BATCHES = (1, 64, 256, 1024)


def _run(script: str, *args: str) -> list[list[str]]:
    """Run ``benchmarks/<script>`` and return its table rows (lines that start with a batch size)."""
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], capture_output=True,
                          text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return [line.split() for line in done.stdout.splitlines() if line.split() and line.split()[0].isdigit()]


def test_bench_decode_prints_every_path_at_every_batch_size() -> None:
    paths = ("fused", "fused+spec", "floor", "jitter")
    rows = _run("bench_decode.py", "--device", "cpu", "--rounds", "1", "--steps", "8", "--warm", "1",
                "--paths", ",".join(paths))
    assert [(int(r[0]), r[1]) for r in rows] == [(b, p) for b in BATCHES for p in paths]
    for r in rows:  # median, best round, p99, p99/med
        assert all(float(x) > 0 for x in r[2:6]), r
    targets = {int(r[0]): r[6] for r in rows if r[1] == "fused" and len(r) > 6}
    assert targets == {1: "25.0", 256: "50.0", 1024: "150.0"}  # the limits; floor and jitter have none
    assert all(len(r) == 6 for r in rows if r[1] in ("floor", "jitter"))


def test_bench_spec_prints_every_batch_size() -> None:
    rows = _run("bench_spec.py", "--rounds", "1", "--steps", "3")
    assert [int(r[0]) for r in rows] == [1, 8, 64, 256, 1024]
    assert all(float(r[1]) > 0 and float(r[2]) > 0 for r in rows)
