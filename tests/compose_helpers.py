"""Helpers shared by the step composer's tests (tests/test_compose.py, tests/test_compose_oracle.py)."""

from __future__ import annotations

from typing import Any

import numpy as np

from attnmeta import BatchSpec


def counts_arguments(specs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``build_counts``'s arguments for a step of ``specs`` (one per group, sharing their counts): the
    arguments and keywords, every vector a fresh writable copy (a scheduler's own arrays)."""
    sp = (specs,) if isinstance(specs, BatchSpec) else tuple(specs)
    first = sp[0]

    def mine(a: np.ndarray | None) -> np.ndarray | None:
        return None if a is None else a.copy()

    return ((mine(first.num_computed_tokens), mine(first.num_scheduled_tokens),
             [(s.block_table, s.block_size) for s in sp]),
            dict(num_prompt_tokens=mine(first.num_prompt_tokens), num_draft_tokens=mine(first.num_draft_tokens),
                 seq_lens_upper_bound=mine(first.seq_lens_upper_bound), num_reqs_padded=first.num_reqs_padded,
                 num_tokens_padded=first.num_tokens_padded))
