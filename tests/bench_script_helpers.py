"""Shared by the benchmark-script tests: run a script of benchmarks/ in a subprocess, read its table rows,
import it as a module."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BATCHES = (1, 64, 256, 1024)


def run_script(script: str, *args: str) -> str:
    """Run ``benchmarks/<script>``; its standard output."""
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], capture_output=True,
                          text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def table_rows(script: str, *args: str) -> list[list[str]]:
    """Run ``benchmarks/<script>`` and return its table rows (lines that start with a batch size)."""
    out = run_script(script, *args)
    return [line.split() for line in out.splitlines() if line.split() and line.split()[0].isdigit()]


def load_benchmark(script: str, name: str) -> Any:
    """``benchmarks/<script>`` imported as module ``name`` (its own imports resolved from benchmarks/)."""
    spec_ = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / script)
    assert spec_ is not None and spec_.loader is not None
    mod = importlib.util.module_from_spec(spec_)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        spec_.loader.exec_module(mod)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return mod
