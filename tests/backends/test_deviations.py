"""Deliberate deviations from vLLM 0.33.0 that the semantics docs list (issue 31, item 2): each pinned
by the worked example the docs give, with vLLM's value beside attnmeta's (computed here from the
formula vLLM's code applies, so the test also says what vLLM would give)."""

from __future__ import annotations

import numpy as np

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
