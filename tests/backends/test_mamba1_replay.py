"""Mamba1 replays (the fill path's shared replayer, attnmeta.backends.mamba._fill.FillReplayer): a replayed
step's metadata equals the lab reference's, in eager and graph mode, on decode walks and on steps with
prefill rows; and a replayer that leaves the recorded step's bytes in place is caught."""

from __future__ import annotations

import numpy as np
import pytest

from attnmeta import BatchSpec, Stager, StaticProfile
from attnmeta.backends.mamba import _fill
from attnmeta.backends.mamba.mamba1 import MAMBA1, Mamba1Options
from attnmeta.metadata import CommonHost
from attnmeta.staging import Step
from attnmeta.testing import check_replay
from attnmeta.testing.workloads import advance, reshuffled

_PROFILE = StaticProfile(max_num_reqs=8, max_num_tokens=64, max_blocks_per_req=16, block_size=4)


def _stager(graph: bool) -> Stager:
    return Stager("cpu", num_slots=2, debug_fill=0xA5, profile=_PROFILE if graph else None)


def _decode_spec() -> BatchSpec:
    table = np.arange(1, 1 + 4 * 12, dtype=np.int32).reshape(4, 12)
    return BatchSpec(num_computed_tokens=[5, 9, 2, 13], num_scheduled_tokens=[1, 1, 1, 1],
                     num_prompt_tokens=[3, 4, 2, 6], block_table=table, block_size=4)


def _mixed_spec() -> BatchSpec:
    table = np.arange(1, 1 + 4 * 12, dtype=np.int32).reshape(4, 12)
    return BatchSpec(num_computed_tokens=[5, 9, 0, 4], num_scheduled_tokens=[1, 1, 6, 5],
                     num_prompt_tokens=[3, 4, 6, 20], block_table=table, block_size=4)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("mode", ["none", "align"])
def test_a_decode_walk_replays_and_equals_the_reference(graph: bool, mode: str) -> None:
    opts = Mamba1Options(cache_mode=mode, mamba_block_size=8 if mode == "align" else None)
    replayed = check_replay(MAMBA1, advance(_decode_spec(), 12), opts, stager=_stager(graph))
    assert replayed >= 8  # every step after each slot's first (and after a new layout: "align" columns grow)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("conv1d", [False, True], ids=["plain", "conv1d"])
def test_steps_with_prefill_rows_replay_and_equal_the_reference(graph: bool, conv1d: bool) -> None:
    opts = Mamba1Options(needs_causal_conv1d_metadata=conv1d)
    walk = reshuffled(_mixed_spec(), 8, np.random.default_rng(3))
    # steps 3-8 replay (2 slots); in graph mode a step that grew the shared layout is not recorded
    assert check_replay(MAMBA1, walk, opts, stager=_stager(graph)) >= (5 if graph else 6)


def test_a_replayer_that_leaves_the_recorded_bytes_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The replays above can fail: a rewrite that writes nothing after its first (it keeps the counts of
    the step it filled and leaves the slot's bytes as the slot's last step left them) differs from the
    reference on a later reshuffled step (its rows' state indices and query starts moved)."""
    walk = reshuffled(_mixed_spec(), 8, np.random.default_rng(5))
    assert check_replay(MAMBA1, walk) == 6  # (the real rewrite passes)
    real = _fill.FillReplayer.rewrite
    kept: dict[int, _fill.Filled] = {}

    def stale(self: _fill.FillReplayer[object], step: Step, host: CommonHost, inputs: object) -> None:
        f = kept.get(id(self))
        if f is None:
            real(self, step, host, inputs)
            assert self.filled is not None
            kept[id(self)] = self.filled
            return
        self.unwritten = None
        self.filled = _fill.Filled(step, f.group, f.layout, f.prefix, f.host, f.D, f.P, f.Dt, f.Pt, f.tot, f.n, f.prep,
                                   f.nck, f.nl)

    monkeypatch.setattr(_fill.FillReplayer, "rewrite", stale)
    with pytest.raises(AssertionError, match="replayed"):
        check_replay(MAMBA1, walk)
