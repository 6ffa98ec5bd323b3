"""Lab entries of the mm_prefix builders (reference values from :mod:`attnmeta.testing.reference`, random
and demo options)."""

from __future__ import annotations

from attnmeta.testing.labs._entry import LabEntry

__all__ = ["ENTRIES"]

ENTRIES: dict[str, LabEntry] = {}
"""Lab entries, by registry name."""
