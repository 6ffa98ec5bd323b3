"""Mamba-family metadata (docs/semantics-mamba.md): Mamba2, Mamba1, linear attention and gated delta net.

Four registered builders, one module each, built from the shared pieces of
:mod:`attnmeta.backends.mamba._shared`; the Mamba2 and Mamba1 builders share one fill path,
:mod:`attnmeta.backends.mamba._fill`:

- :mod:`~attnmeta.backends.mamba.mamba2` (``"mamba2"``): :class:`Mamba2Metadata`, vLLM's
  ``Mamba2AttentionMetadataBuilder``; per-step inputs :class:`Mamba2Inputs`;
- :mod:`~attnmeta.backends.mamba.mamba1` (``"mamba1"``): :class:`Mamba1Metadata`, vLLM's
  ``Mamba1AttentionMetadataBuilder``; no inputs;
- :mod:`~attnmeta.backends.mamba.linear_attn` (``"linear_attn"``): :class:`LinearAttentionMetadata`,
  vLLM's ``LinearAttentionMetadataBuilder``; no inputs;
- :mod:`~attnmeta.backends.mamba.gdn` (``"gdn"``): :class:`GDNMetadata`, vLLM's
  ``GDNAttentionMetadataBuilder``; per-step inputs :class:`GDNInputs`.

Each module's ``stage`` / ``build`` are its builder's methods (``stage(common, step, options,
inputs)``, ``build(spec, stager, options, inputs)``, the inputs an Inputs object or None); the generic
:func:`attnmeta.builder.build` (``build(spec, stager, "mamba2", options, inputs)``) stages the common
metadata with exactly what a Mamba group reads (no per-token arrays, :func:`block_table_columns`
columns).

Examples
--------
>>> from attnmeta import BatchSpec, Stager
>>> from attnmeta.backends.mamba import Mamba2Options, mamba2
>>> spec = BatchSpec(num_computed_tokens=[9, 5, 0], num_scheduled_tokens=[1, 10, 3],
...                  num_prompt_tokens=[4, 40, 3], block_table=[[1, 2], [3, 4], [5, 6]], block_size=8)
>>> m = mamba2.build(spec, Stager("cpu"), Mamba2Options(chunk_size=8))
>>> m.cu_chunk_seqlen_p_cpu.tolist(), m.common.slot_mapping.shape
([0, 3, 10, 13], torch.Size([0]))
"""

from __future__ import annotations

from attnmeta.backends.mamba import gdn, linear_attn, mamba1, mamba2
from attnmeta.backends.mamba._shared import MambaHost, MambaMetadata, block_table_columns
from attnmeta.backends.mamba.gdn import GDNInputs, GDNMetadata, GDNOptions
from attnmeta.backends.mamba.linear_attn import (
    LinearAttentionHost,
    LinearAttentionMetadata,
    LinearAttentionOptions,
)
from attnmeta.backends.mamba.mamba1 import Mamba1Metadata, Mamba1Options
from attnmeta.backends.mamba.mamba2 import (
    CheckpointConfig,
    Mamba2Inputs,
    Mamba2Metadata,
    Mamba2Options,
    MambaCheckpointMetadata,
)

__all__ = [
    "CheckpointConfig",
    "GDNInputs",
    "GDNMetadata",
    "GDNOptions",
    "LinearAttentionHost",
    "LinearAttentionMetadata",
    "LinearAttentionOptions",
    "Mamba1Metadata",
    "Mamba1Options",
    "Mamba2Inputs",
    "Mamba2Metadata",
    "Mamba2Options",
    "MambaCheckpointMetadata",
    "MambaHost",
    "MambaMetadata",
    "block_table_columns",
    "gdn",
    "linear_attn",
    "mamba1",
    "mamba2",
]
