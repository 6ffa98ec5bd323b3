"""Where a step's host time goes: per-phase medians of the decode step and the Mamba2 prefill step.

Decode (batch 1, 64, 256, 1024; the 64-step walk of ``bench_decode.py``): ``step`` (``Stager.step``),
``common`` (``stage_common(paged_kv=True)``), ``fa`` / ``fi`` (``flash_attn.stage`` /
``flashinfer.stage``), ``commit``, then the three ``result()`` calls. Mamba2 (16 and 256 prefills,
one step repeated): ``step``, ``common`` (``token_arrays=False``), ``mamba`` (``mamba2.stage``),
``commit``, ``result``. The fused decode step (:class:`attnmeta.backends.fused.FusedStepBuilder`, the
same walk), eager and in graph mode: ``step``, ``kernel``, ``commit``, ``rest`` (see :func:`_fused_phases`). Each phase is
timed with ``perf_counter_ns`` around it (the timer calls add ~0.1 us per phase); the table shows
the round (of 5) with the lowest sum of phase medians.

Run: ``python benchmarks/bench_phases.py [--device cuda|cpu]``.
"""

from __future__ import annotations

import gc
import importlib.util
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

if importlib.util.find_spec("attnmeta") is None:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attnmeta import StaticProfile
from attnmeta._bench_mamba2 import OPTIONS, prefill_step_specs
from attnmeta.testing.workloads import advance, decode_spec
from attnmeta.backends import flash_attn, flashinfer, fused, mamba2
from attnmeta.bench import script_device
from attnmeta.metadata import stage_common
from attnmeta.staging import Stager

try:
    from attnmeta._bench_scenarios import GRAPH_PROFILE
except ImportError:  # an older checkout first on PYTHONPATH (A/B runs, docs/benchmarks.md): its value
    GRAPH_PROFILE = StaticProfile(max_num_reqs=1024, max_num_tokens=1024, max_blocks_per_req=136, block_size=16)


def best_round(rounds: int, steps: int, warm: int, one: Callable[[int], list[int]], names: list[str],
               device: torch.device) -> dict[str, float]:
    """Per-phase medians of the round with the lowest sum; ``one(i)`` returns the phase timestamps."""
    best: dict[str, float] | None = None
    for _ in range(rounds):
        per: dict[str, list[float]] = {k: [] for k in names}
        for i in range(steps):
            ts = one(i)
            if i >= warm:
                for k, a, b in zip(names, ts, ts[1:]):
                    per[k].append((b - a) / 1e3)
        if device.type == "cuda":
            torch.cuda.synchronize()  # harness only, between rounds
        med = {k: float(np.median(v)) for k, v in per.items()}
        if best is None or sum(med.values()) < sum(best.values()):
            best = med
    assert best is not None
    return best


def _fused_phases(batch: int, dev: torch.device, profile: StaticProfile | None = None) -> dict[str, float]:
    """Phases of a FusedStepBuilder step (the decode walk above, replayed; graph mode with ``profile``):
    ``step`` (``Stager.step``), ``kernel`` (the compiled calls: the common pass, and FlashInfer's where
    the package still runs one in a graph-mode replay, as before this script's graph rows existed), ``commit``,
    ``rest`` (the replay key, the object construction). The three are timed by wrappers installed
    for this measurement only (~0.1 us each)."""
    pc = time.perf_counter_ns
    spent = [0, 0, 0]

    def timed(fn: Callable[..., Any], k: int) -> Callable[..., Any]:
        def wrapper(*a: Any) -> Any:
            t = pc()
            try:
                return fn(*a)
            finally:
                spent[k] += pc() - t
        return wrapper

    specs = advance(decode_spec(batch, np.random.default_rng(0)), 64)
    saved = (fused._common_packed_nb, Stager.step, Stager._commit)
    fi_kernel = getattr(fused, "_flashinfer_nb", None)  # (an older checkout on PYTHONPATH, for A/B runs)
    fused._common_packed_nb = timed(saved[0], 1)  # type: ignore[assignment]
    Stager.step = timed(saved[1], 0)  # type: ignore[method-assign]
    Stager._commit = timed(saved[2], 2)  # type: ignore[method-assign]
    if fi_kernel is not None:
        fused._flashinfer_nb = timed(fi_kernel, 1)  # type: ignore[attr-defined]
    try:
        builder = fused.FusedStepBuilder(Stager(dev, profile=profile))

        def one(i: int) -> list[int]:
            spent[:] = [0, 0, 0]
            t0 = pc()
            builder.build(specs[i % 64])
            total = pc() - t0
            a, k, c = spent
            return [0, a, a + k, a + k + c, total]

        return best_round(5, 600, 100, one, ["step", "kernel", "commit", "rest"], dev)
    finally:
        fused._common_packed_nb, Stager.step, Stager._commit = saved  # type: ignore[method-assign]
        if fi_kernel is not None:
            fused._flashinfer_nb = fi_kernel  # type: ignore[attr-defined]


def main() -> None:
    dev = script_device(__doc__)
    pc = time.perf_counter_ns
    print(f"# per-phase host us (medians, best of 5 rounds), device {dev}, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d')}")
    gc.disable()
    try:
        for b in (1, 64, 256, 1024):
            specs = advance(decode_spec(b, np.random.default_rng(0)), 64)
            st = Stager(dev)

            def decode_step(i: int, st: Stager = st, specs: list = specs) -> list[int]:  # type: ignore[type-arg]
                t0 = pc()
                step = st.step()
                t1 = pc()
                c = stage_common(specs[i % 64], step, paged_kv=True)
                t2 = pc()
                fa = flash_attn.stage(c, step)
                t3 = pc()
                fi = flashinfer.stage(c, step)
                t4 = pc()
                step.commit()
                t5 = pc()
                c.result()
                t6 = pc()
                fa.result()
                t7 = pc()
                fi.result()
                return [t0, t1, t2, t3, t4, t5, t6, t7, pc()]

            names = ["step", "common", "fa", "fi", "commit", "common.result", "fa.result", "fi.result"]
            med = best_round(5, 600, 100, decode_step, names, dev)
            print(f"decode batch {b:>4}: " + " ".join(f"{k} {v:.1f}" for k, v in med.items())
                  + f" | sum {sum(med.values()):.1f}", flush=True)
        for profile, mode in ((None, "fused "), (GRAPH_PROFILE, "graph fused")):
            for b in (1, 64, 256, 1024):
                med = _fused_phases(b, dev, profile)
                print(f"{mode} batch {b:>4}: " + " ".join(f"{k} {v:.1f}" for k, v in med.items())
                      + f" | sum {sum(med.values()):.1f}", flush=True)
        for spec in prefill_step_specs(False):
            if spec.num_reqs not in (16, 256):
                continue
            cols = mamba2.block_table_columns(spec, OPTIONS)
            st = Stager(dev)

            def mamba_step(i: int, st: Stager = st, spec: object = spec, cols: int = cols) -> list[int]:
                t0 = pc()
                step = st.step()
                t1 = pc()
                c = stage_common(spec, step, block_table_columns=cols, token_arrays=False)  # type: ignore[arg-type]
                t2 = pc()
                m = mamba2.stage(c, step, OPTIONS)
                t3 = pc()
                step.commit()
                t4 = pc()
                m.result()
                return [t0, t1, t2, t3, t4, pc()]

            med = best_round(5, 300, 30, mamba_step, ["step", "common", "mamba", "commit", "result"], dev)
            print(f"mamba2 {spec.num_reqs:>4} prefills: " + " ".join(f"{k} {v:.1f}" for k, v in med.items())
                  + f" | sum {sum(med.values()):.1f}", flush=True)
    finally:
        gc.enable()


if __name__ == "__main__":
    main()
