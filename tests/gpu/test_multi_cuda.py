"""Several GPUs: one derivation, one copy per device, fenced slot reuse, graphs on every device.

Runs where at least two CUDA devices are present (``bash benchmarks/gpu_all.sh OUT multi`` on the
nvidia-h200-x2 machine; docs/serving.md, "Several GPUs"); skipped elsewhere. Every loop runs under
``torch.cuda.set_sync_debug_mode("error")``: any synchronising call raises.

- :class:`~attnmeta.staging.MultiStager` on ``cuda:0`` and ``cuda:1``: a profiler trace shows one
  H2D copy per device per step and no synchronising call; a race test holds both devices' streams
  behind (fencing on: no corrupted step on either device; fencing off: the control sees corrupted
  steps); CUDA graphs captured on each device over its fixed arena replay correctly after later
  commits; the host time of a step against two independent stagers, in the same run.
- The shared ring: the writer on ``cuda:0`` in this process, a reader on ``cuda:1`` in a spawned
  process (segment registered with ``cudaHostRegister`` in both), its stream held behind: fencing on,
  no torn step; the control, torn steps. Receives make no synchronising call.
"""

from __future__ import annotations

import gc
import multiprocessing
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from audit_helpers import sync_error_mode

from attnmeta.profile import StaticProfile
from attnmeta.staging import MultiStager, Stager
from attnmeta.staging.shared import RingReader, RingWriter, SharedRing
from attnmeta.testing.multi import assert_replica, host_checksum, run_reader, run_writer, step_fields

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.device_count() < 2:  # pragma: no cover - CPU CI, one GPU
    pytest.skip("needs two CUDA devices (run on the nvidia-h200-x2 machine: benchmarks/gpu_all.sh OUT multi)",
                allow_module_level=True)

DEVICES = ["cuda:0", "cuda:1"]
_NAMES = ("qsl", "seq_lens", "slots", "mask")


def _checksum(views: list[torch.Tensor], weights: torch.Tensor) -> torch.Tensor:
    total = torch.zeros((), dtype=torch.int64, device=weights.device)
    for v in views:
        flat = v.reshape(-1).to(torch.int64)
        total = total + (flat * weights[: flat.shape[0]]).sum()
    return total


def _stage(multi: MultiStager, data: dict[str, np.ndarray], graph: bool = False) -> Any:
    with multi.step() as step:
        for name, arr in data.items():
            if graph:
                cap = 65 if name == "qsl" else (512 if name == "slots" else 64)
                step.alloc(name, arr.shape, arr.dtype, capacity=cap, fill=-1 if name == "slots" else 0)[...] = arr
            else:
                step.alloc(name, arr.shape, arr.dtype)[...] = arr
    return step


# ------------------------------------------------------------------------------------------ one process
def test_one_copy_per_device_per_step_and_no_sync() -> None:
    from torch.profiler import ProfilerActivity, profile

    multi = MultiStager(DEVICES)
    for n in range(1, 4):  # warm: first-use allocations, events
        _stage(multi, step_fields(n, 0))
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    steps = 50
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with sync_error_mode(), torch.profiler.record_function("attnmeta.steps"):
            for n in range(steps):
                step = _stage(multi, step_fields(100 + n, 0))
                for k in (0, 1):
                    multi.view(step.device("seq_lens"), k)
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
    events = prof.events()
    region = next(e for e in events if e.name == "attnmeta.steps")
    lo, hi = region.time_range.start, region.time_range.end
    per_device: dict[int, int] = {}
    for e in events:
        if "Memcpy HtoD" in e.name:
            per_device[e.device_index] = per_device.get(e.device_index, 0) + 1
    syncs = [e.name for e in events if "Synchronize" in e.name and e.name.startswith("cuda")
             and lo <= e.time_range.start <= hi]
    assert per_device == {0: steps, 1: steps}, per_device
    assert syncs == []
    assert [s.copies for s in multi.device_stats] == [steps + 3] * 2
    assert multi.stats.waits == 0


def _corrupted(multi: MultiStager, steps: int, hold_every: int, cycles: int) -> list[int]:
    """Random steps while both devices' streams are held behind every ``hold_every`` steps; per
    device, the steps whose device data differs from what the host staged."""
    weights = [torch.arange(1, 4097, dtype=torch.int64, device=d) for d in DEVICES]
    logs = [torch.zeros(steps, dtype=torch.int64, device=d) for d in DEVICES]
    expected = np.zeros(steps, dtype=np.uint64)
    with sync_error_mode():
        for i in range(steps):
            if i % hold_every == 0:
                for d in (0, 1):
                    with torch.cuda.device(d):
                        torch.cuda._sleep(cycles)
            data = step_fields(i + 1, 7)
            step = _stage(multi, data)
            expected[i] = np.uint64(host_checksum(list(data.values())))
            for k in (0, 1):
                with torch.cuda.device(k):
                    views = [multi.view(step.device(n), k) for n in data]
                    logs[k][i: i + 1].copy_(_checksum(views, weights[k]).view(1))
    return [int((lg.cpu().numpy().astype(np.uint64) != expected).sum()) for lg in logs]  # one sync each


def test_race_free_with_fencing_under_held_streams() -> None:
    multi = MultiStager(DEVICES, num_slots=3)
    assert _corrupted(multi, 5000, 8, 2_000_000) == [0, 0]
    assert multi.device_stats[1].waits + multi.stats.waits > 0, "the held streams made the host wait"


def test_race_test_detects_missing_fencing() -> None:
    multi = MultiStager(DEVICES, num_slots=2, _unsafe_disable_fencing=True)
    bad = _corrupted(multi, 2000, 16, 2_000_000)
    assert bad[1] > 0, bad  # (the mirror's copies are fenced by nothing at all)


def test_cuda_graph_replay_on_both_devices() -> None:
    prof = StaticProfile(max_num_reqs=64, max_num_tokens=512, max_blocks_per_req=8, block_size=16)
    multi = MultiStager(DEVICES, profile=prof)
    step = _stage(multi, step_fields(1, 3), graph=True)
    multi.freeze()
    graphs, outs, fulls, weights = [], [], [], []
    for k in (0, 1):
        with torch.cuda.device(k):
            full = [multi.view(step.device_full(n), k) for n in _NAMES]
            w = torch.arange(1, 4097, dtype=torch.int64, device=f"cuda:{k}")
            out = torch.zeros((), dtype=torch.int64, device=f"cuda:{k}")

            def kernel(full: list[torch.Tensor] = full, w: torch.Tensor = w, out: torch.Tensor = out) -> None:
                out.copy_(_checksum(full, w))

            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                kernel()
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                kernel()
            graphs.append(g)
            outs.append(out)
            fulls.append(full)
            weights.append(w)
    mismatches = [torch.zeros((), dtype=torch.int64, device=d) for d in DEVICES]
    with sync_error_mode():
        for n in range(2, 1002):
            step = _stage(multi, step_fields(n, 3), graph=True)
            for k in (0, 1):
                with torch.cuda.device(k):
                    now = [multi.view(step.device_full(m), k) for m in _NAMES]
                    assert [t.data_ptr() for t in now] == [t.data_ptr() for t in fulls[k]]
                    graphs[k].replay()
                    mismatches[k] += (outs[k] != _checksum(now, weights[k])).to(torch.int64)
    assert [int(m.item()) for m in mismatches] == [0, 0]


def test_builders_on_two_devices_and_host_time_against_two_stagers() -> None:
    """The fused decode step on both devices: device 1's metadata equals device 0's; the host time
    of a step (derive once + a second copy + device 1's objects) against two independent stagers,
    alternating rounds in this run (printed; the bench is benchmarks/bench_multi_rank.py)."""
    from attnmeta.backends.fused import FusedStepBuilder
    from attnmeta.bench.scenarios import decode_walks

    walks = dict(decode_walks(False))
    for batch in (1, 256):
        specs = walks[batch]
        multi = MultiStager(DEVICES)
        mb = FusedStepBuilder(multi)
        singles = [FusedStepBuilder(Stager(d)) for d in DEVICES]
        with sync_error_mode():
            for spec in specs[:8]:
                fs = mb.build(spec)
                rep = multi.view(fs, 1)
        assert_replica(fs, rep)

        def one_process(i: int, multi: MultiStager = multi, mb: Any = mb, specs: Any = specs) -> None:
            multi.view(mb.build(specs[i % 64]), 1)

        def two_stagers(i: int, singles: Any = singles, specs: Any = specs) -> None:
            for b in singles:
                b.build(specs[i % 64])

        med = {}
        gc.disable()
        try:
            for name, fn in (("one-process", one_process), ("two-stagers", two_stagers)) * 5:
                ts = []
                for i in range(300):
                    t0 = time.perf_counter_ns()
                    fn(i)
                    ts.append(time.perf_counter_ns() - t0)
                torch.cuda.synchronize(0)
                torch.cuda.synchronize(1)
                med.setdefault(name, []).append(float(np.median(ts[30:])) / 1e3)
        finally:
            gc.enable()
        a, b = float(np.median(med["one-process"])), float(np.median(med["two-stagers"]))
        print(f"MULTI batch {batch}: one process {a:.1f} us, two stagers {b:.1f} us a step ({b / a:.2f}x)")


# ------------------------------------------------------------------------------------------ one process per GPU
@pytest.fixture(scope="module")
def pool() -> Iterator[Any]:
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as p:
        yield p


def _ring_race(pool: Any, steps: int, fencing: bool, num_slots: int) -> tuple[dict[str, float], dict[str, int]]:
    ring = SharedRing.create(num_readers=1, num_slots=num_slots, slot_bytes=64 << 10, meta_bytes=4096)
    try:
        job = pool.apply_async(run_reader, (ring.name, 0, 5), {"device": "cuda:1", "hold_every": 8,
                                                               "hold_seconds": 0.002})
        with torch.cuda.device(0):
            stats = run_writer(ring, steps, 5, device="cuda:0", fencing=fencing)
        return stats, job.get(timeout=300)
    finally:
        ring.unlink()


def test_ring_race_free_across_processes(pool: Any) -> None:
    stats, got = _ring_race(pool, 3000, fencing=True, num_slots=3)
    assert got == {"steps": 3000, "torn_device": 0, "torn_host": 0, "overruns": 0}, got
    assert stats["waits"] > 0


def test_ring_race_control_sees_torn_steps(pool: Any) -> None:
    _, got = _ring_race(pool, 1000, fencing=False, num_slots=2)
    assert got["torn_device"] + got["torn_host"] > 0, got


def test_ring_receive_makes_no_sync_and_one_copy() -> None:
    """In one process: the writer on cuda:0, a reader on cuda:1; receiving is one async copy from the
    registered segment, and building the reader's objects reads nothing back."""
    from attnmeta.backends.fused import FusedStepBuilder
    from attnmeta.bench.scenarios import decode_walks

    specs = dict(decode_walks(True))[64]
    ring = SharedRing.create(num_readers=1, num_slots=3)
    try:
        writer = RingWriter(ring, "cuda:0")
        rd = RingReader(SharedRing.attach(ring.name), 0, "cuda:1")
        fb = FusedStepBuilder(writer)
        with sync_error_mode():
            for spec in specs[:40]:
                fs = fb.build(spec)
                writer.publish({"step": fs})
                got = rd.receive(timeout=30)
                assert got is not None
                rep = got.result("step")
        assert_replica(fs, rep, shared_host=False)
        assert rd.stats.copies == 40 and writer.stats.copies == 40
        assert rep.common.seq_lens.device == torch.device("cuda:1")
        rd.close()
        writer.close()
    finally:
        ring.unlink()
