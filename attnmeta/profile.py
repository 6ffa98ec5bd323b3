"""``StaticProfile``: the device-independent facts fixed when CUDA graphs are captured.

A profile gives every staged device field a fixed capacity, so in graph mode every field keeps its
address for the stager's lifetime (:mod:`attnmeta.staging.stager`, "Graph mode"). Per-step metadata is sized *from* the
profile; anything larger than a capacity is an error naming the field, the need and the capacity.
"""

from __future__ import annotations

import dataclasses

__all__ = ["StaticProfile"]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StaticProfile:
    """Capacities of one engine configuration (the FlashInfer ``_BlockSparseStaticProfile`` idea).

    Examples
    --------
    >>> p = StaticProfile(max_num_reqs=256, max_num_tokens=8192, max_blocks_per_req=128, block_size=16)
    >>> p.max_num_pages, p.max_num_chunks
    (32768, 800)
    """

    max_num_reqs: int
    """Request rows a step may have, padding included."""
    max_num_tokens: int
    """Tokens a step may have, padding included."""
    max_blocks_per_req: int
    """Block-table width ``W`` (columns)."""
    block_size: int
    """Tokens per KV block."""
    chunk_size: int = 256
    """Mamba2 chunk size (sizes the chunk-metadata capacities)."""
    max_num_pages_override: int | None = None
    """Capacity of ``paged_kv_indices``; default ``max_num_reqs * max_blocks_per_req``."""

    def __post_init__(self) -> None:
        for f in ("max_num_reqs", "max_num_tokens", "max_blocks_per_req", "block_size", "chunk_size"):
            v = getattr(self, f)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"StaticProfile.{f}: must be a positive int, got {v!r}")
        if self.max_num_tokens < self.max_num_reqs:  # (vLLM's SchedulerConfig refuses it alike)
            raise ValueError(f"StaticProfile.max_num_tokens={self.max_num_tokens} < max_num_reqs={self.max_num_reqs}: "
                             f"a decode step of every request has a token a request (vLLM's max_num_batched_tokens "
                             f">= max_num_seqs)")

    @property
    def max_num_pages(self) -> int:
        """Capacity of the FlashInfer ``paged_kv_indices`` array."""
        if self.max_num_pages_override is not None:
            return self.max_num_pages_override
        return self.max_num_reqs * self.max_blocks_per_req

    @property
    def max_num_chunks(self) -> int:
        """Upper bound on Mamba2 chunks in a step: ``cdiv(max_num_tokens, chunk_size) + 3 * max_num_reqs``.

        A prefill of ``n`` tokens emits at most one realignment chunk plus ``cdiv(n, chunk_size)``
        chunks, and a checkpoint split adds at most one more; summed over requests this stays below
        the bound.
        """
        return -(-self.max_num_tokens // self.chunk_size) + 3 * self.max_num_reqs
