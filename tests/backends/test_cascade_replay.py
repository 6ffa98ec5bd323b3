"""Cascade replays (attnmeta.backends.cascade: CascadeBuilder.replay_key / replayer): a step the scalars rule
cascade out of (no shared prefix offered or one under 256 tokens, fewer than 8 requests, CUDA-graph padding
rows, a model feature or DCP) stages nothing and replays, its metadata equal to the lab reference's and to a
never-replaying composer's, in eager and graph mode; a step that may cascade (its prefix capped at the
smallest context, its suffix pages every row's) is composed; a replayed step raises what a composed one
does; and replayers that skip the checks or keep the recorded step's common metadata are caught."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch
from compose_helpers import compare_replays

from attnmeta import BatchSpec, Stager, StaticProfile
from attnmeta._fields import template
from attnmeta.backends import cascade
from attnmeta.backends.cascade import CASCADE, CascadeInputs, CascadeMetadata, CascadeOptions
from attnmeta.compose import Group, StepBuilder
from attnmeta.host.cascade import CASCADE_MIN_PREFIX, CASCADE_MIN_REQS, use_cascade_attention
from attnmeta.staging import StepExpiredError
from attnmeta.testing import check_reads_lengths, check_replay
from attnmeta.testing.workloads import advance, reshuffled

_BS = 16
_PROFILE = StaticProfile(max_num_reqs=16, max_num_tokens=128, max_blocks_per_req=40, block_size=_BS)
_GQA = CascadeOptions(num_query_heads=32, num_kv_heads=8, num_sms=132)
_MHA = CascadeOptions(num_query_heads=8, num_kv_heads=8, num_sms=132)
"""Grouped-query heads (decode steps of a long shared prefix lose the cost vote on 132 SMs) and plain
multi-head attention (every step past the thresholds cascades)."""


def _stager(graph: bool) -> Stager:
    return Stager("cpu", num_slots=2, debug_fill=0xA5, profile=_PROFILE if graph else None)


def _spec(n: int = 9, q: int = 1, shared: int = 20, padded: int | None = None) -> BatchSpec:
    """``n`` requests sharing their first ``shared`` blocks, each with 330-410 cached tokens (the cap at the
    smallest context leaves 20 blocks, 320 tokens, for 20 offered)."""
    c = np.array([330 + 10 * i for i in range(n)], np.int32)
    table = np.arange(1000, 1000 + n * 40, dtype=np.int32).reshape(n, 40)
    table[:, :shared] = np.arange(shared, dtype=np.int32)
    return BatchSpec(num_computed_tokens=c, num_scheduled_tokens=np.full(n, q, np.int32), block_table=table,
                     block_size=_BS, num_reqs_padded=padded, num_tokens_padded=None if padded is None else padded * q)


def _padded_walk(spec: BatchSpec, steps: int) -> list[BatchSpec]:
    """A decode walk of ``spec`` that keeps its padding (``advance`` drops it)."""
    return [dataclasses.replace(s, num_reqs_padded=spec.num_reqs_padded, num_tokens_padded=spec.num_tokens_padded)
            for s in advance(spec, steps)]


def _walk(spec: BatchSpec) -> list[BatchSpec]:
    return _padded_walk(spec, 6) + reshuffled(spec, 6, np.random.default_rng(5))


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize(("case", "spec", "options", "blocks"), [
    ("no prefix offered", _spec(), _MHA, 0),
    ("an offered prefix under 256 tokens", _spec(), _MHA, 15),
    ("fewer than 8 requests", _spec(n=7), _MHA, 20),
    ("padding rows", _spec(padded=12), _MHA, 20),
    ("a sliding window", _spec(q=3), dataclasses.replace(_MHA, use_sliding_window=True), 20),
    ("DCP", _spec(), dataclasses.replace(_GQA, dcp_world_size=2), 20),
], ids=lambda v: v if isinstance(v, str) else "")
def test_a_walk_the_scalars_rule_cascade_out_of_replays_and_equals_the_reference(
        graph: bool, case: str, spec: BatchSpec, options: CascadeOptions, blocks: int) -> None:
    walk = _walk(spec)
    n = check_replay(CASCADE, walk, options, CascadeInputs(num_common_prefix_blocks=blocks), stager=_stager(graph))
    assert n >= len(walk) - 4, case


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("options", [_MHA, _GQA], ids=["mha", "gqa"])
def test_steps_that_may_cascade_are_composed_and_equal_the_reference(graph: bool, options: CascadeOptions) -> None:
    """Nine requests, a 320-token prefix offered: the MHA group cascades; the GQA group's decode steps lose
    the vote, but the scalars cannot tell (the prefix is capped at the smallest context): composed alike."""
    walk = _walk(_spec())
    inputs = CascadeInputs(num_common_prefix_blocks=20)
    assert check_replay(CASCADE, walk, options, inputs, stager=_stager(graph)) == 0
    assert CASCADE.build(walk[0], Stager("cpu"), options, inputs).use_cascade is (options is _MHA)


def test_the_replay_key_reads_scalars_only() -> None:
    shape = _spec().shape
    key = CASCADE.replay_key
    assert key(shape, _MHA, CascadeInputs()) == "off"
    assert key(shape, _MHA, CascadeInputs(num_common_prefix_blocks=15)) == "off"  # (15 * 16 = 240 < 256)
    assert key(shape, _MHA, CascadeInputs(num_common_prefix_blocks=16)) is None
    assert key(_spec(n=7).shape, _MHA, CascadeInputs(num_common_prefix_blocks=16)) == "off"
    assert key(_spec(padded=10).shape, _MHA, CascadeInputs(num_common_prefix_blocks=16)) == "off"
    for flag in ("use_alibi", "use_sliding_window", "use_local_attention"):
        opts = dataclasses.replace(_MHA, **{flag: True})  # type: ignore[arg-type]
        assert key(shape, opts, CascadeInputs(num_common_prefix_blocks=16)) == "off"
    for bad in (-1, True, 2.0, "3"):  # (the staged step raises)
        assert key(shape, _MHA, CascadeInputs(num_common_prefix_blocks=bad)) is None  # type: ignore[arg-type]
    assert key(shape, _MHA, CascadeInputs(num_common_prefix_blocks=np.int64(3))) == "off"  # type: ignore[arg-type]
    assert not CASCADE.reads_lengths(_MHA)
    for blocks in (0, 15, 16):
        check_reads_lengths(CASCADE, shape, _MHA, CascadeInputs(num_common_prefix_blocks=blocks))


def test_the_scalar_thresholds_are_the_decision_s() -> None:
    """The key's thresholds (cascade._ruled_out) are those of the host rule it stands for."""
    kw: dict[str, Any] = dict(num_query_heads=8, num_kv_heads=8, use_alibi=False, use_sliding_window=False,
                              use_local_attention=False, num_sms=132)
    tokens, reqs = CASCADE_MIN_PREFIX, CASCADE_MIN_REQS
    assert use_cascade_attention(common_prefix_len=tokens, query_lens=np.ones(reqs, np.int32), **kw)
    assert not use_cascade_attention(common_prefix_len=tokens - 1, query_lens=np.ones(reqs, np.int32), **kw)
    assert not use_cascade_attention(common_prefix_len=tokens, query_lens=np.ones(reqs - 1, np.int32), **kw)


def _alternating() -> list[tuple[BatchSpec, dict[str, Any] | None, None]]:
    """Two steps without a prefix, two that cascade, and so on: the steps without a prefix replay on ring
    slots whose last step staged the cascade arrays."""
    plain, shared = _padded_walk(_spec(), 8), reshuffled(_spec(), 8, np.random.default_rng(2))
    off, on = CascadeInputs(), CascadeInputs(num_common_prefix_blocks=20)
    steps: list[tuple[BatchSpec, dict[str, Any] | None, None]] = []
    for i in range(0, 8, 2):
        steps += [(plain[i], {"cascade": off}, None), (plain[i + 1], {"cascade": off}, None),
                  (shared[i], {"cascade": on}, None), (shared[i + 1], {"cascade": on}, None)]
    return steps


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_replayed_steps_equal_composed_ones_field_for_field(device: torch.device, graph: bool) -> None:
    steps = _alternating()
    assert [CASCADE.build(s, Stager("cpu"), _MHA, (i or {})["cascade"]).use_cascade for s, i, _a in steps[:4]] == [
        False, False, True, True]
    composer = compare_replays(device, lambda: [Group({"cascade": (CASCADE, _MHA)})], steps,
                               _PROFILE if graph else None)
    assert composer.stats.replayed >= 3, composer.stats


def _composer(graph: bool, options: CascadeOptions = _MHA) -> StepBuilder:
    return StepBuilder(_stager(graph), Group({"cascade": (CASCADE, options)}))


def _differing_prefix(spec: BatchSpec) -> BatchSpec:
    """``spec`` with row 3's first block another request's: the offered prefix is not shared."""
    table = spec.block_table.copy()
    table[3, 0] = 999
    return dataclasses.replace(spec, block_table=table)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_a_replayed_step_raises_what_a_composed_one_does(graph: bool) -> None:
    """Padding rows rule cascade out, but the offered prefix columns are still checked: a replayed step
    whose rows differ there raises the staged step's error, and the composer goes on."""
    spec = _spec(padded=12)
    inputs = {"cascade": CascadeInputs(num_common_prefix_blocks=20)}
    bad = _differing_prefix(spec)
    with pytest.raises(ValueError, match=r"block_table\[3, 0\]=999"):
        CASCADE.build(bad, Stager("cpu"), _MHA, inputs["cascade"])
    composer = _composer(graph)
    for s in _padded_walk(spec, 4):
        composer.build(s, inputs)
    before = composer.stats.replayed
    assert before >= 1
    with pytest.raises(ValueError, match=r"block_table\[3, 0\]=999"):
        composer.build(bad, inputs)
    with pytest.raises(TypeError, match="num_common_prefix_blocks"):  # (a key of None: composed, and refused)
        composer.build(spec, {"cascade": CascadeInputs(num_common_prefix_blocks=True)})  # type: ignore[arg-type]
    for s in _padded_walk(spec, 4):  # (an abandoned step's slot forgets its layouts: recorded again, then replayed)
        composer.build(s, inputs)
    assert composer.stats.replayed > before


def test_a_replayer_that_skips_the_decision_s_checks_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The test above can fail: a rewrite that writes nothing (there is nothing to write) and so checks
    nothing lets a replayed step with an unshared prefix through."""
    monkeypatch.setattr(cascade._Replayer, "rewrite", lambda self, step, host, inputs: None)
    with pytest.raises(pytest.fail.Exception, match="DID NOT RAISE"):
        test_a_replayed_step_raises_what_a_composed_one_does(False)


def test_a_replayer_that_keeps_the_recorded_common_metadata_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """A result that hands out the recorded step's metadata as it was: its common metadata is the recorded
    step's, whose slot a later step has reused (expired), and whose lengths are not this step's."""
    init = cascade._Replayer.__init__

    def keep(self: cascade._Replayer, recorded: CascadeMetadata, options: CascadeOptions) -> None:
        init(self, recorded, options)
        self.make = template(recorded, ())

    monkeypatch.setattr(cascade._Replayer, "__init__", keep)
    monkeypatch.setattr(cascade._Replayer, "result", lambda self, step, common, host, paged, inputs: self.make())
    with pytest.raises((AssertionError, StepExpiredError)):
        check_replay(CASCADE, _walk(_spec()), _MHA, CascadeInputs(), stager=_stager(False))
