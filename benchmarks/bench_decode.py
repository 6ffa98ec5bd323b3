"""Steady-state decode step: common + FlashAttention + FlashInfer metadata, staged in one copy.

For batch 1, 64, 256 and 1024 (2048-column block table, page size 16,
contexts uniform in [1, 2048) that grow by one token each step, cycling through 64 successive
steps) it times whole steps of the four paths of ``python -m attnmeta bench --scenario decode``
(:func:`attnmeta.bench.scenarios.decode`):

- ``attnmeta``: BatchSpec -> ``stage_common`` + ``flash_attn.stage`` + ``flashinfer.stage`` into one
  step, the step's one copy, then all three metadata objects (``.result()``);
- ``reference``: the device-side reference computations from raw uploads (the engines' way);
- ``per-tensor``: attnmeta's host arrays, each uploaded through its own freshly pinned tensor;
- ``fused``: :class:`attnmeta.backends.fused.FusedStepBuilder` on a stager of its own: the same three
  objects (field for field, but for a block table rounded up to a multiple of 8 columns, its default
  ``table_column_step``) from one call per step, which replays the layout recorded on the step's
  ring slot instead of running the composable builders' Python.

Unlike the bench CLI, which interleaves blocks of 16 steps of each path (so the first steps of a
block run with the caches another path left behind), each path here runs in rounds of ``--steps``
consecutive steps, the way an engine's loop calls it; rounds of the paths alternate, so a drift
of the machine hits all paths alike. Each round starts with ``--warm`` untimed steps of its path
(a tenth of that for the two slow paths): right after the reference path's blocking device work
the host core runs slower for a while (without the warm-up the fused path's first rounds after a
reference round are markedly slower), and an engine's loop never switches paths. A round's median
is one sample; the table gives the median over rounds, the best round (robust on a shared machine whose speed changes from second to second) and
the p99 over every timed step (which a drift of the machine's speed between rounds raises too) and
``p99/med``, each round's p99 over its own median, the median over rounds (the steps' own
jitter, without the drift). Garbage collection is off while timing (an engine tunes its GC; a
collection inside a step of tens of microseconds would only measure the collector).

``fused+spec`` is the fused path with the step's :class:`attnmeta.BatchSpec` constructed (and so
validated) inside the timed step from the walk's arrays, as an engine constructs one each step
from its scheduler's arrays; the other attnmeta paths take the walk's ready-made specs. It is
the whole host cost from raw arrays, which the reference path starts from too.

A last row, ``floor``, is not a path: it copies the fused step's staged bytes once per step, from
one buffer into the next of a ring of as many buffers as the stager has slots (on a CPU device
twice, as the commit there is a host copy too). Any path that stages those bytes pays at least
that much, so the row shows how much of a large batch's step is the memory traffic itself, on the
same machine in the same run (omit it with ``--paths``).

Another, ``jitter``, is not a path either: a fixed amount of pure Python work (a loop of additions),
its length set before the rounds so that its median matches the fused path's at that batch size. It
does no memory traffic and calls no driver, so its ``p99 us`` and ``p99/med`` are the machine's own
jitter for a task of the fused step's length (interrupts, another tenant, clock changes): a floor for
the p99 rule, measured in the same run (it needs the ``fused`` path; omit it with ``--paths``).

With ``--spec`` it times the spec-decode scenario of the bench CLI instead (``spec-decode-k3``: 3
draft tokens a request, batch 8, 64 and 256), which has no limits.

``--threads 2,4`` adds the paths ``fused-t2`` and ``fused-t4``: ``FusedStepBuilder(threads=N)``,
whose replays of batches of at least ``PARALLEL_MIN_ROWS`` (512) requests copy the block-table rows
and page indices on numba's thread pool (those threads keep their cores busy between steps).

``--paths ...,fused-unchecked`` adds the fused path on a stager made with ``check_lifetimes=False``
(expired metadata is not turned into objects that raise): the A/B of that check.

``--gap-us 1000`` waits 1 ms before each timed step, untimed, as an engine's host waits for the GPU
between its steps; ``--gap-mode sleep`` (the default) idles the thread, as a blocking wait does,
``--gap-mode spin`` keeps it busy on the clock, ``--gap-mode event`` (CUDA only) enqueues that much GPU
work and blocks on an event recorded after it, as an engine's host blocks on its last step's results.
Back-to-back steps (no gap, the default) run with every cache and predictor warm from the step before;
after a gap they do not, and every path is slower.

``--cold`` times what an engine's loop sees: every path four ways in the same rounds, back to back
(``tight``), right after a blocking wait on a GPU event that follows ``--cold-us`` of GPU work
(``event``, CUDA only), right after a sleep of ``--cold-us`` (``sleep``) and right after 64 MiB of
cache lines written and 20,000 small dicts read (``thrash``: what an engine's own work between two
steps leaves of the caches; on a CPU-only machine the way that shows the loop's cold step); the table
gets one row per path and way (``fused@event``, ...).

Run: ``python benchmarks/bench_decode.py [--device cpu|cuda] [--rounds 10] [--steps 400] [--paths attnmeta,fused]
[--pin-cpu N] [--spec] [--threads N,M] [--gap-us US] [--gap-mode sleep|spin|event] [--cold] [--cold-us US]``.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

if importlib.util.find_spec("attnmeta") is None:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _args import device_arg
from _cold import gpu_waiter, jitter, median_us, spin
from _cold import waits as cold_ways

from attnmeta.bench.scenarios import decode, decode_walks, fused_step, spec_decode, spec_decode_walks

TARGETS = {1: 25.0, 64: None, 256: 50.0, 1024: 150.0}
"""Limits of the median host microseconds of a decode step, by batch size (the ``target`` column)."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", type=device_arg, default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rounds", type=int, default=10, help="rounds per path and batch size")
    ap.add_argument("--steps", type=int, default=400, help="consecutive steps per round")
    ap.add_argument("--warm", type=int, default=200, help="untimed steps of a path before each of its rounds")
    ap.add_argument("--paths", default="attnmeta,reference,per-tensor,fused,fused+spec,floor,jitter",
                    help="comma-separated paths to time (default: all five, the memory floor and the jitter "
                         "floor)")
    ap.add_argument("--pin-cpu", type=int, default=None, metavar="CPU",
                    help="pin this process to one CPU first (os.sched_setaffinity), as engines pin their "
                         "scheduler thread; default: let the OS place it")
    ap.add_argument("--spec", action="store_true",
                    help="time the spec-decode scenario instead (k = 3 drafts, 4 query tokens a row; batch 8, "
                         "64, 256): with the default decode thresholds its rows are prefill rows, which the "
                         "fused path replays too")
    ap.add_argument("--threads", default="", metavar="N[,M...]",
                    help="also time FusedStepBuilder(threads=N) as path fused-tN, for each N (numba's thread "
                         "pool copies the rows of batches of at least PARALLEL_MIN_ROWS requests)")
    ap.add_argument("--gap-us", type=float, default=0.0, metavar="US",
                    help="wait this long before each timed step (not timed), as an engine's host waits "
                         "for the GPU between steps (default 0: steps back to back)")
    ap.add_argument("--gap-mode", choices=("sleep", "spin", "event"), default="sleep",
                    help="how the gap waits: sleep (the thread idles: its core may slow down or run other "
                         "work), spin (busy on the clock, the core stays awake) or event (CUDA: that much GPU "
                         "work, then a blocking wait on an event recorded after it)")
    ap.add_argument("--cold", action="store_true",
                    help="time every path in the same rounds back to back (tight), right after a blocking wait "
                         "on a GPU event (event, CUDA only), right after a sleep (sleep) and right after a "
                         "cache thrash (thrash)")
    ap.add_argument("--cold-us", type=float, default=2000.0, metavar="US",
                    help="--cold: the GPU work before the event wait and the sleep's length (default 2000)")
    args = ap.parse_args()
    if args.pin_cpu is not None:
        os.sched_setaffinity(0, {args.pin_cpu})
    wanted = args.paths.split(",")
    torch.set_num_threads(1)
    dev = torch.device(args.device)
    print(f"# {platform.node()} {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"device {dev}, {args.rounds} rounds x {args.steps} steps, {time.strftime('%Y-%m-%d')}, "
          f"{'pinned to CPU ' + str(args.pin_cpu) if args.pin_cpu is not None else 'not pinned'}"
          f"{f', {args.gap_us:g} us {args.gap_mode} before each step' if args.gap_us else ''}")
    print(f"{'batch':>6} {'path':<15} {'median us':>10} {'best round':>11} {'p99 us':>8} {'p99/med':>8} {'target':>7}")
    if args.spec:  # spec decode, k = 3 (no limits): batch 8, 64, 256
        cases = spec_decode(dev, quick=False)
    else:
        cases = [c for c in decode(dev, quick=False) if c.batch in TARGETS]
    threads = [int(t) for t in args.threads.split(",") if t]
    walks = (dict(spec_decode_walks(False) if args.spec else decode_walks(False))
             if threads or "fused+spec" in wanted or "fused-unchecked" in wanted else {})
    if args.gap_mode == "event" and dev.type != "cuda":
        ap.error("--gap-mode event needs --device cuda")
    gap = args.gap_us / 1e6
    waits: dict[str, Callable[[float], None]] = {"sleep": time.sleep, "spin": spin, "event": gpu_waiter(dev)}
    wait = waits[args.gap_mode]
    ways: list[tuple[str, float, Callable[[float], None]]] = [("", gap, wait)]
    if args.cold:
        cold = args.cold_us / 1e6
        ways = [("@" + name, pause, wait_fn) for name, pause, wait_fn in cold_ways(dev, cold)]
    for case in cases:  # (the scenario's paths: attnmeta, reference, per-tensor, fused)
        case.paths = {p: fn for p, fn in case.paths.items() if p in wanted}
        if "fused+spec" in wanted:
            case.paths["fused+spec"] = fused_step(walks[case.batch], dev, with_spec=True)[0]
        if "fused-unchecked" in wanted:
            case.paths["fused-unchecked"] = fused_step(walks[case.batch], dev, check_lifetimes=False)[0]
        for t in threads:
            case.paths[f"fused-t{t}"] = fused_step(walks[case.batch], dev, t)[0]
        rows = [p + w for p in case.paths for w, *_r in ways]
        samples: dict[str, list[float]] = {r: [] for r in rows}
        every: dict[str, list[float]] = {r: [] for r in rows}
        ratios: dict[str, list[float]] = {r: [] for r in rows}  # a round's p99 / its median
        for fn in case.paths.values():  # warm-up (compilation, slot layouts, caches)
            for _ in range(50):
                fn()
        for extra in ("floor", "jitter"):
            if extra in wanted and ("fused" in case.stagers if extra == "floor" else "fused" in case.paths):
                case.paths[extra] = (_floor(case.stagers["fused"], dev) if extra == "floor"
                                     else jitter(median_us(case.paths["fused"], 400)))
                for w, *_r in ways:
                    samples[extra + w], every[extra + w], ratios[extra + w] = [], [], []
        gc.disable()
        try:
            for _ in range(args.rounds):
                for path, fn in case.paths.items():
                    fast = path in ("attnmeta", "floor", "jitter") or path.startswith("fused")
                    steps = args.steps if fast else max(args.steps // 10, 20)
                    for way, pause, wait_fn in ways:
                        if pause and not fast:
                            steps = max(steps // 4, 10)  # (slow paths after a wait: a few suffice)
                        for _ in range(args.warm if fast else max(args.warm // 10, 2)):
                            fn()
                        ts = np.empty(steps)
                        for i in range(steps):
                            if pause:
                                wait_fn(pause)
                            t0 = time.perf_counter_ns()
                            fn()
                            ts[i] = (time.perf_counter_ns() - t0) / 1e3
                        if dev.type == "cuda":
                            torch.cuda.synchronize(dev)  # harness only, between rounds: drain the queue
                        med = float(np.median(ts[steps // 10:]))
                        samples[path + way].append(med)
                        every[path + way].extend(ts.tolist())
                        ratios[path + way].append(float(np.percentile(ts, 99)) / med)
        finally:
            gc.enable()
        for row in samples:
            s = np.array(samples[row])
            target = None if args.spec else TARGETS[case.batch]
            plain = row.split("@")[0]
            shown = "" if target is None or plain == "floor" or plain[0] not in "af" or "@" in row else target
            print(f"{case.batch:>6} {row:<15} {np.median(s):>10.1f} {s.min():>11.1f} "
                  f"{np.percentile(every[row], 99):>8.1f} {np.median(ratios[row]):>8.2f} {shown:>7}")


def _floor(stager: Any, dev: torch.device) -> Callable[[], None]:
    """The ``floor`` row: the fused path's staged bytes per step (its stager's mean so far), copied
    once per call into the next buffer of a ring as deep as the stager's (twice on a CPU device)."""
    nbytes = max(1, stager.stats.bytes // max(1, stager.stats.steps))
    src = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    ring = [np.empty(nbytes, np.uint8) for _ in range(stager.num_slots)]
    dev_ring = [np.empty(nbytes, np.uint8) for _ in ring] if dev.type == "cpu" else None
    at = [0]

    def floor() -> None:
        k = at[0]
        at[0] = (k + 1) % len(ring)
        np.copyto(ring[k], src)
        if dev_ring is not None:
            np.copyto(dev_ring[k], ring[k])

    return floor


if __name__ == "__main__":
    main()
