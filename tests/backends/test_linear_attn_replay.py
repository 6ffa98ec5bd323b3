"""Linear-attention replays (attnmeta.backends.mamba.linear_attn: LinearAttentionBuilder.replay_key /
replayer): every step replays its slot's recorded layout of its row count (decode, prefill and mixed steps
alike: the one staged field has a row per request row), and its metadata equals the lab reference's and the
never-replaying composer's field for field, in both cache modes, in eager and graph mode; and replayers
that leave the slot's bytes in place are caught."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from compose_helpers import compare_replays

from attnmeta import BatchSpec, Stager, StaticProfile
from attnmeta.backends.mamba import linear_attn
from attnmeta.backends.mamba.linear_attn import LINEAR_ATTN, LinearAttentionOptions
from attnmeta.compose import Group
from attnmeta.metadata import CommonHost
from attnmeta.staging import Step
from attnmeta.testing import check_reads_lengths, check_replay
from attnmeta.testing.workloads import advance, reshuffled

_PROFILE = StaticProfile(max_num_reqs=8, max_num_tokens=64, max_blocks_per_req=16, block_size=4)
_MODES = ("none", "align")


def _stager(graph: bool) -> Stager:
    return Stager("cpu", num_slots=2, debug_fill=0xA5, profile=_PROFILE if graph else None)


def _options(mode: str) -> LinearAttentionOptions:
    return LinearAttentionOptions(cache_mode=mode, mamba_block_size=8 if mode == "align" else None)  # type: ignore[arg-type]


def _table(rows: int) -> np.ndarray:
    return np.arange(1, 1 + rows * 16, dtype=np.int32).reshape(rows, 16)


def _decode_spec(padded: int | None = None) -> BatchSpec:
    return BatchSpec(num_computed_tokens=[5, 9, 2, 13], num_scheduled_tokens=[1, 1, 1, 1],
                     num_prompt_tokens=[3, 4, 2, 6], block_table=_table(4), block_size=4, num_reqs_padded=padded,
                     num_tokens_padded=padded)


def _mixed_spec() -> BatchSpec:
    return BatchSpec(num_computed_tokens=[5, 9, 0, 4], num_scheduled_tokens=[1, 1, 6, 5],
                     num_prompt_tokens=[3, 4, 6, 20], block_table=_table(4), block_size=4)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("mode", _MODES)
def test_a_decode_walk_replays_and_equals_the_reference(graph: bool, mode: str) -> None:
    """12 decode steps (the "align" mode's state column moves on every 8 tokens), then 6 steps that reorder
    the requests and rename their blocks."""
    walk = advance(_decode_spec(), 12) + reshuffled(_decode_spec(), 6, np.random.default_rng(7))
    assert check_replay(LINEAR_ATTN, walk, _options(mode), stager=_stager(graph)) >= len(walk) - 4


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_a_padded_decode_walk_replays_and_equals_the_reference(graph: bool) -> None:
    spec = _decode_spec(padded=6)
    walk = [dataclasses.replace(s, num_reqs_padded=6, num_tokens_padded=6) for s in advance(spec, 10)]
    assert check_replay(LINEAR_ATTN, walk, _options("none"), stager=_stager(graph)) >= 7


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("mode", _MODES)
def test_steps_with_prefill_rows_replay_and_equal_the_reference(graph: bool, mode: str) -> None:
    """The split moves with the rows (reshuffled: a prefill row first on some steps); the layout does not."""
    walk = reshuffled(_mixed_spec(), 8, np.random.default_rng(3))
    assert check_replay(LINEAR_ATTN, walk, _options(mode), stager=_stager(graph)) >= (5 if graph else 6)


def test_the_replay_key_is_the_row_count_and_reads_no_lengths() -> None:
    none, align = _options("none"), _options("align")
    for shape in (_decode_spec().shape, _mixed_spec().shape):
        assert LINEAR_ATTN.replay_key(shape, none, None) == 4
        check_reads_lengths(LINEAR_ATTN, shape, none)
    assert LINEAR_ATTN.replay_key(_decode_spec(padded=6).shape, none, None) == 6
    assert not LINEAR_ATTN.reads_lengths(none)
    assert LINEAR_ATTN.reads_lengths(align)  # (its needs' state column follows the longest request)


def _alternating() -> list[BatchSpec]:
    """Two decode steps, two mixed steps, and so on, all of 4 rows: one layout, whose replays alternate
    between the two kinds of step (and their splits) on each slot."""
    d, m = advance(_decode_spec(), 8), reshuffled(_mixed_spec(), 8, np.random.default_rng(5))
    return [s for i in range(0, 8, 2) for s in (d[i], d[i + 1], m[i], m[i + 1])]


def _compare(device: torch.device, graph: bool, mode: str) -> None:
    """The alternating walk on a replaying composer against one that never replays: every field (values,
    dtypes, read-only flags), the kept earlier step's, and in graph mode every field's whole fixed buffer."""
    opts = _options(mode)
    composer = compare_replays(device, lambda: [Group({"la": (LINEAR_ATTN, opts)})],
                               _alternating() + advance(_decode_spec(), 8), _PROFILE if graph else None)
    assert composer.stats.replayed >= 12, composer.stats


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("mode", _MODES)
def test_replayed_steps_equal_composed_ones_field_for_field(device: torch.device, graph: bool, mode: str) -> None:
    _compare(device, graph, mode)


def test_a_replayer_that_writes_nothing_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tests above can fail: without the rewrite the slot keeps its last step's state indices (the
    reshuffled steps moved the rows and renamed the blocks)."""
    walk = reshuffled(_decode_spec(), 8, np.random.default_rng(9))
    assert check_replay(LINEAR_ATTN, walk, _options("none")) == 6  # (the real rewrite passes)
    monkeypatch.setattr(linear_attn._Replayer, "rewrite", lambda self, step, host, inputs: None)
    with pytest.raises(AssertionError, match="replayed"):
        check_replay(LINEAR_ATTN, walk, _options("none"))
    with pytest.raises(AssertionError, match="state_indices_tensor"):
        _compare(torch.device("cpu"), True, "none")


def test_a_replayer_that_keeps_the_recorded_split_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """A result that makes the metadata with its first step's split (a mixed step's after a decode one's)
    differs from the reference: the split is a per-step value of the layout."""
    real = linear_attn._Replayer.result
    first: dict[int, CommonHost] = {}

    def stale(self: linear_attn._Replayer, step: Step, common: object, host: CommonHost, paged: object,
              inputs: None) -> linear_attn.LinearAttentionMetadata:
        return real(self, step, common, first.setdefault(id(self), host), None, inputs)  # type: ignore[arg-type]

    monkeypatch.setattr(linear_attn._Replayer, "result", stale)
    with pytest.raises(AssertionError, match="replayed"):
        check_replay(LINEAR_ATTN, _alternating(), _options("none"))
