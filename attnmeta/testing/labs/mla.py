"""Lab entries of the mla builders (reference values from :mod:`attnmeta.testing.reference`, random
and demo options)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import torch

from attnmeta.backends.mla import MLAOptions
from attnmeta.spec import BatchSpec
from attnmeta.testing.labs._entry import LabEntry, LeadingColumns
from attnmeta.testing.reference.layout import ref_block_table
from attnmeta.testing.reference.mla import ref_mla_fields

__all__ = ["ENTRIES"]

_VARIANTS = ("flashmla", "flashattn_mla", "flashinfer_mla", "triton_mla")


def _workspace_alignment(block_size: int, dcp_world_size: int, dcp_interleave: int) -> int:
    """vLLM's ``align_mla_chunked_context_workspace_size`` alignment: the block size, under DCP
    ``lcm(block_size, dcp_world_size * dcp_interleave)`` (chunks always align to blocks here)."""
    if dcp_world_size > 1:
        return math.lcm(block_size, dcp_world_size * dcp_interleave)
    return block_size


def mla_sample(spec: BatchSpec, rng: np.random.Generator) -> tuple[MLAOptions, None]:
    """A random variant, draft count and small workspace (so contexts chunk); DCP on about a third of
    the draws (the spec's world size when it has one)."""
    variant = _VARIANTS[int(rng.integers(0, 4))]
    cp = spec.context_parallel
    W = cp.world_size if cp is not None else (2 if rng.random() < 0.3 else 1)
    rank = cp.rank if cp is not None else (int(rng.integers(0, W)))
    inter = 1 if variant == "flashinfer_mla" or W == 1 else int(rng.choice([1, 2]))
    opts = MLAOptions(variant=variant, num_speculative_tokens=int(rng.integers(0, 3)),  # type: ignore[arg-type]
                      dcp_world_size=W, dcp_rank=rank, dcp_interleave=inter,
                      align_indptr=bool(rng.random() < 0.3), num_sms=int(rng.choice([1, 4, 132])))
    align = _workspace_alignment(spec.block_size, W, inter)
    ws = int(rng.integers(1, 9)) * align * W
    return dataclasses.replace(opts, workspace_size=ws), None


def mla_reference(spec: BatchSpec, options: MLAOptions, device: torch.device, inputs: None) -> dict[str, Any]:
    """vLLM's formulas on ``device`` (:func:`attnmeta.testing.reference.mla.ref_mla_fields`), and the
    block table's read columns."""
    return {**ref_mla_fields(spec, options, device), "block_table": LeadingColumns(ref_block_table(spec, device))}


ENTRIES: dict[str, LabEntry] = {
    "mla": LabEntry(reference=mla_reference, sample=mla_sample),
}
"""The MLA builder's lab entry, by registry name."""
