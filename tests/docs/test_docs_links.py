"""Every relative link in docs/*.md and the README reaches a file of the checkout, and every
``#anchor`` a heading of its page, as GitHub names headings (lower case, punctuation dropped, spaces
to hyphens, ``-1``, ``-2`` ... for repeats). A renamed heading once left three links to a section
that no longer existed."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
_FENCE = re.compile(r"^```.*?^```", re.M | re.S)
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6} (.+?)\s*$", re.M)


def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading.

    >>> slug("attnmeta against vLLM 0.33.0's own metadata code, in one engine")
    'attnmeta-against-vllm-0330s-own-metadata-code-in-one-engine'
    >>> slug("The hot path: the step composer")
    'the-hot-path-the-step-composer'
    """
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _prose(page: Path) -> str:
    """``page``'s text without its fenced code blocks (a ``#`` line there is a comment, not a heading)."""
    return _FENCE.sub("", page.read_text())


@cache
def anchors(page: Path) -> frozenset[str]:
    """Every heading anchor of ``page``."""
    seen: dict[str, int] = {}
    out = set()
    for m in _HEADING.finditer(_prose(page)):
        s = slug(m.group(1))
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return frozenset(out)


def test_slug_follows_github() -> None:
    assert slug("Test your own builder") == "test-your-own-builder"
    assert slug("`MultiStager`: several devices") == "multistager-several-devices"
    assert slug("The fused step against the composable one, warm and after a wait") == (
        "the-fused-step-against-the-composable-one-warm-and-after-a-wait")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_and_anchor_resolves(page: Path) -> None:
    broken = []
    for m in _LINK.finditer(_prose(page)):
        link = m.group(1)
        if re.match(r"[a-z]+:", link):  # (http:, https:, mailto:)
            continue
        path, _, anchor = link.partition("#")
        target = page if not path else (page.parent / path).resolve()
        if not target.exists():
            broken.append(f"{link}: no file {target}")
        elif anchor and target.suffix == ".md" and anchor not in anchors(target):
            broken.append(f"{link}: no heading of {target.name} has the anchor #{anchor}")
    assert not broken, "\n".join(broken)
