"""Host time of constructing a step's :class:`attnmeta.BatchSpec` (validation included).

An engine builds one ``BatchSpec`` per step from its scheduler's arrays before any builder runs, so
its cost is part of the step (``bench_decode.py``'s ``fused+spec`` path times the two together).
For the decode walks of the bench (batch 1, 8, 64, 256, 1024; a 2048-column block table, page
size 16, contexts uniform in [1, 2048)), each timed call constructs the next step's spec from its
arrays (computed tokens, scheduled tokens, prompt lengths, block table: C-contiguous int32, kept
without a copy); rounds of ``--steps`` calls, with the median per round, then the median over
rounds and the best round. Garbage collection is off while timing.

``--kind`` picks the arrays' form: ``ready`` (the engine passes int32 arrays, the default) or
``int64`` (numpy's default integer type: every array is range-checked and converted to int32 each
call, the block table included: what not to do in a loop).

Run: ``python benchmarks/bench_spec.py [--rounds 8] [--steps 400] [--kind ready|int64]``.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import platform
import sys
import time
from pathlib import Path

import numpy as np

if importlib.util.find_spec("attnmeta") is None:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attnmeta import BatchSpec
from attnmeta.bench import decode_walks
from attnmeta.spec import spec_arguments


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--kind", choices=("ready", "int64"), default="ready")
    args = ap.parse_args()
    print(f"# {platform.node()} {platform.processor() or platform.machine()}, {args.rounds} rounds x "
          f"{args.steps} constructions, arrays {args.kind}, {time.strftime('%Y-%m-%d')}")
    print(f"{'batch':>6} {'median us':>10} {'best round':>11}")
    for batch, walk in decode_walks(False):
        kws = [spec_arguments(s) for s in walk]
        if args.kind == "int64":
            kws = [{k: (v.astype(np.int64) if isinstance(v, np.ndarray) else v) for k, v in kw.items()} for kw in kws]
        n = len(kws)
        for i in range(100):  # warm-up (compilation is cached; this warms the caches)
            BatchSpec(**kws[i % n])
        meds = []
        gc.disable()
        try:
            for _ in range(args.rounds):
                ts = np.empty(args.steps)
                for i in range(args.steps):
                    kw = kws[i % n]
                    t0 = time.perf_counter_ns()
                    BatchSpec(**kw)
                    ts[i] = (time.perf_counter_ns() - t0) / 1e3
                meds.append(float(np.median(ts)))
        finally:
            gc.enable()
        print(f"{batch:>6} {np.median(meds):>10.1f} {min(meds):>11.1f}")


if __name__ == "__main__":
    main()
