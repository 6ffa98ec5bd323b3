"""Backend metadata builders: one module per backend family, every builder of one protocol.

Each module defines one :class:`attnmeta.builder.Builder` (its options type, its metadata type,
``stage(common, step, options, **inputs)``), registers it, and exposes its ``stage`` and ``build``
methods as module functions. Importing this package registers every built-in builder:

- :mod:`~attnmeta.backends.flash_attn` (``"flash_attn"``), :mod:`~attnmeta.backends.flashinfer`
  (``"flashinfer"``), :mod:`~attnmeta.backends.cascade` (``"cascade"``),
  :mod:`~attnmeta.backends.fast_prefill` (``"fast_prefill"``), :mod:`~attnmeta.backends.local_attn`
  (``"local_attn"``): attention;
- :mod:`~attnmeta.backends.mamba` (``"mamba2"``, ``"mamba1"``, ``"linear_attn"``): state-space and
  linear-attention layers.

:mod:`~attnmeta.backends.fused` is not a builder of the protocol but a step builder for an engine's
loop: the common, FlashAttention and FlashInfer metadata of a step in one call.
"""

from __future__ import annotations

from attnmeta.backends import cascade, fast_prefill, flash_attn, flashinfer, local_attn, mamba, mla, mm_prefix

__all__ = ["cascade", "fast_prefill", "flash_attn", "flashinfer", "local_attn", "mamba", "mla", "mm_prefix"]
