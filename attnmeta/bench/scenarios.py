"""The curated scenarios of ``python -m attnmeta bench``: whole steps the way engines build them.

Each scenario function takes ``(device, quick)`` and returns one :class:`~attnmeta.bench.harness.Case`
per batch size, whose paths each perform one whole step:

- ``attnmeta``: the host derivation written straight into a pinned staging slot, ONE packed copy,
  then the metadata objects (``.result()``);
- ``reference``: the device-side computations of :mod:`attnmeta.testing.reference` from raw
  uploads (``torch.as_tensor(array, device=...)``), host scalars read back with ``.item()``: the way
  engines built metadata before;
- ``per-tensor``: attnmeta's host arrays (the same builders staged on a ``Stager("meta")``, which
  copies nothing), each uploaded through its own freshly pinned tensor (``async_tensor_h2d`` style:
  race-free, one allocation and one copy per array);
- ``fused`` (``decode`` and ``spec-decode-k3``): :class:`attnmeta.backends.fused.FusedStepBuilder`
  on a stager of its own, the same three metadata objects as ``attnmeta`` from one call per step.

The decode workloads walk :data:`DECODE_STEPS` successive decode steps (every context grows by one
token a step), cycled; the mixed workloads walk :data:`MIXED_STEPS` distinct steps: an engine's
consecutive steps differ, and a bench that repeats one step would time per-shape caches that a real
loop misses. :data:`CURATED` lists the scenarios by name; :mod:`attnmeta.bench.builders` adds one
per registered builder.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from attnmeta.backends import flash_attn, flashinfer
from attnmeta.bench.harness import Case, Uploads, blocking_uploader, pinned_uploader
from attnmeta.bench.mamba2 import mamba2_cases
from attnmeta.common import stage_common
from attnmeta.spec import BatchSpec, spec_arguments
from attnmeta.staging import Staged, Stager
from attnmeta.testing.workloads import advance, decode_spec, mixed_spec

__all__ = [
    "CURATED",
    "DECODE_STEPS",
    "MIXED_STEPS",
    "ScenarioFn",
    "decode",
    "decode_common",
    "decode_walks",
    "fast_prefill",
    "fused_step",
    "local_attention",
    "mamba2_prefill",
    "mixed",
    "mixed_common",
    "spec_decode",
    "spec_decode_walks",
    "staging",
    "ubatch",
]

ScenarioFn = Callable[[torch.device, bool], list[Case]]
"""A scenario: ``(device, quick) -> cases``, one :class:`Case` per batch size."""

DECODE_STEPS = 64
"""Successive decode steps each decode case cycles through (contexts grow by one token a step)."""

MIXED_STEPS = 16
"""Distinct mixed steps the ``mixed`` and ``mixed-common`` paths walk in turn (an engine's mixed
steps differ in token count, longest sequence and page count every step)."""

StageExtra = Callable[[Any, Any], Any]
RefExtra = Callable[[BatchSpec], Callable[[dict[str, Any], Callable[[np.ndarray], torch.Tensor]], Any]]


# ------------------------------------------------------------------------------------ the three paths
def _common_case(specs: list[BatchSpec], device: torch.device, stage_extra: StageExtra | None,
                 ref_extra: RefExtra | None, common_kwargs: dict[str, Any]) -> Case:
    """One :class:`Case` whose three paths each perform one whole step of the common metadata (plus
    the extras); successive calls of a path walk through ``specs`` in a cycle."""
    from attnmeta.testing import reference as ref

    stager = Stager(device)
    host_only = Stager("meta")  # the per-tensor path: the same derivation, nothing copied
    ups = {"reference": Uploads(), "per-tensor": Uploads()}
    steps = [(s, ref_extra(s) if ref_extra is not None else None) for s in specs]
    n = len(steps)
    at = {"attnmeta": 0, "reference": 0, "per-tensor": 0}

    def next_step(path: str) -> tuple[BatchSpec, Any]:
        i = at[path]
        at[path] = (i + 1) % n
        return steps[i]

    def attnmeta_step() -> Any:  # copies and bytes: counted from stager.stats by the harness
        spec = next_step("attnmeta")[0]
        with stager.step() as step:
            common = stage_common(spec, step, **common_kwargs)
            extra = stage_extra(common, step) if stage_extra is not None else None
        out = common.result()
        return out if extra is None else (out, extra.result())

    raw = blocking_uploader(device, ups["reference"])

    def reference_step() -> Any:
        spec, r_extra = next_step("reference")
        W = int(-(-spec.max_seq_len // spec.block_size)) if spec.num_reqs else 1
        c, q = raw(spec.num_computed_tokens), raw(spec.num_scheduled_tokens)
        bt = raw(np.ascontiguousarray(spec.block_table[:, :W]))
        Bp, Tp = spec.padded_num_reqs, spec.padded_num_tokens
        fields = {
            "query_start_loc": ref.ref_query_start_loc(q, Bp),
            "seq_lens": ref.ref_seq_lens(c, q, Bp),
            "block_table": bt,
        }
        fields["positions"], fields["slot_mapping"] = ref.ref_token_layout(c, q, bt, spec.block_size, Tp)
        if r_extra is not None:
            return r_extra(fields, raw)
        return fields

    per = pinned_uploader(device, ups["per-tensor"])

    def per_tensor_step() -> Any:
        spec = next_step("per-tensor")[0]
        with host_only.step() as step:
            common = stage_common(spec, step, **common_kwargs)
            if stage_extra is not None:
                stage_extra(common, step)
        return {name: per(step.host(name)) for name in step.field_names}

    return Case("", specs[0].num_reqs, {"attnmeta": attnmeta_step, "reference": reference_step,
                                        "per-tensor": per_tensor_step}, ups, stager)


def _scenario(name: str, specs: Sequence[tuple[int, BatchSpec | list[BatchSpec]]], device: torch.device,
              stage_extra: StageExtra | None = None, ref_extra: RefExtra | None = None,
              common_kwargs: dict[str, Any] | None = None) -> list[Case]:
    cases = []
    for batch, spec in specs:
        case = _common_case(spec if isinstance(spec, list) else [spec], device, stage_extra, ref_extra,
                            common_kwargs or {})
        case.scenario, case.batch = name, batch
        cases.append(case)
    return cases


# ------------------------------------------------------------------------------------ FlashAttention + FlashInfer
_PAGED = {"paged_kv": True}  # a FlashInfer builder follows: the common pass builds the page table too


class _Both:
    """Two staged builders of one step; ``result()`` finishes both (the bench builds every object)."""

    __slots__ = ("a", "b")

    def __init__(self, a: Staged[Any, Any], b: Staged[Any, Any]) -> None:
        self.a, self.b = a, b

    def result(self) -> tuple[Any, Any]:
        return self.a.result(), self.b.result()


def _stage_fa_fi(common: Any, step: Any) -> _Both:
    return _Both(flash_attn.stage(common, step), flashinfer.stage(common, step))


def _ref_fa_fi(spec: BatchSpec) -> Callable[[dict[str, Any], Callable[[np.ndarray], torch.Tensor]], Any]:
    from attnmeta.testing import reference as ref

    def extra(fields: dict[str, Any], up: Callable[[np.ndarray], torch.Tensor]) -> Any:
        sl = fields["seq_lens"]
        qsl = fields["query_start_loc"]
        fields["max_query_len"] = int((qsl[1:] - qsl[:-1]).max().item())  # engines read maxima back
        fields["max_seq_len"] = int(sl.max().item())
        fields["paged_kv_indptr"] = ref.ref_paged_kv_indptr(sl, spec.block_size)
        fields["paged_kv_indices"] = ref.ref_paged_kv_indices(fields["block_table"], sl, spec.block_size)
        fields["paged_kv_last_page_len"] = ref.ref_paged_kv_last_page_len(sl, spec.block_size)
        return fields

    return extra


def decode_walks(quick: bool) -> list[tuple[int, list[BatchSpec]]]:
    """The ``(batch, steps)`` of the :func:`decode` scenario.

    Parameters
    ----------
    quick : bool
        Batch 1, 8 and 64 only (else also 256 and 1024).

    Returns
    -------
    list of (int, list of BatchSpec)
        Per batch size, :data:`DECODE_STEPS` successive decode steps (contexts uniform in [1, 2048),
        growing one token a step; a 2048-column block table, page size 16); the same specs every call.
    """
    rng = np.random.default_rng(0)
    sizes = [1, 8, 64] if quick else [1, 8, 64, 256, 1024]
    return [(b, advance(decode_spec(b, rng), DECODE_STEPS)) for b in sizes]


def spec_decode_walks(quick: bool) -> list[tuple[int, list[BatchSpec]]]:
    """The ``(batch, steps)`` of the :func:`spec_decode` scenario.

    Parameters
    ----------
    quick : bool
        Batch 8 and 64 only (else also 256).

    Returns
    -------
    list of (int, list of BatchSpec)
        Per batch size, :data:`DECODE_STEPS` successive steps of 3 draft tokens a request (4 query
        tokens); the same specs every call.
    """
    rng = np.random.default_rng(2)
    sizes = [8, 64] if quick else [8, 64, 256]
    return [(b, advance(decode_spec(b, rng, drafts=3), DECODE_STEPS)) for b in sizes]


def fused_step(specs: list[BatchSpec], device: torch.device, threads: int = 1,
               with_spec: bool = False, check_lifetimes: bool = True) -> tuple[Callable[[], Any], Stager]:
    """A ``fused`` path: :class:`attnmeta.backends.fused.FusedStepBuilder` on a stager of its own.

    Parameters
    ----------
    specs : list of BatchSpec
        The steps; each call of the path builds the next one (cycled).
    device : torch.device
        Where the stager stages.
    threads : int, default 1
        The builder's ``threads``.
    with_spec : bool, default False
        Construct each step's :class:`~attnmeta.BatchSpec` (validation included) from the spec's
        arrays inside the step, as an engine does each step from its scheduler's (writable) arrays.
    check_lifetimes : bool, default True
        The stager's ``check_lifetimes`` (False: the opt-out, for its A/B).

    Returns
    -------
    (callable, Stager)
        The path (each call one whole step) and the stager counting its copies.
    """
    from attnmeta.backends.fused import FusedStepBuilder

    builder = FusedStepBuilder(Stager(device, check_lifetimes=check_lifetimes), threads=threads)
    at = [0]
    args: list[dict[str, Any]] | None = (
        [{k: v.copy() if isinstance(v, np.ndarray) and v.ndim == 1 else v for k, v in spec_arguments(s).items()}
         for s in specs]  # (writable vectors, as an engine's; the walk's one block table, as an engine's)
        if with_spec else None)

    def step() -> Any:
        i = at[0]
        at[0] = (i + 1) % len(specs)
        return builder.build(specs[i] if args is None else BatchSpec(**args[i]))

    return step, builder.stager


def _with_fused(cases: list[Case], walks: list[tuple[int, list[BatchSpec]]], device: torch.device) -> list[Case]:
    """``cases`` with a ``fused`` path each, walking the case's specs in a cycle."""
    for case, (_b, specs) in zip(cases, walks):
        case.paths["fused"], case.stagers["fused"] = fused_step(specs, device)
    return cases


def decode(device: torch.device, quick: bool) -> list[Case]:
    """``decode``: a decode step's common + FlashAttention + FlashInfer metadata in one copy, batch
    1 to 1024 (:func:`decode_walks`), with the ``fused`` path.

    Parameters
    ----------
    device : torch.device
        Where the metadata goes.
    quick : bool
        Small batches only.

    Returns
    -------
    list of Case
        One per batch size.
    """
    walks = decode_walks(quick)
    return _with_fused(_scenario("decode", walks, device, _stage_fa_fi, _ref_fa_fi, _PAGED),
                       walks, device)


def spec_decode(device: torch.device, quick: bool) -> list[Case]:
    """``spec-decode-k3``: spec decode with 3 drafts a request (4 query tokens), FlashAttention +
    FlashInfer, batch 8 to 256 (:func:`spec_decode_walks`), with the ``fused`` path.

    Parameters
    ----------
    device : torch.device
        Where the metadata goes.
    quick : bool
        Small batches only.

    Returns
    -------
    list of Case
        One per batch size.
    """
    walks = spec_decode_walks(quick)
    cases = _scenario("spec-decode-k3", walks, device, _stage_fa_fi, _ref_fa_fi, _PAGED)
    return _with_fused(cases, walks, device)


def _mixed_walk(quick: bool, seed: int = 1) -> list[BatchSpec]:
    rng = np.random.default_rng(seed)
    return [mixed_spec(rng, prefills=8 if quick else 64, decodes=24 if quick else 192) for _ in range(MIXED_STEPS)]


def mixed(device: torch.device, quick: bool) -> list[Case]:
    """``mixed``: 64 prefills of up to 2k tokens (every second continuing an unaligned cached
    context) + 192 decodes, FlashAttention + FlashInfer; :data:`MIXED_STEPS` distinct such steps.

    Parameters
    ----------
    device : torch.device
        Where the metadata goes.
    quick : bool
        8 prefills + 24 decodes.

    Returns
    -------
    list of Case
        One case.
    """
    walk = _mixed_walk(quick)
    return _scenario("mixed", [(walk[0].num_reqs, walk)], device, _stage_fa_fi, _ref_fa_fi, _PAGED)


# ------------------------------------------------------------------------------------ KV-sharing fast prefill
def _last_tokens(spec: BatchSpec) -> np.ndarray:
    """The logits indices of the plain sampling case: each scheduled request's last token."""
    ends = np.cumsum(spec.num_scheduled_tokens, dtype=np.int64)
    return (ends - 1)[spec.num_scheduled_tokens > 0].astype(np.int32)


def fast_prefill(device: torch.device, quick: bool) -> list[Case]:
    """``fast-prefill``: the KV-sharing fast-prefill batch (the logits-only batch) of a mixed step.

    The reference path computes it on the device and reads its ``query_start_loc`` back with a
    sync (the safe form of vLLM 0.33's pending device-to-host copy).

    Parameters
    ----------
    device : torch.device
        Where the metadata goes.
    quick : bool
        8 prefills + 24 decodes (else 64 + 192).

    Returns
    -------
    list of Case
        One case.
    """
    from attnmeta.backends import fast_prefill as fp
    from attnmeta.testing import reference as ref

    rng = np.random.default_rng(3)
    spec = mixed_spec(rng, prefills=8 if quick else 64, decodes=24 if quick else 192)
    li = _last_tokens(spec)

    def stage_extra(common: Any, step: Any) -> Any:
        return fp.stage(common, step, None, fp.FastPrefillInputs(logits_indices=li))

    def ref_extra(s: BatchSpec) -> Callable[[dict[str, Any], Callable[[np.ndarray], torch.Tensor]], Any]:
        def extra(fields: dict[str, Any], up: Callable[[np.ndarray], torch.Tensor]) -> Any:
            li_d = up(li)
            dqsl = ref.ref_fast_prefill_query_start_loc(fields["query_start_loc"], li_d)
            fields["fast_query_start_loc"] = dqsl
            fields["fast_query_start_loc_cpu"] = dqsl.cpu()  # vLLM 0.33's pending D2H, made safe by a sync
            fields["max_query_len"] = ref.ref_max_logits_per_req(dqsl)
            return fields
        return extra

    return _scenario("fast-prefill", [(spec.num_reqs, spec)], device, stage_extra, ref_extra)


# ------------------------------------------------------------------------------------ chunked local attention
def local_attention(device: torch.device, quick: bool) -> list[Case]:
    """``local-attention``: chunked local attention (Llama-4 style, chunks of 8192 tokens, page 16)
    of a mixed step. The reference path reads ``query_start_loc`` and ``seq_lens`` back (vLLM 0.33's
    sync), runs the host algorithm and uploads its results.

    Parameters
    ----------
    device : torch.device
        Where the metadata goes.
    quick : bool
        8 prefills + 24 decodes (else 64 + 192).

    Returns
    -------
    list of Case
        One case.
    """
    from attnmeta.backends import local_attn as la
    from attnmeta.testing import reference as ref

    rng = np.random.default_rng(4)
    spec = mixed_spec(rng, prefills=8 if quick else 64, decodes=24 if quick else 192)
    chunk = 8192
    opts = la.LocalAttentionOptions(attn_chunk_size=chunk)

    def stage_extra(common: Any, step: Any) -> Any:
        return la.stage(common, step, opts)

    def ref_extra(s: BatchSpec) -> Callable[[dict[str, Any], Callable[[np.ndarray], torch.Tensor]], Any]:
        def extra(fields: dict[str, Any], up: Callable[[np.ndarray], torch.Tensor]) -> Any:
            qsl_cpu = fields["query_start_loc"].cpu()
            sl_cpu = fields["seq_lens"].cpu()
            out = ref.ref_local_virtual_batches(qsl_cpu, sl_cpu, chunk, s.block_size)
            return fields, [up(np.asarray(x)) for x in out[:2]]
        return extra

    return _scenario("local-attention", [(spec.num_reqs, spec)], device, stage_extra, ref_extra)


# ------------------------------------------------------------------------------------ common metadata alone
def decode_common(device: torch.device, quick: bool) -> list[Case]:
    """``decode-common``: the common metadata alone of the :func:`decode` walks.

    Parameters
    ----------
    device : torch.device
        Where the metadata goes.
    quick : bool
        Small batches only.

    Returns
    -------
    list of Case
        One per batch size.
    """
    return _scenario("decode-common", decode_walks(quick), device)


def mixed_common(device: torch.device, quick: bool) -> list[Case]:
    """``mixed-common``: the common metadata alone of the :func:`mixed` walk.

    Parameters
    ----------
    device : torch.device
        Where the metadata goes.
    quick : bool
        8 prefills + 24 decodes (else 64 + 192).

    Returns
    -------
    list of Case
        One case.
    """
    walk = _mixed_walk(quick)
    return _scenario("mixed-common", [(walk[0].num_reqs, walk)], device)


# ------------------------------------------------------------------------------------ Mamba2, staging
def mamba2_prefill(device: torch.device, quick: bool) -> list[Case]:
    """``mamba2-prefill``: the whole Mamba2 prefill step of a Mamba KV-cache group at 1 to 1024
    prefills (chunk 256), against the engine's per-request loops.

    Parameters
    ----------
    device : torch.device
        Where the metadata goes.
    quick : bool
        1, 16 and 64 prefills only.

    Returns
    -------
    list of Case
        One per number of prefills.
    """
    return mamba2_cases(device, quick)


def staging(device: torch.device, quick: bool) -> list[Case]:
    """``staging-8-arrays``: eight prepared int32/int64 arrays (a step's worth, about 29 KB) moved to
    the device three ways: one packed pinned copy through a :class:`~attnmeta.Stager`, eight per-call
    pinned uploads, eight ``torch.as_tensor(array, device=...)`` blocking uploads (the reference).

    Parameters
    ----------
    device : torch.device
        Where the arrays go.
    quick : bool
        Unused (one case either way).

    Returns
    -------
    list of Case
        One case.
    """
    rng = np.random.default_rng(5)
    arrays = [rng.integers(0, 1 << 20, size=n).astype(dt) for n, dt in
              [(257, np.int32), (256, np.int32), (256, np.int32), (1024, np.int64), (1024, np.int64),
               (256, np.int32), (2048, np.int32), (256, np.int32)]]
    names = [f"a{i}" for i in range(len(arrays))]
    stager = Stager(device)
    ups = {"reference": Uploads(), "per-tensor": Uploads()}

    def attnmeta_step() -> list[torch.Tensor]:
        with stager.step() as step:
            for name, a in zip(names, arrays):
                step.stage(name, a)
        return [step.device(name) for name in names]

    raw = blocking_uploader(device, ups["reference"])
    per = pinned_uploader(device, ups["per-tensor"])
    return [Case("staging-8-arrays", len(arrays), {
        "attnmeta": attnmeta_step,
        "reference": lambda: [raw(a) for a in arrays],
        "per-tensor": lambda: [per(a) for a in arrays],
    }, ups, stager)]


# ------------------------------------------------------------------------------------ micro-batches (DBO)
def ubatch(device: torch.device, quick: bool) -> list[Case]:
    """``ubatch``: a mixed step of 256 requests (64 prefills + 192 decodes, padded) in 2 micro-batches:
    attnmeta stages every micro-batch's common metadata in ONE copy (:func:`attnmeta.ubatch.stage_ubatches`);
    the reference builds the parent from raw uploads and slices it per micro-batch on the device, as
    vLLM's ``split_attn_metadata`` does; :data:`MIXED_STEPS` distinct steps.

    Parameters
    ----------
    device : torch.device
        Where the metadata goes.
    quick : bool
        8 prefills + 24 decodes.

    Returns
    -------
    list of Case
        One case.
    """
    from attnmeta.testing import reference as ref
    from attnmeta.ubatch import stage_ubatches, ubatch_slices

    walk = []
    for s in _mixed_walk(quick, seed=7):
        args = spec_arguments(s)
        args["num_reqs_padded"], args["num_tokens_padded"] = s.num_reqs + 3, s.num_tokens + 13
        walk.append(BatchSpec(**args))
    plans = [ubatch_slices(s.num_scheduled_tokens, s.padded_num_tokens, s.padded_num_reqs, 2).padded_slices
             for s in walk]
    stager = Stager(device)
    ups = {"reference": Uploads()}
    raw = blocking_uploader(device, ups["reference"])
    at = {"attnmeta": 0, "reference": 0}

    def next_step(path: str) -> int:
        i = at[path]
        at[path] = (i + 1) % len(walk)
        return i

    def attnmeta_step() -> Any:
        i = next_step("attnmeta")
        with stager.step() as step:
            ubs = stage_ubatches(walk[i], step, plans[i])
        return [u.result() for u in ubs]

    def reference_step() -> Any:
        i = next_step("reference")
        spec = walk[i]
        B, Bp, Tp = spec.num_reqs, spec.padded_num_reqs, spec.padded_num_tokens
        W = max(1, -(-spec.max_exact_seq_len // spec.block_size))
        c, q = raw(spec.num_computed_tokens), raw(spec.num_scheduled_tokens)
        bt = torch.zeros((Bp, W), dtype=torch.int32, device=device)
        bt[:B] = raw(np.ascontiguousarray(spec.block_table[:B, :W]))
        qsl = ref.ref_query_start_loc(q, Bp)
        sl = ref.ref_seq_lens(c, q, Bp)
        pos, slots = ref.ref_token_layout(c, q, bt, spec.block_size, Tp)
        qsl_cpu = qsl.cpu()
        return ref.ref_split_attn_metadata(
            [(u.request_slice, u.token_slice) for u in plans[i]], qsl, qsl_cpu, sl, sl.cpu(), bt, slots, pos,
            int(torch.diff(qsl_cpu).max().item()), int(sl.max().item()))

    return [Case("ubatch", walk[0].num_reqs, {"attnmeta": attnmeta_step, "reference": reference_step}, ups, stager)]


CURATED: dict[str, ScenarioFn] = {
    "staging": staging,
    "decode": decode,
    "mixed": mixed,
    "spec-decode-k3": spec_decode,
    "mamba2-prefill": mamba2_prefill,
    "fast-prefill": fast_prefill,
    "local-attention": local_attention,
    "decode-common": decode_common,
    "mixed-common": mixed_common,
    "ubatch": ubatch,
}
"""The curated scenarios by ``--scenario`` name, in the order the bench runs them."""
