"""What the third-party Triton kernels need to run under Triton's interpreter on the CPU
(``TRITON_INTERPRET=1``), shared by the modules of ``tests/kernels``. Nothing here changes a CUDA run,
except :func:`first_config_only` where ``ATTNMETA_KERNELS_FIRST_CONFIG=1`` asks for it."""

from __future__ import annotations

import contextlib
import os
import types
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

__all__ = ["FIRST_CONFIG", "INTERPRET", "conv1d_metadata", "cuda_device_shim", "first_config_only",
           "int1_comparisons"]

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
FIRST_CONFIG = INTERPRET or os.environ.get("ATTNMETA_KERNELS_FIRST_CONFIG", "0") == "1"
"""Keep only the first config of every autotuned kernel: always under the interpreter (benchmarking
configs there would take minutes; vLLM's ``VLLM_TRITON_FORCE_FIRST_CONFIG`` does the same), on CUDA
with ``ATTNMETA_KERNELS_FIRST_CONFIG=1``."""


def first_config_only(modules: list[types.ModuleType]) -> None:
    """Where :data:`FIRST_CONFIG`, keep only the first config of every autotuned kernel in ``modules``."""
    if not FIRST_CONFIG:
        return
    from triton.runtime.autotuner import Autotuner

    for mod in modules:
        for obj in vars(mod).values():
            if isinstance(obj, Autotuner):
                obj.configs = obj.configs[:1]


@contextlib.contextmanager
def int1_comparisons() -> Iterator[None]:
    """Under Triton's interpreter, make comparisons yield int1 handles (a no-op elsewhere).

    Triton's interpreter (3.6 and 3.9 at least) keeps the operands' type on a comparison's result (an
    int64 compare gives bool data in an "int64" handle); broadcasting such a scalar condition into a
    block then makes int64 data, and a load masked by it fails ("mask has unsupported dtype"), as in
    ``causal_conv1d``'s ``(coord < num_cache_lines) & ...``. Compiled code types every comparison i1.
    """
    if not INTERPRET:
        yield
        return
    import triton.language as tl
    from triton.runtime import interpreter

    def as_int1(create: Callable[..., Any]) -> Callable[..., Any]:
        def compare(self: Any, lhs: Any, rhs: Any) -> Any:
            return interpreter.TensorHandle(create(self, lhs, rhs).data.astype(np.bool_), tl.int1)
        return compare

    with pytest.MonkeyPatch.context() as mp:
        for name in dir(interpreter.InterpreterBuilder):
            if name.startswith(("create_icmp", "create_fcmp")):
                create = getattr(interpreter.InterpreterBuilder, name)
                mp.setattr(interpreter.InterpreterBuilder, name, as_int1(create))
        yield


@contextlib.contextmanager
def cuda_device_shim() -> Iterator[None]:
    """``torch.cuda.device(None)`` fails on a CPU-only torch; ``mamba_ssm`` enters
    ``torch.cuda.device(x.device.index)`` around its launches. A no-op there under the interpreter."""
    if torch.cuda.is_available():
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
        yield


def conv1d_metadata(nums_dict: dict[int, dict[str, Any]], batch_ptr: torch.Tensor,
                    token_chunk_offset_ptr: torch.Tensor) -> types.SimpleNamespace:
    """What vLLM's ``causal_conv1d_fn`` reads as ``metadata=``: ``nums_dict`` and the two program arrays.

    The kernel's grid function swaps its ``batch_ptr`` / ``token_chunk_offset_ptr`` arguments for
    ``nums_dict[8]``'s (the same tensors here). Compiled, that works; Triton's interpreter converts the
    arguments to pointers before it calls the grid function, so there ``nums_dict`` holds the converted
    pointers to the same memory.
    """
    nd = dict(nums_dict[8], batch_ptr=batch_ptr, token_chunk_offset_ptr=token_chunk_offset_ptr)
    if INTERPRET:
        from triton.runtime.interpreter import _implicit_cvt

        nd.update(batch_ptr=_implicit_cvt(batch_ptr), token_chunk_offset_ptr=_implicit_cvt(token_chunk_offset_ptr))
    return types.SimpleNamespace(nums_dict={8: nd}, batch_ptr=batch_ptr, token_chunk_offset_ptr=token_chunk_offset_ptr)
