"""attnmeta.worker.HostWorker: a call runs on the worker's thread and returns or raises as it would in
place; the caller's sync audit and inference mode apply to it; one thread at a time; closing and
dropping the worker stop its thread; and a step composer given a worker builds the same steps, field
for field, with the same errors."""

from __future__ import annotations

import gc
import os
import threading
import weakref
from typing import Any

import numba
import numpy as np
import pytest
import torch
from compose_helpers import counts_arguments
from test_compose import assert_same

from attnmeta import Stager
from attnmeta.backends.flash_attn import FLASH_ATTN
from attnmeta.backends.flashinfer import FLASHINFER
from attnmeta.compose import Array, Group, StepBuilder
from attnmeta.sync import DeviceSyncError, no_device_sync, record_device_syncs
from attnmeta.testing.workloads import advance, decode_spec, mixed_spec
from attnmeta.worker import HostWorker


@pytest.fixture
def worker() -> Any:
    with HostWorker() as w:
        yield w


def test_a_call_runs_on_the_worker_thread_and_returns_its_result(worker: HostWorker) -> None:
    assert worker.threaded
    assert worker.call(sum, [1, 2, 3]) == 6
    assert worker.call(lambda: threading.current_thread().name) == "attnmeta-host-worker"
    assert worker.call(threading.get_ident) != threading.get_ident()
    assert worker.call(dict, a=1) == {"a": 1}
    assert worker.calls == 4


def test_what_the_call_raises_reaches_the_caller(worker: HostWorker) -> None:
    with pytest.raises(ZeroDivisionError):
        worker.call(lambda: 1 // 0)
    with pytest.raises(KeyboardInterrupt):  # (a BaseException too)
        worker.call(_raise, KeyboardInterrupt())
    assert worker.call(int, "7") == 7  # and the worker serves the next call


def _raise(e: BaseException) -> None:
    raise e


def test_the_callers_sync_audit_polices_the_call(worker: HostWorker) -> None:
    x = torch.arange(4)
    with record_device_syncs(devices={"cpu"}) as found:
        total = worker.call(lambda: x.sum().item())
    assert total == 6
    assert [e.op for e in found] == ["aten._local_scalar_dense.default"]
    with pytest.raises(DeviceSyncError), no_device_sync(devices={"cpu"}):
        worker.call(lambda: x.max().item())
    worker.call(lambda: x.max().item())  # no audit outside the block: nothing armed on the worker


def test_the_callers_inference_mode_applies_to_the_call(worker: HostWorker) -> None:
    assert worker.call(torch.is_inference_mode_enabled) is False
    with torch.inference_mode():
        assert worker.call(torch.is_inference_mode_enabled) is True
        made = worker.call(torch.zeros, 3)
    assert made.is_inference()


def test_one_thread_at_a_time(worker: HostWorker) -> None:
    entered, release = threading.Event(), threading.Event()

    def hold() -> str:
        entered.set()
        release.wait()
        return "held"

    got: list[str] = []
    t = threading.Thread(target=lambda: got.append(worker.call(hold)))
    t.start()
    entered.wait()
    try:
        with pytest.raises(RuntimeError, match="one thread at a time"):
            worker.call(int, "1")
    finally:
        release.set()
        t.join()
    assert got == ["held"]
    assert worker.call(int, "2") == 2


def test_a_call_from_the_worker_thread_runs_in_place(worker: HostWorker) -> None:
    assert worker.call(lambda: worker.call(threading.get_ident)) == worker.call(threading.get_ident)


def test_close_stops_the_thread_and_refuses_later_calls() -> None:
    w = HostWorker()
    thread = w._thread
    assert thread is not None and thread.is_alive()
    w.close()
    assert w.closed and not thread.is_alive()
    w.close()  # (twice: nothing)
    with pytest.raises(RuntimeError, match="closed"):
        w.call(int, "1")
    assert "closed" in repr(w)


def test_dropping_the_worker_stops_its_thread() -> None:
    w = HostWorker()
    thread = w._thread
    assert thread is not None
    ref = weakref.ref(w)
    del w
    gc.collect()
    assert ref() is None
    thread.join(timeout=30)
    assert not thread.is_alive()


def test_pinned_to_a_cpu() -> None:
    cpu = sorted(os.sched_getaffinity(0))[-1]
    with HostWorker(cpu=cpu) as w:
        assert w.call(os.sched_getaffinity, 0) == {cpu}
        assert f"cpu={cpu}" in repr(w)


@pytest.mark.parametrize("bad", [-1, True, 1.0, 10**6])
def test_a_cpu_that_is_none_of_this_machines_is_refused(bad: Any) -> None:
    with pytest.raises(ValueError, match="CPU"):
        HostWorker(cpu=bad)


@pytest.mark.parametrize("bad", [-0.1, "1", float("nan")])
def test_spin_must_be_seconds(bad: Any) -> None:
    with pytest.raises(ValueError, match="spin_s"):
        HostWorker(spin_s=bad)


def test_without_compiled_polling_calls_run_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(numba.config, "DISABLE_JIT", True)
    w = HostWorker()
    assert not w.threaded and w._thread is None
    assert w.call(threading.get_ident) == threading.get_ident()
    assert "in place" in repr(w)


# ------------------------------------------------------------------ a step composer on a worker
def _composers(worker: HostWorker | None) -> StepBuilder:
    return StepBuilder(Stager("cpu", num_slots=2), Group({"fa": FLASH_ATTN, "fi": FLASHINFER}),
                       arrays=[Array("engine.input_ids", np.int32)], worker=worker)


def test_a_composer_on_a_worker_builds_the_same_steps(worker: HostWorker) -> None:
    rng = np.random.default_rng(5)
    steps = [*advance(decode_spec(6, rng), 5), mixed_spec(rng), *advance(decode_spec(9, rng), 4)]
    here, there = _composers(None), _composers(worker)
    for k, spec in enumerate(steps):
        ids = {"engine.input_ids": np.arange(spec.num_tokens, dtype=np.int32)}
        args, kw = counts_arguments(spec)
        want = here.build_counts(*args, **kw, arrays=ids) if k % 2 else here.build(spec, arrays=ids)
        got = there.build_counts(*args, **kw, arrays=ids) if k % 2 else there.build(spec, arrays=ids)
        assert_same(got.commons, want.commons, f"step {k}: commons")
        assert_same(got.metadata, want.metadata, f"step {k}: metadata")
        assert_same(got.arrays, want.arrays, f"step {k}: arrays")
    assert there.stats == here.stats and there.stats.replayed > 0
    assert worker.calls == len(steps)
    assert "worker=HostWorker(" in repr(there)


def test_a_composer_on_a_worker_raises_the_same_errors(worker: HostWorker) -> None:
    spec = decode_spec(4, np.random.default_rng(1))
    there = _composers(worker)
    with pytest.raises(TypeError, match=r"engine\.input_ids"):
        there.build(spec, arrays={"engine.input_ids": np.zeros(4, np.int64)})
    with pytest.raises(TypeError, match="expected a BatchSpec"):
        there.build([object()])  # type: ignore[list-item]
    ok = there.build(spec, arrays={"engine.input_ids": np.zeros(4, np.int32)})  # (the stager is ready again)
    assert ok.common.num_reqs == 4


def test_a_composer_refuses_what_is_not_a_worker() -> None:
    with pytest.raises(TypeError, match="HostWorker"):
        StepBuilder(Stager("cpu"), Group({"fa": FLASH_ATTN}), worker=object())  # type: ignore[arg-type]
