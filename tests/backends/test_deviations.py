"""Deliberate deviations from vLLM 0.33.0 that the semantics docs list (issue 31, item 2): each pinned
by the worked example the docs give, with vLLM's value beside attnmeta's (computed here from the
formula vLLM's code applies, so the test also says what vLLM would give)."""

from __future__ import annotations

import numpy as np

import attnmeta
from attnmeta import BatchSpec, Stager, stage_common
from attnmeta.backends import mla
from attnmeta.backends.mamba import Mamba2Inputs, Mamba2Options, mamba2
from attnmeta.graph_padding import apply_capture_fill, capture_fill
from attnmeta.host.layout import dcp_local_seq_lens


def test_mla_prefill_context_is_the_exact_length_not_the_upper_bound() -> None:
    """Async spec decode, FlashMLA's uniform split, k = 3: the second row (4 query tokens after a
    3-token row) lands on the prefill side. vLLM takes its context from ``seq_lens_cpu_upper_bound -
    query_len`` = 181 - 4 = 177, which counts drafts still in flight; attnmeta from the exact 174."""
    spec = BatchSpec(num_computed_tokens=[303, 174], num_scheduled_tokens=[3, 4], seq_lens_upper_bound=[309, 181],
                     num_draft_tokens=[2, 3], block_table=np.arange(40, dtype=np.int32).reshape(2, 20), block_size=16)
    m = mla.build(spec, Stager("cpu"), mla.MLAOptions(num_speculative_tokens=3, workspace_size=48))
    assert (m.num_decodes, m.num_prefills) == (1, 1)
    vllm = int(spec.seq_lens_upper_bound[1]) - int(spec.num_scheduled_tokens[1])  # type: ignore[index]
    assert vllm == 177 and m.context_lens_cpu.tolist() == [174]


def test_mamba2_without_decode_rows_passes_no_accepted_counts() -> None:
    """Spec decode on, no decode row: vLLM hands the runner's whole ``num_accepted_tokens`` on (read by
    no kernel on the prefill path); attnmeta gives None."""
    spec = BatchSpec(num_computed_tokens=[0, 10], num_scheduled_tokens=[5, 6], num_prompt_tokens=[5, 20],
                     block_table=[[1], [2]], block_size=4096)
    m = mamba2.build(spec, Stager("cpu"), Mamba2Options(num_speculative_tokens=1, chunk_size=8),
                     Mamba2Inputs(num_accepted_tokens=[1, 1]))
    assert (m.num_decodes, m.num_prefills) == (0, 2) and m.num_accepted_tokens is None


def test_rocm_capture_fill_zeroes_the_host_twin_too() -> None:
    """The staged ``query_start_loc`` is the host twin's memory: zeroing it for a ROCm capture zeroes
    ``query_start_loc_cpu`` as well (vLLM zeroes only the device tensor)."""
    spec = BatchSpec(num_computed_tokens=[0, 0], num_scheduled_tokens=[1, 2], block_table=[[1], [2]], block_size=16)
    with Stager("cpu").step() as step:
        common = stage_common(spec, step)
        apply_capture_fill(common, capture_fill("rocm_attn"))
    cm = common.result()
    assert cm.query_start_loc_cpu.tolist() == [0, 0, 0] and cm.query_start_loc.tolist() == [0, 0, 0]


def test_dcp_local_seq_lens_of_every_rank_is_a_matrix_even_for_one_rank() -> None:
    """vLLM 0.33.0's ``get_dcp_local_seq_lens(rank=None)`` returns ``(B, W)`` (no squeeze), as attnmeta."""
    out = dcp_local_seq_lens(np.array([5, 8], np.int32), 1)
    assert out.shape == (2, 1) and out[:, 0].tolist() == [5, 8]


def test_mla_dcp_decode_lengths_are_the_ranks_share_of_the_exact_lengths() -> None:
    """Async spec decode under DCP (2 ranks, interleave 1, k = 2): a decode row whose last drafts were
    rejected has 150 computed tokens, the runner's optimistic count 152 (every draft counted as
    accepted), q = 1. vLLM's runner fills ``dcp_local_seq_lens`` from its optimistic lengths and its MLA
    build hands those to the decode kernel, beside ``dcp_tot_seq_lens`` from the exact device lengths:
    rank 0's 77 of an optimistic 153, while the exact 151 puts 76 there. attnmeta takes the rank's share
    of the exact length, so the two fields agree (the local lengths over every rank sum to the total)."""
    cp = attnmeta.ContextParallel(world_size=2, rank=0, interleave=1)
    spec = BatchSpec(num_computed_tokens=[150, 0], num_scheduled_tokens=[1, 9], num_prompt_tokens=[20, 9],
                     seq_lens_upper_bound=[153, 9], block_table=np.arange(34, dtype=np.int32).reshape(2, 17),
                     block_size=16, context_parallel=cp)
    m = mla.build(spec, Stager("cpu"), mla.MLAOptions(variant="triton_mla", workspace_size=512,
                                                      num_speculative_tokens=2, dcp_world_size=2))
    assert m.num_decodes == 1 and m.decode_dcp_tot_seq_lens.tolist() == [151]
    vllm = dcp_local_seq_lens(np.array(spec.seq_lens_upper_bound[:1]), 2, 0)  # type: ignore[index]
    assert vllm.tolist() == [77] and m.decode_seq_lens_cpu.tolist() == [76]
    assert int(dcp_local_seq_lens(np.array([151], np.int32), 2).sum()) == 151
