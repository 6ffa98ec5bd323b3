"""Lab entries of the attention builders: FlashAttention, FlashInfer, cascade, fast prefill, local
attention (reference values from :mod:`attnmeta.testing.reference`, random and demo options)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from attnmeta.backends.flash_attn import FlashAttentionInputs, FlashAttentionOptions
from attnmeta.spec import BatchSpec
from attnmeta.testing.labs._entry import LabEntry
from attnmeta.testing.reference.layout import ref_common_fields, ref_split_decodes_and_prefills

__all__ = ["ENTRIES"]


# ------------------------------------------------------------------------------------------------
# FlashAttention


def flash_attn_sample(spec: BatchSpec, rng: np.random.Generator) -> tuple[FlashAttentionOptions, Any]:
    """DCP on half the draws (world size 2, a random rank), else per-request causal flags."""
    if rng.random() < 0.5:
        return FlashAttentionOptions(dcp_world_size=2, dcp_rank=int(rng.integers(0, 2))), None
    return (FlashAttentionOptions(decode_threshold=int(rng.integers(1, 4))),
            FlashAttentionInputs(causal=rng.random(spec.num_reqs) < 0.7))


def flash_attn_reference(spec: BatchSpec, options: FlashAttentionOptions, device: torch.device,
                         inputs: FlashAttentionInputs) -> dict[str, Any]:
    """The common fields it passes on and its split (the DCP lengths: the FlashAttention tests)."""
    ref = ref_common_fields(spec, device)
    nd, np_, ndt, npt = ref_split_decodes_and_prefills(
        ref["query_start_loc"], spec.padded_num_tokens, spec.max_query_len, options.decode_threshold)
    return {"query_start_loc": ref["query_start_loc"], "seq_lens": ref["seq_lens"],
            "slot_mapping": ref["slot_mapping"], "num_decode_reqs": nd, "num_prefill_reqs": np_,
            "num_decode_tokens": ndt, "num_prefill_tokens": npt}


ENTRIES: dict[str, LabEntry] = {
    "flash_attn": LabEntry(reference=flash_attn_reference, sample=flash_attn_sample),
}
"""The attention builders' lab entries, by registry name."""
