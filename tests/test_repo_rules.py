"""House rules checked on every CI run: lint, types, numba config, host purity, docstrings."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import attnmeta

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "attnmeta"


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(shutil.which("ruff") is None and not Path(sys.executable).with_name("ruff").exists(),
                    reason="ruff not installed (pip install -e '.[dev]')")
def test_ruff_clean() -> None:
    ruff = str(Path(sys.executable).with_name("ruff")) if Path(sys.executable).with_name("ruff").exists() else "ruff"
    r = _run(ruff, "check", "attnmeta", "tests", "benchmarks")
    assert r.returncode == 0, r.stdout + r.stderr


def test_mypy_clean() -> None:
    pytest.importorskip("mypy", reason="mypy not installed (pip install -e '.[dev]')")
    r = _run(sys.executable, "-m", "mypy")
    assert r.returncode == 0, r.stdout + r.stderr


def test_no_raw_numba_njit_outside_the_config_module() -> None:
    bad = []
    for f in PKG.rglob("*.py"):
        if f.name == "_numba.py":
            continue
        text = f.read_text()
        if re.search(r"numba\.(njit|jit)\s*\(|from numba import .*\b(njit|jit)\b|@numba\.", text):
            bad.append(str(f.relative_to(ROOT)))
    assert not bad, f"use attnmeta._numba.njit, not numba directly: {bad}"


def test_host_package_never_imports_torch() -> None:
    offenders = []
    for f in (PKG / "host").rglob("*.py"):
        tree = ast.parse(f.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            if any(n == "torch" or n.startswith("torch.") for n in names):
                offenders.append(f"{f.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, f"attnmeta/host must be torch-free: {offenders}"


def _public_modules() -> list[str]:
    mods = []
    for m in pkgutil.walk_packages(attnmeta.__path__, "attnmeta."):
        if any(part.startswith("_") for part in m.name.split(".")[1:]) or m.name.endswith("__main__"):
            continue
        mods.append(m.name)
    return mods


def _numpydoc_params(doc: str) -> list[str] | None:
    m = re.search(r"\n\s*Parameters\n\s*-+\n(.*?)(\n\s*\n\s*[A-Z][a-z]+\n\s*-+\n|\Z)", doc, re.S)
    if not m:
        return None
    names = []
    for line in m.group(1).splitlines():
        mm = re.match(r"^([A-Za-z_*][\w*, ]*?)\s*:", line)  # parameter lines are not indented
        if mm:
            names += [n.strip().lstrip("*") for n in mm.group(1).split(",")]
    return names


@pytest.mark.parametrize("modname", _public_modules())
def test_public_api_documented(modname: str) -> None:
    """Every public module has __all__; every public function/class a docstring; numpydoc
    ``Parameters`` sections name exactly the signature's parameters."""
    mod = importlib.import_module(modname)
    assert mod.__doc__, f"{modname}: module docstring missing"
    assert hasattr(mod, "__all__"), f"{modname}: __all__ missing"
    for name in mod.__all__:
        obj = getattr(mod, name, None)
        if obj is None:  # a submodule listed in a package's __all__
            importlib.import_module(f"{modname}.{name}")
            continue
        if not (inspect.isfunction(obj) or inspect.isclass(obj)) or getattr(obj, "__module__", modname) != modname:
            continue
        doc = inspect.getdoc(obj)
        assert doc, f"{modname}.{name}: docstring missing"
        if inspect.isfunction(obj):
            documented = _numpydoc_params("\n" + doc)
            if documented is None:
                continue
            sig = [p for p in inspect.signature(obj).parameters if p not in ("self", "cls")]
            assert sorted(documented) == sorted(sig), (
                f"{modname}.{name}: documented parameters {documented} != signature {sig}"
            )
