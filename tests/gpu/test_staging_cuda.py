"""The stager on a real GPU: one H2D per step, no sync, no race, graph-replay safe.

Runs only where CUDA is present (the GPU machine: see docs/benchmarks.md for the command). Every loop
runs under ``torch.cuda.set_sync_debug_mode("error")``: any synchronising call raises.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import numpy as np
import pytest
import torch
from audit_helpers import sync_error_mode

from attnmeta.profile import StaticProfile
from attnmeta.staging import Stager
from attnmeta.testing.multi import random_fields

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # pragma: no cover - CPU CI
    pytest.skip("needs a CUDA device (run on the GPU machine)", allow_module_level=True)


def _checksum(views: list[torch.Tensor], weights: torch.Tensor) -> torch.Tensor:
    """Position-weighted int64 checksum of several device tensors (device ops only)."""
    total = torch.zeros((), dtype=torch.int64, device=weights.device)
    for v in views:
        flat = v.reshape(-1).to(torch.int64)
        total = total + (flat * weights[: flat.shape[0]]).sum()
    return total


def _host_checksum(arrs: list[np.ndarray]) -> int:
    total = 0
    for a in arrs:
        flat = a.reshape(-1).astype(np.int64)
        w = np.arange(1, flat.shape[0] + 1, dtype=np.int64)
        total += int((flat * w).sum())  # wraps like the device int64 sum
    return total & ((1 << 64) - 1)


def _corrupted_steps(stager: Stager, steps: int, seed: int, hold_every: int, sleep_cycles: int) -> int:
    """Build ``steps`` random steps on ``stager`` while the GPU is held behind every ``hold_every``
    steps; return the number of steps whose device data differs from what the host staged."""
    dev = stager.device
    rng = np.random.default_rng(seed)
    weights = torch.arange(1, 4096 + 1, dtype=torch.int64, device=dev)
    log = torch.zeros(steps, dtype=torch.int64, device=dev)
    expected = np.zeros(steps, dtype=np.uint64)
    with sync_error_mode():
        for i in range(steps):
            if i % hold_every == 0:
                torch.cuda._sleep(sleep_cycles)  # the host runs many steps ahead
            data = random_fields(rng)
            with stager.step() as step:
                for name, arr in data.items():
                    step.alloc(name, arr.shape, arr.dtype)[...] = arr
            expected[i] = np.uint64(_host_checksum(list(data.values())))
            log[i : i + 1].copy_(_checksum([step.device(n) for n in data], weights).view(1))
    got = log.cpu().numpy().astype(np.uint64)  # one sync, after the audited loop
    return int((got != expected).sum())


def _run_race(steps: int, fencing: bool, num_slots: int, hold_every: int, sleep_cycles: int = 2_000_000) -> int:
    stager = Stager(torch.device("cuda"), num_slots=num_slots, _unsafe_disable_fencing=not fencing)
    return _corrupted_steps(stager, steps, 1234, hold_every, sleep_cycles)  # (2,000,000 cycles: ~1 ms holds)


def test_race_free_with_fencing_under_a_held_stream() -> None:
    corrupted = _run_race(10_000, fencing=True, num_slots=3, hold_every=8)
    assert corrupted == 0


def test_race_test_detects_missing_fencing() -> None:
    """The same test must fail when fencing is disabled, or it proves nothing.

    A race needs the host to stage ``num_slots + 1`` steps while the GPU is held. A step of this loop
    (random fields, the stage, the checksum's launches, under the sync audit) takes a few hundred
    microseconds on a slow host, so a 1 ms hold could end before the host wrapped the ring and the
    control found nothing; its holds are ~10 ms (20,000,000 cycles), far past any host's three steps."""
    corrupted = _run_race(2_000, fencing=False, num_slots=2, hold_every=16, sleep_cycles=20_000_000)
    assert corrupted > 0


def test_one_h2d_per_step_no_d2h_no_sync_in_profile() -> None:
    from torch.profiler import ProfilerActivity, profile

    dev = torch.device("cuda")
    rng = np.random.default_rng(7)
    stager = Stager(dev)
    for _ in range(3):  # warm: first-use allocations and lazy module loads
        with stager.step() as step:
            for name, arr in random_fields(rng).items():
                step.alloc(name, arr.shape, arr.dtype)[...] = arr
    torch.cuda.synchronize()
    n = 50
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with sync_error_mode(), torch.profiler.record_function("attnmeta.steps"):
            for _ in range(n):
                with stager.step() as step:
                    for name, arr in random_fields(rng).items():
                        step.alloc(name, arr.shape, arr.dtype)[...] = arr
        torch.cuda.synchronize()  # outside the counted region: lets the profiler see every memcpy
    events = prof.events()
    region = next(e for e in events if e.name == "attnmeta.steps")
    lo, hi = region.time_range.start, region.time_range.end
    names = [e.name for e in events]
    h2d = sum(1 for x in names if "Memcpy HtoD" in x)
    d2h = sum(1 for x in names if "Memcpy DtoH" in x)
    # host-side runtime calls issued while the steps ran (the profiler's own flush syncs come later)
    syncs = sum(1 for e in events if "Synchronize" in e.name and e.name.startswith("cuda")
                and lo <= e.time_range.start <= hi)
    assert h2d == n, f"expected one H2D memcpy per step, saw {h2d} for {n} steps"
    assert d2h == 0
    assert syncs == 0, [e.name for e in events if "Synchronize" in e.name and lo <= e.time_range.start <= hi]
    assert stager.stats.waits == 0


def test_cuda_graph_replay_after_later_commits() -> None:
    dev = torch.device("cuda")
    prof = StaticProfile(max_num_reqs=64, max_num_tokens=512, max_blocks_per_req=8, block_size=16)
    stager = Stager(dev, profile=prof)
    rng = np.random.default_rng(99)

    def stage(data: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        with stager.step() as step:
            for name, arr in data.items():
                cap = 65 if name == "qsl" else (512 if name == "slots" else 64)
                fill = -1 if name == "slots" else 0
                step.alloc(name, arr.shape, arr.dtype, capacity=cap, fill=fill)[...] = arr
        return {name: step.device_full(name) for name in data}

    full = stage(random_fields(rng))
    stager.freeze()
    weights = torch.arange(1, 4096 + 1, dtype=torch.int64, device=dev)
    out = torch.zeros((), dtype=torch.int64, device=dev)

    def kernel() -> None:
        out.copy_(_checksum(list(full.values()), weights))

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        kernel()  # warm up on the side stream before capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        kernel()
    mismatches = torch.zeros((), dtype=torch.int64, device=dev)
    with sync_error_mode():
        for _ in range(1000):
            views = stage(random_fields(rng))
            assert all(views[k].data_ptr() == full[k].data_ptr() for k in full)
            g.replay()
            eager = _checksum(list(views.values()), weights)
            mismatches += (out != eager).to(torch.int64)
    assert int(mismatches.item()) == 0


def test_commit_fences_on_whichever_stream_is_current() -> None:
    """The stager caches the current-stream object between commits; switching streams must still record
    each commit's event on the stream that is current at that commit (else the fence would be wrong)."""
    stager = Stager("cuda", num_slots=2)
    side = torch.cuda.Stream()
    for i in range(6):
        ctx = torch.cuda.stream(side) if i % 2 else nullcontext()
        with ctx:
            with stager.step() as step:
                step.alloc("x", 4, np.int32)[:] = i
            expected = side if i % 2 else torch.cuda.current_stream()
            assert stager._current_stream() == expected
            assert step.device("x").sum().item() == 4 * i  # read on the same stream, after the copy


class _CountingDriver:
    """Stands in for ``attnmeta.staging._driver.Driver``: counts calls, delegates or fails on demand."""

    def __init__(self, real: Any, fail_copy: bool = False) -> None:
        self.real, self.fail_copy = real, fail_copy
        self.copies = self.records = 0

    def copy(self, dst: int, src: int, n: int, stream: int) -> int:
        self.copies += 1
        return 1 if self.fail_copy else int(self.real.copy(dst, src, n, stream))

    def record(self, event: int, stream: int) -> int:
        self.records += 1
        return int(self.real.record(event, stream))


def _driver_steps(stager: Stager, steps: int, seed: int) -> int:
    return _corrupted_steps(stager, steps, seed, 8, 1_000_000)


def test_eager_commits_go_through_the_driver_and_land_intact() -> None:
    from attnmeta.staging import _driver

    if _driver.load() is None:
        pytest.skip("libcuda could not be loaded, or ATTNMETA_DRIVER_COPY=0")
    stager = Stager("cuda", num_slots=3)
    assert stager._driver is not None
    spy = _CountingDriver(stager._driver)
    stager._driver = spy  # type: ignore[assignment]
    assert _driver_steps(stager, 600, seed=5) == 0
    # every commit but each slot's first (torch creates the slot's event on its first record)
    assert spy.copies == spy.records == 600 - 3
    assert stager.stats.copies == 600


def test_graph_mode_commits_go_through_the_driver_and_land_intact() -> None:
    """Graph mode (one fixed arena for every slot): commits through the driver, including after the
    layout grew (a new arena, new pinned slots); every step's data lands intact under a held GPU."""
    from attnmeta.backends.fused import FusedStepBuilder
    from attnmeta.staging import _driver
    from attnmeta.testing.workloads import advance, decode_spec

    if _driver.load() is None:
        pytest.skip("libcuda could not be loaded, or ATTNMETA_DRIVER_COPY=0")
    prof = StaticProfile(max_num_reqs=64, max_num_tokens=64, max_blocks_per_req=40, block_size=16)
    stager = Stager("cuda", num_slots=3, profile=prof)
    assert stager._driver is not None
    spy = _CountingDriver(stager._driver)
    stager._driver = spy  # type: ignore[assignment]
    builder = FusedStepBuilder(stager)
    walk = advance(decode_spec(40, np.random.default_rng(4), max_context=600, table_width=40), 50)
    dev = stager.device
    weights = torch.arange(1, 1 << 12, dtype=torch.int64, device=dev)
    log = torch.zeros(300, dtype=torch.int64, device=dev)
    expected = np.zeros(300, dtype=np.uint64)
    with sync_error_mode():
        for i in range(300):
            if i == 150:  # another field: the layout grows, the arena and the pinned slots are new
                with stager.step() as step:
                    step.alloc("other.field", 3, np.int32, capacity=8)[:] = 7
            if i % 8 == 0:
                torch.cuda._sleep(1_000_000)
            cm, _fa, fi = builder.build(walk[i % 50])
            assert fi is not None
            host = [cm.seq_lens_cpu, cm.block_table_cpu, cm.slot_mapping_cpu, fi.paged_kv_indices_cpu]
            expected[i] = np.uint64(_host_checksum(host))
            device = [cm.seq_lens, cm.block_table_tensor, cm.slot_mapping, fi.paged_kv_indices]
            log[i : i + 1].copy_(_checksum(device, weights).view(1))
    got = log.cpu().numpy().astype(np.uint64)  # one sync, after the audited loop
    assert int((got != expected).sum()) == 0
    assert spy.copies == spy.records and spy.copies >= 300 - 6  # every commit but each slot's first
    assert builder.stats.replayed > 200


def test_a_failing_driver_copy_falls_back_to_torch() -> None:
    from attnmeta.staging import _driver

    if _driver.load() is None:
        pytest.skip("libcuda could not be loaded, or ATTNMETA_DRIVER_COPY=0")
    stager = Stager("cuda", num_slots=2)
    spy = _CountingDriver(stager._driver, fail_copy=True)
    stager._driver = spy  # type: ignore[assignment]
    assert _driver_steps(stager, 200, seed=6) == 0
    assert spy.copies == 200 - 2 and spy.records == 0


def test_the_sync_audit_sees_the_commit_as_a_torch_copy() -> None:
    """Under the audit's dispatch/function modes the commit must not bypass torch (else the audit
    could not check the copy)."""
    from attnmeta.staging import _driver
    from attnmeta.sync import no_device_sync

    if _driver.load() is None:
        pytest.skip("libcuda could not be loaded, or ATTNMETA_DRIVER_COPY=0")
    stager = Stager("cuda", num_slots=2)
    spy = _CountingDriver(stager._driver)
    stager._driver = spy  # type: ignore[assignment]
    for i in range(6):
        with no_device_sync(), stager.step() as step:
            step.alloc("x", 8, np.int32)[:] = i
        assert int(step.device("x").sum().item()) == 8 * i
    assert spy.copies == 0


def test_a_collected_stager_keeps_its_pinned_slots_until_their_copies_complete() -> None:
    import gc

    from attnmeta.staging import _driver

    if _driver.load() is None:
        pytest.skip("libcuda could not be loaded, or ATTNMETA_DRIVER_COPY=0")
    torch.cuda.synchronize()
    _driver.purge()
    assert not _driver._RETIRED
    stager = Stager("cuda", num_slots=2)
    for i in range(4):
        with stager.step() as step:
            step.alloc("x", 1 << 16, np.int32)[:] = i
    torch.cuda._sleep(50_000_000)  # the GPU is far behind: the last copies are still queued ...
    with stager.step() as step:
        step.alloc("x", 1 << 16, np.int32)[:] = 9
    import weakref

    alive = weakref.ref(stager)
    del stager, step
    if alive() is not None:  # (diagnosis: what holds it, if not a cycle gc breaks)
        holders = [type(r).__name__ for r in gc.get_referrers(alive())]
        gc.collect()
        assert alive() is None, f"a dropped stager is still referenced by {holders}"
    assert len(_driver._RETIRED) >= 1  # ... so the collected stager's pinned slots are retired, not freed
    torch.cuda.synchronize()
    _driver.purge()
    assert not _driver._RETIRED


def test_no_driver_copy_while_another_device_is_current(monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver call runs in the current device's context: with another device current the commit
    goes through torch (which switches devices itself)."""
    from attnmeta.staging import _driver
    from attnmeta.staging import _ring as stager_mod

    if _driver.load() is None:
        pytest.skip("libcuda could not be loaded, or ATTNMETA_DRIVER_COPY=0")
    stager = Stager("cuda", num_slots=2)
    spy = _CountingDriver(stager._driver)
    stager._driver = spy  # type: ignore[assignment]
    monkeypatch.setattr(stager_mod, "_CURRENT_DEVICE", lambda: stager._device_index + 1)
    assert _driver_steps(stager, 40, seed=8) == 0
    assert spy.copies == 0


@pytest.mark.parametrize("graph, threads", [(False, 1), (True, 1), (False, 2)], ids=["eager", "graph", "eager-threads"])
def test_fused_replays_land_intact_while_the_gpu_is_held(graph: bool, threads: int) -> None:
    """FusedStepBuilder on CUDA (eager replays through the driver copy; graph mode into the fixed
    arena; with ``threads=2`` a 600-request loop whose rows numba's thread pool copies): 1,500 steps
    walking decode and spec-decode loops (3 drafts: prefill rows only, which replay too) of several
    sizes and mixed steps, the GPU held behind every 8 steps, all under sync "error" mode; each
    step's device fields (common and FlashInfer) equal the host twins it handed out."""
    from attnmeta.backends.fused import FusedStepBuilder
    from attnmeta.testing.workloads import advance, decode_spec, mixed_spec

    rng = np.random.default_rng(11)
    walks = [advance(decode_spec(b, rng, max_context=600, table_width=64), 40) for b in (1, 5, 33, 130)]
    walks += [advance(decode_spec(b, rng, max_context=600, table_width=64, drafts=3), 40) for b in (3, 40)]
    if threads > 1:
        walks += [advance(decode_spec(600, rng, max_context=600, table_width=64), 40)]
    mixed = [mixed_spec(rng, prefills=2, decodes=6, max_prompt=50, max_context=600) for _ in range(3)]
    prof = StaticProfile(max_num_reqs=256, max_num_tokens=1024, max_blocks_per_req=160, block_size=16) if graph else None
    builder = FusedStepBuilder(Stager("cuda", num_slots=3, profile=prof), threads=threads)
    steps = 1_500
    dev = builder.stager.device
    weights = torch.arange(1, 1 << 16, dtype=torch.int64, device=dev)
    log = torch.zeros(steps, dtype=torch.int64, device=dev)
    expected = np.zeros(steps, dtype=np.uint64)
    with sync_error_mode():
        for i in range(steps):
            if i % 8 == 0:
                torch.cuda._sleep(1_000_000)
            spec = mixed[i % 3] if i % 50 == 49 else walks[(i // 100) % len(walks)][i % 40]
            cm, _fa, fi = builder.build(spec)
            assert fi is not None
            host = [cm.query_start_loc_cpu, cm.seq_lens_cpu, cm.block_table_cpu, cm.slot_mapping_cpu,
                    cm.positions_cpu, fi.paged_kv_indptr_cpu, fi.paged_kv_indices_cpu, fi.paged_kv_last_page_len_cpu,
                    fi.qo_indptr_prefill_cpu]
            device = [cm.query_start_loc, cm.seq_lens, cm.block_table_tensor, cm.slot_mapping, cm.positions,
                      fi.paged_kv_indptr, fi.paged_kv_indices, fi.paged_kv_last_page_len, fi.qo_indptr_prefill]
            expected[i] = np.uint64(_host_checksum(host))
            log[i : i + 1].copy_(_checksum(device, weights).view(1))
    got = log.cpu().numpy().astype(np.uint64)  # one sync, after the audited loop
    assert int((got != expected).sum()) == 0
    assert builder.stats.replayed > steps // 2, builder.stats
    assert builder.stager.stats.copies == steps


def test_a_cuda_stager_without_num_kv_blocks_warns_once_per_process() -> None:
    """In a fresh process: the first CUDA stager without ``num_kv_blocks`` warns (naming the argument),
    the second does not, and one with it never does."""
    import subprocess
    import sys

    code = ("import warnings\n"
            "warnings.simplefilter('always')\n"
            "from attnmeta import Stager\n"
            "with warnings.catch_warnings(record=True) as seen:\n"
            "    Stager('cuda', num_kv_blocks=8)\n"
            "    Stager('cuda'); Stager('cuda')\n"
            "print([type(w.message).__name__ for w in seen])\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "['UncheckedBlockIdsWarning']"


def test_a_live_graph_step_reads_its_data_after_a_later_step_grows_the_layout() -> None:
    """Graph mode before freeze(): while step 1's copy is still queued behind a held GPU, step 2 adds a
    field (a new arena). Step 1's views made after that must read step 1's bytes: the old arena's are
    carried into the new one on the device, ordered after step 1's copy, with no sync."""
    prof = StaticProfile(max_num_reqs=8, max_num_tokens=64, max_blocks_per_req=4, block_size=16)
    stager = Stager(torch.device("cuda"), profile=prof, debug_fill=0xA5)
    firsts, seconds = [], []
    with sync_error_mode():
        for k in range(3):  # (each round lays out one more field)
            torch.cuda._sleep(5_000_000)  # the copies below queue behind a few ms of GPU work
            with stager.step() as s1:
                s1.alloc("a", 4, np.int32, capacity=8)[:] = [k, 2, 3, 4]
            with stager.step() as s2:
                s2.alloc("a", 2, np.int32)[:] = 9
                s2.alloc(f"new{k}", 2, np.int32, capacity=4)[:] = 7
                firsts.append(s1.device("a").clone())  # (step 1 is live until step 2 commits)
            seconds.append(torch.cat([s2.device("a"), s2.device(f"new{k}")]).clone())
    torch.cuda.synchronize()
    assert [t.cpu().tolist() for t in firsts] == [[k, 2, 3, 4] for k in range(3)]
    assert [t.cpu().tolist() for t in seconds] == [[9, 9, 7, 7]] * 3
