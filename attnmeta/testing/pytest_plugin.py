"""The pytest plugin of :mod:`attnmeta.sync` under its documented package name.

The plugin itself is the top-level module :mod:`attnmeta_pytest_plugin` (the ``pytest11`` entry
point ``attnmeta_sync``), which imports only the standard library and pytest, so that a test run
that does not use the audit never loads torch, numba or attnmeta. This module re-exports its hooks,
options, markers and the ``no_sync`` fixture for ``-p attnmeta.testing.pytest_plugin`` (loading
it this way imports :mod:`attnmeta`, as any ``attnmeta.*`` module does). Load one of the two, not
both: where attnmeta is installed, the entry point loads it already (``-p no:attnmeta_sync`` turns
that off).
"""

from __future__ import annotations

from attnmeta_pytest_plugin import (
    _ENV_AUDIT,  # noqa: F401  (the environment variables' names, for tools that read them)
    _ENV_DEVICES,  # noqa: F401
    no_sync,
    pytest_addoption,
    pytest_configure,
    pytest_report_header,
    pytest_runtest_call,
)

__all__ = [
    "no_sync",
    "pytest_addoption",
    "pytest_configure",
    "pytest_report_header",
    "pytest_runtest_call",
]
