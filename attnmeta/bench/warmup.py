"""Compile, or load from numba's on-disk cache, every kernel an engine will hit: :func:`warmup`.

attnmeta's host derivations are numba kernels compiled on first use, one specialization per
combination of argument types; an optional array passed as ``None`` or as an array gives two (a
spec with or without prompts, drafts, upper bounds; a graph-mode or an eager stager). Compiled code
is kept in numba's on-disk cache (where: :mod:`attnmeta._numba`, docs/deployment.md), so a process
whose kernels are all in the cache loads them instead of compiling, in a small fraction of the time.

:func:`warmup` (and ``python -m attnmeta warmup``, which runs it) builds, on one device:

- ``BatchSpec``: every spec below, and one that breaks a rule (its error path has a kernel of its own);
- the common metadata (:func:`attnmeta.build_common`) of every spec below;
- every builder of :func:`attnmeta.registry` over every spec below without context parallelism
  (its layout reaches the kernels as integers of the common pass, so it needs no specialization of
  its own, and builders whose options assume none reject it), with its lab entry's defaults and
  several of its samples (:class:`attnmeta.testing.lab.Lab`; seeded, so the same every run), on an
  eager stager and on a graph-mode one (:class:`~attnmeta.profile.StaticProfile`); a batch the
  builder reports it cannot serve (:meth:`~attnmeta.builder.Builder.unsupported_reasons`) is skipped;
- :class:`~attnmeta.backends.fused.FusedStepBuilder` over the same specs as the builders, each built more times than
  the ring has slots (compose, then replay), with the default backends and with FlashAttention only;
  with ``parallel=True`` also a builder with ``threads=2`` over a step large enough to replay on
  numba's thread pool.

The specs: a mixed batch (decodes, a chunked prefill whose context is not chunk-aligned, a fresh
prefill) with every combination of prompts, drafts and upper bounds given or not; CUDA-graph padding;
context parallelism (2 ranks, interleaved and not); read-only input arrays; decode-only,
spec-decode-only and prefill-only steps (the fused builder's replays); and one seeded random batch of
each kind of :data:`attnmeta.testing.workloads.KINDS`.

Run it once per install and cache directory, e.g. while building a container image, as the user and
with the ``NUMBA_CACHE_DIR`` the server will have: the cache must be writable by the process that
reads it, and is keyed by the source files and the CPU model (docs/deployment.md).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from attnmeta import _numba
from attnmeta.builder import AnyBuilder, registry
from attnmeta.profile import StaticProfile
from attnmeta.spec import BatchSpec, ContextParallel
from attnmeta.staging import Stager
from attnmeta.testing.lab import lab
from attnmeta.testing.workloads import KINDS, random_spec

__all__ = ["StageReport", "WarmupReport", "warmup", "warmup_specs"]

_BLOCK = 16
_SAMPLES = 6  # seeded sample() draws per builder and spec, besides its defaults()
_RANDOM_REQS = 8  # rows of the random specs (at most 8 x 700 tokens, 4096 + 700 tokens a row)
_PROFILE = StaticProfile(max_num_reqs=16, max_num_tokens=8192, max_blocks_per_req=320, block_size=_BLOCK)
"""The graph-mode stagers' capacities: every spec of :func:`warmup_specs` fits."""


class StageReport(NamedTuple):
    """One stage of :func:`warmup`: ``BatchSpec``, a builder, or the fused step builder."""

    name: str
    """``"BatchSpec"``, a registry name, ``"fused"`` or ``"fused threads=2"``."""
    builds: int
    """Specs constructed (``BatchSpec``) or metadata builds done."""
    compiled: int
    """Kernel specializations compiled during the stage."""
    loaded: int
    """Kernel specializations loaded from numba's on-disk cache during the stage."""
    seconds: float
    """Wall time of the stage."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class WarmupReport:
    """What :func:`warmup` did.

    A kernel specialization is one compiled version of one kernel for one combination of argument
    types; ``compiled + loaded`` counts those the warm-up needed that were not in memory yet.
    """

    stages: tuple[StageReport, ...]
    """Each stage, in the order run."""
    builders: tuple[str, ...]
    """The registry builders warmed."""
    compiled: int
    """Kernel specializations compiled (none when every one was in the on-disk cache already)."""
    loaded: int
    """Kernel specializations loaded from numba's on-disk cache."""
    seconds: float
    """Wall time of the whole warm-up."""
    cache: str
    """Where the compiled kernels are cached (a directory, or a sentence when they are not)."""

    def summary(self) -> str:
        """One line: stages, builds, seconds, kernel specializations compiled and loaded, the cache."""
        builds = sum(s.builds for s in self.stages)
        return (f"warmup: {len(self.stages)} stages, {builds} builds in {self.seconds:.1f} s: {self.compiled} "
                f"kernel specializations compiled, {self.loaded} loaded from the cache ({self.cache})")


def _counts() -> tuple[int, int]:
    """Kernel specializations compiled and loaded so far, over every attnmeta kernel."""
    compiled = loaded = 0
    for k in _numba.kernels():
        stats = k.stats
        compiled += sum(stats.cache_misses.values())
        loaded += sum(stats.cache_hits.values())
    return compiled, loaded


def _cache_location() -> str:
    """Where attnmeta's kernels are cached: the directory holding every kernel's cache folder."""
    info = _numba.cache_info()
    if info.fallback and info.directory is None:
        return "not cached on disk: no writable cache directory"
    paths = [str(k.stats.cache_path) for k in _numba.kernels() if k.stats.cache_path]
    if not paths:
        return "not cached: NUMBA_DISABLE_JIT=1" if not _numba.kernels() else "not cached"
    if all(os.path.basename(p) == "__pycache__" for p in paths):
        return os.path.join(os.path.commonpath([os.path.dirname(p) for p in paths]), "**", "__pycache__")
    return os.path.commonpath(paths)


def _table(rng: np.random.Generator, rows: int, width: int) -> np.ndarray:
    return rng.integers(0, 1 << 16, size=(rows, width), dtype=np.int32)


def _mixed(rng: np.random.Generator, *, prompts: bool, drafts: bool, upper: bool, padded: bool = False,
           cp: ContextParallel | None = None, read_only: bool = False) -> BatchSpec:
    """2 decodes (one of them with 2 drafts when ``drafts``), a chunked prefill with unaligned context,
    a fresh prefill."""
    c = np.array([37, 130, 77, 0], np.int32)
    q = np.array([1, 3 if drafts else 1, 40, 33], np.int32)
    seq = c + q
    span = _BLOCK * (1 if cp is None else cp.world_size)
    arrays: dict[str, Any] = dict(
        num_computed_tokens=c, num_scheduled_tokens=q,
        block_table=_table(rng, 4, int(-(-seq.max() // span)) + 1),
        num_prompt_tokens=np.array([20, 100, 300, 33], np.int32) if prompts else None,
        num_draft_tokens=np.array([0, 2, 0, 0], np.int32) if drafts else None,
        seq_lens_upper_bound=(seq + np.array([0, 2, 0, 0], np.int32)).astype(np.int32) if upper else None,
    )
    if read_only:
        for a in arrays.values():
            if a is not None:
                a.flags.writeable = False
    return BatchSpec(**arrays, block_size=_BLOCK, num_reqs_padded=6 if padded else None,
                     num_tokens_padded=96 if padded else None, context_parallel=cp)


def _uniform(rng: np.random.Generator, rows: int, query: int, *, drafts: int = 0, padded: bool = False) -> BatchSpec:
    """``rows`` requests of ``query`` tokens each (decode, spec decode, prefill-only steps)."""
    c = rng.integers(0 if query > 1 + drafts else 1, 600, size=rows).astype(np.int32)
    q = np.full(rows, query, np.int32)
    width = int(-(-(c + q).max() // _BLOCK)) + 1
    return BatchSpec(
        num_computed_tokens=c, num_scheduled_tokens=q, block_table=_table(rng, rows, width), block_size=_BLOCK,
        num_prompt_tokens=np.minimum(c, 16).astype(np.int32) if query <= 1 + drafts else c + q,
        num_draft_tokens=np.full(rows, drafts, np.int32) if drafts else None,
        num_reqs_padded=rows + 2 if padded else None, num_tokens_padded=rows * query + 5 if padded else None,
    )


def warmup_specs() -> list[tuple[str, BatchSpec]]:
    """The named specs :func:`warmup` builds (see the module docstring), the same every call."""

    rng = np.random.default_rng(0)
    out: list[tuple[str, BatchSpec]] = []
    for prompts in (False, True):
        for drafts in (False, True):
            for upper in (False, True):
                name = "mixed" + "".join(f" +{n}" for n, on in (("prompts", prompts), ("drafts", drafts),
                                                                  ("upper", upper)) if on)
                out.append((name, _mixed(rng, prompts=prompts, drafts=drafts, upper=upper)))
    out += [
        ("mixed padded", _mixed(rng, prompts=True, drafts=False, upper=False, padded=True)),
        ("mixed padded +drafts +upper", _mixed(rng, prompts=True, drafts=True, upper=True, padded=True)),
        ("context parallel", _mixed(rng, prompts=True, drafts=False, upper=False, cp=ContextParallel(2, 1))),
        ("context parallel interleaved", _mixed(rng, prompts=True, drafts=True, upper=True, padded=True,
                                                cp=ContextParallel(2, 0, interleave=4))),
        ("read-only arrays", _mixed(rng, prompts=True, drafts=True, upper=True, read_only=True)),
        ("decode", _uniform(rng, 8, 1)),
        ("decode padded", _uniform(rng, 8, 1, padded=True)),
        ("spec decode", _uniform(rng, 8, 4, drafts=3)),
        ("prefill", _uniform(rng, 4, 40)),
    ]
    out += [(f"random {kind}", random_spec(rng, kind, max_reqs=_RANDOM_REQS)) for kind in KINDS]
    return out


def _invalid_spec() -> None:
    """Construct a spec that breaks a rule (a negative count): compiles the validation's diagnosis."""
    try:
        BatchSpec(num_computed_tokens=np.array([3, -1], np.int32), num_scheduled_tokens=np.array([1, 1], np.int32),
                  block_table=np.zeros((2, 1), np.int32), block_size=_BLOCK)
    except ValueError:
        return
    raise AssertionError("warmup: the invalid spec was accepted")  # pragma: no cover - BatchSpec checks counts


class _Stagers:
    """An eager stager and graph-mode ones. A graph-mode stager serves one configuration (its fields'
    capacities are fixed by the first step that stages them, e.g. local attention's virtual batch for
    its chunk size; Mamba2's chunk size must be the profile's), so each builder's options get their own."""

    def __init__(self, device: str, profile: StaticProfile = _PROFILE) -> None:
        self.device = device
        self.profile = profile
        self.eager = Stager(device)
        self._graph: dict[str, Stager] = {}

    def graph(self, options: Any = None) -> Stager:
        key = repr(options)
        found = self._graph.get(key)
        if found is None:
            chunk = getattr(options, "chunk_size", self.profile.chunk_size)
            profile = dataclasses.replace(self.profile, chunk_size=chunk)
            found = self._graph[key] = Stager(self.device, profile=profile)
        return found

    def both(self, options: Any = None) -> tuple[Stager, Stager]:
        return self.eager, self.graph(options)

    def drop_graph(self) -> None:
        """Forget the graph-mode stagers (their memory goes with them)."""
        self._graph.clear()


def _common_stage(specs: Sequence[BatchSpec], stagers: _Stagers) -> int:
    """:func:`attnmeta.build_common` over ``specs``, eager and in graph mode."""
    from attnmeta.common import build_common

    for spec in specs:
        for stager in stagers.both():
            build_common(spec, stager)
    return 2 * len(specs)


def _builder_stage(builder: AnyBuilder, specs: Sequence[BatchSpec], stagers: _Stagers) -> int:
    """Build ``builder`` over ``specs`` with its lab defaults and seeded samples, eager and in graph mode."""
    entry = lab(builder)
    rng = np.random.default_rng(1)
    builds = 0
    for spec in specs:
        choices = [entry.defaults(spec), *(entry.sample(spec, rng) for _ in range(_SAMPLES))]
        for options, inputs in choices:
            options, inputs = builder.options(options), builder.inputs(inputs)
            if builder.unsupported_reasons(spec, options, inputs):
                continue
            for stager in stagers.both(options):
                builder.build(spec, stager, options, inputs)
                builds += 1
    stagers.drop_graph()
    return builds


def _fused_stage(specs: Sequence[BatchSpec], stagers: _Stagers, *, threads: int = 1) -> int:
    """Build every spec ``num_slots + 1`` times (compose, then replay) with FusedStepBuilder
    configurations: the default backends, and (``threads=1``) FlashAttention only (no page table)."""
    from attnmeta.backends.fused import FusedStepBuilder

    builds = 0
    for stager in stagers.both():
        configs = [FusedStepBuilder(stager, threads=threads)]
        if threads == 1:
            configs.append(FusedStepBuilder(stager, flashinfer=None))
        for fused in configs:
            for spec in specs:
                for _ in range(stager.num_slots + 1):
                    fused.build(spec)
                    builds += 1
    return builds


def warmup(
    *,
    progress: bool | Callable[[str], None] = True,
    device: str = "cpu",
    builders: Sequence[str] | None = None,
    parallel: bool = True,
) -> WarmupReport:
    """Compile, or load from numba's on-disk cache, every kernel an engine will hit.

    Runs the builds listed in the module docstring, so that in a later process with the same cache
    directory the first build of every builder loads its kernels instead of compiling them. Nothing
    is kept: the stagers and metadata built here are dropped on return.

    Parameters
    ----------
    progress : bool or callable, default True
        True prints one line per stage to standard error (``warmup: flash_attn (4/12) 1.8 s``) and
        the summary; a callable receives those lines instead; False is silent.
    device : str, default "cpu"
        The device the stagers stage to (the kernels run on the host whatever it is).
    builders : sequence of str, optional
        Registry names of the builders to warm (default: every registered builder). ``BatchSpec``
        and the fused step builder are always warmed.
    parallel : bool, default True
        Also warm :class:`~attnmeta.backends.fused.FusedStepBuilder` with ``threads=2`` on a step
        of :data:`~attnmeta.backends.fused.PARALLEL_MIN_ROWS` rows, whose copies run on numba's thread
        pool. That starts numba's threading layer in this process, as such a builder does on its first
        large step; nothing to warm where ``NUMBA_NUM_THREADS`` is 1.

    Returns
    -------
    WarmupReport
        The stages, the kernel specializations compiled and loaded, the seconds, the cache.

    Raises
    ------
    KeyError
        A name of ``builders`` that is not registered (the message lists the registered names).
    """
    say: Callable[[str], None] | None
    if progress is True:
        def say(line: str) -> None:
            print(line, file=sys.stderr, flush=True)
    else:
        say = progress or None
    import numba

    reg = registry()
    names = sorted(reg) if builders is None else list(builders)
    unknown = [n for n in names if n not in reg]
    if unknown:
        raise KeyError(f"warmup: no builder named {', '.join(map(repr, unknown))}; registered: {sorted(reg)}")
    threads = min(2, int(numba.config.NUMBA_NUM_THREADS)) if parallel else 1  # type: ignore[attr-defined]
    plan: list[tuple[str, Callable[[], int]]] = []
    specs: list[BatchSpec] = []  # (filled by the first stage, which times their construction)
    plain: list[BatchSpec] = []  # without context parallelism (see the module docstring)

    def spec_stage() -> int:
        specs.extend(s for _, s in warmup_specs())
        plain.extend(s for s in specs if s.context_parallel is None)
        _invalid_spec()
        return len(specs) + 1

    stagers = _Stagers(device)
    plan.append(("BatchSpec", spec_stage))
    plan.append(("common", lambda: _common_stage(specs, stagers)))
    for name in names:
        plan.append((name, functools.partial(_builder_stage, reg[name], plain, stagers)))
    plan.append(("fused", lambda: _fused_stage(plain, stagers)))
    if threads > 1:
        def threaded() -> int:
            from attnmeta.backends.fused import PARALLEL_MIN_ROWS as rows

            rng = np.random.default_rng(2)
            big = [_uniform(rng, rows, 1), _uniform(rng, rows, 1, padded=True)]
            profile = StaticProfile(max_num_reqs=rows + 8, max_num_tokens=4 * rows, max_blocks_per_req=64,
                                    block_size=_BLOCK)
            return _fused_stage(big, _Stagers(device, profile), threads=threads)

        plan.append((f"fused threads={threads}", threaded))
    t_start = time.perf_counter()
    c0, l0 = _counts()
    stages = []
    for i, (name, run) in enumerate(plan, 1):
        t = time.perf_counter()
        cs, ls = _counts()
        builds = run()
        ce, le = _counts()
        stage = StageReport(name, builds, ce - cs, le - ls, time.perf_counter() - t)
        stages.append(stage)
        if say is not None:
            say(f"warmup: {name} ({i}/{len(plan)}) {stage.seconds:.1f} s, {stage.builds} builds, "
                f"{stage.compiled} compiled, {stage.loaded} loaded")
    c1, l1 = _counts()
    report = WarmupReport(stages=tuple(stages), builders=tuple(names), compiled=c1 - c0, loaded=l1 - l0,
                          seconds=time.perf_counter() - t_start, cache=_cache_location())
    if say is not None:
        say(report.summary())
    return report
