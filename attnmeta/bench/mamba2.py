"""The Mamba2 prefill-step scenario: its workload and bench cases (``python -m attnmeta bench``,
benchmarks/bench_mamba2.py).

One case per batch size (number of prefills); every path performs one whole step, from the host
description to device tensors:

- ``attnmeta``: the generic :func:`attnmeta.builder.build` with the ``"mamba2"`` builder: the common
  metadata with what the builder declares it reads (no per-token arrays) and the Mamba2 metadata
  staged into one step (host derivation in numba, written into the pinned slot), the step's ONE copy,
  then the metadata objects;
- ``reference``: the engine's way (vLLM 0.33.0's ``BaseMambaAttentionMetadataBuilder`` +
  ``Mamba2AttentionMetadataBuilder.build``): raw inputs uploaded, the common fields and
  ``has_initial_states_p`` / ``query_start_loc_p`` / state indices computed on the device, the
  classification on host tensors, the causal-conv1d metadata and the chunk layout by per-request
  Python loops over CPU tensors (:mod:`attnmeta.testing.reference`), each list uploaded on its own;
- ``per-tensor``: attnmeta's host arrays (the same builder staged on a ``Stager("meta")``, which
  copies nothing), each uploaded through its own freshly pinned tensor.

The workload (:func:`prefill_step_spec`): ``P`` prefills of 1..2048 new tokens; every second one
continues a cached context of 1..8192 tokens that is not a multiple of the chunk size (256); chunk size
256, causal-conv1d metadata on, in one of three :data:`MODES`: ``"plain"`` (``"none"`` cache mode),
``"align"`` (``"align"`` cache mode, :data:`ALIGN_BLOCK_SIZE`-token mamba blocks, the state in the
last block of each request) and ``"align+ckpt"`` (also prefill checkpoints, :data:`CHECKPOINT`: about
a quarter of the rows export one).

The step is what vLLM builds for a **Mamba KV-cache group**, on every path:

- in the ``"plain"`` mode the group's block table holds one state block per request
  (``mamba_cache_mode="none"``: the state lives in column 0, docs/semantics-mamba.md, "State
  indices"). The spec says so with a block size of :data:`MAMBA_BLOCK_SIZE` tokens, at least the
  longest sequence, so every request has exactly one block-table column (``block_table_columns`` is
  1). The SSD chunk size is independent of it: ``Mamba2Options.chunk_size`` (256) sets the chunks;
- the group uses ``SlotMappingMode.NONE`` (docs/semantics.md, "Block table and slot mapping"): no
  per-token ``positions`` / ``slot_mapping`` are computed or uploaded, since Mamba layers read
  neither. attnmeta's generic build stages the common metadata so (the builder's ``needs()``); the
  reference and per-tensor paths skip them too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from attnmeta.backends.mamba import CheckpointConfig
from attnmeta.bench.harness import Case, Uploads, blocking_uploader, pinned_uploader
from attnmeta.spec import BatchSpec
from attnmeta.testing.workloads import mixed_spec

__all__ = [
    "ALIGN_BLOCK_SIZE", "CHECKPOINT", "CHUNK_SIZE", "MAMBA_BLOCK_SIZE", "MODES", "OPTIONS", "SIZES", "WALK", "mamba2_cases",
    "options", "prefill_step_spec", "prefill_step_specs", "prefill_step_walks",
]

CHUNK_SIZE = 256
"""SSD chunk size of the workload."""
MAMBA_BLOCK_SIZE = 16384
"""Block size of the Mamba group's block table: at least the longest sequence (2048 new + 8192 cached
tokens), so one block (one state slot, column 0) per request."""
SIZES = (1, 16, 64, 256, 1024)
"""Numbers of prefills benchmarked (``quick``: the first three)."""


MODES = ("plain", "align", "align+ckpt")
"""The builder configurations benchmarked: ``"none"`` cache mode; ``"align"`` cache mode; ``"align"``
with prefill checkpoints."""
ALIGN_BLOCK_SIZE = 1024
"""Mamba block size of the ``"align"`` modes (several blocks per request; the state in the last)."""
CHECKPOINT = CheckpointConfig(hash_block_size=256, cache_hit_alignment_tokens=256, mamba_block_size=ALIGN_BLOCK_SIZE,
                              checkpoint_alignment=256)
"""The ``"align+ckpt"`` mode's checkpoints: fresh prompts longer than a block export one."""


def options(mode: str = "plain") -> Any:
    """The builder options of every path in ``mode`` (one of :data:`MODES`)."""
    from attnmeta.backends.mamba import Mamba2Options

    if mode == "plain":
        return Mamba2Options(chunk_size=CHUNK_SIZE)
    if mode not in MODES:
        raise ValueError(f"mode: {mode!r} is not one of {MODES}")
    return Mamba2Options(chunk_size=CHUNK_SIZE, cache_mode="align",
                         checkpoint=CHECKPOINT if mode == "align+ckpt" else None)


OPTIONS = options()
"""The builder options of every path in the ``"plain"`` mode."""


def prefill_step_spec(rng: np.random.Generator, num_prefills: int, mode: str = "plain") -> BatchSpec:
    """A prefill-only step: ``num_prefills`` prompts of 1..2048 new tokens, every second continuing
    an unaligned context of 1..8192 tokens (:func:`attnmeta.testing.workloads.mixed_spec` without decodes),
    with a Mamba group's block table (``"plain"``: one state block per request, :data:`MAMBA_BLOCK_SIZE`;
    the ``"align"`` modes: blocks of :data:`ALIGN_BLOCK_SIZE`)."""
    return mixed_spec(rng, prefills=num_prefills, decodes=0, chunk=CHUNK_SIZE, max_prompt=2048, max_context=8192,
                      block_size=MAMBA_BLOCK_SIZE if mode == "plain" else ALIGN_BLOCK_SIZE)


WALK = 16
"""Distinct steps per size that the bench paths walk in turn: consecutive prefill steps of an engine
differ, so a bench repeating one step would time caches (views, slot layouts, ``-1`` tails) that a
real loop misses."""


def prefill_step_specs(quick: bool, mode: str = "plain") -> list[BatchSpec]:
    """One step per size of :data:`SIZES` (fixed seed): the first step of each walk of
    :func:`prefill_step_walks`."""
    rng = np.random.default_rng(0)
    return [prefill_step_spec(rng, p, mode) for p in (SIZES[:3] if quick else SIZES)]


def prefill_step_walks(quick: bool, mode: str = "plain") -> list[list[BatchSpec]]:
    """Per size of :data:`SIZES`, :data:`WALK` distinct steps of that many prefills (fixed seeds),
    starting with the step of :func:`prefill_step_specs`."""
    rng = np.random.default_rng(1)
    return [[first, *(prefill_step_spec(rng, first.num_reqs, mode) for _ in range(WALK - 1))]
            for first in prefill_step_specs(quick, mode)]


def _list_uploader(device: torch.device, counter: Uploads) -> Callable[[list[int], torch.dtype], torch.Tensor]:
    """vLLM 0.33.0's ``async_tensor_h2d``: a Python list into a pinned tensor, then a non-blocking copy."""
    pin = device.type == "cuda"

    def up(values: list[int], dtype: torch.dtype) -> torch.Tensor:
        t = torch.tensor(values, dtype=dtype, pin_memory=pin)
        counter.add(t)
        return t.to(device, non_blocking=True)

    return up


def _case(specs: list[BatchSpec], device: torch.device, mode: str = "plain") -> Case:
    """One bench case: every path walks ``specs`` (distinct steps of one size) in turn."""
    from attnmeta.backends.mamba import block_table_columns
    from attnmeta.builder import build, get_builder
    from attnmeta.common import stage_common
    from attnmeta.staging import Stager
    from attnmeta.testing import reference as ref

    opts = options(mode)
    cache_mode, ckpt = opts.cache_mode, opts.checkpoint
    stager = Stager(device)
    ups = {"attnmeta": Uploads(), "reference": Uploads(), "per-tensor": Uploads()}
    C = opts.chunk_size
    n = len(specs)
    cols = [block_table_columns(s, opts) for s in specs]
    tables = [np.ascontiguousarray(s.block_table[:, :w]) for s, w in zip(specs, cols)]
    at = {"attnmeta": 0, "reference": 0, "per-tensor": 0}  # each path's position in the walk

    def nxt(path: str) -> int:
        i = at[path]
        at[path] = (i + 1) % n
        return i

    def attnmeta_step() -> Any:
        i = nxt("attnmeta")
        st = stager.stats
        copies, nbytes = st.copies, st.bytes
        m: Any = build(specs[i], stager, "mamba2", opts)
        ups["attnmeta"].copies += st.copies - copies
        ups["attnmeta"].bytes += st.bytes - nbytes
        return m

    raw = blocking_uploader(device, ups["reference"])
    lists = _list_uploader(device, ups["reference"])
    host_t = [(torch.from_numpy(s.num_computed_tokens.copy()), torch.from_numpy(s.num_scheduled_tokens.copy()),
               torch.from_numpy(s.num_prompt_tokens.copy())) for s in specs if s.num_prompt_tokens is not None]
    assert len(host_t) == n, "the Mamba2 bench specs carry prompt lengths"

    def reference_step() -> Any:
        i = nxt("reference")
        spec, table = specs[i], tables[i]
        c_cpu, q_cpu, prompt_cpu = host_t[i]
        B, T, bs = spec.padded_num_reqs, spec.padded_num_tokens, spec.block_size
        # the runner: raw inputs uploaded, common fields on the device, host copies of qsl / lengths;
        # a Mamba group (SlotMappingMode.NONE) computes no positions / slot_mapping
        c, q, bt = raw(spec.num_computed_tokens), raw(spec.num_scheduled_tokens), raw(table)
        qsl, seq_lens = ref.ref_query_start_loc(q, B), ref.ref_seq_lens(c, q, B)
        qsl_cpu = ref.ref_query_start_loc(q_cpu, B)
        ub_cpu = ref.ref_seq_lens(c_cpu, q_cpu, B)
        isp_cpu = ref.ref_is_prefilling(c_cpu, prompt_cpu, B)
        # the Mamba2 builder
        isp, _ = ref.ref_classify_mamba_rows(qsl_cpu, ub_cpu, isp_cpu)
        D, P, Dt, _Pt = ref.ref_split_decodes_and_prefills(qsl_cpu, T, spec.max_query_len, 1, False, False, isp)
        si = ref.ref_mamba_state_indices(bt, seq_lens, mamba_block_size=bs, mode=cache_mode, num_state_columns=1)
        out: dict[str, Any] = {"state_indices_tensor_d": si[:D], "state_indices_tensor_p": si[D:, 0]}
        if P > 0:
            nc = seq_lens - torch.diff(qsl)
            out["query_start_loc_p"] = qsl[-P - 1 :] - Dt
            out["has_initial_states_p"] = nc[B - P : B] > 0
            conv = ref.ref_causal_conv1d_metadata(qsl_cpu[-P - 1 :] - Dt, device=device)
            ups["reference"].add(conv["mlist"])
            ups["reference"].add(conv["offsetlist"])
            nc_p_cpu, qsl_p_cpu = ref.ref_prefill_cpu_metadata(qsl_cpu, ub_cpu, B, P, Dt)
            out["prep_initial_states"] = bool(torch.any(nc_p_cpu > 0).item())
            offsets = None
            if ckpt is not None:  # the checkpoint rules per row, vLLM's device gather, each list uploaded
                cp = ref.ref_prefill_checkpoints(ub_cpu[B - P :], torch.diff(qsl_p_cpu), bt[B - P :], config=ckpt,
                                                 device=device)
                if cp is not None:
                    offsets = cp[0].cpu().tolist()
                    out["checkpoint_meta"] = cp
            cu, sidx, last, ck = ref.ref_chunk_metadata_lists(C, nc_p_cpu, qsl_p_cpu, offsets)
            out["cu_chunk_seqlen_p"] = lists(cu, torch.int32)
            out["seq_idx_p"] = lists(sidx, torch.int32)
            out["last_chunk_indices_p"] = lists(last, torch.int32)
            if offsets is not None:
                out["checkpoint_chunk_idx"] = lists([max(x, 0) for x in ck], torch.int64)
            out["batch_ptr"] = conv["batch_ptr"]
        return out

    per = pinned_uploader(device, ups["per-tensor"])

    host_only = Stager("meta")  # the same derivation, nothing copied: its arrays go up one by one
    mamba2 = get_builder("mamba2")

    def per_tensor_step() -> Any:
        spec = specs[nxt("per-tensor")]
        needs = mamba2.needs(spec.shape, opts)
        with host_only.step() as step:
            common = stage_common(spec, step, token_arrays=needs.token_arrays, paged_kv=needs.paged_kv,
                                  block_table_columns=needs.block_table_columns)
            mamba2.stage(common, step, opts)
        return {name: per(step.host(name)) for name in step.field_names}

    name = "mamba2-prefill" if mode == "plain" else f"mamba2-prefill-{mode}"
    return Case(name, specs[0].num_reqs,
                {"attnmeta": attnmeta_step, "reference": reference_step, "per-tensor": per_tensor_step},
                ups, stager)


def mamba2_cases(device: torch.device, quick: bool, mode: str = "plain") -> list[Case]:
    """The ``mamba2-prefill`` scenario: one :class:`attnmeta.bench.Case` per number of prefills.

    Parameters
    ----------
    device : torch.device
        Where the device tensors live (``cuda`` or ``cpu``).
    quick : bool
        Only 1, 16 and 64 prefills.
    mode : str, default "plain"
        One of :data:`MODES` (the cases of another mode are named ``mamba2-prefill-<mode>``).

    Returns
    -------
    list of attnmeta.bench.Case
        Paths ``"attnmeta"``, ``"reference"`` and ``"per-tensor"``, each performing one whole step;
        each path walks the :data:`WALK` distinct steps of its size (:func:`prefill_step_walks`) in
        turn.
    """
    return [_case(walk, torch.device(device), mode) for walk in prefill_step_walks(quick, mode)]
