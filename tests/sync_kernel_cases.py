"""Operations that synchronise the host with the GPU on CUDA, which the sync audit once let through on
CPU-only CI (found by a review that hunted for false negatives): tests/sync/test_sync_kernel_reads.py
checks that the audit flags each on ``meta`` tensors or on ``cpu`` tensors declared device data (the
modes each case names), and tests/gpu/test_sync_rules_cuda.py that CUDA's own debug mode reports each.

Each case's ``why`` gives the evidence that it blocks on CUDA (torch's source or its own documentation).
Most are syncs inside a C++ kernel that calls ``.item()`` on an input, which the dispatch mode sees only
as the outer aten op; the rest are Python-level reads (printing, ``torch.tensor`` of device scalars).
What the audit still cannot see (serialization, logging's swallowed errors, ``assert_close`` on meta) is
listed in docs/sync-audit.md.
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Callable

import torch

Thunk = Callable[[], object]
MODES: dict[str, tuple[torch.device, frozenset[str]]] = {
    "meta": (torch.device("meta"), frozenset()),
    "cpu-as-device": (torch.device("cpu"), frozenset({"cpu"})),
}
BOTH = ("meta", "cpu-as-device")


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    make: Callable[[torch.device], Thunk]
    why: str
    """Why it syncs on CUDA (the evidence)."""
    modes: tuple[str, ...] = BOTH
    """The CPU-side modes in which the audit currently lets it through."""


def vec(d: torch.device, n: int = 8) -> torch.Tensor:
    return torch.arange(n, device=d)


def fvec(d: torch.device) -> torch.Tensor:
    return torch.arange(8, device=d, dtype=torch.float32)


def mask(d: torch.device) -> torch.Tensor:
    return torch.arange(8, device=d) % 2 == 0


def spd(d: torch.device) -> torch.Tensor:
    return torch.eye(3, device=d) * 2


def _linspace(d: torch.device) -> Thunk:
    x = fvec(d)
    return lambda: torch.linspace(x[0], x[3], 4, device=d)


def _logspace(d: torch.device) -> Thunk:
    x = fvec(d)
    return lambda: torch.logspace(x[0], x[3], 4, device=d)


def _masked_fill_dev_value(d: torch.device) -> Thunk:
    x, m = vec(d), mask(d)
    return lambda: x.masked_fill(m, x[3])


def _masked_fill__dev_value(d: torch.device) -> Thunk:
    x, m = vec(d), mask(d)
    return lambda: x.masked_fill_(m, x[3])


def _index_fill__dev_value(d: torch.device) -> Thunk:
    x = vec(d)
    idx = x[:2].clone()
    return lambda: x.index_fill_(0, idx, x[3])


def _index_fill_dev_value(d: torch.device) -> Thunk:
    x = vec(d)
    idx = x[:2].clone()
    return lambda: x.index_fill(0, idx, x[3])


def _segment_reduce(d: torch.device) -> Thunk:
    x, lengths = fvec(d), torch.tensor([3, 5], device=d) if d.type != "meta" else torch.empty(2, dtype=torch.int64,
                                                                                               device=d)
    return lambda: torch.segment_reduce(x, "sum", lengths=lengths)


def _normal_std_tensor(d: torch.device) -> Thunk:
    x = fvec(d)
    return lambda: torch.normal(x, x)


def _normal_float_mean_std_tensor(d: torch.device) -> Thunk:
    x = fvec(d)
    return lambda: torch.normal(0.0, x)


def _linalg(fn: Callable[[torch.Tensor], object]) -> Callable[[torch.device], Thunk]:
    def make(d: torch.device) -> Thunk:
        a = spd(d)
        return lambda: fn(a)

    return make


def _repr(d: torch.device) -> Thunk:
    x = vec(d)
    return lambda: repr(x)


def _str_float(d: torch.device) -> Thunk:
    x = fvec(d)
    return lambda: str(x)


def _fstring(d: torch.device) -> Thunk:
    x = vec(d)
    return lambda: f"{x}"


def _fstring_0dim(d: torch.device) -> Thunk:
    x = vec(d)
    return lambda: f"{x[0]}"


def _print(d: torch.device) -> Thunk:
    x = vec(d)
    return lambda: print(x, file=io.StringIO())


def _tensor_of_device_scalars(d: torch.device) -> Thunk:
    x = vec(d)
    return lambda: torch.tensor([x[0], x[1]])


def _as_tensor_of_device_scalars(d: torch.device) -> Thunk:
    x = vec(d)
    return lambda: torch.as_tensor([x[0], x[1]])


def _to_sparse(d: torch.device) -> Thunk:
    x = vec(d)
    return lambda: x.to_sparse()


KERNEL_ITEM = "its CUDA kernel calls .item() on a device input"
LINALG_DOC = (
    "torch.linalg docs: 'When inputs are on a CUDA device, this function synchronizes that device with the "
    "CPU' (the non-_ex variants run _linalg_check_errors, which reads `info` on the host)"
)

CASES = [
    Case(
        "linspace(dev_0dim, dev_0dim)",
        _linspace,
        "RangeFactories.cpp linspace(Tensor, Tensor) returns at::linspace(start.item(), end.item(), ...)",
    ),
    Case("logspace(dev_0dim, dev_0dim)", _logspace, "as linspace: logspace(start.item(), end.item(), ...)"),
    Case(
        "masked_fill(mask, dev_0dim)",
        _masked_fill_dev_value,
        f"{KERNEL_ITEM}: cuda/Indexing.cu masked_fill__cuda(self, mask, const Tensor& value) returns "
        "masked_fill__cuda(self, mask, value.item())",
    ),
    Case("masked_fill_(mask, dev_0dim)", _masked_fill__dev_value, "as masked_fill(mask, dev_0dim)"),
    Case(
        "index_fill_(dim, index, dev_0dim)",
        _index_fill__dev_value,
        f"{KERNEL_ITEM}: TensorAdvancedIndexing.cpp index_fill_(self, dim, index, const Tensor& source) returns "
        "self.index_fill_(dim, index, source.item())",
    ),
    Case("index_fill(dim, index, dev_0dim)", _index_fill_dev_value, "as index_fill_ (clone + index_fill_)"),
    Case(
        "normal(mean, std=dev_tensor)",
        _normal_std_tensor,
        "torch.normal docs: 'When std is a CUDA tensor, this function synchronizes its device with the CPU' "
        "(CHECK_NORMAL_TENSOR_STD: std.min().ge(0).item<bool>(), skipped for meta)",
    ),
    Case("normal(0.0, std=dev_tensor)", _normal_float_mean_std_tensor, "as normal(mean, std=dev_tensor)"),
    Case(
        "segment_reduce(lengths=dev)",
        _segment_reduce,
        "SegmentReduce.cpp segment_reduce_kernel checks lengths unless unsafe: lengths.min().item() and "
        "all(lengths.sum(-1) == data.size(axis)).item(); on an H100, CUDA's debug mode raised for it (a probe of "
        "46 ops against the audit, where it was the one the audit let pass)",
    ),
    Case("linalg.cholesky", _linalg(torch.linalg.cholesky), LINALG_DOC),
    Case("linalg.inv", _linalg(torch.linalg.inv), LINALG_DOC),
    Case("linalg.solve", _linalg(lambda a: torch.linalg.solve(a, a)), LINALG_DOC),
    Case("linalg.lu_factor", _linalg(torch.linalg.lu_factor), LINALG_DOC),
    Case("linalg.eigh", _linalg(torch.linalg.eigh), LINALG_DOC + "; here inside the _linalg_eigh kernel"),
    Case(
        "linalg.cholesky_ex(check_errors=True)",
        _linalg(lambda a: torch.linalg.cholesky_ex(a, check_errors=True)),
        "torch.linalg docs (cholesky_ex): 'When the inputs are on a CUDA device, this function synchronizes only "
        "when check_errors = True'",
    ),
    Case(
        "linalg.eigvalsh",
        _linalg(torch.linalg.eigvalsh),
        LINALG_DOC + "; here inside the _linalg_eigh kernel",
    ),
    Case(
        "linalg.svdvals",
        _linalg(torch.linalg.svdvals),
        LINALG_DOC + "; here inside the _linalg_svd kernel (also behind svd, matrix_rank, pinv, cond)",
    ),
    Case(
        "linalg.eig",
        _linalg(torch.linalg.eig),
        LINALG_DOC + "; linalg_eig runs on the host (MAGMA) and copies the input back",
    ),
    Case("linalg.ldl_factor", _linalg(torch.linalg.ldl_factor), LINALG_DOC),
    Case(
        "torch.cholesky (deprecated)",
        _linalg(torch.cholesky),
        "BatchLinearAlgebra.cpp cholesky calls at::_linalg_check_errors(info, ...) inside the kernel",
    ),
    Case(
        "repr(dev)",
        _repr,
        "torch/_tensor_str.py formats CUDA data with .tolist() / masked_select / .item() (D2H copies), under "
        "_disable_current_modes(), so neither audit mode sees them",
    ),
    Case("str(dev float)", _str_float, "as repr(dev)"),
    Case("f'{dev}'", _fstring, "Tensor.__format__ of a non-0-dim tensor: str() -> repr(dev)"),
    Case(
        "f'{dev_0dim}'",
        _fstring_0dim,
        "Tensor.__format__: self.item().__format__() unless self.is_meta (torch/_tensor.py)",
        modes=("meta",),
    ),
    Case("print(dev)", _print, "as repr(dev)"),
    Case(
        "torch.tensor([dev_0dim, dev_0dim])",
        _tensor_of_device_scalars,
        "torch.tensor reads each 0-dim CUDA element on the host (tensor_new.cpp), below the audit's modes",
        modes=("cpu-as-device",),
    ),
    Case(
        "torch.as_tensor([dev_0dim, dev_0dim])",
        _as_tensor_of_device_scalars,
        "as torch.tensor([dev_0dim, dev_0dim])",
        modes=("cpu-as-device",),
    ),
    Case(
        "to_sparse()",
        _to_sparse,
        "dense_to_sparse finds the non-zero indices with nonzero() inside the kernel (meta: torch raises "
        "NotImplementedError, loud)",
        modes=("cpu-as-device",),
    ),
]

