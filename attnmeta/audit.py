"""Every registered builder as a sync-audit target, and ``python -m attnmeta audit``.

:func:`register_builtin_targets` registers one :func:`attnmeta.sync.register_audit_target` per
builder of the registry (:func:`attnmeta.builder.registry`), and one for the engine-loop step builder
:class:`attnmeta.backends.fused.FusedStepBuilder`. Each target builds its metadata for one random batch
of every kind in :data:`attnmeta.testing.workloads.KINDS` on the given device, with options and inputs
the builder draws itself (:meth:`attnmeta.builder.Builder.sample`), each in one step through the
generic :func:`attnmeta.build`. A builder is audited by being registered: the test suite runs every
target under the audit on ``meta`` and ``cpu`` (tests/sync/test_builders_audited.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from attnmeta.builder import AnyBuilder, registry
from attnmeta.staging import Stager
from attnmeta.testing.lab import lab
from attnmeta.testing.workloads import KINDS, random_spec

__all__ = ["FUSED_TARGET", "builder_target", "register_builtin_targets", "run_audit_cli"]

FUSED_TARGET = "fused"
"""The audit target of :class:`attnmeta.backends.fused.FusedStepBuilder` (not a registry builder)."""

_STAGERS: dict[str, Stager] = {}


def _stager(device: torch.device) -> Stager:
    key = str(device)
    st = _STAGERS.get(key)
    if st is None:
        st = _STAGERS[key] = Stager(device)
    return st


def builder_target(builder: AnyBuilder) -> Callable[[torch.device, int], None]:
    """The audit target of ``builder``: ``run(device, seed)`` builds one random batch of every kind of
    :data:`~attnmeta.testing.workloads.KINDS` with options and inputs from ``builder.sample`` (a batch
    the builder reports it cannot serve is skipped), each through :func:`attnmeta.build`."""

    def run(device: torch.device, seed: int) -> None:
        rng = np.random.default_rng(seed)
        stager = _stager(device)
        entry = lab(builder)
        for kind in KINDS:
            spec = random_spec(rng, kind)
            options, inputs = entry.sample(spec, rng)
            if builder.unsupported_reasons(spec, builder.options(options), builder.inputs(inputs)):
                continue
            builder.build(spec, stager, options, inputs)

    run.__name__ = f"audit_{builder.name}"
    return run


_FUSED: dict[int, Any] = {}  # id(stager) -> its FusedStepBuilder (the stagers live in _STAGERS)


def _fused(device: torch.device, seed: int) -> None:
    from attnmeta.backends.fused import FusedStepBuilder

    rng = np.random.default_rng(seed)
    stager = _stager(device)
    builder = _FUSED.get(id(stager))
    if builder is None or builder.stager is not stager:
        builder = _FUSED[id(stager)] = FusedStepBuilder(stager)
    for kind in KINDS:
        spec = random_spec(rng, kind)
        for _ in range(stager.num_slots + 1):  # the last one replays the layout the first recorded
            builder.build(spec)


def register_builtin_targets() -> list[str]:
    """Register (or re-register) every registered builder and the fused step builder as audit targets;
    returns the target names."""
    from attnmeta.sync import register_audit_target

    names = []
    for name, builder in registry().items():
        register_audit_target(name, builder_target(builder), replace=True)
        names.append(name)
    register_audit_target(FUSED_TARGET, _fused, replace=True)
    return [*names, FUSED_TARGET]


def run_audit_cli(*, device: str | None, batches: int) -> int:
    """``python -m attnmeta audit``: run every builder under the audit and print the table.

    Returns 0 when every builder is clean, 1 otherwise.
    """
    from attnmeta.sync import format_audit_table, run_audit

    names = register_builtin_targets()
    devs = [device] if device else None
    rows = run_audit(devices=devs, batches=batches, targets=names)
    print(f"attnmeta sync audit: {len(names)} builders x {batches} seeds x {len(KINDS)} batch kinds "
          f"({', '.join(KINDS)})")
    print(format_audit_table(rows))
    return 0 if all(r.clean for r in rows) else 1
