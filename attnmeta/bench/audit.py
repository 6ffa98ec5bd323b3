"""Every registered builder as a sync-audit target, and ``python -m attnmeta audit``.

:func:`register_builtin_targets` registers one :func:`attnmeta.sync.register_audit_target` per
builder of the registry (:func:`attnmeta.builder.registry`; the target is
:func:`attnmeta.testing.builders.builder_target`), and one for the engine-loop step builder
:class:`attnmeta.backends.fused.FusedStepBuilder`. Each target builds its metadata for one random batch
of every kind in :data:`attnmeta.testing.workloads.KINDS` on the given device, with options and inputs
its lab entry draws (:meth:`attnmeta.testing.lab.Lab.sample`), each in one step through the generic
:func:`attnmeta.build`. A builder is audited by being registered: the test suite runs every target
under the audit on ``meta`` and ``cpu`` (tests/sync/test_builders_audited.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from attnmeta.builder import registry
from attnmeta.testing.builders import audit_stager, builder_target
from attnmeta.testing.workloads import KINDS, random_spec

__all__ = ["FUSED_TARGET", "register_builtin_targets", "run_audit_cli"]

FUSED_TARGET = "fused"
"""The audit target of :class:`attnmeta.backends.fused.FusedStepBuilder` (not a registry builder)."""

_FUSED: dict[int, Any] = {}  # id(stager) -> its FusedStepBuilder (the stagers: audit_stager's)


def _fused(device: torch.device, seed: int) -> None:
    from attnmeta.backends.fused import FusedStepBuilder

    rng = np.random.default_rng(seed)
    stager = audit_stager(device)
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
    """``python -m attnmeta audit``: run every builder under the audit and print the table, a row as
    each builder finishes (with numba's compile progress on standard error before a builder whose
    kernels a first run compiles).

    Returns 0 when every builder is clean, 1 otherwise.
    """
    import sys

    from attnmeta._numba import COMPILE_NOTE, compile_progress
    from attnmeta.sync import AuditTable, run_audit

    names = register_builtin_targets()
    devs = [str(torch.device(device or ("cuda" if torch.cuda.is_available() else "meta")))]
    print(f"attnmeta sync audit: {len(names)} builders x {batches} batches of each kind ({', '.join(KINDS)}), "
          f"on {', '.join(devs)}", flush=True)
    table = AuditTable(names, devs, [[batches * len(KINDS)] * 5])
    print(table.header(), flush=True)
    rows = []
    note = COMPILE_NOTE
    for name in names:
        with compile_progress(sys.stderr, note=note):
            found = run_audit(devices=devs, batches=batches, targets=[name])
        note = "compiling kernels"
        for r in found:
            print(table.row(r), flush=True)
        rows += found
    problems = table.problems(rows)
    if problems:
        print("\n" + problems)
    return 0 if all(r.clean for r in rows) else 1
