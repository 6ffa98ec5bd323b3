"""A reference engine on attnmeta: a Hugging Face Llama served over a paged KV cache.

Not a server: a client of attnmeta that shows how an engine uses it, and the test bed of the whole
library. ``python -m examples.engine --help`` runs it; ``docs/engine.md`` describes it.
"""

import sys

try:
    import transformers  # noqa: F401  (the engine's models are Hugging Face's)
except ImportError as _error:
    _MESSAGE = (f"examples.engine needs transformers, which is not importable here ({_error}): pip install "
                f"transformers (tested with 5.x; the GPU machine's image has it)")
    _argv = list(getattr(sys, "orig_argv", ()))
    if "-m" in _argv and _argv[_argv.index("-m") + 1 : _argv.index("-m") + 2] == ["examples.engine"]:
        raise SystemExit(_MESSAGE) from None  # the command line: the message, no traceback
    raise ImportError(_MESSAGE) from None

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
