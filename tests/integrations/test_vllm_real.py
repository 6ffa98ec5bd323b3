"""The vLLM adapter against vLLM 0.33.0's real ``CommonAttentionMetadata`` (marker ``vllm``).

Skipped, with the reason printed, where vLLM cannot be imported (CI): tests/integrations/install_vllm.sh
makes a virtual environment of its own where it can (docs/vllm.md, "Testing against vLLM"); run
``ENV/bin/python -m pytest -m vllm tests/integrations -ra`` there.

- the pinned fields are the real class's (names, order, defaults);
- vLLM -> attnmeta -> vLLM: a ``CommonAttentionMetadata`` built the way vLLM's V1 runner builds one
  (torch, from the scheduler's counts; nothing of attnmeta) goes through ``spec_from_vllm``, attnmeta's
  common pass and ``to_vllm_common``, and every one of its fields comes back equal; vLLM's own helpers
  (``split_decodes_and_prefills``, ``unpadded``, ``compute_num_computed_tokens``) agree on both;
- attnmeta -> vLLM -> attnmeta gives every attnmeta field back;
- both directions pass the sync audit on ``meta`` with the real class;
- the recipe of docs/vllm.md (an out-of-tree backend whose builder is attnmeta) imports, registers,
  wires the host block table from vLLM's real ``MultiGroupBlockTable`` and builds attnmeta's own
  FlashAttention metadata.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import attnmeta
from attnmeta import BatchSpec, CommonAttentionMetadata, Stager, build_common, stage_common
from attnmeta.backends.flash_attn import FlashAttentionOptions
from attnmeta.integrations import vllm as adapter
from attnmeta.sync import no_device_sync
from attnmeta.testing.strategies import batch_specs

pytestmark = pytest.mark.vllm

vllm_utils = pytest.importorskip(
    "vllm.v1.attention.backends.utils",
    reason="vLLM 0.33.0 is not importable here; tests/integrations/install_vllm.sh makes a venv where it is "
           "(docs/vllm.md, 'Testing against vLLM')",
)
VllmCommon = vllm_utils.CommonAttentionMetadata

from vllm_runner import vllm_runner_common  # noqa: E402  (tests/integrations/vllm_runner.py: needs vLLM)

DOC = Path(__file__).resolve().parents[2] / "docs" / "vllm.md"
KINDS = ("decode", "spec_decode", "prefill", "chunked_prefill")  # vLLM schedules no zero-length row, no empty step


def test_vllm_is_the_pinned_release() -> None:
    import vllm

    assert vllm.__version__ == adapter.VLLM_VERSION
    fields = dataclasses.fields(VllmCommon)
    assert tuple(f.name for f in fields) == adapter.VLLM_COMMON_FIELDS
    assert {f.name: f.default for f in fields if f.default is not dataclasses.MISSING} == dict(
        adapter.VLLM_COMMON_DEFAULTS)
    assert all(f.default_factory is dataclasses.MISSING for f in fields)
    assert adapter.vllm_common_class() is VllmCommon


# ------------------------------------------------------------------ vLLM's CommonAttentionMetadata, vLLM's way


def spec_of(vcm: Any, spec: BatchSpec, table: np.ndarray) -> BatchSpec:
    """spec_from_vllm with what a vLLM caller passes besides ``vcm``: the host table, the exact counts
    under async spec decode, the drafts, the CP layout."""
    return adapter.spec_from_vllm(
        vcm, block_table=table, block_size=spec.block_size,
        num_computed_tokens=None if spec.seq_lens_upper_bound is None else spec.num_computed_tokens,
        num_draft_tokens=spec.num_draft_tokens, context_parallel=spec.context_parallel,
    )


def assert_same_vllm(got: Any, want: Any) -> list[str]:
    """Every field of two vLLM ``CommonAttentionMetadata`` equal (tensors: dtype, shape, device, values);
    returns the names compared."""
    names = [f.name for f in dataclasses.fields(VllmCommon)]
    for name in names:
        a, b = getattr(got, name), getattr(want, name)
        if isinstance(b, torch.Tensor):
            assert isinstance(a, torch.Tensor), f"{name}: {type(a).__name__}, want a tensor"
            assert (a.dtype, tuple(a.shape), a.device) == (b.dtype, tuple(b.shape), b.device), f"{name}: {a} vs {b}"
            if a.device.type != "meta":
                assert torch.equal(a, b), f"{name}: {a.tolist()} != {b.tolist()}"
        else:
            assert type(a) is type(b) and a == b, f"{name}: {a!r} != {b!r}"
    return names


def assert_same_common(a: CommonAttentionMetadata, b: CommonAttentionMetadata) -> None:
    for name, role in a.field_roles().items():
        x, y = getattr(a, name), getattr(b, name)
        if role == "scalar" or x is None or y is None:
            assert x == y, f"{name}: {x!r} != {y!r}"
        elif role == "device":
            assert (x.dtype, x.shape, x.device) == (y.dtype, y.shape, y.device), name
            if x.device.type != "meta":
                assert torch.equal(x, y), f"{name}: {x.tolist()} != {y.tolist()}"
        else:
            assert x.dtype == y.dtype and np.array_equal(x, y), f"{name}: {x!r} != {y!r}"


@given(spec=batch_specs(kinds=KINDS, min_reqs=1, max_reqs=8, with_context_parallel=st.booleans()))
def test_vllm_to_attnmeta_to_vllm_gives_every_field_back(spec: BatchSpec) -> None:
    vcm, table = vllm_runner_common(spec, torch.device("cpu"))
    back = spec_of(vcm, spec, table)
    with Stager("cpu").step() as step:
        staged = stage_common(back, step, block_table_columns=table.shape[1])  # vLLM's width
    ours = adapter.to_vllm_common(staged.result())
    assert type(ours) is VllmCommon
    assert assert_same_vllm(ours, vcm) == list(adapter.VLLM_COMMON_FIELDS)  # every field of the real class
    # vLLM's own helpers agree on both objects, and with attnmeta's host split
    for args in ((1, False, True), (1 + (spec.max_query_len > 1), True, True), (2, False, False), (4, False, True)):
        assert vllm_utils.split_decodes_and_prefills(ours, *args) == vllm_utils.split_decodes_and_prefills(vcm, *args)
        assert vllm_utils.split_decodes_and_prefills(ours, *args) == tuple(staged.host.split(*args))
    assert torch.equal(ours.compute_num_computed_tokens(), vcm.compute_num_computed_tokens())
    assert ours.naive_query_lens().tolist() == vcm.naive_query_lens().tolist()
    n, T = spec.num_reqs, spec.num_tokens
    assert_same_vllm(ours.unpadded(T, n), vcm.unpadded(T, n))


@given(spec=batch_specs(max_reqs=8, with_context_parallel=st.booleans()))
def test_attnmeta_to_vllm_to_attnmeta_gives_every_field_back(spec: BatchSpec) -> None:
    stager = Stager("cpu")
    cm = build_common(spec, stager)
    vcm = adapter.to_vllm_common(cm, mm_req_doc_ranges={0: [(0, 1)]} if spec.num_reqs else None)
    assert vcm.query_start_loc_cpu.data_ptr() == cm.query_start_loc_cpu.ctypes.data  # shared, no copy
    back = adapter.spec_from_vllm(
        vcm, block_table=cm.block_table_cpu, block_size=spec.block_size, num_real_reqs=spec.num_reqs,
        num_computed_tokens=None if spec.seq_lens_upper_bound is None else cm.num_computed_tokens_cpu,
        num_draft_tokens=spec.num_draft_tokens, context_parallel=spec.context_parallel,
    )
    assert_same_common(build_common(back, stager), cm)


@given(spec=batch_specs(kinds=KINDS, min_reqs=1, max_reqs=6))
def test_the_real_class_on_meta_passes_the_sync_audit(spec: BatchSpec) -> None:
    cm = build_common(spec, Stager("meta"))
    with no_device_sync():
        vcm = adapter.to_vllm_common(cm)
        back = adapter.spec_from_vllm(
            vcm, block_table=cm.block_table_cpu, block_size=spec.block_size,
            num_computed_tokens=None if spec.seq_lens_upper_bound is None else cm.num_computed_tokens_cpu,
            num_draft_tokens=spec.num_draft_tokens,
        )
        vllm_utils.split_decodes_and_prefills(vcm)  # vLLM's host-side helper reads host fields only
    assert vcm.seq_lens.device.type == "meta"
    assert_same_common(build_common(back, Stager("meta")), cm)


# ------------------------------------------------------------------ the recipe of docs/vllm.md


@pytest.fixture(scope="module")
def recipe(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ModuleType]:
    """docs/vllm.md's ``attnmeta_vllm_backend.py``, written out and imported as that module."""
    blocks = re.findall(r"^```python attnmeta_vllm_backend\.py\n(.*?)^```$", DOC.read_text(), re.S | re.M)
    assert len(blocks) == 1, "docs/vllm.md: one ```python attnmeta_vllm_backend.py block"
    where = tmp_path_factory.mktemp("recipe")
    (where / "attnmeta_vllm_backend.py").write_text(blocks[0])
    sys.path.insert(0, str(where))
    try:
        import attnmeta_vllm_backend

        yield attnmeta_vllm_backend
    finally:
        sys.path.remove(str(where))
        sys.modules.pop("attnmeta_vllm_backend", None)


def test_the_recipe_registers_and_builds_attnmetas_metadata(recipe: ModuleType) -> None:
    from vllm.config import DeviceConfig, VllmConfig
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.worker.block_table import MultiGroupBlockTable

    recipe.register()
    try:
        assert AttentionBackendEnum.CUSTOM.get_class() is recipe.AttnmetaBackend
    finally:
        AttentionBackendEnum.CUSTOM.clear_override()
    assert recipe.AttnmetaBackend.get_builder_cls() is recipe.AttnmetaFlashAttnBuilder

    bs = 4
    kv_spec = FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=64, dtype=torch.float16)
    config = VllmConfig(device_config=DeviceConfig(device="cpu"))
    builder = recipe.AttnmetaFlashAttnBuilder(kv_spec, ["model.layers.0.self_attn.attn"], config, torch.device("cpu"))
    assert builder.reorder_batch_threshold is None  # as vLLM's FlashAttention builder: no reordering asked for

    # vLLM's own host block table of KV-cache group 0: two decodes and a prefill, padded to 4 rows
    tables = MultiGroupBlockTable(max_num_reqs=4, max_num_batched_tokens=64, pin_memory=False,
                                  device=torch.device("cpu"), block_sizes=[bs], max_num_blocks=[8])
    for row, blocks in enumerate(([11, 12], [21, 22, 23], [31, 32])):
        tables[0].add_row(blocks, row)
    spec = BatchSpec(num_computed_tokens=[5, 9, 0], num_scheduled_tokens=[1, 1, 6],
                     num_prompt_tokens=[3, 4, 6], block_table=tables[0].get_numpy_array(), block_size=bs,
                     num_reqs_padded=4, num_tokens_padded=10)
    vcm, _ = vllm_runner_common(spec, torch.device("cpu"))

    with pytest.raises(ValueError, match="block_table: None"):
        builder.build(0, vcm)  # not wired yet
    runner = SimpleNamespace(attn_groups=[[SimpleNamespace(metadata_builders=[builder])]],
                             input_batch=SimpleNamespace(block_table=tables))
    extension = recipe.AttnmetaWorkerExtension()
    extension.model_runner = runner  # (vLLM mixes the extension into its worker, which has model_runner)
    assert extension.attnmeta_wire_block_tables() == 1
    assert builder.host_block_table is tables[0].get_numpy_array()

    got = builder.build(0, vcm)
    want = attnmeta.build(spec_of(vcm, spec, tables[0].get_numpy_array()), Stager("cpu"), "flash_attn",
                          FlashAttentionOptions())
    for name, role in want.field_roles().items():
        x, y = getattr(got, name), getattr(want, name)
        if role == "scalar" or x is None or y is None:
            assert x == y, name
        elif role == "device":
            assert torch.equal(x, y), name
        else:
            assert np.array_equal(x, y), name
    assert_same_common(got.common, want.common)
    assert (got.num_decode_reqs, got.num_prefill_reqs) == (0, 0)  # (vLLM's builder counts only under DCP)
    assert got.query_start_loc_cpu.tolist() == [0, 1, 2, 8, 8]


def test_the_recipe_refuses_micro_batching_and_speculative_decoding(recipe: ModuleType) -> None:
    """Under both it built wrong slots without a word (a first-contact review): each micro-batch's builder
    read the whole batch's host table from row 0, and the host upper bounds of spec decode (async
    scheduling, and every drafter step after the first) are optimistic."""
    import dataclasses

    from vllm.config import DeviceConfig, ParallelConfig, SpeculativeConfig, VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    kv_spec = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=64, dtype=torch.float16)
    layers, cpu = ["model.layers.0.self_attn.attn"], torch.device("cpu")
    dbo = VllmConfig(device_config=DeviceConfig(device="cpu"))
    dbo.parallel_config = dataclasses.replace(ParallelConfig(), ubatch_size=2)
    assert dbo.parallel_config.use_ubatching
    with pytest.raises(NotImplementedError, match="not a micro-batch's rows of it"):
        recipe.AttnmetaFlashAttnBuilder(kv_spec, layers, dbo, cpu)
    drafting = VllmConfig(device_config=DeviceConfig(device="cpu"))
    drafting.speculative_config = SpeculativeConfig(method="ngram", num_speculative_tokens=2, prompt_lookup_max=3,
                                                    prompt_lookup_min=1)
    with pytest.raises(NotImplementedError, match="optimistic under speculative decoding"):
        recipe.AttnmetaFlashAttnBuilder(kv_spec, layers, drafting, cpu)
    recipe.AttnmetaFlashAttnBuilder(kv_spec, layers, VllmConfig(device_config=DeviceConfig(device="cpu")), cpu)
