"""The test toolkit's comparisons catch what they claim to: a device field that holds a host array, a
declared host twin, a field the object lacks, a nested part's missing fields, scalars of another kind.

Each of these once passed silently (found by a review that planted the bugs in a builder of its own).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

import attnmeta
from attnmeta import BatchSpec, Stager
from attnmeta.backends.flash_attn import FlashAttentionInputs
from attnmeta.testing import check_metadata
from attnmeta.testing.harness import compare_with_reference

SPEC = BatchSpec(num_computed_tokens=[3, 0], num_scheduled_tokens=[1, 4], block_table=[[1, 2], [3, 4]], block_size=4)
INPUTS = FlashAttentionInputs(causal=[True, False])


def _flash_attn() -> object:
    meta = attnmeta.build(SPEC, Stager("cpu"), "flash_attn", None, INPUTS)
    check_metadata("flash_attn", meta, SPEC, None, INPUTS)  # (as built: clean)
    return meta


def test_a_device_field_holding_a_host_array_is_caught() -> None:
    meta = _flash_attn()
    object.__setattr__(meta, "seq_lens", np.asarray(meta.seq_lens_cpu))  # never uploaded
    with pytest.raises(AssertionError, match=r"flash_attn\.seq_lens: expected a device tensor, got ndarray "
                                             r"\(a device field holding a host array"):
        check_metadata("flash_attn", meta, SPEC, None, INPUTS)


def test_a_declared_host_twin_is_compared_whatever_its_name() -> None:
    """FlashAttention's ``causal_tensor`` has the twin ``causal_cpu`` (not ``causal_tensor_cpu``)."""
    meta = _flash_attn()
    object.__setattr__(meta, "causal_cpu", np.zeros(2, np.asarray(meta.causal_cpu).dtype))
    with pytest.raises(AssertionError, match=r"flash_attn\.causal_cpu: first difference at \(0,\)"):
        check_metadata("flash_attn", meta, SPEC, None, INPUTS)


def test_a_field_the_object_lacks_is_named() -> None:
    meta = _flash_attn()
    fields = {n: getattr(meta, n) for n in ("common", "causal_tensor", "causal_cpu")}
    with pytest.raises(AssertionError, match=r"flash_attn\.\w+: the reference names it, but SimpleNamespace has no "
                                             r"such field"):
        check_metadata("flash_attn", SimpleNamespace(**fields), SPEC, None, INPUTS)


def test_compare_with_reference_reports_a_nested_part_s_missing_fields_and_other_kinds() -> None:
    t32 = torch.tensor([3, 5], dtype=torch.int32)
    ref = {"seq_lens": t32, "paged": {"indptr": torch.tensor([0, 1, 2], dtype=torch.int32), "num_pages": 2},
           "causal": True, "n": 2, "lens": t32}
    got = SimpleNamespace(seq_lens=t32.clone(), paged=SimpleNamespace(num_pages=2), causal=1, n=2.0, lens=[3, 5])
    cmp = compare_with_reference(got, ref)
    assert cmp.missing == ("paged.indptr",)
    assert {d.field for d in cmp.disagreements} == {"causal", "n", "lens"}
    assert not cmp.ok
    same = SimpleNamespace(seq_lens=t32.clone(), paged=SimpleNamespace(indptr=ref["paged"]["indptr"], num_pages=np.int64(2)),
                           causal=np.bool_(True), n=np.int32(2), lens=t32.numpy())
    assert compare_with_reference(same, ref).ok  # (numpy's scalars and a host array of the same values agree)
