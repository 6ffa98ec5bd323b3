"""Lab entries of the Mamba-family builders: Mamba2, Mamba1, linear attention and GDN (reference values
from :mod:`attnmeta.testing.reference`, random options and inputs).

None of them has demo defaults of its own: the demo and the benchmarks use each builder's default
options and no inputs (:meth:`attnmeta.testing.lab.Lab.defaults`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from attnmeta.backends.mamba import (
    GDNInputs,
    GDNOptions,
    LinearAttentionOptions,
    Mamba1Options,
    Mamba2Inputs,
    Mamba2Options,
)
from attnmeta.host.mamba import CheckpointConfig
from attnmeta.profile import StaticProfile
from attnmeta.spec import BatchSpec
from attnmeta.testing.labs._entry import LabEntry
from attnmeta.testing.reference.gdn import ref_gdn_metadata
from attnmeta.testing.reference.mamba import ref_linear_attn_metadata, ref_mamba_metadata

__all__ = [
    "ENTRIES",
    "gdn_reference",
    "gdn_sample",
    "linear_attn_reference",
    "linear_attn_sample",
    "mamba1_reference",
    "mamba1_sample",
    "mamba2_reference",
    "mamba2_sample",
]


# ------------------------------------------------------------------------------------------------
# Mamba2


def mamba2_sample(spec: BatchSpec, rng: np.random.Generator) -> tuple[Mamba2Options, Mamba2Inputs | None]:
    """Random cache mode, spec tokens (0-3; with spec decode on, at least the spec's drafts: vLLM's
    runner never schedules more), checkpoints (align mode), chunk formats, conv1d on or off, and
    accepted counts under spec decode (on most draws with spec tokens; else no inputs)."""
    align = rng.random() < 0.5
    k = int(rng.integers(0, 4))
    d = spec.num_draft_tokens
    if k and d is not None and d.size:
        k = max(k, int(d.max()))
    bs = spec.block_size
    ckpt = CheckpointConfig(hash_block_size=int(rng.choice([1, bs])), cache_hit_alignment_tokens=bs,
                            mamba_block_size=bs, checkpoint_alignment=1) if align and rng.random() < 0.7 else None
    opts = Mamba2Options(
        chunk_size=int(rng.choice([8, 16, 64, 256])), cache_mode="align" if align else "none",
        num_speculative_tokens=k, checkpoint=ckpt, logical_chunks=bool(rng.random() < 0.5),
        token_seq_idx=bool(rng.random() < 0.5), needs_causal_conv1d_metadata=bool(rng.random() < 0.8),
    )
    if k and rng.random() < 0.7:
        return opts, Mamba2Inputs(num_accepted_tokens=rng.integers(1, k + 2, size=spec.num_reqs).astype(np.int32))
    return opts, None


def _graph_conv1d(out: dict[str, Any], profile: StaticProfile | None) -> dict[str, Any]:
    """Under a graph-mode ``profile`` the causal-conv1d pointers are fixed buffers of ``2 * max(1024,
    cdiv(max_num_tokens, 8) + max_num_reqs)`` programs, -1 past the step's (docs/semantics-mamba.md,
    "CUDA graphs"), where vLLM's eager build makes ``2 * max(1024, tot)``."""
    if profile is None:
        return out
    cap = 2 * max(1024, -(-profile.max_num_tokens // 8) + profile.max_num_reqs)
    for name in ("batch_ptr", "token_chunk_offset_ptr"):
        t = out.get(name)
        if isinstance(t, torch.Tensor) and t.shape[0] < cap:
            full = torch.full((cap,), -1, dtype=t.dtype, device=t.device)
            full[: t.shape[0]] = t
            out[name] = full
    if out.get("conv1d_max_num_programs"):
        out["conv1d_max_num_programs"] = cap
    return out


def mamba2_reference(spec: BatchSpec, options: Mamba2Options, device: torch.device,
                     inputs: Mamba2Inputs | None, profile: StaticProfile | None = None) -> dict[str, Any]:
    """:func:`attnmeta.testing.reference.ref_mamba_metadata`: every field the way vLLM 0.33.0's
    builder computes it, on ``device`` (the accepted counts from ``inputs``; under a graph-mode
    ``profile`` the causal-conv1d pointers at the profile's fixed length)."""
    return _graph_conv1d(ref_mamba_metadata(spec, options, device, num_accepted_tokens=None if inputs is None
                                            else inputs.num_accepted_tokens), profile)


# ------------------------------------------------------------------------------------------------
# Mamba1


def mamba1_sample(spec: BatchSpec, rng: np.random.Generator) -> tuple[Mamba1Options, None]:
    """A random cache mode, conv1d metadata on or off (Mamba1 takes no inputs)."""
    return Mamba1Options(cache_mode="align" if rng.random() < 0.5 else "none",
                         needs_causal_conv1d_metadata=bool(rng.random() < 0.8)), None


def mamba1_reference(spec: BatchSpec, options: Mamba1Options, device: torch.device, inputs: None,
                     profile: StaticProfile | None = None) -> dict[str, Any]:
    """:func:`attnmeta.testing.reference.ref_mamba_metadata` (threshold 1, no chunks; the causal-conv1d
    pointers at a graph-mode ``profile``'s fixed length)."""
    return _graph_conv1d(ref_mamba_metadata(spec, options, device), profile)


# ------------------------------------------------------------------------------------------------
# linear attention


def linear_attn_sample(spec: BatchSpec, rng: np.random.Generator) -> tuple[LinearAttentionOptions, None]:
    """A random cache mode (linear attention takes no inputs)."""
    return LinearAttentionOptions(cache_mode="align" if rng.random() < 0.5 else "none"), None


def linear_attn_reference(spec: BatchSpec, options: LinearAttentionOptions, device: torch.device,
                          inputs: None) -> dict[str, Any]:
    """:func:`attnmeta.testing.reference.ref_linear_attn_metadata`."""
    return ref_linear_attn_metadata(spec, options, device)


# ------------------------------------------------------------------------------------------------
# GDN


def gdn_sample(spec: BatchSpec, rng: np.random.Generator) -> tuple[GDNOptions, GDNInputs | None]:
    """Random spec tokens (at least the spec's drafts on most draws), cache mode, prefill backend,
    FULL-graph staging and conv1d, and accepted counts under spec decode (on most draws of a spec
    with drafts; else no inputs)."""
    d = spec.num_draft_tokens
    dmax = int(d.max()) if d is not None and d.size else 0
    k = max(dmax, int(rng.integers(0, 4)))
    opts = GDNOptions(
        num_speculative_tokens=k, cache_mode="align" if rng.random() < 0.5 else "none",
        prefill_backend="flashinfer" if rng.random() < 0.2 else "triton",
        cudagraph_max_bs=int(rng.choice([1, 4, 512])) if rng.random() < 0.5 else None,
        needs_causal_conv1d_metadata=bool(rng.random() < 0.8),
    )
    if k and d is not None and rng.random() < 0.7:  # the runner passes counts with drafts only
        return opts, GDNInputs(num_accepted_tokens=rng.integers(1, k + 2, size=spec.num_reqs).astype(np.int32))
    return opts, None


def gdn_reference(spec: BatchSpec, options: GDNOptions, device: torch.device,
                  inputs: GDNInputs | None, profile: StaticProfile | None = None) -> dict[str, Any]:
    """:func:`attnmeta.testing.reference.gdn.ref_gdn_metadata`: vLLM 0.33.0's formulas on ``device``
    (the accepted counts from ``inputs``; the causal-conv1d pointers at a graph-mode ``profile``'s fixed
    length)."""
    return _graph_conv1d(ref_gdn_metadata(spec, options, device, num_accepted_tokens=None if inputs is None
                                          else inputs.num_accepted_tokens), profile)


ENTRIES: dict[str, LabEntry] = {
    "mamba2": LabEntry(reference=mamba2_reference, sample=mamba2_sample),
    "mamba1": LabEntry(reference=mamba1_reference, sample=mamba1_sample),
    "linear_attn": LabEntry(reference=linear_attn_reference, sample=linear_attn_sample),
    "gdn": LabEntry(reference=gdn_reference, sample=gdn_sample),
}
"""The Mamba-family builders' lab entries, by registry name."""
