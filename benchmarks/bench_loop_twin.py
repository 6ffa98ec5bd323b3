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

The rounds alternate (``alone``, ``twin``, ...), each serving new requests; figures are medians over
each variant's full-batch decode steps, in microseconds, with their ratio.

Run: ``python benchmarks/bench_loop_twin.py [--device cpu|cuda] [--model tiny|1b|tiny-hybrid|hybrid-1b]
[--concurrency 8,64] [--rounds 4]`` (CPU: torch's paged kernel, eager; CUDA: FlashInfer in CUDA graphs,
as bench_engine.py's ``graphs`` mode, or for a hybrid model (Bamba: Mamba2 and attention layers, two
KV-cache groups) eager, as its ``eager`` mode; set ``OMP_NUM_THREADS=1`` on a small CPU machine so the
model's ops do not take every core).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_engine  # benchmarks/bench_engine.py: its engines and workload

from examples.engine.workload import make_model


def measure(model: Any, mode: str, n: int, prompt: int, new: int, device: torch.device, rounds: int
            ) -> dict[str, list[float]]:
    """Each variant's times (s) of the first engine's composer call on the full-batch decode steps
    (:func:`bench_engine.full_batch`: the steps whose ``metadata ms`` bench_engine.py reports)."""
    vocab = model.config.vocab_size
    engine = bench_engine.warm_engine(model, mode, n, prompt, new, device)
    twin = bench_engine.warm_engine(model, mode, n, prompt, new, device)
    own, other = engine.composer.build_counts, twin.composer.build_counts
    times: dict[str, list[float]] = {"alone": [], "twin": []}
    calls: list[float] = []  # the run's calls, one a step
    with_twin = [False]

    def timed(c: np.ndarray, q: np.ndarray, tables: Any, **kw: Any) -> Any:
        if with_twin[0]:
            other(c, q, tables, **kw)
        t0 = time.perf_counter()
        out = own(c, q, tables, **kw)
        calls.append(time.perf_counter() - t0)
        return out

    engine.composer.build_counts = timed  # type: ignore[method-assign]
    gc.collect()
    gc.disable()
    try:
        for r in range(rounds):
            for v in ("alone", "twin"):
                with_twin[0], k0 = v == "twin", len(engine.stats.step_kinds)
                calls.clear()
                engine.run(bench_engine._requests(n, prompt, new, vocab, 1000 + r))
                kinds = engine.stats.step_kinds[k0:]
                assert len(kinds) == len(calls), "one composer call a step"
                times[v] += [calls[i] for i in bench_engine.full_batch(kinds)]
    finally:
        gc.enable()
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
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
          f"steps, us (medians): alone, and right after the twin engine's composer call with the same arguments",
          flush=True)
    print(f"{'reqs':>5} {'alone':>8} {'twin':>8} {'twin/alone':>10} {'steps':>6}", flush=True)
    for n in [int(x) for x in a.concurrency.split(",")]:
        t = measure(model, mode, n, a.prompt, a.new, device, a.rounds)
        alone, twin = (statistics.median(t[k]) * 1e6 for k in ("alone", "twin"))
        print(f"{n:>5} {alone:8.1f} {twin:8.1f} {twin / alone:9.2f}x {min(len(t['alone']), len(t['twin'])):>6}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
