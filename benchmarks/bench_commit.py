"""The commit's cost on a CUDA device: torch's copy_ + Event.record against the driver fast path.

Times, best of 7 blocks of ``--calls`` calls (host microseconds per call):

- the raw calls: ``Tensor.copy_(non_blocking=True)`` of a pinned slice against
  ``cuMemcpyHtoDAsync``, at 4 KiB, 256 KiB and 1 MiB; ``Event.record`` against ``cuEventRecord``;
- a whole eager step (``Stager.step`` + one 4 KiB field + ``commit``), with the driver path on and
  with it off (the torch calls), in the same process.

Run on the GPU machine: ``python benchmarks/bench_commit.py [--calls 20000]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

if importlib.util.find_spec("attnmeta") is None:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attnmeta.staging import Stager, _driver


def best_us(fn: Callable[[], object], calls: int) -> float:
    """Best of 7 blocks: mean host microseconds per call of ``fn``."""
    fn()
    best = float("inf")
    for _ in range(7):
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter_ns() - t0) / calls / 1e3)
        torch.cuda.synchronize()  # harness only, between blocks
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=20000)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_commit: needs a CUDA device")
    drv = _driver.load()
    if drv is None:
        sys.exit("bench_commit: libcuda could not be loaded (or ATTNMETA_DRIVER_COPY=0)")
    n = args.calls
    host = torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.current_stream()
    ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
    ev.record(stream)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}, "
          f"best of 7 x {n} calls, host us per call")
    for size in (4096, 1 << 18, 1 << 20):
        h, d = host[:size], dev[:size]
        hp, dp = h.data_ptr(), d.data_ptr()
        t_torch = best_us(lambda h=h, d=d: d.copy_(h, non_blocking=True), n // 10)  # type: ignore[misc]
        t_drv = best_us(lambda dp=dp, hp=hp, size=size: drv.copy(dp, hp, size, stream.cuda_stream), n // 10)  # type: ignore[misc]
        print(f"H2D copy {size:>8} B   copy_ {t_torch:6.2f}   cuMemcpyHtoDAsync {t_drv:6.2f}")
    print(f"event record        Event.record {best_us(lambda: ev.record(stream), n):6.2f}   "
          f"cuEventRecord {best_us(lambda: drv.record(ev.cuda_event, stream.cuda_stream), n):6.2f}")
    for label, on in (("driver", True), ("torch", False), ("driver", True), ("torch", False)):
        stager = Stager("cuda")
        if not on:
            stager._driver = None
        def step(stager: Stager = stager, payload: np.ndarray = np.arange(1024, dtype=np.int32)) -> None:
            with stager.step() as s:
                s.alloc("x", 1024, np.int32)[:] = payload

        print(f"whole 4 KiB step ({label:6s})  {best_us(step, n):6.2f}")


if __name__ == "__main__":
    main()
