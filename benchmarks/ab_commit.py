"""A/B in one process: this checkout's decode step against another commit's, and the lifetime check on/off.

The other commit's package is exported with ``git archive`` and imported under another name
(``attnmeta_base``: every ``attnmeta`` import in it renamed), so both run in the same process, on the
same machine, in alternating rounds. The renamed copy is kept in ``.ab_exports`` (``--exports``) with
its compiled kernels, so a later run against the same base (this script's or ``ab_engine.py``'s) skips
compiling them; the six most recently used copies are kept. Paths, at batch 1 / 64 / 256 / 1024 of the decode
walks (contexts grow by one token a step, page size 16):

- ``fused``: :class:`attnmeta.backends.fused.FusedStepBuilder` on ready-made specs;
- ``fused+spec``: the same with each step's ``BatchSpec`` constructed inside the step from writable
  arrays (as an engine does from its scheduler's);
- ``composable``: ``stage_common`` + FlashAttention + FlashInfer staged into one step;
- ``engine graphs``: the reference engine's graph-mode step (a graph-mode stager; the step composer with
  FlashInfer and the engine's two arrays; the step from the scheduler's arrays, padded to the captured
  size), and ``engine hybrid``: its hybrid model's eager step (FlashInfer over the attention group, Mamba2
  over the Mamba group, the two arrays; the Mamba group's table beside the attention one), where both
  commits have the step composer (compared against an older commit, the two rows are left out). Each
  side takes the engine's entry as its package has it: ``StepBuilder.build_counts`` of the arrays, or
  where it has none, a ``BatchSpec`` made in the step (and ``for_group``) and ``build``;
- ``lifetimes on/off``: this checkout's fused step on ``Stager(check_lifetimes=False)`` (the "base"
  column) against the default.

Each round times ``--steps`` consecutive steps of one path; the two sides alternate rounds; the table
gives the medians over rounds of per-round medians (us) and their ratio (``--mean``: of per-round
means). Garbage collection is off while timing. ``--cold`` times each step right after a cache
thrash instead (64 MiB of cache lines written and 20,000 small dicts read, untimed:
``benchmarks/_cold.py``'s ``thrash``), the state an engine's loop leaves the caches in; a change that
saves work in a tight loop may save nothing there, and the reverse. The engine rows cycle through the walk's 64 steps, so once warm the step composer finds
every step's shape in its caches (its layout keys); in an engine's loop every decode step has a new
longest sequence and misses them. ``--walk`` makes the engine rows walk one decode walk for the whole
run instead, a step's counts a fresh array each step, as the loop does: for a change to the per-step
key path, or to see what the cycle leaves out. A walk's longer sequences also outgrow their layout now
and then (a wider block table), and each ring slot then composes the step
afresh: a median leaves those steps out, ``--mean`` counts them as a loop's average does.
``--engine-steps`` makes the engine rows walk the reference engine's own decode steps instead,
recorded first on the CPU (:func:`engine_steps`: ``bench_engine.py``'s workload, served as many times,
with new requests each time, as the timed walk has steps; about 30 s for 6 rounds of 200 steps at
64 requests on the 2-core CPU machine): their page counts are a serving loop's, a new one nearly
every step, recurring over the runs. No step is timed twice, so a cache by page count fills as it
does in a loop that serves one run after another: empty at the first run, finding more of each
run's counts the more runs it has served.
(Cycling through a few runs instead would find every count after the first cycle: a
loop that has served for hours, and only while its page counts stay in a narrow range.)

``--split`` times the ``composable`` row's step in parts instead (:data:`SPLIT`: beginning the step, each
builder's staging, the commit, each result), both sides back to back in alternating rounds, and prints each
part's medians and their difference: where a difference in the composable row lies.

Run: ``python benchmarks/ab_commit.py BASE_COMMIT [--device cuda] [--rounds 12] [--steps 300] [--cold] [--walk |
--engine-steps] [--mean] [--split]``; on a
machine without the checkout's history, export the base first (``git archive BASE_COMMIT attnmeta | tar -x -C
.ab_base``) and pass the folder instead of the commit (benchmarks/gpu_all.sh's part ``ab`` does).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import importlib
import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import attnmeta  # noqa: E402
from attnmeta.testing.workloads import advance, decode_spec  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from _args import device_arg  # noqa: E402  (benchmarks/_args.py)
from _cold import thrash  # noqa: E402  (benchmarks/_cold.py)

EXPORTS = ROOT / ".ab_exports"
"""Where the exported base packages are kept between runs (:func:`import_exported`; ``--exports``)."""
KEEP_EXPORTS = 6
"""How many exports :func:`import_exported` keeps (the most recently used); each is a copy of a package
with the kernels compiled from it: a few MB."""
_COMPILED = (".pyc", ".nbi", ".nbc")  # (Python's and numba's caches: not a copy's content)
_NOT_SOURCE = shutil.ignore_patterns("__pycache__", *(f"*{suffix}" for suffix in _COMPILED))


def export(commit: str, path: str, into: Path) -> Path:
    """``path`` (a folder of this checkout: ``attnmeta``, ``examples/engine``) as of ``commit``, copied
    under ``into``; where it is. ``commit`` is a commit of this checkout, or a folder holding ``path``
    exported from one (``git archive COMMIT PATH | tar -x -C FOLDER``), for a machine the checkout travels
    to without its history."""
    exported = Path(commit) / path
    dst = into / "_export" / path
    if (exported / "__init__.py").is_file():
        shutil.copytree(exported, dst, ignore=_NOT_SOURCE)
    else:
        data = subprocess.run(["git", "-C", str(ROOT), "archive", commit, path], capture_output=True,
                              check=True).stdout
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            tar.extractall(into / "_export", filter="data")
    return dst


def export_key(commit: str, path: str) -> str:
    """A name for the content of ``path`` as of ``commit`` (:func:`export`'s arguments): git's hash of
    its tree at a commit; for an exported folder, a hash of its files' names and bytes (compiled caches
    left out). Two commits with the same ``path`` share the key."""
    exported = Path(commit) / path
    if not (exported / "__init__.py").is_file():
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", f"{commit}:{path}"], capture_output=True,
                              check=True, text=True).stdout.strip()
    h = hashlib.sha1()
    for f in sorted(exported.rglob("*")):
        if f.is_file() and "__pycache__" not in f.parts and f.suffix not in _COMPILED:
            h.update(f.relative_to(exported).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def rename_imports(folder: Path, renames: dict[str, str]) -> None:
    """Rewrite every ``.py`` file under ``folder``: each package of ``renames`` (``attnmeta``,
    ``examples.engine``) imported and named under its new name instead."""
    for f in folder.rglob("*.py"):
        text = f.read_text()
        for old, new in renames.items():
            dotted = re.escape(old)
            text = re.sub(rf"\b{dotted}\.", f"{new}.", text)
            text = re.sub(rf"^(\s*)(import|from) {dotted}\b", rf"\1\2 {new}", text, flags=re.M)
        f.write_text(text)


def import_exported(commit: str, path: str, name: str, renames: dict[str, str], exports: Path = EXPORTS) -> Any:
    """``path`` as of ``commit`` (:func:`export`), imported as the package ``name``, with the imports of
    :func:`rename_imports`'s ``renames`` rewritten.

    The renamed copy is kept under ``exports`` (a folder per content, :func:`export_key`) and reused by
    later runs, so the base's kernels compile once: numba caches them beside their source, and the cache
    stays valid while the copy's files are untouched. Processes exporting the same content at once each
    write their own copy and keep the first one renamed into place. The :data:`KEEP_EXPORTS` most recently
    used copies are kept, older ones deleted."""
    digest = hashlib.sha1(repr((export_key(commit, path), name, sorted(renames.items()))).encode()).hexdigest()
    home = exports / f"{name}-{digest[:16]}"
    if not (home / name / "__init__.py").is_file():
        try:
            exports.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{home.name}-", dir=exports))
        except OSError as e:
            raise OSError(f"cannot keep the base's copy under {exports} ({e}); --exports DIR names a writable "
                          "folder") from None
        export(commit, path, tmp).rename(tmp / name)
        rename_imports(tmp / name, renames)
        shutil.rmtree(tmp / "_export")
        try:
            tmp.rename(home)
        except OSError:  # (another process put the same copy in place first)
            shutil.rmtree(tmp, ignore_errors=True)
    os.utime(home)  # (its last use, for the eviction below)
    used = {d: _mtime(d) for d in exports.iterdir()}  # (another process may delete one meanwhile: then 0)
    copies = sorted((d for d in used if not d.name.startswith(".")), key=used.__getitem__, reverse=True)
    unfinished = [d for d in used if d.name.startswith(".") and time.time() - used[d] > 3600]
    for old in copies[KEEP_EXPORTS:] + unfinished:  # (unfinished: a copy whose process died an hour ago)
        shutil.rmtree(old, ignore_errors=True)
    if str(home) not in sys.path:
        sys.path.insert(0, str(home))
    return importlib.import_module(name)


def _mtime(path: Path) -> float:
    """``path``'s modification time; 0 where it is gone."""
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return 0.0


def base_package(commit: str, exports: Path = EXPORTS, side: str = "base") -> Any:
    """``commit``'s ``attnmeta`` package, imported as ``attnmeta_<side>`` (``attnmeta_base`` by default)
    from a copy kept under ``exports`` (:func:`import_exported`; ``commit``: a commit, or a folder
    exported from one, :func:`export`)."""
    return import_exported(commit, "attnmeta", f"attnmeta_{side}", {"attnmeta": f"attnmeta_{side}"}, exports)


def decode_walk(batch: int) -> list[dict[str, Any]]:
    """The decode walk of ``batch`` requests that every row times: 64 steps, contexts growing one token a
    step, page size 16, as ``BatchSpec`` keyword arguments (host arrays of their own; any package's
    ``BatchSpec(**step)`` makes the step)."""
    return [dict(num_computed_tokens=s.num_computed_tokens.copy(), num_scheduled_tokens=s.num_scheduled_tokens.copy(),
                 num_prompt_tokens=None if s.num_prompt_tokens is None else s.num_prompt_tokens.copy(),
                 block_table=s.block_table, block_size=s.block_size)
            for s in advance(decode_spec(batch, np.random.default_rng(batch)), 64)]


def paths(mod: Any, batch: int, device: torch.device, walk: int = 0, engine: list[dict[str, Any]] | None = None,
          **stager_kw: Any) -> dict[str, Callable[[], Any]]:
    """The step paths of package ``mod`` on the decode walk of ``batch`` requests (the engine rows walk
    ``walk`` steps without repeating one where it is given: :class:`_Walk`; or walk ``engine`` in order,
    the reference engine's own steps: :func:`engine_steps`)."""
    fa = importlib.import_module(mod.__name__ + ".backends.flash_attn")
    fi = importlib.import_module(mod.__name__ + ".backends.flashinfer")
    fused = importlib.import_module(mod.__name__ + ".backends.fused")
    raws = decode_walk(batch)
    specs = [mod.BatchSpec(**r) for r in raws]
    builder = fused.FusedStepBuilder(mod.Stager(device, **stager_kw))
    builder_spec = fused.FusedStepBuilder(mod.Stager(device))
    stager = mod.Stager(device)
    at = [0, 0, 0]

    def f() -> Any:
        i = at[0] = at[0] + 1
        return builder.build(specs[i % 64])

    def fs() -> Any:
        i = at[1] = at[1] + 1
        return builder_spec.build(mod.BatchSpec(**raws[i % 64]))

    def comp() -> Any:
        i = at[2] = at[2] + 1
        s = specs[i % 64]
        with stager.step() as step:
            c = mod.stage_common(s, step, paged_kv=True, block_table_columns=fused.table_columns(s))
            a, b = fa.stage(c, step), fi.stage(c, step)
        return c.result(), a.result(), b.result()

    out = {"fused": f, "fused+spec": fs, "composable": comp}
    compose = _module(mod, "compose")
    if compose is not None:
        steps = raws if engine is None else engine
        out["engine graphs"] = engine_graphs(mod, compose, fi.FLASHINFER, steps, device, walk)
        out["engine hybrid"] = engine_hybrid(mod, compose, fi.FLASHINFER, steps, device, walk)
    return out


def _module(mod: Any, name: str) -> Any:
    """``mod.name`` (a submodule), or None where that commit has none."""
    try:
        return importlib.import_module(f"{mod.__name__}.{name}")
    except ModuleNotFoundError:
        return None


def _longest(raws: list[dict[str, Any]]) -> int:
    """The longest sequence (``c + q``) of the walk."""
    return max(int((r["num_computed_tokens"] + r["num_scheduled_tokens"]).max()) for r in raws)


def _fit(table: np.ndarray, width: int) -> np.ndarray:
    """``table``'s first ``width`` columns (zeros past its own), C-contiguous."""
    out = np.zeros((table.shape[0], width), np.int32)
    cols = min(width, table.shape[1])
    out[:, :cols] = table[:, :cols]
    return out


def engine_steps(batch: int, at_least: int = 1) -> list[dict[str, Any]]:
    """The full-batch decode steps of the reference engine (``examples/engine``) serving
    ``bench_engine.py``'s workload at ``batch`` requests on the CPU (its tiny Llama and torch's paged kernel:
    the same scheduler and counts as the GPU's modes), run after run of new requests until there are
    ``at_least`` steps (one run at least): each step's computed and scheduled counts and block table as
    the engine hands them to its step composer, in order. Their page counts are a serving loop's: a new one nearly
    every step, recurring over the runs (neither the synthetic walk's cycle, where all recur, nor
    ``--walk``, where none does)."""
    import bench_engine  # (benchmarks/: the engine benchmark's workload and engine)

    from examples.engine.workload import make_model, tiny_config

    cpu = torch.device("cpu")
    model = make_model(tiny_config(), cpu)
    engine = bench_engine._engine(model, "paged", batch, 64, 96, cpu)
    composer = engine.composer
    steps: list[dict[str, Any]] = []
    build_counts = composer.build_counts

    def record(c: np.ndarray, q: np.ndarray, tables: list[tuple[np.ndarray, int]], **kw: Any) -> Any:
        if len(c) == batch and bool((q == 1).all()):
            steps.append({"num_computed_tokens": c.copy(), "num_scheduled_tokens": q.copy(),
                          "block_table": tables[0][0].copy(), "block_size": tables[0][1]})
        return build_counts(c, q, tables, **kw)

    composer.build_counts = record  # (this engine's own composer only)
    seed = 0
    while seed == 0 or len(steps) < at_least:
        engine.run(bench_engine._requests(batch, 64, 96, model.config.vocab_size, seed))
        seed += 1
    return steps


def _engine_arrays(compose: Any, capacity: int | None = None) -> list[Any]:
    """The reference engine's two arrays of its own (token ids, last step's sampled rows)."""
    return [compose.Array("engine.input_ids", np.int32, capacity=capacity),
            compose.Array("engine.prev_rows", np.int32, capacity=capacity, fill=-1)]


class _Walk:
    """The engine rows' counts, step by step: the steps of ``raws`` over and over (``steps`` 0), or
    ``steps`` steps of one decode walk that never repeats a step, each step's counts a fresh array (as an
    engine's scheduler makes them). In an engine's loop every decode step has a new longest sequence, so
    the step composer's caches by step shape (its layout keys) miss on every step; the 64-step cycle of
    the synthetic walk hits them once warm, and the walk misses every one (its page count never recurs);
    the reference engine's own steps (:func:`engine_steps`) have a loop's page counts, which recur over
    its runs."""

    def __init__(self, raws: list[dict[str, Any]], steps: int) -> None:
        self.raws, self.steps = raws, steps
        self.c0, self.q = raws[0]["num_computed_tokens"], raws[0]["num_scheduled_tokens"]

    def longest(self) -> int:
        """The longest sequence of the steps walked."""
        return _longest(self.raws) + self.steps * int(self.q.max())

    def counts(self, i: int) -> tuple[np.ndarray, np.ndarray, int]:
        """Step ``i``'s computed and scheduled counts, and the index of its table in ``raws`` (one table for
        the whole walk)."""
        if not self.steps:
            k = i % len(self.raws)
            r = self.raws[k]
            return r["num_computed_tokens"], r["num_scheduled_tokens"], k
        if i >= self.steps:
            raise RuntimeError(f"ab_commit: the walk has {self.steps} steps, step {i} asked")
        return self.c0 + np.int32(i) * self.q, self.q, 0


def engine_hybrid(mod: Any, compose: Any, flashinfer: Any, raws: list[dict[str, Any]], device: torch.device,
                  walk: int = 0) -> Callable[[], Any]:
    """The reference engine's hybrid step (examples/engine, eager): the step composer with FlashInfer over
    the attention group, Mamba2 over the Mamba group (one state slot a request) and the engine's two
    arrays; the attention spec made in the step from the scheduler's arrays, the Mamba group's from it
    (``BatchSpec.for_group`` where the package has it, else a second spec)."""
    mamba2 = importlib.import_module(mod.__name__ + ".backends.mamba.mamba2")
    batch = len(raws[0]["num_computed_tokens"])
    composer = compose.StepBuilder(
        mod.Stager(device, num_slots=3),
        compose.Group({"flashinfer": flashinfer}),
        compose.Group({"mamba": (mamba2.MAMBA2, mamba2.Mamba2Options(chunk_size=256))}, prefix="mamba_common",
                      table_column_step=1),
        arrays=_engine_arrays(compose))
    states = (1 + np.arange(batch, dtype=np.int32))[:, None]
    w = _Walk(raws, walk)
    longest = w.longest()
    arrays = {"engine.input_ids": np.arange(batch, dtype=np.int32), "engine.prev_rows": np.arange(batch, dtype=np.int32)}
    at = [0]

    counts = hasattr(composer, "build_counts")

    def step() -> Any:
        i = at[0] = at[0] + 1
        c, q, k = w.counts(i)
        r = raws[k]
        if counts:  # the engine's entry where the package has it: the scheduler's arrays, no specs
            return composer.build_counts(c, q, [(r["block_table"], r["block_size"]), (states, longest)], arrays=arrays)
        spec = mod.BatchSpec(num_computed_tokens=c, num_scheduled_tokens=q, block_table=r["block_table"],
                             block_size=r["block_size"])
        if hasattr(spec, "for_group"):
            mspec = spec.for_group(block_table=states, block_size=longest)
        else:
            mspec = mod.BatchSpec(num_computed_tokens=c, num_scheduled_tokens=q, block_table=states, block_size=longest)
        return composer.build((spec, mspec), None, arrays)

    return step


def engine_graphs(mod: Any, compose: Any, flashinfer: Any, raws: list[dict[str, Any]], device: torch.device,
                  walk: int = 0) -> Callable[[], Any]:
    """The reference engine's step in graph mode (examples/engine): a graph-mode stager, the step composer
    with FlashInfer over the common metadata and the engine's two arrays, the spec made in the step from
    the scheduler's arrays with its rows padded to the next captured size."""
    batch = len(raws[0]["num_computed_tokens"])
    padded = next(s for s in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024) if s >= batch)
    bs = raws[0]["block_size"]  # the profile's table width: the walk's longest request (the workload's is wider)
    w = _Walk(raws, walk)
    width = -(-w.longest() // bs // 8) * 8
    tables = [_fit(r["block_table"], width) for r in raws]
    profile = mod.StaticProfile(max_num_reqs=padded, max_num_tokens=max(8192, padded), max_blocks_per_req=width,
                                block_size=bs)
    stager = mod.Stager(device, num_slots=3, profile=profile)
    composer = compose.StepBuilder(stager, compose.Group({"flashinfer": flashinfer}),
                                   arrays=_engine_arrays(compose, profile.max_num_tokens))
    ids = np.arange(padded, dtype=np.int32)
    prev = np.full(padded, -1, np.int32)
    prev[:batch] = np.arange(batch)
    arrays = {"engine.input_ids": ids, "engine.prev_rows": prev}
    at = [0]

    counts = hasattr(composer, "build_counts")

    def step() -> Any:
        i = at[0] = at[0] + 1
        c, q, k = w.counts(i)
        if counts:  # the engine's entry where the package has it: the scheduler's arrays, no specs
            return composer.build_counts(c, q, [(tables[k], bs)], num_reqs_padded=padded, num_tokens_padded=padded,
                                         arrays=arrays)
        spec = mod.BatchSpec(num_computed_tokens=c, num_scheduled_tokens=q, block_table=tables[k], block_size=bs,
                             num_reqs_padded=padded, num_tokens_padded=padded)
        return composer.build((spec,), None, arrays)

    return step


def _warm_ups(steps: int) -> tuple[int, int]:
    """:func:`ab`'s untimed calls of each side: before the first round, and before each round's timed steps."""
    return min(300, 3 * steps), min(50, steps)


def calls_per_side(rounds: int, steps: int) -> int:
    """How many times :func:`ab` calls each side (its warm-ups and its timed steps)."""
    first, each = _warm_ups(steps)
    return first + rounds * (each + steps)


def ab(a: Callable[[], Any], b: Callable[[], Any], rounds: int, steps: int, device: torch.device,
       cold: bool = False, mean: bool = False) -> tuple[float, float]:
    """Medians over alternating rounds of the per-round median step time (us) of ``a`` and ``b`` (with
    ``cold``, each step timed right after :func:`_cold.thrash`; with ``mean``, of the per-round mean)."""
    per_round = np.mean if mean else np.median
    med: tuple[list[float], list[float]] = ([], [])
    first, each = _warm_ups(steps)
    for fn in (a, b):
        for _ in range(first):
            fn()
    gc.disable()
    try:
        for r in range(rounds):
            for k in ((0, 1) if r % 2 == 0 else (1, 0)):
                fn = (a, b)[k]
                for _ in range(each):
                    fn()
                ts = np.empty(steps)
                for j in range(steps):
                    if cold:
                        thrash()
                    t0 = time.perf_counter_ns()
                    fn()
                    ts[j] = time.perf_counter_ns() - t0
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                med[k].append(float(per_round(ts)) / 1e3)
    finally:
        gc.enable()
    return float(np.median(med[0])), float(np.median(med[1]))


SPLIT = ("begin", "stage_common", "flash_attn stage", "flashinfer stage", "commit", "common result",
         "flash_attn result", "flashinfer result")
"""The parts of the composable step that ``--split`` times apart, in the order a step passes them."""


def composable_parts(mod: Any, batch: int, device: torch.device) -> Callable[[], list[int]]:
    """One composable step of package ``mod`` on the decode walk of ``batch`` requests (the
    ``composable`` row's step), each call the next step of the walk, returning the nanoseconds of each
    part of :data:`SPLIT`: beginning the step (the claim of its ring slot and the expiry of that slot's
    last step), each builder's staging, the commit, and each result."""
    fa = importlib.import_module(mod.__name__ + ".backends.flash_attn")
    fi = importlib.import_module(mod.__name__ + ".backends.flashinfer")
    fused = importlib.import_module(mod.__name__ + ".backends.fused")
    specs = [mod.BatchSpec(**r) for r in decode_walk(batch)]
    stager = mod.Stager(device)
    at = [0]
    clock = time.perf_counter_ns

    def step() -> list[int]:
        i = at[0] = at[0] + 1
        s = specs[i % 64]
        t0 = clock()
        cm = stager.step()
        st = cm.__enter__()
        t1 = clock()
        c = mod.stage_common(s, st, paged_kv=True, block_table_columns=fused.table_columns(s))
        t2 = clock()
        a = fa.stage(c, st)
        t3 = clock()
        b = fi.stage(c, st)
        t4 = clock()
        cm.__exit__(None, None, None)
        t5 = clock()
        c.result()
        t6 = clock()
        a.result()
        t7 = clock()
        b.result()
        t8 = clock()
        return [t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5, t7 - t6, t8 - t7]

    return step


def split(base: Any, batch: int, device: torch.device, rounds: int, steps: int) -> list[tuple[str, float, float]]:
    """``(part, base us, this us)`` for each part of :data:`SPLIT`: medians over alternating rounds of
    each round's median (back to back)."""
    sides = (composable_parts(base, batch, device), composable_parts(attnmeta, batch, device))
    first, each = _warm_ups(steps)
    for fn in sides:
        for _ in range(first):
            fn()
    med: tuple[list[np.ndarray], list[np.ndarray]] = ([], [])
    gc.disable()
    try:
        for r in range(rounds):
            for k in ((0, 1) if r % 2 == 0 else (1, 0)):
                fn = sides[k]
                for _ in range(each):
                    fn()
                ts = np.array([fn() for _ in range(steps)], dtype=np.float64)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                med[k].append(np.median(ts, axis=0) / 1e3)
    finally:
        gc.enable()
    old, new = np.median(np.stack(med[0]), axis=0), np.median(np.stack(med[1]), axis=0)
    return [(name, float(o), float(n)) for name, o, n in zip(SPLIT, old, new, strict=True)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("base", help="the commit to compare with (e.g. 407a805), or a folder holding its exported "
                                 "attnmeta package (git archive COMMIT attnmeta | tar -x -C FOLDER)")
    ap.add_argument("--device", type=device_arg, default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batches", default="1,64,256,1024")
    ap.add_argument("--cold", action="store_true", help="time each step right after a cache thrash (module "
                                                         "docstring)")
    ap.add_argument("--walk", action="store_true", help="the engine rows walk one decode walk that never repeats a "
                                                         "step, as an engine's loop does (class _Walk), instead of "
                                                         "cycling through 64 steps")
    ap.add_argument("--engine-steps", action="store_true",
                    help="the engine rows walk the reference engine's own decode steps, recorded on the CPU "
                         "first, each timed once (engine_steps: a loop's page counts, which recur over its runs)")
    ap.add_argument("--mean", action="store_true", help="each round's mean step time instead of its median: with "
                                                         "--walk, the steps that compose a new layout count as they "
                                                         "do in a loop's average")
    ap.add_argument("--paths", default="", help="comma-separated rows to run (default: every row; e.g. "
                                                "'engine graphs,lifetimes on/off')")
    ap.add_argument("--split", action="store_true", help="the composable step's parts timed apart on both sides "
                                                          "(SPLIT: the claim, each staging, the commit, each result), "
                                                          "back to back, instead of the rows")
    ap.add_argument("--exports", type=Path, default=EXPORTS, help="where the base's renamed copy is kept and "
                                                                  "reused, its compiled kernels with it "
                                                                  "(default: .ab_exports in the checkout)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dev = torch.device(args.device)
    # The base's stagers (before num_kv_blocks) have no bound to pass; this side's, without one, still makes
    # the same compiled check of every used block id (against 2**31), so its warning is noise here.
    warnings.filterwarnings("ignore", category=attnmeta.staging.UncheckedBlockIdsWarning)
    if args.walk and args.engine_steps:
        ap.error("--walk and --engine-steps: the engine rows take one of them")
    base = base_package(args.base, args.exports)
    if args.split:
        print(f"# {args.device}, torch {torch.__version__}, base {args.base}, {args.rounds} rounds x {args.steps} "
              f"steps: the composable step's parts, back to back; medians over rounds of per-round medians (us)")
        print(f"{'batch':>6} {'part':<20} {'base':>8} {'this':>8} {'this-base':>10}")
        for batch in [int(x) for x in args.batches.split(",")]:
            parts = split(base, batch, dev, args.rounds, args.steps)
            for name, o, n in parts:
                print(f"{batch:>6} {name:<20} {o:>8.2f} {n:>8.2f} {n - o:>+10.2f}")
            o, n = sum(p[1] for p in parts), sum(p[2] for p in parts)
            print(f"{batch:>6} {'(sum)':<20} {o:>8.2f} {n:>8.2f} {n - o:>+10.2f}", flush=True)
        return
    rows_from = ("; engine rows: one walk, no step repeated" if args.walk else
                 "; engine rows: the reference engine's decode steps" if args.engine_steps else "")
    print(f"# {args.device}, torch {torch.__version__}, base {args.base}, {args.rounds} rounds x {args.steps} "
          f"steps{', each after a cache thrash' if args.cold else ''}"
          f"{rows_from}; medians over rounds of per-round "
          f"{'means' if args.mean else 'medians'} (us)")
    print(f"{'batch':>6} {'path':<22} {'base':>8} {'this':>8} {'this/base':>10}")
    for batch in [int(x) for x in args.batches.split(",")]:
        walk = calls_per_side(args.rounds, args.steps) + 1 if args.walk else 0  # (a side's steps count from 1)
        engine = None
        if args.engine_steps:
            t0 = time.perf_counter()
            print(f"# recording the reference engine's decode steps at {batch} requests (CPU) ...", end="", flush=True)
            engine = engine_steps(batch, calls_per_side(args.rounds, args.steps) + 1)  # (each step timed once)
            print(f" {len(engine)} steps in {time.perf_counter() - t0:.0f} s", flush=True)
        old, new = paths(base, batch, dev, walk, engine), paths(attnmeta, batch, dev, walk, engine)
        rows = [(name, old[name], new[name]) for name in new if name in old]
        rows.append(("lifetimes on/off", paths(attnmeta, batch, dev, check_lifetimes=False)["fused"], new["fused"]))
        if args.paths:
            wanted = {p.strip() for p in args.paths.split(",")}
            rows = [r for r in rows if r[0] in wanted]
        for name, a, b in rows:
            ta, tb = ab(a, b, args.rounds, args.steps, dev, args.cold, args.mean)
            print(f"{batch:>6} {name:<22} {ta:>8.1f} {tb:>8.1f} {tb / ta:>10.3f}", flush=True)


if __name__ == "__main__":
    main()
