"""Benchmark scenarios for ``python -m attnmeta bench`` (see :mod:`attnmeta.bench`).

Each scenario builds, for each batch size, one callable per path that performs a whole step:
``attnmeta`` (host derivation into the pinned slot + one copy), ``reference`` (device-side reference
computations from raw uploads, the way engines did it) and ``per-tensor`` (attnmeta's host arrays,
each uploaded through its own freshly pinned tensor).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from attnmeta.testing.workloads import advance, decode_spec, mixed_spec
from attnmeta.backends import flash_attn, flashinfer
from attnmeta.bench import Case, Uploads
from attnmeta.metadata import stage_common
from attnmeta.profile import StaticProfile
from attnmeta.spec import BatchSpec, spec_arguments

__all__ = ["GRAPH_PROFILE", "SCENARIOS", "composable_step", "decode_walks", "fused_step", "spec_decode_walks"]



# ------------------------------------------------------------------------------------ uploads
def _uploader(device: torch.device, counter: Uploads) -> Callable[[np.ndarray], torch.Tensor]:
    """Per-tensor upload the way ``async_tensor_h2d`` does it: a fresh pinned tensor per array."""
    pin = device.type == "cuda"

    def up(a: np.ndarray) -> torch.Tensor:
        counter.add(a)
        t = torch.from_numpy(np.ascontiguousarray(a))
        if pin:
            return t.pin_memory().to(device, non_blocking=True)
        return t.clone()

    return up


def _raw_uploader(device: torch.device, counter: Uploads) -> Callable[[np.ndarray], torch.Tensor]:
    """The engine-style upload of raw inputs: ``torch.as_tensor(np, device=...)`` (blocking H2D)."""

    def up(a: np.ndarray) -> torch.Tensor:
        counter.add(a)
        return torch.as_tensor(a, device=device)

    return up


# ------------------------------------------------------------------------------------ batches
# ------------------------------------------------------------------------------------ paths
def _common_paths(specs: list[BatchSpec], device: torch.device, stage_extra: Callable[[Any, Any], Any] | None,
                  ref_extra: Callable[[BatchSpec], Callable[..., Any]] | None,
                  host_extra: Callable[[BatchSpec], Callable[..., Any]] | None,
                  common_kwargs: dict[str, Any] | None = None) -> Case:
    """One :class:`Case` whose paths each perform one whole step; successive calls of a path walk
    through ``specs`` in a cycle (one spec: the same step every time)."""
    from attnmeta.host import layout
    from attnmeta.metadata import stage_common
    from attnmeta.staging import Stager
    from attnmeta.testing import reference as ref

    stager = Stager(device)
    ups = {"attnmeta": Uploads(), "reference": Uploads(), "per-tensor": Uploads()}
    steps = [(s, ref_extra(s) if ref_extra is not None else None, host_extra(s) if host_extra is not None else None)
             for s in specs]
    n = len(steps)
    at = {"attnmeta": 0, "reference": 0, "per-tensor": 0}
    kw = common_kwargs or {}

    def next_step(path: str) -> tuple[BatchSpec, Any, Any]:
        i = at[path]
        at[path] = (i + 1) % n
        return steps[i]

    def attnmeta_step() -> Any:  # copies and bytes: counted from stager.stats by the harness
        spec = next_step("attnmeta")[0]
        with stager.step() as step:
            common = stage_common(spec, step, **kw)
            extra = stage_extra(common, step) if stage_extra is not None else None
        out = common.result()
        return out if extra is None else (out, extra.result())

    raw = _raw_uploader(device, ups["reference"])

    def reference_step() -> Any:
        spec, r_extra, _ = next_step("reference")
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

    per = _uploader(device, ups["per-tensor"])

    def per_tensor_step() -> Any:
        spec, _, h_extra = next_step("per-tensor")
        W = int(-(-spec.max_seq_len // spec.block_size)) if spec.num_reqs else 1
        c, q = spec.num_computed_tokens, spec.num_scheduled_tokens
        Bp, Tp = spec.padded_num_reqs, spec.padded_num_tokens
        host = {
            "query_start_loc": layout.query_start_loc(q, num_reqs_padded=Bp),
            "seq_lens": layout.seq_lens(c, q, num_reqs_padded=Bp),
            "block_table": np.ascontiguousarray(spec.block_table[:, :W]),
        }
        host["positions"], host["slot_mapping"] = layout.token_layout(
            c, q, spec.block_table, spec.block_size, num_tokens_padded=Tp)
        if h_extra is not None:
            host.update(h_extra(host))
        return {k: per(v) for k, v in host.items()}

    return Case("", specs[0].num_reqs, {"attnmeta": attnmeta_step, "reference": reference_step,
                                        "per-tensor": per_tensor_step}, ups, stager)


def _scenario(name: str, specs: Sequence[tuple[int, BatchSpec | list[BatchSpec]]], device: torch.device,
              stage_extra: Callable[[Any, Any], Any] | None = None,
              ref_extra: Callable[[BatchSpec], Callable[..., Any]] | None = None,
              host_extra: Callable[[BatchSpec], Callable[..., Any]] | None = None,
              common_kwargs: dict[str, Any] | None = None,
              ) -> list[Case]:
    cases = []
    for batch, spec in specs:
        case = _common_paths(spec if isinstance(spec, list) else [spec], device, stage_extra, ref_extra, host_extra,
                             common_kwargs)
        case.scenario, case.batch = name, batch
        cases.append(case)
    return cases


def _scenario_common(name: str, specs: list[tuple[int, BatchSpec | list[BatchSpec]]], device: torch.device,
                     ) -> list[Case]:
    return _scenario(name, specs, device)


# ---- FlashAttention + FlashInfer (decode, spec decode)
_PAGED = {"paged_kv": True}  # a FlashInfer builder follows: the common pass builds the page table too


def _stage_fa_fi(common: Any, step: Any) -> Any:
    return _Both(flash_attn.stage(common, step), flashinfer.stage(common, step))


class _Both:
    """Two staged builders of one step; ``result()`` finishes both (the bench builds every object)."""

    __slots__ = ("a", "b")

    def __init__(self, a: Any, b: Any) -> None:
        self.a, self.b = a, b

    def result(self) -> tuple[Any, Any]:
        return self.a.result(), self.b.result()


def _ref_fa_fi(spec: BatchSpec) -> Callable[[dict[str, torch.Tensor], Callable[[np.ndarray], torch.Tensor]], Any]:
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


def _host_fa_fi(spec: BatchSpec) -> Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]:
    from attnmeta.host import paged

    def extra(host: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        lay = paged.paged_kv_layout(host["seq_lens"], spec.block_table, spec.block_size)
        return {"paged_kv_indptr": lay.paged_kv_indptr, "paged_kv_indices": lay.paged_kv_indices,
                "paged_kv_last_page_len": lay.paged_kv_last_page_len}

    return extra


DECODE_STEPS = 64
"""Successive decode steps each decode case cycles through (contexts grow by one token a step)."""


def decode(device: torch.device, quick: bool) -> list[Case]:
    """A decode step: common + FlashAttention + FlashInfer metadata in one copy; batch 1..1024,
    contexts uniform in [1, 2048) growing by one token each step (:data:`DECODE_STEPS` successive
    steps, cycled), a 2048-column block table, page size 16. A fourth path, ``fused``, builds the
    same objects with :class:`attnmeta.backends.fused.FusedStepBuilder`."""
    walks = decode_walks(quick)
    return _with_fused(_scenario("decode", walks, device, _stage_fa_fi, _ref_fa_fi, _host_fa_fi, _PAGED), walks, device)


def _with_fused(cases: list[Case], walks: list[tuple[int, list[BatchSpec]]], device: torch.device) -> list[Case]:
    """``cases`` with a ``fused`` path each: a FusedStepBuilder on a stager of its own (its copies
    counted apart), walking the case's specs in a cycle."""
    for case, (_b, specs) in zip(cases, walks):
        case.paths["fused"], case.stagers["fused"] = fused_step(specs, device)
        case.uploads["fused"] = Uploads()
    return cases


def fused_step(specs: list[BatchSpec], device: torch.device, threads: int = 1,
               with_spec: bool = False) -> tuple[Callable[[], Any], Any]:
    """``(step, stager)``: each call of ``step`` builds the next of ``specs`` (cycled) with a
    :class:`attnmeta.backends.fused.FusedStepBuilder` (``threads``) on a stager of its own. With
    ``with_spec`` the step first constructs that :class:`BatchSpec` (validation included) from the
    spec's arrays, as an engine does each step from its scheduler's arrays."""
    from attnmeta.backends.fused import FusedStepBuilder
    from attnmeta.staging import Stager

    builder = FusedStepBuilder(Stager(device), threads=threads)
    at = [0]
    args = [spec_arguments(s) for s in specs] if with_spec else None

    def step() -> Any:
        i = at[0]
        at[0] = (i + 1) % len(specs)
        return builder.build(specs[i] if args is None else BatchSpec(**args[i]))

    return step, builder.stager


GRAPH_PROFILE = StaticProfile(max_num_reqs=1024, max_num_tokens=1024, max_blocks_per_req=2048 // 16 + 8, block_size=16)
"""The graph-mode profile of the decode benchmarks (``bench_fused_modes.py``, ``bench_phases.py``): the
:func:`decode_walks` fit it (1024 requests of 1 token, contexts below 2048 + 64 tokens)."""


def composable_step(stager: Any, column_step: int = 1) -> Callable[[BatchSpec], Any]:
    """One whole step of the composable builders on ``stager`` (``stage_common`` with the page table,
    FlashAttention, FlashInfer, the three ``result()``), with the block-table width of
    :func:`attnmeta.backends.fused.table_columns` when ``column_step > 1`` (eager mode)."""
    from attnmeta.backends.fused import table_columns

    def step_fn(spec: BatchSpec) -> Any:
        cols = table_columns(spec, column_step) if column_step > 1 else None
        with stager.step() as step:
            c = stage_common(spec, step, paged_kv=True, block_table_columns=cols)
            fa, fi = flash_attn.stage(c, step), flashinfer.stage(c, step)
        return c.result(), fa.result(), fi.result()

    return step_fn


def decode_walks(quick: bool) -> list[tuple[int, list[BatchSpec]]]:
    """``(batch, steps)`` of the :func:`decode` scenario: :data:`DECODE_STEPS` successive decode steps
    per batch size (the same specs every call)."""
    rng = np.random.default_rng(0)
    sizes = [1, 8, 64] if quick else [1, 8, 64, 256, 1024]
    return [(b, advance(decode_spec(b, rng), DECODE_STEPS)) for b in sizes]


def spec_decode_walks(quick: bool) -> list[tuple[int, list[BatchSpec]]]:
    """``(batch, steps)`` of the :func:`spec_decode` scenario: :data:`DECODE_STEPS` successive steps
    of 3 draft tokens a request (4 query tokens), per batch size (the same specs every call)."""
    rng = np.random.default_rng(2)
    sizes = [8, 64] if quick else [8, 64, 256]
    return [(b, advance(decode_spec(b, rng, drafts=3), DECODE_STEPS)) for b in sizes]


def spec_decode(device: torch.device, quick: bool) -> list[Case]:
    """Spec decode with k = 3 drafts per request (4 query tokens each), FlashAttention + FlashInfer;
    with the ``fused`` path of :func:`decode` too."""
    walks = spec_decode_walks(quick)  # (with the fused path: spec-decode steps replay too)
    cases = _scenario("spec-decode-k3", walks, device, _stage_fa_fi, _ref_fa_fi, _host_fa_fi, _PAGED)
    return _with_fused(cases, walks, device)


MIXED_STEPS = 16
"""Distinct mixed steps the ``mixed`` and ``mixed-common`` paths walk in turn (an engine's mixed
steps differ in token count, longest sequence and page count every step)."""


def _mixed_walk(quick: bool) -> list[BatchSpec]:
    rng = np.random.default_rng(1)
    return [mixed_spec(rng, prefills=8 if quick else 64, decodes=24 if quick else 192) for _ in range(MIXED_STEPS)]


def mixed(device: torch.device, quick: bool) -> list[Case]:
    """64 prefills up to 2k tokens (half with unaligned cached context) + 192 decodes; FA + FlashInfer;
    :data:`MIXED_STEPS` distinct such steps, walked in turn."""
    walk = _mixed_walk(quick)
    return _scenario("mixed", [(walk[0].num_reqs, walk)], device, _stage_fa_fi, _ref_fa_fi, _host_fa_fi, _PAGED)


# ---- KV-sharing fast prefill
def _logits_for(spec: BatchSpec) -> np.ndarray:
    qsl = np.concatenate([[0], np.cumsum(spec.num_scheduled_tokens)]).astype(np.int32)
    return (qsl[1:][spec.num_scheduled_tokens > 0] - 1).astype(np.int32)  # the last token of each request


def fast_prefill(device: torch.device, quick: bool) -> list[Case]:
    """KV-sharing fast prefill on the mixed batch: the logits-only batch of vllm-semantics 5.5."""
    from attnmeta.backends import fast_prefill as fp
    from attnmeta.host import fast_prefill as hfp
    from attnmeta.testing import reference as ref

    rng = np.random.default_rng(3)
    spec = mixed_spec(rng, prefills=8 if quick else 64, decodes=24 if quick else 192)
    li = _logits_for(spec)

    def stage_extra(common: Any, step: Any) -> Any:
        return fp.stage(common, step, li)

    def ref_extra(s: BatchSpec) -> Callable[[dict[str, torch.Tensor], Callable[[np.ndarray], torch.Tensor]], Any]:
        def extra(fields: dict[str, Any], up: Callable[[np.ndarray], torch.Tensor]) -> Any:
            li_d = up(li)
            dqsl = ref.ref_fast_prefill_query_start_loc(fields["query_start_loc"], li_d)
            fields["fast_query_start_loc"] = dqsl
            fields["fast_query_start_loc_cpu"] = dqsl.cpu()  # vLLM 0.33's pending D2H, made safe by a sync
            fields["max_query_len"] = ref.ref_max_logits_per_req(dqsl)
            return fields
        return extra

    def host_extra(s: BatchSpec) -> Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]:
        def extra(host: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            return {"fast_query_start_loc": hfp.fast_prefill_query_start_loc(host["query_start_loc"], li),
                    "logits_indices": li}
        return extra

    return _scenario("fast-prefill", [(spec.num_reqs, spec)], device, stage_extra, ref_extra, host_extra)


# ---- chunked local attention
def local_attention(device: torch.device, quick: bool) -> list[Case]:
    """Chunked local attention (Llama-4 style, chunk 8192 tokens at page 16) on the mixed batch."""
    from attnmeta.backends import local_attn as la
    from attnmeta.host import local_attn as hla
    from attnmeta.testing import reference as ref

    rng = np.random.default_rng(4)
    spec = mixed_spec(rng, prefills=8 if quick else 64, decodes=24 if quick else 192)
    chunk = 8192
    opts = la.LocalAttnOptions(attn_chunk_size=chunk)

    def stage_extra(common: Any, step: Any) -> Any:
        return la.stage(common, step, opts)

    def ref_extra(s: BatchSpec) -> Callable[[dict[str, torch.Tensor], Callable[[np.ndarray], torch.Tensor]], Any]:
        def extra(fields: dict[str, torch.Tensor], up: Callable[[np.ndarray], torch.Tensor]) -> Any:
            # vLLM 0.33 reads seq_lens back (its known sync), then runs the host algorithm and uploads.
            qsl_cpu = fields["query_start_loc"].cpu()
            sl_cpu = fields["seq_lens"].cpu()
            out = ref.ref_local_virtual_batches(qsl_cpu, sl_cpu, chunk, s.block_size)
            return fields, [up(np.asarray(x)) for x in out[:2]]
        return extra

    def host_extra(s: BatchSpec) -> Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]:
        def extra(host: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            lb = hla.local_virtual_batches(host["query_start_loc"], host["seq_lens"], chunk, s.block_size,
                                           s.block_table)
            assert lb.block_table is not None
            return {"local_qsl": lb.query_start_loc, "local_seq_lens": lb.seq_lens,
                    "local_block_table": lb.block_table}
        return extra

    return _scenario("local-attention", [(spec.num_reqs, spec)], device, stage_extra, ref_extra, host_extra)
def decode_common(device: torch.device, quick: bool) -> list[Case]:
    """Common metadata only, decode batches of 1..1024 (2048-column table, page 16), contexts growing
    one token a step as in :func:`decode`."""
    rng = np.random.default_rng(0)
    sizes = [1, 8, 64] if quick else [1, 8, 64, 256, 1024]
    return _scenario_common("decode-common", [(b, advance(decode_spec(b, rng), DECODE_STEPS)) for b in sizes],
                            device)


def mixed_common(device: torch.device, quick: bool) -> list[Case]:
    """Common metadata of the mixed batch (64 prefills, 192 decodes), :data:`MIXED_STEPS` distinct steps."""
    walk = _mixed_walk(quick)
    return _scenario_common("mixed-common", [(walk[0].num_reqs, walk)], device)


def _mamba2_prefill(device: torch.device, quick: bool) -> list[Case]:
    """The whole Mamba2 prefill-step build at 1..1024 prefills (chunk 256; see attnmeta._bench_mamba2)."""
    from attnmeta._bench_mamba2 import mamba2_cases

    return mamba2_cases(device, quick)


def staging(device: torch.device, quick: bool) -> list[Case]:
    """Eight prepared int32/int64 arrays (a step's worth, ~20 KB) moved to the device three ways: one
    packed pinned copy through a Stager, eight per-call pinned uploads, eight ``torch.as_tensor(np,
    device=...)`` blocking uploads (the reference)."""
    from attnmeta.staging import Stager

    rng = np.random.default_rng(5)
    arrays = [rng.integers(0, 1 << 20, size=n).astype(dt) for n, dt in
              [(257, np.int32), (256, np.int32), (256, np.int32), (1024, np.int64), (1024, np.int64),
               (256, np.int32), (2048, np.int32), (256, np.int32)]]
    specs = tuple((f"a{i}", a.shape[0], a.dtype, None, 0) for i, a in enumerate(arrays))
    stager = Stager(device)
    ups = {"attnmeta": Uploads(), "reference": Uploads(), "per-tensor": Uploads()}

    def attnmeta_step() -> Any:
        with stager.step() as step:
            for view, a in zip(step.alloc_group(specs), arrays):
                np.copyto(view, a)
        return [step.device(s[0]) for s in specs]

    raw = _raw_uploader(device, ups["reference"])
    per = _uploader(device, ups["per-tensor"])
    case = Case("staging-8-arrays", len(arrays), {
        "attnmeta": attnmeta_step,
        "reference": lambda: [raw(a) for a in arrays],
        "per-tensor": lambda: [per(a) for a in arrays],
    }, ups, stager)
    return [case]


SCENARIOS: dict[str, Callable[[torch.device, bool], list[Case]]] = {
    "staging": staging,
    "decode": decode,
    "mixed": mixed,
    "spec-decode-k3": spec_decode,
    "mamba2-prefill": _mamba2_prefill,
    "fast-prefill": fast_prefill,
    "local-attention": local_attention,
    "decode-common": decode_common,
    "mixed-common": mixed_common,
}
