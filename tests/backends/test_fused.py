"""FusedStepBuilder: field for field the composable builders' output, on walks that replay layouts."""

from __future__ import annotations

import dataclasses
import doctest
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from attnmeta import BatchSpec, ContextParallel, Stager, StaticProfile, UnsupportedBatchError, stage_common
from attnmeta.backends import flash_attn, flashinfer, fused
from attnmeta.backends.flash_attn import FlashAttentionOptions
from attnmeta.backends.flashinfer import FlashInferOptions
from attnmeta.backends.fused import FusedStep, FusedStepBuilder
from attnmeta.staging import CapacityError, StepExpiredError, is_expired
from attnmeta.sync import no_device_sync
from attnmeta.testing.strategies import batch_specs
from attnmeta.testing.workloads import advance, decode_spec, mixed_spec


def _columns(spec: BatchSpec, column_step: int, graph: bool) -> int | None:
    """``block_table_columns`` of the composable call that FusedStepBuilder(table_column_step=...) equals."""
    if column_step == 1 or graph:
        return None
    cp = spec.context_parallel
    span = spec.block_size * (1 if cp is None else cp.world_size)
    need = max(1, -(-spec.max_exact_seq_len // span))
    rounded = -(-need // column_step) * column_step
    return min(rounded, max(need, spec.block_table.shape[1]))  # (never past the table, unless a request is)


def _composed(spec: BatchSpec, stager: Stager, fa_opts: Any, fi_opts: Any, paged: bool, column_step: int = 1) -> FusedStep:
    """What FusedStepBuilder must equal: the composable builders on one step."""
    with stager.step() as step:
        common = stage_common(spec, step, paged_kv=paged,
                              block_table_columns=_columns(spec, column_step, stager.graph_mode))
        fa = flash_attn.stage(common, step, fa_opts) if fa_opts is not None else None
        fi = flashinfer.stage(common, step, fi_opts) if fi_opts is not None else None
    return FusedStep(common.result(), fa.result() if fa is not None else None, fi.result() if fi is not None else None)


def _assert_same(got: Any, want: Any, path: str) -> None:
    """Every field equal: values, dtypes, shapes, devices, read-only flags; scalars by value and type."""
    if want is None:
        assert got is None, path
        return
    assert type(got) is type(want), path
    for f in dataclasses.fields(want):
        a, b = getattr(got, f.name), getattr(want, f.name)
        where = f"{path}.{f.name}"
        if dataclasses.is_dataclass(b):
            _assert_same(a, b, where)
        elif isinstance(b, torch.Tensor):
            assert isinstance(a, torch.Tensor), where
            assert (a.shape, a.dtype, a.device) == (b.shape, b.dtype, b.device), where
            assert torch.equal(a.cpu(), b.cpu()), where  # test-only read-back
        elif isinstance(b, np.ndarray):
            assert isinstance(a, np.ndarray), where
            assert (a.shape, a.dtype, a.flags.writeable) == (b.shape, b.dtype, b.flags.writeable), where
            assert np.array_equal(a, b), where
        else:
            assert type(a) is type(b) and a == b, f"{where}: {a!r} != {b!r}"


def _check_walk(specs: list[Any], device: torch.device, fa_opts: Any = FlashAttentionOptions(),
                fi_opts: Any = FlashInferOptions(), column_step: int = 1, threads: int = 1,
                **stager_kw: Any) -> FusedStepBuilder:
    builder = FusedStepBuilder(Stager(device, **stager_kw), flash_attn=fa_opts, flashinfer=fi_opts,
                               table_column_step=column_step, threads=threads)
    ref = Stager(device, **stager_kw)
    paged = fi_opts is not None and fi_opts == FlashInferOptions()
    kept: list[tuple[FusedStep, FusedStep]] = []
    for i, spec in enumerate(specs):
        if callable(spec):  # a step of other code on both stagers, between builds
            spec(builder.stager)
            spec(ref)
            continue
        got = builder.build(spec)
        want = _composed(spec, ref, fa_opts, fi_opts, paged, column_step)
        for name, a, b in zip(FusedStep._fields, got, want):
            _assert_same(a, b, f"step {i} {name}")
        if ref.graph_mode:  # every field's whole fixed buffer, the bytes kernels in CUDA graphs read
            mine, theirs = builder.stager, ref
            assert list(mine.graph_fields) == list(theirs.graph_fields)
            a, b = mine.graph_arena, theirs.graph_arena
            assert a is not None and b is not None
            for name, f in theirs.graph_fields.items():
                lo, hi = f.offset, f.offset + f.nbytes
                assert torch.equal(a[lo:hi].cpu(), b[lo:hi].cpu()), f"step {i}: {name}"
        kept = [*kept, (got, want)][-(builder.stager.num_slots - 1):]
        for j, (old_got, old_want) in enumerate(kept[:-1]):  # earlier steps' objects: intact, or expired
            expired = is_expired(old_got.common)
            assert expired == is_expired(old_want.common) and (expired or not ref.graph_mode), f"step {i}, kept {j}"
            if expired:  # (eager mode: steps of other code between builds took their slots)
                with pytest.raises(StepExpiredError):
                    _ = old_got.common.seq_lens
            else:
                _assert_same(old_got.common, old_want.common, f"step {i}, kept {j}")
    assert builder.stats.steps == sum(not callable(s) for s in specs)
    return builder


def _decode_walk(batch: int, steps: int, seed: int = 0, **kw: Any) -> list[BatchSpec]:
    return advance(decode_spec(batch, np.random.default_rng(seed), **kw), steps)


@pytest.mark.parametrize("batch", [1, 7, 64])
def test_decode_walk_replays_and_matches(device: torch.device, batch: int) -> None:
    builder = _check_walk(_decode_walk(batch, 24, max_context=200, table_width=32), device)
    # Each slot's first step of a layout composes; the block-table width changes now and then as
    # contexts grow. Most steps replay.
    assert builder.stats.replayed >= 12, builder.stats


def test_padded_and_empty_rows_replay(device: torch.device) -> None:
    """CUDA-graph padding rows and zero-query rows (max_query_len <= 1) take the replay path."""
    table = np.arange(4 * 6, dtype=np.int32).reshape(4, 6)
    specs = [BatchSpec(num_computed_tokens=[5 + i % 2, 0, 9 + i % 2], num_scheduled_tokens=[1, 0, 1], block_table=table[:3],
                       block_size=4, num_reqs_padded=4, num_tokens_padded=4) for i in range(8)]
    specs += [BatchSpec(num_computed_tokens=[], num_scheduled_tokens=[], block_table=np.zeros((0, 1), np.int32),
                        block_size=4)] * 4
    builder = _check_walk(specs, device)
    assert builder.stats.replayed == 5 + 1  # 8 padded steps and 4 empty ones on 3 slots


_GRAPH = [None, StaticProfile(max_num_reqs=8, max_num_tokens=16, max_blocks_per_req=8, block_size=4)]


@pytest.mark.parametrize("profile", _GRAPH, ids=["eager", "graph"])
def test_page_count_changes_never_resize_a_handed_out_view(device: torch.device, profile: Any) -> None:
    """A replay whose page count differs from its slot's last hands out new views of the page
    indices; no view handed out before (the composed steps', shared with composable steps on that
    slot) changes its shape, and every step's indices are right (the walk goes up and down)."""
    table = np.arange(3 * 8, dtype=np.int32).reshape(3, 8)
    # Page counts 7, 9, 8, 7, 9, ... (block size 4): each ring slot sees a new count at every replay.
    contexts = [[3, 8, 9], [7, 8, 12], [7, 8, 9], [3, 8, 9]]
    specs = [BatchSpec(num_computed_tokens=contexts[i % 3 if i % 7 else 3], num_scheduled_tokens=[1, 1, 1],
                       block_table=table, block_size=4) for i in range(20)]
    kw = {} if profile is None else {"profile": profile}
    builder = FusedStepBuilder(Stager(device, **kw))
    first = [builder.build(spec).flashinfer.paged_kv_indices for spec in specs[:3]]  # each slot's first composes
    shapes = [f.shape for f in first]
    _check_walk(specs, device, **kw)  # (a builder of its own: every replayed field against the composable path)
    for spec in specs[3:]:
        got = builder.build(spec)
        assert got.flashinfer.paged_kv_indices.shape == (spec.num_pages,)
        assert got.flashinfer.paged_kv_indices_cpu.shape == (spec.num_pages,)
        assert [f.shape for f in first] == shapes  # never resized
    assert builder.stats.replayed >= len(specs) - 6  # (graph mode records again once its arena grows)


@pytest.mark.parametrize("profile", _GRAPH, ids=["eager", "graph"])
def test_optional_spec_arrays_are_part_of_the_layout(device: torch.device, profile: Any) -> None:
    """Steps of one shape with and without prompt lengths, upper bounds and (zero) draft counts: a
    layout recorded without an optional array must not replay a step that has it, or the reverse."""
    base = _decode_walk(5, 1, max_context=30, table_width=8, block_size=4)[0]
    c, q, bt = base.num_computed_tokens, base.num_scheduled_tokens, base.block_table
    variants = [
        {},
        {"num_prompt_tokens": np.minimum(c, 4) + 1},
        {"seq_lens_upper_bound": c + q + 2},
        {"num_draft_tokens": np.zeros_like(q)},
        {"num_prompt_tokens": c + 5, "seq_lens_upper_bound": c + q},
    ]
    specs = [BatchSpec(num_computed_tokens=c, num_scheduled_tokens=q, block_table=bt, block_size=base.block_size, **v)
             for _ in range(4) for v in variants]
    builder = _check_walk(specs, device, profile=profile)
    assert builder.stats.replayed > 0


@pytest.mark.parametrize("profile", _GRAPH, ids=["eager", "graph"])
def test_padded_steps_share_a_layout_whatever_their_real_counts(device: torch.device, profile: Any) -> None:
    """Padded to the same rows, steps with fewer real rows or fewer real tokens replay one layout and
    differ only in ``num_real_reqs``, ``num_real_tokens``, ``max_query_len`` (and the values); the same
    real counts padded to more tokens (``num_actual_tokens``) is another layout."""
    table = np.arange(3 * 4, dtype=np.int32).reshape(3, 4) + 1
    shapes = [([6, 2, 9], [1, 0, 1], 4, 4), ([9, 2], [1, 1], 4, 4), ([6, 2, 9], [1, 1, 1], 4, 4),
              ([6, 2, 9], [0, 0, 0], 4, 4), ([6, 2, 9], [1, 0, 1], 4, 8), ([6, 2, 9], [1, 0, 1], 5, 4)]
    # (the same block-table width throughout)
    specs = [BatchSpec(num_computed_tokens=c, num_scheduled_tokens=q, block_table=table[: len(c)], block_size=4,
                       num_reqs_padded=bp, num_tokens_padded=tp) for _ in range(4) for c, q, bp, tp in shapes]
    builder = _check_walk(specs, device, profile=profile)
    # Three layouts: 4 rows and 4 tokens (shapes 0-3, on all 3 slots), 4 rows and 8 tokens (shape 4,
    # always slot 1), 5 rows and 4 tokens (shape 5, always slot 2): 5 steps compose, the rest replay.
    # In graph mode the first step lays the fields out and records nothing: one more composes.
    assert builder.stats.replayed == len(specs) - 5 - (profile is not None)


_SPEC_GRAPH = [None, StaticProfile(max_num_reqs=8, max_num_tokens=40, max_blocks_per_req=8, block_size=64)]


@pytest.mark.parametrize("profile", _SPEC_GRAPH, ids=["eager", "graph"])
def test_spec_decode_walk_replays_and_matches(device: torch.device, profile: Any) -> None:
    """Spec decode (4 query tokens a row) with the default decode thresholds: every row is a prefill
    row for both backends, and such steps replay too (FlashInfer's prefill query indptr written by the
    common pass). CUDA-graph padding rows (query 0) follow the real rows."""
    # (64-token blocks: the longest request needs a new block-table column every 16 steps, a new
    # eager layout; with 16-token blocks that is every 4 steps, and each layout composes once a slot)
    walk = _decode_walk(5, 24, seed=7, max_context=250, table_width=8, block_size=64, drafts=3)
    specs: list[Any] = list(walk)
    if profile is not None:  # padded: 5 real rows of 6, 20 real tokens of 24
        specs += [dataclasses.replace(s, num_reqs_padded=6, num_tokens_padded=24) for s in walk]
    builder = _check_walk(specs, device, profile=profile)
    assert builder.stats.replayed >= len(specs) // 2, builder.stats


@pytest.mark.parametrize("profile", _GRAPH, ids=["eager", "graph"])
def test_prefill_only_steps_replay_whatever_their_rows(device: torch.device, profile: Any) -> None:
    """Steps whose first row's query exceeds both thresholds are prefill rows only in both splits,
    whatever the other rows' queries: steps of one layout with different query lengths (and so
    different query_start_loc, positions, slot mapping and longest query) replay it."""
    table = np.arange(3 * 6, dtype=np.int32).reshape(3, 6) + 1
    rows = [([2, 0, 5], [3, 1, 2]), ([4, 1, 0], [2, 2, 2]), ([0, 3, 1], [5, 0, 1]), ([3, 1, 1], [2, 3, 1])]
    specs = [BatchSpec(num_computed_tokens=c, num_scheduled_tokens=q, block_table=table, block_size=4,
                       num_prompt_tokens=[9, 9, 9]) for _ in range(4) for c, q in rows]
    builder = _check_walk(specs, device, profile=profile)
    assert builder.stats.replayed == len(specs) - 3 - (profile is not None), builder.stats


@pytest.mark.parametrize("profile", _GRAPH, ids=["eager", "graph"])
def test_decode_and_prefill_only_steps_of_one_shape_are_two_layouts(device: torch.device, profile: Any) -> None:
    """Same rows, tokens and width: a decode step and a prefill-only step (first row 2
    tokens, a padding-like 0 after) split differently, so each replays only its own layout."""
    table = np.arange(4 * 3, dtype=np.int32).reshape(4, 3) + 1
    decode = BatchSpec(num_computed_tokens=[5, 6, 7, 4], num_scheduled_tokens=[1, 1, 1, 1], block_table=table,
                       block_size=4)
    prefill = BatchSpec(num_computed_tokens=[5, 6, 7, 4], num_scheduled_tokens=[2, 1, 1, 0], block_table=table,
                        block_size=4)
    specs = [decode, prefill] * 6
    builder = _check_walk(specs, device, profile=profile)
    assert builder.stats.replayed == len(specs) - 6 - (profile is not None), builder.stats


@pytest.mark.parametrize("mixed", [True, False], ids=["decode-then-prefill", "prefills-only"])
def test_each_builder_decides_whether_its_split_changes_its_layout(device: torch.device, mixed: bool) -> None:
    """A first row within FlashInfer's decode threshold while a later row is longer: FlashInfer's split
    depends on every row's query (eager mode stages the prefill indptr for it), and such steps compose.
    Queries of 3 and 4 tokens in every row are prefill rows for FlashInfer (its first rule; FlashAttention
    stages nothing of a split either way): the layout is the split's, and the steps replay."""
    table = np.arange(2 * 4, dtype=np.int32).reshape(2, 4) + 1
    q = [[1, 3], [1, 2]] if mixed else [[4, 4], [3, 4]]
    specs = [BatchSpec(num_computed_tokens=[5, 6], num_scheduled_tokens=qi, block_table=table, block_size=4)
             for _ in range(4) for qi in q]
    builder = _check_walk(specs, device)
    assert builder.stats.replayed == (0 if mixed else 2), builder.stats


def test_block_size_is_part_of_the_layout(device: torch.device) -> None:
    """Block sizes 4 and 8 with the same block-table width (2 columns): slot mapping, page size and
    last-page lengths differ."""
    table = np.array([[3, 5], [7, 2]], np.int32)
    specs = [BatchSpec(num_computed_tokens=[bs + 1, bs + 2], num_scheduled_tokens=[1, 1], block_table=table,
                       block_size=bs) for _ in range(4) for bs in (4, 8)]
    builder = _check_walk(specs, device)
    assert builder.stats.replayed > 0


def test_mixed_steps_between_decodes_do_not_disturb_replays(device: torch.device) -> None:
    rng = np.random.default_rng(3)
    decodes = _decode_walk(16, 12, seed=4, max_context=300, table_width=64)
    mixed = [mixed_spec(rng, prefills=3, decodes=5, max_prompt=40, max_context=300) for _ in range(4)]
    specs = [*decodes[:6], mixed[0], *decodes[6:8], mixed[1], mixed[2], *decodes[8:], mixed[3], *decodes[:3]]
    builder = _check_walk(specs, device)
    assert 0 < builder.stats.replayed < len(specs)


def test_slot_growth_invalidates_recorded_layouts(device: torch.device) -> None:
    """A slot that grows gets new bytes; a layout recorded on the old bytes must be recorded again."""
    small = _decode_walk(4, 8, seed=5, max_context=100, table_width=16)
    big = _decode_walk(96, 4, seed=6, max_context=4000, table_width=256)
    builder = _check_walk([*small, *big, *small, *small], device, initial_bytes=4096)
    assert builder.stager.stats.grows > 0


@pytest.mark.parametrize("which", ["flash_attn", "flashinfer"])
def test_one_backend_only(device: torch.device, which: str) -> None:
    fa = FlashAttentionOptions() if which == "flash_attn" else None
    fi = FlashInferOptions() if which == "flashinfer" else None
    builder = _check_walk(_decode_walk(8, 10, max_context=100, table_width=16), device, fa, fi)
    assert builder.stats.replayed > 0
    out = builder.build(_decode_walk(8, 1, max_context=100, table_width=16)[0])
    assert (out.flash_attn is None, out.flashinfer is None) == (fa is None, fi is None)


@pytest.mark.parametrize("fa_opts, fi_opts, replays", [
    (FlashAttentionOptions(max_num_splits=4), FlashInferOptions(indices="device"), False),
    (FlashAttentionOptions(dcp_world_size=2, dcp_rank=1), FlashInferOptions(dcp_world_size=2, dcp_rank=1), False),
    (FlashAttentionOptions(causal=False), FlashInferOptions(decode_threshold=2, require_uniform=False), True),
    (FlashAttentionOptions(dcp_world_size=2, dcp_rank=1), None, True),
])
def test_options_whose_layouts_replay(device: torch.device, fa_opts: Any, fi_opts: Any, replays: bool) -> None:
    """FlashInfer replays only with the common pass's page table (no DCP, host-side indices);
    FlashAttention replays whatever its options (its DCP lengths are rewritten on a replay)."""
    builder = _check_walk(_decode_walk(6, 6, max_context=100, table_width=16), device, fa_opts, fi_opts)
    assert (builder.stats.replayed > 0) == replays, builder.stats


@pytest.mark.parametrize("fi_opts", [FlashInferOptions(), None])
def test_graph_mode_replays_and_matches_arena_and_all(device: torch.device, fi_opts: Any) -> None:
    """Graph mode (fixed addresses, sentinels past each field's rows): decode walks of two padded
    sizes and a mixed step in between; every field and the whole device arena equal the composable
    builders' after every step."""
    prof = StaticProfile(max_num_reqs=16, max_num_tokens=64, max_blocks_per_req=160, block_size=16)
    rng = np.random.default_rng(8)
    small = _decode_walk(3, 10, seed=1, max_context=100, table_width=16)
    big = [BatchSpec(num_computed_tokens=s.num_computed_tokens, num_scheduled_tokens=s.num_scheduled_tokens,
                     block_table=s.block_table, block_size=16, num_reqs_padded=16, num_tokens_padded=16)
           for s in _decode_walk(11, 10, seed=2, max_context=200, table_width=16)]
    mixed = mixed_spec(rng, prefills=2, decodes=3, max_prompt=20, max_context=100)
    specs = [*small, *big[:5], mixed, *small[:4], *big[5:], *small[4:]]
    builder = _check_walk(specs, device, FlashAttentionOptions(), fi_opts, profile=prof)
    assert builder.stats.replayed >= len(specs) // 2, builder.stats


def test_graph_layout_growth_invalidates_recorded_layouts(device: torch.device) -> None:
    """Another builder adds a field to the graph layout after layouts were recorded: the stager
    re-creates its device arena, so the recorded device views are stale and must be recorded anew."""
    prof = StaticProfile(max_num_reqs=8, max_num_tokens=16, max_blocks_per_req=16, block_size=16)

    def other_field(stager: Stager) -> None:
        with stager.step() as step:
            step.alloc("other.field", 3, np.int32, capacity=8)[:] = 7

    walk = _decode_walk(4, 12, seed=3, max_context=100, table_width=16)
    builder = _check_walk([*walk[:6], other_field, *walk[6:]], device, profile=prof)
    assert builder.stats.replayed > 0


def test_graph_mode_capacity_errors_still_raise() -> None:
    prof = StaticProfile(max_num_reqs=4, max_num_tokens=8, max_blocks_per_req=4, block_size=16)
    builder = FusedStepBuilder(Stager("cpu", profile=prof))
    fits = _decode_walk(2, 1, max_context=40, table_width=8)[0]
    for _ in range(5):  # the first step lays the fields out (nothing recorded), the next three record
        builder.build(fits)
    assert builder.stats.replayed == 1
    with pytest.raises(CapacityError):  # a request needs 5 blocks; the profile holds 4 per request
        builder.build(BatchSpec(num_computed_tokens=[70], num_scheduled_tokens=[1], block_table=[list(range(8))],
                                block_size=16))
    with pytest.raises(CapacityError):  # 6 rows; the profile holds 4
        builder.build(_decode_walk(6, 1, max_context=40, table_width=8)[0])
    builder.build(fits)  # the stager goes on
    assert builder.stager.stats.steps == 6


@given(walk=st.lists(st.tuples(batch_specs(max_reqs=6, max_query_len=3, max_context_len=80,
                                           kinds=("decode", "empty", "prefill", "spec_decode"),
                                           block_sizes=st.just(16)), st.integers(1, 4)),
                     min_size=1, max_size=5),
       graph=st.booleans(), column_step=st.sampled_from([1, 4, 8]))
def test_random_walks_match_the_composable_builders(walk: list[tuple[BatchSpec, int]], graph: bool,
                                                    column_step: int) -> None:
    """Steps drawn at random (decode-only ones replay), each repeated 1-4 times so layouts recur on
    every ring slot, interleaved, in eager and in graph mode: every field of every step (and in graph
    mode every fixed buffer) equals the composable builders'."""
    specs = [spec for spec, times in walk for _ in range(times)]
    specs += [spec for spec, _ in walk]  # and once more each, in order, after every slot has seen them
    kw: dict[str, Any] = {}
    if graph:  # capacities that fit every drawn batch (6 requests, 3 tokens each, padding, contexts <= 80)
        kw["profile"] = StaticProfile(max_num_reqs=16, max_num_tokens=64, max_blocks_per_req=32, block_size=16)
    _check_walk(specs, torch.device("cpu"), column_step=column_step, **kw)


def test_a_failed_step_is_abandoned_and_the_stager_goes_on() -> None:
    prof = StaticProfile(max_num_reqs=4, max_num_tokens=8, max_blocks_per_req=4, block_size=16)
    builder = FusedStepBuilder(Stager("cpu", profile=prof))
    too_long = BatchSpec(num_computed_tokens=[70], num_scheduled_tokens=[1], block_table=[list(range(8))],
                         block_size=16)  # needs 5 blocks; the profile holds 4 per request
    with pytest.raises(CapacityError):
        builder.build(too_long)
    assert builder.stager.stats.steps == 0
    ok = builder.build(_decode_walk(3, 1, max_context=40, table_width=8)[0])
    assert ok.common.num_reqs == 3 and builder.stager.stats.steps == 1


@pytest.mark.parametrize("drafts", [0, 3])
def test_table_column_step_keeps_layouts_while_the_longest_request_grows(device: torch.device, drafts: int) -> None:
    """Eager mode, 4-token blocks: the longest request needs a new column every 4 steps (every step
    with 3 drafts), a new layout each time with ``stage_common``'s width (``table_column_step=1``);
    rounded up to 8 columns (the default) the layouts last 8 times longer. Every field still equals the composable builders' called with the
    same ``block_table_columns``, a multiple of 8 (the columns past a row's blocks: the engine's)."""
    # (2 requests: the page count stays in one bucket, <= 64, so only the width changes layouts)
    walk = _decode_walk(2, 40, seed=9, max_context=60, table_width=64, block_size=4, drafts=drafts)
    exact = _check_walk(walk, device)
    rounded = _check_walk(walk, device, column_step=8)
    assert rounded.stats.replayed > exact.stats.replayed + len(walk) // 4, (exact.stats, rounded.stats)
    last = rounded.build(walk[-1]).common
    assert last.block_table_cpu.shape[1] % 8 == 0 and last.block_table_tensor.shape == last.block_table_cpu.shape
    assert "table_column_step=1" in repr(exact) and "table_column_step" not in repr(rounded)  # 8: the default


def test_table_columns_is_the_builders_width() -> None:
    """``table_columns``: the longest request's blocks (columns of ``block_size * world_size`` tokens
    under context parallelism), at least 1, rounded up but not past the spec's table; what a composed
    step's table has."""
    from attnmeta.spec import ContextParallel

    table = np.arange(2 * 12, dtype=np.int32).reshape(2, 12)
    spec = BatchSpec(num_computed_tokens=[40, 3], num_scheduled_tokens=[1, 1], block_table=table, block_size=4)
    assert (fused.table_columns(spec, 1), fused.table_columns(spec, 8), fused.table_columns(spec, 4)) == (11, 12, 12)
    wide = dataclasses.replace(spec, block_table=np.zeros((2, 40), np.int32))
    assert (fused.table_columns(wide, 8), fused.table_columns(wide, 5)) == (16, 15)
    assert FusedStepBuilder(Stager("cpu")).build(spec).common.block_table_cpu.shape == (2, 12)  # (not 16)
    cp = dataclasses.replace(spec, context_parallel=ContextParallel(2, 0))
    assert (fused.table_columns(cp, 1), fused.table_columns(cp, 4)) == (6, 8)  # cdiv(41, 8) = 6
    empty = BatchSpec(num_computed_tokens=[], num_scheduled_tokens=[], block_table=np.zeros((0, 1), np.int32),
                      block_size=4)
    assert (fused.table_columns(empty, 1), fused.table_columns(empty, 8)) == (1, 1)
    common = FusedStepBuilder(Stager("cpu"), table_column_step=4).build(spec).common
    assert common.block_table_cpu.shape == (2, fused.table_columns(spec, 4)) == (2, 12)


@pytest.mark.parametrize("profile", [None, StaticProfile(max_num_reqs=640, max_num_tokens=2560, max_blocks_per_req=16,
                                                        block_size=16)], ids=["eager", "graph"])
@pytest.mark.parametrize("drafts", [0, 3])
def test_threads_copy_the_same_bytes(device: torch.device, profile: Any, drafts: int,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """``threads=2``: replays of layouts with at least PARALLEL_MIN_ROWS rows copy the block-table rows
    and page indices on numba's thread pool; every field (and in graph mode every fixed buffer) still
    equals the composable builders', and the calling thread's numba thread count is restored. Smaller
    layouts never touch the pool."""
    import numba

    calls: list[int] = []
    real = numba.set_num_threads
    monkeypatch.setattr(numba, "set_num_threads", lambda n: (calls.append(n), real(n))[1])
    before = numba.get_num_threads()
    rows = fused.PARALLEL_MIN_ROWS + 8
    # (a 13-column table: the staged width, 16 in both modes, zero-fills columns past the engine's)
    def junk(stager: Stager) -> None:  # every byte of the next slot overwritten (eager mode)
        with stager.step() as step:
            step.alloc("junk", step.slot_bytes // 4, np.int32)[:] = 77

    walk: list[Any] = []
    for spec in _decode_walk(rows, 4, seed=11, max_context=190, table_width=13, drafts=drafts):
        # each step on every slot, then (eager mode) junk on every slot, then replays of the step
        walk += [spec] * 3 + ([junk] * 3 if profile is None else []) + [spec] * 3
    builder = _check_walk(walk, device, column_step=8, threads=2, profile=profile)
    assert builder.stats.replayed > 0 and calls[::2] == [2] * builder.stats.replayed and numba.get_num_threads() == before
    calls.clear()
    small = _check_walk(_decode_walk(8, 8, seed=11, max_context=190, table_width=13, drafts=drafts), device, threads=2,
                        profile=profile)
    assert small.stats.replayed > 0 and calls == []
    assert "threads=2" in repr(builder)


def test_threads_start_numbas_pool_only_when_used_and_keep_torchs_thread_count() -> None:
    """A fresh process: builders with ``threads=1`` (the default) never start numba's threading layer;
    one with ``threads=2`` starts it on its first parallel replay, and torch's CPU thread count (which
    the layer's OpenMP start changes) is as it was. Before the fix, loading the kernel started the layer
    and torch's CPU ops ran on every core, a spinning second thread beside each copy."""
    import subprocess
    import sys

    code = (
        "import numba.np.ufunc.parallel as par, numpy as np, torch\n"
        "torch.set_num_threads(1)\n"
        "from attnmeta.testing.workloads import advance, decode_spec\n"
        "from attnmeta.backends.fused import PARALLEL_MIN_ROWS, FusedStepBuilder\n"
        "from attnmeta.staging import Stager\n"
        "specs = advance(decode_spec(PARALLEL_MIN_ROWS + 8, np.random.default_rng(0), max_context=200,"
        " table_width=16), 2)\n"
        "for threads in (1, 2):\n"
        "    b = FusedStepBuilder(Stager('cpu'), threads=threads)\n"
        "    for i in range(8):\n"
        "        b.build(specs[i % 2])\n"
        "    print(threads, b.stats.replayed > 0, torch.get_num_threads(), par._is_initialized)\n"
    )
    env = {**__import__("os").environ, "NUMBA_NUM_THREADS": "2"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["1 True 1 False", "2 True 1 True"], out.stdout


def test_bad_options_fail_fast() -> None:
    with pytest.raises(TypeError, match="flash_attn: options must be FlashAttentionOptions, got str"):
        FusedStepBuilder(Stager("cpu"), flash_attn="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="flashinfer: options must be FlashInferOptions, got FlashAttentionOptions"):
        FusedStepBuilder(Stager("cpu"), flashinfer=FlashAttentionOptions())  # type: ignore[arg-type]
    for bad in (0, -8, 2.0, True):
        with pytest.raises(ValueError, match=r"Group\.table_column_step: expected an int >= 1"):
            FusedStepBuilder(Stager("cpu"), table_column_step=bad)  # type: ignore[arg-type]
    import numba

    for bad in (0, numba.config.NUMBA_NUM_THREADS + 1, 2.0, True):
        with pytest.raises(ValueError, match="threads: expected an int in"):
            FusedStepBuilder(Stager("cpu"), threads=bad)  # type: ignore[arg-type]


def test_one_copy_per_step_and_no_sync_on_meta() -> None:
    builder = FusedStepBuilder(Stager("meta"))
    specs = _decode_walk(5, 8, max_context=100, table_width=16)
    with no_device_sync():
        for spec in specs:
            builder.build(spec)
    assert builder.stats.replayed > 0
    assert builder.stager.stats.copies == len(specs)
    assert f"replayed={builder.stats.replayed}" in repr(builder)


def test_docstring_example() -> None:
    runner = doctest.DocTestRunner()
    tests = doctest.DocTestFinder(recurse=False).find(FusedStepBuilder, "FusedStepBuilder", globs=dict(vars(fused)))
    assert tests and tests[0].examples
    for t in tests:
        runner.run(t)
    assert runner.failures == 0


def test_a_context_parallel_spec_needs_matching_flashinfer_options() -> None:
    spec = BatchSpec(num_computed_tokens=[5, 30], num_scheduled_tokens=[1, 4], block_size=4,
                     block_table=np.arange(10, dtype=np.int32).reshape(2, 5), context_parallel=ContextParallel(2, 0))
    stager = Stager("cpu")
    with pytest.raises(UnsupportedBatchError, match="dcp_world_size"):
        FusedStepBuilder(stager).build(spec)
    assert stager.stats.steps_begun == 0
    _, _, fi = FusedStepBuilder(stager, flashinfer=FlashInferOptions(dcp_world_size=2)).build(spec)
    assert fi is not None and fi.paged_kv_indptr_cpu.tolist() == [0, 1, 5]
