"""Every attnmeta builder runs clean under the sync audit (meta, and cpu declared as device data).

The audit's targets come from the registry (:func:`attnmeta.builder.registry`): a builder is audited by
being registered, and every builder a backend module defines must be registered.
"""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import attnmeta.backends
from attnmeta.bench.audit import FUSED_TARGET, register_builtin_targets
from attnmeta.builder import Builder, registry
from attnmeta.sync import run_audit


def test_every_backend_builder_is_registered_and_an_audit_target() -> None:
    defined = []
    for info in pkgutil.walk_packages(attnmeta.backends.__path__, "attnmeta.backends."):
        mod = importlib.import_module(info.name)
        defined += [v for v in vars(mod).values() if isinstance(v, Builder)]
    assert defined, "no builder found"
    unregistered = [b.name for b in defined if registry().get(b.name) is not b]
    assert not unregistered, f"builders defined but not registered: {unregistered}"
    names = register_builtin_targets()
    assert set(names) == {*registry(), FUSED_TARGET}


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_builders_clean_under_audit(device: str) -> None:
    names = register_builtin_targets()
    rows = run_audit(devices=[device], batches=4, targets=names)
    assert {r.builder for r in rows} == set(names)
    bad = [f"{r.builder}: {r.first_problem}" for r in rows if not r.clean]
    assert not bad, "\n".join(bad)
