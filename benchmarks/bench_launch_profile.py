"""Where the engines of one process spend their step's launches: each under Python's profiler, side by side.

``bench_engine.py`` times the host's launches of each step (``launch ms``: the model's forward, or its
graph's replay, and the sampled tokens' copy). Two engines of the same code in one process can differ
there by far more than their metadata (docs/benchmarks.md). This script finds where. It warms one
engine per ``--modes`` entry (``MODE#2`` a twin, as in ``bench_engine.py``) and times ``--rounds``
rounds of runs alternating between them, unprofiled. For each engine it prints the median step and
launch times over its full-batch decode steps, and the share of those steps whose launches began with
the GPU still on the previous step: near 100%, the loop is bound by the GPU and its launch time holds
the GPU's. Then it serves one more run per engine under ``cProfile``. Per engine and per step, it
prints the functions whose own time (``tottime``: without the functions they call) differs most from
the first engine's, with their calls (``--callers REGEX``: and who calls the functions that match). A
function that takes longer in one engine with as many calls points at what that engine pays more for
in each call; one with more calls, at a path only that engine takes.

Run: ``python benchmarks/bench_launch_profile.py [--device cuda] [--model hybrid-1b] [--modes
eager,eager#2,vllm-eager] [--concurrency 256] [--rounds 2] [--top 30]`` (``bash benchmarks/gpu_all.sh OUT
launchprof``, carry ``.vllm .kernels``). The profiler slows every Python call alike; its per-function
times are for comparing the engines with each other, not for reading as they are.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_engine  # benchmarks/bench_engine.py: its engines, workload and timed runs
from _args import device_arg  # benchmarks/_args.py

from examples.engine.workload import make_model

Key = tuple[str, int, str]  # (file, line, function), as pstats names a function


def own_times(stats: pstats.Stats, steps: int) -> dict[Key, tuple[float, float]]:
    """Per function of ``stats``: its calls and its own time in microseconds, each per step."""
    by_key: dict[Key, Any] = stats.stats  # type: ignore[attr-defined]
    return {k: (v[1] / steps, v[2] * 1e6 / steps) for k, v in by_key.items()}


def profiled_run(engine: Any, requests: list[Any]) -> tuple[pstats.Stats, int]:
    """``engine`` serves ``requests`` under the profiler, the garbage collector off as in a timed run
    (collected before, untimed): the run's statistics and its steps."""
    steps = engine.stats.steps
    gc.collect()
    gc.disable()
    prof = cProfile.Profile()
    try:
        prof.enable()
        engine.run(requests)
        prof.disable()
    finally:
        gc.enable()
    return pstats.Stats(prof), engine.stats.steps - steps


def name_of(key: Key) -> str:
    """A function's short name: ``file:line(function)`` with the file's last two path parts."""
    file, line, func = key
    if file == "~":  # (a built-in: pstats names it in the function part)
        return func
    return f"{'/'.join(Path(file).parts[-2:])}:{line}({func})"


def differences(per_mode: dict[str, dict[Key, tuple[float, float]]], top: int) -> list[tuple[Key, float]]:
    """The ``top`` functions whose own time per step differs most between any engine and the first, with
    that largest difference in microseconds (signed: the other engine's time less the first's; a
    function an engine never called counts as 0 there).

    >>> a = {("f", 1, "x"): (2.0, 10.0), ("f", 2, "y"): (1.0, 5.0)}
    >>> b = {("f", 1, "x"): (2.0, 30.0), ("f", 2, "y"): (1.0, 4.0), ("f", 3, "z"): (1.0, 0.5)}
    >>> [(k[2], d) for k, d in differences({"A": a, "B": b}, 2)]
    [('x', 20.0), ('y', -1.0)]
    """
    modes = list(per_mode)
    first = per_mode[modes[0]]
    keys = set().union(*per_mode.values())
    found = []
    for k in keys:
        base = first.get(k, (0.0, 0.0))[1]
        d = max((per_mode[m].get(k, (0.0, 0.0))[1] - base for m in modes[1:]), key=abs)
        found.append((k, d))
    found.sort(key=lambda kd: (-abs(kd[1]), kd[0]))  # (ties by name: the same order every run)
    return found[:top]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", type=device_arg, default="cuda")
    p.add_argument("--model", choices=list(bench_engine.MODELS), default="hybrid-1b")
    p.add_argument("--modes", default="eager,eager#2,vllm-eager")
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new", type=int, default=96)
    p.add_argument("--rounds", type=int, default=2, help="unprofiled timed rounds, alternating (default 2)")
    p.add_argument("--top", type=int, default=30, help="functions listed (default 30)")
    p.add_argument("--callers", default=None, metavar="REGEX",
                   help="also print, per engine, the callers of the functions whose names match REGEX (pstats's)")
    a = p.parse_args(argv)
    modes = a.modes.split(",")
    device = torch.device(a.device)
    config = bench_engine.MODELS[a.model]()
    error = (bench_engine.modes_error(modes, bench_engine.is_hybrid(config))
             or (bench_engine.cpu_error(modes) if device.type != "cuda" else None))
    if len(set(modes)) != len(modes) or len(modes) < 2:
        error = f"--modes needs two or more distinct modes (MODE#2 a twin), got {a.modes!r}"
    if error:
        print(f"bench_launch_profile: {error}", file=sys.stderr)
        return 2
    model = make_model(config, device, torch.bfloat16)
    vocab, n = model.config.vocab_size, a.concurrency
    print(f"model {a.model}, {n} requests, {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}; "
          f"engines {modes}", flush=True)
    engines = {m: bench_engine.warm_engine(model, m, n, a.prompt, a.new, device) for m in modes}
    launch: dict[str, list[float]] = {m: [] for m in modes}
    step: dict[str, list[float]] = {m: [] for m in modes}
    behind: dict[str, list[float]] = {m: [] for m in modes}
    for k in range(a.rounds):
        for m in modes:
            run = bench_engine.timed_run(engines[m], n, a.prompt, a.new, vocab, 1000 + k)
            idx = bench_engine.full_batch(run["kinds"])
            launch[m].append(statistics.median(run["launch"][i] for i in idx) * 1e3)
            step[m].append(statistics.median(run["times"][i] for i in idx) * 1e3)
            behind[m].append(sum(run["behind"][i] for i in idx) / max(len(idx), 1))
    print(f"\nunprofiled, {a.rounds} rounds (medians over each run's full-batch decode steps, ms; then their median; "
          "behind: the steps whose launches began with the GPU still on the previous step)")
    for m in modes:
        print(f"{m:>12}  step {' '.join(f'{x:7.3f}' for x in step[m])} -> {statistics.median(step[m]):7.3f}   "
              f"launch {' '.join(f'{x:7.3f}' for x in launch[m])} -> {statistics.median(launch[m]):7.3f}   "
              f"behind {' '.join(f'{x:4.0%}' for x in behind[m])}", flush=True)
    per_mode: dict[str, dict[Key, tuple[float, float]]] = {}
    totals: dict[str, float] = {}
    for m in modes:
        stats, steps = profiled_run(engines[m], bench_engine._requests(n, a.prompt, a.new, vocab, 2000))
        per_mode[m] = own_times(stats, steps)
        if a.callers:
            text = io.StringIO()
            stats.stream = text  # type: ignore[attr-defined]
            stats.print_callers(a.callers)
            print(f"\n{m}: callers of {a.callers!r} over {steps} steps (pstats)\n"
                  + "\n".join(line for line in text.getvalue().splitlines() if line.strip()), flush=True)
        totals[m] = sum(t for _c, t in per_mode[m].values())
    print("\nprofiled, one run each: own time per step (us), all functions: "
          + ", ".join(f"{m} {totals[m]:.0f}" for m in modes))
    print(f"\nthe {a.top} functions whose own time per step differs most from {modes[0]}'s (us per step, calls per step)")
    print(f"{'function':<70} " + " ".join(f"{m + ' us':>14} {'calls':>8}" for m in modes))
    for k, _d in differences(per_mode, a.top):
        cells = [per_mode[m].get(k, (0.0, 0.0)) for m in modes]
        print(f"{name_of(k)[-70:]:<70} " + " ".join(f"{t:14.1f} {c:8.1f}" for c, t in cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
