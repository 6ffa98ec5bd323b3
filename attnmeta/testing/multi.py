"""Testing several devices: replicas of metadata, and the shared ring's race test.

:func:`assert_replica` checks that one device's metadata is another's on other memory (what
:meth:`attnmeta.staging.MultiStager.view` and a ring reader hand out).

The race test asks: does any reader of a shared ring ever read a slot that was rewritten under it?

One writer (:func:`run_writer`) stages, step after step, fields of random values that depend only
on the step's number and a seed (:func:`step_fields`) into a :class:`~attnmeta.staging.shared.SharedRing`
and publishes them; each reader (:func:`run_reader`, one process each) receives every step and
checks, against the values it recomputes from the step's number:

- its **device** copy, in stream order right after the copy (a checksum of the step's device views);
- the step's **host** views of the shared slot, when it receives the step and again just before the
  step expires (the last moment the protocol lets it read them).

The readers' copies are **held back**, as a busy GPU holds a stream: on the CPU a
:class:`HeldCopyEngine` runs copies on a worker thread that sleeps every few copies; on CUDA the
reader enqueues ``torch.cuda._sleep`` on its stream every few steps. A writer that fences (the
protocol) must give zero torn steps; a writer made with ``_unsafe_disable_fencing=True`` (it waits
until readers have *received* a step, not until they *released* it) must give torn steps, or the
test proves nothing. tests/staging/test_shared.py runs it with spawned processes on the CPU,
tests/gpu/test_multi_cuda.py on two GPUs.

These are test helpers: they read device data back (once, at the end, on CUDA).
"""

from __future__ import annotations

import collections
import dataclasses
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from attnmeta.staging.shared import RingOverrunError, RingReader, RingWriter, SharedRing

__all__ = ["HeldCopyEngine", "assert_replica", "host_checksum", "random_fields", "run_reader", "run_writer", "step_fields"]

_NAMES = ("qsl", "seq_lens", "slots", "mask")


def _tensors(obj: Any, out: list[tuple[str, torch.Tensor]], path: str, seen: set[int]) -> None:
    """Every tensor in a metadata tree, with its path (containers visited once)."""
    if isinstance(obj, torch.Tensor):
        out.append((path, obj))
        return
    if isinstance(obj, np.ndarray | str | int | float) or obj is None or id(obj) in seen:
        return
    seen.add(id(obj))
    if dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            _tensors(getattr(obj, f.name), out, f"{path}.{f.name}", seen)
    elif isinstance(obj, tuple | list):
        for i, v in enumerate(obj):
            _tensors(v, out, f"{path}[{i}]", seen)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _tensors(v, out, f"{path}[{k!r}]", seen)


def assert_replica(primary: Any, replica: Any, *, shared_host: bool = True) -> int:
    """Assert that ``replica`` is ``primary``'s metadata on another device: the same tree, every
    device tensor of the same shape, dtype, strides and values in other memory.

    Parameters
    ----------
    primary, replica : metadata objects (or containers of them)
        ``replica`` from :meth:`attnmeta.staging.MultiStager.view` or a ring reader.
    shared_host : bool, default True
        Also assert that the top object's host arrays are the very same arrays (one process, one
        pinned slot); False for another process's (equal values, other objects).

    Returns
    -------
    int
        The device tensors compared.

    Raises
    ------
    AssertionError
        Naming the first field that differs.
    """
    a: list[tuple[str, torch.Tensor]] = []
    b: list[tuple[str, torch.Tensor]] = []
    _tensors(primary, a, "", set())
    _tensors(replica, b, "", set())
    assert [p for p, _ in a] == [p for p, _ in b], f"different trees: {[p for p, _ in a]} != {[p for p, _ in b]}"
    for (path, x), (_, y) in zip(a, b):
        assert (x.shape, x.dtype, x.stride()) == (y.shape, y.dtype, y.stride()), path
        if x.numel() and x.device.type != "meta":
            assert x.untyped_storage().data_ptr() != y.untyped_storage().data_ptr(), f"{path}: the same memory"
            assert torch.equal(x.cpu(), y.cpu()), f"{path}: {x} != {y}"  # test-only read-back
    if dataclasses.is_dataclass(primary):
        for f in dataclasses.fields(primary):
            v = getattr(primary, f.name)
            if isinstance(v, np.ndarray):
                w = getattr(replica, f.name)
                if shared_host:
                    assert w is v, f"{f.name}: host arrays are shared (one pinned slot)"
                else:
                    np.testing.assert_array_equal(w, v, err_msg=f.name)
    return len(a)


def step_fields(number: int, seed: int) -> dict[str, np.ndarray]:
    """The fields the writer stages for step ``number``: a function of ``(seed, number)`` only.

    Parameters
    ----------
    number : int
        The step's number (1, 2, ...).
    seed : int
        The run's seed.

    Returns
    -------
    dict of str to numpy.ndarray
        ``qsl`` (B + 1,) int32, ``seq_lens`` (B,) int32, ``slots`` (T,) int64, ``mask`` (B,) bool, host,
        with 1 <= B < 64 and B <= T < 512 drawn too.
    """
    return random_fields(np.random.default_rng([seed, number]))


def random_fields(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """The fields of :func:`step_fields`, drawn from ``rng`` (host arrays; the same shapes and dtypes)."""
    b = int(rng.integers(1, 64))
    t = int(rng.integers(b, 512))
    return {
        "qsl": np.concatenate([[0], np.cumsum(rng.integers(0, 9, size=b))]).astype(np.int32),
        "seq_lens": rng.integers(0, 1 << 20, size=b).astype(np.int32),
        "slots": rng.integers(-1, 1 << 40, size=t).astype(np.int64),
        "mask": rng.integers(0, 2, size=b).astype(np.bool_),
    }


def host_checksum(arrays: list[np.ndarray]) -> int:
    """Position-weighted checksum of host arrays, modulo 2**64 (equal to :func:`_device_checksum`'s).

    Parameters
    ----------
    arrays : list of numpy.ndarray
        Integer or bool arrays.

    Returns
    -------
    int
    """
    total = 0
    for a in arrays:
        flat = a.reshape(-1).astype(np.int64)
        w = np.arange(1, flat.shape[0] + 1, dtype=np.int64)
        total += int((flat * w).sum())
    return total & ((1 << 64) - 1)


def _device_checksum(views: list[torch.Tensor], weights: torch.Tensor) -> torch.Tensor:
    """The same checksum of device tensors, by device ops only (an int64 scalar tensor)."""
    total = torch.zeros((), dtype=torch.int64, device=weights.device)
    for v in views:
        flat = v.reshape(-1).to(torch.int64)
        total = total + (flat * weights[: flat.shape[0]]).sum()
    return total


class HeldCopyEngine:
    """A :class:`~attnmeta.staging.shared.CopyEngine` for CPU readers that behaves like a held CUDA
    stream: copies (and work enqueued with :meth:`run`) execute in order on a worker thread, which
    sleeps ``hold_seconds`` before every ``hold_every``-th item.

    Parameters
    ----------
    hold_every : int, default 8
        Items between holds.
    hold_seconds : float, default 0.002
        Length of a hold.
    """

    def __init__(self, hold_every: int = 8, hold_seconds: float = 0.002) -> None:
        self.hold_every = hold_every
        self.hold_seconds = hold_seconds
        self._queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._count = 0
        self._thread = threading.Thread(target=self._work, name="held-copy-engine", daemon=True)
        self._thread.start()

    def _work(self) -> None:
        n = 0
        while True:
            item = self._queue.get()
            if item is None:
                return
            n += 1
            if n % self.hold_every == 0:
                time.sleep(self.hold_seconds)
            item()

    def copy(self, dst: torch.Tensor, src: torch.Tensor, slot: int) -> threading.Event:
        """Enqueue ``dst.copy_(src)``; the returned event is set once it has run."""
        done = threading.Event()

        def job() -> None:
            dst.copy_(src)
            done.set()

        self._queue.put(job)
        return done

    def done(self, fence: Any) -> bool:
        """Whether the copy that returned ``fence`` has run."""
        return fence is None or bool(fence.is_set())

    def run(self, fn: Callable[[], None]) -> None:
        """Enqueue ``fn`` after everything enqueued so far (stream order)."""
        self._queue.put(fn)

    def drain(self) -> None:
        """Wait until everything enqueued so far has run."""
        ev = threading.Event()
        self._queue.put(ev.set)
        ev.wait()

    def close(self) -> None:
        """Stop the worker (after what is enqueued)."""
        self._queue.put(None)
        self._thread.join()


def run_writer(ring: SharedRing, steps: int, seed: int, *, device: str = "cpu", fencing: bool = True,
               timeout: float = 120.0) -> dict[str, float]:
    """Stage and publish ``steps`` steps of :func:`step_fields` into ``ring``, then close it.

    Parameters
    ----------
    ring : SharedRing
        Created with the readers' count.
    steps : int
        Steps to write.
    seed : int
        The run's seed (the readers' too).
    device : str, default "cpu"
        The writer's own device.
    fencing : bool, default True
        False: the control, ``RingWriter(..., _unsafe_disable_fencing=True)``.
    timeout : float, default 120
        The writer's wait limit per slot.

    Returns
    -------
    dict
        ``published``, ``waits``, ``wait_seconds``, ``seconds``.
    """
    writer = RingWriter(ring, device, timeout=timeout, _unsafe_disable_fencing=not fencing)
    t0 = time.perf_counter()
    for n in range(1, steps + 1):
        data = step_fields(n, seed)
        with writer.step() as step:
            assert step.number == n
            for name in _NAMES:
                arr = data[name]
                step.alloc(name, arr.shape, arr.dtype)[...] = arr
        writer.publish()
    writer.close()
    st = writer.ring_stats
    return {"published": float(st.published), "waits": float(st.waits), "wait_seconds": st.wait_seconds,
            "seconds": time.perf_counter() - t0}


def run_reader(name: str, reader: int, seed: int, *, device: str = "cpu", hold_every: int = 8,
               hold_seconds: float = 0.002, timeout: float = 120.0) -> dict[str, int]:
    """Receive every step of the ring ``name`` as reader ``reader`` and count torn ones.

    Parameters
    ----------
    name : str
        :attr:`SharedRing.name` (attached here: run it in a process of its own).
    reader : int
        This reader's number.
    seed : int
        The writer's seed.
    device : str, default "cpu"
        The reader's device: ``cpu`` (copies held by a :class:`HeldCopyEngine`) or ``cuda:n`` (the
        stream held by ``torch.cuda._sleep``).
    hold_every : int, default 8
        Steps (CPU: copies) between holds.
    hold_seconds : float, default 0.002
        Length of a hold.
    timeout : float, default 120
        Wait limit for the writer.

    Returns
    -------
    dict
        ``steps`` received; ``torn_device`` (a device copy that differs from the step's values),
        ``torn_host`` (a host view that differs when received or just before it expires) and
        ``overruns`` (a slot found already holding a later step).
    """
    ring = SharedRing.attach(name)
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.set_device(dev)  # the holds go to this device's stream, where the copies are
    engine = None if cuda else HeldCopyEngine(hold_every, hold_seconds)
    rd = RingReader(ring, reader, dev, copier=engine, timeout=timeout)
    out = {"steps": 0, "torn_device": 0, "torn_host": 0, "overruns": 0}
    held: collections.deque[tuple[Any, int]] = collections.deque()
    weights = torch.arange(1, 4096 + 1, dtype=torch.int64, device=dev)
    log: list[tuple[int, torch.Tensor]] = []  # CUDA: (expected, device checksum), read back at the end
    lock = threading.Lock()
    sleep_cycles = int(hold_seconds * 1e9)  # ~1 cycle/ns on current GPUs
    try:
        while True:
            if len(held) >= rd.hold:  # the oldest held step expires at the next receive: read it once more
                st, want = held.popleft()
                if host_checksum([st.host(n) for n in _NAMES]) != want:
                    out["torn_host"] += 1
            if cuda and out["steps"] % hold_every == 0:
                torch.cuda._sleep(sleep_cycles)  # type: ignore[no-untyped-call]
            try:
                st = rd.receive()
            except RingOverrunError:
                out["overruns"] += 1
                break
            if st is None:
                break
            out["steps"] += 1
            data = step_fields(st.number, seed)
            want = host_checksum([data[n] for n in _NAMES])
            if host_checksum([st.host(n) for n in _NAMES]) != want:
                out["torn_host"] += 1
            views = [st.device(n) for n in _NAMES]
            if cuda:
                log.append((want, _device_checksum(views, weights)))
            else:
                assert engine is not None

                def check(views: list[torch.Tensor] = views, want: int = want) -> None:
                    got = int(_device_checksum(views, weights)) & ((1 << 64) - 1)
                    if got != want:
                        with lock:
                            out["torn_device"] += 1

                engine.run(check)
            held.append((st, want))
    finally:
        if engine is not None:
            engine.drain()
        rd.close()
        if engine is not None:
            engine.close()
    if cuda:
        got = torch.stack([c for _, c in log]).cpu().tolist() if log else []  # one sync, at the end
        out["torn_device"] += sum(1 for (want, _), g in zip(log, got) if (g & ((1 << 64) - 1)) != want)
    return out
