"""Assertion helpers: compare host results and device tensors bit for bit.

These are test-suite helpers: they read device tensors on the host (``.cpu()``), which is a
synchronisation, and are therefore only for tests, never for the serving path.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from attnmeta.staging import STAGEABLE_DTYPES
from attnmeta.testing._oracle import oracle

__all__ = ["DEBUG_FILL", "assert_host_equal", "assert_matches_device", "numpy_dtype_of", "torch_dtype_of"]

# One dtype table for the project (the stager's), plus float64 for comparing float references.
_NP_TO_TORCH: dict[np.dtype, torch.dtype] = {**STAGEABLE_DTYPES, np.dtype(np.float64): torch.float64}
_TORCH_TO_NP = {v: k for k, v in _NP_TO_TORCH.items()}


def torch_dtype_of(dtype: Any) -> torch.dtype:
    """The torch dtype matching a numpy dtype (``int32`` -> ``torch.int32``)."""
    return _NP_TO_TORCH[np.dtype(dtype)]


def numpy_dtype_of(dtype: torch.dtype) -> np.dtype:
    """The numpy dtype matching a torch dtype (``torch.int32`` -> ``int32``)."""
    return _TORCH_TO_NP[dtype]


DEBUG_FILL = 0xA5
"""The byte :func:`attnmeta.testing.check_builder`'s own stagers fill their new memory with
(``Stager(debug_fill=...)``); a mismatch whose value is this byte repeated says so."""


def _unwritten(a: np.ndarray, where: tuple[int, ...]) -> str:
    """A note when ``a[where]`` is :data:`DEBUG_FILL` in every byte: memory the builder never wrote."""
    if a.dtype.kind not in "iuf" or not a.size:
        return ""
    if np.frombuffer(np.ascontiguousarray(a[where]).tobytes(), np.uint8).tolist() != [DEBUG_FILL] * a.itemsize:
        return ""
    return f" ({DEBUG_FILL:#x} in every byte: the stager's debug fill, a value the builder never wrote)"


def _first_diff(a: np.ndarray, b: np.ndarray) -> str:
    idx = np.argwhere(a != b)
    if idx.size == 0:
        return ""
    where = tuple(int(v) for v in idx[0])
    return (f"first difference at {where}: host {a[where]!r}{_unwritten(a, where)} vs expected {b[where]!r}; "
            f"{len(idx)} differ")


def assert_host_equal(actual: Any, expected: Any, name: str = "value") -> None:
    """Assert two host arrays are equal in dtype, shape and every value.

    ``expected`` may be a Python list (then only values and shape are checked against ``actual``'s
    dtype).
    """
    a = np.asarray(actual)
    b = np.asarray(expected)
    if isinstance(expected, np.ndarray) and a.dtype != b.dtype:
        raise AssertionError(f"{name}: dtype {a.dtype} != expected {b.dtype}")
    if a.shape != b.shape:
        raise AssertionError(f"{name}: shape {a.shape} != expected {b.shape}\nactual={a}\nexpected={b}")
    if not np.array_equal(a, b):
        raise AssertionError(f"{name}: {_first_diff(a, b)}\nactual={a}\nexpected={b}")


@oracle
def assert_matches_device(host: Any, device: torch.Tensor | None, name: str = "value") -> None:
    """Assert a host (numpy) result equals a torch tensor bit for bit: dtype, shape and values.

    ``device`` is copied to the host with ``.cpu()`` (a sync; test-only). ``None`` must match
    ``None``. Scalars (Python ints/bools) compare against 0-d tensors or plain values.
    """
    if host is None or device is None:
        if host is not device:
            raise AssertionError(f"{name}: one side is None (host={host!r}, reference={device!r})")
        return
    if not isinstance(device, torch.Tensor):
        if not isinstance(host, np.ndarray) and host == device and type(host) is type(device):
            return
        assert_host_equal(host, device, name)
        return
    ref = device.detach().cpu()
    h = np.asarray(host)
    expected_np = numpy_dtype_of(ref.dtype)
    if h.dtype != expected_np:
        raise AssertionError(f"{name}: host dtype {h.dtype} != reference dtype {ref.dtype}")
    assert_host_equal(h, ref.numpy(), name)
