"""Backend metadata builders: one module per backend family, built from the common metadata.

Each module exposes ``stage(common, step, ...) -> Staged[XMetadata]`` (host-only derivation written
into the shared step, so the backend's arrays travel in the step's one copy) and ``build(spec,
stager, ...) -> XMetadata`` (a step of its own).
"""

from __future__ import annotations

from typing import Any

__all__ = ["stage_demo_backends"]


def stage_demo_backends(common: Any, step: Any) -> list[tuple[str, Any]]:
    """Stage every backend's metadata for the demo batch into ``step``; returns (title, Staged) pairs."""
    return []
