"""How often FusedStepBuilder replays in a loop that never repeats a step, and what that costs.

The other decode benchmarks cycle through 64 successive steps, so after the first cycle every layout
they meet has been recorded on every ring slot. An engine's contexts only grow: each time the
longest request gets a new block the eager block-table width changes, a new layout starts, and its
first step on each of the ring's slots composes. This script walks 1,000 successive steps (256
requests, contexts uniform in [1, 2048) growing every step, 16-token blocks, nothing cycled) of plain
decoding and of spec decoding with 3 drafts, in eager mode with ``table_column_step`` 1
(``stage_common``'s exact width) and 8 (the default), and in graph mode (the profile's fixed
width), and prints the share of steps replayed, the mean, median and p99 host time per step over
the whole walk, and the minor page faults per step (``getrusage``; on the CPU the stager's arenas
are touched when allocated, so steps fault only where Python or numpy take fresh memory). The
composable builders run the same walks in eager mode, with ``stage_common``'s default width and
with ``block_table_columns`` rounded up to 8 columns: their cached field groups are per layout too,
and a new layout costs them the same. Each mode walks ``--rounds`` times (default 3), the modes
alternating; the figures are medians over the rounds.

Run: ``python benchmarks/bench_replay_rate.py [--device cuda|cpu] [--rounds N]``.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

if importlib.util.find_spec("attnmeta") is None:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attnmeta import BatchSpec, StaticProfile
from attnmeta._bench_scenarios import composable_step
from attnmeta.testing.workloads import advance, decode_spec
from attnmeta.backends.fused import FusedStepBuilder
from attnmeta.staging import Stager

STEPS = 1000
BATCH = 256


def _walk(fn: Callable[[BatchSpec], Any], specs: list[BatchSpec], dev: torch.device) -> np.ndarray:
    """Host us of each step of one walk through ``specs``."""
    ts = np.empty(len(specs))
    gc.disable()
    try:
        for i, spec in enumerate(specs):
            t0 = time.perf_counter_ns()
            fn(spec)
            ts[i] = (time.perf_counter_ns() - t0) / 1e3
    finally:
        gc.enable()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)  # harness only, after the walk
    return ts


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rounds", type=int, default=3,
                    help="walks of each mode, the modes alternating (default 3); figures are medians over rounds")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dev = torch.device(args.device)
    print(f"# {STEPS} successive steps, batch {BATCH}, device {dev}, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d')}; host us per step over the walk (median over {args.rounds} rounds)")
    print(f"{'walk':<16} {'mode':<22} {'replayed':>9} {'mean us':>8} {'median us':>10} {'p99 us':>8} "
          f"{'faults/step':>11}")
    for drafts in (0, 3):
        specs = advance(decode_spec(BATCH, np.random.default_rng(5), drafts=drafts), STEPS)
        widest = -(-max(s.max_exact_seq_len for s in specs) // 16)
        profile = StaticProfile(max_num_reqs=BATCH, max_num_tokens=BATCH * (1 + drafts),
                                max_blocks_per_req=widest, block_size=16)
        walk = "decode" if not drafts else f"spec decode k={drafts}"
        modes: list[tuple[str, Callable[[], tuple[Callable[[BatchSpec], Any], FusedStepBuilder | None]]]] = []
        for mode, stager_kw, column_step in (("fused, exact width", {}, 1), ("fused, width step 8", {}, 8),
                                             ("fused, graph", {"profile": profile}, 1)):
            def fused_mode(kw: dict[str, Any] = stager_kw,
                           cs: int = column_step) -> tuple[Callable[[BatchSpec], Any], FusedStepBuilder | None]:
                builder = FusedStepBuilder(Stager(dev, **kw), table_column_step=cs)
                return builder.build, builder
            modes.append((mode, fused_mode))
        for mode, column_step in (("composable, exact", 1), ("composable, step 8", 8)):
            modes.append((mode, lambda cs=column_step: (composable_step(Stager(dev), cs), None)))
        rows: dict[str, list[tuple[float, float, float, float, float]]] = {m: [] for m, _ in modes}
        for _ in range(args.rounds):
            for mode, make in modes:
                fn, builder = make()
                fn(specs[0])  # compile outside the walk (the walk's layouts are still all new)
                if builder is not None:
                    builder.stats = type(builder.stats)()
                faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                ts = _walk(fn, specs, dev)
                faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
                st = builder.stats if builder is not None else None
                rows[mode].append((st.replayed / st.steps if st else -1.0, float(ts.mean()), float(np.median(ts)),
                                   float(np.percentile(ts, 99)), faults / len(specs)))
        for mode, r in rows.items():
            rep, mean, med, p99, flt = np.median(np.array(r), axis=0)
            share = "-" if rep < 0 else f"{rep:.0%}"
            print(f"{walk:<16} {mode:<22} {share:>9} {mean:>8.1f} {med:>10.1f} {p99:>8.1f} {flt:>11.2f}", flush=True)


if __name__ == "__main__":
    main()
