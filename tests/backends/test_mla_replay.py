"""MLA replays (attnmeta.backends.mla: MLABuilder.replay_key / replayer): a decode-only step replays its
slot's recorded layout and its metadata equals the lab reference's, for every variant, with DCP, in eager
and graph mode; steps with prefill rows and non-causal groups are composed; and replayers that leave the
slot's bytes in place are caught."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from compose_helpers import compare_replays

from attnmeta import BatchSpec, Stager, StaticProfile
from attnmeta.backends import mla
from attnmeta.backends.mla import MLA, MLAOptions
from attnmeta.compose import Group
from attnmeta.testing import check_replay
from attnmeta.testing.workloads import advance, reshuffled

_PROFILE = StaticProfile(max_num_reqs=8, max_num_tokens=64, max_blocks_per_req=16, block_size=4)
_VARIANTS = ("flashmla", "flashattn_mla", "flashinfer_mla", "triton_mla")


def _stager(graph: bool) -> Stager:
    return Stager("cpu", num_slots=2, debug_fill=0xA5, profile=_PROFILE if graph else None)


def _table(rows: int) -> np.ndarray:
    return np.arange(1, 1 + rows * 12, dtype=np.int32).reshape(rows, 12)


def _decode_spec(q: int = 1) -> BatchSpec:
    return BatchSpec(num_computed_tokens=[5, 9, 2, 13], num_scheduled_tokens=[q, q, q, q], block_table=_table(4),
                     block_size=4)


def _mixed_spec() -> BatchSpec:
    return BatchSpec(num_computed_tokens=[5, 9, 20, 0], num_scheduled_tokens=[1, 1, 6, 5],
                     num_prompt_tokens=[3, 4, 30, 5], block_table=_table(4), block_size=4)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("variant", _VARIANTS)
@pytest.mark.parametrize("dcp", [1, 2], ids=["no-dcp", "dcp2"])
def test_a_decode_walk_replays_and_equals_the_reference(graph: bool, variant: str, dcp: int) -> None:
    opts = MLAOptions(variant=variant, dcp_world_size=dcp, dcp_rank=dcp - 1, workspace_size=64)
    walk = advance(_decode_spec(), 6) + reshuffled(_decode_spec(), 6, np.random.default_rng(7))
    assert check_replay(MLA, walk, opts, stager=_stager(graph)) >= len(walk) - 3


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_spec_decode_steps_replay_where_the_scalars_say_every_row_decodes(graph: bool) -> None:
    """With 2 drafts, 3-token rows: every variant's rows are decode rows (FlashAttention-MLA's threshold is
    512; FlashMLA's and Triton-MLA's need uniform decodes, which ``StepShape.uniform_queries`` promises).
    A row that verifies one draft among them is a prefill row for those two (the split's uniform rule):
    composed, and still equal to the reference; FlashAttention-MLA replays it."""
    uniform = advance(_decode_spec(3), 6)
    ragged = advance(BatchSpec(num_computed_tokens=[5, 9, 2, 13], num_scheduled_tokens=[3, 2, 3, 3],
                               block_table=_table(4), block_size=4), 6)
    for variant in _VARIANTS:
        opts = MLAOptions(variant=variant, num_speculative_tokens=2)
        assert check_replay(MLA, uniform, opts, stager=_stager(graph)) >= 3, variant
        replays = check_replay(MLA, ragged, opts, stager=_stager(graph))
        assert (replays >= 3) if variant in ("flashattn_mla", "flashinfer_mla") else replays == 0, variant


def test_a_uniform_variant_s_padded_decode_step_replays() -> None:
    """FlashMLA, one-token rows and CUDA-graph padding rows (zero-length, allowed beside uniform decodes)."""
    spec = BatchSpec(num_computed_tokens=[5, 9, 2], num_scheduled_tokens=[1, 1, 1], block_table=_table(3),
                     block_size=4, num_reqs_padded=4, num_tokens_padded=6)
    walk = advance(spec, 6)
    walk = [dataclasses.replace(s, num_reqs_padded=4, num_tokens_padded=6) for s in walk]
    assert check_replay(MLA, walk, MLAOptions(variant="flashmla"), stager=_stager(True)) >= 3


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_steps_with_prefill_rows_are_composed(graph: bool) -> None:
    opts = MLAOptions(variant="flashinfer_mla", workspace_size=64)
    assert check_replay(MLA, reshuffled(_mixed_spec(), 6, np.random.default_rng(1)), opts, stager=_stager(graph)) == 0


@pytest.mark.parametrize("variant", ["flashinfer_mla", "triton_mla"])
def test_non_causal_steps_are_composed_and_equal_the_reference(variant: str) -> None:
    """A non-causal step's rows must each step be checked to be uniform: never replayed."""
    opts = MLAOptions(variant=variant, causal=False)
    assert check_replay(MLA, advance(_decode_spec(2), 6), opts, stager=_stager(False)) == 0


def _alternating() -> list[BatchSpec]:
    """Two decode steps, two mixed steps, and so on: on a ring of two slots each decode step but the
    first two replays over the bytes a mixed step left on its slot (whose prefill and chunk fields lie
    where the decode layout's do)."""
    d, m = advance(_decode_spec(), 8), reshuffled(_mixed_spec(), 8, np.random.default_rng(3))
    return [s for i in range(0, 8, 2) for s in (d[i], d[i + 1], m[i], m[i + 1])]


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_a_decode_step_after_a_mixed_one_on_the_slot_replays_and_equals_the_reference(graph: bool) -> None:
    opts = MLAOptions(variant="flashinfer_mla", workspace_size=64)
    assert check_replay(MLA, _alternating(), opts, stager=_stager(graph)) >= 3


def _compare(device: torch.device, graph: bool) -> None:
    """The alternating walk on a replaying composer against one that never replays: metadata, and in
    graph mode every field's whole fixed buffer (what captured kernels read, sentinels included)."""
    opts = MLAOptions(variant="flashinfer_mla", workspace_size=64)
    composer = compare_replays(device, lambda: [Group({"mla": (MLA, opts)})], _alternating(),
                               _PROFILE if graph else None)
    assert composer.stats.replayed >= 3, composer.stats


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_replayed_steps_equal_composed_ones_to_the_byte(device: torch.device, graph: bool) -> None:
    _compare(device, graph)


def test_a_replayer_that_leaves_the_empty_fields_unwritten_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The test above can fail: without the zeros, a graph-mode decode step replayed after a mixed one
    keeps that step's prefill query indptr (its sentinel included) and chunk bytes in the fixed buffers."""
    monkeypatch.setattr(mla._Replayer, "rewrite", lambda self, step, host, inputs: None)
    with pytest.raises(AssertionError, match="step"):
        _compare(torch.device("cpu"), True)


def test_a_replayer_that_keeps_the_recorded_dcp_lengths_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    opts = MLAOptions(variant="flashinfer_mla", dcp_world_size=2, dcp_rank=1)
    real = mla._Replayer.rewrite

    def stale(self: mla._Replayer, step: object, host: object, inputs: None) -> None:
        dcp, self.dcp = self.dcp, None
        try:
            real(self, step, host, inputs)  # type: ignore[arg-type]
        finally:
            self.dcp = dcp

    monkeypatch.setattr(mla._Replayer, "rewrite", stale)
    with pytest.raises(AssertionError, match="replayed"):
        check_replay(MLA, advance(_decode_spec(), 6), opts, stager=_stager(False))
