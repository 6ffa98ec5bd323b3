"""Micro-benchmark: Mamba2 chunk metadata on the host (numba) vs the engine's per-request loop.

Times :func:`attnmeta.host.chunks.chunk_metadata` against
:func:`attnmeta.testing.reference.mamba.ref_chunk_metadata_lists` (vLLM's ``_compute_chunk_metadata``
style: a Python loop over prefill rows reading torch CPU tensors with ``.item()`` and appending to
lists) in the same process, on the same batches: chunk size 256, prompts (query lengths) of 1..2048
tokens, contexts of 0..8192 tokens, fixed seed; each size without and with prefill-checkpoint offsets
(``ckpt``: half the rows, at a random offset into their query). Both sides produce host data only
(no device copy). The target: at least 500x at 256 prefills, in both modes.

Calls of the two sides are interleaved in 10 rounds so that machine noise hits both alike. Reports
the median and p99 per call in microseconds and the speedup (ratio of medians), plus the best
per-round median of each side (robust to other load on a shared machine) and its ratio.

Run: ``python benchmarks/bench_chunks.py`` (``--quick`` for a short run, ``--sizes 256`` for one size).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numba
import numpy as np
import torch

if importlib.util.find_spec("attnmeta") is None:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attnmeta.host.chunks import chunk_metadata
from attnmeta.testing.reference.mamba import ref_chunk_metadata_lists

CHUNK_SIZE = 256
MAX_PROMPT = 2048
MAX_CONTEXT = 8192
SIZES = (1, 16, 64, 256, 1024)


TARGET_RATIO = 500.0
TARGET_PREFILLS = 256


def make_batch(
    rng: np.random.Generator, num_prefills: int, checkpoints: bool = False
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(num_computed_p, query_start_loc_p, checkpoint offsets or None) as int32 host arrays; with
    ``checkpoints`` half the rows (at random) get an offset in ``[1, query length]``."""
    num_computed = rng.integers(0, MAX_CONTEXT + 1, num_prefills).astype(np.int32)
    query_lens = rng.integers(1, MAX_PROMPT + 1, num_prefills)
    qsl = np.zeros(num_prefills + 1, dtype=np.int32)
    qsl[1:] = np.cumsum(query_lens)
    offsets = None
    if checkpoints:
        offsets = np.where(rng.random(num_prefills) < 0.5, rng.integers(1, query_lens + 1), 0).astype(np.int32)
    return num_computed, qsl, offsets


def sample(fn: Callable[[], object], calls: int, out: list[float]) -> None:
    clock = time.perf_counter_ns
    for _ in range(calls):
        t0 = clock()
        fn()
        out.append((clock() - t0) / 1e3)


def bench_size(rng: np.random.Generator, num_prefills: int, budget_s: float, checkpoints: bool) -> dict[str, float]:
    nc, qsl, offs = make_batch(rng, num_prefills, checkpoints)
    nc_t, qsl_t = torch.from_numpy(nc), torch.from_numpy(qsl)
    offs_list = None if offs is None else offs.tolist()

    def host() -> object:
        return chunk_metadata(CHUNK_SIZE, nc, qsl, offs)

    def ref() -> object:
        return ref_chunk_metadata_lists(CHUNK_SIZE, nc_t, qsl_t, offs_list)

    # correctness sanity check, and warm-up (numba dispatch, caches)
    m = chunk_metadata(CHUNK_SIZE, nc, qsl, offs)
    cu, seq_idx, last, ckpt = ref_chunk_metadata_lists(CHUNK_SIZE, nc_t, qsl_t, offs_list)
    assert m.cu_chunk_seqlens.tolist() == cu and m.seq_idx.tolist() == seq_idx
    assert m.last_chunk_indices.tolist() == last and m.checkpoint_chunk_idx.tolist() == ckpt
    for _ in range(200):
        host()
    t0 = time.perf_counter()
    ref()
    ref_est = max(time.perf_counter() - t0, 1e-6)

    rounds = 10
    ref_calls = max(3, min(200, int(budget_s / 2 / ref_est / rounds)))
    host_calls = 500
    host_t: list[float] = []
    ref_t: list[float] = []
    host_best = ref_best = float("inf")
    for _ in range(rounds):
        n_h, n_r = len(host_t), len(ref_t)
        sample(host, host_calls, host_t)
        sample(ref, ref_calls, ref_t)
        host_best = min(host_best, float(np.median(host_t[n_h:])))
        ref_best = min(ref_best, float(np.median(ref_t[n_r:])))
    h = np.asarray(host_t)
    r = np.asarray(ref_t)
    return {
        "mode": "ckpt" if checkpoints else "plain",
        "prefills": num_prefills,
        "chunks": m.num_chunks,
        "tokens": int(qsl[-1]),
        "host_med": float(np.median(h)),
        "host_p99": float(np.percentile(h, 99)),
        "ref_med": float(np.median(r)),
        "ref_p99": float(np.percentile(r, 99)),
        "speedup": float(np.median(r) / np.median(h)),
        "host_best": host_best,
        "ref_best": ref_best,
        "speedup_best": ref_best / host_best,
        "host_n": h.size,
        "ref_n": r.size,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="shorter run (less time per size)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sizes", type=int, nargs="+", default=None, help=f"numbers of prefills (default {SIZES})")
    args = parser.parse_args()
    budget = 1.0 if args.quick else 4.0
    jit = "off (NUMBA_DISABLE_JIT=1)" if os.environ.get("NUMBA_DISABLE_JIT") == "1" else "on"
    print(
        f"chunk_metadata vs per-request torch loop | chunk {CHUNK_SIZE}, prompts 1..{MAX_PROMPT}, "
        f"contexts 0..{MAX_CONTEXT}, seed {args.seed}"
    )
    print(
        f"python {platform.python_version()}, numpy {np.__version__}, numba {numba.__version__} (jit {jit}), "
        f"torch {torch.__version__}, {os.cpu_count()} CPUs"
    )
    header = (
        f"{'prefills':>8} {'chunks':>7} {'tokens':>8} | {'host med':>9} {'host p99':>9} | "
        f"{'loop med':>10} {'loop p99':>10} | {'speedup':>8} | {'host best':>9} {'loop best':>10} {'speedup':>8} || "
        f"{'ckpt:':<5} {'chunks':>7} {'host med':>9} {'loop med':>10} {'speedup':>8} {'best':>8}"
    )
    print(header)
    print("-" * len(header))
    verdicts = []
    for size in args.sizes or SIZES:
        r, c = (bench_size(np.random.default_rng([args.seed, size, ck]), size, budget, ck) for ck in (False, True))
        print(
            f"{r['prefills']:>8} {r['chunks']:>7} {r['tokens']:>8} | {r['host_med']:>9.2f} {r['host_p99']:>9.2f} | "
            f"{r['ref_med']:>10.1f} {r['ref_p99']:>10.1f} | {r['speedup']:>7.0f}x | {r['host_best']:>9.2f} "
            f"{r['ref_best']:>10.1f} {r['speedup_best']:>7.0f}x || {'':<5} {c['chunks']:>7} {c['host_med']:>9.2f} "
            f"{c['ref_med']:>10.1f} {c['speedup']:>7.0f}x {c['speedup_best']:>7.0f}x", flush=True
        )
        if size == TARGET_PREFILLS:
            verdicts += [f"{x['mode']}: {x['speedup']:.0f}x ({'meets' if x['speedup'] >= TARGET_RATIO else 'misses'} it)"
                         for x in (r, c)]
    print(
        "times in microseconds per call over all samples (median, p99); speedup = loop median / host median;\n"
        "best = the lowest of the 10 per-round medians (least disturbed by other load on the machine);\n"
        "ckpt: the same sizes with checkpoint offsets on half the rows (another batch of that size)"
    )
    if verdicts:
        print(f"target: >= {TARGET_RATIO:.0f}x the loop at {TARGET_PREFILLS} prefills: " + "; ".join(verdicts))


if __name__ == "__main__":
    main()
