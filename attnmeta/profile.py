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
    """Block-table width ``W`` (columns) of a KV-cache group of :attr:`block_size`; ``max_blocks_per_req *
    block_size`` tokens is the longest request (a group of another block size: :meth:`for_block_size`)."""
    block_size: int
    """Tokens per KV block (of the attention group; a step's other groups may have others)."""
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

    def for_block_size(self, block_size: int) -> StaticProfile:
        """The profile of a KV-cache group whose blocks hold ``block_size`` tokens: the same requests,
        tokens and longest request (``max_blocks_per_req * self.block_size`` tokens), in blocks of
        ``block_size``. A hybrid model's Mamba group has blocks of its own size (in vLLM's ``"none"``
        cache mode one block a request, of the model's length); graph mode sizes each group's block
        table and page indices from its block size's profile. ``self`` where the sizes are equal.

        - ``max_blocks_per_req``: ``cdiv(max_blocks_per_req * self.block_size, block_size)``;
        - ``max_num_pages_override``, where set: at most ``cdiv(override * self.block_size, block_size)
          + max_num_reqs`` (the same tokens, each request's last block part-filled), and at most
          ``max_num_reqs`` times the new width.

        Examples
        --------
        >>> p = StaticProfile(max_num_reqs=256, max_num_tokens=8192, max_blocks_per_req=128, block_size=16)
        >>> q = p.for_block_size(2048)  # (one block a request: 128 * 16 tokens)
        >>> q.max_blocks_per_req, q.max_num_pages, q.block_size
        (1, 256, 2048)
        >>> p.for_block_size(16) is p
        True
        """
        if block_size == self.block_size:
            return self
        if not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"StaticProfile.for_block_size: block_size must be a positive int, got {block_size!r}")
        hit = _BY_BLOCK_SIZE.get((self, block_size))
        if hit is not None:
            return hit
        width = -(-self.max_blocks_per_req * self.block_size // block_size)
        pages = self.max_num_pages_override
        if pages is not None:
            pages = min(self.max_num_reqs * width, -(-pages * self.block_size // block_size) + self.max_num_reqs)
        out = dataclasses.replace(self, max_blocks_per_req=width, block_size=block_size, max_num_pages_override=pages)
        if len(_BY_BLOCK_SIZE) >= 64:
            _BY_BLOCK_SIZE.clear()
        _BY_BLOCK_SIZE[(self, block_size)] = out
        return out

    @property
    def max_num_chunks(self) -> int:
        """Upper bound on Mamba2 chunks in a step: ``cdiv(max_num_tokens, chunk_size) + 3 * max_num_reqs``.

        A prefill of ``n`` tokens emits at most one realignment chunk plus ``cdiv(n, chunk_size)``
        chunks, and a checkpoint split adds at most one more; summed over requests this stays below
        the bound.
        """
        return -(-self.max_num_tokens // self.chunk_size) + 3 * self.max_num_reqs


_BY_BLOCK_SIZE: dict[tuple[StaticProfile, int], StaticProfile] = {}
""":meth:`StaticProfile.for_block_size` by profile and block size (a composer asks on every composed step)."""
