"""Where the engine loop's replayed step spends its time: the step composer's call, split into phases.

``bench_engine.py`` reports attnmeta's host time a step inside the reference engine's loop, several
times the same step's back-to-back time (the loop leaves the caches cold; docs/benchmarks.md). This
script says which parts of the call that time goes to. It imports the package with timing marks put in
at import (:data:`MARKS`: a ``time.perf_counter_ns()`` read before each named line of the composer's
replay, the stager's claim and commit, and the common writer's page-table object), from the installed
source, which it leaves unchanged (nothing is written to ``__pycache__``), then serves the
``bench_engine.py`` workload and times the full-batch decode steps. A phase is the time from one mark to
the next, named by the mark it ends at; the table gives each phase's median over the steps, in
microseconds, its share of the call's median, and the whole call's median, with the marks in (a mark
costs about 0.1 us back to back, 0.15 us after a cache thrash, on the CPU machine).

Every timed step must replay its ring slot's recorded layout (``bench_engine.py``'s ``replay`` column:
the warm-up records every slot's layouts); a step that takes another path (a composed step) passes other
marks and is left out, and the script says how many were.

Run: ``python benchmarks/bench_loop_phases.py [--device cpu|cuda] [--model tiny|1b|tiny-hybrid|hybrid-1b]
[--concurrency 64,256] [--rounds 3]`` (CPU: torch's paged kernel, eager; CUDA: FlashInfer in CUDA graphs,
as ``bench_engine.py``'s ``graphs`` mode, or for a hybrid model eager, as its ``eager`` mode; set
``OMP_NUM_THREADS=1`` on a small CPU machine). Run it as a script: the marks must be in before anything
imports ``attnmeta``.
"""

from __future__ import annotations

import argparse
import gc
import importlib.abc
import importlib.machinery
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import CodeType, ModuleType
from typing import Any

from _args import device_arg  # benchmarks/_args.py (torch only: nothing of attnmeta before the marks)

MARKS: tuple[tuple[str, str, str, str], ...] = (
    # (module, the start of a statement's first line (stripped), the phase that ends there, a line it comes
    # after where the start is not unique in the module ("" where it is)), in the order a replayed step
    # passes them
    ("attnmeta.compose", "scan = scan_counts(c, q, tables,", "(call)", ""),
    ("attnmeta.spec", "st, total, max_q, max_seq, max_ub, pages0, first, pre, uni, spec = _scan_nb(",
     "scan: the arguments checked", ""),
    ("attnmeta.compose", "if scan is None:", "scan: compiled, its scalars", "scan = scan_counts(c, q, tables,"),
    ("attnmeta.compose", "shapes = shapes_of(scan)", "inputs and arrays checked", ""),
    ("attnmeta.compose", "key = self._lengths_key(", "shapes", ""),
    ("attnmeta.compose", "return self._run(shapes, key,", "layout key", ""),
    ("attnmeta.staging._ring", "if prev is not None and not prev._expired:", "claim: the ring slot taken",
     "prev = None if owner is None else owner()"),
    ("attnmeta.staging._ring", "waits, wait_s = self._wait_slot(slot)", "claim: the slot's last step expired", ""),
    ("attnmeta.staging._ring", "step = make(self, slot, waits, wait_s)", "fence query", ""),
    ("attnmeta.compose", "records = step.slot_extras.get(self._token)", "step object", ""),
    ("attnmeta.compose", "restaged = rec is not None and step.restage(rec.layout, rows)", "record found (graph mode: row counts)",
     ""),
    ("attnmeta.compose", "return self._replay(step, rec, shapes,", "restage", ""),
    ("attnmeta.compose", "for (w, causal, _p, _t), shape in zip(rec.groups, shapes):", "common passes (compiled)", ""),
    ("attnmeta.compose", "for _n, gi, pi, rep in rec.replayers:", "host objects", ""),
    ("attnmeta.compose", "for (_name, view), a in zip(rec.arrays, arrays):", "builders' rewrites", ""),
    ("attnmeta.compose", "step.commit()", "engine arrays written", "for (_name, view), a in zip(rec.arrays, arrays):"),
    ("attnmeta.staging._ring", "ev = slot.event.cuda_event", "commit: sentinels (graph mode), the copy's size", ""),
    ("attnmeta.staging._ring", "if drv.copy(", "commit: torch's modes, device and stream checked", ""),
    ("attnmeta.staging._ring", "if drv.record(ev, handle):", "commit: the copy's driver call", ""),
    ("attnmeta.staging._ring", "slot.generation += 1", "commit: the fence (CPU: the whole commit)", ""),
    ("attnmeta.compose", "self.stats.replayed += 1", "commit done (graph mode: the arena's last step expired)", ""),
    ("attnmeta.compose", "cms.append(cm)", "common metadata object (a group's)", ""),
    ("attnmeta.common", "v = t[2].copy()", "(paged-KV template)", ""),
    ("attnmeta.common", "meta = _make_paged_positional(*v)", "page-indices views (a group's)", ""),
    ("attnmeta.common", "self._paged_meta = (step, num_pages, meta, dev, v)", "paged-KV metadata object (a group's)",
     ""),
    ("attnmeta.compose", "meta = {}", "the groups' loop", ""),
    ("attnmeta.compose", "owned.append(m)", "a builder's metadata object", "meta[n] = m = rep.result("),
    ("attnmeta.compose", "devices = rec.devices", "builders' loop", ""),
    ("attnmeta.compose", "step.own_all(owned)", "arrays' device views, the composed step", ""),
    ("attnmeta.compose", "return out", "lifetimes registered", "step.own_all(owned)"),
)
"""Where the marks go. A mark's phase runs from the mark passed before it (in any module) to it, so a phase
is named by what the code between the two does on the replay path. A name in brackets joins the next
phase: its mark only splits the time for that one. The marks of the groups' loop are passed once per
KV-cache group (the paged-KV ones for a group that stages a page table), so their rows repeat, in group
order. Steps on another path pass other marks (a CPU's commit copies with torch and passes no driver
mark) and are counted apart."""

_COMPOUND = frozenset({"if", "elif", "else", "for", "while", "with", "try", "except", "finally", "def", "class",
                       "async", "match", "case"})
"""Statements a mark cannot share a line with."""
_TIMES: list[tuple[str, int]] = []
_END = "objects returned"


def _mark(label: str, _clock: Any = time.perf_counter_ns, _add: Any = _TIMES.append) -> None:
    _add((label, _clock()))


def instrument(source: str, module: str) -> str:
    """``source`` (of ``module``) with a call of the mark function before each of its :data:`MARKS` lines
    (on the same line where the statement is a simple one).

    Raises
    ------
    LookupError
        A mark's line is not in ``source`` once (after its ``after`` line, where it has one): the code
        moved; update :data:`MARKS`.
    """
    original = source.splitlines(keepends=True)
    lines = list(original)  # (found in the original, changed in the copy)
    inserts: list[tuple[int, str]] = []
    for mod, start, label, after in MARKS:
        if mod != module:
            continue
        first = 0
        if after:
            first = next((i + 1 for i, line in enumerate(original) if line.strip().startswith(after)), len(lines))
        found = [i for i in range(first, len(lines)) if original[i].strip().startswith(start)]
        if not found or (not after and len(found) > 1):
            where = f" after {after!r}" if after else ""
            raise LookupError(f"bench_loop_phases: {module} has {len(found)} lines starting {start!r}{where}, not one: "
                              f"the code moved; update MARKS")
        i = found[0]
        body = original[i].lstrip()
        indent = original[i][: len(original[i]) - len(body)]
        call = f"_bench_phase_mark({label!r})"
        if body.split(" ", 1)[0].rstrip(":") in _COMPOUND:  # (a line of its own before it)
            inserts.append((i, f"{indent}{call}\n"))
        else:  # (in front of it, on its line: the module's line numbers, numba's cache keys, stay)
            lines[i] = f"{indent}{call}; {body}"
    inserts.sort()
    for i, text in reversed(inserts):
        lines.insert(i, text)
    return "".join(lines)


class _Loader(importlib.machinery.SourceFileLoader):
    """Compiles the instrumented source, never from or to ``__pycache__``."""

    def get_code(self, fullname: str) -> CodeType:
        path = self.get_filename(fullname)
        source = self.get_data(path).decode("utf-8")
        code: CodeType = compile(instrument(source, fullname), path, "exec", dont_inherit=True)
        return code

    def exec_module(self, module: ModuleType) -> None:
        module.__dict__["_bench_phase_mark"] = _mark
        super().exec_module(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if fullname not in {m for m, *_r in MARKS}:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.origin is None:
            return None
        spec.loader = _Loader(fullname, spec.origin)
        return spec


def install() -> None:
    """Put the marks into :data:`MARKS`' modules when they are imported (before any ``attnmeta`` import).

    Raises
    ------
    RuntimeError
        One of them is imported already.
    """
    done = [m for m, *_r in MARKS if m in sys.modules]
    if done:
        raise RuntimeError(f"bench_loop_phases: {sorted(set(done))} imported before the marks were installed")
    sys.meta_path.insert(0, _Finder())


def phases(calls: list[list[tuple[str, int]]]) -> tuple[list[tuple[str, float]], int]:
    """Each phase's median (us) over ``calls`` (each a call's marks, its end last) that passed the marks of
    the most common path, in the order they were passed; and how many calls did."""
    paths: dict[tuple[str, ...], list[list[tuple[str, int]]]] = {}
    for c in calls:
        paths.setdefault(tuple(label for label, _t in c), []).append(c)
    order, kept = max(paths.items(), key=lambda kv: len(kv[1]))
    out: list[tuple[str, float]] = []
    carried = 0.0
    for j in range(1, len(order)):
        us = statistics.median([c[j][1] - c[j - 1][1] for c in kept]) / 1e3
        if order[j].startswith("("):  # (its time joins the next phase's)
            carried += us
            continue
        out.append((order[j], us + carried))
        carried = 0.0
    return out, len(kept)


def measure(bench_engine: ModuleType, model: Any, mode: str, n: int, prompt: int, new: int, device: Any, rounds: int
            ) -> tuple[list[list[tuple[str, int]]], list[float]]:
    """The marks of the composer's call on each full-batch decode step of ``rounds`` runs (new requests
    each), and each call's time (us); ``bench_engine``: that script's module, imported after
    :func:`install` (it imports attnmeta)."""
    engine = bench_engine.warm_engine(model, mode, n, prompt, new, device)
    own = engine.composer.build_counts
    calls: list[list[tuple[str, int]]] = []
    totals: list[float] = []

    def timed(*args: Any, **kw: Any) -> Any:
        _TIMES.clear()
        _mark("(call)")
        out = own(*args, **kw)
        _mark(_END)
        calls.append(list(_TIMES))
        return out

    engine.composer.build_counts = timed  # type: ignore[method-assign]
    mixed = engine.mixed_composer  # (its mixed steps' composer, EngineConfig.fixed_mixed_layout: no marks kept)
    if mixed is not None:
        own_mixed = mixed.build_counts

        def untimed(*args: Any, **kw: Any) -> Any:
            calls.append([])
            return own_mixed(*args, **kw)

        mixed.build_counts = untimed  # type: ignore[method-assign]
    kept: list[list[tuple[str, int]]] = []
    vocab = model.config.vocab_size
    gc.collect()
    gc.disable()
    try:
        for r in range(rounds):
            calls.clear()
            k0 = len(engine.stats.step_kinds)
            engine.run(bench_engine._requests(n, prompt, new, vocab, 1000 + r))
            kinds = engine.stats.step_kinds[k0:]
            assert len(kinds) == len(calls), "one composer call a step"
            for i in bench_engine.full_batch(kinds):
                kept.append(calls[i])
                totals.append((calls[i][-1][1] - calls[i][0][1]) / 1e3)
    finally:
        gc.enable()
    return kept, totals


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", type=device_arg, default="cpu")
    p.add_argument("--model", default="tiny", help="1b, hybrid-1b, tiny or tiny-hybrid (bench_engine.py's)")
    p.add_argument("--concurrency", default="64,256")
    p.add_argument("--rounds", type=int, default=3, help="runs of the workload timed (default 3)")
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new", type=int, default=96)
    a = p.parse_args(argv)
    install()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import bench_engine
    import torch

    from examples.engine.workload import make_model

    device = torch.device(a.device)
    config = bench_engine.MODELS[a.model]()
    hybrid = bench_engine.is_hybrid(config)
    mode = "paged" if device.type != "cuda" else "eager" if hybrid else "graphs"
    model = make_model(config, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"# {a.model}, mode {mode}, {name}: the step composer's call on full-batch decode steps, split at the marks "
          f"(us, medians over steps)", flush=True)
    for n in [int(x) for x in a.concurrency.split(",")]:
        kept, totals = measure(bench_engine, model, mode, n, a.prompt, a.new, device, a.rounds)
        rows, on_path = phases(kept)
        whole = statistics.median(totals)
        print(f"\n## {n} requests: the call {whole:.1f} us ({on_path} of {len(kept)} steps on the replay path)")
        print(f"{'phase':<56} {'us':>7} {'share':>6}")
        for label, us in rows:
            print(f"{label:<56} {us:7.1f} {us / whole:6.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
