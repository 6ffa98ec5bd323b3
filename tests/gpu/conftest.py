"""The GPU suites' shared models (tests/gpu/test_engine_cuda.py and test_engine_vllm_cuda.py): a small Llama
and a small Bamba in bfloat16 on CUDA, and the ``generate`` reference cache of each. Made on first use, so
collecting tests/gpu on a machine without CUDA or transformers builds nothing."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(scope="module")
def model() -> Any:
    """A Llama of 4 layers, 8 query / 2 KV heads of 64, in bfloat16 on CUDA."""
    import torch

    from examples.engine.workload import make_model, tiny_config

    cfg = tiny_config(vocab_size=2048, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=64, initializer_range=0.05)
    return make_model(cfg, "cuda", torch.bfloat16)


@pytest.fixture(scope="module")
def reference() -> dict[Any, Any]:
    """``generate``'s results for :func:`model`, cached across a module's tests."""
    return {}


@pytest.fixture(scope="module")
def hybrid_model() -> Any:
    """A Bamba of 4 layers (Mamba2 and attention in turn), in bfloat16 on CUDA."""
    import torch

    from examples.engine.workload import make_model, tiny_hybrid_config

    cfg = tiny_hybrid_config(vocab_size=2048, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                             num_attention_heads=8, num_key_value_heads=2, mamba_n_heads=16, mamba_d_head=64,
                             mamba_n_groups=2, mamba_d_state=64, mamba_chunk_size=32, initializer_range=0.05)
    return make_model(cfg, "cuda", torch.bfloat16)


@pytest.fixture(scope="module")
def hybrid_reference() -> dict[Any, Any]:
    """``generate``'s results for :func:`hybrid_model`, cached across a module's tests."""
    return {}
