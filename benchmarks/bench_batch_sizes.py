"""Decode steps whose batch size changes: the cost of switching cached layouts.

Loops of the decode step of ``bench_decode.py`` (common + FlashAttention + FlashInfer metadata,
2048-column table, page 16), each on its own stager: one at 256 rows (64 successive steps, cycled),
one cycling through 64 batch sizes (200-263 rows, 8 successive steps each, interleaved), so every
step changes the row count, and the same 64 sizes padded to multiples of 8 rows and tokens (as an
engine pads decode batches to its CUDA-graph capture sizes). Every layout is cached after the first
pass, so the differences are the cost of switching field groups (cold caches), not of building
them. Each loop runs the composable builders and :class:`attnmeta.backends.fused.FusedStepBuilder`
(whose replays count too: a step replays only a layout recorded on its slot). Prints the best of 4
round medians (host microseconds), the cached layouts per slot (composable) and the share of fused
steps replayed; the loops alternate twice.

Run: ``python benchmarks/bench_batch_sizes.py [--device cpu|cuda]``.
"""

from __future__ import annotations

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
from attnmeta.testing.workloads import advance, decode_spec
from attnmeta.backends.fused import FusedStepBuilder
from attnmeta.bench import script_device
from attnmeta.metadata import stage_common
from attnmeta.spec import BatchSpec
from attnmeta.staging import Stager


def best_median(specs: list[BatchSpec], device: torch.device, fused: bool) -> tuple[float, str]:
    """Best of 4 round medians (us) of whole decode steps walking ``specs``, and what was cached."""
    stager = Stager(device)
    builder = FusedStepBuilder(stager) if fused else None
    pc = time.perf_counter_ns
    meds = []
    for _ in range(4):
        ts = []
        for i in range(512):
            spec = specs[i % len(specs)]
            t0 = pc()
            if builder is not None:
                builder.build(spec)
            else:
                with stager.step() as step:  # the decode step of bench_decode.py / `attnmeta bench --scenario decode`
                    c = stage_common(spec, step, paged_kv=True)
                    both = _stage_fa_fi(c, step)
                c.result(), both.result()
            ts.append((pc() - t0) / 1e3)
        if device.type == "cuda":
            torch.cuda.synchronize()  # harness only, between rounds
        meds.append(float(np.median(ts[64:])))
    if builder is not None:
        return min(meds), f"replayed {builder.stats.replayed / builder.stats.steps:.0%} of steps"
    return min(meds), f"cached layouts per slot {[len(s.groups) for s in stager._slots]}"


def padded(spec: BatchSpec, multiple: int = 8) -> BatchSpec:
    """``spec`` padded to a multiple of ``multiple`` rows and tokens (decode: one token a row)."""
    rows = -(-spec.num_reqs // multiple) * multiple
    return BatchSpec(num_computed_tokens=spec.num_computed_tokens, num_scheduled_tokens=spec.num_scheduled_tokens,
                     num_prompt_tokens=spec.num_prompt_tokens, block_table=spec.block_table,
                     block_size=spec.block_size, num_reqs_padded=rows, num_tokens_padded=rows)


def main() -> None:
    dev = script_device(__doc__)
    one = advance(decode_spec(256, np.random.default_rng(0)), 64)
    walks = [advance(decode_spec(b, np.random.default_rng(b)), 8) for b in range(200, 264)]
    many = [w[i] for i in range(8) for w in walks]
    loops = (("one batch size (256)", one), ("64 batch sizes (200-263)", many),
             ("the same, padded to 8k rows", [padded(s) for s in many]))
    print(f"# decode steps, device {dev}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}, "
          "best of 4 round medians (us)")
    gc.disable()
    try:
        for _ in range(2):
            for label, specs in loops:
                for fused in (False, True):
                    med, what = best_median(specs, dev, fused)
                    print(f"{label:<28} {'fused' if fused else 'composable':<10} {med:8.1f}   {what}", flush=True)
    finally:
        gc.enable()


if __name__ == "__main__":
    main()
