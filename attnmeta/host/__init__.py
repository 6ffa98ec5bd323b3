"""Pure host derivations: numpy in, numpy out, numba-compiled loops. Never imports torch.

Modules: :mod:`~attnmeta.host.layout` (query offsets, sequence lengths, positions, slot mapping),
:mod:`~attnmeta.host.split` (decode/prefill splits, the vLLM reorder), :mod:`~attnmeta.host.common`
(the fused per-step common derivation), :mod:`~attnmeta.host.paged` (FlashInfer paged KV),
:mod:`~attnmeta.host.fast_prefill`, :mod:`~attnmeta.host.local_attn`, :mod:`~attnmeta.host.cascade`,
:mod:`~attnmeta.host.flash_attn` (DCP), :mod:`~attnmeta.host.chunks` (Mamba2 chunk layouts),
:mod:`~attnmeta.host.conv1d` (causal-conv1d programs), :mod:`~attnmeta.host.mamba` (state indices,
classification, prefill checkpoints).
"""

__all__ = [
    "cascade",
    "chunks",
    "common",
    "conv1d",
    "fast_prefill",
    "flash_attn",
    "layout",
    "local_attn",
    "mamba",
    "paged",
    "split",
]
