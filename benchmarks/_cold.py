"""What an engine's loop does to a host step: the waits before it, and a control that does the same
waits around fixed work without attnmeta (shared by bench_decode.py and bench_engine.py).

An engine's step starts after a wait (a blocking wait on the GPU for the last step's sampled tokens,
or an idle thread), while a tight loop keeps every cache and branch predictor warm. :func:`waits`
gives the four ways of the ``--cold`` modes: ``tight`` (back to back), ``event`` (about ``seconds``
of GPU work, then a blocking wait on an event recorded after it; CUDA only), ``sleep``, and
``thrash`` (:func:`thrash`: what an engine's own work between two steps does to the caches, on any
machine, so a CPU-only run sees the loop's cold step too).
:func:`jitter` is the control: plain Python additions calibrated to a given warm time, the same work
every call, so its cold / tight ratio is the machine's floor for any host code after such a wait.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

Wait = Callable[[float], None]


def gpu_waiter(dev: torch.device) -> Wait:
    """``wait(seconds)``: about that much GPU work on the current stream, then a blocking wait on an
    event recorded after it (the host blocks on the GPU, as an engine's on its last step's sampled
    tokens). On a CPU device a sleep."""
    if dev.type != "cuda":
        return time.sleep
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    rate = torch.cuda.get_device_properties(dev).clock_rate * 1e3  # cycles per second (kHz -> Hz)

    def wait(seconds: float) -> None:
        torch.cuda._sleep(int(seconds * rate))  # type: ignore[no-untyped-call]
        event.record()
        event.synchronize()  # harness only: the wait before the step, not timed

    return wait


def spin(seconds: float) -> None:
    """Busy-wait ``seconds`` on the clock (the thread stays on its core, busy)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


_THRASH_BYTES = 64 << 20
_thrash_state: list[Any] = []


def thrash(seconds: float = 0.0) -> None:
    """Leave the caches as an engine's loop leaves them before its next step: write one byte of every
    cache line of 64 MiB (more than a server CPU's last-level cache) and read 20,000 small dicts (the
    scattered Python objects of a scheduler and a model's launch code). ``seconds`` is ignored (the
    work takes what it takes, a few ms); the buffers are made on the first call."""
    if not _thrash_state:
        _thrash_state.extend((np.zeros(_THRASH_BYTES, np.uint8), [{i: str(i)} for i in range(20_000)]))
    buf, objs = _thrash_state
    buf[::64] += 1
    total = 0
    for d in objs:
        total += len(d)


def waits(dev: torch.device, seconds: float) -> list[tuple[str, float, Wait]]:
    """The ``--cold`` ways, ``(name, pause, wait)``: ``tight`` (no pause), ``event`` (CUDA only),
    ``sleep``, each pausing ``seconds``, and ``thrash`` (:func:`thrash`)."""
    out: list[tuple[str, float, Wait]] = [("tight", 0.0, time.sleep)]
    if dev.type == "cuda":
        out.append(("event", seconds, gpu_waiter(dev)))
    out.append(("sleep", seconds, time.sleep))
    out.append(("thrash", seconds, thrash))
    return out


def median_us(fn: Callable[[], Any], calls: int) -> float:
    """The median time of ``calls`` consecutive calls of ``fn``, us (garbage collection off)."""
    ts = np.empty(calls)
    gc.disable()
    try:
        for i in range(calls):
            t0 = time.perf_counter_ns()
            fn()
            ts[i] = time.perf_counter_ns() - t0
    finally:
        gc.enable()
    return float(np.median(ts)) / 1e3


def jitter(target_us: float) -> Callable[[], int]:
    """A loop of Python additions whose median time, back to back, is about ``target_us``
    (calibrated here, at the machine's present speed), the same work every call."""

    def work(n: int) -> int:
        x = 0
        for i in range(n):
            x += i
        return x

    probe = 4096
    per_iter = median_us(lambda: work(probe), 200) / probe
    n = max(1, round(target_us / per_iter))
    return lambda: work(n)


def timed_after(calls: list[Callable[[], Any]], pause: float, wait: Wait) -> np.ndarray:
    """Each of ``calls`` timed once (us), each right after ``wait(pause)`` (none when ``pause`` is 0);
    garbage collection off."""
    ts = np.empty(len(calls))
    gc.disable()
    try:
        for i, fn in enumerate(calls):
            if pause:
                wait(pause)
            t0 = time.perf_counter_ns()
            fn()
            ts[i] = (time.perf_counter_ns() - t0) / 1e3
    finally:
        gc.enable()
    return ts
