"""Lab entries of the mm_prefix builders (reference values from :mod:`attnmeta.testing.reference`, random
and demo options)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from attnmeta.backends.mm_prefix import MMPrefixInputs, MMPrefixOptions
from attnmeta.profile import StaticProfile
from attnmeta.spec import BatchSpec
from attnmeta.testing.labs._entry import LabEntry
from attnmeta.testing.reference.layout import ref_common_fields
from attnmeta.testing.reference.mm_prefix import (
    ref_mm_prefix_query_ranges,
    ref_mm_prefix_range_tensor,
    ref_mm_prefix_ranges,
)

__all__ = ["ENTRIES"]


def mm_prefix_defaults(spec: BatchSpec) -> tuple[MMPrefixOptions, MMPrefixInputs]:
    """The Triton form, one image span over the first half of each real request's scheduled tokens
    (a prefill's new tokens; nothing for a request with fewer than 2)."""
    q = spec.num_scheduled_tokens[: spec.num_reqs].astype(np.int64)
    c = spec.num_computed_tokens[: spec.num_reqs].astype(np.int64)
    has = q >= 2
    indptr = np.concatenate([[0], np.cumsum(has)]).astype(np.int32)
    return MMPrefixOptions(), MMPrefixInputs(mm_span_indptr=indptr, mm_span_starts=c[has].astype(np.int32),
                                             mm_span_lengths=(q[has] // 2).astype(np.int32))


def mm_prefix_sample(spec: BatchSpec, rng: np.random.Generator) -> tuple[MMPrefixOptions, MMPrefixInputs]:
    """Random non-overlapping spans (0-3 per request, one-token ones included) inside each real
    request's prompt (its sequence when the spec gives no prompts), random ``is_embed`` runs, a
    random form, sliding window, clamp and ``span_pad``."""
    n = spec.num_reqs
    prompt = spec.num_prompt_tokens if spec.num_prompt_tokens is not None else spec.num_computed_tokens + \
        spec.num_scheduled_tokens
    counts: list[int] = []
    starts: list[int] = []
    lengths: list[int] = []
    for i in range(n):
        P = int(prompt[i])
        k = min(int(rng.integers(0, 4)), (P + 1) // 2)
        if k == 0 and i == n - 1 and not starts and P >= 1:
            k = 1  # at least one span in a step that can hold one
        if k:
            cuts = np.sort(rng.choice(P + 1, size=2 * k, replace=False))
            starts += cuts[0::2].tolist()
            lengths += (cuts[1::2] - cuts[0::2]).tolist()
        counts.append(k)
    indptr = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).astype(np.int32)
    total = int(np.sum(lengths, dtype=np.int64))
    embed = np.ones(total, np.bool_)
    at = 0
    for n_tok in lengths:  # at most one non-embedded run a span: at most 6 ranges a request
        if n_tok > 1 and rng.random() < 0.5:
            a = int(rng.integers(0, n_tok))
            embed[at + a: at + int(rng.integers(a + 1, n_tok + 1))] = False
        at += n_tok
    opts = MMPrefixOptions(
        form="triton" if rng.random() < 0.5 else "flash_attn",
        sliding_window=None if rng.random() < 0.4 else int(rng.integers(1, 16)),
        clamp_sliding_window=bool(rng.random() < 0.5),
        span_pad=None if rng.random() < 0.6 else int(rng.integers(1, 6)),
    )
    return opts, MMPrefixInputs(mm_span_indptr=indptr, mm_span_starts=np.asarray(starts, np.int32),
                                mm_span_lengths=np.asarray(lengths, np.int32), mm_is_embed=embed)


def mm_prefix_reference(spec: BatchSpec, options: MMPrefixOptions, device: torch.device,
                        inputs: MMPrefixInputs, profile: StaticProfile | None = None) -> dict[str, Any]:
    """vLLM's three functions transcribed on device tensors
    (:mod:`attnmeta.testing.reference.mm_prefix`), syncs and all; under a graph-mode ``profile`` the
    Triton form's rows padded with ``(0, 0)`` ranges to ``graph_max_ranges`` (one row stride for a
    captured kernel)."""

    def dev(value: Any, dtype: Any) -> torch.Tensor:
        return torch.tensor(np.array([] if value is None else value, dtype)).to(device)

    ip_t = torch.zeros(spec.num_reqs + 1, dtype=torch.int32, device=device) if inputs.mm_span_indptr is None else \
        dev(inputs.mm_span_indptr, np.int32)
    emb = None if inputs.mm_is_embed is None else dev(inputs.mm_is_embed, np.bool_)
    ranges = ref_mm_prefix_ranges(ip_t, dev(inputs.mm_span_starts, np.int32), dev(inputs.mm_span_lengths, np.int32),
                                  emb, sliding_window=options.sliding_window,
                                  clamp_sliding_window=options.clamp_sliding_window, span_pad=options.span_pad)
    flat = [list(r) for i in range(spec.num_reqs) for r in ranges[i]]
    ip_ref = np.cumsum([0] + [len(ranges[i]) for i in range(spec.num_reqs)]).astype(np.int32)
    out: dict[str, Any] = {
        "form": options.form, "num_ranges": len(flat),
        "mm_range_indptr_cpu": ip_ref, "mm_ranges_cpu": np.array(flat, np.int32).reshape(-1, 2),
    }
    common = ref_common_fields(spec, device)
    if options.form == "triton":
        t = ref_mm_prefix_range_tensor(ranges, spec.padded_num_reqs, device)
        if t is not None and profile is not None:
            t = torch.nn.functional.pad(t, (0, 0, 0, options.graph_max_ranges - t.shape[1]))
        out["mm_prefix_range_tensor"] = t
        out["max_ranges"] = 0 if t is None else int(t.shape[1])
        out["num_query_range_rows"] = 0  # (the other form's)
    else:
        ub_np = spec.seq_lens_upper_bound if spec.seq_lens_upper_bound is not None else \
            spec.num_computed_tokens + spec.num_scheduled_tokens
        ub = torch.tensor(np.array(ub_np, np.int32)).to(device)
        qt = ref_mm_prefix_query_ranges(ranges, common["query_start_loc"], ub)
        out["mm_prefix_query_range_tensor"] = qt
        out["num_query_range_rows"] = 0 if qt is None else int(qt.shape[0])
        out["max_ranges"] = 0  # (the other form's)
    return out


ENTRIES: dict[str, LabEntry] = {
    "mm_prefix": LabEntry(reference=mm_prefix_reference, sample=mm_prefix_sample, defaults=mm_prefix_defaults),
}
"""The multimodal prefix-range builder's lab entry, by registry name."""
