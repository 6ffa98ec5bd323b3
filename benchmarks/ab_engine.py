"""A/B of the engine's loop in one process: this checkout's attnmeta against another commit's, in the
reference engine (examples/engine), serving the same requests, rounds alternating.

``ab_commit.py`` times the step composer outside a loop (back to back, or after a synthetic cache
thrash, on a synthetic decode walk). This times what a change is for: attnmeta's part of each step
inside an engine's loop, where the scheduler, the kernel's ``plan()`` and the model's launches run
between two steps, and where each run serves new requests (so the step shapes, page counts included,
are those of a serving loop, not of a walk). Both packages run in the same process on the same model,
each with its own engine (its own copy of ``examples/engine``, importing its own attnmeta); each round
serves one set of new requests on both engines, back to back, their order alternating from round to
round.

For each concurrency the table gives, per side, the median over the rounds of each run's median
attnmeta time over its full-batch decode steps (the engine's ``metadata`` time, as
``bench_engine.py``'s ``metadata ms``), the ratio of the two medians (this / base) and ``paired``: the
median over the rounds of each round's ratio (a drift of the machine between rounds cancels in it);
also the step time of each side, the kernel's preparation of a step (``plan``: the mean over each run's
steps of the time the kernel takes to plan them, as ``bench_engine.py``'s ``plan ms``; the median over
the rounds), and the requests whose tokens differ between the sides (0: the same kernels and model read
either side's metadata).

The other commit's package comes from ``ab_commit.base_package`` (a renamed copy); its
engine from the same commit's ``examples/engine`` (imported as ``engine_base``, every attnmeta import
renamed), both kept in ``.ab_exports`` for later runs as ``ab_commit.py`` keeps them. On a machine without
the checkout's history, export both first and pass the folder:
``git archive BASE attnmeta examples/engine | tar -x -C FOLDER``.

``--arrive-over STEPS`` spreads each run's requests over its first STEPS steps, so that prompts join
running decodes in mixed steps, as in a server under a steady load, and adds a line with each side's
share of the steps the composer did not replay; ``--steps composed`` times those steps (mostly the mixed
ones) instead of the full-batch decode steps, and ``--steps all`` every step (each run's mean: a change that
replays steps the base composed shows there, where the two sides' composed steps are not the same steps).

Two sides of the same code do not take the same time in one process: how and when a side's code was
loaded moves its time by several percent (docs/speed-tricks.md, "Their resolution"). ``--symmetric`` takes
that out: this checkout's package and engine are exported too (``attnmeta_new``, ``engine_new``), and the
A/B runs twice, each in a process of its own, the base's copy imported first in one and this checkout's
in the other (``--order``); it prints both runs' rows and, per concurrency, the geometric means of their
two ratios.

Usage: python benchmarks/ab_engine.py BASE [--device cuda] [--model 1b|hybrid-1b|tiny|tiny-hybrid]
[--mode graphs|eager|paged] [--concurrency 64,256] [--rounds 8] [--prompt 64] [--new 96] [--warm 3]
[--arrive-over STEPS] [--steps decode|composed|all] [--symmetric | --order base,this|this,base] [--json FILE]
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _args import device_arg  # noqa: E402  (benchmarks/_args.py)
from ab_commit import EXPORTS, base_package, import_exported  # noqa: E402  (benchmarks/ab_commit.py)
from bench_engine import (  # noqa: E402
    MODELS,
    _engine,
    _prompt_range,
    _requests,
    full_batch,
    is_hybrid,
    json_runs,
    next_step,
    share_composed,
    timed_run,
)

import examples.engine as engine_this  # noqa: E402
from examples.engine.workload import make_model  # noqa: E402


def side_engine(commit: str, exports: Path = EXPORTS, side: str = "base") -> Any:
    """``commit``'s ``examples/engine``, imported as the package ``engine_<side>`` (from a copy kept under
    ``exports``: :func:`ab_commit.import_exported`) with its attnmeta imports renamed to ``attnmeta_<side>``
    (``ab_commit.base_package`` imports that package). ``commit`` is a commit of this checkout, or a folder
    holding ``examples/engine`` exported from one (this checkout's root: its working tree)."""
    pkg, name = f"attnmeta_{side}", f"engine_{side}"
    engine = import_exported(commit, "examples/engine", name, {"attnmeta": pkg, "examples.engine": name}, exports)
    composer = importlib.import_module(f"{name}.engine").StepBuilder
    if not composer.__module__.startswith(f"{pkg}."):  # (else the A/B would time one package twice)
        raise RuntimeError(f"ab_engine: the {side} engine's step composer comes from {composer.__module__}, "
                           f"not {pkg}")
    try:  # the hybrid model's Mamba kernels: the copy looks beside itself, which has none
        mamba = importlib.import_module(f"{name}.vllm_mamba")
    except ModuleNotFoundError:  # (a base from before the engine ran vLLM's Mamba kernels)
        return engine
    if hasattr(mamba, "KERNELS"):
        mamba.KERNELS = ROOT / ".kernels"
    return engine


def load_sides(base: str, order: str | None, exports: Path = EXPORTS) -> dict[str, Any]:
    """The two sides' engine packages, ``{"base": ..., "this": ...}``. Without ``order``, the base's copy
    against this checkout's own ``examples.engine``; with it (``"base,this"`` or ``"this,base"``), this
    checkout's working tree exported as well (``attnmeta_new``, ``engine_new``), the two imported in that
    order, and the dict in that order (:func:`ab` makes the engines in the dict's order)."""
    if order is None:
        base_package(base, exports)
        return {"base": side_engine(base, exports), "this": engine_this}
    sides = {}  # (in import order, which is also the order :func:`ab` makes the engines in)
    for side in order.split(","):
        commit, name = (base, "base") if side == "base" else (str(ROOT), "new")
        base_package(commit, exports, name)
        sides[side] = side_engine(commit, exports, name)
    return sides


def geometric_means(runs: list[dict[str, Any]]) -> dict[int, tuple[float, float]]:
    """Per concurrency, the geometric means over ``runs`` (each :func:`main`'s ``--json`` of one order) of
    the ratio of medians and of the paired ratio (this / base).

    >>> geometric_means([{"64": {"ratio": 2.0, "paired": 4.0}}, {"64": {"ratio": 0.5, "paired": 1.0}}])
    {64: (1.0, 2.0)}
    """
    out = {}
    for n in runs[0]:
        ratios = [r[n]["ratio"] for r in runs]
        paired = [r[n]["paired"] for r in runs]
        out[int(n)] = (math.prod(ratios) ** (1 / len(ratios)), math.prod(paired) ** (1 / len(paired)))
    return out


_TIMED = {"decode": "median over its full-batch decode steps", "composed": "median over its steps not replayed",
          "all": "mean over every step"}
"""What ``--steps`` times, as the header line says it."""


def timed_steps(run: dict[str, Any], steps: str) -> list[int]:
    """The indices of ``run``'s steps that ``--steps`` times: ``decode``, its full-batch decode steps;
    ``composed``, the steps the step composer did not replay (prefill and mixed steps, and decode steps
    of a layout their ring slot had not recorded); ``all``, every step.

    Raises
    ------
    RuntimeError
        The run had none."""
    if steps == "decode":
        idx = full_batch(run["kinds"])
    elif steps == "all":
        idx = list(range(len(run["kinds"])))
    else:
        idx = [i for i, replayed in enumerate(run["replayed"]) if not replayed]
    if not idx:
        raise RuntimeError(f"ab_engine: the run had no {steps} steps to time (raise --new; composed steps: "
                           "--arrive-over, and an engine that replays its mixed steps composes few, so time --steps all)")
    return idx


def ab(sides: dict[str, Any], model: Any, mode: str, n: int, prompt: int, new: int, device: torch.device,
       rounds: int, warm: int = 3, arrive_over: int = 0, steps: str = "decode") -> dict[str, Any]:
    """Both sides' engines at ``n`` requests (``bench_engine.py``'s, each of its side's package), warmed by
    ``warm`` runs, then ``rounds`` rounds, each serving new requests on both (order alternating), arriving
    over ``arrive_over`` steps. Returns each side's per-round medians over the steps ``steps`` names
    (:func:`timed_steps`; ms; ``all``: means, the mixed steps' time counted in full), its per-round mean plan time a step (ms) and the requests whose tokens
    differed in any round; and each side's per-round share of the steps not replayed (``composed``)."""
    vocab = model.config.vocab_size
    engines = {name: _engine(model, mode, n, prompt, new, device, pkg) for name, pkg in sides.items()}
    for name, eng in engines.items():
        for seed in range(warm):
            eng.run(_requests(n, prompt, new, vocab, seed, sides[name].Request, arrive_over, next_step(eng)))
    meta: dict[str, list[float]] = {name: [] for name in sides}
    composed: dict[str, list[float]] = {name: [] for name in sides}
    step: dict[str, list[float]] = {name: [] for name in sides}
    plan: dict[str, list[float]] = {name: [] for name in sides}
    differ = 0
    names = list(sides)
    for k in range(rounds):
        tokens = {}
        for name in (names if k % 2 == 0 else names[::-1]):
            run = timed_run(engines[name], n, prompt, new, vocab, 1000 + k, sides[name].Request, arrive_over)
            idx = timed_steps(run, steps)
            stat = statistics.fmean if steps == "all" else statistics.median
            meta[name].append(stat(run["metadata"][i] for i in idx) * 1e3)
            composed[name].append(share_composed(run["kinds"], run["replayed"]))
            step[name].append(stat(run["times"][i] for i in idx) * 1e3)
            plan[name].append(run["plan_s"] / run["steps"] * 1e3)
            tokens[name] = run["tokens"]
        differ += sum(a != b for a, b in zip(tokens[names[0]], tokens[names[1]], strict=True))
    del engines
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"metadata_ms": meta, "step_ms": step, "plan_ms": plan, "composed": composed, "tokens_differ": differ}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("base", help="the commit to compare with, or a folder holding its exported attnmeta and "
                                "examples/engine (git archive BASE attnmeta examples/engine | tar -x -C FOLDER)")
    p.add_argument("--device", type=device_arg, default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", choices=list(MODELS), default="1b")
    p.add_argument("--mode", choices=["graphs", "eager", "paged"], default="graphs",
                   help="the engine's mode (bench_engine.py's modes of attnmeta; on a CPU: paged)")
    p.add_argument("--concurrency", default="64,256")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new", type=int, default=96)
    p.add_argument("--warm", type=int, default=3, help="untimed runs of each engine before the rounds")
    p.add_argument("--arrive-over", type=int, default=0, metavar="STEPS",
                   help="requests arrive over the first STEPS steps, so prompts join running decodes in mixed "
                        "steps (default 0: all at once)")
    p.add_argument("--steps", choices=["decode", "composed", "all"], default="decode",
                   help="the steps timed: the full-batch decode steps (default), the steps the step composer "
                        "did not replay (with --arrive-over: mostly mixed steps), or every step (means, not "
                        "medians: with --arrive-over, the loop's mixed steps counted in full)")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--order", choices=["base,this", "this,base"], default=None, metavar="base,this|this,base",
                     help="export this checkout's working tree too and import the two sides' copies in this order "
                          "(by default the base's copy runs against this checkout's own packages)")
    how.add_argument("--symmetric", action="store_true",
                     help="run the A/B twice, each in a process of its own, with --order base,this and this,base, "
                          "and print the geometric means of their ratios (see the module docstring)")
    p.add_argument("--json", type=Path, default=None, help="also write each concurrency's medians and ratios here")
    p.add_argument("--exports", type=Path, default=EXPORTS, help="where the base's renamed copies are kept and "
                                                                 "reused, their compiled kernels with them "
                                                                 "(default: .ab_exports in the checkout; "
                                                                 "ab_commit.py's too)")
    a = p.parse_args(argv)
    device = torch.device(a.device)
    if device.type != "cuda" and (a.mode != "paged" or a.model not in ("tiny", "tiny-hybrid")):
        print("ab_engine: on a CPU only --model tiny or tiny-hybrid --mode paged runs (torch's paged kernel)",
              file=sys.stderr)
        return 2
    config = MODELS[a.model]()
    if is_hybrid(config) and a.mode == "graphs":
        print("ab_engine: a hybrid model runs eager steps (--mode eager or paged)", file=sys.stderr)
        return 2
    if a.symmetric:
        return _symmetric([x for x in (argv if argv is not None else sys.argv[1:]) if x != "--symmetric"], a.json)
    model = make_model(config, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    sides = load_sides(a.base, a.order, a.exports)
    order = "" if a.order is None else f", both sides exported, imported in the order {a.order}"
    print(f"# {device.type}, torch {torch.__version__}, base {a.base}, model {a.model}, mode {a.mode}, "
          f"{a.rounds} rounds of new requests (prompts {'-'.join(map(str, _prompt_range(a.prompt)))}, "
          f"{a.new} new tokens{f', arriving over {a.arrive_over} steps' if a.arrive_over else ''}){order}; medians "
          f"over rounds of each run's {_TIMED[a.steps]} (ms)", flush=True)
    print(f"{'reqs':>5} {'base ms':>8} {'this ms':>8} {'this/base':>9} {'paired':>7} {'base step':>9} "
          f"{'this step':>9} {'base plan':>9} {'this plan':>9} {'plan x':>7} {'tokens differ':>13}", flush=True)
    results = {}
    for n in [int(x) for x in a.concurrency.split(",")]:
        r = ab(sides, model, a.mode, n, a.prompt, a.new, device, a.rounds, a.warm, a.arrive_over, a.steps)
        mb, mt = r["metadata_ms"]["base"], r["metadata_ms"]["this"]
        paired = statistics.median(t / b for b, t in zip(mb, mt, strict=True))
        ratio = statistics.median(mt) / statistics.median(mb)
        pb, pt = statistics.median(r["plan_ms"]["base"]), statistics.median(r["plan_ms"]["this"])
        print(f"{n:>5} {statistics.median(mb):8.4f} {statistics.median(mt):8.4f} {ratio:9.3f} {paired:7.3f} "
              f"{statistics.median(r['step_ms']['base']):9.3f} {statistics.median(r['step_ms']['this']):9.3f} "
              f"{pb:9.4f} {pt:9.4f} {pt / pb if pb else float('nan'):7.3f} {r['tokens_differ']:>13}", flush=True)
        if a.arrive_over or a.steps == "composed":
            cb, ct = (statistics.median(r["composed"][side]) for side in ("base", "this"))
            print(f"#  {n} requests: steps not replayed (composed), median over the rounds: base {cb:.1%}, "
                  f"this {ct:.1%}", flush=True)
        results[str(n)] = {"ratio": ratio, "paired": paired, **r}
    if a.json is not None:
        a.json.write_text(json.dumps(results))
    return 0


def _symmetric(rest: list[str], out_json: Path | None) -> int:
    """``--symmetric``: this script with the arguments ``rest`` once per import order, each run in a process
    of its own, then the geometric means of the two runs' ratios (with both runs written to ``out_json``)."""
    runs = json_runs(__file__, [[*rest, "--order", order] for order in ("base,this", "this,base")])
    if isinstance(runs, int):
        return runs
    means = geometric_means(runs)
    print("# both orders: geometric means of the two runs' ratios (this / base)", flush=True)
    print(f"{'reqs':>5} {'this/base':>9} {'paired':>7}", flush=True)
    for n, (ratio, paired) in means.items():
        print(f"{n:>5} {ratio:9.3f} {paired:7.3f}", flush=True)
    if out_json is not None:
        out_json.write_text(json.dumps(
            {"runs": runs, "geometric_means": {str(n): {"ratio": r, "paired": p} for n, (r, p) in means.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
