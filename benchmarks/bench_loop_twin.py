"""What makes the engine's step cold: its composer call timed alone, and right after a twin's.

In the reference engine's loop attnmeta's step takes several times what the same step takes back to
back (docs/benchmarks.md). Two causes are possible: the composer's own state (its recorded layouts,
templates, the slot's pinned bytes) was evicted from the caches between two steps, or what every call
of the same code shares (the interpreter's and the library's code, numba's and torch's dispatch
tables, the type objects every call touches) was. This script tells them apart inside the loop: two
engines of the same mode, warmed alike; in the ``twin`` rounds each step of the first engine calls the
second engine's step composer (its own stager and recorded layouts) with the same arguments just
before its own call, and only its own call is timed; in the ``alone`` rounds it does not. If ``twin``
is as slow as ``alone``, the composer's own state is what went cold; if ``twin`` is close to the
back-to-back step, what the twin warmed (everything but that state) is.

Three more variants split what the twin warms: ``interp`` runs about 20 us of plain Python additions
first (the interpreter's own eval loop); ``libs`` calls what every step enters outside attnmeta's code,
on objects of its own (numba's dispatch of an unrelated compiled function, numpy's array checks, torch's
``as_strided`` and a copy, a slotted object); ``kernels`` replays the twin's two compiled calls (the
scan and the common passes, :data:`KERNELS`) with the arguments of one of its steps, the same machine
code and nothing of attnmeta's Python. What none of them recovers of the twin's saving is attnmeta's own
Python path: its functions, classes and module dictionaries, which the twin's call shares.

The rounds alternate (``alone``, ``twin``, ``interp``, ``libs``, ``kernels``, ...), each serving new
requests; figures are medians over each variant's full-batch decode steps, in microseconds, with their
ratio to ``alone``.

Run: ``python benchmarks/bench_loop_twin.py [--device cpu|cuda] [--model tiny|1b|tiny-hybrid|hybrid-1b]
[--concurrency 8,64] [--rounds 4]`` (CPU: torch's paged kernel, eager; CUDA: FlashInfer in CUDA graphs,
as bench_engine.py's ``graphs`` mode, or for a hybrid model (Bamba: Mamba2 and attention layers, two
KV-cache groups) eager, as its ``eager`` mode; set ``OMP_NUM_THREADS=1`` on a small CPU machine so the
model's ops do not take every core).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numba
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _cold  # benchmarks/_cold.py
import bench_engine  # benchmarks/bench_engine.py: its engines and workload
from _args import device_arg  # benchmarks/_args.py

from examples.engine.workload import make_model

VARIANTS = ("alone", "twin", "interp", "libs", "kernels")
"""What runs, untimed, right before the timed composer call: nothing; the twin engine's composer call with
the same arguments; :func:`_interp_primer` (the interpreter's own loop); :func:`_libs_primer` (the
libraries' entry points, none of attnmeta's code); :class:`_KernelsPrimer` (attnmeta's two compiled
calls of a step, nothing of its Python)."""

KERNELS = (("attnmeta.spec", "_scan_nb"), ("attnmeta.common", "common_passes_nb"))
"""The two compiled calls of a replayed step, by module and the name the step calls them by: the scan of
the scheduler's arrays and the common passes. Internal names, read by this diagnostic only (as
bench_loop_phases.py reads lines of the package's source): if one moves, the script says so."""


@numba.njit(cache=False)
def _unrelated_nb(a: np.ndarray, b: np.ndarray, rows: tuple[np.ndarray, ...], k: int) -> int:
    """A compiled function of the step's kinds of arguments (arrays, a tuple of arrays, an int) that
    attnmeta does not have: its call goes through numba's dispatch and unboxing, not attnmeta's code."""
    s = k
    for r in rows:
        s += r[0, 0]
    return s + a[0] + b[0]


def _libs_primer(device: torch.device) -> Any:
    """A call that enters what every composer step enters outside attnmeta's own code, on objects of its
    own: numba's dispatch (:func:`_unrelated_nb`), numpy's array checks and a small array, torch's
    ``as_strided`` and a host-to-device copy from pinned memory (a host copy on the CPU), a slotted
    object and a few dicts and lists."""
    a, b = np.zeros(64, np.int32), np.ones(64, np.int32)
    rows = (np.zeros((64, 8), np.int32), np.zeros((64, 1), np.int32))
    host = torch.zeros(64, dtype=torch.int32, pin_memory=device.type == "cuda")
    dev = torch.zeros(1024, dtype=torch.int32, device=device)
    _unrelated_nb(a, b, rows, 1)

    class Slotted:
        __slots__ = ("x", "y", "z")

    def prime() -> None:
        _unrelated_nb(a, b, rows, 1)
        ok = a.dtype == np.int32 and a.flags.c_contiguous and b.ndim == 1
        np.empty((2, 8), np.int32)
        view = dev.as_strided((64,), (1,), 128)
        view.copy_(host, non_blocking=True)
        o = Slotted()
        o.x, o.y, o.z = ok, {"n": 64, "rows": [1, 2]}, (a, b)

    prime()
    return prime


class _KernelsPrimer:
    """Replays the twin's two compiled calls (:data:`KERNELS`) with the arguments of one of its steps,
    captured once: the same machine code the composer's step runs, on the twin's own buffers (whose bytes
    nothing reads: the twin engine only composes), and none of attnmeta's Python. ``capture(call)`` runs
    ``call`` (a twin composer call) with the two names wrapped to record their arguments; then each call
    of the primer replays them."""

    def __init__(self) -> None:
        self.args: dict[tuple[str, str], tuple[Any, ...]] = {}
        self.originals: dict[tuple[str, str], Any] = {}
        for module, name in KERNELS:
            mod = importlib.import_module(module)
            if not hasattr(mod, name):
                raise LookupError(f"bench_loop_twin: {module} has no {name}: the code moved; update KERNELS")
            self.originals[module, name] = getattr(mod, name)

    def capture(self, call: Any) -> None:
        def recorder(key: tuple[str, str]) -> Any:
            def record(*args: Any) -> Any:
                self.args[key] = args
                return self.originals[key](*args)
            return record

        mods = {key: importlib.import_module(key[0]) for key in self.originals}
        for key, mod in mods.items():
            setattr(mod, key[1], recorder(key))
        try:
            call()
        finally:
            for key, mod in mods.items():
                setattr(mod, key[1], self.originals[key])
        missing = [name for (module, name) in self.originals if (module, name) not in self.args]
        if missing:
            raise LookupError(f"bench_loop_twin: the step made no call of {missing}: the code moved; update KERNELS")

    def __call__(self) -> None:
        for key, args in self.args.items():
            self.originals[key](*args)


def _interp_primer() -> Any:
    """Plain Python additions, about 20 us back to back: the interpreter's eval loop, nothing else."""
    return _cold.jitter(20.0)


def measure(model: Any, mode: str, n: int, prompt: int, new: int, device: torch.device, rounds: int
            ) -> dict[str, list[float]]:
    """Each variant's times (s) of the first engine's composer call on the full-batch decode steps
    (:func:`bench_engine.full_batch`: the steps whose ``metadata ms`` bench_engine.py reports), by
    :data:`VARIANTS`."""
    vocab = model.config.vocab_size
    engine = bench_engine.warm_engine(model, mode, n, prompt, new, device)
    twin = bench_engine.warm_engine(model, mode, n, prompt, new, device)
    own, other = engine.composer.build_counts, twin.composer.build_counts
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    calls: list[float] = []  # the run's calls, one a step
    kernels = _KernelsPrimer()
    before = {"interp": _interp_primer(), "libs": _libs_primer(device), "kernels": kernels}
    variant = ["alone"]

    def timed(c: np.ndarray, q: np.ndarray, tables: Any, **kw: Any) -> Any:
        capturing = variant[0] == "kernels" and not kernels.args
        if variant[0] == "twin":
            other(c, q, tables, **kw)
        elif capturing:  # (the first such step: the twin's whole call, recorded; this step is not counted)
            kernels.capture(lambda: other(c, q, tables, **kw))
        elif variant[0] != "alone":
            before[variant[0]]()
        t0 = time.perf_counter()
        out = own(c, q, tables, **kw)
        calls.append(float("nan") if capturing else time.perf_counter() - t0)
        return out

    engine.composer.build_counts = timed  # type: ignore[method-assign]
    mixed = engine.mixed_composer  # (its mixed steps' composer, EngineConfig.fixed_mixed_layout: not timed)
    if mixed is not None:
        own_mixed = mixed.build_counts

        def untimed(*a: Any, **kw: Any) -> Any:
            calls.append(float("nan"))
            return own_mixed(*a, **kw)

        mixed.build_counts = untimed  # type: ignore[method-assign]
    gc.collect()
    gc.disable()
    try:
        for r in range(rounds):
            for v in VARIANTS:
                variant[0], k0 = v, len(engine.stats.step_kinds)
                calls.clear()
                engine.run(bench_engine._requests(n, prompt, new, vocab, 1000 + r))
                kinds = engine.stats.step_kinds[k0:]
                assert len(kinds) == len(calls), "one composer call a step"
                times[v] += [calls[i] for i in bench_engine.full_batch(kinds) if not math.isnan(calls[i])]
    finally:
        gc.enable()
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", type=device_arg, default="cpu")
    p.add_argument("--model", choices=list(bench_engine.MODELS), default="tiny")
    p.add_argument("--concurrency", default="8,64")
    p.add_argument("--rounds", type=int, default=4, help="rounds of each variant, alternating (default 4)")
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new", type=int, default=96)
    a = p.parse_args(argv)
    device = torch.device(a.device)
    config = bench_engine.MODELS[a.model]()
    hybrid = bench_engine.is_hybrid(config)  # (no graph mode for a hybrid model)
    mode = "paged" if device.type != "cuda" else "eager" if hybrid else "graphs"
    model = make_model(config, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    print(f"# {device.type}, mode {mode}, model {a.model}; the first engine's composer call on full-batch decode "
          f"steps, us (medians): alone, right after the twin engine's composer call with the same arguments, and "
          f"right after each primer (module docstring)",
          flush=True)
    print(f"{'reqs':>5} {'alone':>8} {'twin':>8} {'twin/alone':>10} {'steps':>6} {'interp':>8} {'interp/alone':>12} "
          f"{'libs':>8} {'libs/alone':>10} {'kernels':>8} {'kernels/alone':>13}", flush=True)
    for n in [int(x) for x in a.concurrency.split(",")]:
        t = measure(model, mode, n, a.prompt, a.new, device, a.rounds)
        alone, twin, interp, libs, kern = (statistics.median(t[k]) * 1e6 for k in VARIANTS)
        print(f"{n:>5} {alone:8.1f} {twin:8.1f} {twin / alone:9.2f}x {min(len(x) for x in t.values()):>6} "
              f"{interp:8.1f} {interp / alone:11.2f}x {libs:8.1f} {libs / alone:9.2f}x {kern:8.1f} "
              f"{kern / alone:12.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
