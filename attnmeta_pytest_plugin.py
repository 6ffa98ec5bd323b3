"""The pytest plugin of :mod:`attnmeta.sync`: run test bodies under the sync audit.

Installed as the ``pytest11`` entry point ``attnmeta_sync``, so pytest loads it wherever attnmeta
is installed; without the install, load it with ``-p attnmeta_pytest_plugin`` (or its documented
alias ``-p attnmeta.testing.pytest_plugin``). It gives:

- the fixture ``no_sync``: the test's call phase runs under :func:`attnmeta.sync.no_device_sync`;
- the marker ``@pytest.mark.no_device_sync(**options)``: the same, with ``options`` passed to
  ``no_device_sync`` (``devices``, ``check_copies``, ``cuda_mode``, ``allow_async_d2h``);
- the option ``--attnmeta-sync-audit`` (or the ini key ``attnmeta_sync_audit = true``, or the
  environment variable ``ATTNMETA_SYNC_AUDIT=1``): every test's call phase runs under the audit,
  except tests marked ``@pytest.mark.allow_device_sync``;
- the option ``--attnmeta-sync-devices=cpu,...`` (ini ``attnmeta_sync_devices``, environment
  ``ATTNMETA_SYNC_DEVICES``): device types to declare as device data besides ``cuda`` and
  ``meta``, for the fixture, the marker (unless it says ``devices=``) and the session option.

Only the call phase (the test function's body) is audited: fixtures may allocate, warm up and
compare on the host as they like, the way vLLM arms its check after warm-up.

It costs nothing where it is not used: this module imports only the standard library and pytest
(it lives outside the ``attnmeta`` package, whose ``__init__`` imports torch, numba and every
backend), and :mod:`attnmeta.sync` is imported when a test first asks for the audit (the fixture,
the marker, or the session option), never at pytest's start.

Examples
--------
In a test module::

    import pytest
    import torch

    def test_build_is_sync_free(no_sync):
        lens = torch.tensor([3, 1, 4]).to("meta", non_blocking=True)
        (lens * 2).cumsum(0)

    @pytest.mark.no_device_sync(devices={"cpu"})
    def test_reference_path_syncs_are_caught():
        ...
"""

from __future__ import annotations

import os
from collections.abc import Generator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from attnmeta.sync import SyncAudit

__all__ = ["no_sync"]

_ENV_AUDIT = "ATTNMETA_SYNC_AUDIT"
_ENV_DEVICES = "ATTNMETA_SYNC_DEVICES"
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"", "0", "false", "no", "off"})
_OPTIONS = frozenset({"devices", "check_copies", "cuda_mode", "allow_async_d2h"})


ENTRY_POINT = "attnmeta_sync"
"""The plugin's ``pytest11`` entry-point name (pyproject.toml)."""


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    """Loaded by module name (``-p attnmeta_pytest_plugin``) where attnmeta is installed, the entry
    point would load this module a second time, under its own name, and pytest would refuse: block
    it, so that either way of loading works alone or together."""
    import sys

    if pluginmanager.get_name(sys.modules[__name__]) not in (None, ENTRY_POINT):
        pluginmanager.set_blocked(ENTRY_POINT)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("attnmeta", "attnmeta sync audit")
    group.addoption(
        "--attnmeta-sync-audit",
        action="store_true",
        default=None,
        dest="attnmeta_sync_audit",
        help=(
            "run every test's call phase under attnmeta.sync.no_device_sync() "
            f"(also: ini attnmeta_sync_audit, env {_ENV_AUDIT}=1); "
            "tests marked allow_device_sync are exempt"
        ),
    )
    group.addoption(
        "--attnmeta-sync-devices",
        default=None,
        dest="attnmeta_sync_devices",
        metavar="TYPES",
        help=(
            "comma-separated device types to count as device data besides cuda and meta, "
            f"e.g. 'cpu' (also: ini attnmeta_sync_devices, env {_ENV_DEVICES})"
        ),
    )
    parser.addini("attnmeta_sync_audit", type="bool", default=False, help="audit every test's call phase")
    parser.addini(
        "attnmeta_sync_devices",
        type="args",
        default=[],
        help="device types to count as device data besides cuda and meta",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "no_device_sync(**options): run the test body under attnmeta.sync.no_device_sync(**options); "
        "fail on any host read of device data, blocking copy or pageable non-blocking copy",
    )
    config.addinivalue_line(
        "markers",
        "allow_device_sync: exempt the test body from a session-wide --attnmeta-sync-audit",
    )


def _session_audit_enabled(config: pytest.Config) -> bool:
    flag = config.getoption("attnmeta_sync_audit")
    if flag:
        return True
    env = os.environ.get(_ENV_AUDIT)
    if env is not None:
        value = env.strip().lower()
        if value in _TRUE:
            return True
        if value in _FALSE:
            return False
        raise pytest.UsageError(f"{_ENV_AUDIT}={env!r}: expected 1/true/yes/on or 0/false/no/off")
    return bool(config.getini("attnmeta_sync_audit"))


def _declared_devices(config: pytest.Config) -> list[str]:
    option = config.getoption("attnmeta_sync_devices")
    if option is None:
        option = os.environ.get(_ENV_DEVICES)
    if option is not None:
        return [d.strip() for d in str(option).split(",") if d.strip()]
    return [str(d) for d in config.getini("attnmeta_sync_devices")]


def _audit_for(item: pytest.Item) -> SyncAudit | None:
    """The audit the call phase of ``item`` runs under, or None."""
    marker = item.get_closest_marker("no_device_sync")
    fixture = "no_sync" in getattr(item, "fixturenames", ())
    session = _session_audit_enabled(item.config) and item.get_closest_marker("allow_device_sync") is None
    if marker is None and not fixture and not session:
        return None
    options: dict[str, Any] = {"devices": _declared_devices(item.config)}
    if marker is not None:
        if marker.args:
            pytest.fail(
                f"@pytest.mark.no_device_sync takes keyword options only, got {marker.args!r}", pytrace=False
            )
        unknown = set(marker.kwargs) - _OPTIONS
        if unknown:
            pytest.fail(
                f"@pytest.mark.no_device_sync got unknown options {sorted(unknown)}; "
                f"expected some of {sorted(_OPTIONS)}",
                pytrace=False,
            )
        options.update(marker.kwargs)
    from attnmeta.sync import make_audit  # (torch, numba and attnmeta load here, for an audited test only)

    return make_audit(
        options["devices"],
        bool(options.get("check_copies", True)),
        str(options.get("cuda_mode", "error")),
        bool(options.get("allow_async_d2h", False)),
    )


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, object, object]:
    audit = _audit_for(item)
    if audit is None:
        return (yield)
    from attnmeta.sync import no_device_sync

    with no_device_sync(
        devices=audit.devices,
        check_copies=audit.check_copies,
        cuda_mode=audit.cuda_mode,
        allow_async_d2h=audit.allow_async_d2h,
    ):
        return (yield)


def pytest_report_header(config: pytest.Config) -> str | None:
    if not _session_audit_enabled(config):
        return None
    devices = sorted({"cuda", "meta", *_declared_devices(config)})
    return f"attnmeta sync audit: every test call phase (device data: {', '.join(devices)})"


@pytest.fixture
def no_sync(request: pytest.FixtureRequest) -> SyncAudit:
    """Run this test's body (its call phase) under :func:`attnmeta.sync.no_device_sync`.

    Returns the settings the body will run under: the ``no_device_sync`` marker's options if the
    test has one, else the defaults plus ``--attnmeta-sync-devices``. Fixtures are not audited.
    """
    audit = _audit_for(request.node)
    assert audit is not None  # the test requests this fixture, so it is audited
    return audit
