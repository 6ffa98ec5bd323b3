"""A reference engine on attnmeta: a Hugging Face Llama served over a paged KV cache.

Not a server: a client of attnmeta that shows how an engine uses it, and the test bed of the whole
library. ``python -m examples.engine --help`` runs it; ``docs/engine.md`` describes it.
"""

from .engine import Engine, EngineConfig, EngineStats, make_kernel
from .kernels import AttentionKernel, FlashInferKernel, TorchPagedKernel, VarlenKernel
from .kv_cache import BlockPool
from .model import PagedLlama
from .scheduler import Request, Scheduler
from .workload import compare_with_generate, make_model, make_requests, tiny_config

__all__ = [
    "AttentionKernel",
    "BlockPool",
    "Engine",
    "EngineConfig",
    "EngineStats",
    "FlashInferKernel",
    "PagedLlama",
    "Request",
    "Scheduler",
    "TorchPagedKernel",
    "VarlenKernel",
    "compare_with_generate",
    "make_kernel",
    "make_model",
    "make_requests",
    "tiny_config",
]
