"""Decode steps whose batch size changes: the cost of switching cached layouts.

Two loops of the decode step of ``bench_decode.py`` (common + FlashAttention + FlashInfer metadata,
2048-column table, page 16), each on its own stager: one at 256 rows (64 successive steps, cycled),
one cycling through 64 batch sizes (200-263 rows, 8 successive steps each, interleaved), so every
step changes the row count. Every layout is cached after the first pass, so the difference is the
cost of switching field groups (cold caches), not of building them. Prints the best of 4 round
medians (host microseconds) and the cached layouts per slot; the two loops alternate twice.

Run: ``python benchmarks/bench_batch_sizes.py [--device cpu|cuda]``.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import sys
import time
from pathlib import Path

import numpy as np
import torch

if importlib.util.find_spec("attnmeta") is None:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attnmeta._bench_scenarios import _stage_fa_fi
from attnmeta._workloads import advance, decode_spec
from attnmeta.metadata import stage_common
from attnmeta.spec import BatchSpec
from attnmeta.staging import Stager


def best_median(specs: list[BatchSpec], device: torch.device) -> tuple[float, list[int]]:
    """Best of 4 round medians (us) of whole decode steps walking ``specs``; cached layouts per slot."""
    stager = Stager(device)
    pc = time.perf_counter_ns
    meds = []
    for _ in range(4):
        ts = []
        for i in range(512):
            spec = specs[i % len(specs)]
            t0 = pc()
            with stager.step() as step:  # the decode step of bench_decode.py / `attnmeta bench --scenario decode`
                c = stage_common(spec, step, paged_kv=True)
                both = _stage_fa_fi(c, step)
            c.result(), both.result()
            ts.append((pc() - t0) / 1e3)
        if device.type == "cuda":
            torch.cuda.synchronize()  # harness only, between rounds
        meds.append(float(np.median(ts[64:])))
    return min(meds), [len(s.groups) for s in stager._slots]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    dev = torch.device(args.device)
    torch.set_num_threads(1)
    one = advance(decode_spec(256, np.random.default_rng(0)), 64)
    walks = [advance(decode_spec(b, np.random.default_rng(b)), 8) for b in range(200, 264)]
    many = [w[i] for i in range(8) for w in walks]
    print(f"# decode steps, device {dev}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}, "
          "best of 4 round medians (us)")
    gc.disable()
    try:
        for _ in range(2):
            for label, specs in (("one batch size (256)", one), ("64 batch sizes (200-263)", many)):
                med, groups = best_median(specs, dev)
                print(f"{label:<26} {med:8.1f}   cached layouts per slot {groups}", flush=True)
    finally:
        gc.enable()


if __name__ == "__main__":
    main()
