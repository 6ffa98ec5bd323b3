"""How close a replayed decode step can get to the commit before the builder contract: the contract's floor.

``ab_commit.py`` compares the fused step (:class:`attnmeta.backends.fused.FusedStepBuilder`, the step
composer over the registered FlashAttention and FlashInfer builders) with an older commit's. This
script asks what part of the difference the contract itself makes: it times, against the base's fused
step in alternating rounds of one process, this package's fused step and five hand-written replays of
the very layouts the composer recorded: four each doing more of what a replayed step must do and nothing
else (no loop over groups or builders, no host part for the builders, no per-builder calls), and one
that makes the floor's objects through the builders' own calls:

- ``shared``: begin the step, restage the recorded layout, the common pass's one compiled call, commit
  (the one copy). The base's fused step does all of this too;
- ``+ objects``: and the four metadata objects the step hands out (common, paged-KV, FlashAttention,
  FlashInfer), each from a template of the recorded one with the step's own scalars
  (:func:`attnmeta._fields.template`); the base made three, its FlashInfer object holding the page
  table's fields itself;
- ``+ lifetimes``: and the four objects tied to the step's lifetime (``Step.own_all``; the base had no
  lifetimes, the contract's default has them on);
- ``+ layout key``: and the step's shape and the composer's layout key, by which it finds the recorded
  layout (the base's key was its own, of one fixed composition): the contract's floor;
- ``builders' calls``: the floor's steps, with the objects made by the calls the composer makes instead of
  the script's templates: the common writer's host part and its two objects, each builder's rewrite and
  result (its per-step function). What it adds to the floor is the builders' and the common writer's
  own code; what the fused step adds to it is the composer's glue (its entry's checks, its loops over
  groups and builders, the metadata parts' walk, the ``ComposedStep`` and ``FusedStep``).

The hand-written replays reach into the composer's recorded layouts (private attributes of
:class:`attnmeta.compose.StepBuilder`): this is a measurement of the contract's parts, never a way to
build metadata. The last two replays are checked against the fused step's objects before timing, field
for field.

Run: ``python benchmarks/bench_replay_floor.py BASE [--device cuda] [--batches 1,64,256,1024] [--rounds 8]
[--steps 300] [--cold]`` (``BASE`` as for ``ab_commit.py``: a commit, or a folder with its exported package;
``--cold`` times each step right after a cache thrash, as ``ab_commit.py --cold`` does).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from _args import device_arg  # noqa: E402  (benchmarks/_args.py)
from ab_commit import EXPORTS, ab, base_package, decode_walk, paths  # noqa: E402

import attnmeta  # noqa: E402
from attnmeta import compose  # noqa: E402
from attnmeta._fields import template  # noqa: E402
from attnmeta.backends import flash_attn  # noqa: E402
from attnmeta.backends.fused import FusedStepBuilder  # noqa: E402
from attnmeta.common import _COMMON_PER_STEP  # noqa: E402

FLOORS = ("shared", "+ objects", "+ lifetimes", "+ layout key", "builders' calls")
"""The hand-written replays, each doing what the one before does and one more part of a replayed step (the
last: the floor's parts, its objects made by the builders' own calls)."""

_PAGED_PER_STEP = ("paged_kv_indices", "paged_kv_indices_cpu", "num_pages")  # (the fields a page count sets)
_FI_PER_STEP = ("common", "paged", "max_decode_query_len", "max_kv_len")  # (a decode step's: every row decodes)


class Floor:
    """The hand-written replays of a :class:`FusedStepBuilder`'s recorded decode layouts (every step of
    ``specs`` must have been built by ``builder`` on every ring slot first)."""

    def __init__(self, builder: FusedStepBuilder, specs: list[attnmeta.BatchSpec]) -> None:
        self.composer = c = builder._composer
        self.stager = c.stager
        shapes = {id(s): s.shape for s in specs}
        self.keys = {i: (sh, c._key((sh,), c._no_inputs, compose._NO_ARRAYS)) for i, sh in shapes.items()}
        self.templates: dict[tuple[int, int], tuple[Callable[..., Any], ...]] = {}

    def _record(self, step: Any, key: Any) -> Any:
        rec = step.slot_extras.get(self.composer._token, {}).get(key)
        if rec is None or not step.restage(rec.layout, None):
            step.abandon()
            raise RuntimeError("bench_replay_floor: this ring slot has not recorded the step's layout (build every "
                               "step on every slot first)")
        return rec

    def _objects(self, step: Any, rec: Any, shape: Any) -> tuple[Any, ...]:
        """The step's four objects from templates of the recorded ones (made once per record and page count,
        through the composer's own writers and replayers)."""
        t = self.templates.get((id(rec), shape.num_pages))
        if t is None:
            w = rec.groups[0][0]
            host, cm = w.host(shape, True), w.metadata(step, shape, True)
            pk = w.paged_metadata(step, shape.num_pages)
            (_n, _g, _p, fa_rep), (_n2, _g2, _p2, fi_rep) = rec.replayers
            fa, fi = fa_rep.result(step, cm, host, pk, None), fi_rep.result(step, cm, host, pk, None)
            t = self.templates[(id(rec), shape.num_pages)] = (
                template(cm, _COMMON_PER_STEP), template(pk, _PAGED_PER_STEP), template(fa, flash_attn._PER_STEP),
                template(fi, _FI_PER_STEP), pk.paged_kv_indices, pk.paged_kv_indices_cpu)
        make_cm, make_pk, make_fa, make_fi, idx, idx_cpu = t
        B, max_q, max_seq = shape.num_reqs, shape.max_query_len, shape.max_seq_len
        cm = make_cm(B, max_q, max_seq, True, B, shape.num_tokens)
        pk = make_pk(idx, idx_cpu, shape.num_pages)
        fa = make_fa(cm, max_q, max_seq, True, 0, 0, 0, 0, 0)
        fi = make_fi(cm, pk, max_q, shape.max_exact_seq_len)
        return cm, pk, fa, fi

    def step(self, spec: attnmeta.BatchSpec, upto: str) -> tuple[Any, ...] | None:
        """One replayed step of ``spec`` doing the parts of :data:`FLOORS` up to ``upto``; its objects
        (None for ``shared``)."""
        c = self.composer
        if upto in ("+ layout key", "builders' calls"):
            shape = spec.shape
            key = c._key((shape,), c._no_inputs, compose._NO_ARRAYS)
        else:
            shape, key = self.keys[id(spec)]
        step = self.stager.step()
        rec = self._record(step, key)
        passes = rec.passes if rec.passes is not False else rec.make_passes()
        passes.write((spec,))
        if upto == "builders' calls":  # (the calls the composer makes on a replay of this one group)
            w, causal, _paged, _threads = rec.groups[0]
            (_n, _g, _p, fa_rep), (_n2, _g2, _p2, fi_rep) = rec.replayers
            host = w.host(shape, causal)
            fa_rep.rewrite(step, host, None)
            fi_rep.rewrite(step, host, None)
            step.commit()
            cm, pk = w.metadata(step, shape, causal), w.paged_metadata(step, shape.num_pages)
            objs = (cm, pk, fa_rep.result(step, cm, host, pk, None), fi_rep.result(step, cm, host, pk, None))
            step.own_all(list(objs))
            return objs
        step.commit()
        if upto == "shared":
            return None
        objs = self._objects(step, rec, shape)
        if upto != "+ objects":
            step.own_all(list(objs))
        return objs


def floor_paths(batch: int, device: torch.device) -> dict[str, Callable[[], Any]]:
    """The :data:`FLOORS` replays of ``ab_commit.decode_walk`` of ``batch`` requests, by name, on a
    fused step builder of their own that has recorded every step's layout on every ring slot."""
    specs = [attnmeta.BatchSpec(**step) for step in decode_walk(batch)]
    builder = FusedStepBuilder(attnmeta.Stager(device))
    for _ in range(2):  # every step's layout recorded on every ring slot (twice: a slot's first step may grow it)
        for s in specs:
            for _ in range(builder.stager.num_slots):
                builder.build(s)
    floor = Floor(builder, specs)
    check(builder, floor, specs)
    out: dict[str, Callable[[], Any]] = {}
    for upto in FLOORS:
        at = [0]

        def run(upto: str = upto, at: list[int] = at) -> Any:
            at[0] += 1
            return floor.step(specs[at[0] % 64], upto)

        out[upto] = run
    return out


def check(builder: FusedStepBuilder, floor: Floor, specs: list[attnmeta.BatchSpec]) -> None:
    """Raise unless the last two hand-written replays hand out the fused step's objects, field for field."""
    for upto in ("+ layout key", "builders' calls"):
        for s in specs[:8]:
            want = builder.build(s)
            got = floor.step(s, upto)
            assert got is not None
            for name, a, b in (("common", got[0], want.common), ("flash_attn", got[2], want.flash_attn),
                               ("flashinfer", got[3], want.flashinfer)):
                where = differs(a, b)
                if where:
                    raise AssertionError(f"bench_replay_floor: the `{upto}` replay's {name}.{where} differs from the "
                                         f"fused step's at {s!r}")


def differs(a: Any, b: Any) -> str:
    """The first field where metadata objects ``a`` and ``b`` differ (``""``: none): tensors and arrays by
    dtype, shape and values, nested objects field by field, anything else by ``==``."""
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        if type(a) is not type(b):
            return f" (type {type(a).__name__} != {type(b).__name__})"
        for f in dataclasses.fields(a):
            where = differs(getattr(a, f.name), getattr(b, f.name))
            if where:
                return f.name + ("." + where if not where.startswith(" ") else where)
        return ""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a.cpu(), b.cpu()))
        return "" if same else " (tensor)"
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        same = (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype
                and np.array_equal(a, b))
        return "" if same else " (array)"
    return "" if a == b else f" ({a!r} != {b!r})"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("base", help="the commit before the builder contract (3786481), or a folder holding its exported "
                                 "attnmeta package (git archive COMMIT attnmeta | tar -x -C FOLDER)")
    ap.add_argument("--device", type=device_arg, default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batches", default="1,64,256,1024")
    ap.add_argument("--exports", type=Path, default=EXPORTS, help="as ab_commit.py's")
    ap.add_argument("--cold", action="store_true", help="time each step right after a cache thrash (as ab_commit.py's)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    dev = torch.device(args.device)
    warnings.filterwarnings("ignore", category=attnmeta.staging.UncheckedBlockIdsWarning)  # (as ab_commit.py's)
    base = base_package(args.base, args.exports)
    cold = ", each step after a cache thrash" if args.cold else ""
    print(f"# {args.device}, torch {torch.__version__}, base {args.base}, {args.rounds} rounds x {args.steps} steps{cold}; "
          "medians over rounds of per-round medians (us), each row against the base's fused step in its own rounds")
    print(f"{'batch':>6} {'path':<16} {'base fused':>11} {'this':>8} {'this/base':>10}")
    for batch in [int(x) for x in args.batches.split(",")]:
        old = paths(base, batch, dev)["fused"]
        floors = floor_paths(batch, dev)
        rows = [("fused", paths(attnmeta, batch, dev)["fused"]), *floors.items()]
        for name, fn in rows:
            ta, tb = ab(old, fn, args.rounds, args.steps, dev, cold=args.cold)
            print(f"{batch:>6} {name:<16} {ta:>11.1f} {tb:>8.1f} {tb / ta:>10.3f}", flush=True)


if __name__ == "__main__":
    main()
