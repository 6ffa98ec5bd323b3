"""Which rows are spec-decode rows: vLLM 0.33.0's runner rule, and how each builder that classifies rows
under spec decode reads it (docs/semantics.md, "Draft tokens").

The rule, from ``GPUModelRunner._prepare_inputs`` (where it fills ``num_decode_draft_tokens``): every row
starts at -1; a row the scheduler gave ``d > 0`` drafts gets ``d`` when ``q == d + 1``; then a row still at
-1 that schedules one token *past its prompt* (``num_computed_tokens >= num_prompt_tokens``) gets 0. A
prompt chunk of one token (a fresh one-token prompt, or a chunked prefill that schedules one token) stays
-1: it is a prefill. The expected values below are worked out by hand from that code and from each vLLM
builder's ``build``, not from attnmeta.

The batch, in the order vLLM's reorder leaves it (decodes, short extends, prefills):

====  ===  ===  ======  ======  =========================================  =========
row    c    q   prompt  drafts  what it is                                 runner
====  ===  ===  ======  ======  =========================================  =========
0      40   3    20      2      a decode with 2 drafts and the bonus        2
1      17   1     5      0      a decode without drafts                     0
2       5   1    10      0      a one-token chunk in the middle of a prompt -1
3       0   1    10      0      a fresh request's one-token first chunk     -1
4       0   6    30      0      a prompt chunk                              -1
====  ===  ===  ======  ======  =========================================  =========
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnmeta import BatchSpec, Stager, build_common
from attnmeta.backends import mla
from attnmeta.backends.mamba import gdn, linear_attn, mamba1, mamba2
from attnmeta.testing.reference.layout import ref_num_decode_draft_tokens

I32 = np.int32
C = [40, 17, 5, 0, 0]
Q = [3, 1, 1, 1, 6]
PROMPT = [20, 5, 10, 10, 30]
DRAFTS = [2, 0, 0, 0, 0]
RUNNER = [2, 0, -1, -1, -1]
K = 2


def _spec(rows: slice = slice(None), *, pad: int = 0) -> BatchSpec:
    c, q = np.array(C, I32)[rows], np.array(Q, I32)[rows]
    n = c.shape[0]
    return BatchSpec(num_computed_tokens=c, num_scheduled_tokens=q, num_prompt_tokens=np.array(PROMPT, I32)[rows],
                     num_draft_tokens=np.array(DRAFTS, I32)[rows],
                     block_table=(1 + np.arange(n * 8, dtype=I32)).reshape(n, 8), block_size=16,
                     num_reqs_padded=n + pad if pad else None)


def test_the_common_metadata_carries_the_runner_rule() -> None:
    cm = build_common(_spec(pad=1), Stager("cpu"))
    assert cm.num_decode_draft_tokens_cpu is not None
    assert cm.num_decode_draft_tokens_cpu.tolist() == [*RUNNER, -1]  # padding -1


def test_the_reference_is_the_runner_rule() -> None:
    t = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    got = ref_num_decode_draft_tokens(t(Q), t(DRAFTS), t(C), t(PROMPT), 6)
    assert got.tolist() == [*RUNNER, -1]
    # without prompt lengths every row counts as past its prompt (is_prefilling is all False then)
    assert ref_num_decode_draft_tokens(t(Q), t(DRAFTS), t(C), None).tolist() == [2, 0, 0, 0, -1]


def test_a_fresh_one_token_prompt_is_a_gdn_prefill_without_initial_state() -> None:
    """The issue's reproducer: with spec decode on, a fresh request whose first chunk is one token."""
    spec = BatchSpec(num_computed_tokens=[0], num_scheduled_tokens=[1], num_prompt_tokens=[10],
                     num_draft_tokens=[0], block_table=[[7, 8]], block_size=16)
    m = gdn.build(spec, Stager("cpu"), gdn.GDNOptions(num_speculative_tokens=1), gdn.GDNInputs(num_accepted_tokens=[1]))
    # vLLM 0.33: no spec row (so no spec path), one prefill, has_initial_state [False]
    assert (m.num_spec_decodes, m.num_prefills, m.num_decodes) == (0, 1, 0)
    assert m.spec_sequence_masks is None and m.spec_state_indices_tensor is None
    assert m.has_initial_state_cpu is not None and m.has_initial_state_cpu.tolist() == [False]
    assert m.prefill_state_indices_cpu is not None and m.prefill_state_indices_cpu.tolist() == [7]


def test_gdn_spec_rows_follow_the_runner_rule() -> None:
    """vLLM's GDN build: spec mask ``drafts >= 0``; the non-spec rows' one-token decodes become prefills."""
    m = gdn.build(_spec(pad=1), Stager("cpu"), gdn.GDNOptions(num_speculative_tokens=K),
                  gdn.GDNInputs(num_accepted_tokens=np.array([2, 1, 1, 1, 1], I32)))
    assert (m.num_spec_decodes, m.num_decodes, m.num_prefills) == (2, 0, 3)
    assert m.spec_sequence_masks_cpu is not None
    assert m.spec_sequence_masks_cpu.tolist() == [True, True, False, False, False, False]
    # the non-spec rows 2, 3, 4 and the padding row; only row 2 continues a state
    assert m.has_initial_state_cpu is not None and m.has_initial_state_cpu.tolist() == [True, False, False, False]
    assert m.non_spec_state_indices_tensor_cpu is not None
    assert m.non_spec_state_indices_tensor_cpu.tolist() == [17, 25, 33, 0]
    assert m.num_accepted_tokens_cpu is not None and m.num_accepted_tokens_cpu.tolist() == [2, 1]


def test_a_spec_decode_step_without_draft_counts_is_read_as_the_runner_fills_it() -> None:
    """Spec decode on, a step whose spec carries no draft counts (no request got drafts): vLLM's runner
    still fills them (gpu_model_runner.py, every step while spec decode is on), so a one-token row past
    its prompt is a spec row with zero drafts; the prompt chunk stays -1. Found by running vLLM's own GDN
    builder through the harness (tests/integrations/test_vllm_builders.py)."""
    spec = BatchSpec(num_computed_tokens=[30, 0], num_scheduled_tokens=[1, 4], num_prompt_tokens=[10, 9],
                     block_table=[[7, 8], [9, 10]], block_size=16)
    with_counts = BatchSpec(num_computed_tokens=[30, 0], num_scheduled_tokens=[1, 4], num_prompt_tokens=[10, 9],
                            num_draft_tokens=[0, 0], block_table=[[7, 8], [9, 10]], block_size=16)
    opts, acc = gdn.GDNOptions(num_speculative_tokens=1), gdn.GDNInputs(num_accepted_tokens=[1, 1])
    for s in (spec, with_counts):
        m = gdn.build(s, Stager("cpu"), opts, acc)
        assert (m.num_spec_decodes, m.num_decodes, m.num_prefills) == (1, 0, 1), s
        assert m.spec_state_indices_tensor_cpu is not None and m.spec_state_indices_tensor_cpu.tolist() == [[7, 8]]
    m2 = mamba2.build(spec, Stager("cpu"), mamba2.Mamba2Options(num_speculative_tokens=1, chunk_size=8),
                      mamba2.Mamba2Inputs(num_accepted_tokens=[1, 1]))
    assert (m2.num_decodes, m2.num_prefills) == (1, 1)
    no_spec = gdn.build(spec, Stager("cpu"), gdn.GDNOptions(), None)  # spec decode off: no counts, no spec rows
    assert (no_spec.num_spec_decodes, no_spec.num_decodes, no_spec.num_prefills) == (0, 1, 1)


def test_mamba2_moves_only_the_stateful_one_token_chunk_to_the_decodes() -> None:
    """vLLM's Mamba2 build (threshold 1 + k with accepted counts): row 2 continues a state and has one
    token, so it moves to the decodes; row 3 has no prior state and stays a prefill."""
    m = mamba2.build(_spec(), Stager("cpu"), mamba2.Mamba2Options(num_speculative_tokens=K, chunk_size=8),
                     mamba2.Mamba2Inputs(num_accepted_tokens=np.array([2, 1, 1, 1, 1], I32)))
    assert (m.num_decodes, m.num_prefills, m.num_decode_tokens, m.num_prefill_tokens) == (3, 2, 5, 7)
    assert m.has_initial_states_p_cpu is not None and m.has_initial_states_p_cpu.tolist() == [False, False]
    assert m.num_accepted_tokens_cpu is not None and m.num_accepted_tokens_cpu.tolist() == [2, 1, 1]


def test_mamba1_and_linear_attention_read_no_draft_counts() -> None:
    """vLLM passes Mamba1 and the plain linear-attention builder no draft counts: Mamba1 moves the stateful
    one-token chunk (row 2) to the decodes; linear attention's plain split (threshold 1) counts every
    one-token row as a decode, the fresh one-token prompt included."""
    spec = _spec(slice(1, None))  # rows 1..4: no multi-token drafted row, which neither builder serves
    m1 = mamba1.build(spec, Stager("cpu"))
    assert (m1.num_decodes, m1.num_prefills) == (2, 2)
    assert m1.has_initial_states_p_cpu is not None and m1.has_initial_states_p_cpu.tolist() == [False, False]
    la = linear_attn.build(spec, Stager("cpu"))
    assert (la.num_decodes, la.num_prefills, la.num_decode_tokens, la.num_prefill_tokens) == (3, 1, 3, 6)


@pytest.mark.parametrize(("variant", "want"), [("flashattn_mla", (5, 0)), ("flashinfer_mla", (4, 1)),
                                               ("flashmla", (1, 4)), ("triton_mla", (1, 4))])
def test_mla_splits_by_query_length_not_by_drafts(variant: str, want: tuple[int, int]) -> None:
    """vLLM's MLA split reads no draft counts, only ``q`` against ``max(class threshold, 1 + k)``
    (flashattn_mla 512, flashinfer_mla 3): the one-token prompt chunks are decodes like the drafted row.
    flashmla and triton_mla split uniformly: the first row whose ``q`` differs from row 0's starts the
    prefills."""
    m = mla.build(_spec(), Stager("cpu"), mla.MLAOptions(variant=variant, num_speculative_tokens=K))  # type: ignore[arg-type]
    assert (m.num_decodes, m.num_prefills) == want
