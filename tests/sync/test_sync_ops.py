"""Which operations the sync audit flags, and which it lets through.

Every blocking operation of docs/sync-audit.md, "Operations that do not block" (left column), and the
rest of its family, must raise :class:`DeviceSyncError` naming the operation, on three kinds of
"device" data:

- ``meta`` tensors (CPU-only CI: the data does not exist, so the audit must fail first);
- ``cpu`` tensors declared as device data (``devices={"cpu"}``: how CPU CI audits reference code);
- ``cuda`` tensors, where a GPU is present (skipped otherwise, with the reason shown by ``-ra``).

Every non-blocking operation of the right column must run clean on the same three.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch

from attnmeta.sync import DeviceSyncError, ViolationKind, allow_device_sync, no_device_sync

Thunk = Callable[[], object]


@dataclasses.dataclass(frozen=True)
class Backend:
    """Where the "device" tensors of a case live and what the audit must declare for them."""

    name: str
    device: torch.device
    declare: frozenset[str]

    def audit(self, **kwargs: object) -> object:
        return no_device_sync(devices=self.declare, **kwargs)  # type: ignore[arg-type]

    def pinned(self, t: torch.Tensor) -> torch.Tensor:
        """Pinned where that exists (CUDA); the same tensor elsewhere."""
        return t.pin_memory() if self.device.type == "cuda" else t


BACKENDS = {
    "meta": Backend("meta", torch.device("meta"), frozenset()),
    "cpu-as-device": Backend("cpu-as-device", torch.device("cpu"), frozenset({"cpu"})),
    "cuda": Backend("cuda", torch.device("cuda"), frozenset()),
}


@pytest.fixture(params=list(BACKENDS))
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    b = BACKENDS[request.param]
    if b.device.type == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device; the meta and cpu-as-device runs cover the CPU-only machine")
    yield b
    if b.device.type == "cuda":
        torch.cuda.synchronize()


def vec(b: Backend, n: int = 8) -> torch.Tensor:
    """``[0, 1, ..., n-1]`` int64 on the backend's device, built without a sync."""
    return torch.arange(n, device=b.device)


def mask(b: Backend) -> torch.Tensor:
    return torch.arange(8, device=b.device) % 2 == 0


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    make: Callable[[Backend], Thunk]
    ops: tuple[str, ...]
    """The acceptable ``DeviceSyncError.op`` values (a composite op may be caught at either level)."""
    kind: ViolationKind = "sync"
    not_on_cpu: str = ""
    """Why the case does not apply when CPU tensors are declared device data ("" if it does)."""


NO_HOST = "CPU tensors are device data here: there is no host tensor to copy or index with"
NUMPY_VIEW = "a numpy view of a CPU tensor is zero-copy (how staging buffers are written): not flagged"


# --- 12.3, left column: blocks the host -------------------------------------------------------


def _tensor_from_list(b: Backend) -> Thunk:
    return lambda: torch.tensor([1, 2, 3], device=b.device)


def _setitem_int(b: Backend) -> Thunk:
    x = vec(b)
    return lambda: x.__setitem__(3, 7)


def _getitem_host_long(b: Backend) -> Thunk:
    x, idx = vec(b), torch.tensor([0, 2])
    return lambda: x[idx]


def _cpu(b: Backend) -> Thunk:
    x = vec(b)
    return lambda: x.cpu()


def _item(b: Backend) -> Thunk:
    x = vec(b)
    return lambda: x.sum().item()


def _bool(b: Backend) -> Thunk:
    x = vec(b)
    return lambda: bool(x[1])


def _nonzero(b: Backend) -> Thunk:
    x = vec(b)
    return lambda: x.nonzero()


def _repeat_interleave(b: Backend) -> Thunk:
    x = vec(b)
    return lambda: torch.repeat_interleave(x, x)


def _bincount(b: Backend) -> Thunk:
    x = vec(b)
    return lambda: torch.bincount(x, minlength=10)


LEFT_COLUMN = [
    Case("torch.tensor(list, device=dev)", _tensor_from_list, ("torch.tensor",)),
    Case("dev[int] = scalar", _setitem_int, ("Tensor.__setitem__",)),
    Case("dev[host_long_index]", _getitem_host_long, ("aten.index.Tensor",), not_on_cpu=NO_HOST),
    Case(".cpu()", _cpu, ("Tensor.cpu",)),
    Case(".item()", _item, ("aten._local_scalar_dense.default",)),
    Case("bool(dev)", _bool, ("aten._local_scalar_dense.default",)),
    Case("nonzero()", _nonzero, ("aten.nonzero.default",)),
    Case("repeat_interleave without output_size", _repeat_interleave, ("aten.repeat_interleave.Tensor",)),
    Case("bincount(..., minlength)", _bincount, ("aten.bincount.default",)),
]


# --- the rest of the family ---------------------------------------------------------------------


def _thunk(fn: Callable[[torch.Tensor, torch.Tensor], object]) -> Callable[[Backend], Thunk]:
    def make(b: Backend) -> Thunk:
        x, m = vec(b), mask(b)
        return lambda: fn(x, m)

    return make


def _blocking_h2d(b: Backend) -> Thunk:
    host = torch.arange(3)
    return lambda: host.to(b.device)


def _blocking_copy_(b: Backend) -> Thunk:
    x, host = vec(b, 3), torch.arange(3)
    return lambda: x.copy_(host)


def _setitem_slice_host_tensor(b: Backend) -> Thunk:
    x, host = vec(b), torch.tensor([7, 8, 9])
    return lambda: x.__setitem__(slice(0, 3), host)


def _host_values_through_dev_mask(b: Backend) -> Thunk:
    x, host_values = vec(b), torch.tensor([1, 2, 3, 4])
    return lambda: x.__setitem__(mask(b), host_values)


def _tensor_from_numpy_device(b: Backend) -> Thunk:
    a = np.arange(3)
    return lambda: torch.as_tensor(a, device=b.device)


def _d2h_non_blocking(b: Backend) -> Thunk:
    x = vec(b)
    return lambda: x.to("cpu", non_blocking=True)


def _d2h_to(b: Backend) -> Thunk:
    x = vec(b)
    return lambda: x.to("cpu")


def _d2h_copy_(b: Backend) -> Thunk:
    x, host = vec(b), torch.empty(8, dtype=torch.int64)
    return lambda: host.copy_(x)


def _pageable_non_contiguous(b: Backend) -> Thunk:
    x, host = vec(b, 4).view(2, 2), b.pinned(torch.arange(4).view(2, 2)).t()
    return lambda: x.copy_(host, non_blocking=True)


def _broadcast_from_host(b: Backend) -> Thunk:
    x, host = vec(b), b.pinned(torch.arange(1))
    return lambda: x.copy_(host, non_blocking=True)


FAMILY = [
    Case(".tolist()", _thunk(lambda x, m: x.tolist()), ("Tensor.tolist",)),
    Case("int(dev)", _thunk(lambda x, m: int(x[2])), ("aten._local_scalar_dense.default",)),
    Case("float(dev)", _thunk(lambda x, m: float(x[2])), ("aten._local_scalar_dense.default",)),
    Case("`if dev:`", _thunk(lambda x, m: 1 if x.any() else 0), ("aten._local_scalar_dense.default",)),
    Case(".numpy()", _thunk(lambda x, m: x.numpy()), ("Tensor.numpy",), not_on_cpu=NUMPY_VIEW),
    Case("np.asarray(dev)", _thunk(lambda x, m: np.asarray(x)), ("Tensor.__array__",), not_on_cpu=NUMPY_VIEW),
    Case("masked_select", _thunk(lambda x, m: torch.masked_select(x, m)), ("aten.masked_select.default",)),
    Case("dev[dev_mask]", _thunk(lambda x, m: x[m]), ("aten.index.Tensor",)),
    Case(
        "dev[dev_mask] = dev_values",
        _thunk(lambda x, m: x.__setitem__(m, x[:4])),
        ("aten.index_put_.default",),
    ),
    Case("dev[dev_index] = scalar", _thunk(lambda x, m: x.__setitem__(x[:2], 0)), ("Tensor.__setitem__",)),
    Case(
        "dev[dev_mask] = dev_0dim",
        _thunk(lambda x, m: x.__setitem__(m, x[1].clone())),
        ("aten.index_put_.default",),
    ),
    Case("torch.where(cond)", _thunk(lambda x, m: torch.where(m)), ("aten.nonzero.default",)),
    Case(
        "argwhere", _thunk(lambda x, m: torch.argwhere(m)), ("aten.argwhere.default", "aten.nonzero.default")
    ),
    Case("unique", _thunk(lambda x, m: torch.unique(x)), ("aten._unique2.default",)),
    Case(
        "unique_consecutive",
        _thunk(lambda x, m: torch.unique_consecutive(x)),
        ("aten.unique_consecutive.default",),
    ),
    Case("equal", _thunk(lambda x, m: torch.equal(x, x + 0)), ("aten.equal.default",)),
    Case(
        "allclose",
        _thunk(lambda x, m: torch.allclose(x.float(), x.float() + 0)),
        ("aten.allclose.default", "aten._local_scalar_dense.default"),
    ),
    Case("histc without a range", _thunk(lambda x, m: torch.histc(x.float())), ("aten.histc.default",)),
    Case(  # 13 or more test elements for 8 elements: torch's sorting path, which calls unique on both
        "isin with many test elements",
        _thunk(lambda x, m: torch.isin(x, torch.arange(13, device=x.device))),
        ("aten.isin.Tensor_Tensor",),
    ),
    Case(  # (CUDA's debug mode: assume_unique skips unique, yet its sorting path still synchronises)
        "isin with many test elements, assume_unique",
        _thunk(lambda x, m: torch.isin(x, torch.arange(64, device=x.device), assume_unique=True)),
        ("aten.isin.Tensor_Tensor",),
    ),
    Case(
        "isin of a scalar with many test elements",
        _thunk(lambda x, m: torch.isin(3, torch.arange(16, device=x.device))),
        ("aten.isin.Scalar_Tensor",),
    ),
    Case(
        "one_hot without num_classes",
        _thunk(lambda x, m: torch.nn.functional.one_hot(x)),
        ("aten.one_hot.default", "aten._local_scalar_dense.default"),
    ),
    Case("dev[dev_0dim]", _thunk(lambda x, m: x[x[2]]), ("aten._local_scalar_dense.default",)),
    Case(
        "narrow(start=dev)",
        _thunk(lambda x, m: torch.narrow(x, 0, x[1], 2)),
        ("aten._local_scalar_dense.default",),
    ),
    Case("arange(dev_0dim)", _thunk(lambda x, m: torch.arange(x[3])), ("aten._local_scalar_dense.default",)),
    Case("dev[python_list]", _thunk(lambda x, m: x[[0, 2]]), ("Tensor.__getitem__",)),
    Case("dev[numpy_array]", _thunk(lambda x, m: x[np.array([0, 2])]), ("Tensor.__getitem__",)),
    Case(
        "dev[host_bool_mask] = scalar",
        lambda b: (lambda x, hm: lambda: x.__setitem__(hm, 0))(vec(b), torch.arange(8) % 3 == 0),
        ("Tensor.__setitem__",),
        not_on_cpu=NO_HOST,
    ),
    Case("dev[python_list] = scalar", _thunk(lambda x, m: x.__setitem__([0, 2], 0)), ("Tensor.__setitem__",)),
    Case("torch.as_tensor(np, device=dev)", _tensor_from_numpy_device, ("torch.as_tensor",)),
    Case("dev.new_tensor(list)", _thunk(lambda x, m: x.new_tensor([1, 2])), ("Tensor.new_tensor",)),
    Case(".to(dev) blocking H2D", _blocking_h2d, ("aten._to_copy.default",), not_on_cpu=NO_HOST),
    Case("dev.copy_(host) blocking", _blocking_copy_, ("aten.copy_.default",), not_on_cpu=NO_HOST),
    Case("dev[a:b] = host_tensor", _setitem_slice_host_tensor, ("aten.copy_.default",), not_on_cpu=NO_HOST),
    Case(
        "dev[dev_mask] = host_values",
        _host_values_through_dev_mask,
        ("aten.index_put_.default",),
        not_on_cpu=NO_HOST,
    ),
    Case(".to('cpu')", _d2h_to, ("aten._to_copy.default",), not_on_cpu=NO_HOST),
    Case("host.copy_(dev)", _d2h_copy_, ("aten.copy_.default",), not_on_cpu=NO_HOST),
    Case(
        ".to('cpu', non_blocking=True)",
        _d2h_non_blocking,
        ("aten._to_copy.default",),
        kind="race",
        not_on_cpu=NO_HOST,
    ),
    Case(
        "non-blocking copy_ from non-contiguous host",
        _pageable_non_contiguous,
        ("aten.copy_.default",),
        kind="pageable-copy",
        not_on_cpu=NO_HOST,
    ),
    Case(
        "non-blocking copy_ broadcasting a host tensor",
        _broadcast_from_host,
        ("aten.copy_.default",),
        kind="pageable-copy",
        not_on_cpu=NO_HOST,
    ),
]


@pytest.mark.parametrize("case", LEFT_COLUMN + FAMILY, ids=lambda c: c.name)
def test_blocking_op_is_caught(case: Case, backend: Backend) -> None:
    if case.not_on_cpu and backend.device.type == "cpu":
        pytest.skip(case.not_on_cpu)
    thunk = case.make(backend)
    with pytest.raises(DeviceSyncError) as info, backend.audit():
        thunk()
    err = info.value
    assert err.op in case.ops, str(err)
    assert err.kind == case.kind, str(err)
    assert err.frame is not None and err.frame.filename == __file__, str(err)


# --- 12.3, right column: does not block ---------------------------------------------------------


def _pinned_h2d_copy_(b: Backend) -> Thunk:
    dst = torch.empty(8, dtype=torch.int32, device=b.device)
    src = b.pinned(torch.from_numpy(np.arange(8, dtype=np.int64)))
    return lambda: dst.copy_(src, non_blocking=True)  # int64 -> int32 on the way


def _pinned_h2d_to(b: Backend) -> Thunk:
    src = b.pinned(torch.from_numpy(np.arange(8, dtype=np.int64)))
    return lambda: src.to(b.device, dtype=torch.int32, non_blocking=True)


def _tensor_then_upload(b: Backend) -> Thunk:
    pin = b.device.type == "cuda"
    return lambda: torch.tensor([1, 2, 3], pin_memory=pin).to(b.device, non_blocking=True)


def _host_bool_mask(b: Backend) -> Thunk:
    x, host_mask = vec(b), torch.arange(8) % 3 == 0
    return lambda: x[host_mask]


def _bucketize_scatter_add(b: Backend) -> Thunk:
    x, bounds = vec(b), torch.arange(0, 8, 3, device=b.device)
    counts = torch.zeros(4, dtype=torch.int64, device=b.device)
    return lambda: counts.scatter_add_(0, torch.bucketize(x, bounds), torch.ones_like(x))


def _cumsum_out(b: Backend) -> Thunk:
    x, out = vec(b), torch.empty(8, dtype=torch.int64, device=b.device)
    return lambda: torch.cumsum(x, 0, out=out)


def _index_fill_cached(b: Backend) -> Thunk:
    x, idx = vec(b), b.pinned(torch.tensor([1, 5])).to(b.device, non_blocking=True)
    return lambda: x.index_fill_(0, idx, -1)


RIGHT_COLUMN = [
    Case("pinned non-blocking copy_ int64->int32", _pinned_h2d_copy_, ()),
    Case("pinned non-blocking .to int64->int32", _pinned_h2d_to, ()),
    Case("torch.tensor(..., pin_memory).to(dev, non_blocking)", _tensor_then_upload, ()),
    Case("dev[a:] = scalar", _thunk(lambda x, m: x.__setitem__(slice(3, None), 0)), ()),
    Case("fill_", _thunk(lambda x, m: x.fill_(3)), ()),
    Case("dev[host_bool_mask]", _host_bool_mask, (), not_on_cpu=NO_HOST),
    Case("dev[dev_index]", _thunk(lambda x, m: x[x[:3]]), ()),
    Case("dev2d[dev_index_2d]", _thunk(lambda x, m: x.view(2, 4)[x[:2], x[2:4] % 4]), ()),
    Case("gather", _thunk(lambda x, m: torch.gather(x, 0, x.flip(0))), ()),
    Case("where(cond, a, b)", _thunk(lambda x, m: torch.where(m, x, -x)), ()),
    Case(
        "full/arange on device",
        lambda b: lambda: (torch.full((4,), 7, device=b.device), torch.arange(4, device=b.device)),
        (),
    ),
    Case("torch.any without bool", _thunk(lambda x, m: torch.any(m)), ()),
    Case("bucketize + scatter_add_", _bucketize_scatter_add, ()),
    Case("split", _thunk(lambda x, m: torch.split(x, [3, 5])), ()),
    Case("cumsum(out=)", _cumsum_out, ()),
    Case("nonzero_static", _thunk(lambda x, m: torch.nonzero_static(x, size=8)), ()),
    Case("masked_fill", _thunk(lambda x, m: x.masked_fill(m, 0)), ()),
    Case("dev[dev_mask] = scalar (a masked fill)", _thunk(lambda x, m: x.__setitem__(m, 0)), ()),
    Case("dev2d[int] = scalar (a row fill)", _thunk(lambda x, m: x.view(2, 4).__setitem__(1, 0)), ()),
    Case("index_fill_ with a device index", _index_fill_cached, ()),
    Case(
        "dev[dev_index] = dev_values", _thunk(lambda x, m: x.__setitem__(x[:3].clone(), x[3:6].clone())), ()
    ),
    Case(
        "index_put_(dev_index, dev_0dim)",
        _thunk(lambda x, m: x.index_put_((x[:3].clone(),), x[1].clone())),
        (),
    ),
    Case(
        "dev[host_bool_mask] = dev_values",
        lambda b: (lambda x, hm: lambda: x.__setitem__(hm, x[:3].clone()))(vec(b), torch.arange(8) % 3 == 0),
        (),
        not_on_cpu=NO_HOST,
    ),
    Case(
        "repeat_interleave with output_size",
        _thunk(lambda x, m: torch.repeat_interleave(x, x, output_size=28)),
        (),
    ),
    Case("histc with a range", _thunk(lambda x, m: torch.histc(x.float(), bins=4, min=0, max=8)), ()),
    Case("isin with few test elements", _thunk(lambda x, m: torch.isin(x, torch.arange(12, device=x.device))), ()),
    Case(  # (CUDA's debug mode: unsafe skips the host checks of the lengths; with them it synchronises)
        "segment_reduce with device lengths, unsafe",
        _thunk(lambda x, m: torch.segment_reduce(x.float(), "sum", lengths=x[:2], unsafe=True)),
        (),
    ),
    Case("one_hot with num_classes", _thunk(lambda x, m: torch.nn.functional.one_hot(x, 8)), ()),
    Case("device arithmetic and reductions", _thunk(lambda x, m: (x * 2 + 1).sum() + x.max()), ()),
    Case("empty host copy", lambda b: lambda: torch.empty(0, dtype=torch.int64).to(b.device), ()),
    Case(
        "numpy view of a CPU staging tensor", lambda b: lambda: torch.zeros(4).numpy().__setitem__(0, 1.0), ()
    ),
]


@pytest.mark.parametrize("case", RIGHT_COLUMN, ids=lambda c: c.name)
def test_non_blocking_op_is_not_flagged(case: Case, backend: Backend) -> None:
    if case.not_on_cpu and backend.device.type == "cpu":
        pytest.skip(case.not_on_cpu)
    if case.name == "one_hot with num_classes" and backend.device.type == "cpu":
        pytest.skip("torch's CPU one_hot validates its input with .item(); the CUDA path does not")
    thunk = case.make(backend)
    with backend.audit():
        thunk()


def test_d2h_non_blocking_allowed_on_request(backend: Backend) -> None:
    if backend.device.type == "cpu":
        pytest.skip(NO_HOST)
    x = vec(backend)
    with backend.audit(allow_async_d2h=True):
        if backend.device.type == "meta":
            # Not a DeviceSyncError: torch's own "no data" error, because the audit let it through.
            with pytest.raises(NotImplementedError):
                x.to("cpu", non_blocking=True)
        else:
            out = x.to("cpu", non_blocking=True)
    if backend.device.type == "cuda":
        assert out.is_pinned()


def test_small_pageable_upload_is_a_copy_problem_not_a_sync(backend: Backend) -> None:
    """12.3: a 16 KB pageable non-blocking upload did not block, but larger ones can (vllm#53491)."""
    if backend.device.type != "cuda":
        pytest.skip("pinned memory exists only with CUDA; meta/cpu uploads are not checked for pinning")
    host = torch.zeros(4096, dtype=torch.int32)  # 16 KB, pageable
    with pytest.raises(DeviceSyncError) as info, backend.audit():
        host.to(backend.device, non_blocking=True)
    assert info.value.kind == "pageable-copy"
    with backend.audit(check_copies=False):
        host.to(backend.device, non_blocking=True)


@allow_device_sync()  # "outside": even under --attnmeta-sync-audit --attnmeta-sync-devices=cpu
def test_outside_the_audit_nothing_is_flagged() -> None:
    x = torch.arange(8)
    with no_device_sync(devices={"cpu"}), allow_device_sync():
        assert x.nonzero().shape == (7, 1)
    assert x.sum().item() == 28
