"""GDN replays (``GDNBuilder.replay_key`` / ``replayer``): the steps of a decode loop, without and with spec
decode (one-token rows, and rows verifying drafts), eager and graph mode, replay and equal the reference; the steps whose layout the shape cannot fix
are composed; a replayer that leaves a field stale is caught."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from profile_helpers import scaled_examples

from attnmeta import BatchSpec, Stager, StaticProfile
from attnmeta.backends.mamba import gdn
from attnmeta.backends.mamba.gdn import GDN, GDNInputs, GDNOptions
from attnmeta.compose import Group, StepBuilder
from attnmeta.staging import CapacityError
from attnmeta.testing import check_reads_lengths, check_replay
from attnmeta.testing.lab import lab
from attnmeta.testing.strategies import batch_specs
from attnmeta.testing.workloads import advance, decode_spec, fits_profile, reshuffled

STEPS = 12
PROFILE = StaticProfile(max_num_reqs=32, max_num_tokens=128, max_blocks_per_req=64, block_size=16)


def _stager(graph: bool) -> Stager:
    return Stager("cpu", num_slots=2, debug_fill=0xA5, profile=PROFILE if graph else None)


def _decodes(n: int, seed: int, *, padded: bool = True) -> BatchSpec:
    """``n`` one-token decode rows (contexts past their prompts), padded by 2 rows and 3 tokens."""
    s = decode_spec(n, np.random.default_rng(seed), max_context=300, table_width=64)
    return BatchSpec(num_computed_tokens=s.num_computed_tokens, num_scheduled_tokens=s.num_scheduled_tokens,
                     num_prompt_tokens=s.num_prompt_tokens, block_table=s.block_table, block_size=16,
                     num_reqs_padded=n + 2 if padded else None, num_tokens_padded=n + 3 if padded else None)


def _walk(kind: str, spec: BatchSpec, seed: int) -> list[BatchSpec]:
    return advance(spec, STEPS) if kind == "advance" else reshuffled(spec, STEPS, np.random.default_rng(seed))


def _accepted(walk: list[BatchSpec], k: int, seed: int) -> list[GDNInputs]:
    rng = np.random.default_rng(seed)
    return [GDNInputs(num_accepted_tokens=rng.integers(1, k + 2, size=s.num_reqs).astype(np.int32)) for s in walk]


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("kind", ["advance", "reshuffled"])
@pytest.mark.parametrize("mode", ["none", "align"])
@pytest.mark.parametrize("n", [1, 7])
def test_a_decode_walk_without_spec_decode_replays(graph: bool, kind: str, mode: Literal["none", "align"],
                                                   n: int) -> None:
    walk = _walk(kind, _decodes(n, n), n)
    opts = GDNOptions(cache_mode=mode)
    assert GDN.replay_key(walk[0].shape, opts, GDN.inputs(None)) == gdn._DECODE
    replayed = check_replay(GDN, walk, opts, stager=_stager(graph))
    assert replayed >= STEPS // 2, replayed  # (each slot's first steps, and a new block-table width, compose)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("kind", ["advance", "reshuffled"])
@pytest.mark.parametrize("max_bs", [None, 4, 512])
@pytest.mark.parametrize("accepted", [True, False], ids=["accepted", "no-inputs"])
@pytest.mark.parametrize("n", [1, 7])
def test_a_spec_decode_walk_replays(graph: bool, kind: str, max_bs: int | None, accepted: bool, n: int) -> None:
    """Spec decode on: every one-token decode is a spec row with zero drafts; an all-spec step, staged to
    every row under FULL graphs when ``cudagraph_max_bs`` holds it."""
    k = 2
    walk = _walk(kind, _decodes(n, 10 + n), n)
    opts = GDNOptions(num_speculative_tokens=k, cudagraph_max_bs=max_bs)
    staged = max_bs is not None and max_bs >= n
    assert GDN.replay_key(walk[0].shape, opts, GDN.inputs(None)) == (gdn._SPEC, n, n, staged, 1)
    inputs: Any = _accepted(walk, k, n) if accepted else None
    replayed = check_replay(GDN, walk, opts, inputs, stager=_stager(graph))
    assert replayed >= STEPS // 2, replayed


def test_the_composer_counts_the_replays_and_the_replayed_metadata_is_the_derived_one() -> None:
    """Field for field against a fresh derive of the same step (not only the reference): the replay's
    views hold this step's values, and its scalars are the step's."""
    import attnmeta

    k = 3
    walk = reshuffled(_decodes(5, 3), 10, np.random.default_rng(3))
    opts = GDNOptions(num_speculative_tokens=k, cache_mode="align", cudagraph_max_bs=16)
    inputs = _accepted(walk, k, 4)
    composer = StepBuilder(Stager("cpu", num_slots=2), Group({"gdn": (GDN, opts)}))
    for spec, inp in zip(walk, inputs, strict=True):
        got = composer.build(spec, inputs={"gdn": inp})["gdn"]
        want = attnmeta.build(spec, Stager("cpu"), GDN, opts, inp)
        for f in [x.name for x in dataclasses.fields(want)]:
            a, b = getattr(got, f), getattr(want, f)
            if f == "common":
                continue
            if a is None or b is None or isinstance(a, int | bool):
                assert a == b, f
            else:
                assert a.shape == b.shape and a.dtype == b.dtype and (a == b).all(), f
    assert composer.stats.replayed >= 6


def _drafted(n: int, seed: int, drafts: list[int] | None = None) -> BatchSpec:
    """``n`` spec rows verifying ``drafts`` drafts each (default 2), ``d + 1`` tokens a row."""
    s = decode_spec(n, np.random.default_rng(seed), max_context=300, drafts=2, table_width=64)
    if drafts is None:
        return s
    d = np.array(drafts, np.int32)
    return BatchSpec(num_computed_tokens=s.num_computed_tokens, num_scheduled_tokens=d + 1, num_draft_tokens=d,
                     num_prompt_tokens=s.num_prompt_tokens, block_table=s.block_table, block_size=16)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("max_bs", [None, 32])
@pytest.mark.parametrize("accepted", [True, False], ids=["accepted", "no-inputs"])
@pytest.mark.parametrize("drafts", [None, [2, 1, 2, 2, 0, 2]], ids=["uniform", "mixed-drafts"])
def test_a_spec_decode_walk_with_drafts_replays(graph: bool, max_bs: int | None, accepted: bool,
                                                drafts: list[int] | None) -> None:
    """Every row a spec row (``d`` drafts verified with ``d + 1`` tokens, or one token past its prompt):
    ``StepShape.all_spec_rows`` says so, and the step replays its all-spec layout; the spec rows' common
    query length is part of the key (None where they differ)."""
    k = 2
    spec = _drafted(6, 5, drafts)
    walk = advance(spec, STEPS)
    opts = GDNOptions(num_speculative_tokens=k, cudagraph_max_bs=max_bs)
    T = int(spec.num_scheduled_tokens.sum())
    assert spec.shape.all_spec_rows
    assert GDN.replay_key(spec.shape, opts, GDN.inputs(None)) == (
        gdn._SPEC, 6, T, max_bs is not None, 3 if drafts is None else None)
    inputs: Any = _accepted(walk, k, 5) if accepted else None
    assert check_replay(GDN, walk, opts, inputs, stager=_stager(graph)) >= STEPS // 2


def test_spec_decode_with_a_prefill_row_among_drafts_and_prefills_are_composed() -> None:
    """Where a row of a step with drafts is not a spec row (``q != d + 1``: its extra tokens make it a
    prefill) or a row prefills, which rows are which is in the per-row counts: such steps are staged the
    ordinary way (and still equal the reference)."""
    k = 2
    spec = _drafted(6, 5)
    q = spec.num_scheduled_tokens.copy()
    q[3] = 5  # (a row of 2 drafts scheduled 5 tokens: not a spec row)
    spec = dataclasses.replace(spec, num_scheduled_tokens=q)
    opts = GDNOptions(num_speculative_tokens=k)
    assert not spec.shape.all_spec_rows and GDN.replay_key(spec.shape, opts, GDN.inputs(None)) is None
    assert check_replay(GDN, advance(spec, 6), opts, _accepted(advance(spec, 6), k, 5)) == 0
    prefill = BatchSpec(num_computed_tokens=[9, 0, 4], num_scheduled_tokens=[1, 5, 1], num_prompt_tokens=[3, 5, 9],
                        block_table=np.arange(12, dtype=np.int32).reshape(3, 4), block_size=4)
    for o in (GDNOptions(), opts):
        assert GDN.replay_key(prefill.shape, o, GDN.inputs(None)) is None
        assert check_replay(GDN, reshuffled(prefill, 6, np.random.default_rng(0)), o) == 0


def test_a_loop_of_decode_and_prefill_steps_replays_the_decode_steps_only() -> None:
    decode = _decodes(4, 7)
    prefill = BatchSpec(num_computed_tokens=[0, 12], num_scheduled_tokens=[9, 1], num_prompt_tokens=[20, 3],
                        block_table=decode.block_table[:2], block_size=16)
    composer = StepBuilder(Stager("cpu", num_slots=2), Group({"gdn": (GDN, GDNOptions())}))
    for i, spec in enumerate(advance(decode, 10)):
        composer.build(spec)
        if i % 3 == 2:
            composer.build(prefill)
    assert composer.stats.steps == 13 and 4 <= composer.stats.replayed <= 10


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_a_replayed_step_raises_the_derive_s_errors(graph: bool) -> None:
    k = 2
    walk = advance(_decodes(3, 1, padded=False), 8)
    opts = GDNOptions(num_speculative_tokens=k)
    composer = StepBuilder(_stager(graph), Group({"gdn": (GDN, opts)}))
    for spec in walk[:6]:
        composer.build(spec, inputs={"gdn": GDNInputs(num_accepted_tokens=np.ones(3, np.int32))})
    before = composer.stats.replayed
    assert before > 0
    bad = GDNInputs(num_accepted_tokens=np.array([1, k + 2, 1], np.int32))
    with pytest.raises(ValueError, match=r"num_accepted_tokens\[1\]=4 is outside \[1, 3\]"):
        composer.build(walk[6], inputs={"gdn": bad})
    with pytest.raises(ValueError, match=r"num_accepted_tokens\[1\]=4 is outside \[1, 3\]"):
        GDN.build(walk[6], Stager("cpu"), opts, bad)
    assert composer.stats.replayed == before
    composer.build(walk[7], inputs={"gdn": GDNInputs(num_accepted_tokens=np.full(3, 2, np.int32))})  # (and on)


@pytest.mark.parametrize("k", [0, 2])
def test_the_key_reads_no_lengths(k: int) -> None:
    """reads_lengths is False in "none" mode (AlignReadsLengths): the key must not change with them."""
    opts = GDNOptions(num_speculative_tokens=k)
    assert not GDN.reads_lengths(opts) and GDN.reads_lengths(GDNOptions(cache_mode="align"))
    for spec in (_decodes(5, 2), decode_spec(3, np.random.default_rng(1), max_context=100, drafts=2, table_width=8)):
        check_reads_lengths(GDN, spec.shape, opts)


# ------------------------------------------------------------------------------------------------
# broken replayers are caught


def _spec_walk() -> tuple[list[BatchSpec], GDNOptions, list[GDNInputs]]:
    k = 2
    walk = reshuffled(_decodes(6, 21), STEPS, np.random.default_rng(21))
    return walk, GDNOptions(num_speculative_tokens=k), _accepted(walk, k, 22)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("spec_decode", [False, True], ids=["decode", "spec"])
def test_a_replayer_that_rewrites_nothing_is_caught(monkeypatch: pytest.MonkeyPatch, graph: bool,
                                                    spec_decode: bool) -> None:
    if spec_decode:
        walk, opts, inputs = _spec_walk()
    else:
        walk, opts, inputs = reshuffled(_decodes(6, 23), STEPS, np.random.default_rng(23)), GDNOptions(), None
    assert check_replay(GDN, walk, opts, inputs, stager=_stager(graph)) > 0
    monkeypatch.setattr(gdn._Replayer, "rewrite", lambda self, step, host, inputs: None)
    with pytest.raises(AssertionError, match=r"step \d+ \(replayed\)"):
        check_replay(GDN, walk, opts, inputs, stager=_stager(graph))


def _interleaved(walk: list[BatchSpec], inputs: list[GDNInputs] | None) -> tuple[list[BatchSpec], Any]:
    """``walk`` with a pair of prefill steps after every second pair of its steps: each ring slot then holds
    another layout's bytes (over the offsets of the walk's fields) before the next replay of the walk's."""
    n = walk[0].num_reqs
    prefill = BatchSpec(num_computed_tokens=np.zeros(n, np.int32), num_scheduled_tokens=np.full(n, 9, np.int32),
                        num_prompt_tokens=np.full(n, 20, np.int32), block_table=walk[0].block_table[:n], block_size=16)
    specs: list[BatchSpec] = []
    given: list[Any] = []
    for i, s in enumerate(walk):
        specs.append(s)
        given.append(None if inputs is None else inputs[i])
        if i % 4 == 3:
            specs += [prefill, prefill]
            given += [None, None]
    return specs, given if inputs is not None else None


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("field", range(5), ids=["masks", "state_indices", "query_start_loc", "accepted",
                                                  "token_indices"])
def test_a_replayer_that_leaves_one_field_unwritten_is_caught(monkeypatch: pytest.MonkeyPatch, graph: bool,
                                                              field: int) -> None:
    """Every field, constants included (the all-spec masks, query starts and token indices of one-token
    rows repeat from step to step; another layout's step on the slot overwrites them)."""
    walk, opts, inputs = _spec_walk()
    specs, given = _interleaved(walk, inputs)
    assert check_replay(GDN, specs, opts, given, stager=_stager(graph)) > 0
    rewrite = gdn._Replayer.rewrite

    def skip(self: Any, step: Any, host: Any, inp: Any) -> None:
        view = self.fields[field]
        kept = view.copy()
        rewrite(self, step, host, inp)
        view[...] = kept  # (what the slot held: the last step's bytes there)

    monkeypatch.setattr(gdn._Replayer, "rewrite", skip)
    with pytest.raises(AssertionError, match=r"step \d+ \(replayed\)"):
        check_replay(GDN, specs, opts, given, stager=_stager(graph))


def test_a_result_that_keeps_the_recorded_token_count_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    walk = [BatchSpec(num_computed_tokens=s.num_computed_tokens, num_scheduled_tokens=s.num_scheduled_tokens,
                      num_prompt_tokens=s.num_prompt_tokens, block_table=s.block_table, block_size=16,
                      num_reqs_padded=8, num_tokens_padded=8 + i % 3)
            for i, s in enumerate(advance(_decodes(5, 9, padded=False), 9))]
    assert check_replay(GDN, walk, GDNOptions()) > 0
    monkeypatch.setattr(gdn._Replayer, "result",
                        lambda self, step, common, host, paged, inputs: self.make(common, 8, 8, common.query_start_loc,
                                                                                 common.query_start_loc_cpu))
    with pytest.raises(AssertionError, match=r"step \d+ \(replayed\)"):
        check_replay(GDN, walk, GDNOptions())


# ------------------------------------------------------------------------------------------------
# random steps and options


@settings(max_examples=scaled_examples(40))
@given(spec=batch_specs(max_reqs=10, max_query_len=40, max_context_len=300), seed=st.integers(0, 2**32 - 1),
       graph=st.booleans())
def test_random_walks_with_random_options_replay_what_their_key_names(spec: BatchSpec, seed: int, graph: bool) -> None:
    """Any step of any shape with the lab's random options (spec tokens, cache mode, prefill backend,
    FULL-graph staging) and accepted counts: a replayed step equals the reference (and the replayer
    checks that the recorded step's layout is the one its key names)."""
    rng = np.random.default_rng(seed)
    opts, _ = lab("gdn").sample(spec, rng)
    k = opts.num_speculative_tokens
    walk = reshuffled(spec, 5, rng)
    inputs = [GDNInputs(num_accepted_tokens=rng.integers(1, k + 2, size=s.num_reqs).astype(np.int32))
              if k and rng.random() < 0.6 else None for s in walk]
    if any(GDN.unsupported_reasons(s, opts, GDN.inputs(i)) for s, i in zip(walk, inputs, strict=True)):
        return
    prof = StaticProfile(max_num_reqs=16, max_num_tokens=512, max_blocks_per_req=512, block_size=spec.block_size)
    try:
        check_replay(GDN, walk, opts, inputs, stager=Stager("cpu", num_slots=2, debug_fill=0xA5,
                                                            profile=prof if graph else None))
    except CapacityError:
        if not graph or fits_profile(spec, prof):
            raise
