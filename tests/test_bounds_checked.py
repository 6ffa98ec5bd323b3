"""Every compiled kernel stays inside its arrays: the audit's builders, with numba's bounds checks on.

attnmeta's kernels compile with ``boundscheck=False`` (attnmeta/_numba.py): an index past an array's end
reads or writes whatever memory follows it, silently. ``NUMBA_BOUNDSCHECK=1`` overrides that option for
every kernel, so such an index raises ``IndexError`` instead. This test runs ``python -m attnmeta audit``
(every registered builder, and the fused step, over generated batches of every kind) in a process of
its own with the checks on, its kernels compiled into a cache of its own (code compiled with the checks
never mixes with the everyday cache). The whole host suite passes under the same setting too
(docs/testing.md, "Kernels with bounds checks"); that run takes several minutes, this one about half a
minute on two cores, most of it compiling.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import attnmeta


def test_every_builder_stays_inside_its_arrays(tmp_path: Path) -> None:
    env = {**os.environ, "NUMBA_BOUNDSCHECK": "1", "NUMBA_CACHE_DIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "attnmeta", "audit", "--device", "cpu", "--batches", "10"],
                         env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, f"the audit with bounds checks failed:\n{run.stdout[-4000:]}\n{run.stderr[-4000:]}"
    assert "IndexError" not in run.stdout + run.stderr
    rows = len(attnmeta.registry()) + 1  # (every registered builder's row, and the fused step's)
    assert run.stdout.count(" clean\n") == rows, run.stdout[-4000:]
