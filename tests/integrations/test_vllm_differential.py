"""Differential checks of three attnmeta families against vLLM 0.33.0's own Python code, on generated
batches (marker ``vllm``): multimodal prefix-LM ranges, chunked local attention virtual batches and
micro-batch (DBO) splitting.

Each test builds vLLM's ``CommonAttentionMetadata`` the way its V1 runner builds it
(:mod:`vllm_runner`, torch only, CPU tensors), hands it to vLLM's real function or builder, runs
attnmeta's public API on the same :class:`~attnmeta.BatchSpec`, and compares every field both
produce. Nothing of vLLM is stubbed except its ``PIN_MEMORY`` flag (no pinned memory without CUDA:
``no_pinning``); the multimodal builders are vLLM's real FlashAttention and Triton builders of a tiny
Llama whose config says ``is_mm_prefix_lm`` (vLLM's own config path turns their mm-prefix buffers on).

What the runner hands these functions (vllm/v1/worker/gpu_model_runner.py, 0.33.0):

- every real row schedules at least one token (unscheduled requests leave the persistent batch), so
  the only zero-length rows are CUDA-graph padding rows, which exist only under FULL graphs
  (``pad_attn``);
- ``compute_mm_prefix_ranges`` gets the image/video/other features of the real rows, placeholders
  inside the prompt (``_build_attention_metadata``); the dict goes into the common metadata;
- chunked local attention's builder reports ``AttentionCGSupport.NEVER``
  (model_executor/layers/attention/chunked_local_attention.py), so FULL graphs are refused or
  downgraded (config/compilation.py, ``resolve_cudagraph_mode_and_sizes``) and its common metadata is
  never padded; padding rows are still drawn here (attnmeta documents how it treats them);
- micro-batches: ``maybe_create_ubatch_slices(should_ubatch, q, num_tokens_padded, num_reqs_padded, n)``
  without split points, only when ``not is_last_ubatch_empty``; attention is split from the padded
  slices of a padded common metadata under FULL graphs, else from the unpadded slices of an unpadded
  one; chunked local attention layers run ``make_local_attention_virtual_batches`` on each micro-batch.

What the checks left as known, documented differences is in :data:`DOCUMENTED`; anything else fails.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from attnmeta import BatchSpec, Stager, StaticProfile, stage_common
from attnmeta.backends import local_attn, mm_prefix
from attnmeta.testing.strategies import batch_specs
from attnmeta.ubatch import is_last_ubatch_empty, stage_ubatches, ubatch_slices

pytestmark = pytest.mark.vllm

INSTALL = ("vLLM 0.33.0 is not importable here: bash tests/integrations/install_vllm.sh ENV, then "
           "ENV/bin/python -m pytest -m vllm tests/integrations (docs/testing.md, 'Test your own builder')")
pytest.importorskip("vllm.v1.attention.backends.flash_attn", reason=INSTALL)
pytest.importorskip("vllm.v1.worker.ubatch_utils", reason=INSTALL)

from profile_helpers import scaled_examples  # noqa: E402
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange  # noqa: E402
from vllm.v1.attention.backends.utils import compute_mm_prefix_ranges, make_local_attention_virtual_batches  # noqa: E402
from vllm.v1.worker.ubatch_utils import is_last_ubatch_empty as vllm_is_last_ubatch_empty  # noqa: E402
from vllm.v1.worker.ubatch_utils import maybe_create_ubatch_slices, split_attn_metadata  # noqa: E402
from vllm_runner import assert_same_as_vllm, host_copy, vllm_runner_common  # noqa: E402

from examples.engine.vllm_metadata import no_pinning  # noqa: E402

CPU = torch.device("cpu")
RUNNER_KINDS = ("decode", "spec_decode", "prefill", "chunked_prefill")
"""Rows vLLM's runner schedules: every real row has a query (zero-length rows are padding only)."""

DOCUMENTED = {
    "local_attn padding rows": "block columns from 0 where vLLM's negative columns wrap to the row's end "
                               "(docs/semantics-attention.md, LocalAttentionMetadata deviations; never produced: "
                               "the chunked-local builder is AttentionCGSupport.NEVER, so its metadata is never padded)",
    "local_attn eager width": "eager staging clips to the batch's widest row, vLLM to its persistent width; only "
                              "columns past a row's KV differ (docs/semantics-attention.md, 'Clip width')",
    "block_table width": "eager staging stages max cdiv(s, bs) columns, vLLM its persistent width "
                         "(docs/semantics.md, deviations)",
    "positions padding": "attnmeta 0, vLLM stale buffer contents (docs/semantics.md, deviations)",
}
"""The documented differences these checks step around (each comparison says where), and why."""

TALLY: dict[str, int] = {}


@pytest.fixture(scope="module", autouse=True)
def _report() -> Iterator[None]:
    """vLLM's imported modules told not to pin (its CPU platform says it can; without CUDA
    ``async_tensor_h2d``'s pinned copy fails); one ``DIFFERENTIAL`` line per test at the end of the
    module: the cases compared."""
    if not torch.cuda.is_available():
        no_pinning()
    yield
    for name, cases in sorted(TALLY.items()):
        print(f"\nDIFFERENTIAL {name}: {cases} cases compared with vLLM 0.33.0")


def _count(name: str) -> None:
    TALLY[name] = TALLY.get(name, 0) + 1


def _same(field: str, got: Any, want: Any, *, dtype: bool = True) -> None:
    assert_same_as_vllm(field, got, want, dtype=dtype)


def _unpadded(spec: BatchSpec) -> BatchSpec:
    """``spec`` without its CUDA-graph padding (what the runner hands builders outside FULL graphs)."""
    return dataclasses.replace(spec, num_reqs_padded=None, num_tokens_padded=None)


# ============================================================================ 1. multimodal prefix-LM ranges
@pytest.fixture(scope="module")
def mm_builders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """vLLM's FlashAttention and Triton builders of a tiny Llama whose HF config sets ``is_mm_prefix_lm``:
    vLLM's config turns its mm-prefix paths on from that flag (ModelArchConfigConvertorBase.is_mm_prefix_lm),
    so the builders allocate their mm-prefix buffers as for Gemma3 or PaliGemma. Made once: the runner keeps
    one builder per attention group, whose persistent staging buffer is reused every step."""
    from transformers import LlamaConfig
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, VllmConfig
    from vllm.v1.attention.backends.flash_attn import FlashAttentionMetadataBuilder
    from vllm.v1.attention.backends.triton_attn import TritonAttentionMetadataBuilder
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    folder: Path = tmp_path_factory.mktemp("vllm-mm-prefix")
    hf = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    hf.is_mm_prefix_lm = True
    hf.save_pretrained(folder)
    model = ModelConfig(model=str(folder), skip_tokenizer_init=True, dtype="float16", max_model_len=4096)
    assert model.is_mm_prefix_lm
    config = VllmConfig(model_config=model, cache_config=CacheConfig(block_size=16), device_config=DeviceConfig(device="cpu"))
    if not torch.cuda.is_available():
        no_pinning()  # (the Triton backend's module, imported here)
    kv = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=16, dtype=torch.float16)
    fa = FlashAttentionMetadataBuilder(kv, ["model.layers.0.self_attn.attn"], config, CPU)
    assert fa.mm_prefix_query_ranges_np is not None
    return {"flash_attn": fa, "triton": TritonAttentionMetadataBuilder(kv, ["model.layers.0.self_attn.attn"], config, CPU)}


Feature = tuple[str, int, int, "list[bool] | None"]
"""One multimodal feature of a request: modality, placeholder offset, length, ``is_embed`` mask or None."""


@dataclasses.dataclass(frozen=True)
class MMCase:
    spec: BatchSpec
    features: list[list[Feature]]
    sliding_window: int | None
    clamp: bool
    span_pad: int | None


@st.composite
def mm_cases(draw: st.DrawFn) -> MMCase:
    """A runner step of a prefix-LM model: real rows of every kind vLLM schedules, with prompts; per real
    row its multimodal features (image, video, audio), non-overlapping placeholders inside the prompt,
    single-token ones at offset 0 included (a lone range ``(0, 0)``: vLLM's Triton-form quirk); the model's
    sliding window, clamp flag and DeepSeek V4 span padding."""
    spec = draw(batch_specs(min_reqs=1, max_reqs=6, max_query_len=24, max_context_len=24, kinds=RUNNER_KINDS,
                            with_prompts=st.just(True), block_sizes=st.just(16), max_draft_tokens=3))
    assert spec.num_prompt_tokens is not None
    features: list[list[Feature]] = []
    for i in range(spec.num_reqs):
        prompt = int(spec.num_prompt_tokens[i])
        row: list[Feature] = []
        pos = 0
        for _ in range(draw(st.integers(0, 4))):
            offset = pos + draw(st.integers(0, 5))
            length = draw(st.integers(1, 16))
            if offset + length > prompt:
                break
            mask = draw(st.none() | st.lists(st.booleans(), min_size=length, max_size=length))
            row.append((draw(st.sampled_from(["image", "image", "video", "audio"])), offset, length, mask))
            pos = offset + length
        features.append(row)
    return MMCase(spec, features, draw(st.none() | st.integers(1, 16)), draw(st.booleans()),
                  draw(st.none() | st.integers(1, 8)))


def _vllm_features(row: list[Feature]) -> list[MultiModalFeatureSpec]:
    return [MultiModalFeatureSpec(data=None, modality=m, identifier=f"{m}-{k}",
                                  mm_position=PlaceholderRange(offset=o, length=n,
                                                               is_embed=None if e is None else torch.tensor(e)))
            for k, (m, o, n, e) in enumerate(row)]


def _attnmeta_spans(features: list[list[Feature]]) -> mm_prefix.MMPrefixInputs:
    """attnmeta's inputs: the image/video spans of each real row (a CSR; other modalities are not passed)."""
    indptr, starts, lengths, masks, any_mask = [0], [], [], [], False
    for row in features:
        for m, o, n, e in row:
            if m in ("image", "video"):
                starts.append(o)
                lengths.append(n)
                masks.extend([True] * n if e is None else e)
                any_mask |= e is not None
        indptr.append(len(starts))
    return mm_prefix.MMPrefixInputs(mm_span_indptr=np.array(indptr, np.int64), mm_span_starts=np.array(starts, np.int64),
                                    mm_span_lengths=np.array(lengths, np.int64),
                                    mm_is_embed=np.array(masks, bool) if any_mask else None)


def _mm_example(c: list[int], q: list[int], prompt: list[int], features: list[list[Feature]], *,
                padded: bool = False, sliding_window: int | None = None, clamp: bool = False,
                span_pad: int | None = None) -> MMCase:
    """A hand-written case for one of vLLM's quirks (random draws rarely hit them)."""
    spec = BatchSpec(num_computed_tokens=c, num_scheduled_tokens=q, num_prompt_tokens=prompt,
                     block_table=np.arange(1, 1 + 4 * len(c), dtype=np.int32).reshape(len(c), 4), block_size=16,
                     num_reqs_padded=len(c) + 2 if padded else None, num_tokens_padded=sum(q) + 3 if padded else None)
    return MMCase(spec, features, sliding_window, clamp, span_pad)


@settings(max_examples=scaled_examples(50), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=mm_cases(), graph=st.booleans())
# a lone range (0, 0) and empty rows: vLLM's Triton form is None, its FA form skips the one-token range
@example(graph=False, case=_mm_example([0, 0], [3, 2], [3, 2], [[("image", 0, 1, None)], [("audio", 0, 2, None)]], padded=True))
# one-token ranges only (FA form: nothing covered, None) next to a two-token one in another row
@example(graph=False, case=_mm_example([0, 4], [6, 4], [6, 9], [[("image", 2, 1, None), ("video", 4, 1, None)],
                                                 [("image", 5, 2, None)]]))
# the sliding window at its boundary (a 5-token range: dropped at 4, kept at 5 and when clamped)
@example(graph=False, case=_mm_example([0], [8], [8], [[("image", 1, 5, None)]], sliding_window=4))
@example(graph=False, case=_mm_example([0], [8], [8], [[("image", 1, 5, None)]], sliding_window=5))
@example(graph=False, case=_mm_example([0], [8], [8], [[("image", 1, 5, None)]], sliding_window=4, clamp=True))
# span_pad: a range with start > end (kept in the Triton form), one that starts after its offset (mask ignored)
@example(graph=False, case=_mm_example([0], [20], [20], [[("image", 5, 2, None), ("video", 9, 10, [True, False] * 5)]],
                                       span_pad=8))
# chunked prefill: a range from an earlier chunk reaching past this one; is_embed runs cut by the chunk
@example(graph=False, case=_mm_example([10, 0], [4, 5], [40, 5], [[("image", 8, 10, None), ("image", 20, 6, None)],
                                                   [("video", 0, 5, [False, True, True, False, True])]]))
def test_mm_prefix_ranges_and_both_forms_equal_vllm(mm_builders: dict[str, Any], case: MMCase, graph: bool) -> None:
    """The runner's ``compute_mm_prefix_ranges``, then vLLM's FlashAttention builder (FA4 per-token form,
    ``fill_mm_prefix_query_ranges`` into its persistent buffer) and Triton builder
    (``compute_mm_prefix_range_tensor`` over the padded rows) on the runner's common metadata, against
    attnmeta's ``mm_prefix`` builder in both forms on the same spec, eager or in graph mode (where attnmeta's
    Triton form has a fixed row stride, ``graph_max_ranges``: vLLM's ranges are its first columns)."""
    spec = case.spec
    ranges = compute_mm_prefix_ranges([_vllm_features(row) for row in case.features], sliding_window=case.sliding_window,
                                      clamp_sliding_window=case.clamp, span_pad=case.span_pad or 0)
    cm, _ = vllm_runner_common(spec, CPU)
    cm.mm_req_doc_ranges = ranges  # _build_attention_metadata: CommonAttentionMetadata(..., mm_req_doc_ranges=...)
    fa = mm_builders["flash_attn"].build(0, cm)
    tri = mm_builders["triton"].build(0, cm)
    want_fa, want_tri = fa.mm_prefix_query_range_tensor, tri.mm_prefix_range_tensor

    inputs = _attnmeta_spans(case.features)
    common: dict[str, Any] = dict(sliding_window=case.sliding_window, clamp_sliding_window=case.clamp,
                                  span_pad=case.span_pad, graph_max_ranges=64)
    profile = StaticProfile(max_num_reqs=32, max_num_tokens=512, max_blocks_per_req=spec.block_table.shape[1],
                            block_size=spec.block_size) if graph else None
    # (a stager each: a graph-mode step's metadata is valid until the stager's next step commits)
    got_tri = mm_prefix.build(spec, Stager("cpu", profile=profile), mm_prefix.MMPrefixOptions(form="triton", **common),
                              inputs)
    got_fa = mm_prefix.build(spec, Stager("cpu", profile=profile),
                             mm_prefix.MMPrefixOptions(form="flash_attn", **common), inputs)

    want_ranges = {int(k): [(int(a), int(b)) for a, b in v] for k, v in ranges.items()}
    for got in (got_tri, got_fa):
        assert got.doc_ranges() == want_ranges, (got.doc_ranges(), want_ranges)
        assert got.num_ranges == sum(len(v) for v in want_ranges.values())
    if want_tri is None:
        assert got_tri.mm_prefix_range_tensor is None and got_tri.mm_prefix_range_tensor_cpu is None
        assert got_tri.max_ranges == 0
    else:
        assert got_tri.mm_prefix_range_tensor is not None and got_tri.mm_prefix_range_tensor_cpu is not None
        r = want_tri.shape[1]
        _same("mm_prefix_range_tensor", got_tri.mm_prefix_range_tensor[:, :r], want_tri)
        _same("mm_prefix_range_tensor_cpu", got_tri.mm_prefix_range_tensor_cpu[:, :r], want_tri)
        if graph:  # the fixed stride's extra columns are (0, 0), which the kernel skips as vLLM's padding
            assert not got_tri.mm_prefix_range_tensor_cpu[:, r:].any()
        else:
            assert got_tri.mm_prefix_range_tensor.shape == want_tri.shape and got_tri.max_ranges == r
    if want_fa is None:
        assert got_fa.mm_prefix_query_range_tensor is None and got_fa.mm_prefix_query_range_tensor_cpu is None
        assert got_fa.num_query_range_rows == 0
    else:
        assert got_fa.mm_prefix_query_range_tensor is not None
        _same("mm_prefix_query_range_tensor", got_fa.mm_prefix_query_range_tensor, want_fa)
        _same("mm_prefix_query_range_tensor_cpu", got_fa.mm_prefix_query_range_tensor_cpu, want_fa)
        assert got_fa.num_query_range_rows == want_fa.shape[0]
    _count("mm_prefix")


# ============================================================================ 2. chunked local attention
@st.composite
def local_cases(draw: st.DrawFn, *, padding: bool) -> tuple[BatchSpec, int]:
    """A runner step and an ``attn_chunk_size`` (a multiple of the block size). Queries up to 40 tokens over
    chunks of 1 to 8192: decode-only, prefill-only, mixed, single-token batches, chunk-aligned and unaligned
    contexts. With ``padding`` the step may carry CUDA-graph padding rows (and the chunk is at most the
    table's width in blocks)."""
    bs = draw(st.sampled_from([1, 2, 4, 16]))
    spec = draw(batch_specs(min_reqs=1, max_reqs=6, max_query_len=40, max_context_len=80, block_sizes=st.just(bs),
                            kinds=(*RUNNER_KINDS, "empty") if padding else RUNNER_KINDS,
                            with_padding=st.booleans() if padding else st.just(False), max_draft_tokens=3))
    if padding:  # vLLM's padding rows read columns -ppl..-1: out of bounds unless the table has ppl columns
        per = draw(st.integers(1, min(4, spec.block_table.shape[1])))
    else:  # chunks longer than every sequence too (Llama 4's 8192 against a short batch)
        per = draw(st.integers(1, 4) | st.sampled_from([16, 512]))
    return spec, bs * per


def _local_attnmeta(spec: BatchSpec, chunk: int, mode: Literal["host", "device"], columns: int | None) -> Any:
    with Stager("cpu").step() as step:
        common = stage_common(spec, step, block_table_columns=columns)
        staged = local_attn.stage(common, step, local_attn.LocalAttentionOptions(attn_chunk_size=chunk, block_table=mode))
    return staged.result()


def _compare_local(name: str, got: Any, want: Any, parent_cm: Any, *, eager_width: bool,
                   make_block_table: Any = None) -> int:
    """attnmeta's ``LocalAttentionMetadata`` ``got`` against vLLM's virtual ``CommonAttentionMetadata``
    ``want`` (from ``parent_cm``): every field vLLM's function sets, ``compute_num_computed_tokens``, and with
    vLLM's ``make_block_table`` its gather indices (each virtual row's request and first column).
    Returns how many virtual rows' block columns were left out: those of rows with ``s = 0`` (padding rows;
    DOCUMENTED["local_attn padding rows"])."""
    c = got.common
    for field in ("query_start_loc", "query_start_loc_cpu", "seq_lens", "seq_lens_cpu_upper_bound"):
        _same(f"{name}.common.{field}", getattr(c, field), getattr(want, field))
    _same(f"{name}.common.seq_lens_cpu", c.seq_lens_cpu, want.seq_lens)
    _same(f"{name}.query_start_loc_cpu", got.query_start_loc_cpu, want.query_start_loc_cpu)
    _same(f"{name}.seq_lens", got.seq_lens, want.seq_lens)
    _same(f"{name}.common.num_computed_tokens_cpu", c.num_computed_tokens_cpu, want.compute_num_computed_tokens())
    assert (c.num_reqs, c.num_actual_tokens, c.max_query_len, c.max_seq_len, c.causal, got.num_virtual_reqs) == (
        want.num_reqs, want.num_actual_tokens, int(want.max_query_len), want.max_seq_len, want.causal, want.num_reqs)
    _same(f"{name}.common.slot_mapping", c.slot_mapping, want.slot_mapping)
    # the virtual block table, but rows of s = 0 requests (DOCUMENTED["local_attn padding rows"])
    rows = np.flatnonzero(host_copy(parent_cm.seq_lens)[got.req_indices_cpu] > 0)
    if make_block_table is not None:  # vLLM's gather indices (the closure of its make_block_table)
        gather = inspect.getclosurevars(make_block_table).nonlocals
        ppl = got.pages_per_local_block
        _same(f"{name}.req_indices_cpu", got.req_indices_cpu, gather["batch_indices_torch"][::ppl])
        _same(f"{name}.block_starts_cpu (rows with s > 0)", got.block_starts_cpu[rows],
              gather["block_indices_torch"][::ppl][rows], dtype=False)
    g, w = host_copy(c.block_table_tensor), host_copy(want.block_table_tensor)
    assert g.shape == w.shape and g.dtype == w.dtype, (name, g.shape, w.shape, g.dtype, w.dtype)
    left_out = int(got.num_virtual_reqs) - rows.shape[0]
    if not eager_width:
        _same(f"{name}.common.block_table_tensor (rows with s > 0)", g[rows], w[rows])
        _same(f"{name}.block_table (rows with s > 0)", host_copy(got.block_table)[rows], w[rows])
        if got.block_table_cpu is not None:  # (None with block_table="device")
            _same(f"{name}.block_table_cpu (rows with s > 0)", got.block_table_cpu[rows], w[rows])
        return left_out
    # eager width (DOCUMENTED["local_attn eager width"]): the columns holding each row's k_v KV tokens agree
    bs = c.block_size
    k = host_copy(want.seq_lens)
    for v in rows:
        need = -(-int(k[v]) // bs)
        _same(f"{name}.common.block_table_tensor[{v}, :{need}] (KV columns)", g[v, :need], w[v, :need])
    return left_out


@settings(max_examples=scaled_examples(50), deadline=None)
@given(case=local_cases(padding=False), mode=st.sampled_from(["host", "device"]))
def test_local_attention_virtual_batches_equal_vllm(case: tuple[BatchSpec, int],
                                                   mode: Literal["host", "device"]) -> None:
    """vLLM's ``make_local_attention_virtual_batches`` on the runner's common metadata (never padded for
    this builder) against attnmeta's ``local_attn`` builder: staged with vLLM's persistent width every
    field is equal, block table included; staged at attnmeta's eager width the columns a kernel reads are."""
    spec, chunk = case
    cm, table = vllm_runner_common(spec, CPU)
    want, make_block_table = make_local_attention_virtual_batches(chunk, cm, spec.block_size)
    _same("make_block_table(parent)", make_block_table(cm.block_table_tensor), want.block_table_tensor)
    got = _local_attnmeta(spec, chunk, mode, table.shape[1])
    # the runner's rows all have s > 0: nothing is left out
    assert _compare_local("full width", got, want, cm, eager_width=False, make_block_table=make_block_table) == 0
    got = _local_attnmeta(spec, chunk, mode, None)
    assert _compare_local("eager width", got, want, cm, eager_width=True, make_block_table=make_block_table) == 0
    _count("local_attn")


@settings(max_examples=scaled_examples(25), deadline=None)
@given(case=local_cases(padding=True))
def test_local_attention_with_padding_and_zero_length_rows_equal_vllm_but_the_documented_columns(
        case: tuple[BatchSpec, int]) -> None:
    """Padding rows and zero-length real rows (cases vLLM's runner never produces for this builder): every
    field equals vLLM's but the block columns of virtual rows whose request has ``s = 0``."""
    spec, chunk = case
    cm, table = vllm_runner_common(spec, CPU)
    want, make_block_table = make_local_attention_virtual_batches(chunk, cm, spec.block_size)
    got = _local_attnmeta(spec, chunk, "host", table.shape[1])
    _compare_local("padded", got, want, cm, eager_width=False, make_block_table=make_block_table)
    _count("local_attn (padding, zero-length rows)")


# ============================================================================ 3. micro-batches (DBO)
@st.composite
def ubatch_cases(draw: st.DrawFn, *, context_parallel: bool = True) -> tuple[BatchSpec, int]:
    """A runner step (mixed kinds, optimistic upper bounds under async spec decode, CUDA-graph padding and
    decode context parallelism sometimes) and the number of micro-batches."""
    spec = draw(batch_specs(min_reqs=1, max_reqs=8, max_query_len=40, max_context_len=120, kinds=RUNNER_KINDS,
                            max_padding_tokens=24,
                            with_context_parallel=st.booleans() if context_parallel else st.just(False)))
    return spec, draw(st.sampled_from([2, 2, 3]))


def _compare_ubatch(k: int, got: Any, want: Any, *, real_tokens: int, full_width: bool) -> None:
    """attnmeta's micro-batch ``k`` against vLLM's ``_make_metadata_with_slice`` result."""
    name = f"ubatch {k}"
    for field in ("query_start_loc", "query_start_loc_cpu", "seq_lens", "seq_lens_cpu_upper_bound"):
        _same(f"{name}.{field}", getattr(got, field), getattr(want, field))
    _same(f"{name}.seq_lens_cpu", got.seq_lens_cpu, want.seq_lens)
    _same(f"{name}.slot_mapping", got.slot_mapping, want.slot_mapping)
    # positions: real tokens (padding: DOCUMENTED["positions padding"])
    _same(f"{name}.positions[:real]", got.positions[:real_tokens], want.positions[:real_tokens])
    assert got.positions.shape == want.positions.shape
    # block table: graph mode stages the profile's width (vLLM's persistent one: equal in full); eager mode
    # the batch's widest row (DOCUMENTED["block_table width"]), the columns it stages
    w = want.block_table_tensor.shape[1] if full_width else got.block_table_tensor.shape[1]
    assert got.block_table_tensor.shape[0] == want.block_table_tensor.shape[0]
    _same(f"{name}.block_table_tensor[:, :{w}]", got.block_table_tensor, want.block_table_tensor[:, :w])
    _same(f"{name}.block_table_cpu[:, :{w}]", got.block_table_cpu, want.block_table_tensor[:, :w])
    _same(f"{name}.num_computed_tokens_cpu", got.num_computed_tokens_cpu, want.compute_num_computed_tokens())
    assert (got.num_reqs, got.num_actual_tokens, got.max_query_len, got.max_seq_len, got.causal) == (
        want.num_reqs, want.num_actual_tokens, want.max_query_len, want.max_seq_len, want.causal), name


def _pairs(slices: Any) -> list[tuple[slice, slice]]:
    return [(s.request_slice, s.token_slice) for s in slices]


def _run_ubatches(spec: BatchSpec, n: int, split_point: list[int] | None, pad_attn: bool, graph: bool = False) -> None:
    """vLLM's plan and split against attnmeta's, for one way the runner builds attention; with ``graph`` attnmeta
    stages in graph mode (a profile of vLLM's persistent table width), as under the FULL graphs of ``pad_attn``."""
    q = spec.num_scheduled_tokens
    Tp, Bp = spec.padded_num_tokens, spec.padded_num_reqs
    slices, padded = maybe_create_ubatch_slices(True, q, Tp, Bp, n, split_point)
    plan = ubatch_slices(q, Tp, Bp, n, split_point)
    assert _pairs(plan.slices) == _pairs(slices) and _pairs(plan.padded_slices) == _pairs(padded)
    # the runner: padded slices over a padded common metadata under FULL graphs, else unpadded over unpadded
    step_spec = spec if pad_attn else _unpadded(spec)
    cm, _ = vllm_runner_common(step_spec, CPU)
    want = split_attn_metadata(padded if pad_attn else slices, cm)
    profile = StaticProfile(max_num_reqs=max(Bp, 32), max_num_tokens=max(Tp, 512), block_size=spec.block_size,
                            max_blocks_per_req=spec.block_table.shape[1]) if graph else None
    with Stager("cpu", profile=profile).step() as step:
        staged = stage_ubatches(step_spec, step, plan.padded_slices if pad_attn else plan.slices)
    got = [s.result() for s in staged]
    assert len(got) == len(want) == n
    for k, (g, w, s) in enumerate(zip(got, want, padded if pad_attn else slices)):
        real = max(0, min(s.token_slice.stop, spec.num_tokens) - s.token_slice.start)
        _compare_ubatch(k, g, w, real_tokens=real, full_width=graph)


@settings(max_examples=scaled_examples(50), deadline=None)
@given(case=ubatch_cases(), graph=st.booleans())
def test_ubatch_split_equals_vllm(case: tuple[BatchSpec, int], graph: bool) -> None:
    """The runner's plan (default split points from the padded count) and ``split_attn_metadata`` against
    ``ubatch_slices`` + ``stage_ubatches``, for padded (FULL graphs; attnmeta in graph mode or eager) and
    unpadded attention."""
    spec, n = case
    T, Tp = spec.num_tokens, spec.padded_num_tokens
    empty = vllm_is_last_ubatch_empty(T, Tp, n)
    assert is_last_ubatch_empty(T, Tp, n) == empty
    if empty or Tp // n == 0:  # vLLM does not micro-batch it (is_last_ubatch_empty); attnmeta refuses it
        with pytest.raises(ValueError):
            ubatch_slices(spec.num_scheduled_tokens, Tp, spec.padded_num_reqs, n)
        _count("ubatch (not micro-batched)")
        return
    _run_ubatches(spec, n, None, pad_attn=True, graph=graph)
    _run_ubatches(spec, n, None, pad_attn=False)
    _count("ubatch")


@settings(max_examples=scaled_examples(40), deadline=None)
@given(case=ubatch_cases(), data=st.data())
def test_ubatch_split_with_explicit_split_points_equals_vllm(case: tuple[BatchSpec, int], data: st.DataObject) -> None:
    """``maybe_create_ubatch_slices``'s explicit split points (the runner passes none; vLLM's function takes
    them): any strictly increasing points inside the real tokens, a request cut in three included."""
    spec, n = case
    T = spec.num_tokens
    assume(n <= T)
    points = sorted(data.draw(st.sets(st.integers(1, T - 1), min_size=n - 1, max_size=n - 1), label="points"))
    _run_ubatches(spec, n, points, pad_attn=True)
    _run_ubatches(spec, n, points, pad_attn=False)
    _count("ubatch (explicit split points)")


@settings(max_examples=scaled_examples(30), deadline=None)
@given(case=ubatch_cases(context_parallel=False), per=st.integers(1, 4))
def test_local_attention_on_micro_batches_equals_vllm(case: tuple[BatchSpec, int], per: int) -> None:
    """What the runner does for a chunked-local layer under DBO: ``make_local_attention_virtual_batches`` on
    each ``split_attn_metadata`` result (unpadded: the builder never runs in FULL graphs), against
    ``local_attn.stage`` on each of attnmeta's micro-batches (staged at vLLM's width)."""
    spec, n = case
    spec = _unpadded(spec)
    T, bs = spec.num_tokens, spec.block_size
    assume(not vllm_is_last_ubatch_empty(T, T, n) and T // n > 0)
    chunk = bs * min(per, spec.block_table.shape[1])
    slices, _ = maybe_create_ubatch_slices(True, spec.num_scheduled_tokens, T, spec.num_reqs, n)
    cm, table = vllm_runner_common(spec, CPU)
    parents = split_attn_metadata(slices, cm)
    want = [make_local_attention_virtual_batches(chunk, u, bs) for u in parents]
    plan = ubatch_slices(spec.num_scheduled_tokens, T, spec.num_reqs, n)
    with Stager("cpu").step() as step:
        ubs = stage_ubatches(spec, step, plan.slices, block_table_columns=table.shape[1])
        staged = [local_attn.stage(u, step, local_attn.LocalAttentionOptions(attn_chunk_size=chunk, prefix=f"local_ub{k}"))
                  for k, u in enumerate(ubs)]
    for k, (s, (w, make_block_table), u) in enumerate(zip(staged, want, parents)):
        assert _compare_local(f"ubatch {k} local", s.result(), w, u, eager_width=False,
                              make_block_table=make_block_table) == 0
    _count("local_attn on micro-batches")
