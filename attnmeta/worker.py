"""A thread of its own for a serving loop's metadata call, so that its working set stays in a core's caches.

Why
---
An engine's step builds its metadata between two GPU waits, after the previous step's forward launched
hundreds of kernels from the same thread. That work evicts the step composer's working set (its
recorded layouts, templates, numba dispatchers, the slot's pinned bytes) from the core's caches, so
the composer's call in the loop costs two to five times the same call back to back
(docs/benchmarks.md, "The fused step against the composable one, warm and after a wait"). A
:class:`HostWorker` runs the call on a thread that does nothing else, on another core: the engine's
thread hands it the call and waits; the worker's core still holds what the last call touched.

How
---
The hand-off never takes a lock and never sleeps. The two threads share a small int64 array of
counters; each waits for the other's counter in compiled code that has released the GIL (yielding
the core to the OS scheduler between reads), so the thread that runs Python always holds the GIL
alone: the caller posts the call and waits without the GIL, the worker sees it, takes the GIL, runs
the call, stores the result, releases the GIL and posts that it is done. After a call the worker keeps
polling for ``spin_s`` seconds (a core kept busy: the cost of the trick), then polls every 50 us with
the thread asleep in between, so an idle engine does not hold a core.

Semantics
---------
``worker.call(fn, *args, **kwargs)`` returns ``fn(*args, **kwargs)`` or raises what it raised; the
caller's sync audit (:mod:`attnmeta.sync`) and torch's inference mode apply to the call as if it ran
on the caller's thread. Calls run one at a time, in the order made, from one thread at a time. Under
``NUMBA_DISABLE_JIT=1`` (no compiled polling) every call runs on the caller's thread.

Examples
--------
>>> from attnmeta.worker import HostWorker
>>> with HostWorker() as worker:
...     worker.call(sum, [1, 2, 3]), worker.calls
(6, 1)
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import numba
import numpy as np
import torch

from attnmeta._numba import njit_uncached
from attnmeta.sync import carry_audit, current_audit

__all__ = ["HostWorker"]

R = TypeVar("R")

_GO, _DONE, _STOP = 0, 1, 2  # the shared counters: calls posted, calls done, stop asked
_DOZE_US = 50  # after its spin, the worker's poll interval (us)
_CHECK_S = 0.1  # a waiting caller returns to Python this often (signals, the worker's liveness)


def _libc_functions() -> tuple[Any, Any] | None:
    """libc's ``sched_yield`` and ``usleep`` as ctypes functions, or None where there are none."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        sched_yield, usleep = libc.sched_yield, libc.usleep
    except (OSError, AttributeError, TypeError):
        return None
    sched_yield.argtypes, sched_yield.restype = [], ctypes.c_int
    usleep.argtypes, usleep.restype = [ctypes.c_uint], ctypes.c_int
    return sched_yield, usleep


_LIBC = _libc_functions()

if _LIBC is not None:
    _sched_yield, _usleep = _LIBC

    @njit_uncached
    def _post_and_wait(flags: np.ndarray, post_at: int, value: int, wait_at: int, target: int, spin: int,
                       limit: int) -> int:  # pragma: no cover (compiled)
        """Store ``value`` at ``flags[post_at]``, then wait until ``flags[wait_at] >= target`` (1) or a
        stop is asked (2): ``spin`` polls with a yield of the core between them, then polls 50 us apart;
        0 after ``limit`` polls (``limit < 0``: no limit). Runs without the GIL, so the store happens
        after this thread released it. (The calls to libc between two reads keep the compiler from
        reading the counter once.)"""
        flags[post_at] = value
        n = 0
        while True:
            if flags[wait_at] >= target:
                return 1
            if flags[_STOP] != 0:
                return 2
            if 0 <= limit <= n:
                return 0
            if n < spin:
                _sched_yield()
            else:
                _usleep(_DOZE_US)
            n += 1


class _Shared:
    """What the caller and the worker thread share (the worker holds this, never the HostWorker, so that
    dropping the HostWorker stops its thread)."""

    __slots__ = ("error", "flags", "job", "result", "spin")

    def __init__(self, spin: int) -> None:
        self.flags = np.zeros(3, np.int64)
        self.spin = spin
        self.job: tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any], Any, bool] | None = None
        self.result: Any = None
        self.error: BaseException | None = None


def _serve(shared: _Shared, cpu: int | None, started: threading.Event, failed: list[BaseException]) -> None:
    """The worker thread: pin itself to ``cpu``, then run each posted call until a stop is asked."""
    try:
        if cpu is not None:
            os.sched_setaffinity(0, {cpu})  # (0: this thread)
    except BaseException as e:  # (reported by the constructor)
        failed.append(e)
        started.set()
        return
    started.set()
    flags, done = shared.flags, 0
    while _post_and_wait(flags, _DONE, done, _GO, done + 1, shared.spin, -1) == 1:
        done += 1
        job, shared.job = shared.job, None
        assert job is not None
        fn, args, kwargs, audit, inference = job
        try:
            if audit is None and not inference:
                shared.result = fn(*args, **kwargs)
            else:
                with carry_audit(audit), torch.inference_mode() if inference else contextlib.nullcontext():
                    shared.result = fn(*args, **kwargs)
        except BaseException as e:  # (raised in the caller's thread)
            shared.error = e
        del job, fn, args, kwargs


def _stop(flags: np.ndarray) -> None:
    """Ask the worker thread to stop (it sees it within one poll)."""
    flags[_STOP] = 1


class HostWorker:
    """Runs a serving loop's metadata calls on a thread of its own (see the module docstring).

    Parameters
    ----------
    cpu : int, optional
        Pin the worker thread to this CPU (``os.sched_setaffinity``; Linux). Default: where the OS
        puts it. Pin the engine's own thread elsewhere, or leave both to the OS.
    spin_s : float, default 0.1
        How long the worker keeps polling at full speed after a call (its core stays busy), before it
        polls every 50 us asleep. A loop whose steps come more often than this keeps the worker's core
        busy all the time: one core is the cost of the worker.
    name : str, default "attnmeta-host-worker"
        The thread's name.

    Notes
    -----
    Give a :class:`~attnmeta.compose.StepBuilder` the worker (``StepBuilder(..., worker=HostWorker())``)
    and its ``build`` and ``build_counts`` run there, or call :meth:`call` with any function. The
    objects a call returns are the caller's as usual: the worker keeps no reference to them. A call from
    the worker thread itself runs at once, in place.

    Raises
    ------
    ValueError
        ``cpu`` is not one of this process's CPUs, or given where threads cannot be pinned;
        ``spin_s`` is negative.
    """

    def __init__(self, *, cpu: int | None = None, spin_s: float = 0.1, name: str = "attnmeta-host-worker") -> None:
        if cpu is not None:
            count = os.cpu_count() or 1
            if not hasattr(os, "sched_setaffinity"):
                raise ValueError(f"HostWorker(cpu={cpu!r}): this platform pins no threads; leave cpu to the OS")
            if isinstance(cpu, bool) or not isinstance(cpu, int) or not 0 <= cpu < count:
                raise ValueError(f"HostWorker(cpu={cpu!r}): expected a CPU number in [0, {count})")
        if not isinstance(spin_s, (int, float)) or isinstance(spin_s, bool) or not spin_s >= 0:
            raise ValueError(f"HostWorker(spin_s={spin_s!r}): expected seconds >= 0")
        self._cpu, self._spin_s, self._calls = cpu, float(spin_s), 0
        self._lock = threading.Lock()
        self._caller: int | None = None
        self._inline = _LIBC is None or bool(numba.config.DISABLE_JIT)  # type: ignore[attr-defined]
        self._thread: threading.Thread | None = None
        self._ident: int | None = None
        self._closed = False
        rate = 1.0 if self._inline else _yields_per_second()
        self._check = max(1, int(rate * _CHECK_S))  # the caller's polls between two returns to Python
        self._shared = _Shared(int(rate * self._spin_s))
        if self._inline:
            return
        started, failed = threading.Event(), list[BaseException]()
        t = threading.Thread(target=_serve, args=(self._shared, cpu, started, failed), name=name, daemon=True)
        t.start()
        started.wait()
        if failed:
            t.join()
            raise ValueError(f"HostWorker(cpu={cpu!r}): the thread could not be pinned: {failed[0]}") from failed[0]
        self._thread, self._ident = t, t.ident
        self._finalizer = weakref.finalize(self, _stop, self._shared.flags)

    @property
    def calls(self) -> int:
        """Calls made so far (those run in place included)."""
        return self._calls

    @property
    def threaded(self) -> bool:
        """False when every call runs on the caller's thread (``NUMBA_DISABLE_JIT=1``, or no libc)."""
        return not self._inline

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def call(self, fn: Callable[..., R], /, *args: Any, **kwargs: Any) -> R:
        """``fn(*args, **kwargs)``, run on the worker thread; the caller waits for it.

        Raises
        ------
        RuntimeError
            The worker is closed, its thread is gone, or another thread's call is running.
        BaseException
            Whatever ``fn`` raised (a ``KeyboardInterrupt`` that reaches the waiting caller is raised
            once the call has finished).
        """
        if self._closed:
            raise RuntimeError("HostWorker.call(): the worker is closed")
        self._calls += 1
        if self._inline or threading.get_ident() == self._ident:
            return fn(*args, **kwargs)
        if not self._lock.acquire(False):
            raise RuntimeError(f"HostWorker.call(): thread {threading.current_thread().name!r} called while another "
                               f"thread's call runs; a HostWorker serves one thread at a time")
        try:
            return self._run(fn, args, kwargs)
        finally:
            self._lock.release()

    def _run(self, fn: Callable[..., R], args: tuple[Any, ...], kwargs: dict[str, Any]) -> R:
        sh = self._shared
        sh.job = (fn, args, kwargs, current_audit(), torch.is_inference_mode_enabled())
        n = int(sh.flags[_GO]) + 1
        check, interrupted = self._check, None
        while True:
            try:
                code = _post_and_wait(sh.flags, _GO, n, _DONE, n, check, check)
                if code == 1:
                    break
                if code == 2 or self._thread is None or not self._thread.is_alive():
                    sh.job = None
                    raise RuntimeError("HostWorker.call(): the worker thread stopped before the call finished")
            except KeyboardInterrupt as e:  # (the call still runs: wait for it, then raise)
                interrupted = e
        out, err = sh.result, sh.error
        sh.result = sh.error = None
        if interrupted is not None:
            raise interrupted
        if err is not None:
            try:
                raise err
            finally:
                del err
        return out  # type: ignore[no-any-return]

    def close(self) -> None:
        """Stop the worker thread (after the running call, if any). Calls afterwards raise."""
        if self._closed:
            return
        with self._lock:
            self._closed = True
            if self._thread is not None:
                self._finalizer()
                self._thread.join()

    def __enter__(self) -> HostWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        where = "in place" if self._inline else ("unpinned" if self._cpu is None else f"cpu={self._cpu}")
        state = ", closed" if self._closed else ""
        return f"HostWorker({where}, spin_s={self._spin_s}, calls={self._calls}{state})"


def _yields_per_second() -> float:
    """How many of the worker's polls (a read and a yield of the core) run in a second, measured once a
    process (the first call also compiles the polling function)."""
    global _RATE
    if _RATE is None:
        flags = np.zeros(3, np.int64)
        _post_and_wait(flags, _GO, 0, _DONE, 1, 10, 10)  # (compile)
        polls = 2000
        t0 = time.perf_counter()
        _post_and_wait(flags, _GO, 0, _DONE, 1, polls, polls)
        _RATE = polls / max(time.perf_counter() - t0, 1e-9)
    return _RATE


_RATE: float | None = None
