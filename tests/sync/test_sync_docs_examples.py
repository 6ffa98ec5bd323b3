"""Every example in docs/sync-audit.md runs.

- a ```python block is executed as is, each in a fresh namespace;
- a ```python <file>.py block is a test module: it runs in a pytester session with the plugin and
  all of its tests must pass;
- a ```console block: every ``--attnmeta-*`` option and ``ATTNMETA_*`` variable it uses must exist.
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

import attnmeta.testing.pytest_plugin as plugin
from attnmeta.sync import allow_device_sync, current_audit

pytest_plugins = ["pytester"]

DOC = Path(__file__).resolve().parents[2] / "docs" / "sync-audit.md"
FENCE = re.compile(r"^```(\w+)[ \t]*([^\n]*)\n(.*?)^```$", re.MULTILINE | re.DOTALL)
BLOCKS = [
    (m.group(1), m.group(2).strip(), m.group(3), DOC.read_text()[: m.start()].count("\n") + 1)
    for m in FENCE.finditer(DOC.read_text())
]


def _blocks(lang: str, *, named: bool) -> list[tuple[str, str, int]]:
    return [(info, body, line) for lg, info, body, line in BLOCKS if lg == lang and bool(info) == named]


def test_the_doc_has_examples() -> None:
    assert len(_blocks("python", named=False)) >= 4
    assert len(_blocks("python", named=True)) >= 1
    assert len(_blocks("console", named=False)) >= 2


@pytest.mark.parametrize(
    ("info", "body", "line"),
    _blocks("python", named=False),
    ids=lambda v: f"line{v}" if isinstance(v, int) else "",
)
def test_python_example(info: str, body: str, line: int) -> None:
    code = compile(body, f"{DOC}:{line}", "exec")
    outer = current_audit()  # set under --attnmeta-sync-audit
    with allow_device_sync(), contextlib.redirect_stdout(io.StringIO()):  # the example arms its own audits
        exec(code, {"__name__": f"sync_audit_doc_{line}"})
    assert current_audit() is outer


@pytest.mark.parametrize(
    ("info", "body", "line"),
    _blocks("python", named=True),
    ids=lambda v: f"line{v}" if isinstance(v, int) else "",
)
def test_pytest_example(
    info: str, body: str, line: int, pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    for var in ("ATTNMETA_SYNC_AUDIT", "ATTNMETA_SYNC_DEVICES", "PYTEST_ADDOPTS"):
        monkeypatch.delenv(var, raising=False)
    assert info.endswith(".py"), f"docs/sync-audit.md:{line}: name the test module (```python test_x.py)"
    pytester.makepyfile(**{info[:-3]: body})
    with allow_device_sync():
        result = pytester.runpytest_inprocess(
            "-p",
            "no:attnmeta_sync",
            "-p",
            "attnmeta.testing.pytest_plugin",
            "--strict-markers",
            "-p",
            "no:cacheprovider",
        )
    outcomes = {k: v for k, v in result.parseoutcomes().items() if k not in ("warning", "warnings")}
    assert outcomes.get("passed", 0) >= 1 and set(outcomes) == {"passed"}, result.stdout.str()


def test_console_examples_use_real_options(pytester: pytest.Pytester) -> None:
    text = "\n".join(body for _, body, _ in _blocks("console", named=False))
    with allow_device_sync():
        help_text = pytester.runpytest_inprocess(
            "-p", "no:attnmeta_sync", "-p", "attnmeta.testing.pytest_plugin", "--help"
        ).stdout.str()
    for option in set(re.findall(r"--attnmeta-[\w-]+", text)):
        assert option in help_text, option
    for var in set(re.findall(r"\bATTNMETA_[A-Z_]+", text)):
        assert var in {plugin._ENV_AUDIT, plugin._ENV_DEVICES}, var
    for command in re.findall(r"python -m (\S+)", text):
        assert command in {"pytest", "attnmeta"}, command
