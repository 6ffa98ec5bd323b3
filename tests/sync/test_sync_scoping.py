"""Scoping of the sync audit: nesting, allow blocks, threads, asyncio tasks, the error's location,
the torch mode stacks, and the per-thread conversion of torch's CUDA sync debug mode warnings."""

from __future__ import annotations

import asyncio
import pickle
import sys
import threading
import warnings
from collections.abc import AsyncIterator, Iterator

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from attnmeta.sync import (
    DeviceSyncError,
    _cuda,
    _dispatch,
    _state,
    allow_device_sync,
    current_audit,
    no_device_sync,
    record_device_syncs,
)

CPU = {"cpu"}


def _read() -> float:
    """A host read of a CPU tensor: a sync whenever CPU tensors are declared device data."""
    return torch.ones(3).sum().item()


@allow_device_sync()  # start from "not audited", even under --attnmeta-sync-audit
def test_nesting_and_allow() -> None:
    outer = current_audit()
    with no_device_sync(devices=CPU):
        with pytest.raises(DeviceSyncError):
            _read()
        with allow_device_sync():
            assert _read() == 3.0  # suspended
            with no_device_sync(devices=CPU), pytest.raises(DeviceSyncError):
                _read()  # re-armed inside allow
            assert _read() == 3.0  # suspended again
        with no_device_sync():  # inner settings replace the outer ones: cpu is host data here
            assert _read() == 3.0
        with pytest.raises(DeviceSyncError):
            _read()  # the outer settings are back
    assert _read() == 3.0
    assert current_audit() is outer


def test_record_collects_and_lets_the_ops_run() -> None:
    outer = current_audit()
    x = torch.arange(6)
    with record_device_syncs(devices=CPU) as found:
        assert x.nonzero().shape == (5, 1)
        assert x.tolist() == [0, 1, 2, 3, 4, 5]
        with allow_device_sync():
            _read()  # not recorded
        with no_device_sync(devices=CPU), pytest.raises(DeviceSyncError):
            _read()  # an inner no_device_sync raises
        assert current_audit() is not None
    assert [(e.op, e.kind) for e in found] == [("aten.nonzero.default", "sync"), ("Tensor.tolist", "sync")]
    assert all(e.frame is not None and e.frame.filename == __file__ for e in found)
    assert current_audit() is outer


def test_usable_as_decorator() -> None:
    @no_device_sync(devices=CPU)
    def build() -> float:
        return _read()

    outer = current_audit()
    for _ in range(2):  # each call arms afresh
        with pytest.raises(DeviceSyncError):
            build()
    assert current_audit() is outer


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="cuda_mode"), no_device_sync(cuda_mode="loud"):  # type: ignore[arg-type]
        pass
    with pytest.raises(ValueError, match="not a device type"), no_device_sync(devices={"gpu0"}):
        pass
    with no_device_sync(devices="cpu") as audit:  # a single device type is accepted as is
        assert audit.devices == frozenset({"cpu", "cuda", "meta"})


def test_error_names_the_op_and_this_line() -> None:
    x = torch.arange(4, device="meta")
    line = sys._getframe().f_lineno + 2
    with pytest.raises(DeviceSyncError) as info, no_device_sync():
        x.nonzero()
    err = info.value
    assert err.op == "aten.nonzero.default"
    assert err.kind == "sync"
    assert err.frame is not None
    assert (err.frame.filename, err.frame.lineno, err.frame.name) == (
        __file__,
        line,
        "test_error_names_the_op_and_this_line",
    )
    message = str(err)
    assert message.startswith("aten.nonzero.default at ")
    assert f"test_sync_scoping.py:{line} in test_error_names_the_op_and_this_line: `x.nonzero()`" in message
    assert "allow_device_sync" in message
    clone = pickle.loads(pickle.dumps(err))
    assert (type(clone), str(clone), clone.op, clone.kind) == (DeviceSyncError, message, err.op, err.kind)
    assert isinstance(err, RuntimeError)


def test_error_points_at_the_caller_of_torch_python_code() -> None:
    """torch.unique is Python code in torch/functional.py; the frame is still this file."""
    x = torch.arange(4, device="meta")
    line = sys._getframe().f_lineno + 2
    with pytest.raises(DeviceSyncError) as info, no_device_sync():
        torch.unique(x)
    assert info.value.frame is not None and info.value.frame.lineno == line


def test_threads_are_scoped() -> None:
    """An audit armed in one thread does not police another, and the other way round."""
    armed, probed = threading.Event(), threading.Event()
    results: dict[str, object] = {}

    def audited() -> None:
        with no_device_sync(devices=CPU):
            armed.set()
            probed.wait(10)
            try:
                _read()
                results["audited"] = "no error"
            except DeviceSyncError as e:
                results["audited"] = e.op

    def free() -> None:
        armed.wait(10)
        results["free"] = _read()  # while the other thread's audit is armed
        probed.set()

    threads = [threading.Thread(target=audited), threading.Thread(target=free)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert results == {"audited": "aten._local_scalar_dense.default", "free": 3.0}

    # armed here, not in a fresh thread
    with no_device_sync(devices=CPU):
        out: list[float] = []
        worker = threading.Thread(target=lambda: out.append(_read()))
        worker.start()
        worker.join(10)
        assert out == [3.0]
        with pytest.raises(DeviceSyncError):
            _read()


@allow_device_sync()  # tasks inherit the context: start from "not audited"
def test_asyncio_tasks_are_scoped() -> None:
    async def main() -> dict[str, object]:
        results: dict[str, object] = {}
        armed, probed = asyncio.Event(), asyncio.Event()

        async def audited() -> None:
            with no_device_sync(devices=CPU):
                armed.set()
                await probed.wait()
                try:
                    _read()
                    results["audited"] = "no error"
                except DeviceSyncError as e:
                    results["audited"] = e.op
                # a task started inside the block inherits the audit
                child = asyncio.create_task(asyncio.to_thread(lambda: None))
                await child
                results["child"] = await asyncio.create_task(_inherits())

        async def free() -> None:
            await armed.wait()
            results["free"] = _read()  # same thread, other task, while `audited` is armed
            probed.set()

        async def _inherits() -> bool:
            return current_audit() is not None

        await asyncio.gather(audited(), free())
        return results

    assert asyncio.run(main()) == {"audited": "aten._local_scalar_dense.default", "free": 3.0, "child": True}


@allow_device_sync()
def test_interleaved_task_exits_leave_the_mode_stacks_clean() -> None:
    """asyncio blocks need not nest: A enters, B enters, A exits, B exits."""
    dispatch_before, function_before = (
        torch._C._len_torch_dispatch_stack(),
        torch._C._len_torch_function_stack(),
    )

    async def main() -> None:
        a_in, b_in, a_out = asyncio.Event(), asyncio.Event(), asyncio.Event()

        async def a() -> None:
            with no_device_sync(devices=CPU):
                a_in.set()
                await b_in.wait()
            a_out.set()

        async def b() -> None:
            await a_in.wait()
            with no_device_sync(devices=CPU):
                b_in.set()
                await a_out.wait()
                with pytest.raises(DeviceSyncError):
                    _read()  # still armed after A left

        await asyncio.gather(a(), b())

    asyncio.run(main())
    assert torch._C._len_torch_dispatch_stack() == dispatch_before
    assert torch._C._len_torch_function_stack() == function_before
    assert _read() == 3.0


class _Counting(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.calls += 1
        return func(*args, **(kwargs or {}))


def test_a_mode_entered_inside_and_left_open_survives() -> None:
    """The audit removes only its own modes, even when another mode sits above them."""
    if _state.THREAD.depth:
        pytest.skip("an enclosing audit (--attnmeta-sync-audit) keeps the audit's modes installed")
    depth = torch._C._len_torch_dispatch_stack()
    other = _Counting()
    audit = no_device_sync(devices=CPU)
    audit.__enter__()
    other.__enter__()
    audit.__exit__(None, None, None)  # out of order: `other` is above the audit's modes
    try:
        stack = [torch._C._get_dispatch_stack_at(i) for i in range(torch._C._len_torch_dispatch_stack())]
        assert other in stack
        assert not any(isinstance(m, _dispatch.DispatchAudit) for m in stack)
        assert _read() == 3.0  # no audit
        assert other.calls > 0
    finally:
        other.__exit__(None, None, None)
    assert torch._C._len_torch_dispatch_stack() == depth


def test_fake_tensor_mode_inside_the_audit() -> None:
    """An infra mode (FakeTensorMode) below the audit still works, and reads are still caught."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with no_device_sync(devices=CPU), FakeTensorMode():
        y = torch.ones(3) * 2
        assert y.shape == (3,)


# --- torch's CUDA sync debug mode, simulated where no GPU is present ---------------------------

SYNC_WARNING = "called a synchronizing CUDA operation (Triggered internally at c10/cuda/CUDAFunctions.cpp:1.)"


@pytest.fixture
def fake_cuda_debug_mode(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Pretend CUDA is present: record set_sync_debug_mode calls instead of making them.

    The tests using it call :func:`_no_enclosing_cuda_audit` first: a session-wide audit holds the
    real debug mode during the test body (not during fixture setup).
    """
    modes = [0]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: modes[-1])
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda m: modes.append(int(m)))
    monkeypatch.setattr(_cuda, "patch_explicit_syncs", lambda: None)
    yield modes


def _no_enclosing_cuda_audit() -> None:
    if _cuda.CudaDebug.users:
        pytest.skip("an enclosing audit (--attnmeta-sync-audit) holds the real CUDA debug mode")


def _torch_sync_warning() -> None:
    """What torch's debug mode does in "warn" mode: a UserWarning from the C++ side."""
    warnings.warn(SYNC_WARNING, UserWarning, stacklevel=2)


def test_cuda_debug_mode_is_reference_counted(fake_cuda_debug_mode: list[int]) -> None:
    _no_enclosing_cuda_audit()
    with no_device_sync():
        assert fake_cuda_debug_mode == [0, 1]  # armed as "warn" process-wide
        with no_device_sync():
            assert fake_cuda_debug_mode == [0, 1]  # counted, not re-armed
        with no_device_sync(cuda_mode="off"):
            pass
        assert fake_cuda_debug_mode == [0, 1]
    assert fake_cuda_debug_mode == [0, 1, 0]  # restored when the count drops to 0
    assert _cuda.CudaDebug.users == 0


def test_cuda_debug_mode_already_on_is_left_alone(fake_cuda_debug_mode: list[int]) -> None:
    _no_enclosing_cuda_audit()
    fake_cuda_debug_mode.append(2)  # the process runs torch's "error" mode itself
    with no_device_sync():
        pass
    assert fake_cuda_debug_mode == [0, 2]


def test_cuda_sync_warning_becomes_an_error_only_where_armed(fake_cuda_debug_mode: list[int]) -> None:
    _no_enclosing_cuda_audit()
    seen: dict[str, object] = {}

    def other_thread() -> None:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _torch_sync_warning()  # not audited: swallowed (it did not ask for the debug mode)
        seen["other"] = [str(w.message) for w in caught]

    with no_device_sync():
        for _ in range(2):  # the same line twice: never deduplicated away
            line = sys._getframe().f_lineno + 2
            with pytest.raises(DeviceSyncError) as info:
                warnings.warn(SYNC_WARNING, UserWarning, stacklevel=1)
            assert info.value.op == "cuda-sync-debug-mode"
            assert info.value.frame is not None and info.value.frame.lineno == line
        # pytest's own warning capture does this around every test
        with warnings.catch_warnings(record=True), pytest.raises(DeviceSyncError):
            _torch_sync_warning()
        with allow_device_sync(), warnings.catch_warnings(record=True) as caught:
            _torch_sync_warning()
        assert caught == []  # suspended: swallowed too
        t = threading.Thread(target=other_thread)
        t.start()
        t.join(10)
        with no_device_sync(cuda_mode="warn"), pytest.warns(UserWarning, match="synchronizing CUDA"):
            _torch_sync_warning()
        with record_device_syncs() as found:
            _torch_sync_warning()  # recorded, not raised, not shown
        assert [e.op for e in found] == ["cuda-sync-debug-mode"]
    assert seen == {"other": []}
    # Once nothing is armed, the hook passes torch's warnings (and all others) through.
    with pytest.warns(UserWarning, match="synchronizing CUDA"):
        _torch_sync_warning()


def test_cuda_error_mode_set_by_the_process_is_reraised(monkeypatch: pytest.MonkeyPatch) -> None:
    """If torch raises itself ("error" mode), the dispatch mode re-raises as DeviceSyncError."""

    def raising(*args: object, **kwargs: object) -> None:
        raise RuntimeError("called a synchronizing CUDA operation")

    with no_device_sync(cuda_mode="error"):
        mode = _dispatch.DispatchAudit()
        with pytest.raises(DeviceSyncError, match="sync debug mode") as info:
            mode.__torch_dispatch__(raising, (), (torch.ones(1),), {})
        assert isinstance(info.value.__cause__, RuntimeError)


def test_explicit_synchronize_is_flagged(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    class FakeEvent:
        def synchronize(self) -> None:
            calls.append("event")

    class FakeStream:
        def synchronize(self) -> None:
            calls.append("stream")

    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append("device"))
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    if hasattr(torch, "accelerator"):
        monkeypatch.setattr(torch.accelerator, "synchronize", lambda device=None: calls.append("acc"))
    monkeypatch.setattr(_cuda, "PATCHED_SYNCS", {})
    _cuda.patch_explicit_syncs()
    with allow_device_sync():
        torch.cuda.synchronize()  # not armed: passes through
    with no_device_sync():
        with pytest.raises(DeviceSyncError, match=r"torch\.cuda\.synchronize"):
            torch.cuda.synchronize()
        with pytest.raises(DeviceSyncError, match=r"Event\.synchronize"):
            torch.cuda.Event().synchronize()
        with pytest.raises(DeviceSyncError, match=r"Stream\.synchronize"):
            torch.cuda.Stream().synchronize()
        with no_device_sync(cuda_mode="off"):
            torch.cuda.Event().synchronize()
    assert calls == ["device", "event"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the CPU tests simulate it)")
def test_real_cuda_debug_mode_is_scoped(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the dispatch rule for .item() switched off, torch's debug mode still catches it."""
    monkeypatch.setitem(_dispatch.RULE_CACHE, torch.ops.aten._local_scalar_dense.default, None)
    x = torch.arange(8, device="cuda")
    before = torch.cuda.get_sync_debug_mode()
    results: dict[str, object] = {}

    def other_thread() -> None:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            results["value"] = x.sum().item()
        results["warnings"] = [str(w.message) for w in caught if "synchroniz" in str(w.message)]

    with no_device_sync():
        line = sys._getframe().f_lineno + 2
        with pytest.raises(DeviceSyncError) as info:
            x.sum().item()
        assert info.value.op == "cuda-sync-debug-mode"
        assert "aten._local_scalar_dense" in str(info.value)
        assert info.value.frame is not None and info.value.frame.lineno == line
        with allow_device_sync():
            assert x.sum().item() == 28
        t = threading.Thread(target=other_thread)
        t.start()
        t.join(30)
    assert results == {"value": 28, "warnings": []}
    assert torch.cuda.get_sync_debug_mode() == before


# ------------------------------------------------------------------------------------------------
# found by an adversarial review


def test_the_decorators_refuse_generator_and_async_functions() -> None:
    """``@no_device_sync()`` on a generator or an ``async def`` audited nothing: the block ended when the
    call returned the generator or coroutine, before the body ran."""
    from attnmeta.sync import allow_device_sync

    def gen() -> Iterator[int]:
        yield 1

    async def coro() -> None:
        return None

    async def agen() -> AsyncIterator[int]:
        yield 1

    for scope in (no_device_sync(devices={"cpu"}), allow_device_sync()):
        for fn in (gen, coro, agen):
            with pytest.raises(TypeError, match=r"is a generator or async function"):
                scope(fn)

    @no_device_sync(devices={"cpu"})
    def plain(t: torch.Tensor) -> int:
        return int(t.sum())

    with pytest.raises(DeviceSyncError):
        plain(torch.arange(3))
    assert current_audit() is None


def test_an_index_from_any_host_sequence_is_an_upload() -> None:
    """torch turns any non-tuple sequence used as an index into an index tensor (an upload): a list was
    flagged, a range, deque or array.array was not."""
    import array
    import collections

    dev = torch.arange(6, device="meta")
    value = torch.zeros(2, dtype=dev.dtype, device="meta")
    for index in (range(0, 3, 2), collections.deque([0, 2]), array.array("q", [0, 2]), (slice(None), range(2))):
        with no_device_sync(), pytest.raises(DeviceSyncError):
            dev[index]
        with no_device_sync(), pytest.raises(DeviceSyncError):
            dev[index] = value


def test_a_sync_error_the_target_catches_itself_is_still_counted() -> None:
    """``try: int(t.max()) except RuntimeError:`` swallowed the audit's error, so run_audit reported the
    target clean; outside the audit the try branch syncs."""
    from attnmeta.sync import register_audit_target, run_audit, unregister_audit_target

    def swallowing(device: torch.device, seed: int) -> None:
        t = torch.arange(seed + 2, device=device)
        try:
            int(t.max())
        except RuntimeError:  # (the mistake: the audit's error swallowed with the rest)
            return

    register_audit_target("swallowing", swallowing)
    try:
        (row,) = run_audit(devices=["meta"], batches=2, targets=["swallowing"])
    finally:
        unregister_audit_target("swallowing")
    assert (row.syncs, row.clean) == (2, False) and "caught inside the target" in (row.first_problem or "")


def test_an_empty_upload_is_not_a_sync() -> None:
    """Empty uploads copy nothing (as the copy checks already held for empty tensors) but were flagged;
    the same calls with data still are."""
    m = torch.zeros(4, device="meta")
    empty = (lambda: torch.tensor([], device="meta"), lambda: torch.as_tensor(np.empty(0), device="meta"),
             lambda: m.new_tensor([]), lambda: m[[]], lambda: m[np.empty(0, np.int64)], lambda: m.view(2, 2)[(slice(None), [])])
    full = (lambda: torch.tensor([1], device="meta"), lambda: torch.as_tensor(np.ones(1), device="meta"),
            lambda: m.new_tensor([1.0]), lambda: m[[1]], lambda: m[np.ones(1, np.int64)], lambda: m.view(2, 2)[(slice(None), [1])])
    for call in empty:
        with no_device_sync():
            call()
    for call in full:
        with no_device_sync(), pytest.raises(DeviceSyncError):
            call()


def test_a_block_closed_on_another_thread_raises_and_leaves_that_thread_whole() -> None:
    """A generator holding a ``no_device_sync()`` block, closed on another thread, popped that thread's
    audit state (its next block policed nothing) before failing to reset the block's context."""
    started, results = threading.Event(), {}

    def holder() -> Iterator[None]:
        with no_device_sync(devices={"cpu"}):
            yield

    gen = holder()

    def begin() -> None:  # thread A enters the block and keeps the generator suspended inside it
        next(gen)
        started.set()

    def close() -> None:  # thread B closes it, then audits code of its own
        with pytest.raises(RuntimeError, match="ended on another thread than the one it began on"):
            gen.close()
        with no_device_sync(devices={"cpu"}), pytest.raises(DeviceSyncError):
            int(torch.arange(3).sum())
        results["b"] = current_audit() is None

    a = threading.Thread(target=begin)
    a.start()
    a.join(10)
    assert started.is_set()
    b = threading.Thread(target=close)
    b.start()
    b.join(10)
    assert results == {"b": True}
