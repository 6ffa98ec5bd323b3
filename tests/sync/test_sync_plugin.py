"""The pytest plugin (attnmeta_pytest_plugin, alias attnmeta.testing.pytest_plugin): fixture, marker,
options, ini, env; nothing heavy loaded until a test asks for the audit."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from attnmeta.sync import allow_device_sync

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[2]
# Load the plugin by module name whether or not attnmeta is installed (installed, its entry point
# `attnmeta_sync` would load it a second time under that name).
PLUGIN = ("-p", "no:attnmeta_sync", "-p", "attnmeta_pytest_plugin")
ALIAS = ("-p", "no:attnmeta_sync", "-p", "attnmeta.testing.pytest_plugin")
# ... and without the entry point blocked by hand: loaded by module name, the plugin blocks it itself
# (where attnmeta is installed, as in CI, both once failed: an option added twice, a plugin registered twice)
BARE_PLUGIN = ("-p", "attnmeta_pytest_plugin")
BARE_ALIAS = ("-p", "attnmeta.testing.pytest_plugin")

TESTS = """
import pytest
import torch

def _read():
    return torch.ones(3).sum().item()  # a sync once CPU tensors are declared device data

def test_plain():
    assert _read() == 3.0

def test_fixture(no_sync):
    assert "cpu" in no_sync.devices
    _read()

def test_fixture_clean(no_sync):
    torch.ones(3).to("meta", non_blocking=True) * 2

@pytest.mark.no_device_sync(devices={"cpu"})
def test_marker():
    _read()

@pytest.mark.no_device_sync(devices={"cpu"}, allow_async_d2h=True)
def test_marker_with_fixture(no_sync):
    assert no_sync.allow_async_d2h
    _read()

@pytest.mark.allow_device_sync
def test_allowed():
    assert _read() == 3.0

@pytest.fixture
def synced():
    return _read()  # fixtures are not audited

def test_fixture_setup_not_audited(synced, no_sync):
    assert synced == 3.0
"""


@pytest.fixture
def pytester(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    for var in ("ATTNMETA_SYNC_AUDIT", "ATTNMETA_SYNC_DEVICES", "PYTEST_ADDOPTS"):
        monkeypatch.delenv(var, raising=False)
    pytester.makepyfile(test_example=TESTS)
    return pytester


def _run(pytester: pytest.Pytester, *args: str, plugin: tuple[str, ...] = PLUGIN) -> pytest.RunResult:
    with allow_device_sync():  # the inner session runs inside this test's (maybe audited) body
        return pytester.runpytest_inprocess(
            *plugin, "--strict-markers", "-p", "no:cacheprovider", "--tb=line", *args
        )


def _outcomes(result: pytest.RunResult) -> dict[str, str]:
    outcomes: dict[str, str] = {}
    for report in result.reprec.getreports("pytest_runtest_logreport"):  # type: ignore[attr-defined]
        if report.when == "call" or report.outcome != "passed":
            outcomes[report.nodeid.split("::")[-1]] = report.outcome
    return outcomes


@pytest.mark.parametrize("plugin", [PLUGIN, ALIAS, BARE_PLUGIN, BARE_ALIAS],
                         ids=["attnmeta_pytest_plugin", "attnmeta.testing.pytest_plugin", "bare name", "bare alias"])
def test_fixture_and_marker(pytester: pytest.Pytester, plugin: tuple[str, ...]) -> None:
    result = _run(pytester, "--attnmeta-sync-devices=cpu", plugin=plugin)
    assert _outcomes(result) == {
        "test_plain": "passed",
        "test_fixture": "failed",
        "test_fixture_clean": "passed",
        "test_marker": "failed",
        "test_marker_with_fixture": "failed",
        "test_allowed": "passed",
        "test_fixture_setup_not_audited": "passed",
    }
    result.stdout.fnmatch_lines(
        ["*DeviceSyncError: aten._local_scalar_dense.default at *test_example.py:5 in _read*"]
    )


def test_without_declared_devices_cpu_is_host_data(pytester: pytest.Pytester) -> None:
    outcomes = _outcomes(_run(pytester))
    assert outcomes["test_fixture"] == "failed"  # asserts "cpu" in no_sync.devices
    assert outcomes["test_fixture_setup_not_audited"] == "passed"
    assert outcomes["test_marker"] == "failed"  # the marker declares cpu itself


@pytest.mark.parametrize(
    ("args", "env", "ini"),
    [
        (("--attnmeta-sync-audit", "--attnmeta-sync-devices=cpu"), {}, ""),
        ((), {"ATTNMETA_SYNC_AUDIT": "1", "ATTNMETA_SYNC_DEVICES": "cpu"}, ""),
        ((), {}, "attnmeta_sync_audit = true\nattnmeta_sync_devices = cpu"),
    ],
    ids=["option", "env", "ini"],
)
def test_session_wide_audit(
    pytester: pytest.Pytester,
    monkeypatch: pytest.MonkeyPatch,
    args: tuple[str, ...],
    env: dict[str, str],
    ini: str,
) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    if ini:
        pytester.makeini(f"[pytest]\n{ini}\n")
    result = _run(pytester, *args)
    outcomes = _outcomes(result)
    assert outcomes["test_plain"] == "failed"  # every test body is audited now
    assert outcomes["test_allowed"] == "passed"  # ... except the ones marked allow_device_sync
    assert outcomes["test_fixture_setup_not_audited"] == "passed"
    result.stdout.fnmatch_lines(["attnmeta sync audit: every test call phase (device data: cpu, cuda, meta)"])


def test_env_can_turn_the_ini_setting_off(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    pytester.makeini("[pytest]\nattnmeta_sync_audit = true\n")
    monkeypatch.setenv("ATTNMETA_SYNC_AUDIT", "0")
    monkeypatch.setenv("ATTNMETA_SYNC_DEVICES", "cpu")
    assert _outcomes(_run(pytester))["test_plain"] == "passed"


def test_bad_env_value_is_a_usage_error(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATTNMETA_SYNC_AUDIT", "maybe")
    result = _run(pytester)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*ATTNMETA_SYNC_AUDIT='maybe'*"])


def test_bad_marker_options_fail_the_test(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_bad="""
        import pytest

        @pytest.mark.no_device_sync("cpu")
        def test_positional():
            pass

        @pytest.mark.no_device_sync(device="cpu")
        def test_misspelt():
            pass
        """
    )
    result = _run(pytester, "test_bad.py")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(["*keyword options only*", "*unknown options*'device'*"])


def test_markers_and_options_are_registered(pytester: pytest.Pytester) -> None:
    markers = _run(pytester, "--markers")
    markers.stdout.fnmatch_lines(
        ["@pytest.mark.no_device_sync(**options):*", "@pytest.mark.allow_device_sync:*"]
    )
    help_text = _run(pytester, "--help")
    help_text.stdout.fnmatch_lines(["*--attnmeta-sync-audit*", "*--attnmeta-sync-devices*"])
    help_text.stdout.fnmatch_lines(["*attnmeta_sync_audit (bool)*", "*attnmeta_sync_devices (args)*"])


def test_nothing_heavy_is_imported_until_a_test_asks_for_the_audit(pytester: pytest.Pytester,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """In a fresh pytest process the plugin registers everything without importing torch, numba or
    attnmeta; the first test that uses the fixture imports attnmeta.sync and is audited."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    pytester.makepyfile(
        test_light="""
        import sys

        HEAVY = ("torch", "numba", "attnmeta")

        def test_plain_first():
            assert not [m for m in sys.modules if m.split(".")[0] in HEAVY]

        def test_audited_then(no_sync):
            assert "attnmeta.sync" in sys.modules and "meta" in no_sync.devices
        """
    )
    result = pytester.runpytest_subprocess(*PLUGIN, "--strict-markers", "-p", "no:cacheprovider", "test_light.py")
    result.assert_outcomes(passed=2)
