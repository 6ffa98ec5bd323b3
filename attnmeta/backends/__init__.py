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
    from attnmeta.backends import flash_attn, flashinfer

    staged: list[tuple[str, Any]] = []
    staged.append(("FlashAttentionMetadata", flash_attn.stage(common, step)))
    staged.append(("FlashInferMetadata", flashinfer.stage(common, step)))
    from attnmeta.backends import mamba2  # chunk size 16 so the chunk layout shows on the small batch

    staged.append(("Mamba2Metadata (chunk_size=16, mamba_block_size=16)",
                   mamba2.stage(common, step, mamba2.Mamba2Options(chunk_size=16, mamba_block_size=16))))
    return staged
