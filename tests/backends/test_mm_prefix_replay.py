"""Multimodal prefix-range replays (attnmeta.backends.mm_prefix: MMPrefixBuilder.replay_key / replayer): a
step without spans (nothing staged) replays in either form and mode; with spans, the FlashAttention form
(staged for every token, ``-1`` where no range covers one) replays in eager and graph mode, covered or not,
and the Triton form in graph mode (``(num_reqs, graph_max_ranges, 2)``, zeros when every row is ``[(0, 0)]``);
the eager Triton form with spans, whose width is per-row data, is composed. Replayed steps equal the lab
reference and a never-replaying composer field for field, raise what composed ones do, and replayers that
leave the slot's bytes in place or keep the recorded ranges are caught."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from compose_helpers import compare_replays

import attnmeta
from attnmeta import BatchSpec, Stager, StaticProfile
from attnmeta.backends import mm_prefix
from attnmeta.backends.mm_prefix import MM_PREFIX, MMPrefixInputs, MMPrefixOptions
from attnmeta.compose import Group, StepBuilder
from attnmeta.staging import CapacityError
from attnmeta.testing import check_reads_lengths, check_replay
from attnmeta.testing.workloads import advance, reshuffled

_BS = 16
_PROFILE = StaticProfile(max_num_reqs=8, max_num_tokens=64, max_blocks_per_req=16, block_size=_BS)
_FORMS = ("triton", "flash_attn")


def _stager(graph: bool) -> Stager:
    return Stager("cpu", num_slots=2, debug_fill=0xA5, profile=_PROFILE if graph else None)


def _options(form: str, **kw: Any) -> MMPrefixOptions:
    return MMPrefixOptions(form=form, **kw)  # type: ignore[arg-type]


def _table(rows: int) -> np.ndarray:
    return np.arange(1, 1 + rows * 16, dtype=np.int32).reshape(rows, 16)


def _decode_spec() -> BatchSpec:
    """Four requests decoding past their prompts (of 40, 12, 50 and 30 tokens)."""
    return BatchSpec(num_computed_tokens=[45, 31, 60, 30], num_scheduled_tokens=[1] * 4,
                     num_prompt_tokens=[40, 12, 50, 30], block_table=_table(4), block_size=_BS)


def _spans(spec: BatchSpec) -> MMPrefixInputs:
    """Each real request's image spans, from its prompt length (so they move with it when a walk reorders the
    requests): one over the prompt's second quarter, and for prompts over 32 tokens a second of 5 tokens
    at its middle, its first token not embedded."""
    counts, starts, lengths, embed = [], [], [], []
    assert spec.num_prompt_tokens is not None
    for p in spec.num_prompt_tokens[: spec.num_reqs].tolist():
        spans = [(p // 4, max(p // 4, 1))] + ([(p // 2 + 2, 5)] if p > 32 else [])
        counts.append(len(spans))
        for s, n in spans:
            starts.append(s)
            lengths.append(n)
            embed += [not (n == 5 and i == 0) for i in range(n)]
    return MMPrefixInputs(mm_span_indptr=np.concatenate([[0], np.cumsum(counts)]).astype(np.int32),
                          mm_span_starts=np.array(starts, np.int32), mm_span_lengths=np.array(lengths, np.int32),
                          mm_is_embed=np.array(embed, bool))


def _chunk(covered: bool, shift: int = 0) -> BatchSpec:
    """A decode row beside two prefill chunks of 4 tokens: row 1's chunk at tokens ``9 + shift`` to ``12 +
    shift`` (``shift`` at most 4), ending in its first image (prompt 48: tokens 12-23), when ``covered``,
    else past both images."""
    return BatchSpec(num_computed_tokens=[50, 9 + shift if covered else 40, 0], num_scheduled_tokens=[1, 4, 4],
                     num_prompt_tokens=[40, 48, 30], block_table=_table(3), block_size=_BS)


def _walk(spec: BatchSpec) -> list[BatchSpec]:
    return advance(spec, 6) + reshuffled(spec, 6, np.random.default_rng(3))


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("form", _FORMS)
def test_a_decode_walk_without_spans_replays_and_equals_the_reference(graph: bool, form: str) -> None:
    walk = _walk(_decode_spec())
    for inputs in (MMPrefixInputs(), MMPrefixInputs(mm_span_indptr=np.zeros(5, np.int32), mm_span_starts=[],
                                                    mm_span_lengths=[])):
        assert check_replay(MM_PREFIX, walk, _options(form), inputs, stager=_stager(graph)) >= len(walk) - 4


@pytest.mark.parametrize(("graph", "form"), [(False, "flash_attn"), (True, "flash_attn"), (True, "triton")],
                         ids=["eager-flash_attn", "graph-flash_attn", "graph-triton"])
def test_a_multimodal_decode_walk_replays_and_equals_the_reference(graph: bool, form: str) -> None:
    walk = _walk(_decode_spec())
    assert check_replay(MM_PREFIX, walk, _options(form), [_spans(s) for s in walk], stager=_stager(graph)) >= len(
        walk) - 4


def test_the_eager_triton_form_with_spans_is_composed_and_equals_the_reference() -> None:
    """Its width is the widest row's range count: per-row data, which the scalars do not tell."""
    walk = _walk(_decode_spec())
    assert check_replay(MM_PREFIX, walk, _options("triton"), [_spans(s) for s in walk], stager=_stager(False)) == 0


def _covered_or_not() -> list[BatchSpec]:
    """Two covered steps (at other tokens of the image each time), two uncovered ones, and so on: one layout,
    each step replaying over a step of the other kind on its slot (the form's tensor, then None, and back)."""
    return [_chunk(i % 4 < 2, i % 5) for i in range(12)]


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_the_flash_attn_form_replays_covered_and_uncovered_steps_of_one_layout(graph: bool) -> None:
    walk = _covered_or_not()
    assert {MM_PREFIX.replay_key(s.shape, _options("flash_attn"), _spans(s)) for s in walk} == {("flash_attn", 9)}
    assert check_replay(MM_PREFIX, walk, _options("flash_attn"), [_spans(s) for s in walk],
                        stager=_stager(graph)) >= len(walk) - 4
    m = [MM_PREFIX.build(s, Stager("cpu"), _options("flash_attn"), _spans(s)) for s in walk[1:3]]
    assert m[0].num_query_range_rows == 9 and m[1].mm_prefix_query_range_tensor is None


def test_the_graph_triton_form_replays_steps_whose_every_row_is_empty() -> None:
    """A sliding window of 8 tokens drops every range of the longer prompts' spans: such a step's form is
    None (every row ``[(0, 0)]``), on the same layout as a step whose ranges stay."""
    opts = _options("triton", sliding_window=8)
    short = BatchSpec(num_computed_tokens=[45, 31, 60, 30], num_scheduled_tokens=[1] * 4,
                      num_prompt_tokens=[20, 12, 24, 30], block_table=_table(4), block_size=_BS)
    long = BatchSpec(num_computed_tokens=[45, 41, 60, 40], num_scheduled_tokens=[1] * 4,
                     num_prompt_tokens=[40, 36, 50, 40], block_table=_table(4), block_size=_BS)

    def quarter(spec: BatchSpec) -> MMPrefixInputs:  # (one span over each prompt's second quarter)
        assert spec.num_prompt_tokens is not None
        p = spec.num_prompt_tokens
        return MMPrefixInputs(mm_span_indptr=np.arange(5, dtype=np.int32), mm_span_starts=p // 4,
                              mm_span_lengths=p // 4)

    walk = [short, short, long, long] * 3
    assert MM_PREFIX.build(long, Stager("cpu"), opts, quarter(long)).mm_prefix_range_tensor is None
    assert MM_PREFIX.build(short, Stager("cpu"), opts, quarter(short)).mm_prefix_range_tensor is not None
    assert check_replay(MM_PREFIX, walk, opts, [quarter(s) for s in walk], stager=_stager(True)) >= len(walk) - 4


def test_what_a_step_stages() -> None:
    """Nothing without spans; with spans the FlashAttention form for every token (uncovered: -1, and None
    in the metadata), and in graph mode the Triton form at its fixed width (zeros where it is None)."""
    spec = _decode_spec()
    for graph in (False, True):
        for form in _FORMS:
            with _stager(graph).step() as step:
                common = attnmeta.stage_common(spec, step, token_arrays=False)
                staged = MM_PREFIX.stage(common, step, _options(form))
            assert not [n for n in step.field_names if n.startswith("mm_prefix.")], (graph, form)
            assert staged.result().num_ranges == 0
    with _stager(False).step() as step:
        common = attnmeta.stage_common(spec, step, token_arrays=False)
        staged = MM_PREFIX.stage(common, step, _options("flash_attn"), _spans(spec))
    assert step.host("mm_prefix.mm_prefix_query_range_tensor").tolist() == [[-1, -1]] * 4
    assert staged.result().mm_prefix_query_range_tensor is None and staged.result().num_query_range_rows == 0
    lone = MMPrefixInputs(mm_span_indptr=[0, 1, 1, 1, 1], mm_span_starts=[0], mm_span_lengths=[1])
    with _stager(True).step() as step:
        common = attnmeta.stage_common(spec, step, token_arrays=False)
        staged = MM_PREFIX.stage(common, step, _options("triton"), lone)
    assert step.host("mm_prefix.mm_prefix_range_tensor").shape == (4 * 8 * 2,)
    assert not step.host("mm_prefix.mm_prefix_range_tensor").any()
    assert staged.result().mm_prefix_range_tensor is None and staged.result().max_ranges == 0


def test_the_replay_key_and_reads_lengths() -> None:
    spec = _decode_spec()
    shape = spec.shape
    key = MM_PREFIX.replay_key
    for form in _FORMS:
        opts = _options(form)
        assert key(shape, opts, MMPrefixInputs()) == "none"
        assert key(shape, opts, MMPrefixInputs(mm_span_indptr=[0] * 5, mm_span_starts=[], mm_span_lengths=[])) == "none"
        assert key(shape, opts, MMPrefixInputs(mm_span_indptr=[0] * 5)) is None  # (the staged step raises)
        assert key(shape, opts, MMPrefixInputs(mm_span_starts=[[1]], mm_span_lengths=[[1]])) is None
        assert not MM_PREFIX.reads_lengths(opts)
        for s in (spec, _chunk(True)):
            for inputs in (MMPrefixInputs(), _spans(s)):
                check_reads_lengths(MM_PREFIX, s.shape, opts, inputs)
    assert key(shape, _options("triton"), _spans(spec)) == "triton"
    assert key(shape, _options("flash_attn"), _spans(spec)) == ("flash_attn", 4)
    assert key(_chunk(False).shape, _options("flash_attn"), _spans(_chunk(False))) == ("flash_attn", 9)


def _alternating() -> list[tuple[BatchSpec, dict[str, Any] | None, None]]:
    """Decode steps without spans, multimodal decode steps, and prefill chunks covered by a range or not,
    two by two: each layout replays on ring slots whose last step held another's bytes."""
    d, c = _walk(_decode_spec()), _covered_or_not()
    steps: list[tuple[BatchSpec, dict[str, Any] | None, None]] = []
    for i in range(0, 12, 2):
        for j in (i, i + 1):
            steps.append((d[j], None, None))
        for j in (i, i + 1):
            steps.append((d[j], {"mm": _spans(d[j])}, None))
        for j in (i, i + 1):
            steps.append((c[j], {"mm": _spans(c[j])}, None))
    return steps


def _compare(device: torch.device, graph: bool, form: str) -> StepBuilder:
    """The alternating walk on a replaying composer against one that never replays: metadata, and in
    graph mode every field's whole fixed buffer."""
    return compare_replays(device, lambda: [Group({"mm": (MM_PREFIX, _options(form))}, token_arrays=False)],
                           _alternating(), _PROFILE if graph else None)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("form", _FORMS)
def test_replayed_steps_equal_composed_ones_field_for_field(device: torch.device, graph: bool, form: str) -> None:
    composer = _compare(device, graph, form)
    assert composer.stats.replayed >= (10 if graph or form == "flash_attn" else 5), composer.stats


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_a_replayed_step_raises_what_a_composed_one_does(graph: bool) -> None:
    spec = _decode_spec()
    opts = _options("flash_attn" if not graph else "triton", graph_max_ranges=2)
    composer = StepBuilder(_stager(graph), Group({"mm": (MM_PREFIX, opts)}, token_arrays=False))
    for s in advance(spec, 5):
        composer.build(s, {"mm": _spans(s)})
    assert composer.stats.replayed >= 2
    overlapping = MMPrefixInputs(mm_span_indptr=[0, 2, 2, 2, 2], mm_span_starts=[3, 5], mm_span_lengths=[4, 4])
    with pytest.raises(ValueError) as composed:
        MM_PREFIX.build(spec, Stager("cpu"), opts, overlapping)
    with pytest.raises(ValueError) as replayed:
        composer.build(spec, {"mm": overlapping})
    assert str(replayed.value) == str(composed.value) and "overlap" in str(composed.value)
    if graph:  # (three ranges in row 0, two the fixed buffer holds)
        three = MMPrefixInputs(mm_span_indptr=[0, 3, 3, 3, 3], mm_span_starts=[1, 5, 9], mm_span_lengths=[2] * 3)
        with pytest.raises(CapacityError, match="graph_max_ranges=2"):
            composer.build(spec, {"mm": three})
    before = composer.stats.replayed
    for s in advance(spec, 4):
        composer.build(s, {"mm": _spans(s)})
    assert composer.stats.replayed > before


def _into_scratch(self: mm_prefix._Replayer, step: Any, host: Any, inputs: Any) -> None:
    """A broken rewrite: the step's ranges and counts computed, its form written into copies of the staged
    fields, the slot left as it is."""
    opts = self.options
    r_ip, ranges, _spans = mm_prefix._host_ranges(step, self.prefix, host.num_real_reqs, opts, inputs)
    width = mm_prefix._triton_width(r_ip, ranges, host.num_reqs, opts, self.graph) if opts.form == "triton" else 0
    scratch = mm_prefix._Own(*(a.copy() if isinstance(a, np.ndarray) else a for a in self.own))  # type: ignore[arg-type]
    self.written = (step, r_ip, ranges, *mm_prefix._write(host, opts, r_ip, ranges, width, scratch))


@pytest.mark.parametrize(("graph", "form"), [(False, "flash_attn"), (True, "flash_attn"), (True, "triton")],
                         ids=["eager-flash_attn", "graph-flash_attn", "graph-triton"])
def test_a_replayer_that_writes_nothing_into_the_slot_is_caught(monkeypatch: pytest.MonkeyPatch, graph: bool,
                                                                 form: str) -> None:
    monkeypatch.setattr(mm_prefix._Replayer, "rewrite", _into_scratch)
    walk = _covered_or_not() if form == "flash_attn" else _walk(_decode_spec())
    with pytest.raises(AssertionError, match="replayed"):
        check_replay(MM_PREFIX, walk, _options(form), [_spans(s) for s in walk], stager=_stager(graph))
    with pytest.raises(AssertionError, match="step"):
        _compare(torch.device("cpu"), graph, form)


def test_a_replayer_that_keeps_the_recorded_ranges_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """A result with the ranges of the first step it replayed (the host-only fields a replay derives anew)."""
    real = mm_prefix._Replayer.result
    kept: dict[int, Any] = {}

    def stale(self: mm_prefix._Replayer, step: Any, common: Any, host: Any, paged: Any, inputs: Any) -> Any:
        assert self.written is not None
        first = kept.setdefault(id(self), self.written[1:3])
        self.written = (self.written[0], *first, *self.written[3:])
        return real(self, step, common, host, paged, inputs)

    monkeypatch.setattr(mm_prefix._Replayer, "result", stale)
    walk = _walk(_decode_spec())
    with pytest.raises(AssertionError, match="replayed"):
        check_replay(MM_PREFIX, walk, _options("flash_attn"), [_spans(s) for s in walk], stager=_stager(False))
