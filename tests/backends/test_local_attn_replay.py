"""Chunked-local-attention replays (attnmeta.backends.local_attn: LocalAttentionBuilder.replay_key /
replayer): a decode step (every query at most one token, padding rows included) replays its slot's recorded
layout, and its metadata equals the lab reference's and the never-replaying composer's field for field (the
virtual common metadata included), with the table gathered on the host or on the device, in eager and
graph mode; steps with longer queries, whose virtual rows depend on their lengths, are composed; and
replayers that leave the slot's bytes in place are caught."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from compose_helpers import check_steps, compare_replays, composers

from attnmeta import BatchSpec, Stager, StaticProfile
from attnmeta.backends import local_attn
from attnmeta.backends.local_attn import LOCAL_ATTN, LocalAttentionMetadata, LocalAttentionOptions
from attnmeta.compose import Group
from attnmeta.metadata import CommonAttentionMetadata, CommonHost
from attnmeta.staging import Step
from attnmeta.testing import check_reads_lengths, check_replay
from attnmeta.testing.workloads import advance, reshuffled

_PROFILE = StaticProfile(max_num_reqs=8, max_num_tokens=64, max_blocks_per_req=16, block_size=4)
_MODES = ("host", "device")


def _stager(graph: bool) -> Stager:
    return Stager("cpu", num_slots=2, debug_fill=0xA5, profile=_PROFILE if graph else None)


def _options(mode: str, chunk: int = 8) -> LocalAttentionOptions:
    return LocalAttentionOptions(attn_chunk_size=chunk, block_table=mode)  # type: ignore[arg-type]


def _table(rows: int) -> np.ndarray:
    return np.arange(1, 1 + rows * 16, dtype=np.int32).reshape(rows, 16)


def _decode_spec(q: int = 1, padded: int | None = None) -> BatchSpec:
    """Four requests, one of them on a chunk's last token (the next step starts a chunk: k = 1)."""
    return BatchSpec(num_computed_tokens=[5, 9, 2, 15], num_scheduled_tokens=[q] * 4,
                     num_prompt_tokens=[3, 12, 2, 6], block_table=_table(4), block_size=4, num_reqs_padded=padded,
                     num_tokens_padded=None if padded is None else padded * q)


def _mixed_spec() -> BatchSpec:
    return BatchSpec(num_computed_tokens=[5, 9, 20, 0], num_scheduled_tokens=[1, 1, 6, 5],
                     num_prompt_tokens=[3, 4, 30, 5], block_table=_table(4), block_size=4)


def _padded_walk(spec: BatchSpec, steps: int) -> list[BatchSpec]:
    """A decode walk of ``spec`` that keeps its padding (``advance`` drops it)."""
    return [dataclasses.replace(s, num_reqs_padded=spec.num_reqs_padded, num_tokens_padded=spec.num_tokens_padded)
            for s in advance(spec, steps)]


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("mode", _MODES)
def test_a_decode_walk_replays_and_equals_the_reference(graph: bool, mode: str) -> None:
    """12 steps of a decode loop (every request crosses a chunk boundary on the way: k_v restarts at 1, the
    block starts move), then 6 steps that reorder the requests and rename their blocks."""
    walk = advance(_decode_spec(), 12) + reshuffled(_decode_spec(), 6, np.random.default_rng(7))
    assert check_replay(LOCAL_ATTN, walk, _options(mode), stager=_stager(graph)) >= len(walk) - 4


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("mode", _MODES)
def test_a_padded_decode_walk_replays_one_virtual_row_per_row(graph: bool, mode: str) -> None:
    """CUDA-graph padding rows (zero-length) are one virtual row each; the replayed layout keeps them."""
    walk = _padded_walk(_decode_spec(padded=6), 10)
    opts = _options(mode)
    assert check_replay(LOCAL_ATTN, walk, opts, stager=_stager(graph)) >= 7
    built = check_steps(*composers(torch.device("cpu"), lambda: [Group({"la": (LOCAL_ATTN, opts)})],
                                   profile=_PROFILE if graph else None), [(s, None, None) for s in walk])
    assert built[-1]["la"].num_virtual_reqs == 6


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_steps_with_longer_queries_are_composed_and_equal_the_reference(graph: bool) -> None:
    """Two-token rows (spec decode) make one or two virtual rows each, by where they cross a chunk boundary:
    the step's scalars do not tell, so no key; nor for prefill rows."""
    for mode in _MODES:
        assert check_replay(LOCAL_ATTN, advance(_decode_spec(2), 6), _options(mode), stager=_stager(graph)) == 0
        walk = reshuffled(_mixed_spec(), 6, np.random.default_rng(1))
        assert check_replay(LOCAL_ATTN, walk, _options(mode), stager=_stager(graph)) == 0


def test_the_replay_key_names_the_rows_of_a_decode_step_and_reads_no_lengths() -> None:
    opts = _options("host")
    decode, padded = _decode_spec().shape, _decode_spec(padded=6).shape
    assert LOCAL_ATTN.replay_key(decode, opts, None) == ("decode", 4)
    assert LOCAL_ATTN.replay_key(padded, opts, None) == ("decode", 6)
    assert LOCAL_ATTN.replay_key(_decode_spec(2).shape, opts, None) is None
    assert LOCAL_ATTN.replay_key(_mixed_spec().shape, opts, None) is None
    assert not LOCAL_ATTN.reads_lengths(opts)
    for shape in (decode, padded, _mixed_spec().shape):
        check_reads_lengths(LOCAL_ATTN, shape, opts)


def _alternating() -> list[BatchSpec]:
    """Two decode steps, two mixed steps, and so on: on a ring of two slots each decode step but the first
    two replays over the bytes a mixed step (more virtual rows, at other places in eager mode; the same
    fixed buffers in graph mode) left on its slot."""
    d, m = advance(_decode_spec(), 8), reshuffled(_mixed_spec(), 8, np.random.default_rng(3))
    return [s for i in range(0, 8, 2) for s in (d[i], d[i + 1], m[i], m[i + 1])]


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("mode", _MODES)
def test_a_decode_step_after_a_mixed_one_on_the_slot_replays_and_equals_the_reference(graph: bool, mode: str) -> None:
    assert check_replay(LOCAL_ATTN, _alternating(), _options(mode), stager=_stager(graph)) >= 3


def _compare(device: torch.device, graph: bool, mode: str) -> None:
    """The alternating walk, then a decode walk, on a replaying composer against one that never replays:
    every field of the metadata and of its virtual common metadata (values, dtypes, read-only flags), the
    kept earlier step's, and in graph mode every field's whole fixed buffer (sentinels included)."""
    opts = _options(mode)
    composer = compare_replays(device, lambda: [Group({"la": (LOCAL_ATTN, opts)})],
                               _alternating() + advance(_decode_spec(), 10), _PROFILE if graph else None)
    assert composer.stats.replayed >= 10, composer.stats


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("mode", _MODES)
def test_replayed_steps_equal_composed_ones_field_for_field(device: torch.device, graph: bool, mode: str) -> None:
    _compare(device, graph, mode)


@pytest.mark.parametrize("mode", _MODES)
def test_a_replayer_that_writes_nothing_into_the_slot_is_caught(monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    """The tests above can fail: a rewrite that fills scratch copies of the own fields (the metadata's
    per-step host values right, the staged bytes the slot's last step's) differs from the reference."""
    walk = advance(_decode_spec(), 8)
    assert check_replay(LOCAL_ATTN, walk, _options(mode)) == 6  # (the real rewrite passes)

    def unwritten(self: local_attn._Replayer, step: Step, host: CommonHost, inputs: None) -> None:
        own = self.own
        scratch = own._replace(query_start_loc=own.query_start_loc.copy(), seq_lens=own.seq_lens.copy(),
                               req_indices=own.req_indices.copy(), block_starts=own.block_starts.copy(),
                               block_table=None if own.block_table is None else own.block_table.copy())
        self.filled = (step, local_attn._fill(host, self.options.attn_chunk_size, scratch))

    monkeypatch.setattr(local_attn._Replayer, "rewrite", unwritten)
    with pytest.raises(AssertionError, match="replayed"):
        check_replay(LOCAL_ATTN, walk, _options(mode))


def _snapshot(host: CommonHost) -> CommonHost:
    """``host`` with copies of its arrays (its own are views of the slot, which the next step rewrites)."""
    return dataclasses.replace(host, **{n: getattr(host, n).copy() for n in (
        "query_start_loc_cpu", "seq_lens_cpu", "block_table_cpu", "is_prefilling")})


def test_a_replayer_that_rewrites_the_recorded_step_s_values_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rewrite that fills the first replayed step's values again (a stale host part) differs from the
    reference on a later step (the lengths moved on), in eager and graph mode."""
    real = local_attn._Replayer.rewrite
    first: dict[int, CommonHost] = {}

    def stale(self: local_attn._Replayer, step: Step, host: CommonHost, inputs: None) -> None:
        real(self, step, first.setdefault(id(self), _snapshot(host)), inputs)

    monkeypatch.setattr(local_attn._Replayer, "rewrite", stale)
    for graph in (False, True):
        first.clear()
        with pytest.raises(AssertionError, match="replayed"):
            check_replay(LOCAL_ATTN, advance(_decode_spec(), 8), _options("host"), stager=_stager(graph))


def test_a_replayer_that_leaves_the_virtual_common_metadata_s_per_step_fields_stale_is_caught(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The field-for-field comparison covers the virtual common metadata, which the lab reference does not:
    a replay that keeps its first step's computed-token counts and prefill flags is caught."""
    real = local_attn._Replayer.result
    first: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def stale(self: local_attn._Replayer, step: Step, common: CommonAttentionMetadata, host: CommonHost,
              paged: object, inputs: None) -> LocalAttentionMetadata:
        m = real(self, step, common, host, None, inputs)
        nc, prefilling = first.setdefault(id(self), (m.common.num_computed_tokens_cpu, m.common.is_prefilling))
        return self.make(dataclasses.replace(m.common, num_computed_tokens_cpu=nc, is_prefilling=prefilling),
                         m.block_table)

    monkeypatch.setattr(local_attn._Replayer, "result", stale)
    with pytest.raises(AssertionError, match=r"common\.num_computed_tokens_cpu"):
        _compare(torch.device("cpu"), False, "host")
