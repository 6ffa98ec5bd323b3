"""The lists in the docs that name every builder, checked against the registry and the code, so they
cannot drift (a builder added without its row fails here): serving.md's per-step inputs table,
deployment.md's cold-start table and its warm-up stages. (quickstart.md asserts the registry's names in
its own example, run by test_docs_examples.py.)"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import attnmeta

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _table_rows(text: str, header: str) -> list[list[str]]:
    """The cells of the Markdown table whose header row starts with ``header``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


def test_serving_inputs_table_names_every_builder_with_inputs() -> None:
    rows = _table_rows((DOCS / "serving.md").read_text(), "| builder | per-step inputs |")
    documented = {}
    for name, cell in rows:
        m = re.match(r"`(\w+)`$", name)
        t = re.match(r"`(\w+)\(([\w, ]*)\)`", cell)
        assert m and t, (name, cell)
        documented[m.group(1)] = (t.group(1), [f.strip() for f in t.group(2).split(",")])
    want = {n: b.inputs_type for n, b in attnmeta.registry().items() if b.inputs_type is not None}
    assert sorted(documented) == sorted(want)
    for name, typ in want.items():
        assert documented[name] == (typ.__name__, [f.name for f in dataclasses.fields(typ)]), name


def test_cold_start_table_names_every_builder() -> None:
    rows = _table_rows((DOCS / "deployment.md").read_text(), "| first build (s) | cold | after warmup |")
    names = [r[0] for r in rows]
    first, last = names.index("`BatchSpec` (the first kernel call)"), names.index("fused (4 builds)")
    assert names[first + 1: last] == sorted(attnmeta.registry())


def test_warmup_stages_in_the_docs_are_the_codes() -> None:
    text = (DOCS / "deployment.md").read_text()
    stages = re.findall(r"^warmup: (.+?) \((\d+)/(\d+)\) \.\.\.$", text, flags=re.M)
    want = ["BatchSpec", "common", *sorted(attnmeta.registry()), "fused", "fused threads=2"]
    assert [s[0] for s in stages] == want
    assert [int(s[1]) for s in stages] == list(range(1, len(want) + 1))
    assert {int(s[2]) for s in stages} == {len(want)}
    assert f"warmup: {len(want)} stages, " in text


def test_the_warmup_runs_those_stages() -> None:
    """The stage names and order the docs list are what ``warmup`` runs (one builder here, to be quick;
    the threaded stage where numba has two threads, as on the documented machine)."""
    import numba

    from attnmeta.bench.warmup import warmup

    lines: list[str] = []
    report = warmup(progress=lines.append, builders=["flash_attn"])
    threaded = ["fused threads=2"] if int(numba.config.NUMBA_NUM_THREADS) >= 2 else []
    assert [s.name for s in report.stages] == ["BatchSpec", "common", "flash_attn", "fused", *threaded]
    assert lines[0].startswith(f"warmup: BatchSpec (1/{len(report.stages)}) ")
