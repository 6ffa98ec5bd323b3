"""Audit targets: registration, run_audit's counting, and the table `python -m attnmeta audit` prints."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from attnmeta.sync import (
    AuditRow,
    audit_targets,
    format_audit_table,
    register_audit_target,
    run_audit,
    unregister_audit_target,
)


@pytest.fixture
def names() -> Iterator[list[str]]:
    """Names registered by the test; unregistered afterwards."""
    registered: list[str] = []
    yield registered
    for name in registered:
        if name in audit_targets():
            unregister_audit_target(name)


def test_register_replace_unregister(names: list[str]) -> None:
    def first(device: torch.device, seed: int) -> None:
        pass

    def second(device: torch.device, seed: int) -> None:
        pass

    names.append("t_reg")
    assert register_audit_target("t_reg", first) is first
    assert register_audit_target("t_reg", first) is first  # the same function again: fine
    with pytest.raises(ValueError, match="already registered"):
        register_audit_target("t_reg", second)
    register_audit_target("t_reg", second, replace=True)
    assert audit_targets()["t_reg"] is second

    names.append("t_deco")

    @register_audit_target("t_deco")
    def decorated(device: torch.device, seed: int) -> None:
        pass

    assert audit_targets()["t_deco"] is decorated
    assert list(audit_targets())[-2:] == ["t_reg", "t_deco"]  # registration order
    unregister_audit_target("t_deco")
    with pytest.raises(KeyError, match="t_deco"):
        unregister_audit_target("t_deco")
    with pytest.raises(ValueError, match="non-empty"):
        register_audit_target("", first)


def test_run_audit_counts_each_kind_per_batch(names: list[str]) -> None:
    seen: list[tuple[str, int]] = []

    def clean(device: torch.device, seed: int) -> None:
        seen.append((device.type, seed))
        torch.arange(seed + 2, dtype=torch.int32).to(device, non_blocking=True).cumsum(0)

    def syncs_on_odd_seeds(device: torch.device, seed: int) -> None:
        x = torch.arange(4).to(device, non_blocking=True)
        if seed % 2:
            x.nonzero()

    def non_contiguous_upload(device: torch.device, seed: int) -> None:
        torch.arange(6).view(2, 3).t().to(device, non_blocking=True)

    def reads_back(device: torch.device, seed: int) -> None:
        torch.arange(4).to(device, non_blocking=True).to("cpu", non_blocking=True)

    def crashes(device: torch.device, seed: int) -> None:
        raise ValueError(f"bad batch {seed}")

    for name, fn in [
        ("t_clean", clean),
        ("t_odd", syncs_on_odd_seeds),
        ("t_pageable", non_contiguous_upload),
        ("t_race", reads_back),
        ("t_crash", crashes),
    ]:
        names.append(name)
        register_audit_target(name, fn)

    rows = run_audit(devices=["meta", "cpu"], batches=4, seed=10, targets=names)
    assert [(r.builder, r.device) for r in rows] == [(n, d) for n in names for d in ("meta", "cpu")]
    assert seen == [("meta", s) for s in range(10, 14)] + [("cpu", s) for s in range(10, 14)]
    by = {(r.builder, r.device): r for r in rows}
    assert by["t_clean", "meta"] == AuditRow("t_clean", "meta", 4)
    assert by["t_clean", "cpu"].clean
    odd = by["t_odd", "meta"]
    assert (odd.syncs, odd.clean) == (2, False)
    assert odd.first_problem is not None and odd.first_problem.startswith("seed 11: aten.nonzero.default at ")
    assert by["t_odd", "cpu"].syncs == 2  # cpu declared as device data for the cpu run
    assert by["t_pageable", "meta"].pageable_copies == 4
    assert by["t_pageable", "cpu"].clean  # cpu -> cpu: no host<->device copy at all
    assert by["t_race", "meta"].races == 4
    crash = by["t_crash", "meta"]
    assert (crash.errors, crash.first_problem) == (4, "seed 10: ValueError: bad batch 10")


def test_run_audit_defaults_and_errors(names: list[str]) -> None:
    names.append("t_one")
    register_audit_target("t_one", lambda device, seed: None)
    (row,) = run_audit(batches=2, targets=["t_one"])
    assert row.device == ("cuda" if torch.cuda.is_available() else "meta")
    with pytest.raises(ValueError, match="no audit target named"):
        run_audit(targets=["t_missing"])
    with pytest.raises(ValueError, match="batches=0"):
        run_audit(batches=0)


def test_format_audit_table() -> None:
    rows = [
        AuditRow("flash_attn", "meta", 16),
        AuditRow("mamba2_reference", "meta", 16, syncs=16, first_problem="seed 0: aten.nonzero.default ..."),
        AuditRow("x", "cpu", 3, pageable_copies=1, races=1, errors=1, first_problem="seed 2: ValueError: no"),
    ]
    text = format_audit_table(rows)
    lines = text.splitlines()
    assert lines[0].split() == [
        "builder",
        "device",
        "batches",
        "syncs",
        "pageable",
        "copies",
        "D2H",
        "races",
        "errors",
        "result",
    ]
    assert lines[2].split() == ["flash_attn", "meta", "16", "0", "0", "0", "0", "clean"]
    assert lines[3].split() == ["mamba2_reference", "meta", "16", "16", "0", "0", "0", "FAIL"]
    assert lines[4].split() == ["x", "cpu", "3", "0", "1", "1", "1", "FAIL"]
    assert lines[6:] == [
        "mamba2_reference on meta: seed 0: aten.nonzero.default ...",
        "x on cpu: seed 2: ValueError: no",
    ]
    assert format_audit_table([AuditRow("a", "meta", 1)]).count("\n") == 2  # no problems section
