"""Requests and the scheduler: a token budget per step, chunked prefill, prefix caching, preemption.

The scheduler is vLLM v1's in miniature. Each step it first serves the running requests in admission
order (a decode is one token; a prefill continues with the next chunk of its prompt, as much as the
budget leaves), allocating the blocks their new tokens need; when the pool runs dry it preempts the
most recently admitted running request (recompute: its blocks are freed and it starts again from its
prompt plus what it has generated). Then, if nothing was preempted, it admits waiting requests that
have arrived, reusing cached blocks of their prompt's prefix.

Async scheduling: a request sampled in step N has a token the host does not know while it schedules
step N + 1. The scheduler counts it (``num_tokens`` includes it) and records where it is
(``pending``: step N and its row in that step's sampled tokens); the engine then takes that input token from the
device, and the host learns its value one step later (:meth:`Scheduler.receive`).
"""

from __future__ import annotations

import dataclasses
from collections import deque

import numpy as np

from .kv_cache import BlockPool, block_hashes


@dataclasses.dataclass(eq=False)
class Request:
    """One generation request: greedy decoding of ``max_new_tokens`` tokens after ``prompt``."""

    rid: int
    prompt: list[int]
    max_new_tokens: int
    arrival: int = 0
    """The first step at which the request may be admitted."""
    tokens: list[int] = dataclasses.field(default_factory=list)
    """Known tokens: the prompt, then each generated token once the host has received it."""
    num_generated: int = 0
    """Tokens sampled so far, received or not."""
    num_computed: int = 0
    """Tokens whose KV is written (or scheduled to be) in this request's blocks."""
    blocks: list[int] = dataclasses.field(default_factory=list)
    num_cached_blocks: int = 0
    """Prompt blocks named in the prefix cache (or found there)."""
    state_slot: int = 0
    """Slot of this request's Mamba states (hybrid models; 0 while it holds none)."""
    mamba_blocks: list[int] = dataclasses.field(default_factory=list)
    """Hybrid models in "align" mode: a Mamba state block per KV block (column ``j`` holds the state
    after ``(j + 1) * block_size`` tokens, or the running state in the last column; the null block 0
    where a prefix-cache hit needs no state)."""
    pending: tuple[int, int] | None = None
    """``(step, row)`` of the sampled tokens holding this request's newest token, not yet received."""
    preemptions: int = 0

    def __post_init__(self) -> None:
        if not self.prompt or self.max_new_tokens < 1:
            raise ValueError(f"request {self.rid}: needs a prompt and max_new_tokens >= 1")
        self.tokens = list(self.prompt)

    @property
    def num_tokens(self) -> int:
        """Prompt plus every sampled token (the newest may not be received yet)."""
        return len(self.prompt) + self.num_generated

    @property
    def done_sampling(self) -> bool:
        return self.num_generated >= self.max_new_tokens

    @property
    def output(self) -> list[int]:
        """The generated tokens received so far."""
        return self.tokens[len(self.prompt) :]


@dataclasses.dataclass
class ScheduledRow:
    """One request's share of a step."""

    req: Request
    num_new: int
    """Tokens computed this step, from ``req.num_computed`` (before the step) on."""
    start: int
    """``req.num_computed`` before the step."""
    samples: bool
    """The chunk reaches the request's last token: the step samples its next token."""
    pending_in: tuple[int, int] | None = None
    """``req.pending`` when the step was scheduled: where its newest input token is, if the host does
    not have it yet."""


@dataclasses.dataclass
class SchedulerOutput:
    """A step's batch: decode rows (one token each) first, then the longer rows."""

    step: int
    rows: list[ScheduledRow]
    num_common_prefix_blocks: int
    """Blocks shared by every row of the step (cascade attention's input)."""

    @property
    def num_tokens(self) -> int:
        return sum(r.num_new for r in self.rows)


class Scheduler:
    """Schedules requests over a :class:`BlockPool` with a token budget per step.

    Parameters
    ----------
    pool : BlockPool
        The KV cache's blocks.
    max_num_tokens : int
        Token budget of a step.
    max_num_seqs : int
        Most requests in a step.
    max_blocks_per_req : int
        Block-table width: a request may hold at most this many blocks.
    num_state_slots : int, default 0
        Hybrid models: slots of the Mamba state pool (slot 0 reserved); a running request holds one.
    prefix_caching : bool, default True
        Reuse cached prompt blocks (for a hybrid model only with ``mamba_pool``: a Mamba state of one
        slot per request has no per-block cache).
    mamba_pool : BlockPool, optional
        Hybrid models in vLLM's "align" Mamba cache mode (instead of ``num_state_slots``): Mamba state
        blocks, one per KV block of a request (:attr:`Request.mamba_blocks`). A prompt chunk that
        does not finish the prompt ends on a block boundary, so its final state is a block's state; a
        state at the end of a full prompt block is named in this pool's prefix cache; a prefix-cache
        hit stops at the last block whose state is cached.
    """

    def __init__(self, pool: BlockPool, max_num_tokens: int, max_num_seqs: int, max_blocks_per_req: int,
                 num_state_slots: int = 0, prefix_caching: bool = True, mamba_pool: BlockPool | None = None) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.max_num_tokens = max_num_tokens
        self.max_num_seqs = max_num_seqs
        self.max_blocks_per_req = max_blocks_per_req
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._to_free: list[Request] = []
        self.step_index = 0
        self.preemptions = 0
        self.prefix_caching = prefix_caching
        self._num_state_slots = num_state_slots
        self.free_slots = list(range(num_state_slots - 1, 0, -1))
        self.mamba_pool = mamba_pool
        if mamba_pool is not None and (num_state_slots or mamba_pool.block_size != pool.block_size):
            raise ValueError("Scheduler: mamba_pool (align mode) replaces num_state_slots, with the KV block size")

    def add(self, req: Request) -> None:
        """Queue a request (admitted at or after ``req.arrival``)."""
        if -(-(len(req.prompt) + req.max_new_tokens) // self.block_size) > self.max_blocks_per_req:
            raise ValueError(f"request {req.rid}: longer than max_blocks_per_req * block_size tokens")
        self.waiting.append(req)

    @property
    def has_slots(self) -> bool:
        """Whether requests hold Mamba state slots (a hybrid model)."""
        return self._num_state_slots > 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _grow(self, req: Request, num_new: int) -> bool:
        need = -(-(req.num_computed + num_new) // self.block_size) - len(req.blocks)
        if need > self.pool.num_free or (self.mamba_pool is not None and need > self.mamba_pool.num_free):
            return False
        if need > 0:
            req.blocks += self.pool.allocate(need)
            if self.mamba_pool is not None:
                req.mamba_blocks += self.mamba_pool.allocate(need)
        return True

    def _chunk(self, req: Request, budget: int) -> int:
        """Tokens of ``req`` to compute this step; in align mode a chunk that stops short of the last
        token ends on a block boundary (0: none fits this step)."""
        num_new = min(req.num_tokens - req.num_computed, budget)
        if self.mamba_pool is not None and req.num_computed + num_new < req.num_tokens:
            num_new = max((req.num_computed + num_new) // self.block_size * self.block_size - req.num_computed, 0)
        return num_new

    def _drop_blocks(self, req: Request) -> None:
        self.pool.free(req.blocks)
        if self.mamba_pool is not None:
            self.mamba_pool.free(req.mamba_blocks)
        req.blocks, req.mamba_blocks, req.num_computed, req.num_cached_blocks = [], [], 0, 0

    def cache_mamba_state(self, req: Request, col: int) -> bool:
        """Align mode: name ``req``'s Mamba block of column ``col``, which holds (or is being written
        with) the state after ``(col + 1) * block_size`` tokens, in the prefix cache, if those tokens are
        prompt tokens. Returns whether it was named."""
        assert self.mamba_pool is not None
        n = col + 1
        if n * self.block_size > len(req.prompt) or req.mamba_blocks[col] == 0:
            return False
        self.mamba_pool.cache(req.mamba_blocks[col], block_hashes(req.prompt, self.block_size, n)[col])
        return True

    def _release_slot(self, req: Request) -> None:
        if req.state_slot:
            self.free_slots.append(req.state_slot)
            req.state_slot = 0

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._release_slot(req)
        self._drop_blocks(req)
        req.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(req)

    def schedule(self) -> SchedulerOutput:
        """The next step's batch (possibly empty while requests have not arrived yet)."""
        for req in self._to_free:  # finished last step: that step may still read their blocks, this one not
            self._drop_blocks(req)
            self._release_slot(req)
        self._to_free = []
        budget = self.max_num_tokens
        rows: list[ScheduledRow] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = self._chunk(req, budget)
            if num_new == 0:  # align mode: no block-aligned chunk fits what is left of the budget
                i += 1
                continue
            while not self._grow(req, num_new):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            else:
                rows.append(ScheduledRow(req, num_new, req.num_computed, req.num_computed + num_new == req.num_tokens))
                budget -= num_new
                i += 1
                continue
            break  # req preempted itself
        while (not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs
               and self.waiting[0].arrival <= self.step_index and self.waiting[0].pending is None
               and (self.free_slots or not self.has_slots)):
            req = self.waiting[0]
            full = (req.num_tokens - 1) // self.block_size  # at least one token is computed
            cacheable = min(full, len(req.prompt) // self.block_size) if self.prefix_caching else 0
            hashes = block_hashes(req.tokens, self.block_size, cacheable)
            hits = self.pool.lookup(hashes)
            if self.mamba_pool is not None:  # the hit ends where a Mamba state is cached
                k = len(hits)
                while k > 0 and not self.mamba_pool.cached(hashes[k - 1]):
                    k -= 1
                self.pool.free(hits[k:])
                self.pool.hits -= len(hits) - k
                hits = hits[:k]
                req.mamba_blocks = [0] * (k - 1) + [self.mamba_pool.take(hashes[k - 1])] if k else []
            req.blocks, req.num_computed, req.num_cached_blocks = hits, len(hits) * self.block_size, len(hits)
            num_new = self._chunk(req, budget)
            if num_new == 0 or not self._grow(req, num_new):
                self._drop_blocks(req)
                break
            self.waiting.popleft()
            self.running.append(req)
            if self.has_slots:
                req.state_slot = self.free_slots.pop()
            rows.append(ScheduledRow(req, num_new, req.num_computed, req.num_computed + num_new == req.num_tokens))
            budget -= num_new
        for row in rows:  # the step writes these tokens' KV; name the prompt blocks it completes
            req = row.req
            req.num_computed += row.num_new
            if self.mamba_pool is not None and self.prefix_caching and req.num_computed % self.block_size == 0:
                self.cache_mamba_state(req, req.num_computed // self.block_size - 1)  # the step's final state
            full = min(req.num_computed, len(req.prompt)) // self.block_size
            if self.prefix_caching and full > req.num_cached_blocks:
                for b, h in zip(req.blocks[req.num_cached_blocks : full],
                                block_hashes(req.prompt, self.block_size, full)[req.num_cached_blocks :]):
                    self.pool.cache(b, h)
                req.num_cached_blocks = full
            if row.samples:
                req.num_generated += 1
                if req.done_sampling:
                    self.running.remove(req)
                    self._to_free.append(req)
        rows.sort(key=lambda r: r.num_new != 1)  # decodes first (stable): the backends' split wants it
        for i, row in enumerate(rows):
            row.pending_in = row.req.pending
            if row.samples:
                row.req.pending = (self.step_index, i)
        out = SchedulerOutput(self.step_index, rows, _common_prefix_blocks(rows))
        self.step_index += 1
        return out

    def receive(self, out: SchedulerOutput, sampled: np.ndarray) -> None:
        """Hand the host one step's sampled tokens (``sampled[i]`` for ``out.rows[i]``), in step order."""
        for i, row in enumerate(out.rows):
            if row.samples:
                row.req.tokens.append(int(sampled[i]))
                if row.req.pending == (out.step, i):
                    row.req.pending = None


def _common_prefix_blocks(rows: list[ScheduledRow]) -> int:
    if not rows:
        return 0
    first = rows[0].req.blocks
    n = min(len(r.req.blocks) for r in rows)
    for r in rows[1:]:
        b = r.req.blocks
        k = 0
        while k < n and b[k] == first[k]:
            k += 1
        n = k
    return n
