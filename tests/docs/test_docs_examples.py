"""Every ```python block in docs/*.md and the README runs as written (blocks of one page share a
namespace): on this machine's devices, as a user copies it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def _pages() -> list[Path]:
    return [*sorted(p for p in DOCS.glob("*.md") if _BLOCK.search(p.read_text())), DOCS.parent / "README.md"]


@pytest.mark.parametrize("page", _pages(), ids=lambda p: p.name)
def test_doc_examples_run(page: Path) -> None:
    ns: dict[str, object] = {"__name__": f"docs_{page.stem}"}
    for i, block in enumerate(_BLOCK.findall(page.read_text())):
        code = compile(block, f"{page.name}[block {i}]", "exec", dont_inherit=True)  # as a user runs it
        exec(code, ns)
