"""Benchmark: the whole Mamba2 prefill-step build, attnmeta vs the engine's per-request loops.

For 1, 16, 64, 256 and 1024 prefills (chunk size 256, 1..2048 new tokens per prompt, every second
prompt continuing an unaligned context of 1..8192 tokens; see :mod:`attnmeta.bench.mamba2`) and in
three modes (``plain``: ``"none"`` cache mode, one state block per request; ``align``: ``"align"``
cache mode; ``align+ckpt``: with prefill checkpoints) three paths build the same metadata of a Mamba
KV-cache group (no per-token positions / slot mapping: vLLM's ``SlotMappingMode.NONE``), from the
host description to device tensors, in the same process:

- ``attnmeta``: the generic ``attnmeta.builder.build(spec, stager, "mamba2", options)`` (the common
  metadata with what the builder reads, and the Mamba2 metadata, into one step on a
  :class:`attnmeta.Stager`), the step's ONE copy, then the metadata objects;
- ``reference``: vLLM 0.33.0's way: raw uploads, device-side common fields and
  ``has_initial_states_p`` / state indices, and per-request Python loops over torch CPU tensors for
  the classification, the causal-conv1d metadata and the chunk layout, each list uploaded on its own;
- ``per-tensor``: attnmeta's host kernels, each array uploaded through its own pinned tensor.

The paths run interleaved in rounds so machine noise hits all of them alike. Reported per path:
median and p99 host microseconds per step over all samples, the best per-round median (robust to
other load on a shared machine), H2D copies and host reads of device data ("syncs") per step, and
attnmeta's speed-up over the reference (the target: at least 20x at 256 prefills in every mode). A
breakdown splits attnmeta's step into the common metadata alone and the Mamba2 increment
(``mamba2.stage`` + its ``result()``).

Run: ``python benchmarks/bench_mamba2.py`` (``--quick`` for 1-64 prefills and fewer samples,
``--sizes 256`` for some sizes only, ``--modes plain`` for some modes only, ``--device cuda`` on a
GPU machine, ``--floor`` for the memory floor of the format (bytes any implementation must write, and
their write / copy time), ``--steady`` for attnmeta's step alone in a steady loop, both repeating one
step and walking 16 distinct steps of each size; absolute times are only meaningful on the machine
that produced them). Every path of the interleaved comparison walks the same 16 distinct steps per
size (:data:`attnmeta.bench.mamba2.WALK`).
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

import numba
import numpy as np
import torch

if importlib.util.find_spec("attnmeta") is None:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _args import device_arg  # benchmarks/_args.py

from attnmeta import BatchSpec, Stager, stage_common
from attnmeta.backends.mamba import block_table_columns, mamba2
from attnmeta.bench import count_path
from attnmeta.bench.mamba2 import (
    MODES,
    SIZES,
    WALK,
    mamba2_cases,
    options,
    prefill_step_specs,
    prefill_step_walks,
)
from attnmeta.builder import build

TARGET_RATIO = 20.0
TARGET_PREFILLS = 256
PATHS = ("attnmeta", "reference", "per-tensor")


def _sample(fn: Callable[[], object], calls: int, out: list[float]) -> None:
    clock = time.perf_counter_ns
    for _ in range(calls):
        t0 = clock()
        fn()
        out.append((clock() - t0) / 1e3)


def _estimate(fn: Callable[[], object]) -> float:
    fn()
    t0 = time.perf_counter()
    fn()
    return max(time.perf_counter() - t0, 1e-6)


def time_paths(fns: dict[str, Callable[[], object]], rounds: int, budget_s: float) -> dict[str, dict[str, float]]:
    """Interleaved rounds; per path: median / p99 over all samples and the best per-round median."""
    calls = {n: max(3, min(500, int(budget_s / len(fns) / rounds / _estimate(f)))) for n, f in fns.items()}
    for n, f in fns.items():  # warm-up
        for _ in range(min(20, calls[n])):
            f()
    samples: dict[str, list[float]] = {n: [] for n in fns}
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for n, f in fns.items():
            start = len(samples[n])
            _sample(f, calls[n], samples[n])
            best[n] = min(best[n], float(np.median(samples[n][start:])))
    return {n: {"med": float(np.median(s)), "p99": float(np.percentile(s, 99)), "best": best[n], "n": len(s)}
            for n, s in samples.items()}


def breakdown(spec: BatchSpec, device: torch.device, rounds: int, budget_s: float, mode: str) -> dict[str, float]:
    """attnmeta's step split into the common metadata alone and the Mamba2 increment."""
    stager = Stager(device)
    opts = options(mode)
    cols = block_table_columns(spec, opts)

    def common_only() -> object:
        with stager.step() as step:
            staged = stage_common(spec, step, block_table_columns=cols, token_arrays=False)
        return staged.result()

    def full() -> object:
        return build(spec, stager, "mamba2", opts)

    stage_t: list[float] = []
    result_t: list[float] = []

    def mamba_only() -> object:  # times mamba2.stage and its result() inside a whole step
        with stager.step() as step:
            common = stage_common(spec, step, block_table_columns=cols, token_arrays=False)
            t0 = time.perf_counter_ns()
            staged = mamba2.stage(common, step, opts)
            stage_t.append((time.perf_counter_ns() - t0) / 1e3)
        common.result()
        t0 = time.perf_counter_ns()
        out = staged.result()
        result_t.append((time.perf_counter_ns() - t0) / 1e3)
        return out

    t = time_paths({"common": common_only, "full": full, "mamba": mamba_only}, rounds, budget_s)
    return {"common": t["common"]["med"], "full": t["full"]["med"], "increment": t["full"]["med"] - t["common"]["med"],
            "stage": float(np.median(stage_t)), "result": float(np.median(result_t))}


def steady(walk: list[BatchSpec], device: torch.device, steps: int, reps: int, mode: str) -> tuple[float, float]:
    """attnmeta's step alone (the generic build), one stager in a loop, walking the steps of ``walk``
    in turn: ``reps`` blocks of ``steps`` steps with the garbage collector off; returns the best block
    median and that block's p99. A one-step ``walk`` repeats one step (every per-shape cache hits); a
    walk of distinct steps is what an engine's loop does."""
    stager = Stager(device)
    opts = options(mode)
    at = [0]

    def one() -> object:
        i = at[0]
        at[0] = (i + 1) % len(walk)
        return build(walk[i], stager, "mamba2", opts)

    for _ in range(50):
        one()
    best = (float("inf"), 0.0)
    enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(reps):
            ts: list[float] = []
            _sample(one, steps, ts)
            med = float(np.median(ts))
            if med < best[0]:
                best = (med, float(np.percentile(ts, 99)))
    finally:
        if enabled:
            gc.enable()
    return best


def floor(walk: list[BatchSpec], device: torch.device, mode: str, reps: int = 2000) -> dict[str, float]:
    """The memory floor of the vLLM format for ``walk``'s steps, whatever computes it.

    The causal-conv1d metadata alone needs, per program (``cdiv(query_len, 8)`` per prefill), one
    int32 of ``batch_ptr`` and of ``token_chunk_offset_ptr`` (staged) and one int64 of ``mlist``
    (host): 16 bytes. ``write_us`` is the time to write that many bytes once (a constant fill, the
    cheapest write there is), ``copy_us`` the time to copy the step's staged bytes once (what a CPU
    "device" commit does; on CUDA the DMA costs the host a constant few us instead). Buffers rotate
    through three sets, as the stager's slots do, so neither is timed cache-warm."""
    st = Stager(device)
    opts = options(mode)
    programs, staged = [], []
    for spec in walk:
        nbytes = st.stats.bytes
        meta = build(spec, st, "mamba2", opts)
        programs.append(meta.conv1d_num_programs_total)
        staged.append(st.stats.bytes - nbytes)
    tot, nbytes = int(np.median(programs)), int(np.median(staged))
    sets = [(np.empty(2 * tot, np.int32), np.empty(tot, np.int64), np.empty(nbytes, np.uint8), np.empty(nbytes, np.uint8))
            for _ in range(3)]
    write, copy = [], []
    clock = time.perf_counter_ns
    for i in range(reps):
        a32, a64, src, dst = sets[i % 3]
        t0 = clock()
        a32.fill(i)
        a64.fill(i)
        t1 = clock()
        np.copyto(dst, src)
        t2 = clock()
        write.append((t1 - t0) / 1e3)
        copy.append((t2 - t1) / 1e3)
    return {"programs": tot, "program_bytes": 16 * tot, "staged_bytes": nbytes,
            "write_us": float(np.median(write)), "copy_us": float(np.median(copy))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1-64 prefills, fewer samples")
    parser.add_argument("--sizes", type=int, nargs="+", default=None,
                        help=f"numbers of prefills to run (of {SIZES}; default all, --quick the first three)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="builder modes (default all)")
    parser.add_argument("--device", type=device_arg, default=None, help="cpu or cuda (default: cuda if present)")
    parser.add_argument("--rounds", type=int, default=10, help="interleaved rounds per size (default 10)")
    parser.add_argument("--floor", action="store_true",
                        help="the vLLM format's memory floor per step at each size (see floor())")
    parser.add_argument("--steady", action="store_true",
                        help="attnmeta's path alone in a steady loop: 5 x 1000 steps per size (200 at 1024 "
                             "prefills), best median and its p99")
    args = parser.parse_args()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.set_num_threads(1)  # the reference's tiny CPU ops only suffer from intra-op threads

    def wanted(batch: int) -> bool:
        return args.sizes is None or batch in args.sizes

    if args.floor:
        print("the vLLM format's memory floor per step (medians): causal-conv1d programs, their bytes "
              "(batch_ptr + token_chunk_offset_ptr + mlist), the step's staged bytes, us to write the program "
              "bytes once, us to copy the staged bytes once")
        for mode in args.modes:
            for walk in prefill_step_walks(args.quick, mode):
                if not wanted(walk[0].num_reqs):
                    continue
                f = floor(walk, device, mode)
                print(f"{mode:>10} {walk[0].num_reqs:>8} prefills: {f['programs']:>7.0f} programs "
                      f"{f['program_bytes']:>9.0f} B | staged {f['staged_bytes']:>9.0f} B | write {f['write_us']:>7.1f} us "
                      f"| copy {f['copy_us']:>7.1f} us", flush=True)
        return
    if args.steady:
        print(f"attnmeta's step alone (the generic build), us per step (best block median and its p99): one step "
              f"repeated | a walk of {WALK} distinct steps of the size (what an engine's loop does)")
        print(f"{'mode':>10} {'prefills':>8} {'tokens':>8} | {'repeated':>9} {'p99':>9} | {'walk':>9} {'p99':>9}")
        for mode in args.modes:
            for walk in prefill_step_walks(args.quick, mode):
                if not wanted(walk[0].num_reqs):
                    continue
                steps = 1000 if walk[0].num_reqs <= 256 else 200
                med1, p991 = steady(walk[:1], device, steps, 5, mode)
                med, p99 = steady(walk, device, steps, 5, mode)
                print(f"{mode:>10} {walk[0].num_reqs:>8} {walk[0].num_tokens:>8} | {med1:>9.1f} {p991:>9.1f} | "
                      f"{med:>9.1f} {p99:>9.1f}", flush=True)
        return
    budget = 1.5 if args.quick else 6.0
    jit = "off (NUMBA_DISABLE_JIT=1)" if os.environ.get("NUMBA_DISABLE_JIT") == "1" else "on"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    print(f"Mamba2 prefill-step build on {device} ({name}) | chunk 256, prompts 1..2048, contexts 0..8192")
    print(f"python {platform.python_version()}, numpy {np.__version__}, numba {numba.__version__} (jit {jit}), "
          f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}")
    head = (f"{'mode':>10} {'prefills':>8} {'tokens':>8} {'path':<10} | {'median':>9} {'p99':>9} {'best':>9} | "
            f"{'vs ref':>7} | {'H2D':>4} {'syncs':>5}")
    print(head)
    print("-" * len(head))
    parts: list[tuple[str, int, dict[str, float]]] = []
    verdicts: list[str] = []
    for mode in args.modes:
        for case, spec in zip(mamba2_cases(device, args.quick, mode), prefill_step_specs(args.quick, mode)):
            if not wanted(case.batch):
                continue
            res = time_paths({p: case.paths[p] for p in PATHS}, args.rounds, budget)
            ref_med = res["reference"]["med"]
            for p in PATHS:
                r = res[p]
                counts = count_path(case, p, device, 3)
                speed = "      -" if p == "reference" else f"{ref_med / r['med']:6.1f}x"
                print(f"{mode:>10} {case.batch:>8} {spec.num_tokens:>8} {p:<10} | {r['med']:>9.1f} {r['p99']:>9.1f} "
                      f"{r['best']:>9.1f} | {speed} | {counts.h2d:>4.0f} {counts.syncs:>5.0f}", flush=True)
            parts.append((mode, case.batch, breakdown(spec, device, max(3, args.rounds // 2), budget / 2, mode)))
            if case.batch == TARGET_PREFILLS:
                ratio = ref_med / res["attnmeta"]["med"]
                verdicts.append(f"{mode}: {ratio:.1f}x ({'meets' if ratio >= TARGET_RATIO else 'misses'} it)")
    print("times: host microseconds per step (median and p99 over all samples; best = lowest per-round median)")
    print()
    print("attnmeta breakdown (medians, us): common metadata alone | whole step | Mamba2 increment "
          "(= whole - common) | mamba2.stage | mamba2 result()")
    for mode, num, b in parts:
        print(f"{mode:>10} {num:>8} prefills: {b['common']:>9.1f} | {b['full']:>9.1f} | {b['increment']:>9.1f} | "
              f"{b['stage']:>7.1f} | {b['result']:>7.1f}")
    if verdicts:
        print(f"\ntarget: attnmeta's whole build >= {TARGET_RATIO:.0f}x the reference at {TARGET_PREFILLS} prefills: "
              + "; ".join(verdicts))


if __name__ == "__main__":
    main()
