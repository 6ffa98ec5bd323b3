"""The pytest plugin of :mod:`attnmeta.sync` under its documented package name.

The plugin itself is the top-level module :mod:`attnmeta_pytest_plugin` (the ``pytest11`` entry
point ``attnmeta_sync``), which imports only the standard library and pytest, so that a test run
that does not use the audit never loads torch, numba or attnmeta. This module re-exports its hooks,
options, markers and the ``no_sync`` fixture for ``-p attnmeta.testing.pytest_plugin`` (loading
it this way imports :mod:`attnmeta`, as any ``attnmeta.*`` module does). Where attnmeta is installed,
the entry point would load the plugin a second time; loaded this way, this module blocks it, so
``-p attnmeta.testing.pytest_plugin`` works with or without the install.
"""

from __future__ import annotations

import pytest

from attnmeta_pytest_plugin import (
    _ENV_AUDIT,  # noqa: F401  (the environment variables' names, for tools that read them)
    _ENV_DEVICES,  # noqa: F401
    ENTRY_POINT,
    no_sync,
    pytest_addoption,
    pytest_configure,
    pytest_report_header,
    pytest_runtest_call,
)

__all__ = [
    "no_sync",
    "pytest_addhooks",
    "pytest_addoption",
    "pytest_configure",
    "pytest_report_header",
    "pytest_runtest_call",
]


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    """The entry point (the same plugin) must not load as well: block it."""
    pluginmanager.set_blocked(ENTRY_POINT)
