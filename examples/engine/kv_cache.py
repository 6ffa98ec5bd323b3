"""The paged KV cache's block pool: allocation, reference counts and prefix caching.

Block 0 is the *null block*: never handed out, it is where CUDA-graph padding rows point (attnmeta's
graph-mode sentinel for block ids is 0) and where padding tokens write (their ``slot_mapping`` is -1,
which the model clamps to slot 0). Every other block is free, or held by one or more requests.

Prefix caching keeps the KV of full prompt blocks after their requests finish. A full block is named
by a hash of its tokens and of every token before it (a chain: equal hashes mean equal prefixes), so a
new request whose prompt starts with the same blocks reuses them instead of computing them again.
Freed blocks go to the tail of an LRU free queue and keep their hash until they are handed out again;
a hit on a free block takes it back out of the queue.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

NULL_BLOCK = 0


def block_hashes(tokens: Sequence[int], block_size: int, num_blocks: int) -> list[int]:
    """Chained hashes of the first ``num_blocks`` full blocks of ``tokens``."""
    out: list[int] = []
    parent = 0
    for b in range(num_blocks):
        parent = hash((parent, tuple(tokens[b * block_size : (b + 1) * block_size])))
        out.append(parent)
    return out


class BlockPool:
    """``num_blocks`` KV blocks (block 0 reserved), reference-counted, with a prefix cache.

    Parameters
    ----------
    num_blocks : int
        Blocks in the KV cache, the null block included (at least 2).
    block_size : int
        Tokens per block.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"BlockPool: num_blocks must be at least 2 (block 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.refs = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))
        self._by_hash: dict[int, int] = {}
        self._hash_of: dict[int, int] = {}
        self.hits = 0
        """Blocks taken from the prefix cache instead of computed (over the pool's life)."""

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (free, cached or not)."""
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Hand out ``n`` blocks (reference count 1), evicting the least recently freed cached ones."""
        if n > len(self._free):
            raise MemoryError(f"BlockPool: {n} blocks asked, {len(self._free)} free")
        out = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            h = self._hash_of.pop(b, None)
            if h is not None:
                del self._by_hash[h]
            self.refs[b] = 1
            out.append(b)
        return out

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block; blocks reaching 0 join the free queue, the last block first
        (a request's tail is the least likely to be shared, so it is evicted first). Null blocks in
        ``blocks`` (a hybrid request's Mamba columns that hold no state) are skipped."""
        for b in reversed(blocks):
            if b == NULL_BLOCK:
                continue
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self._free[b] = None

    def lookup(self, hashes: Sequence[int]) -> list[int]:
        """The cached blocks of the longest prefix of ``hashes``, each with one more reference."""
        out: list[int] = []
        for h in hashes:
            b = self._by_hash.get(h)
            if b is None:
                break
            if self.refs[b] == 0:
                del self._free[b]
            self.refs[b] += 1
            out.append(b)
        self.hits += len(out)
        return out

    def cached(self, h: int) -> bool:
        """Whether a block is named by prefix hash ``h``."""
        return h in self._by_hash

    def take(self, h: int) -> int:
        """The block named by ``h`` (see :meth:`cached`), with one more reference; counts one hit."""
        b = self._by_hash[h]
        if self.refs[b] == 0:
            del self._free[b]
        self.refs[b] += 1
        self.hits += 1
        return b

    def cache(self, block: int, h: int) -> None:
        """Name a held, fully written block by its prefix hash (a no-op if the hash has a block already)."""
        if h not in self._by_hash and block not in self._hash_of:
            self._by_hash[h] = block
            self._hash_of[block] = h
