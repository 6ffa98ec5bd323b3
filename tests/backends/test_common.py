"""CommonAttentionMetadata, stage_common and build_common.

Structure tests (field roles, documented shapes and dtypes, repr/describe, read-only host arrays)
are kept apart from numerics tests (every field bit for bit against the device-side references of
:mod:`attnmeta.testing.reference`, in eager mode, graph mode and on ``meta``), and from the
``replace`` / ``unpadded`` / ``validate`` behaviour and the worked examples.
"""

from __future__ import annotations

import ast
import dataclasses
import doctest
import functools
import inspect
import re
import textwrap
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from profile_helpers import scaled_examples
from torch.overrides import TorchFunctionMode, resolve_name

from attnmeta import BatchSpec, ContextParallel, Stager, StaticProfile, build_common, metadata, stage_common
from attnmeta.metadata import CommonAttentionMetadata
from attnmeta.staging import CapacityError, bucket_rows
from attnmeta.testing.assertions import assert_host_equal, assert_matches_device
from attnmeta.testing.reference import (
    ref_is_prefilling,
    ref_num_decode_draft_tokens,
    ref_query_start_loc,
    ref_seq_lens,
    ref_token_layout,
)
from attnmeta.testing.strategies import batch_specs

I32, I64 = np.int32, np.int64
_TORCH = {"int32": torch.int32, "int64": torch.int64, "bool": torch.bool}
_NUMPY = {"int32": np.dtype(I32), "int64": np.dtype(I64), "bool": np.dtype(np.bool_)}

# Every kind of batch: padding, spec decode, prompts, upper bounds and (here) context parallelism.
SPECS = batch_specs(max_reqs=12, with_context_parallel=st.booleans())

# Graph mode: sizes bounded so every drawn batch fits PROFILE (12 rows, 8 * 64 + 16 tokens, 33 + 3
# columns at block size 4); the spec's extra block-table columns are cut to the profile's width.
GRAPH_SPECS = batch_specs(max_reqs=8, max_context_len=64, block_sizes=st.just(4),
                          with_context_parallel=st.booleans())
PROFILE = StaticProfile(max_num_reqs=12, max_num_tokens=600, max_blocks_per_req=34, block_size=4)


# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------


class OpLog(TorchFunctionMode):
    """Records every torch function / Tensor method called while active.

    A torch-function mode (not a dispatch mode: that would import torch._dynamo, ~5 s) sees every
    Python-level tensor access, including ``repr``, ``tolist``, ``item``, ``cpu`` and attribute reads.
    """

    METADATA_ONLY = frozenset({"torch.Tensor.shape.__get__", "torch.Tensor.dtype.__get__", "torch.Tensor.device.__get__"})
    COPIES = frozenset({"torch.Tensor.copy_", "torch.Tensor.to", "torch.Tensor.cuda", "torch.tensor", "torch.as_tensor"})

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append(resolve_name(func) or repr(func))
        return func(*args, **(kwargs or {}))

    @property
    def copies(self) -> int:
        return sum(op in self.COPIES for op in self.ops)

    @property
    def data_accesses(self) -> list[str]:
        """Ops other than reading a tensor's shape, dtype or device."""
        return [op for op in self.ops if op not in self.METADATA_ONLY]


_EAGER: dict[str, Stager] = {}


def eager_stager(device: torch.device) -> Stager:
    """One eager stager per device for the whole module (steady state, like a serving loop)."""
    key = str(device)
    if key not in _EAGER:
        _EAGER[key] = Stager(device)
    return _EAGER[key]


def _t(x: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.array(x)).to(device)


def _pad(x: torch.Tensor, rows: int, value: int | bool) -> torch.Tensor:
    tail = torch.full((rows - x.shape[0],), value, dtype=x.dtype, device=x.device)
    return torch.cat([x, tail])


def addr(t: torch.Tensor) -> int:
    """Where ``t`` starts in memory (``data_ptr()`` is 0 for an empty tensor, whatever its storage)."""
    return t.untyped_storage().data_ptr() + t.storage_offset() * t.element_size()


def expected_width(spec: BatchSpec) -> int:
    """Eager-mode block-table columns: the most blocks any request uses (at least 1).

    Under context parallelism one column holds ``block_size * world_size`` tokens (docs/semantics.md,
    "Context parallelism"), so a request of length ``s`` uses ``cdiv(s, block_size * world_size)`` columns.
    """
    cp = spec.context_parallel
    span = spec.block_size * (1 if cp is None else cp.world_size)
    return max(1, -(-spec.max_exact_seq_len // span))


def ref_block_table(spec: BatchSpec, width: int, device: torch.device) -> torch.Tensor:
    """The spec's real rows, first ``width`` columns (zero-extended), padding rows 0 (NULL_BLOCK_ID)."""
    B = spec.num_reqs
    table = _t(spec.block_table[:B], device)
    cols = min(width, table.shape[1])
    out = torch.zeros((spec.padded_num_reqs, width), dtype=torch.int32, device=device)
    out[:B, :cols] = table[:, :cols]
    return out


def check_common(cm: CommonAttentionMetadata, spec: BatchSpec, device: torch.device, width: int) -> None:
    """Every field of ``cm`` against the device references for ``spec``, bit for bit."""
    B, Bp, Tp = spec.num_reqs, spec.padded_num_reqs, spec.padded_num_tokens
    c, q = _t(spec.num_computed_tokens, device), _t(spec.num_scheduled_tokens, device)
    table = _t(spec.block_table, device)

    qsl = ref_query_start_loc(q, Bp)
    seq = ref_seq_lens(c, q, Bp)
    pos, slots = ref_token_layout(c, q, table, spec.block_size, Tp, spec.context_parallel)
    bt = ref_block_table(spec, width, device)
    for name, ref in (("query_start_loc", qsl), ("seq_lens", seq), ("positions", pos),
                      ("slot_mapping", slots), ("block_table_tensor", bt)):
        dev = getattr(cm, name)
        assert dev.device.type == device.type, f"{name} lives on {dev.device}, expected {device}"
        assert_matches_device(dev.cpu().numpy(), ref, name)
    # host twins equal their device tensors (and hence the references)
    for dev_name, host_name in cm._TWINS:
        assert_matches_device(getattr(cm, host_name), getattr(cm, dev_name), host_name)

    # host-only fields
    if spec.num_prompt_tokens is None:
        pre = torch.zeros(Bp, dtype=torch.bool, device=device)
    else:
        pre = ref_is_prefilling(c, _t(spec.num_prompt_tokens, device), Bp)
    assert_matches_device(cm.is_prefilling, pre, "is_prefilling")
    assert_matches_device(cm.num_computed_tokens_cpu, seq - (qsl[1:] - qsl[:-1]), "num_computed_tokens_cpu")
    ub = seq if spec.seq_lens_upper_bound is None else _pad(_t(spec.seq_lens_upper_bound, device), Bp, 0)
    assert_matches_device(cm.seq_lens_cpu_upper_bound, ub, "seq_lens_cpu_upper_bound")
    if spec.num_draft_tokens is None:
        assert cm.num_decode_draft_tokens_cpu is None
    else:
        prompt = None if spec.num_prompt_tokens is None else torch.from_numpy(spec.num_prompt_tokens.copy())
        ddt = ref_num_decode_draft_tokens(torch.from_numpy(spec.num_scheduled_tokens.copy()),
                                          torch.from_numpy(spec.num_draft_tokens.copy()),
                                          torch.from_numpy(spec.num_computed_tokens.copy()), prompt, Bp).to(device)
        assert_matches_device(cm.num_decode_draft_tokens_cpu, ddt, "num_decode_draft_tokens_cpu")

    # host scalars
    exact = (c + q)[:B]
    bound = exact if spec.seq_lens_upper_bound is None else _t(spec.seq_lens_upper_bound, device)
    assert (cm.num_reqs, cm.num_actual_tokens) == (Bp, Tp)
    assert (cm.num_real_reqs, cm.num_real_tokens) == (B, spec.num_tokens)
    assert cm.max_query_len == (int(q.max().item()) if B else 0)
    assert cm.max_seq_len == (int(bound.max().item()) if B else 0)
    assert cm.block_size == spec.block_size and cm.causal is True

    # on-device derivation: seq_lens - diff(qsl), never memoised
    ncd = cm.compute_num_computed_tokens()
    assert_matches_device(cm.num_computed_tokens_cpu, ncd, "compute_num_computed_tokens")
    assert ncd.device.type == device.type and cm.compute_num_computed_tokens() is not ncd
    cm.validate()


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """``{field: attribute docstring}`` read from the class source."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    assert isinstance(body, ast.ClassDef)
    docs = {}
    for a, b in zip(body.body, body.body[1:]):
        if (isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name) and isinstance(b, ast.Expr)
                and isinstance(b.value, ast.Constant) and isinstance(b.value.value, str)):
            docs[a.target.id] = b.value.value
    return docs


_DOC = re.compile(r"^\((?P<shape>[^)]*)\)\s+(?P<dtype>int32|int64|bool),\s+(?P<where>device|host)\b")


def check_documented_layout(meta: Any, sizes: dict[str, int], device_type: str) -> None:
    """Every array field's shape, dtype and location are what its docstring's first words say."""
    docs = field_docs(type(meta))
    for name in (*meta._DEVICE_FIELDS, *meta._HOST_FIELDS):
        m = _DOC.match(docs.get(name, ""))
        assert m, f"{name}: docstring must start with '(shape) dtype, device|host', got {docs.get(name)!r}"
        value = getattr(meta, name)
        if value is None:
            continue
        shape = eval("(" + m["shape"] + ")", {"__builtins__": {}}, dict(sizes))
        expected_where = "device" if name in meta._DEVICE_FIELDS else "host"
        assert m["where"] == expected_where, f"{name}: documented on {m['where']}, declared {expected_where}"
        if expected_where == "device":
            assert isinstance(value, torch.Tensor), f"{name}: {type(value).__name__}"
            assert value.device.type == device_type, f"{name} on {value.device}"
            assert value.dtype == _TORCH[m["dtype"]], f"{name}: {value.dtype} != documented {m['dtype']}"
            assert tuple(value.shape) == shape, f"{name}: shape {tuple(value.shape)} != documented {shape}"
        else:
            assert isinstance(value, np.ndarray), f"{name}: {type(value).__name__}"
            assert value.dtype == _NUMPY[m["dtype"]], f"{name}: {value.dtype} != documented {m['dtype']}"
            assert value.shape == shape, f"{name}: shape {value.shape} != documented {shape}"


def common_sizes(cm: CommonAttentionMetadata) -> dict[str, int]:
    return {"num_reqs": cm.num_reqs, "num_actual_tokens": cm.num_actual_tokens,
            "max_blocks": cm.block_table_cpu.shape[1]}


def without_padding(spec: BatchSpec) -> BatchSpec:
    return BatchSpec(
        num_computed_tokens=spec.num_computed_tokens, num_scheduled_tokens=spec.num_scheduled_tokens,
        block_table=spec.block_table[: spec.num_reqs], block_size=spec.block_size,
        num_prompt_tokens=spec.num_prompt_tokens, num_draft_tokens=spec.num_draft_tokens,
        seq_lens_upper_bound=spec.seq_lens_upper_bound, context_parallel=spec.context_parallel,
    )


# The docstring example: two decodes (5 and 7 cached), a fresh 4-token prefill, padded to 4 rows / 8 tokens.
DOC_SPEC = BatchSpec(num_computed_tokens=[5, 7, 0], num_scheduled_tokens=[1, 1, 4],
                     block_table=[[10, 11], [20, 21], [30, 31]], block_size=4,
                     num_reqs_padded=4, num_tokens_padded=8)
# Every optional input at once: prompts, drafts (a spec decode, a plain decode, a prefill chunk whose
# q != drafts + 1), an optimistic upper bound, padding.
RICH_SPEC = BatchSpec(num_computed_tokens=[9, 4, 2], num_scheduled_tokens=[3, 1, 5],
                      block_table=[[1, 2, 3, 4], [5, 6, -1, -1], [7, 8, -1, -1]], block_size=4,
                      num_prompt_tokens=[6, 4, 20], num_draft_tokens=[2, 0, 0],
                      seq_lens_upper_bound=[14, 6, 7], num_reqs_padded=5, num_tokens_padded=12)
# DCP: world 2, block size 4 -> one block-table column holds 8 tokens (4 on each rank).
DCP_C, DCP_Q, DCP_BT = [0, 5], [10, 4], [[7, 9], [3, 6]]


def dcp_spec(rank: int, interleave: int, **kw: Any) -> BatchSpec:
    return BatchSpec(num_computed_tokens=DCP_C, num_scheduled_tokens=DCP_Q, block_table=DCP_BT, block_size=4,
                     context_parallel=ContextParallel(2, rank, interleave), **kw)


EMPTY_PADDED = BatchSpec(num_computed_tokens=np.zeros(0, I32), num_scheduled_tokens=np.zeros(0, I32),
                         block_table=np.zeros((3, 2), I32), block_size=4, num_reqs_padded=3, num_tokens_padded=5)


# --------------------------------------------------------------------------------------------------
# structure
# --------------------------------------------------------------------------------------------------


def test_field_roles_partition_the_dataclass_fields() -> None:
    C = CommonAttentionMetadata
    roles = (*C._DEVICE_FIELDS, *C._HOST_FIELDS, *C._SCALAR_FIELDS)
    assert len(roles) == len(set(roles)), "a field is declared in two roles"
    assert set(roles) == {f.name for f in dataclasses.fields(C)}
    for dev, host in C._TWINS:
        assert dev in C._DEVICE_FIELDS and host in C._HOST_FIELDS and host == dev.replace("_tensor", "") + "_cpu"
    # every device field has a host twin (one naming rule: <name>_cpu)
    assert {d for d, _ in C._TWINS} == set(C._DEVICE_FIELDS)


@pytest.mark.parametrize("spec", [DOC_SPEC, RICH_SPEC, EMPTY_PADDED, dcp_spec(1, 2)], ids=["doc", "rich", "empty", "dcp"])
@pytest.mark.parametrize("dev", ["cpu", "meta"])
def test_fields_have_documented_shapes_and_dtypes(spec: BatchSpec, dev: str) -> None:
    cm = build_common(spec, Stager(dev))
    check_documented_layout(cm, common_sizes(cm), dev)
    for d, h in cm._TWINS:
        assert tuple(getattr(cm, d).shape) == getattr(cm, h).shape, f"{d} / {h} shapes differ"
        assert getattr(cm, d).dtype == _TORCH[str(getattr(cm, h).dtype)], f"{d} / {h} dtypes differ"


@pytest.mark.parametrize("dev", ["cpu", "meta"])
def test_repr_shows_no_values_and_touches_no_device_memory(dev: str) -> None:
    cm = build_common(RICH_SPEC, Stager(dev))
    with OpLog() as log:
        text = repr(cm)
        described = cm.describe()
    assert log.data_accesses == [], f"repr/describe touched tensors beyond shape/dtype/device: {log.data_accesses}"
    assert text.startswith("CommonAttentionMetadata(num_reqs=5, num_actual_tokens=12, max_query_len=5, max_seq_len=14")
    for name in (*cm._DEVICE_FIELDS, *cm._HOST_FIELDS):
        assert f"{name}=" in text
    assert f"slot_mapping=(12,) int64 {dev}" in text and "block_table_cpu=(5, 3) int32 host" in text
    assert "tensor(" not in text and "array(" not in text and "[" not in text, text
    # describe(): host twins' values, device fields as shape/dtype/device only
    assert re.search(r"query_start_loc_cpu\s+\(6,\) int32 host: \[0, 3, 4, 9, 9, 9\]", described), described
    assert re.search(r"num_decode_draft_tokens_cpu\s+\(5,\) int32 host: \[ 2,  0, -1, -1, -1\]", described)
    assert re.search(rf"\n  slot_mapping\s+\(12,\) int64 {dev}\n", described)
    assert "... (12 total)" in cm.describe(limit=4)


@pytest.mark.parametrize("spec", [DOC_SPEC, RICH_SPEC], ids=["doc", "rich"])
def test_host_arrays_are_read_only_after_result(spec: BatchSpec) -> None:
    cm = build_common(spec, Stager("cpu"))
    for name in cm._HOST_FIELDS:
        arr = getattr(cm, name)
        if arr is None:
            continue
        assert not arr.flags.writeable, f"{name} is writeable after result()"
        with pytest.raises(ValueError, match="read-only"):
            arr[...] = 0


# --------------------------------------------------------------------------------------------------
# numerics: eager mode vs the device references
# --------------------------------------------------------------------------------------------------


@given(spec=SPECS)
@example(spec=DOC_SPEC)
@example(spec=RICH_SPEC)
@example(spec=EMPTY_PADDED)
@example(spec=dcp_spec(0, 1, num_reqs_padded=3, num_tokens_padded=16))
def test_stage_common_matches_references(device: torch.device, spec: BatchSpec) -> None:
    stager = eager_stager(device)
    with stager.step() as step:
        staged = stage_common(spec, step)
    assert step.stats.copies == 1
    cm = staged.result()
    assert cm.block_table_tensor.shape[1] == expected_width(spec)
    check_common(cm, spec, device, expected_width(spec))


def test_block_table_columns_option(device: torch.device) -> None:
    wide = build_common(DOC_SPEC, eager_stager(device), block_table_columns=5)
    check_common(wide, DOC_SPEC, device, 5)
    assert wide.block_table_cpu.tolist() == [[10, 11, 0, 0, 0], [20, 21, 0, 0, 0], [30, 31, 0, 0, 0], [0] * 5]
    with pytest.raises(CapacityError, match=r"block_table_tensor: a request needs 2 blocks but only 1 columns"):
        build_common(DOC_SPEC, eager_stager(device), block_table_columns=1)


@given(spec=SPECS)
@example(spec=RICH_SPEC)
@example(spec=EMPTY_PADDED)
def test_without_token_arrays(device: torch.device, spec: BatchSpec) -> None:
    """``token_arrays=False`` (SlotMappingMode.NONE): the per-token arrays are empty and not staged;
    every other field equals the full build's, and 16 bytes per token fewer move."""
    stager = eager_stager(device)
    with stager.step() as step:
        staged = stage_common(spec, step, token_arrays=False)
    lean = staged.result()
    with stager.step() as full_step:
        staged_full = stage_common(spec, full_step)
    full = staged_full.result()
    for name in ("slot_mapping", "positions"):
        assert tuple(getattr(lean, name).shape) == (0,) and getattr(lean, name + "_cpu").shape == (0,)
    for name in CommonAttentionMetadata._HOST_FIELDS:
        if name not in ("slot_mapping_cpu", "positions_cpu"):
            a, b = getattr(lean, name), getattr(full, name)
            assert (a is None and b is None) or np.array_equal(a, b), name
    for name in ("query_start_loc", "seq_lens", "block_table_tensor"):
        assert torch.equal(getattr(lean, name), getattr(full, name)), name
    assert lean.num_actual_tokens == full.num_actual_tokens
    assert step.stats.bytes <= full_step.stats.bytes - 16 * spec.padded_num_tokens + 2 * 64
    lean.validate()


def test_without_token_arrays_graph_mode() -> None:
    stager = Stager("cpu", profile=PROFILE)
    with stager.step() as step:
        stage_common(DOC_SPEC, step)
    with stager.step() as step:
        staged = stage_common(DOC_SPEC, step, token_arrays=False)
    lean = staged.result()
    assert lean.slot_mapping.shape == (0,) and lean.query_start_loc_cpu.tolist() == [0, 1, 2, 6, 6]
    # the fixed buffers are back to their sentinels past the (empty) staged rows
    assert (step.device_full("common.slot_mapping") == -1).all()
    assert (step.device_full("common.positions") == 0).all()


@pytest.mark.parametrize("num_slots", [2, 3])
def test_cached_layouts_across_slot_reuse(device: torch.device, num_slots: int) -> None:
    """Steady state reuses each slot's cached layout, views and metadata plumbing: a long run of steps
    with the same shapes but changing values must still give every step its own values."""
    stager = Stager(device, num_slots=num_slots)
    rng = np.random.default_rng(0)
    table = rng.integers(0, 1000, size=(4, 8)).astype(I32)
    for i in range(4 * num_slots + 1):
        c = rng.integers(0, 20, size=4).astype(I32)
        spec = BatchSpec(num_computed_tokens=c, num_scheduled_tokens=np.ones(4, I32), block_table=table,
                         block_size=4, num_reqs_padded=5)
        with stager.step() as step:
            staged = stage_common(spec, step, block_table_columns=8)
        cm = staged.result()
        check_common(cm, spec, device, 8)
        assert stager.stats.steps == i + 1


def test_an_empty_paged_step_after_an_empty_unpaged_one_gets_its_page_fields(device: torch.device) -> None:
    """An empty batch stages no page rows, paged or not: the slot's cached layout of an unpaged empty
    step must not serve a paged one, whose ``paged_kv_indptr`` is one row (the 0), not missing."""
    stager = Stager(device, num_slots=2)
    empty = BatchSpec(num_computed_tokens=np.zeros(0, I32), num_scheduled_tokens=np.zeros(0, I32),
                      block_table=np.zeros((0, 1), I32), block_size=16)
    for paged_kv in (False, False, True, True, False, True):  # each slot: unpaged, then paged
        with stager.step() as step:
            staged = stage_common(empty, step, paged_kv=paged_kv)
        cm = staged.result()
        check_common(cm, empty, device, 1)
        if paged_kv:
            assert staged.paged is not None
            assert staged.paged.host.paged_kv_indptr.tolist() == [0]
            paged = staged.paged.result()
            assert paged.paged_kv_indptr.shape == (1,)
            if device.type != "meta":
                assert paged.paged_kv_indptr.tolist() == [0]
            assert paged.paged_kv_indices.shape == (0,) and paged.paged_kv_last_page_len.shape == (0,)


def test_token_counts_share_a_layout_and_get_exact_views(device: torch.device) -> None:
    """The per-token fields are staged at a bucketed row count: steps of one row count and table
    width but different token counts (a mixed batch changes its count every step) reuse one cached
    layout per slot, and each step's token arrays are exact-length views holding its own values."""
    stager = Stager(device, num_slots=2)
    rng = np.random.default_rng(4)
    table = rng.integers(0, 1000, size=(4, 64)).astype(I32)
    steps = []
    totals = [66, 70, 130, 140, 68, 135, 71, 141, 69, 133, 67, 138]  # two buckets per slot: 72 and 144
    for i, total in enumerate(totals):
        cut = np.sort(rng.choice(np.arange(1, total), size=3, replace=False))
        q = np.diff(np.concatenate([[0], cut, [total]])).astype(I32)
        c = rng.integers(0, 400, size=4).astype(I32)
        spec = BatchSpec(num_computed_tokens=c, num_scheduled_tokens=q, block_table=table, block_size=16,
                         num_tokens_padded=total + i % 2)
        with stager.step() as step:
            staged = stage_common(spec, step, block_table_columns=64)
        cm = staged.result()
        assert cm.slot_mapping.shape[0] == cm.positions_cpu.shape[0] == spec.padded_num_tokens
        check_common(cm, spec, device, 64)
        steps.append((cm, spec))
        if len(steps) > 1:  # the other slot's step is intact
            check_common(*steps[-2], device, 64)
    for j, slot in enumerate(stager._slots):  # one layout per bucket of token counts, not one per count
        layouts = {k[1] for k in slot.groups if isinstance(k[1], tuple) and k[1][0] == "common"}
        counts = {spec.padded_num_tokens for _, spec in steps[j::2]}
        assert len(layouts) == len({bucket_rows(t) for t in counts}) < len(counts)


def test_narrow_staged_table_still_maps_slots() -> None:
    """A staged table narrower than the spec's is refused before any kernel runs; the host kernel
    itself, given a narrow output table, falls back to the spec's table for the slot mapping."""
    from attnmeta.host.common import common_layout

    spec = BatchSpec(num_computed_tokens=[6], num_scheduled_tokens=[2], block_table=[[3, 4]], block_size=4)
    bufs = dict(query_start_loc=np.empty(2, I32), seq_lens=np.empty(1, I32), block_table=np.empty((1, 1), I32),
                positions=np.empty(2, I64), slot_mapping=np.empty(2, I64), seq_lens_upper_bound=np.empty(1, I32),
                num_computed_tokens=np.empty(1, I32), is_prefilling=np.empty(1, np.bool_),
                num_decode_draft_tokens=None)
    common_layout(spec, **bufs)
    assert bufs["slot_mapping"].tolist() == [18, 19] and bufs["block_table"].tolist() == [[3]]


def test_one_compiled_common_pass_serves_every_combination_of_optional_arrays() -> None:
    """Prompt lengths, draft counts and upper bounds, each present or not, reach the common pass (one
    group, through ``stage_common``) and the passes of a step's groups (a composer's replayed steps)
    as one compiled type: an absent array is a read-only empty array and a cleared bit, not None, for
    which numba would compile one of the package's longest kernels again for each combination."""
    import itertools

    import numba

    from attnmeta.compose import Group, StepBuilder
    from attnmeta.host.common import ABSENT, common_pass_nb, common_passes_nb

    before = {f: set(f.signatures) for f in (common_pass_nb, common_passes_nb)}
    composer = StepBuilder(Stager("cpu", num_slots=2), Group({}))
    table = [[1, 2, 0], [3, 4, 5]]
    for p, d, u in itertools.product((False, True), repeat=3):
        spec = BatchSpec(num_computed_tokens=[4, 0], num_scheduled_tokens=[3, 5], block_table=table, block_size=4,
                         num_prompt_tokens=[2, 9] if p else None, num_draft_tokens=[2, 0] if d else None,
                         seq_lens_upper_bound=[9, 5] if u else None)
        for a in (spec.num_prompt_tokens, spec.num_draft_tokens, spec.seq_lens_upper_bound):
            assert a is None or numba.typeof(a) == numba.typeof(ABSENT)  # (a spec's arrays are read-only too)
        build_common(spec, Stager("cpu"))
        for _ in range(3):  # the third replays the first's layout on ring slot 0
            composer.build(spec)
        assert composer.stats.replayed >= 1
    for f in (common_pass_nb, common_passes_nb):
        added = set(f.signatures) - before[f]
        assert len(added) <= 1, (f.py_func.__name__, added)


# --------------------------------------------------------------------------------------------------
# graph mode
# --------------------------------------------------------------------------------------------------

_SENTINELS = {"seq_lens": 0, "block_table_tensor": 0, "slot_mapping": -1, "positions": 0}


@given(specs=st.lists(GRAPH_SPECS, min_size=2, max_size=4))
@example(specs=[RICH_SPEC, DOC_SPEC, EMPTY_PADDED, dcp_spec(1, 2)])
def test_graph_mode_values_sentinels_and_fixed_addresses(device: torch.device, specs: list[BatchSpec]) -> None:
    stager = Stager(device, profile=PROFILE)
    W = PROFILE.max_blocks_per_req
    ptrs: dict[str, int] | None = None
    for spec in specs:  # shrinking and growing batches through the same fixed layout
        with stager.step() as step:
            staged = stage_common(spec, step)
        assert step.stats.copies == 1
        cm = staged.result()
        check_common(cm, spec, device, W)
        Bp, Tp = cm.num_reqs, cm.num_actual_tokens
        full = {n: step.device_full("common." + n) for n in ("query_start_loc", *_SENTINELS)}
        assert full["query_start_loc"].shape == (PROFILE.max_num_reqs + 1,)
        assert full["block_table_tensor"].shape == (PROFILE.max_num_reqs, W)
        assert full["slot_mapping"].shape == full["positions"].shape == (PROFILE.max_num_tokens,)
        # heads are this step's values, tails the documented sentinels
        qsl = full["query_start_loc"].cpu()
        assert qsl[: Bp + 1].tolist() == cm.query_start_loc_cpu.tolist()
        assert (qsl[Bp + 1 :] == int(cm.query_start_loc_cpu[-1])).all(), "qsl tail must repeat its last value"
        for name, fill in _SENTINELS.items():
            rows = Tp if name in ("slot_mapping", "positions") else Bp
            t = full[name].cpu()
            assert_host_equal(t[:rows].numpy(), getattr(cm, name).cpu().numpy(), name)
            assert (t[rows:] == fill).all(), f"{name}: tail is not the sentinel {fill}"
        now = {n: addr(t) for n, t in full.items()}
        for n in ("query_start_loc", *_SENTINELS):
            assert addr(getattr(cm, n)) == now[n], f"{n}: step view is not the fixed-address buffer"
        assert ptrs is None or now == ptrs, "graph-mode fields must keep their addresses across steps"
        ptrs = now


def test_graph_mode_capacity_errors() -> None:
    small = StaticProfile(max_num_reqs=3, max_num_tokens=6, max_blocks_per_req=2, block_size=4)
    stager = Stager("cpu", profile=small)
    fits = BatchSpec(num_computed_tokens=[0], num_scheduled_tokens=[6], block_table=[[1, 2]], block_size=4)
    too_many_tokens = BatchSpec(num_computed_tokens=[0], num_scheduled_tokens=[7], block_table=[[1, 2]], block_size=4)
    too_wide = BatchSpec(num_computed_tokens=[9], num_scheduled_tokens=[1], block_table=[[1, 2, 3]], block_size=4)
    check_common(build_common(fits, stager), fits, torch.device("cpu"), 2)
    with pytest.raises(CapacityError, match=r"4 rows / 8 tokens exceeds the profile \(max_num_reqs=3, max_num_tokens=6\)"):
        build_common(DOC_SPEC, stager)  # 4 padded rows
    with pytest.raises(CapacityError, match=r"1 rows / 7 tokens exceeds the profile \(max_num_reqs=3, max_num_tokens=6\)"):
        build_common(too_many_tokens, stager)
    with pytest.raises(CapacityError, match=r"block_table_tensor: a request needs 3 blocks but only 2 columns"):
        build_common(too_wide, stager)
    # a failed step is abandoned: the stager goes on
    check_common(build_common(fits, stager), fits, torch.device("cpu"), 2)


def test_graph_mode_context_parallel_batch_fits_its_block_columns() -> None:
    """Under DCP one column holds block_size * world_size tokens: a 10-token request needs 2 columns of a
    world-2, block-size-4 table, so a 2-column profile holds it (BatchSpec accepts this table)."""
    prof = StaticProfile(max_num_reqs=4, max_num_tokens=16, max_blocks_per_req=2, block_size=4)
    spec = dcp_spec(0, 1)
    cm = build_common(spec, Stager("cpu", profile=prof))
    check_common(cm, spec, torch.device("cpu"), 2)


# --------------------------------------------------------------------------------------------------
# meta device
# --------------------------------------------------------------------------------------------------


@settings(max_examples=scaled_examples(30))
@given(spec=SPECS)
@example(spec=EMPTY_PADDED)
def test_meta_build_has_the_shapes_and_host_values_of_a_real_build(spec: BatchSpec) -> None:
    with OpLog() as log:
        cm = build_common(spec, eager_stager(torch.device("meta")))
    assert log.copies == 1
    ref = build_common(spec, eager_stager(torch.device("cpu")))
    check_documented_layout(cm, common_sizes(ref), "meta")
    for name in cm._DEVICE_FIELDS:
        assert getattr(cm, name).is_meta
        assert getattr(cm, name).shape == getattr(ref, name).shape
    for name in cm._HOST_FIELDS:
        assert_matches_device(getattr(cm, name), getattr(ref, name), name)
    cm.validate()
    # (compute_num_computed_tokens() is plain torch arithmetic; its first meta op costs ~5 s of torch
    # imports, so it is exercised on real devices only, in check_common.)


# --------------------------------------------------------------------------------------------------
# replace / unpadded / validate
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("dev", "host"), CommonAttentionMetadata._TWINS)
def test_replace_refuses_a_field_without_its_twin(dev: str, host: str) -> None:
    cm = build_common(DOC_SPEC, Stager("cpu"))
    with pytest.raises(ValueError, match=rf"replace\(\): {dev} changed without its twin {host}"):
        cm.replace(**{dev: getattr(cm, dev).clone()})
    with pytest.raises(ValueError, match=rf"replace\(\): {host} changed without its twin {dev}"):
        cm.replace(**{host: getattr(cm, host).copy()})


def test_replace_rederives_num_computed_tokens() -> None:
    cm = build_common(DOC_SPEC, Stager("cpu"))
    longer = cm.seq_lens_cpu + np.array([3, 0, 1, 0], I32)
    new = cm.replace(seq_lens_cpu=longer, seq_lens=torch.from_numpy(longer))
    assert_host_equal(new.num_computed_tokens_cpu, np.array([8, 7, 1, 0], I32))
    assert_matches_device(new.num_computed_tokens_cpu, new.compute_num_computed_tokens())
    # ... and when query_start_loc changes (a row's query shrinks: more of it counts as context)
    qsl = np.array([0, 1, 2, 4, 4], I32)
    newq = cm.replace(query_start_loc_cpu=qsl, query_start_loc=torch.from_numpy(qsl))
    assert_host_equal(newq.num_computed_tokens_cpu, np.array([5, 7, 2, 0], I32))
    # the original object is untouched, and an explicit value wins
    assert_host_equal(cm.num_computed_tokens_cpu, np.array([5, 7, 0, 0], I32))
    explicit = np.array([1, 2, 3, 0], I32)
    assert cm.replace(seq_lens_cpu=longer, seq_lens=torch.from_numpy(longer),
                      num_computed_tokens_cpu=explicit).num_computed_tokens_cpu is explicit
    assert cm.replace(max_seq_len=99).num_computed_tokens_cpu is cm.num_computed_tokens_cpu


def test_replace_with_mismatched_lengths_says_which() -> None:
    cm = build_common(DOC_SPEC, Stager("cpu"))
    short = cm.query_start_loc_cpu[:-1].copy()
    with pytest.raises(ValueError, match=r"replace\(\): .*seq_lens_cpu .*\(4,\).* query_start_loc_cpu .*\(4,\)"):
        cm.replace(query_start_loc_cpu=short, query_start_loc=torch.from_numpy(short))


@given(spec=SPECS, rows=st.integers(0, 16))
@example(spec=RICH_SPEC, rows=1)
def test_unpadded_slices_rows_and_tokens(device: torch.device, spec: BatchSpec, rows: int) -> None:
    stager = eager_stager(device)
    cm = build_common(spec, stager)
    B, T = spec.num_reqs, spec.num_tokens
    un = cm.unpadded(T, B)
    # dropping exactly the padding gives what the unpadded batch builds, field for field
    ref = build_common(without_padding(spec), stager)
    for name in (*cm._DEVICE_FIELDS, *cm._HOST_FIELDS):
        a, b = getattr(un, name), getattr(ref, name)
        if isinstance(a, torch.Tensor):
            assert a.device.type == device.type
            assert_matches_device(a.cpu().numpy(), b, name)
        else:
            assert_matches_device(a, b, name)
    for name in cm._SCALAR_FIELDS:
        assert getattr(un, name) == getattr(ref, name), name
    un.validate()
    # fewer rows: every per-row field has b rows, tokens t; max_query_len / max_seq_len are kept
    b = min(rows, B)
    t = int(cm.query_start_loc_cpu[b])
    part = cm.unpadded(t, b)
    assert (part.num_reqs, part.num_actual_tokens, part.num_real_reqs, part.num_real_tokens) == (b, t, b, t)
    assert (part.max_query_len, part.max_seq_len) == (cm.max_query_len, cm.max_seq_len)
    assert part.query_start_loc.shape == (b + 1,) and part.block_table_tensor.shape[0] == b
    assert part.slot_mapping.shape == part.positions.shape == (t,)
    check_documented_layout(part, common_sizes(part), device.type)
    assert_host_equal(part.slot_mapping_cpu, cm.slot_mapping_cpu[:t], "slot_mapping_cpu")
    assert_host_equal(part.is_prefilling, cm.is_prefilling[:b], "is_prefilling")
    part.validate()


def test_unpadded_out_of_range() -> None:
    cm = build_common(DOC_SPEC, Stager("cpu"))
    for T, B in ((9, 3), (6, 5), (-1, 3), (6, -1)):
        with pytest.raises(ValueError, match=rf"unpadded\({T}, {B}\): must be within num_actual_tokens=8, num_reqs=4"):
            cm.unpadded(T, B)
    assert cm.unpadded(8, 4).num_reqs == 4 and cm.unpadded(0, 0).query_start_loc_cpu.tolist() == [0]


def _corrupt(cm: CommonAttentionMetadata, **host: np.ndarray) -> CommonAttentionMetadata:
    """``cm`` with bad host arrays, each device twin re-made from its host array (so twins agree)."""
    twin_of = {h: d for d, h in cm._TWINS}
    changes: dict[str, Any] = dict(host)
    for name, arr in host.items():
        if name in twin_of:
            changes[twin_of[name]] = torch.from_numpy(np.array(arr))
    return cm.replace(**changes)


def test_validate_names_the_broken_invariant() -> None:
    cm = build_common(RICH_SPEC, Stager("cpu"))  # qsl [0,3,4,9,9,9], seq_lens [12,5,7,0,0], T=12
    cm.validate()
    qsl = cm.query_start_loc_cpu
    cases: list[tuple[CommonAttentionMetadata, str]] = [
        (_corrupt(cm, query_start_loc_cpu=qsl[:-1].copy(), num_computed_tokens_cpu=cm.num_computed_tokens_cpu),
         r"query_start_loc_cpu: shape \(5,\) != \(num_reqs \+ 1,\) = \(6,\)"),
        (_corrupt(cm, query_start_loc_cpu=qsl + 1), r"query_start_loc_cpu\[0\]=1 != 0"),
        (_corrupt(cm, query_start_loc_cpu=np.array([0, 3, 2, 9, 9, 9], I32)),
         r"query_start_loc_cpu decreases at row 1: 3 -> 2"),
        (cm.replace(num_actual_tokens=8), r"query_start_loc_cpu\[-1\]=9 > num_actual_tokens=8"),
        (_corrupt(cm, seq_lens_cpu=np.array([12, 5, 7, 0], I32), num_computed_tokens_cpu=cm.num_computed_tokens_cpu),
         r"seq_lens_cpu: shape \(4,\) != \(num_reqs,\) = \(5,\)"),
        (cm.replace(is_prefilling=cm.is_prefilling[:3]), r"is_prefilling: shape \(3,\) != \(num_reqs,\) = \(5,\)"),
        (_corrupt(cm, seq_lens_cpu=np.array([12, 5, 4, 0, 0], I32)), r"seq_lens_cpu\[2\]=4 < query_lens\[2\]=5 \(request 2\)"),
        (cm.replace(seq_lens_cpu_upper_bound=np.array([12, 4, 7, 0, 0], I32)),
         r"seq_lens_cpu_upper_bound\[1\]=4 < seq_lens_cpu\[1\]=5 \(request 1\)"),
        (_corrupt(cm, slot_mapping_cpu=cm.slot_mapping_cpu[:10].copy()), r"slot_mapping: 10 rows < required 12"),
        (_corrupt(cm, block_table_cpu=cm.block_table_cpu[:4].copy()), r"block_table_tensor: 4 rows < required 5"),
        (cm.replace(block_table_tensor=cm.block_table_tensor[:, :2], block_table_cpu=cm.block_table_cpu.copy()),
         r"block_table_tensor shape \(5, 2\) != its host twin block_table_cpu shape \(5, 3\)"),
    ]
    for bad, message in cases:
        with pytest.raises(ValueError, match=message):
            bad.validate()


# --------------------------------------------------------------------------------------------------
# worked examples
# --------------------------------------------------------------------------------------------------


def test_docstring_example_runs() -> None:
    finder = doctest.DocTestFinder(recurse=False)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    tests = finder.find(CommonAttentionMetadata, "CommonAttentionMetadata", globs=dict(vars(metadata)))
    assert tests and tests[0].examples
    for t in tests:
        runner.run(t)
    assert runner.failures == 0


def test_docstring_example_values(device: torch.device) -> None:
    cm = build_common(DOC_SPEC, eager_stager(device))
    expected = {
        "query_start_loc": [0, 1, 2, 6, 6],
        "seq_lens": [6, 8, 4, 0],
        "block_table_tensor": [[10, 11], [20, 21], [30, 31], [0, 0]],
        # 5 -> block 11 offset 1; 7 -> block 21 offset 3; 0..3 -> block 30; two padding tokens
        "slot_mapping": [45, 87, 120, 121, 122, 123, -1, -1],
        "positions": [5, 7, 0, 1, 2, 3, 0, 0],
    }
    for name, values in expected.items():
        assert getattr(cm, name).cpu().tolist() == values, name
        assert getattr(cm, name + "_cpu" if name != "block_table_tensor" else "block_table_cpu").tolist() == values
    assert cm.num_computed_tokens_cpu.tolist() == [5, 7, 0, 0]
    assert cm.seq_lens_cpu_upper_bound.tolist() == [6, 8, 4, 0]
    assert cm.is_prefilling.tolist() == [False] * 4 and cm.num_decode_draft_tokens_cpu is None
    assert (cm.num_reqs, cm.num_actual_tokens, cm.max_query_len, cm.max_seq_len) == (4, 8, 4, 8)
    assert (cm.num_real_reqs, cm.num_real_tokens) == (3, 6)


def test_rich_example_values() -> None:
    cm = build_common(RICH_SPEC, Stager("cpu"))
    assert cm.is_prefilling.tolist() == [False, False, True, False, False]  # c < P: 9<6, 4<4, 2<20
    # row 0: q=3 == 2 drafts + 1 -> 2; row 1: a plain decode -> 0; row 2: q=5 != 0 + 1 -> -1; padding -1
    assert cm.num_decode_draft_tokens_cpu.tolist() == [2, 0, -1, -1, -1]
    assert cm.seq_lens_cpu.tolist() == [12, 5, 7, 0, 0]
    assert cm.seq_lens_cpu_upper_bound.tolist() == [14, 6, 7, 0, 0]
    assert (cm.max_query_len, cm.max_seq_len) == (5, 14)  # max_seq_len is the upper bound's max
    assert cm.slot_mapping_cpu.tolist() == [13, 14, 15, 24, 30, 31, 32, 33, 34, -1, -1, -1]
    assert cm.positions_cpu.tolist() == [9, 10, 11, 4, 2, 3, 4, 5, 6, 0, 0, 0]


# Slots by hand (docs/semantics.md, "Block table and slot mapping"): W=2, bs=4 -> V=8 tokens per block-table column, o = p % 8,
# local iff (o // I) % 2 == rank, slot = table[p // 8] * 4 + (o // (2 * I)) * I + o % I, else -1.
# Request 0: c=0, q=10 (p 0..9), table [7, 9] -> bases 28, 36; request 1: c=5, q=4 (p 5..8), table [3, 6]
# -> bases 12, 24.
DCP_SLOTS: dict[tuple[int, int], tuple[list[int], list[int]]] = {  # (request 0, request 1)
    # I=1: rank 0 holds even o at o // 2, rank 1 odd o at o // 2
    (0, 1): ([28, -1, 29, -1, 30, -1, 31, -1, 36, -1], [-1, 15, -1, 24]),
    (1, 1): ([-1, 28, -1, 29, -1, 30, -1, 31, -1, 36], [14, -1, 15, -1]),
    # I=2: rank 0 holds o in {0,1,4,5} at {0,1,2,3}, rank 1 o in {2,3,6,7} at {0,1,2,3}
    (0, 2): ([28, 29, -1, -1, 30, 31, -1, -1, 36, 37], [15, -1, -1, 24]),
    (1, 2): ([-1, -1, 28, 29, -1, -1, 30, 31, -1, -1], [-1, 14, 15, -1]),
}


@pytest.mark.parametrize(("rank", "interleave"), sorted(DCP_SLOTS))
def test_dcp_slot_mapping_by_hand(device: torch.device, rank: int, interleave: int) -> None:
    cm = build_common(dcp_spec(rank, interleave, num_tokens_padded=16), eager_stager(device))
    req0, req1 = DCP_SLOTS[rank, interleave]
    assert cm.slot_mapping.cpu().tolist() == [*req0, *req1, -1, -1]
    assert cm.positions_cpu.tolist() == [*range(10), 5, 6, 7, 8, 0, 0]
    assert cm.seq_lens_cpu.tolist() == [10, 9]
    assert cm.block_table_cpu.tolist() == DCP_BT  # 2 columns of 8 tokens each cover seq_len 10


@pytest.mark.parametrize("interleave", [1, 2])
def test_dcp_ranks_partition_the_tokens(interleave: int) -> None:
    slots = np.array([[*DCP_SLOTS[r, interleave][0], *DCP_SLOTS[r, interleave][1]] for r in (0, 1)])
    assert ((slots >= 0).sum(axis=0) == 1).all(), "every token is stored on exactly one rank"
    # each rank's slots are distinct, and per request it stores dcp_local_seq_lens tokens (5.9)
    for r in (0, 1):
        local = slots[r][slots[r] >= 0]
        assert len(set(local.tolist())) == local.size
    assert [(slots[:, :10] >= 0).sum(axis=1).tolist(), (slots[:, 10:] >= 0).sum(axis=1).tolist()] == (
        [[5, 5], [2, 2]] if interleave == 1 else [[6, 4], [2, 2]]
    )


# --------------------------------------------------------------------------------------------------
# several prefixes (KV-cache groups) in one step
# --------------------------------------------------------------------------------------------------


def test_several_prefixes_share_one_copy(device: torch.device) -> None:
    stager = Stager(device)
    with OpLog() as log:
        with stager.step() as step:
            a = stage_common(DOC_SPEC, step, prefix="group0")
            b = stage_common(RICH_SPEC, step, prefix="group1", causal=False)
            c = stage_common(dcp_spec(1, 2), step, prefix="group2")
            with pytest.raises(ValueError, match="staged twice"):
                stage_common(DOC_SPEC, step, prefix="group0")
        ca, cb, cc = a.result(), b.result(), c.result()
    assert log.copies == 1, "a step must move everything in one copy"
    assert step.stats.copies == 1 and stager.stats.copies == 1
    check_common(ca, DOC_SPEC, device, 2)
    check_common(cb.replace(causal=True), RICH_SPEC, device, 3)
    check_common(cc, dcp_spec(1, 2), device, 2)
    assert cb.causal is False and ca.causal is True


def _metadata_classes() -> list[type]:
    """Every metadata dataclass of the package (a MetadataBase subclass), the registry's included."""
    import importlib
    import pkgutil

    import attnmeta
    from attnmeta._fields import MetadataBase

    found: set[type] = set()
    for info in pkgutil.walk_packages(attnmeta.__path__, "attnmeta."):
        if info.name.endswith("__main__"):
            continue
        mod = importlib.import_module(info.name)
        found |= {c for c in vars(mod).values() if isinstance(c, type) and issubclass(c, MetadataBase)
                  and dataclasses.is_dataclass(c) and c.__module__ == mod.__name__}
    return sorted(found, key=lambda c: c.__qualname__)


@pytest.mark.parametrize("cls", _metadata_classes(), ids=lambda c: c.__name__)
def test_keyword_factory_makes_ordinary_frozen_instances(cls: type) -> None:
    """The builders' keyword and positional constructors give the same object the dataclass __init__
    would (frozen bases included: the Mamba types share a frozen base)."""
    from attnmeta._fields import keyword_factory, positional_factory

    names = [f.name for f in dataclasses.fields(cls)]
    values = {n: object() for n in names}
    made = keyword_factory(cls)(**values)
    assert type(made) is cls
    for n, v in values.items():
        assert getattr(made, n) is v, n
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(made, names[0], 1)
    reference = cls(**values)
    assert [getattr(reference, n) for n in names] == [getattr(made, n) for n in names]
    with pytest.raises(TypeError):
        keyword_factory(cls)(**values, not_a_field=1)
    positional = positional_factory(cls)(*values.values())
    assert type(positional) is cls and [getattr(positional, n) for n in names] == list(values.values())


@pytest.mark.parametrize("cls", _metadata_classes(), ids=lambda c: c.__name__)
def test_templates_of_one_class_keep_their_own_shared_values(cls: type) -> None:
    """:func:`attnmeta._fields.template` compiles its body once per class and names: templates of two
    objects share that body and keep each its own object's values, for one, several and every field
    given per call (no field shared)."""
    from attnmeta._fields import template

    names = [f.name for f in dataclasses.fields(cls)]
    first, second = (cls(**{n: object() for n in names}) for _ in range(2))
    for per_call in (names[:1], names[: max(1, len(names) // 2)], names[1:], names):
        made = [template(obj, tuple(per_call)) for obj in (first, second)]
        assert made[0].__code__ is made[1].__code__
        given = [object() for _ in per_call]
        for obj, make in zip((first, second), made, strict=True):
            out = make(*given)
            assert type(out) is cls
            for n in names:
                want = given[per_call.index(n)] if n in per_call else getattr(obj, n)
                assert getattr(out, n) is want, (per_call, n)
    with pytest.raises(ValueError, match="has no field"):
        template(first, ("not_a_field",))
