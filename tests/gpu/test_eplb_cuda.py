"""EPLB pad-out on a real GPU: attnmeta's never waits behind queued GPU work; vLLM's way does.

A long ``torch.cuda._sleep`` kernel is queued first (the state of a serving engine whose host runs
ahead of the GPU), then the host call is timed. :func:`attnmeta.eplb.pad_out_expert_maps` (one
non-blocking copy from pinned memory plus device-to-device copies) must return in a small fraction
of the kernel's time, under the sync audit (CUDA sync debug mode and the pageable-copy checker);
the reference (vLLM's blocking pageable ``copy_``) must wait for the kernel. Afterwards both hold the
same maps.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import pytest
import torch

from attnmeta import Stager
from attnmeta.eplb import pad_out_expert_maps
from attnmeta.sync import no_device_sync, record_device_syncs
from attnmeta.testing.reference import ref_commit_expert_maps

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # pragma: no cover - CPU CI
    pytest.skip("needs a CUDA device (run on the GPU machine)", allow_module_level=True)

SLEEP_MS = 200.0
# 8 layers, 64 logical experts over 8 ranks of 9 slots: every expert once plus 8 redundant replicas
RNG = np.random.default_rng(0)
P2L = np.stack([RNG.permutation(np.concatenate([np.arange(64), RNG.integers(0, 64, 8)])) for _ in range(8)])
WIDTH = 9


def _cycles_per_ms() -> float:
    torch.cuda._sleep(1_000_000)  # warm the kernel
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(20_000_000)
    end.record()
    end.synchronize()
    return 20_000_000 / start.elapsed_time(end)


def _host_ms_behind_busy_gpu(fn: Callable[[], object], cycles: int) -> tuple[float, float]:
    """(host milliseconds of ``fn()``, GPU milliseconds of the queued sleep plus ``fn``'s work)."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    t0 = time.perf_counter()
    fn()
    host_ms = (time.perf_counter() - t0) * 1e3
    end.record()
    torch.cuda.synchronize()
    return host_ms, start.elapsed_time(end)


def _maps() -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.full((8, 64, WIDTH), 7, dtype=torch.int64, device="cuda"),
            torch.full((8, 64), 7, dtype=torch.int64, device="cuda"))


def test_pad_out_does_not_wait_behind_a_busy_gpu_and_the_reference_does() -> None:
    cycles = int(_cycles_per_ms() * SLEEP_MS)
    stager = Stager("cuda")
    l2p, counts = _maps()
    for _ in range(stager.num_slots + 1):  # compile, and size every ring slot outside the timing
        pad_out_expert_maps(stager, P2L, l2p, counts)
    l2p, counts = _maps()

    def attnmeta_way() -> None:
        with no_device_sync():  # 0 syncs, no pageable or blocking copy
            pad_out_expert_maps(stager, P2L, l2p, counts)

    host_ms, gpu_ms = _host_ms_behind_busy_gpu(attnmeta_way, cycles)
    assert gpu_ms > 0.5 * SLEEP_MS, f"the sleep kernel ran {gpu_ms:.1f} ms; the test needs a long one"
    assert host_ms < 0.1 * gpu_ms, f"pad_out_expert_maps took {host_ms:.1f} ms behind a {gpu_ms:.1f} ms kernel"
    assert stager.stats.waits == 0

    ref_l2p, ref_counts = _maps()
    found: list[object] = []

    def vllm_way() -> None:
        with record_device_syncs() as errors:
            ref_commit_expert_maps(torch.from_numpy(P2L), ref_l2p, ref_counts)  # CPU map, as vLLM
        found.extend(errors)

    ref_host_ms, ref_gpu_ms = _host_ms_behind_busy_gpu(vllm_way, cycles)
    assert ref_host_ms > 0.5 * ref_gpu_ms, f"the reference returned after {ref_host_ms:.1f} of {ref_gpu_ms:.1f} ms"
    assert found, "the audit must report the reference's blocking copy"
    assert torch.equal(l2p, ref_l2p) and torch.equal(counts, ref_counts)
    assert l2p[:, :, -1].eq(-1).any()  # the width is padded: some expert has fewer than WIDTH replicas
