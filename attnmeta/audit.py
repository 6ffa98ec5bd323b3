"""Every attnmeta builder as a sync-audit target, and ``python -m attnmeta audit``.

:func:`register_builtin_targets` registers one :func:`attnmeta.sync.register_audit_target` per
builder; each target builds that builder's metadata for every batch kind of
:data:`attnmeta.testing.workloads.KINDS` on the given device, in one step per batch (a builder that runs its
own steps, :data:`LOOP_BUILDERS`, in as many steps as it takes to replay). The test suite runs all
of them under the audit on ``meta`` (tests/sync/test_builders_audited.py), and a new backend module
that is not registered here fails that test.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from attnmeta.testing.workloads import KINDS, random_spec
from attnmeta.metadata import stage_common
from attnmeta.spec import BatchSpec
from attnmeta.staging import Stager, Step

__all__ = ["BUILDERS", "LOOP_BUILDERS", "register_builtin_targets", "run_audit_cli"]

_STAGERS: dict[str, Stager] = {}


def _stager(device: torch.device) -> Stager:
    key = str(device)
    st = _STAGERS.get(key)
    if st is None:
        st = _STAGERS[key] = Stager(device)
    return st


def _common(spec: BatchSpec, step: Step, rng: np.random.Generator) -> Any:
    return stage_common(spec, step)


def _flash_attn(spec: BatchSpec, step: Step, rng: np.random.Generator) -> Any:
    from attnmeta.backends import flash_attn

    opts = flash_attn.FlashAttnOptions(dcp_world_size=2, dcp_rank=int(rng.integers(0, 2))) if rng.random() < 0.5 \
        else flash_attn.FlashAttnOptions(causal=rng.random(spec.num_reqs) < 0.7)
    return flash_attn.stage(stage_common(spec, step), step, opts)


def _flashinfer(spec: BatchSpec, step: Step, rng: np.random.Generator) -> Any:
    from attnmeta.backends import flashinfer

    dcp = rng.random() < 0.3
    opts = flashinfer.FlashInferOptions(
        decode_threshold=int(rng.integers(1, 5)), require_uniform=bool(rng.random() < 0.5),
        indices="device" if rng.random() < 0.5 else "host", dcp_world_size=2 if dcp else 1,
        dcp_rank=int(rng.integers(0, 2)) if dcp else 0,
    )
    if rng.random() < 0.5:  # the steady-state decode path: the page table built by the common pass
        return flashinfer.stage(stage_common(spec, step, paged_kv=True), step)
    return flashinfer.stage(stage_common(spec, step), step, opts)


def _fast_prefill(spec: BatchSpec, step: Step, rng: np.random.Generator) -> Any:
    from attnmeta.backends import fast_prefill

    q = spec.num_scheduled_tokens.astype(np.int64)
    ends = np.cumsum(q)
    cnt = np.minimum(rng.integers(1, 4, q.shape[0]), q)  # the last cnt_i tokens of each request
    starts = np.cumsum(cnt) - cnt
    li = (np.repeat(ends - cnt, cnt) + np.arange(int(cnt.sum())) - np.repeat(starts, cnt)).astype(np.int32)
    opts = fast_prefill.FastPrefillOptions(num_logits_padded=li.shape[0] + int(rng.integers(0, 4)))
    return fast_prefill.stage(stage_common(spec, step), step, li if li.size else None, opts)


def _local_attn(spec: BatchSpec, step: Step, rng: np.random.Generator) -> Any:
    from attnmeta.backends import local_attn

    opts = local_attn.LocalAttnOptions(attn_chunk_size=spec.block_size * int(rng.integers(1, 5)),
                                       block_table="device" if rng.random() < 0.5 else "host")
    return local_attn.stage(stage_common(spec, step), step, opts)


def _cascade(spec: BatchSpec, step: Step, rng: np.random.Generator) -> Any:
    from attnmeta.backends import cascade

    opts = cascade.CascadeOptions(num_query_heads=8, num_kv_heads=int(rng.choice([1, 8])), num_sms=132)
    return cascade.stage(stage_common(spec, step), step, int(rng.integers(0, 64)), opts)


def _mamba_common(spec: BatchSpec, step: Step, options: Any) -> Any:
    from attnmeta.backends import mamba2

    return stage_common(spec, step, block_table_columns=mamba2.block_table_columns(spec, options))


def _mamba2(spec: BatchSpec, step: Step, rng: np.random.Generator) -> Any:
    from attnmeta.backends import mamba2
    from attnmeta.host.mamba import CheckpointConfig

    align = rng.random() < 0.5
    k = int(rng.integers(0, 4))
    bs = spec.block_size
    ckpt = CheckpointConfig(hash_block_size=int(rng.choice([1, bs])), cache_hit_alignment_tokens=bs,
                            mamba_block_size=bs, checkpoint_alignment=1) if align and rng.random() < 0.7 else None
    opts = mamba2.Mamba2Options(
        chunk_size=int(rng.choice([8, 16, 64, 256])), cache_mode="align" if align else "none",
        num_speculative_tokens=k, checkpoint=ckpt, logical_chunks=bool(rng.random() < 0.5),
        token_seq_idx=bool(rng.random() < 0.5), needs_causal_conv1d_metadata=bool(rng.random() < 0.8),
    )
    accepted = rng.integers(1, k + 2, size=spec.num_reqs).astype(np.int32) if k and rng.random() < 0.7 else None
    return mamba2.stage(_mamba_common(spec, step, opts), step, opts, num_accepted_tokens=accepted)


def _mamba1(spec: BatchSpec, step: Step, rng: np.random.Generator) -> Any:
    from attnmeta.backends import mamba1

    opts = mamba1.Mamba1Options(cache_mode="align" if rng.random() < 0.5 else "none")
    return mamba1.stage(_mamba_common(spec, step, opts), step, opts)


def _linear_attn(spec: BatchSpec, step: Step, rng: np.random.Generator) -> Any:
    from attnmeta.backends import linear_attn

    opts = linear_attn.LinearAttnOptions(cache_mode="align" if rng.random() < 0.5 else "none")
    return linear_attn.stage(_mamba_common(spec, step, opts), step, opts)


BUILDERS: dict[str, Callable[[BatchSpec, Step, np.random.Generator], Any]] = {
    "common": _common,
    "flash_attn": _flash_attn,
    "flashinfer": _flashinfer,
    "fast_prefill": _fast_prefill,
    "local_attn": _local_attn,
    "cascade": _cascade,
    "mamba2": _mamba2,
    "mamba1": _mamba1,
    "linear_attn": _linear_attn,
}
"""Builder name -> function staging that builder's metadata for a spec into a step."""

LOOP_BUILDERS: dict[str, Callable[[Stager, BatchSpec], Any]] = {}
"""Builder name -> function running one whole step of a builder that begins and commits its own steps
(:class:`attnmeta.backends.fused.FusedStepBuilder`); filled below."""

_FUSED: dict[int, Any] = {}  # id(stager) -> its FusedStepBuilder (the stagers live in _STAGERS)


def _fused(stager: Stager, spec: BatchSpec) -> Any:
    from attnmeta.backends.fused import FusedStepBuilder

    builder = _FUSED.get(id(stager))
    if builder is None or builder.stager is not stager:
        builder = _FUSED[id(stager)] = FusedStepBuilder(stager)
    # One more step than the ring has slots: the last one replays the layout the first recorded.
    for _ in range(stager.num_slots + 1):
        out = builder.build(spec)
    return out


LOOP_BUILDERS["fused"] = _fused


def _target(name: str) -> Callable[[torch.device, int], None]:
    loop = LOOP_BUILDERS.get(name)
    stage = BUILDERS.get(name)

    def run(device: torch.device, seed: int) -> None:
        rng = np.random.default_rng(seed)
        stager = _stager(device)
        for kind in KINDS:
            spec = random_spec(rng, kind)
            if loop is not None:
                loop(stager, spec)
                continue
            assert stage is not None
            with stager.step() as step:
                staged = stage(spec, step, rng)
            staged.result()

    run.__name__ = f"audit_{name}"
    return run


def register_builtin_targets() -> list[str]:
    """Register (or re-register) every builder of :data:`BUILDERS` and :data:`LOOP_BUILDERS` as an
    audit target; returns the names."""
    from attnmeta.sync import register_audit_target

    names = [*BUILDERS, *LOOP_BUILDERS]
    for name in names:
        register_audit_target(name, _target(name), replace=True)
    return names


def run_audit_cli(*, device: str | None, batches: int) -> int:
    """``python -m attnmeta audit``: run every builder under the audit and print the table.

    Returns 0 when every builder is clean, 1 otherwise.
    """
    from attnmeta.sync import format_audit_table, run_audit

    names = register_builtin_targets()
    devs = [device] if device else None
    rows = run_audit(devices=devs, batches=batches, targets=names)
    print(f"attnmeta sync audit: {len(names)} builders x {batches} seeds x {len(KINDS)} batch kinds "
          f"({', '.join(KINDS)})")
    print(format_audit_table(rows))
    return 0 if all(r.clean for r in rows) else 1
