"""``python -m attnmeta bench``: side-by-side host timings, syncs and copies per step.

For every scenario and batch size three paths build the same metadata in the same process,
interleaved repetition by repetition:

- ``attnmeta``: host derivation (numba) written straight into the pinned slot + ONE packed copy;
- ``reference``: the device-side reference path of :mod:`attnmeta.testing.reference` (raw inputs
  uploaded, fields computed on the device, host scalars read back with ``.item()`` as engines did);
- ``per-tensor``: the same host arrays as attnmeta, each uploaded through its own freshly pinned
  tensor (``async_tensor_h2d`` style, race-free but one allocation and one copy per array);
- ``fused`` (the ``decode`` and ``spec-decode-k3`` scenarios): :class:`attnmeta.backends.fused.FusedStepBuilder`
  on a stager of its own, the same three metadata objects as ``attnmeta`` (its block table up to 7
  columns wider) from one call per step.

Reported per path: host microseconds per step (median and p99), GPU->CPU syncs per step, H2D copies
per step, bytes per step, staging waits. On CUDA the syncs and copies come from a torch.profiler
trace; on CPU the syncs come from :func:`attnmeta.sync.record_device_syncs` (cpu declared as device
data) and the copies from the paths' upload counters. Absolute times are only meaningful on the machine that produced them; compare paths
within one run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

__all__ = ["BenchRow", "add_arguments", "format_table", "run_bench", "run_from_args"]


# --------------------------------------------------------------------------------------- counting
@dataclasses.dataclass
class _Counts:
    syncs: float = 0.0
    h2d: float = 0.0
    bytes: float = 0.0


class Uploads:
    """Upload counter the benchmark paths report their H2D copies through (CPU counting pass)."""

    def __init__(self) -> None:
        self.copies = 0
        self.bytes = 0

    def add(self, t: torch.Tensor | np.ndarray) -> None:
        self.copies += 1
        self.bytes += int(t.nbytes)


# --------------------------------------------------------------------------------------- results
@dataclasses.dataclass(frozen=True)
class BenchRow:
    """One (scenario, batch, path) measurement."""

    scenario: str
    batch: int
    path: str
    median_us: float
    p99_us: float
    syncs_per_step: float
    h2d_per_step: float
    bytes_per_step: float
    waits: int
    reps: int


PathFn = Callable[[], Any]


@dataclasses.dataclass
class Case:
    """A scenario at one batch size: one callable per path, each performing one whole step."""

    scenario: str
    batch: int
    paths: dict[str, PathFn]
    uploads: dict[str, Uploads]
    stager: Any = None
    """The ``attnmeta`` path's stager (it counts that path's copies, bytes and waits)."""
    stagers: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Stagers of further paths that stage through attnmeta (e.g. ``fused``), by path."""

    def stager_of(self, path: str) -> Any:
        """The stager counting ``path``'s copies, or None for paths that upload per tensor."""
        return self.stager if path == "attnmeta" else self.stagers.get(path)


# --------------------------------------------------------------------------------------- timing
def _progress(msg: str, enabled: bool) -> None:
    if enabled:
        print(f"\r{msg:<78}", end="", file=sys.stderr, flush=True)


@contextmanager
def _profile_counts(device: torch.device) -> Iterator[dict[str, int]]:
    """On CUDA: count H2D/D2H memcpys and the synchronising runtime calls the host issued inside the
    block, from a torch.profiler trace (the profiler's own flush at the end is outside the region)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    out: dict[str, int] = {}
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function("attnmeta.bench.region"):
            yield out
        torch.cuda.synchronize(device)  # benchmark harness, outside every measured step: drains the queue
    events = prof.events()
    region = next(e for e in events if e.name == "attnmeta.bench.region")
    lo, hi = region.time_range.start, region.time_range.end
    h2d = d2h = syncs = 0
    for e in events:
        n = e.name
        if "Memcpy HtoD" in n:
            h2d += 1
        elif "Memcpy DtoH" in n:
            d2h += 1
        if n in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy") and (
            lo <= e.time_range.start <= hi
        ):
            syncs += 1
    out.update(h2d=h2d, d2h=d2h, syncs=syncs)


def _count(case: Case, path: str, device: torch.device, steps: int) -> _Counts:
    fn = case.paths[path]
    fn()  # warm
    up = case.uploads[path]
    up.copies = up.bytes = 0
    stager = case.stager_of(path)
    if stager is not None:  # the stager counts its own copies
        st = stager.stats
        copies0, bytes0 = st.copies, st.bytes
        counts = _count_run(fn, device, steps)
        return _Counts(counts.syncs, (st.copies - copies0) / steps if device.type != "cuda" else counts.h2d,
                       (st.bytes - bytes0) / steps)
    counts = _count_run(fn, device, steps)
    return _Counts(counts.syncs, counts.h2d if device.type == "cuda" else up.copies / steps, up.bytes / steps)


def _count_run(fn: PathFn, device: torch.device, steps: int) -> _Counts:
    """Syncs per step (and on CUDA H2D copies per step, from a profiler trace) over ``steps`` calls."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # benchmark harness, outside every measured step: drains the queue
        with _profile_counts(device) as prof:
            for _ in range(steps):
                fn()
        return _Counts(prof["syncs"] / steps, prof["h2d"] / steps, 0.0)
    from attnmeta.sync import record_device_syncs

    # CPU: the "device" is cpu, declared as device data, so every host read of it is recorded.
    with record_device_syncs(devices={"cpu"}, check_copies=False) as found:
        for _ in range(steps):
            fn()
    syncs = sum(1 for e in found if e.kind == "sync")
    return _Counts(syncs / steps, 0.0, 0.0)


BLOCK = 16
"""Consecutive steps of one path per timing block (see :func:`_time_case`)."""


def _time_case(case: Case, reps: int, warmup: int) -> dict[str, np.ndarray]:
    """``reps`` timed steps per path, taken in blocks of :data:`BLOCK` consecutive steps of one path,
    the blocks of the paths interleaved.

    Within a block a path runs as it would in an engine's loop, one step after the other; the
    interleaving spreads any drift of the machine's speed over every path alike. The first step of
    a block follows another path's work (cold caches): it counts, and shows in the p99.
    """
    names = list(case.paths)
    times = {n: np.empty(reps) for n in names}
    for _ in range(warmup):
        for n in names:
            case.paths[n]()
    for start in range(0, reps, BLOCK):
        stop = min(start + BLOCK, reps)
        for n in names:
            fn = case.paths[n]
            out = times[n]
            for r in range(start, stop):
                t0 = time.perf_counter_ns()
                fn()
                out[r] = (time.perf_counter_ns() - t0) / 1e3
    return times


def run_bench(
    *,
    device: str,
    scenarios: list[str] | None = None,
    quick: bool = False,
    reps: int | None = None,
    progress: bool = True,
) -> list[BenchRow]:
    """Run the scenarios and return one :class:`BenchRow` per (scenario, batch, path)."""

    dev = torch.device(device)
    # Host-side metadata work is single-threaded in an engine; torch's intra-op pool only adds jitter
    # (and, on a loaded machine, spinning threads) to the tiny ops all three paths run.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run(dev, scenarios, quick, reps, progress)
    finally:
        torch.set_num_threads(threads)


def _run(dev: torch.device, scenarios: list[str] | None, quick: bool, reps: int | None, progress: bool) -> list[BenchRow]:
    from attnmeta._bench_scenarios import SCENARIOS

    chosen = scenarios or list(SCENARIOS)
    unknown = [s for s in chosen if s not in SCENARIOS]
    if unknown:
        raise ValueError(f"unknown scenario(s) {unknown}; choose from {sorted(SCENARIOS)}")
    reps = reps or (5 if quick else 200)
    warmup = 2 if quick else 20
    rows: list[BenchRow] = []
    cases: list[Case] = []
    for s in chosen:
        cases += SCENARIOS[s](dev, quick)
    for i, case in enumerate(cases):
        _progress(f"[{i + 1}/{len(cases)}] {case.scenario} batch={case.batch}", progress)
        times = _time_case(case, reps, warmup)
        waits0 = {p: st.stats.waits for p in times if (st := case.stager_of(p)) is not None}
        for path, t in times.items():
            counts = _count(case, path, dev, 3 if quick else 10)
            st = case.stager_of(path)
            waits = st.stats.waits - waits0[path] if st is not None else 0
            rows.append(BenchRow(case.scenario, case.batch, path, float(np.median(t)),
                                 float(np.percentile(t, 99)), counts.syncs, counts.h2d, counts.bytes, waits, reps))
    _progress("", progress)
    if progress:
        print("\r", end="", file=sys.stderr)
    return rows


def format_table(rows: list[BenchRow]) -> str:
    """A readable fixed-width table, with each path's speedup over ``reference`` at the same batch."""
    ref = {(r.scenario, r.batch): r.median_us for r in rows if r.path == "reference"}
    head = f"{'scenario':<16} {'batch':>6} {'path':<11} {'median us':>10} {'p99 us':>9} {'vs ref':>7} " \
           f"{'syncs':>6} {'H2D':>5} {'bytes':>9} {'waits':>5}"
    out = [head, "-" * len(head)]
    for r in rows:
        base = ref.get((r.scenario, r.batch))
        speed = f"{base / r.median_us:6.1f}x" if base and r.path != "reference" else "      -"
        out.append(
            f"{r.scenario:<16} {r.batch:>6} {r.path:<11} {r.median_us:>10.1f} {r.p99_us:>9.1f} {speed:>7} "
            f"{r.syncs_per_step:>6.1f} {r.h2d_per_step:>5.1f} {r.bytes_per_step:>9.0f} {r.waits:>5}"
        )
    return "\n".join(out)


def _plot(rows: list[BenchRow], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scen = sorted({r.scenario for r in rows if len({x.batch for x in rows if x.scenario == r.scenario}) > 1})
    if not scen:
        scen = sorted({r.scenario for r in rows})
    fig, axes = plt.subplots(1, len(scen), figsize=(5 * len(scen), 4), squeeze=False)
    for ax, s in zip(axes[0], scen):
        for p in sorted({r.path for r in rows if r.scenario == s}):
            pts = sorted((r.batch, r.median_us) for r in rows if r.scenario == s and r.path == p)
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=p)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("batch (requests)")
        ax.set_ylabel("host us per step (median)")
        ax.set_title(s)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def script_device(doc: str | None) -> torch.device:
    """The device of a benchmark script that takes only ``--device`` (cuda if present, else cpu),
    from its command line; also sets torch to one intra-op thread, as an engine's host loop runs.

    ``doc``: the script's module docstring (its first line describes ``--help``).
    """
    ap = argparse.ArgumentParser(description=(doc or "").split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    torch.set_num_threads(1)
    return torch.device(args.device)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Register the ``bench`` sub-command's options."""
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present)")
    p.add_argument("--scenario", action="append", default=None, help="run only this scenario (repeatable)")
    p.add_argument("--quick", action="store_true", help="smoke run: few repetitions, small batches")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions per path (default 200; quick 5)")
    p.add_argument("--json", dest="json_path", default=None, help="write the rows as JSON to this file")
    p.add_argument("--plot", default=None, help="write a log-log scaling plot (PNG) to this file")
    p.add_argument("--no-progress", action="store_true", help="no progress line on stderr")


def run_from_args(args: argparse.Namespace) -> int:
    """Run the bench from parsed CLI arguments; prints the table; returns the exit status."""
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    rows = run_bench(device=device, scenarios=args.scenario, quick=args.quick, reps=args.reps,
                     progress=not args.no_progress)
    name = torch.cuda.get_device_name(0) if device.startswith("cuda") else "cpu"
    print(f"attnmeta bench on {device} ({name}); torch {torch.__version__}; host times in microseconds")
    print(format_table(rows))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({"device": device, "device_name": name, "torch": torch.__version__,
                       "rows": [dataclasses.asdict(r) for r in rows]}, f, indent=1)
    if args.plot:
        _plot(rows, args.plot)
    return 0
