"""Deterministic random batches (numpy only; no hypothesis needed).

Seeded generators of valid :class:`~attnmeta.BatchSpec` objects of the kinds an engine schedules:
decode walks, mixed batches, and one random batch of each kind in :data:`KINDS`. The sync audit
(``python -m attnmeta audit``), the benchmarks (``python -m attnmeta bench``, ``benchmarks/*.py``)
and the tests use them; test suites of their own may too. Property tests that want shrinking use
:mod:`attnmeta.testing.strategies` instead.

Examples
--------
>>> import numpy as np
>>> from attnmeta.testing.workloads import advance, decode_spec
>>> walk = advance(decode_spec(2, np.random.default_rng(0), max_context=64), 3)
>>> [s.num_computed_tokens.tolist() for s in walk] == [
...     [int(c) + i for c in walk[0].num_computed_tokens] for i in range(3)]
True
"""

from __future__ import annotations

from typing import Any

import numpy as np

from attnmeta.profile import StaticProfile
from attnmeta.spec import BatchSpec

__all__ = ["KINDS", "advance", "decode_spec", "fits_profile", "mixed_spec", "random_spec", "reshuffled"]

KINDS = ("decode", "prefill", "mixed", "spec_decode", "chunked", "padded")


def _table(rng: np.random.Generator, rows: int, width: int) -> np.ndarray:
    return rng.integers(0, 1 << 20, size=(rows, max(width, 1)), dtype=np.int32)


def decode_spec(
    batch: int, rng: np.random.Generator, *, max_context: int = 2048, drafts: int = 0,
    block_size: int = 16, table_width: int = 2048,
) -> BatchSpec:
    """``batch`` decode requests with contexts uniform in [1, max_context) and ``drafts`` draft tokens
    each (scheduled ``1 + drafts``); a ``table_width``-column block table."""
    c = rng.integers(1, max_context, size=batch).astype(np.int32)
    q = np.full(batch, 1 + drafts, np.int32)
    return BatchSpec(
        num_computed_tokens=c,
        num_scheduled_tokens=q,
        num_prompt_tokens=np.minimum(c, 16).astype(np.int32),
        num_draft_tokens=np.full(batch, drafts, np.int32) if drafts else None,
        block_table=_table(rng, batch, table_width),
        block_size=block_size,
    )


def advance(spec: BatchSpec, steps: int) -> list[BatchSpec]:
    """``spec`` and the ``steps - 1`` decode steps after it: every request's context grows by its
    scheduled tokens each step (same block table, prompts, drafts), as in a real decode loop, so the
    step-to-step data and sizes (pages, longest sequence) change as they would in an engine."""
    out = [spec]
    c = spec.num_computed_tokens
    for _ in range(steps - 1):
        c = (c + spec.num_scheduled_tokens).astype(np.int32)
        out.append(BatchSpec(
            num_computed_tokens=c, num_scheduled_tokens=spec.num_scheduled_tokens,
            num_prompt_tokens=spec.num_prompt_tokens, num_draft_tokens=spec.num_draft_tokens,
            block_table=spec.block_table, block_size=spec.block_size,
        ))
    return out


def fits_profile(spec: BatchSpec, profile: StaticProfile) -> bool:
    """Whether ``spec`` is within ``profile``'s bounds: its padded requests and tokens, each request's
    blocks (the longest sequence's, ``cdiv(max_seq_len, block_size)``) and its pages, at the profile's
    block size. A graph-mode step of such a spec must fit every capacity a builder sizes from the
    profile: a :class:`~attnmeta.staging.CapacityError` there is the builder's bug, not the batch's.

    Examples
    --------
    >>> from attnmeta import BatchSpec, StaticProfile
    >>> p = StaticProfile(max_num_reqs=4, max_num_tokens=16, max_blocks_per_req=2, block_size=4)
    >>> spec = BatchSpec(num_computed_tokens=[3], num_scheduled_tokens=[5], block_table=[[1, 2]], block_size=4)
    >>> fits_profile(spec, p), fits_profile(BatchSpec(num_computed_tokens=[3], num_scheduled_tokens=[6],
    ...                                               block_table=[[1, 2, 3]], block_size=4), p)
    (True, False)
    """
    s = spec.shape
    return (s.block_size == profile.block_size and spec.padded_num_reqs <= profile.max_num_reqs
            and spec.padded_num_tokens <= profile.max_num_tokens
            and -(-s.max_seq_len // s.block_size) <= profile.max_blocks_per_req and s.num_pages <= profile.max_num_pages)


def reshuffled(spec: BatchSpec, steps: int, rng: np.random.Generator) -> list[BatchSpec]:
    """``spec`` and ``steps - 1`` steps of the same step shape with other contents: each reorders the
    requests after the first (their counts, prompts, drafts, upper bounds and block-table rows move
    together) and renames the block ids the table holds (a random permutation of its non-negative ids). The scalars a
    replay's layout is keyed on stay (request and token counts, padding, the longest and first queries,
    whether any request prefills), while every per-request and per-token value may move: a builder
    whose replay leaves a field of the recorded step in place shows it under
    :func:`~attnmeta.testing.builders.check_replay`.

    Examples
    --------
    >>> import numpy as np
    >>> from attnmeta import BatchSpec
    >>> spec = BatchSpec(num_computed_tokens=[5, 0, 9], num_scheduled_tokens=[1, 3, 1],
    ...                  block_table=[[1, 2, 0], [3, 0, 0], [4, 5, 6]], block_size=4)
    >>> walk = reshuffled(spec, 3, np.random.default_rng(1))
    >>> {s.shape._replace(max_seq_len=0, max_exact_seq_len=0, num_pages=0) for s in walk} == {
    ...     spec.shape._replace(max_seq_len=0, max_exact_seq_len=0, num_pages=0)}
    True
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"reshuffled: steps must be an int >= 1 (the given spec is the first), got {steps!r}")
    out = [spec]
    n = spec.num_reqs
    for _ in range(steps - 1):
        order = np.concatenate([[0], 1 + rng.permutation(max(n - 1, 0))]).astype(np.intp)[:n]
        table = spec.block_table[:n][order]
        used = np.unique(table[table >= 0])  # (negative entries, past a row's blocks, stay as they are)
        renamed = np.where(table >= 0, rng.permutation(used)[np.searchsorted(used, table).clip(0, max(len(used) - 1, 0))]
                           if len(used) else table, table).astype(np.int32)
        out.append(BatchSpec(
            num_computed_tokens=_moved(spec.num_computed_tokens, order),
            num_scheduled_tokens=_moved(spec.num_scheduled_tokens, order),
            num_prompt_tokens=_moved(spec.num_prompt_tokens, order), num_draft_tokens=_moved(spec.num_draft_tokens, order),
            seq_lens_upper_bound=_moved(spec.seq_lens_upper_bound, order), block_table=renamed, block_size=spec.block_size,
            num_reqs_padded=spec.num_reqs_padded, num_tokens_padded=spec.num_tokens_padded,
            context_parallel=spec.context_parallel,
        ))
    return out


def _moved(a: np.ndarray | None, order: np.ndarray) -> Any:
    """A per-request array in a new order of its requests (None stays None)."""
    return None if a is None else np.ascontiguousarray(a[: order.shape[0]][order])


def mixed_spec(
    rng: np.random.Generator, *, prefills: int = 64, decodes: int = 192, chunk: int = 256,
    max_prompt: int = 2048, max_context: int = 8192, block_size: int = 16,
) -> BatchSpec:
    """``decodes`` decode rows, then ``prefills`` prefills of up to ``max_prompt`` new tokens; every
    second prefill continues a cached context that is deliberately not a multiple of ``chunk``."""
    cd = rng.integers(1, 2048, size=decodes)
    qp = rng.integers(1, max_prompt + 1, size=prefills)
    cp = np.where(np.arange(prefills) % 2 == 0, 0, rng.integers(1, max_context, size=prefills))
    cp = np.where((cp % chunk == 0) & (cp > 0), cp + 1, cp)
    c = np.concatenate([cd, cp]).astype(np.int32)
    q = np.concatenate([np.ones(decodes, np.int64), qp]).astype(np.int32)
    prompt = np.concatenate([np.minimum(cd, 16), cp + qp + 10]).astype(np.int32)
    width = -(-int((c + q).max()) // block_size) if c.size else 1
    return BatchSpec(num_computed_tokens=c, num_scheduled_tokens=q, num_prompt_tokens=prompt,
                     block_table=_table(rng, c.shape[0], width), block_size=block_size)


def random_spec(rng: np.random.Generator, kind: str, *, max_reqs: int = 24, block_size: int = 16) -> BatchSpec:
    """One random valid batch of ``kind`` (one of :data:`KINDS`), reordered decode-first like an
    engine's batch, with zero-length rows and CUDA-graph padding where the kind calls for them."""
    if kind not in KINDS:
        raise ValueError(f"kind: {kind!r} is not one of {KINDS}")
    n = int(rng.integers(1, max_reqs + 1))
    drafts = None
    if kind == "decode":
        c = rng.integers(1, 4096, size=n)
        q = np.ones(n, np.int64)
        prompt = np.minimum(c, rng.integers(1, 64, size=n))
    elif kind == "spec_decode":
        k = int(rng.integers(1, 4))
        c = rng.integers(1, 4096, size=n)
        q = np.full(n, k + 1)
        drafts = np.full(n, k)
        prompt = np.minimum(c, 16)
    else:
        nd = 0 if kind == "prefill" else int(rng.integers(0, n))
        np_ = n - nd
        cd = rng.integers(1, 4096, size=nd)
        cp = np.zeros(np_, np.int64) if kind == "prefill" else rng.integers(0, 3000, size=np_)
        qp = rng.integers(0 if kind in ("chunked", "padded") else 1, 700, size=np_)
        c = np.concatenate([cd, cp])
        q = np.concatenate([np.ones(nd, np.int64), qp])
        prompt = np.concatenate([np.minimum(cd, 16), cp + qp + rng.integers(0, 50, size=np_)])
    c = c.astype(np.int32)
    q = q.astype(np.int32)
    width = -(-int((c + q).max()) // block_size) + int(rng.integers(0, 4))
    pad = kind in ("padded", "decode", "spec_decode")
    return BatchSpec(
        num_computed_tokens=c,
        num_scheduled_tokens=q,
        num_prompt_tokens=prompt.astype(np.int32),
        num_draft_tokens=None if drafts is None else drafts.astype(np.int32),
        block_table=_table(rng, n, width),
        block_size=block_size,
        num_reqs_padded=n + int(rng.integers(0, 4)) if pad else None,
        num_tokens_padded=int(q.sum()) + int(rng.integers(0, 8)) if pad else None,
    )
