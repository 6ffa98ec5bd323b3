"""What replay saves, builder by builder: a step composer's decode step, replayed against composed.

A step composer (:class:`attnmeta.compose.StepBuilder`) replays a steady-state step: the builder's
:class:`~attnmeta.builder.Replayer` rewrites its fields in the layout its ring slot recorded, instead
of running the builder's ``derive``. For every registered builder that replays (or those ``--builders``
names), each batch size of ``--batches`` gets a decode walk (contexts uniform in [1, 2048), block size
16, a 2048-column table: :func:`attnmeta.testing.workloads.decode_spec` and ``advance``) and two
composers of one group of that builder with the lab's default options and inputs: one as registered,
one whose ``replay_key`` is None, so that every step is composed through ``derive`` (the path a builder
without a replayer takes). Each step goes through the engine's entry, ``build_counts`` of the walk's
arrays. After a warm-up, ``--rounds`` rounds alternate the two (A B A B ...: drift lands on both), each
timing ``--steps`` steps; the table gives each side's median over the rounds of each round's median
step, in microseconds, and composed / replayed (``saving``: how many times faster a replayed step is).
Garbage collection is off while timing. The steps are back to back, caches warm: an engine's loop runs
them colder (docs/benchmarks.md), which this script does not model.

``--drafts K`` makes the walk spec decode: every request verifies ``K`` drafts (``1 + K`` tokens a step),
and the builders that take a spec-decode setting get it (``num_speculative_tokens=K``; FlashInfer's
``decode_threshold=1 + K``). A builder whose key does not name such steps shows 0% replays (local
attention's multi-token steps).

``--arrivals`` times the steps of a loop whose requests keep arriving instead: graph mode (a
:class:`~attnmeta.StaticProfile` of ``batch`` rows), every step unpadded, of up to ``batch`` rows of which
one to three are prompt chunks of up to 64 tokens after the decodes, its counts new at nearly every step
(:func:`arrivals_walk`; each round its own steps). A builder that replays such steps with one recorded
layout (those with an :meth:`~attnmeta.builder.Builder.any_rows_key`) replays them; the default builders
are those.

Run: ``python benchmarks/bench_replay.py [--device cpu|cuda] [--builders mla,gdn] [--batches 1,64,256]
[--rounds 6] [--steps 200] [--drafts 2 | --arrivals]`` (set ``OMP_NUM_THREADS=1`` on a small CPU machine).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.util
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

if importlib.util.find_spec("attnmeta") is None:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _args import device_arg  # benchmarks/_args.py

import attnmeta
from attnmeta import BatchSpec, Stager, StaticProfile
from attnmeta.backends.flashinfer import FlashInferOptions
from attnmeta.builder import AnyBuilder, Builder
from attnmeta.compose import Group, StepBuilder
from attnmeta.testing.lab import lab
from attnmeta.testing.workloads import advance, decode_spec

_SAMPLE = BatchSpec(num_computed_tokens=[3], num_scheduled_tokens=[1], block_table=[[1]], block_size=16)


def replaying_builders() -> list[str]:
    """The registered builders that implement :meth:`~attnmeta.builder.Builder.replayer`, sorted."""
    return sorted(n for n, b in attnmeta.registry().items() if type(b).replayer is not Builder.replayer)


def without_replay(builder: AnyBuilder) -> AnyBuilder:
    """A builder of ``builder``'s class whose :meth:`~attnmeta.builder.Builder.replay_key` and
    :meth:`~attnmeta.builder.Builder.any_rows_key` are None: every step it is in is composed through
    ``derive``."""
    cls = type(builder)
    sub = type(f"Composed{cls.__name__}", (cls,), {"replay_key": lambda self, shape, options, inputs: None,
                                                    "any_rows_key": lambda self, shape, options, inputs: None})
    composed: AnyBuilder = sub()
    return composed


def _counts(spec: BatchSpec) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``build_counts``'s arguments for ``spec``: its arrays as a scheduler holds them."""
    return ((spec.num_computed_tokens, spec.num_scheduled_tokens, [(spec.block_table, spec.block_size)]),
            {"num_prompt_tokens": spec.num_prompt_tokens, "num_draft_tokens": spec.num_draft_tokens})


def arrivals_walk(batch: int, steps: int, seed: int) -> list[BatchSpec]:
    """``steps`` unpadded steps of a loop whose requests keep arriving: each of ``batch // 2`` to ``batch``
    rows, one to three of them (at most all) prompt chunks of 1-64 tokens over cached contexts of 0-511
    tokens after decodes of contexts in [1, 2048) (prompt lengths given, so the chunks are prefilling),
    block size 16, a 136-column table. Every step's counts are drawn anew."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        n = int(rng.integers(max(batch // 2, 1), batch + 1))
        p = min(n, int(rng.integers(1, 4)))
        d = n - p
        c = np.concatenate([rng.integers(1, 2048, d), rng.integers(0, 512, p)]).astype(np.int32)
        q = np.concatenate([np.ones(d, np.int32), rng.integers(1, 65, p)]).astype(np.int32)
        prompt = np.where(np.arange(n) < d, np.minimum(c, 16), c + q + 16).astype(np.int32)
        out.append(BatchSpec(num_computed_tokens=c, num_scheduled_tokens=q, num_prompt_tokens=prompt, block_size=16,
                             block_table=rng.integers(0, 1 << 20, (n, 136)).astype(np.int32)))
    return out


def arrivals_profile(batch: int) -> StaticProfile:
    """The graph-mode capacities of :func:`arrivals_walk`'s steps at ``batch``."""
    return StaticProfile(max_num_reqs=batch, max_num_tokens=batch + 3 * 64, max_blocks_per_req=136, block_size=16)


def any_rows_builders() -> list[str]:
    """The registered builders that may key a graph-mode layout for steps of any counts
    (:meth:`~attnmeta.builder.Builder.any_rows_key`), sorted."""
    return sorted(n for n, b in attnmeta.registry().items() if b.gives_any_rows_key)


def with_drafts(options: Any, drafts: int) -> Any:
    """``options`` set for spec decode with ``drafts`` drafts a request, where they have such a setting."""
    if not drafts:
        return options
    if hasattr(options, "num_speculative_tokens"):
        return dataclasses.replace(options, num_speculative_tokens=drafts)
    if isinstance(options, FlashInferOptions):
        return dataclasses.replace(options, decode_threshold=1 + drafts)
    return options


def measure(name: str, batch: int, device: str, rounds: int, steps: int, drafts: int = 0,
            arrivals: bool = False) -> tuple[float, float, int]:
    """(composed us, replayed us, replays in the replaying composer's timed steps) for ``name`` at ``batch``,
    each request verifying ``drafts`` drafts a step; ``arrivals``: the steps of :func:`arrivals_walk`, in
    graph mode, each round (the warm-up's too) of steps of its own."""
    b = attnmeta.get_builder(name)
    if arrivals:
        walk = arrivals_walk(batch, steps * (rounds + 1), batch)
    else:
        walk = advance(decode_spec(batch, np.random.default_rng(batch), drafts=drafts), steps)
    options, inputs = lab(name).defaults(walk[0])
    options = with_drafts(options, drafts)
    inp = None if inputs is None else {name: inputs}
    calls = [_counts(s) for s in walk]
    profile = arrivals_profile(batch) if arrivals else None
    sides = {"composed": StepBuilder(Stager(device, profile=profile), Group({name: (without_replay(b), options)})),
             "replayed": StepBuilder(Stager(device, profile=profile), Group({name: (b, options)}))}
    done = {k: 0 for k in sides}  # (arrivals: the rounds each side has run)

    def run(composer: StepBuilder) -> float:
        ts = np.empty(steps)
        k = "composed" if composer is sides["composed"] else "replayed"
        first = done[k] * steps if arrivals else 0
        done[k] += 1
        for i, (args, kw) in enumerate(calls[first:first + steps]):
            t0 = time.perf_counter_ns()
            composer.build_counts(*args, **kw, inputs=inp)
            ts[i] = time.perf_counter_ns() - t0
        return float(np.median(ts)) / 1e3

    for c in sides.values():  # warm-up: compiled code, every slot's layouts recorded
        run(c)
    before = sides["replayed"].stats.replayed
    meds: dict[str, list[float]] = {k: [] for k in sides}
    gc.disable()
    try:
        for _ in range(rounds):
            for k, c in sides.items():
                meds[k].append(run(c))
    finally:
        gc.enable()
    replays = sides["replayed"].stats.replayed - before
    return statistics.median(meds["composed"]), statistics.median(meds["replayed"]), replays


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", type=device_arg, default="cpu")
    ap.add_argument("--builders", default="", help="comma-separated registry names (default: every builder that replays)")
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=200)
    how = ap.add_mutually_exclusive_group()
    how.add_argument("--drafts", type=int, default=0, help="drafts each request verifies a step (spec decode)")
    how.add_argument("--arrivals", action="store_true",
                     help="graph mode, unpadded steps of new counts each step, prompt chunks joining decodes")
    a = ap.parse_args()
    names = [n for n in a.builders.split(",") if n] or (any_rows_builders() if a.arrivals else replaying_builders())
    unknown = sorted(set(names) - set(attnmeta.registry()))
    if unknown:
        ap.error(f"--builders: not registered: {', '.join(unknown)} (registered: {', '.join(sorted(attnmeta.registry()))})")
    batches = [int(x) for x in a.batches.split(",")]
    kind = "graph-mode steps of arriving requests" if a.arrivals else "decode steps"
    print(f"# {platform.node()} {platform.processor() or platform.machine()}, {a.device}, {a.rounds} rounds x "
          f"{a.steps} {kind}, build_counts" + (f", {a.drafts} drafts a request" if a.drafts else ""))
    print(f"{'builder':>14} {'batch':>6} {'composed us':>12} {'replayed us':>12} {'saving':>7} {'replays':>8}")
    for name in names:
        for batch in batches:
            comp, rep, replays = measure(name, batch, a.device, a.rounds, a.steps, a.drafts, a.arrivals)
            print(f"{name:>14} {batch:>6} {comp:>12.1f} {rep:>12.1f} {comp / rep:>6.2f}x "
                  f"{replays / (a.rounds * a.steps):>7.0%}", flush=True)


if __name__ == "__main__":
    main()
