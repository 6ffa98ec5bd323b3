"""What an engine's loop does to a host step: the waits before it, and a control that does the same
waits around fixed work without attnmeta (shared by bench_decode.py and bench_engine.py).

An engine's step starts after a wait (a blocking wait on the GPU for the last step's sampled tokens,
or an idle thread), while a tight loop keeps every cache and branch predictor warm. :func:`waits`
gives the three ways of the ``--cold`` modes: ``tight`` (back to back), ``event`` (about ``seconds``
of GPU work, then a blocking wait on an event recorded after it; CUDA only) and ``sleep``.
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


def waits(dev: torch.device, seconds: float) -> list[tuple[str, float, Wait]]:
    """The ``--cold`` ways, ``(name, pause, wait)``: ``tight`` (no pause), ``event`` (CUDA only) and
    ``sleep``, each pausing ``seconds``."""
    out: list[tuple[str, float, Wait]] = [("tight", 0.0, time.sleep)]
    if dev.type == "cuda":
        out.append(("event", seconds, gpu_waiter(dev)))
    out.append(("sleep", seconds, time.sleep))
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
