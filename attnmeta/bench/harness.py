"""Timing and counting: the cases a scenario hands out, and the rows measuring them gives.

A :class:`Case` is one scenario at one batch size: one callable per **path**, each performing one
whole step (from the host description of a step to device tensors and metadata objects).
:func:`measure` times the paths of each case interleaved (:func:`time_case`), then counts each
path's GPU->CPU syncs, H2D copies and bytes per step (:func:`count_path`), and returns one
:class:`BenchRow` per (scenario, batch, path).

How things are counted:

- **syncs**: on CUDA, the synchronising runtime calls (``cudaStreamSynchronize``,
  ``cudaDeviceSynchronize``, ``cudaEventSynchronize``, blocking ``cudaMemcpy``) the host issued
  inside the measured steps, from a ``torch.profiler`` trace; on CPU, the host reads of device data
  that :func:`attnmeta.sync.record_device_syncs` records with ``cpu`` declared as the device. The
  functions of :mod:`attnmeta.testing.reference` suspend that audit by design (they are oracles),
  so on CPU the syncs inside them are not seen: a reference path's CPU count is a lower bound, and
  None for the paths a case lists in :attr:`Case.oracle_paths` (which run entirely inside them);
- **H2D copies**: on CUDA, the ``Memcpy HtoD`` activities of the same trace; on CPU, the copies of
  the path's stager (:attr:`Case.stager`, :attr:`Case.stagers`) or of its :class:`Uploads` counter,
  and None (not counted) for a path that has neither;
- **bytes**: from the same stager or counter (None where neither counts them).

Examples
--------
>>> import torch
>>> calls = []
>>> case = Case("toy", 1, {"a": lambda: calls.append(1)}, {"a": Uploads()})
>>> times = time_case(case, reps=3, warmup=1)
>>> times["a"].shape, len(calls)
((3,), 4)
>>> count_path(case, "a", torch.device("cpu"), steps=2)
Counts(syncs=0.0, h2d=0.0, bytes=0.0)
"""

from __future__ import annotations

import dataclasses
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import numpy as np
import torch

# The baselines upload attnmeta's host arrays (read-only views) and BatchSpec's read-only vectors with
# ``torch.as_tensor``, which warns that the tensor could be written through; they only read them.
warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning,
                        module=r"attnmeta\.bench\.")

__all__ = [
    "BLOCK",
    "BenchRow",
    "Case",
    "Counts",
    "PathFn",
    "Uploads",
    "blocking_uploader",
    "count_path",
    "measure",
    "pinned_uploader",
    "time_case",
]

PathFn = Callable[[], Any]
"""One path of a case: each call performs one whole step."""


class Uploads:
    """Counter of the H2D copies a benchmark path issues itself (the CPU counting pass reads it).

    Examples
    --------
    >>> import numpy as np
    >>> up = Uploads()
    >>> up.add(np.zeros(4, np.int32)); up.add(np.zeros(2, np.int64))
    >>> up.copies, up.bytes
    (2, 32)
    """

    def __init__(self) -> None:
        self.copies = 0
        """Copies counted so far."""
        self.bytes = 0
        """Bytes of those copies."""

    def add(self, t: torch.Tensor | np.ndarray) -> None:
        """Count one copy of ``t``'s bytes."""
        self.copies += 1
        self.bytes += int(t.nbytes)


def pinned_uploader(device: torch.device, counter: Uploads) -> Callable[[np.ndarray], torch.Tensor]:
    """Per-tensor upload the way vLLM's ``async_tensor_h2d`` does it: a freshly pinned tensor per
    array and a non-blocking copy (race-free; one allocation and one copy per array). On a CPU
    device, a clone.

    Parameters
    ----------
    device : torch.device
        Where the uploads go.
    counter : Uploads
        Counts every upload.

    Returns
    -------
    callable
        ``up(array) -> tensor`` on ``device``.
    """
    pin = device.type == "cuda"

    def up(a: np.ndarray) -> torch.Tensor:
        counter.add(a)
        t = torch.from_numpy(np.ascontiguousarray(a))
        if pin:
            return t.pin_memory().to(device, non_blocking=True)
        return t.clone()

    return up


def blocking_uploader(device: torch.device, counter: Uploads) -> Callable[[np.ndarray], torch.Tensor]:
    """The engine-style upload of raw inputs: ``torch.as_tensor(array, device=...)``, a blocking copy
    from pageable memory.

    Parameters
    ----------
    device : torch.device
        Where the uploads go.
    counter : Uploads
        Counts every upload.

    Returns
    -------
    callable
        ``up(array) -> tensor`` on ``device``.
    """

    def up(a: np.ndarray) -> torch.Tensor:
        counter.add(a)
        return torch.as_tensor(a, device=device)  # (read-only inputs: read, never written; see below)

    return up


@dataclasses.dataclass
class Case:
    """A scenario at one batch size: one callable per path, each performing one whole step.

    A path's copies and bytes are counted by its stager (``attnmeta``: :attr:`stager`; others:
    :attr:`stagers`), else by its :class:`Uploads` counter in :attr:`uploads` (on CPU), else not at
    all (reported as None).
    """

    scenario: str
    """Scenario name (the ``--scenario`` name, or a name of its own for a sub-case)."""
    batch: int
    """Batch size (requests) the rows report."""
    paths: dict[str, PathFn]
    """The paths by name, in the order they are timed and reported."""
    uploads: dict[str, Uploads]
    """Upload counters of the paths that upload per tensor, by path."""
    stager: Any = None
    """The ``attnmeta`` path's stager (it counts that path's copies, bytes and waits)."""
    stagers: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Stagers of further paths that stage through attnmeta (e.g. ``fused``), by path."""
    oracle_paths: frozenset[str] = frozenset()
    """Paths that run entirely inside :mod:`attnmeta.testing.reference` functions, whose syncs the
    CPU counting pass cannot see (reported as None there; the CUDA trace counts them)."""

    def stager_of(self, path: str) -> Any:
        """The stager counting ``path``'s copies, or None for paths that upload per tensor."""
        return self.stager if path == "attnmeta" else self.stagers.get(path)


@dataclasses.dataclass(frozen=True)
class BenchRow:
    """One (scenario, batch, path) measurement; times in host microseconds per step."""

    scenario: str
    batch: int
    path: str
    median_us: float
    p99_us: float
    syncs_per_step: float | None
    """None: not counted (a path of :attr:`Case.oracle_paths` on a CPU device)."""
    h2d_per_step: float | None
    """None: not counted (a path on a CPU device that counts neither through a stager nor an
    :class:`Uploads` counter)."""
    bytes_per_step: float | None
    """None: not counted (as :attr:`h2d_per_step`)."""
    waits: int
    """Times the path's stager waited for a ring slot while the path was timed (warm-up included)."""
    reps: int
    """Timed steps."""


@dataclasses.dataclass(frozen=True)
class Counts:
    """Syncs, H2D copies and bytes per step of one path (see the module docstring)."""

    syncs: float | None
    h2d: float | None
    bytes: float | None


BLOCK = 16
"""Consecutive steps of one path per timing block (see :func:`time_case`)."""


def time_case(case: Case, reps: int, warmup: int) -> dict[str, np.ndarray]:
    """Time ``reps`` steps of every path of ``case``, in blocks of :data:`BLOCK` consecutive steps
    of one path, the blocks of the paths interleaved.

    Within a block a path runs as it would in an engine's loop, one step after the other; the
    interleaving spreads any drift of the machine's speed over every path alike. The first step of
    a block follows another path's work (cold caches): it counts, and shows in the p99.

    Parameters
    ----------
    case : Case
        The paths to time.
    reps : int
        Timed steps per path.
    warmup : int
        Untimed steps per path first.

    Returns
    -------
    dict of str to numpy.ndarray
        Per path, the ``(reps,)`` host microseconds of each step.
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


@contextmanager
def _profile_counts(device: torch.device) -> Iterator[dict[str, int]]:
    """On CUDA: count H2D/D2H memcpys and the synchronising runtime calls the host issued inside the
    block, from a torch.profiler trace (the profiler's own flush at the end is outside the region)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    out: dict[str, int] = {}
    with ExitStack() as stack:
        with warnings.catch_warnings():  # starting warns that a cycle clears its events: there is one cycle
            warnings.filterwarnings("ignore", message=".*Profiler clears events", category=UserWarning)
            prof = stack.enter_context(profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]))
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


def _count_run(fn: PathFn, device: torch.device, steps: int) -> tuple[float, float | None]:
    """(syncs per step, H2D copies per step on CUDA else None) over ``steps`` calls of ``fn``."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # benchmark harness, outside every measured step: drains the queue
        with _profile_counts(device) as prof:
            for _ in range(steps):
                fn()
        return prof["syncs"] / steps, prof["h2d"] / steps
    from attnmeta.sync import record_device_syncs

    # CPU: the "device" is cpu, declared as device data, so every host read of it is recorded.
    with record_device_syncs(devices={"cpu"}, check_copies=False) as found:
        for _ in range(steps):
            fn()
    return sum(1 for e in found if e.kind == "sync") / steps, None


def count_path(case: Case, path: str, device: torch.device, steps: int) -> Counts:
    """Syncs, H2D copies and bytes per step of one path of ``case`` over ``steps`` steps (after
    one untimed step).

    Parameters
    ----------
    case : Case
        The case.
    path : str
        One of ``case.paths``.
    device : torch.device
        The case's device (``cuda``: counted from a profiler trace; else the CPU counting pass).
    steps : int
        Steps counted.

    Returns
    -------
    Counts
        Per step; copies and bytes None where nothing counts them.
    """
    fn = case.paths[path]
    fn()  # warm
    hidden = device.type != "cuda" and path in case.oracle_paths
    stager = case.stager_of(path)
    if stager is not None:  # the stager counts its own copies
        st = stager.stats
        copies0, bytes0 = st.copies, st.bytes
        seen, h2d = _count_run(fn, device, steps)
        return Counts(None if hidden else seen, h2d if h2d is not None else (st.copies - copies0) / steps,
                      (st.bytes - bytes0) / steps)
    up = case.uploads.get(path)
    if up is not None:
        up.copies = up.bytes = 0
    seen, h2d = _count_run(fn, device, steps)
    syncs = None if hidden else seen
    if up is None:
        return Counts(syncs, h2d, None)
    return Counts(syncs, h2d if h2d is not None else up.copies / steps, up.bytes / steps)


def _progress(msg: str, enabled: bool) -> None:
    """``msg`` on stderr: over the last one on a terminal, else (a log, a pipe) on a line of its own."""
    if not enabled:
        return
    if sys.stderr.isatty():
        print(f"\r{msg:<78}", end="", file=sys.stderr, flush=True)
    elif msg:
        print(msg, file=sys.stderr, flush=True)


def measure(cases: list[Case], device: torch.device, *, reps: int, warmup: int, count_steps: int,
            progress: bool = False) -> list[BenchRow]:
    """Time and count every path of every case; one :class:`BenchRow` per (case, path).

    Parameters
    ----------
    cases : list of Case
        What to measure, in order.
    device : torch.device
        The cases' device.
    reps : int
        Timed steps per path (:func:`time_case`).
    warmup : int
        Untimed steps per path before timing.
    count_steps : int
        Steps per path of the counting pass (:func:`count_path`), after the timing.
    progress : bool, default False
        Print a progress line on stderr.

    Returns
    -------
    list of BenchRow
        In the order of ``cases`` and of each case's paths.
    """
    rows: list[BenchRow] = []
    for i, case in enumerate(cases):
        _progress(f"[{i + 1}/{len(cases)}] {case.scenario} batch={case.batch}", progress)
        waits0 = {p: st.stats.waits for p in case.paths if (st := case.stager_of(p)) is not None}
        times = time_case(case, reps, warmup)
        waits = {p: st.stats.waits - waits0[p] for p in case.paths if (st := case.stager_of(p)) is not None}
        for path, t in times.items():
            counts = count_path(case, path, device, count_steps)
            rows.append(BenchRow(case.scenario, case.batch, path, float(np.median(t)), float(np.percentile(t, 99)),
                                 counts.syncs, counts.h2d, counts.bytes, waits.get(path, 0), reps))
    if progress and sys.stderr.isatty():  # (clear the terminal's progress line)
        _progress("", progress)
        print("\r", end="", file=sys.stderr)
    return rows
