"""Every attnmeta builder as a sync-audit target, and ``python -m attnmeta audit``.

:func:`register_builtin_targets` registers one :func:`attnmeta.sync.register_audit_target` per
builder; each target builds that builder's metadata for every batch kind of
:data:`attnmeta._workloads.KINDS` on the given device, in one step per batch. The test suite runs all
of them under the audit on ``meta`` (tests/sync/test_builders_audited.py), and a new backend module
that is not registered here fails that test.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from attnmeta._workloads import KINDS, random_spec
from attnmeta.metadata import stage_common
from attnmeta.spec import BatchSpec
from attnmeta.staging import Stager, Step

__all__ = ["BUILDERS", "register_builtin_targets", "run_audit_cli"]

_STAGERS: dict[str, Stager] = {}


def _stager(device: torch.device) -> Stager:
    key = str(device)
    st = _STAGERS.get(key)
    if st is None:
        st = _STAGERS[key] = Stager(device)
    return st


def _common(spec: BatchSpec, step: Step, rng: np.random.Generator) -> Any:
    return stage_common(spec, step)


def _flash_attn(spec: BatchSpec, step: Step, rng: np.random.Generator) -> Any:
    from attnmeta.backends import flash_attn

    opts = flash_attn.FlashAttnOptions(dcp_world_size=2, dcp_rank=int(rng.integers(0, 2))) if rng.random() < 0.5 \
        else flash_attn.FlashAttnOptions(causal=rng.random(spec.num_reqs) < 0.7)
    return flash_attn.stage(stage_common(spec, step), step, opts)


BUILDERS: dict[str, Callable[[BatchSpec, Step, np.random.Generator], Any]] = {
    "common": _common,
    "flash_attn": _flash_attn,
}
"""Builder name -> function staging that builder's metadata for a spec into a step."""


def _target(name: str) -> Callable[[torch.device, int], None]:
    stage = BUILDERS[name]

    def run(device: torch.device, seed: int) -> None:
        rng = np.random.default_rng(seed)
        stager = _stager(device)
        for kind in KINDS:
            spec = random_spec(rng, kind)
            with stager.step() as step:
                staged = stage(spec, step, rng)
            staged.result()

    run.__name__ = f"audit_{name}"
    return run


def register_builtin_targets() -> list[str]:
    """Register (or re-register) every builder of :data:`BUILDERS` as an audit target; returns names."""
    from attnmeta.sync import register_audit_target

    for name in BUILDERS:
        register_audit_target(name, _target(name), replace=True)
    return list(BUILDERS)


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
