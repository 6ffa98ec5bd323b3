"""How often FusedStepBuilder replays in a loop that never repeats a step, and what that costs.

The other decode benchmarks cycle through 64 successive steps, so after the first cycle every layout
they meet has been recorded on every ring slot. An engine's contexts only grow: each time the
longest request gets a new block the eager block-table width changes, a new layout starts, and its
first step on each of the ring's slots composes. This script walks 1,000 successive steps (256
requests, contexts uniform in [1, 2048) growing every step, 16-token blocks, nothing cycled) of plain
decoding and of spec decoding with 3 drafts, in eager mode with ``table_column_step`` 1
(``stage_common``'s exact width) and 8 (the default), and in graph mode (the profile's fixed
width), and prints the share of steps replayed and the median host time per step over the whole
walk. The composable builders run the same walks in eager mode, with ``stage_common``'s default
width and with ``block_table_columns`` rounded up to 8 columns: their cached field groups are per
layout too, and a new layout costs them the same.

Run: ``python benchmarks/bench_replay_rate.py [--device cuda|cpu]``.
"""

from __future__ import annotations

import gc
import importlib.util
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

if importlib.util.find_spec("attnmeta") is None:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attnmeta import StaticProfile
from attnmeta._bench_scenarios import composable_step
from attnmeta._workloads import advance, decode_spec
from attnmeta.backends.fused import FusedStepBuilder
from attnmeta.bench import script_device
from attnmeta.staging import Stager

STEPS = 1000
BATCH = 256


def main() -> None:
    dev = script_device(__doc__)
    print(f"# {STEPS} successive steps, batch {BATCH}, device {dev}, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d')}; median host us per step over the walk")
    print(f"{'walk':<16} {'mode':<22} {'replayed':>9} {'median us':>10} {'p99 us':>8}")
    for drafts in (0, 3):
        specs = advance(decode_spec(BATCH, np.random.default_rng(5), drafts=drafts), STEPS)
        widest = -(-max(s.max_exact_seq_len for s in specs) // 16)
        profile = StaticProfile(max_num_reqs=BATCH, max_num_tokens=BATCH * (1 + drafts),
                                max_blocks_per_req=widest, block_size=16)
        walk = "decode" if not drafts else f"spec decode k={drafts}"
        runs: list[tuple[str, Any, FusedStepBuilder | None]] = []
        for mode, stager_kw, column_step in (("fused, exact width", {}, 1), ("fused, width step 8", {}, 8),
                                             ("fused, graph", {"profile": profile}, 1)):
            builder = FusedStepBuilder(Stager(dev, **stager_kw), table_column_step=column_step)
            runs.append((mode, builder.build, builder))
        for mode, column_step in (("composable, exact", 1), ("composable, step 8", 8)):
            runs.append((mode, composable_step(Stager(dev), column_step), None))
        for mode, fn, builder in runs:
            fn(specs[0])  # compile outside the walk (the walk's layouts are still all new)
            if builder is not None:
                builder.stats.steps = builder.stats.replayed = 0
            ts = np.empty(STEPS)
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
            share = "-" if builder is None else f"{builder.stats.replayed / builder.stats.steps:.0%}"
            print(f"{walk:<16} {mode:<22} {share:>9} {np.median(ts):>10.1f} {np.percentile(ts, 99):>8.1f}",
                  flush=True)


if __name__ == "__main__":
    main()
