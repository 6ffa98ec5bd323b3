"""Adapters between attnmeta and serving engines, each importing its engine lazily.

No engine is a dependency of attnmeta: importing an adapter module never imports the engine; only
the functions that need the engine's own classes import it, when called.

- :mod:`attnmeta.integrations.vllm`: vLLM 0.33.0's ``CommonAttentionMetadata`` to a
  :class:`~attnmeta.BatchSpec` and back (docs/vllm.md).
"""

__all__ = ["vllm"]
