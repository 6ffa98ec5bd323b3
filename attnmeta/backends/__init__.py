"""Backend metadata builders: one module per backend family, every builder of one protocol.

Each module defines one :class:`attnmeta.builder.Builder` (its options type, its metadata type,
``derive(common, step, options, inputs)``), registers it, and exposes its ``stage`` and ``build``
methods as module functions. Importing this package registers every built-in builder:

- :mod:`~attnmeta.backends.flash_attn` (``"flash_attn"``), :mod:`~attnmeta.backends.flashinfer`
  (``"flashinfer"``), :mod:`~attnmeta.backends.cascade` (``"cascade"``),
  :mod:`~attnmeta.backends.fast_prefill` (``"fast_prefill"``), :mod:`~attnmeta.backends.local_attn`
  (``"local_attn"``): attention;
- :mod:`~attnmeta.backends.mla` (``"mla"``): multi-head latent attention;
- :mod:`~attnmeta.backends.mm_prefix` (``"mm_prefix"``): multimodal bidirectional prefix ranges;
- :mod:`~attnmeta.backends.mamba` (``"mamba2"``, ``"mamba1"``, ``"linear_attn"``, ``"gdn"``): state-space,
  linear-attention and gated-delta-net layers.

:mod:`~attnmeta.backends.fused` is not a builder of the contract but a step composer
(:class:`attnmeta.compose.StepBuilder`) of the common, FlashAttention and FlashInfer metadata.
"""

from __future__ import annotations

from attnmeta.backends import cascade, fast_prefill, flash_attn, flashinfer, local_attn, mamba, mla, mm_prefix

__all__ = ["cascade", "fast_prefill", "flash_attn", "flashinfer", "local_attn", "mamba", "mla", "mm_prefix"]
