"""A realistic sync-free metadata build passes the audit clean; its device-side twin does not.

The clean build is the attnmeta way: derive everything on the host with numpy, pack it
into one staging buffer (pinned where CUDA exists), move it with one non-blocking copy, and only
then work on the device (views, gathers, fills with cached device indices). The reference build is
the way engines used to do it: device arithmetic plus host reads of the results.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from attnmeta.sync import (
    DeviceSyncError,
    allow_device_sync,
    no_device_sync,
    register_audit_target,
    run_audit,
    unregister_audit_target,
)

BLOCK = 4


@dataclasses.dataclass(frozen=True)
class Meta:
    query_start_loc: torch.Tensor  # (num_reqs + 1,) int32, device
    seq_lens: torch.Tensor  # (num_reqs,) int32, device
    slot_mapping: torch.Tensor  # (num_tokens,) int64, device
    max_query_len: int  # host scalar


def _batch(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    num_reqs = int(rng.integers(1, 6))
    query_lens = rng.integers(1, 9, num_reqs).astype(np.int32)
    computed = rng.integers(0, 9, num_reqs).astype(np.int32)
    max_blocks = int(-(-(computed + query_lens).max() // BLOCK))
    block_table = rng.permutation(64)[: num_reqs * max_blocks].reshape(num_reqs, max_blocks).astype(np.int32)
    return query_lens, computed, block_table


def build_clean(device: torch.device, seed: int) -> Meta:
    query_lens, computed, block_table = _batch(seed)
    num_reqs, num_tokens = len(query_lens), int(query_lens.sum())
    # host derivation (numpy): exact, no device involved
    qsl = np.zeros(num_reqs + 1, np.int32)
    np.cumsum(query_lens, out=qsl[1:])
    seq_lens = computed + query_lens
    req = np.repeat(np.arange(num_reqs), query_lens)
    pos = computed[req] + (np.arange(num_tokens) - qsl[req])
    slots = block_table[req, pos // BLOCK].astype(np.int64) * BLOCK + pos % BLOCK
    # one staging buffer, one non-blocking copy
    staging = torch.empty(2 * num_tokens + 2 * num_reqs + 1, dtype=torch.int32)  # int64 slots first
    if device.type == "cuda":
        staging = staging.pin_memory()
    flat = staging.numpy()
    flat[: 2 * num_tokens].view(np.int64)[:] = slots
    flat[2 * num_tokens : 2 * num_tokens + num_reqs + 1] = qsl
    flat[2 * num_tokens + num_reqs + 1 :] = seq_lens
    dev = staging.to(device, non_blocking=True)
    slot_d, qsl_d, seq_d = torch.split(dev, [2 * num_tokens, num_reqs + 1, num_reqs])
    slot_d = slot_d.view(torch.int64)
    # device-side work that never reads back: pad-out with fill_, a cached device index
    padded = torch.full((num_reqs + 3,), -1, dtype=torch.int32, device=device)
    padded[: num_reqs + 1] = qsl_d
    padded[num_reqs + 1 :].fill_(num_tokens)
    return Meta(qsl_d, seq_d, slot_d, int(query_lens.max()))


def build_reference(device: torch.device, seed: int) -> Meta:
    """The device-side way: correct values, and a host wait at every .item()/.tolist()."""
    query_lens, computed, block_table = _batch(seed)
    q = torch.as_tensor(query_lens, device=device)
    c = torch.as_tensor(computed, device=device)
    bt = torch.as_tensor(block_table, device=device)
    qsl = torch.zeros(len(q) + 1, dtype=torch.int32, device=device)
    qsl[1:] = torch.cumsum(q, 0)
    req = torch.repeat_interleave(torch.arange(len(q), device=device), q)
    pos = c[req] + torch.arange(int(qsl[-1]), device=device) - qsl[req]
    slots = bt[req, pos // BLOCK].long() * BLOCK + pos % BLOCK
    return Meta(qsl, c + q, slots, int(q.max().item()))


@pytest.fixture(params=["meta", "cpu", "cuda"])
def device(request: pytest.FixtureRequest) -> torch.device:
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device; meta and cpu-as-device cover the CPU-only machine")
    return torch.device(request.param)


def test_clean_build_passes_the_audit(device: torch.device) -> None:
    for seed in range(5):
        with no_device_sync(devices={device.type}):
            meta = build_clean(device, seed)
        if device.type != "meta":
            with allow_device_sync():
                ref = build_reference(device, seed)
                assert torch.equal(meta.query_start_loc, ref.query_start_loc)
                assert torch.equal(meta.seq_lens, ref.seq_lens)
                assert torch.equal(meta.slot_mapping, ref.slot_mapping)
                assert meta.max_query_len == ref.max_query_len


def test_reference_build_is_caught(device: torch.device) -> None:
    with pytest.raises(DeviceSyncError) as info, no_device_sync(devices={device.type}):
        build_reference(device, 0)
    assert info.value.op == "torch.as_tensor"  # the first offence: a blocking upload
    with pytest.raises(DeviceSyncError) as info, no_device_sync(devices={device.type}):
        q_cpu = torch.from_numpy(np.array([3, 1, 2]))
        q = (q_cpu.pin_memory() if device.type == "cuda" else q_cpu).to(device, non_blocking=True)
        torch.repeat_interleave(torch.arange(3, device=device), q)
    assert info.value.op == "aten.repeat_interleave.Tensor"


@pytest.fixture
def targets() -> Iterator[list[str]]:
    names = ["sync_test_clean", "sync_test_reference"]
    register_audit_target(names[0], build_clean)
    register_audit_target(names[1], build_reference)
    yield names
    for name in names:
        unregister_audit_target(name)


def test_run_audit_over_the_two_builds(targets: list[str]) -> None:
    devices = ["meta", "cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    rows = run_audit(devices=devices, batches=4, targets=targets)
    clean = [r for r in rows if r.builder == targets[0]]
    reference = [r for r in rows if r.builder == targets[1]]
    assert all(r.clean for r in clean), [r.first_problem for r in clean]
    assert all(r.syncs == 4 for r in reference), reference
