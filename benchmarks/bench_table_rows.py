"""What the block-table rows of a 1024-request decode step cost on this host, piece by piece.

At batch 1024 the fused decode step is mostly its compiled pass (``bench_phases.py``), and the pass
is mostly two copies: the block-table rows (1024 rows of the engine's 2048-column int32 table, the
first ``W`` = 128 columns of each, into the pinned slot) and FlashInfer's page indices (each row's
first ``cdiv(seq_len, 16)`` ids, from the rows just written). This script times those copies alone,
with numba loops of the same shape as attnmeta's kernels (each destination a ring of 3 buffers, as
the stager's slots):

- ``rows (wide source)``: the rows from the engine-shaped table (rows 8 KiB apart);
- ``rows (narrow source)``: the same values from a contiguous ``1024 x W`` copy (rows 512 B apart):
  the difference is what the wide table's layout costs (cache sets and prefetch, not bytes);
- ``rows, compare first``: read the destination row and write only if it differs (the table here
  never changes, so nothing is written: the best case of skipping unchanged rows);
- ``page indices``: FlashInfer's page table from the rows already written (attnmeta's own kernel,
  ``attnmeta.host.common._paged_from_staged_nb``);
- ``memcpy of the step``: one ``np.copyto`` of the same bytes (rows and indices), the floor.

Prints the best of 5 round medians (2000 calls each), microseconds. The row copies are loops written
like the common kernel's (which does more in the same pass), to separate the costs;
``bench_phases.py`` times the real pass.

Run: ``python benchmarks/bench_table_rows.py``.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

if importlib.util.find_spec("attnmeta") is None:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attnmeta._numba import njit
from attnmeta.testing.workloads import decode_spec
from attnmeta.host.common import _paged_from_staged_nb

RING = 3


@njit
def _rows(table: np.ndarray, out: np.ndarray) -> None:
    w = out.shape[1]
    for i in range(out.shape[0]):
        src = table[i]
        dst = out[i]
        for j in range(w):
            dst[j] = src[j]


@njit
def _rows_compare_first(table: np.ndarray, out: np.ndarray) -> int:
    w = out.shape[1]
    written = 0
    for i in range(out.shape[0]):
        src = table[i]
        dst = out[i]
        same = True
        for j in range(w):
            same &= dst[j] == src[j]
        if not same:
            for j in range(w):
                dst[j] = src[j]
            written += 1
    return written


def _best(fn: Callable[[int], Any]) -> float:
    for k in range(50):
        fn(k)
    best = float("inf")
    for _ in range(5):
        ts = np.empty(2000)
        for k in range(2000):
            t0 = time.perf_counter_ns()
            fn(k)
            ts[k] = time.perf_counter_ns() - t0
        best = min(best, float(np.median(ts)) / 1e3)
    return best


def main() -> None:
    spec = decode_spec(1024, np.random.default_rng(0))
    table = spec.block_table
    seq_lens = (spec.num_computed_tokens + spec.num_scheduled_tokens).astype(np.int32)
    page = spec.block_size
    w = int(-(-int(seq_lens.max()) // page))
    pages = int((-(-seq_lens // page)).sum())
    narrow = np.ascontiguousarray(table[:, :w])
    rows = [np.zeros((table.shape[0], w), np.int32) for _ in range(RING)]
    idx = [np.zeros(pages, np.int32) for _ in range(RING)]
    indptr = np.zeros(table.shape[0] + 1, np.int32)
    last = np.zeros(table.shape[0], np.int32)
    nbytes = rows[0].nbytes + idx[0].nbytes
    src_bytes = np.ones(nbytes, np.uint8)
    flat = [np.zeros(nbytes, np.uint8) for _ in range(RING)]
    print(f"# 1024 rows x {w} of a {table.shape[0]} x {table.shape[1]} int32 table, {pages} pages; "
          f"{nbytes / 1024:.0f} KiB a step; {time.strftime('%Y-%m-%d')}; best of 5 round medians, us")
    cases: list[tuple[str, Callable[[int], Any]]] = [
        ("rows (wide source)", lambda k: _rows(table, rows[k % RING])),
        ("rows (narrow source)", lambda k: _rows(narrow, rows[k % RING])),
        ("rows, compare first", lambda k: _rows_compare_first(table, rows[k % RING])),
        ("page indices", lambda k: _paged_from_staged_nb(seq_lens, rows[k % RING], page, indptr, idx[k % RING], last)),
        ("memcpy of the step", lambda k: np.copyto(flat[k % RING], src_bytes)),
    ]
    for name, fn in cases:
        print(f"{name:<24} {_best(fn):8.1f}", flush=True)


if __name__ == "__main__":
    main()
