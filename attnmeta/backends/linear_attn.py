"""Linear-attention metadata (vllm-semantics.md 6.12): the ``stage`` / ``build`` pair.

The implementation is shared with the Mamba builders in :mod:`attnmeta.backends.mamba2` (same
state-index gather, the plain decode/prefill split); this module gives it the usual per-backend
names. See :class:`~attnmeta.backends.mamba2.LinearAttentionMetadata` for the fields.

Shape legend
------------
- ``num_reqs`` (``B``): request rows, padding included.
"""

from __future__ import annotations

from attnmeta.backends.mamba2 import LinearAttentionMetadata, LinearAttnOptions, block_table_columns
from attnmeta.backends.mamba2 import build_linear_attn as build
from attnmeta.backends.mamba2 import stage_linear_attn as stage

__all__ = ["LinearAttentionMetadata", "LinearAttnOptions", "block_table_columns", "build", "stage"]
