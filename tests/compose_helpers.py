"""Helpers shared by the step composer's tests (tests/test_compose.py, tests/test_compose_oracle.py, and the
builders' replay tests): a replaying composer checked step by step against one that never replays."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from attnmeta import BatchSpec, Stager, StaticProfile
from attnmeta.compose import ComposedStep, Group, StepBuilder
from attnmeta.staging import is_expired


def counts_arguments(specs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``build_counts``'s arguments for a step of ``specs`` (one per group, sharing their counts): the
    arguments and keywords, every vector a fresh writable copy (a scheduler's own arrays)."""
    sp = (specs,) if isinstance(specs, BatchSpec) else tuple(specs)
    first = sp[0]

    def mine(a: np.ndarray | None) -> np.ndarray | None:
        return None if a is None else a.copy()

    return ((mine(first.num_computed_tokens), mine(first.num_scheduled_tokens),
             [(s.block_table, s.block_size) for s in sp]),
            dict(num_prompt_tokens=mine(first.num_prompt_tokens), num_draft_tokens=mine(first.num_draft_tokens),
                 seq_lens_upper_bound=mine(first.seq_lens_upper_bound), num_reqs_padded=first.num_reqs_padded,
                 num_tokens_padded=first.num_tokens_padded))


def assert_same(got: Any, want: Any, path: str) -> None:
    """Every field equal: values, dtypes, shapes, devices, read-only flags; scalars by value and type."""
    if want is None:
        assert got is None, path
        return
    assert type(got) is type(want), f"{path}: {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, dict):
        assert got.keys() == want.keys(), path
        for k in want:
            assert_same(got[k], want[k], f"{path}[{k!r}]")
        return
    if isinstance(want, tuple | list):  # (a NamedTuple's fields by name: a plan of arrays)
        assert len(got) == len(want), path
        names = getattr(want, "_fields", range(len(want)))
        for k, a, b in zip(names, got, want, strict=True):
            assert_same(a, b, f"{path}.{k}" if isinstance(k, str) else f"{path}[{k}]")
        return
    if isinstance(want, torch.Tensor):
        assert (got.shape, got.dtype, got.device) == (want.shape, want.dtype, want.device), path
        assert torch.equal(got.cpu(), want.cpu()), path  # test-only read-back
        return
    if isinstance(want, np.ndarray):
        assert (got.shape, got.dtype, got.flags.writeable) == (want.shape, want.dtype, want.flags.writeable), path
        assert np.array_equal(got, want), path
        return
    if dataclasses.is_dataclass(want):
        for f in dataclasses.fields(want):
            assert_same(getattr(got, f.name), getattr(want, f.name), f"{path}.{f.name}")
        return
    assert type(got) is type(want) and got == want, f"{path}: {got!r} != {want!r}"


def check_steps(composer: StepBuilder, reference: StepBuilder, counts: StepBuilder, steps: list[Any]) -> list[ComposedStep]:
    """Build every step on the three composers (``reference`` never replays; ``counts`` takes the
    scheduler's arrays, ``build_counts``) and compare them; earlier steps kept by the caller stay intact
    until their slot is reused."""
    out = []
    kept: list[tuple[ComposedStep, ComposedStep]] = []
    for i, (specs, inputs, arrays) in enumerate(steps):
        got = composer.build(specs, inputs, arrays)
        want = reference.build(specs, inputs, arrays)
        args, kw = counts_arguments(specs)
        raw = counts.build_counts(*args, **kw, inputs=inputs, arrays=arrays)
        for a in (*args[:2], *kw.values()):  # the counts were read, not kept: a scheduler reuses its arrays
            if isinstance(a, np.ndarray):
                a[:] = -7
        for name, built in (("build", got), ("build_counts", raw)):
            assert_same(built.commons, want.commons, f"step {i} commons ({name})")
            assert_same(built.metadata, want.metadata, f"step {i} metadata ({name})")
            assert_same(built.arrays, want.arrays, f"step {i} arrays ({name})")
        assert counts.stats == composer.stats, f"step {i}: {counts.stats} != {composer.stats}"
        if composer.stager.graph_mode:  # every field's whole fixed buffer (what captured kernels read)
            a, b = composer.stager.graph_arena, reference.stager.graph_arena
            assert a is not None and b is not None
            assert list(composer.stager.graph_fields) == list(reference.stager.graph_fields)
            for name, f in reference.stager.graph_fields.items():
                assert torch.equal(a[f.offset: f.offset + f.nbytes], b[f.offset: f.offset + f.nbytes]), f"step {i} {name}"
        elif kept:  # the previous step's objects are intact (eager mode: their slot is not reused yet)
            old_got, old_want = kept[-1]
            assert not is_expired(old_got.common)
            assert_same(old_got.metadata, old_want.metadata, f"step {i}: step {i - 1} kept")
        kept = [*kept, (got, want)][-(composer.stager.num_slots - 1):]
        out.append(got)
    return out


class NoReplay:
    """A composer whose steps are all staged through the builders' ``stage`` (the reference)."""

    def __new__(cls, stager: Stager, *groups: Group, arrays: Any = ()) -> StepBuilder:  # type: ignore[misc]
        composer = StepBuilder(stager, *groups, arrays=arrays)
        composer._key = lambda *a: None  # type: ignore[method-assign]
        return composer


def composers(device: torch.device, groups: Callable[[], list[Group]], arrays: Any = (),
          profile: StaticProfile | None = None) -> tuple[StepBuilder, StepBuilder, StepBuilder]:
    """A composer, its never-replaying reference and a twin for ``build_counts``."""
    return (StepBuilder(Stager(device, profile=profile), *groups(), arrays=arrays),
            NoReplay(Stager(device, profile=profile), *groups(), arrays=arrays),
            StepBuilder(Stager(device, profile=profile), *groups(), arrays=arrays))


def compare_replays(device: torch.device, groups: Callable[[], list[Group]], steps: Sequence[Any],
                    graph_profile: StaticProfile | None = None) -> StepBuilder:
    """``steps`` (specs, or ``(specs, inputs, arrays)`` tuples) through a replaying composer, one that never
    replays and a ``build_counts`` twin of the first (:func:`check_steps`: every field, and in graph mode
    every field's whole fixed buffer); returns the replaying composer, whose ``stats`` count its replays.
    ``graph_profile``: graph mode under it (None: eager)."""
    composer, reference, counts = composers(device, groups, profile=graph_profile)
    check_steps(composer, reference, counts, [s if isinstance(s, tuple) else (s, None, None) for s in steps])
    return composer
