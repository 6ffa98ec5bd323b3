"""Every attnmeta builder runs clean under the sync audit (meta, and cpu declared as device data).

New backends must be registered in :data:`attnmeta.audit.BUILDERS` (or, for builders that run whole
steps themselves, :data:`attnmeta.audit.LOOP_BUILDERS`); the coverage test fails otherwise.
"""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import attnmeta.backends
from attnmeta.audit import BUILDERS, LOOP_BUILDERS, register_builtin_targets
from attnmeta.sync import run_audit


def test_every_backend_module_is_an_audit_target() -> None:
    modules = [m.name for m in pkgutil.iter_modules(attnmeta.backends.__path__) if not m.name.startswith("_")]
    missing = []
    registered = [*BUILDERS, *LOOP_BUILDERS]
    for name in modules:
        importlib.import_module(f"attnmeta.backends.{name}")
        if not any(b == name or b.startswith(name) or name.startswith(b) for b in registered):
            missing.append(name)
    assert not missing, f"backend modules not registered in attnmeta.audit.BUILDERS / LOOP_BUILDERS: {missing}"
    assert "common" in BUILDERS and "fused" in LOOP_BUILDERS


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_builders_clean_under_audit(device: str) -> None:
    names = register_builtin_targets()
    rows = run_audit(devices=[device], batches=4, targets=names)
    assert {r.builder for r in rows} == set(names)
    bad = [f"{r.builder}: {r.first_problem}" for r in rows if not r.clean]
    assert not bad, "\n".join(bad)
