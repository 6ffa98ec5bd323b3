"""KV-sharing fast-prefill replays (attnmeta.backends.fast_prefill: FastPrefillBuilder.replay_key / replayer):
every step replays its slot's layout of its key (whether the transform runs, the logits count, the padded
count): decode steps (the all-decode quirk: only the padded logits indices are staged), spec-decode and
mixed steps (the fast query starts and positions too) and steps without logits indices, in eager and
graph mode, their metadata equal to the lab reference's and to a never-replaying composer's field for field
(the fast batch's common metadata included); a replayed step raises what a composed one does; and replayers
that leave the slot's bytes in place or forget the transform are caught."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch
from compose_helpers import compare_replays

from attnmeta import BatchSpec, Stager, StaticProfile
from attnmeta.backends import fast_prefill
from attnmeta.backends.fast_prefill import FAST_PREFILL, FastPrefillInputs
from attnmeta.compose import Group, StepBuilder
from attnmeta.testing import check_reads_lengths, check_replay
from attnmeta.testing.workloads import advance, reshuffled

_PROFILE = StaticProfile(max_num_reqs=8, max_num_tokens=64, max_blocks_per_req=16, block_size=4)


def _stager(graph: bool) -> Stager:
    return Stager("cpu", num_slots=2, debug_fill=0xA5, profile=_PROFILE if graph else None)


def _table(rows: int) -> np.ndarray:
    return np.arange(1, 1 + rows * 16, dtype=np.int32).reshape(rows, 16)


def _decode_spec(q: int = 1) -> BatchSpec:
    return BatchSpec(num_computed_tokens=[5, 9, 2, 13], num_scheduled_tokens=[q] * 4, block_table=_table(4),
                     block_size=4)


def _mixed_spec() -> BatchSpec:
    return BatchSpec(num_computed_tokens=[5, 9, 20, 0], num_scheduled_tokens=[1, 1, 6, 5],
                     num_prompt_tokens=[3, 4, 30, 5], block_table=_table(4), block_size=4)


def _last(spec: BatchSpec, k: int = 1, pad: int = 0) -> FastPrefillInputs:
    """The logits of each request's last ``k`` tokens (at most its query), padded by ``pad`` entries."""
    q = spec.num_scheduled_tokens.astype(np.int64)
    ends = np.cumsum(q)
    li = np.concatenate([np.arange(e - min(k, n), e) for e, n in zip(ends, q, strict=True)]).astype(np.int32)
    return FastPrefillInputs(logits_indices=li, num_logits_padded=li.shape[0] + pad)


def _walk(spec: BatchSpec) -> list[BatchSpec]:
    return advance(spec, 6) + reshuffled(spec, 6, np.random.default_rng(11))


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize(("case", "spec", "k", "pad"), [
    ("decode (the all-decode quirk)", _decode_spec(), 1, 0),
    ("decode, padded count", _decode_spec(), 1, 3),
    ("spec decode (the transform runs)", _decode_spec(3), 2, 1),
    ("mixed", _mixed_spec(), 1, 2),
], ids=lambda v: v if isinstance(v, str) else "")
def test_a_walk_replays_and_equals_the_reference(graph: bool, case: str, spec: BatchSpec, k: int, pad: int) -> None:
    walk = _walk(spec)
    n = check_replay(FAST_PREFILL, walk, None, [_last(s, k, pad) for s in walk], stager=_stager(graph))
    assert n >= len(walk) - 4, case


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_steps_without_logits_indices_replay(graph: bool) -> None:
    walk = _walk(_mixed_spec())
    assert check_replay(FAST_PREFILL, walk, stager=_stager(graph)) >= len(walk) - 4


def test_the_replay_key_is_the_transform_and_the_counts_and_reads_no_lengths() -> None:
    key = FAST_PREFILL.replay_key
    opts = FAST_PREFILL.options(None)
    dec, spec = _decode_spec().shape, _decode_spec(3).shape
    assert key(dec, opts, FastPrefillInputs()) == "off"
    assert key(dec, opts, FastPrefillInputs(logits_indices=[0, 1, 2, 3])) == (False, 4, 4)
    assert key(spec, opts, FastPrefillInputs(logits_indices=np.arange(4), num_logits_padded=6)) == (True, 4, 6)
    assert key(spec, opts, FastPrefillInputs(logits_indices=[2, 5], num_logits_padded=np.int32(3))) == (  # type: ignore[arg-type]
        True, 2, 3)
    for bad in (FastPrefillInputs(logits_indices=[[1, 2]]), FastPrefillInputs(logits_indices=[1, 2], num_logits_padded=1),
                FastPrefillInputs(logits_indices=[1, 2], num_logits_padded=True),
                FastPrefillInputs(logits_indices=[1, 2], num_logits_padded=2.0)):  # type: ignore[arg-type]
        assert key(spec, opts, bad) is None  # (the staged step raises)
    assert not FAST_PREFILL.reads_lengths(opts)
    for s, inp in ((_decode_spec(), _last(_decode_spec())), (_mixed_spec(), _last(_mixed_spec(), 2, 1))):
        check_reads_lengths(FAST_PREFILL, s.shape, opts, inp)
        check_reads_lengths(FAST_PREFILL, s.shape, opts, None)


def _alternating() -> list[tuple[BatchSpec, dict[str, Any] | None, None]]:
    """Decode steps (the quirk: the padded logits indices only), spec-decode steps of as many logits (the
    fast query starts and positions too), and mixed steps without logits indices, in turn: each layout
    replays on ring slots whose last step held another's bytes."""
    d, s, m = _walk(_decode_spec()), _walk(_decode_spec(3)), _walk(_mixed_spec())
    steps: list[tuple[BatchSpec, dict[str, Any] | None, None]] = []
    for i in range(0, 12, 2):
        for j in (i, i + 1):
            steps.append((d[j], {"fp": _last(d[j], 1, 2)}, None))
        for j in (i, i + 1):
            steps.append((s[j], {"fp": _last(s[j], 1, 2)}, None))
        steps.append((m[i], None, None))
    return steps


def _compare(device: torch.device, graph: bool) -> None:
    """The alternating walk on a replaying composer against one that never replays: metadata, and in
    graph mode every field's whole fixed buffer."""
    composer = compare_replays(device, lambda: [Group({"fp": FAST_PREFILL})], _alternating(),
                               _PROFILE if graph else None)
    assert composer.stats.replayed >= 10, composer.stats


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_replayed_steps_equal_composed_ones_field_for_field(device: torch.device, graph: bool) -> None:
    _compare(device, graph)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_a_replayed_step_raises_what_a_composed_one_does(graph: bool) -> None:
    spec = _decode_spec(3)
    composer = StepBuilder(_stager(graph), Group({"fp": FAST_PREFILL}))
    for s in advance(spec, 5):
        composer.build(s, {"fp": _last(s, 2)})
    assert composer.stats.replayed >= 2
    unsorted = FastPrefillInputs(logits_indices=np.array([2, 1, 5, 8, 10, 11, 14, 15], np.int32))
    with pytest.raises(ValueError) as composed:
        FAST_PREFILL.build(spec, Stager("cpu"), None, unsorted)
    with pytest.raises(ValueError) as replayed:
        composer.build(spec, {"fp": unsorted})
    assert str(replayed.value) == str(composed.value)
    with pytest.raises(TypeError, match="logits_indices"):
        composer.build(spec, {"fp": FastPrefillInputs(logits_indices=torch.arange(8, dtype=torch.int32))})
    before = composer.stats.replayed
    for s in advance(spec, 4):
        out = composer.build(s, {"fp": _last(s, 2)})
    assert composer.stats.replayed > before and out["fp"].applied


def _into_scratch(self: fast_prefill._Replayer, step: Any, host: Any, inputs: Any) -> None:
    """A broken rewrite: the step's values computed into copies of the own fields, the slot left as it is."""
    self.fast = None
    if self.own is not None:
        li, _L, _n = fast_prefill._logits(inputs)
        scratch = fast_prefill._Own(*(None if a is None else a.copy() for a in self.own))  # type: ignore[arg-type]
        self.fast = (step, fast_prefill._write(host, li, scratch))


def test_a_replayer_that_writes_nothing_into_the_slot_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the writes, a replayed step keeps the slot's last padded indices, fast query starts and
    positions (the recorded step's, or another layout's in the alternating walk)."""
    monkeypatch.setattr(fast_prefill._Replayer, "rewrite", _into_scratch)
    walk = _walk(_mixed_spec())
    with pytest.raises(AssertionError, match="replayed"):  # (the recorded step's fast query starts)
        check_replay(FAST_PREFILL, walk, None, [_last(s, 1, 1) for s in walk], stager=_stager(False))
    for graph in (False, True):  # (positions too, which the lab reference does not compare)
        with pytest.raises(AssertionError, match="step"):
            _compare(torch.device("cpu"), graph)


def test_a_replayer_that_forgets_the_transform_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """A result around the step's own common metadata (the quirk's) where the fast batch's is due."""
    real = fast_prefill._Replayer.result

    def untransformed(self: fast_prefill._Replayer, step: Any, common: Any, host: Any, paged: Any,
                      inputs: Any) -> Any:
        m = real(self, step, common, host, paged, inputs)
        return dataclasses.replace(m, common=common, query_start_loc=common.query_start_loc,
                                   query_start_loc_cpu=common.query_start_loc_cpu, max_query_len=common.max_query_len)

    monkeypatch.setattr(fast_prefill._Replayer, "result", untransformed)
    walk = _walk(_decode_spec(3))
    with pytest.raises(AssertionError, match="replayed"):
        check_replay(FAST_PREFILL, walk, None, [_last(s, 2) for s in walk], stager=_stager(False))
