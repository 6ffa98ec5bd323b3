"""The decode step in eager and in graph mode, composable builders against FusedStepBuilder.

Graph mode (a ``Stager`` with a ``StaticProfile``: fixed addresses and capacities, sentinels past
each field's rows) is how engines decode under CUDA graphs. For batch 1, 64, 256 and 1024 (the
64-step decode walks of ``bench_decode.py``) four loops build the same common + FlashAttention +
FlashInfer metadata, each on its own stager: the composable builders (``stage_common`` with
``paged_kv=True``, ``flash_attn.stage``, ``flashinfer.stage``, three ``result()``) and
:class:`attnmeta.backends.fused.FusedStepBuilder`, each in eager and in graph mode (profile: 1024
requests, 1024 tokens, 136 blocks per request, page 16). Prints the best of 3 round medians (1000
steps per round after 300 untimed ones), host microseconds. Then the same four loops on the
spec-decode walks of ``python -m attnmeta bench --scenario spec-decode-k3`` (3 draft tokens a
request, batch 8, 64 and 256), whose rows are prefill rows for both backends (graph profile: 160
blocks per request, as their contexts grow 4 tokens a step).

Run: ``python benchmarks/bench_fused_modes.py [--device cuda|cpu]``.
"""

from __future__ import annotations

import dataclasses
import gc
import importlib.util
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

if importlib.util.find_spec("attnmeta") is None:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attnmeta._bench_scenarios import GRAPH_PROFILE, composable_step, decode_walks, spec_decode_walks
from attnmeta.backends.fused import FusedStepBuilder
from attnmeta.bench import script_device
from attnmeta.spec import BatchSpec
from attnmeta.staging import Stager

SPEC_PROFILE = dataclasses.replace(GRAPH_PROFILE, max_blocks_per_req=(2048 + 4 * 64) // 16 + 8)
"""The spec-decode walks' contexts grow 4 tokens a step for 64 steps."""


def best_median(fn: Callable[[BatchSpec], Any], specs: list[BatchSpec], device: torch.device) -> float:
    for i in range(300):
        fn(specs[i % len(specs)])
    meds = []
    for _ in range(3):
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # harness only, between rounds
        ts = np.empty(1000)
        gc.disable()
        try:
            for i in range(1000):
                t0 = time.perf_counter_ns()
                fn(specs[i % len(specs)])
                ts[i] = time.perf_counter_ns() - t0
        finally:
            gc.enable()
        meds.append(float(np.median(ts)) / 1e3)
    return min(meds)


def main() -> None:
    dev = script_device(__doc__)
    print(f"# decode step, device {dev}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}, "
          "best of 3 round medians (us)")
    print(f"{'batch':>6} {'eager composable':>17} {'eager fused':>12} {'graph composable':>17} {'graph fused':>12}")
    for batch, specs in decode_walks(quick=False):
        if batch not in (1, 64, 256, 1024):
            continue
        row = []
        for profile in (None, GRAPH_PROFILE):
            row.append(best_median(composable_step(Stager(dev, profile=profile)), specs, dev))
            row.append(best_median(FusedStepBuilder(Stager(dev, profile=profile)).build, specs, dev))
        print(f"{batch:>6} {row[0]:>17.1f} {row[1]:>12.1f} {row[2]:>17.1f} {row[3]:>12.1f}", flush=True)
    print("# spec decode, 3 drafts a request (4 query tokens; prefill rows for both backends' default "
          "thresholds)")
    for batch, specs in spec_decode_walks(quick=False):
        row = []
        for profile in (None, SPEC_PROFILE):
            row.append(best_median(composable_step(Stager(dev, profile=profile)), specs, dev))
            row.append(best_median(FusedStepBuilder(Stager(dev, profile=profile)).build, specs, dev))
        print(f"{batch:>6} {row[0]:>17.1f} {row[1]:>12.1f} {row[2]:>17.1f} {row[3]:>12.1f}", flush=True)


if __name__ == "__main__":
    main()
