"""Every ``>>>`` example in the package's docstrings runs and prints what it says."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import attnmeta


def _modules() -> list[str]:
    return [m.name for m in pkgutil.walk_packages(attnmeta.__path__, "attnmeta.")
            if not m.name.endswith("__main__") and not m.name.endswith("pytest_plugin")]


@pytest.mark.parametrize("modname", _modules())
def test_docstring_examples(modname: str) -> None:
    mod = importlib.import_module(modname)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in finder.find(mod, modname, globs=dict(vars(mod))):
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{modname}: {result.failed} of {result.attempted} docstring examples failed"
