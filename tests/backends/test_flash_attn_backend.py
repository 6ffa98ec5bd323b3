"""FlashAttention backend metadata (attnmeta.backends.flash_attn; docs/semantics.md, "split_decodes_and_prefills"; docs/semantics.md, "Context parallelism"; docs/semantics-attention.md, "FlashAttentionMetadata").

Structure (field roles, documented shapes, repr, read-only host arrays) apart from numerics: the
fields are the common metadata's own, the decode/context-query counts are vLLM's (none without DCP;
under DCP its split_dcp_context_queries, from the torch split reference), the DCP
context lengths equal a torch transcription of section 7 step 6 and 5.9, per-request ``causal`` is an
int32 array with padding rows 1; in eager mode, graph mode and on ``meta``, always in one copy.
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

from attnmeta import BatchSpec, Stager, StaticProfile, stage_common
from attnmeta.backends import flash_attn
from attnmeta.backends.flash_attn import FlashAttentionInputs, FlashAttentionMetadata, FlashAttentionOptions
from attnmeta.metadata import CommonAttentionMetadata
from attnmeta.testing.assertions import assert_matches_device
from attnmeta.testing.reference import ref_query_start_loc, ref_seq_lens
from attnmeta.testing.reference.layout import ref_split_decodes_prefills_and_extends
from attnmeta.testing.strategies import batch_specs

I32 = np.int32
_TORCH = {"int32": torch.int32, "int64": torch.int64, "bool": torch.bool}
_NUMPY = {"int32": np.dtype(I32), "int64": np.dtype(np.int64), "bool": np.dtype(np.bool_)}
PREFIX = FlashAttentionOptions().prefix + "."

SPECS = batch_specs(max_reqs=12)
GRAPH_SPECS = batch_specs(max_reqs=8, max_context_len=64, block_sizes=st.just(4))
PROFILE = StaticProfile(max_num_reqs=12, max_num_tokens=600, max_blocks_per_req=34, block_size=4)

Case = tuple[BatchSpec, FlashAttentionOptions, Any]


@st.composite
def cases(draw: st.DrawFn, specs: st.SearchStrategy[BatchSpec] = SPECS) -> Case:
    """A batch, builder options (DCP layout, decode threshold, one causal flag) and, or instead of the
    one flag, the per-step input of one causal flag per real request."""
    spec = draw(specs)
    world = draw(st.sampled_from([1, 2, 4]))
    flags = st.lists(st.booleans(), min_size=spec.num_reqs, max_size=spec.num_reqs)
    causal = draw(st.one_of(st.booleans(), flags, flags.map(lambda f: np.array(f, dtype=np.bool_))))
    per_request = None if isinstance(causal, bool) else causal
    return spec, FlashAttentionOptions(
        causal=causal if per_request is None else None,
        dcp_world_size=world,
        dcp_rank=draw(st.integers(0, world - 1)),
        dcp_interleave=draw(st.sampled_from([1, 2, 4, 16])),
        max_num_splits=draw(st.sampled_from([0, 8])),
    ), per_request


# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------


class OpLog(TorchFunctionMode):
    """Records every torch function / Tensor method called (a dispatch mode would import torch._dynamo)."""

    METADATA_ONLY = frozenset({"torch.Tensor.shape.__get__", "torch.Tensor.dtype.__get__", "torch.Tensor.device.__get__"})

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append(resolve_name(func) or repr(func))
        return func(*args, **(kwargs or {}))


_EAGER: dict[str, Stager] = {}


def eager_stager(device: torch.device) -> Stager:
    key = str(device)
    if key not in _EAGER:
        _EAGER[key] = Stager(device)
    return _EAGER[key]


def _t(x: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.array(x)).to(device)


def addr(t: torch.Tensor) -> int:
    """Where ``t`` starts in memory (``data_ptr()`` is 0 for an empty tensor, whatever its storage)."""
    return t.untyped_storage().data_ptr() + t.storage_offset() * t.element_size()


def build_in_step(spec: BatchSpec, stager: Stager, options: FlashAttentionOptions,
                  flags: Any = None) -> tuple[FlashAttentionMetadata, Any]:
    with stager.step() as step:
        staged = flash_attn.stage(stage_common(spec, step), step, options, FlashAttentionInputs(causal=flags))
    assert step.stats.copies == 1, "common + FlashAttention metadata must travel in one copy"
    return staged.result(), step


def ref_dcp_context_kv_lens(spec: BatchSpec, device: torch.device, world: int, rank: int, interleave: int) -> torch.Tensor:
    """Section 7 step 6 on device: ``context = seq_lens - diff(qsl)``, then 5.9's local length for ``rank``."""
    c, q = _t(spec.num_computed_tokens, device), _t(spec.num_scheduled_tokens, device)
    qsl = ref_query_start_loc(q, spec.padded_num_reqs)
    context = ref_seq_lens(c, q, spec.padded_num_reqs) - (qsl[1:] - qsl[:-1])
    base = context // interleave // world * interleave
    rem = context - base * world
    return (base + torch.clamp(rem - rank * interleave, 0, interleave)).to(torch.int32)


def flags_of(per_request: Any) -> list[bool] | None:
    return None if per_request is None else [bool(v) for v in per_request]


def _upper(spec: BatchSpec) -> torch.Tensor:
    """``seq_lens_cpu_upper_bound`` as vLLM's runner fills it: the spec's bound (or ``c + q``), padding rows 0."""
    upper = (spec.num_computed_tokens + spec.num_scheduled_tokens if spec.seq_lens_upper_bound is None
             else spec.seq_lens_upper_bound)
    out = torch.zeros(spec.padded_num_reqs, dtype=torch.int32)
    out[: spec.num_reqs] = torch.from_numpy(upper.astype(np.int32))
    return out


def check_flash(m: FlashAttentionMetadata, spec: BatchSpec, options: FlashAttentionOptions, device: torch.device,
                per_request: Any = None) -> None:
    """Every FlashAttention field of ``m`` against ``spec`` / ``options`` / the per-request flags."""
    cm = m.common
    Bp, Tp = spec.padded_num_reqs, spec.padded_num_tokens
    # the common metadata's own tensors and arrays (views, not copies) and scalars
    for mine, theirs in (("query_start_loc", "query_start_loc"), ("seq_lens", "seq_lens"),
                         ("block_table", "block_table_tensor"), ("slot_mapping", "slot_mapping"),
                         ("query_start_loc_cpu", "query_start_loc_cpu"), ("seq_lens_cpu", "seq_lens_cpu")):
        assert getattr(m, mine) is getattr(cm, theirs), f"{mine} is not common's {theirs}"
    for name in ("num_actual_tokens", "max_query_len", "max_seq_len"):
        assert getattr(m, name) == getattr(cm, name), name
    assert (m.max_num_splits, m.scheduler_metadata) == (options.max_num_splits, None)
    q = _t(spec.num_scheduled_tokens, device)
    qsl = ref_query_start_loc(q, Bp)
    assert_matches_device(m.query_start_loc_cpu, qsl, "query_start_loc_cpu")
    assert_matches_device(m.seq_lens_cpu, ref_seq_lens(_t(spec.num_computed_tokens, device), q, Bp), "seq_lens_cpu")

    # the counts, as vLLM 0.33.0's builder sets them: none without DCP; under DCP with a query longer than
    # one token, the decodes and extends of split_decodes_prefills_and_extends at threshold 1
    counts = (0, 0, 0, 0)
    if options.dcp_world_size > 1 and spec.max_query_len > 1:
        d, e, _p, dt, et, _pt = ref_split_decodes_prefills_and_extends(qsl.cpu(), _upper(spec), Tp, spec.max_query_len, 1)
        counts = (d, e, dt, et)
    assert (m.num_decode_reqs, m.num_prefill_reqs, m.num_decode_tokens, m.num_prefill_tokens) == counts

    # DCP: this rank's share of every context, on device and host; the host bound covers every rank
    W, r, inter = options.dcp_world_size, options.dcp_rank, options.dcp_interleave
    if W == 1:
        assert m.dcp_context_kv_lens is None and m.dcp_context_kv_lens_cpu is None
        assert m.max_dcp_context_kv_len == 0
    else:
        ref = ref_dcp_context_kv_lens(spec, device, W, r, inter)
        assert m.dcp_context_kv_lens is not None
        assert_matches_device(m.dcp_context_kv_lens.cpu().numpy(), ref, "dcp_context_kv_lens")
        assert_matches_device(m.dcp_context_kv_lens_cpu, m.dcp_context_kv_lens, "dcp_context_kv_lens_cpu")
        contexts = _upper(spec) - (qsl.cpu()[1:] - qsl.cpu()[:-1])
        no_context = not contexts.numel() or int(contexts.max()) == 0  # vLLM then skips the context attention
        assert m.max_dcp_context_kv_len == (0 if no_context else -(-m.max_seq_len // (W * inter)) * inter)
        shares = torch.stack([ref_dcp_context_kv_lens(spec, device, W, k, inter) for k in range(W)])
        assert int(shares.max().item() if shares.numel() else 0) <= m.max_dcp_context_kv_len
        context = m.seq_lens.cpu() - torch.diff(m.query_start_loc.cpu())
        assert torch.equal(shares.sum(0).cpu().to(context.dtype), context), "the ranks' shares add up to the context"

    # causal: a scalar, or an int32 array (padding rows 1) whose scalar summary is "all causal"
    flags = flags_of(per_request)
    if flags is None:
        assert m.causal_tensor is None and m.causal_cpu is None
        # default (None): the common metadata's causal flag
        assert m.causal is (cm.causal if options.causal is None else bool(options.causal))
    else:
        expected = torch.tensor(flags + [True] * (Bp - len(flags)), dtype=torch.int32, device=device)
        assert m.causal_tensor is not None
        assert_matches_device(m.causal_tensor.cpu().numpy(), expected, "causal_tensor")
        assert_matches_device(m.causal_cpu, expected, "causal_cpu")
        assert m.causal is all(flags)


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    assert isinstance(body, ast.ClassDef)
    docs = {}
    for a, b in zip(body.body, body.body[1:]):
        if (isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name) and isinstance(b, ast.Expr)
                and isinstance(b.value, ast.Constant) and isinstance(b.value.value, str)):
            docs[a.target.id] = b.value.value
    return docs


_DOC = re.compile(r"^\((?P<shape>[^)]*)\)\s+(?P<dtype>int32|int64|bool),\s+(?P<where>device|host)\b")


def check_documented_layout(m: FlashAttentionMetadata, device_type: str) -> None:
    """Every array field's shape, dtype and location are what its docstring's first words say."""
    sizes = {"num_reqs": m.common.num_reqs, "num_actual_tokens": m.num_actual_tokens,
             "max_blocks": m.common.block_table_cpu.shape[1]}
    docs = field_docs(FlashAttentionMetadata)
    for name in (*m._DEVICE_FIELDS, *m._HOST_FIELDS):
        doc = _DOC.match(docs.get(name, ""))
        assert doc, f"{name}: docstring must start with '(shape) dtype, device|host', got {docs.get(name)!r}"
        where = "device" if name in m._DEVICE_FIELDS else "host"
        assert doc["where"] == where, f"{name}: documented on {doc['where']}, declared {where}"
        value = getattr(m, name)
        if value is None:
            continue
        shape = eval("(" + doc["shape"] + ")", {"__builtins__": {}}, dict(sizes))
        if where == "device":
            assert isinstance(value, torch.Tensor) and value.device.type == device_type, name
            assert value.dtype == _TORCH[doc["dtype"]] and tuple(value.shape) == shape, name
        else:
            assert isinstance(value, np.ndarray), name
            assert value.dtype == _NUMPY[doc["dtype"]] and value.shape == shape, name
    for d, h in m._TWINS:
        dv, hv = getattr(m, d), getattr(m, h)
        assert (dv is None) == (hv is None), f"{d} / {h}: one is None"
        if dv is not None:
            assert tuple(dv.shape) == hv.shape and dv.dtype == _TORCH[str(hv.dtype)], f"{d} / {h} differ"


# The docstring example, and the same batch padded to 5 rows / 9 tokens with per-request causal flags.
DOC_SPEC = BatchSpec(num_computed_tokens=[5, 7, 0], num_scheduled_tokens=[1, 1, 4],
                     block_table=[[10, 11], [20, 21], [30, 31]], block_size=4)
PADDED_SPEC = BatchSpec(num_computed_tokens=[5, 7, 0], num_scheduled_tokens=[1, 1, 4],
                        block_table=[[10, 11], [20, 21], [30, 31]], block_size=4,
                        num_reqs_padded=5, num_tokens_padded=9)
FULL_OPTIONS = FlashAttentionOptions(dcp_world_size=2, dcp_rank=1, dcp_interleave=2)
FULL_FLAGS = [True, False, True]
EMPTY_PADDED = BatchSpec(num_computed_tokens=np.zeros(0, I32), num_scheduled_tokens=np.zeros(0, I32),
                         block_table=np.zeros((2, 1), I32), block_size=4, num_reqs_padded=2, num_tokens_padded=3)


# --------------------------------------------------------------------------------------------------
# structure
# --------------------------------------------------------------------------------------------------


def test_field_roles() -> None:
    F = FlashAttentionMetadata
    roles = (*F._DEVICE_FIELDS, *F._HOST_FIELDS, *F._SCALAR_FIELDS)
    assert len(roles) == len(set(roles)), "a field is declared in two roles"
    # `common` is the nested metadata (its own roles); `scheduler_metadata` is always None (not produced)
    assert set(roles) == {f.name for f in dataclasses.fields(F)} - {"common", "scheduler_metadata"}
    for dev, host in F._TWINS:
        assert dev in F._DEVICE_FIELDS and host in F._HOST_FIELDS
    assert {"query_start_loc", "seq_lens", "dcp_context_kv_lens"} <= {d for d, _ in F._TWINS}


@pytest.mark.parametrize("options, flags", [(FlashAttentionOptions(), None), (FULL_OPTIONS, FULL_FLAGS)],
                         ids=["plain", "dcp+causal"])
@pytest.mark.parametrize("dev", ["cpu", "meta"])
def test_layout_repr_and_read_only_host_arrays(dev: str, options: FlashAttentionOptions, flags: Any) -> None:
    m = flash_attn.build(PADDED_SPEC, Stager(dev), options, FlashAttentionInputs(causal=flags))
    check_documented_layout(m, dev)
    with OpLog() as log:
        text, described = repr(m), m.describe()
    assert [op for op in log.ops if op not in OpLog.METADATA_ONLY] == [], "repr/describe touched tensor data"
    assert text.startswith("FlashAttentionMetadata(num_actual_tokens=9, max_query_len=4, max_seq_len=8")
    assert "tensor(" not in text and "[" not in text, text
    assert f"slot_mapping=(9,) int64 {dev}" in text
    assert re.search(r"seq_lens_cpu\s+\(5,\) int32 host: \[6, 8, 4, 0, 0\]", described), described
    for name in m._HOST_FIELDS:
        arr = getattr(m, name)
        if arr is not None:
            assert not arr.flags.writeable, f"{name} is writeable after result()"


# --------------------------------------------------------------------------------------------------
# numerics
# --------------------------------------------------------------------------------------------------


@given(case=cases())
@example(case=(PADDED_SPEC, FULL_OPTIONS, FULL_FLAGS))
@example(case=(DOC_SPEC, FlashAttentionOptions(dcp_world_size=2), np.array([False, False, False])))
@example(case=(EMPTY_PADDED, FlashAttentionOptions(dcp_world_size=4, dcp_rank=3, dcp_interleave=16), []))
def test_flash_attn_matches_references(device: torch.device, case: Case) -> None:
    spec, options, flags = case
    m, _ = build_in_step(spec, eager_stager(device), options, flags)
    check_flash(m, spec, options, device, flags)


@pytest.mark.parametrize("flags", [[True, False], [True, False, True, True, True], [[True, False, True]]])
def test_causal_of_the_wrong_length_raises(flags: Any) -> None:
    stager = Stager("cpu")
    with pytest.raises(ValueError, match=r"causal: expected one flag per real request \(3\), got shape"):
        flash_attn.build(PADDED_SPEC, stager, None, FlashAttentionInputs(causal=flags))
    # the failed step was abandoned; the stager goes on
    m = flash_attn.build(PADDED_SPEC, stager, None, FlashAttentionInputs(causal=[False, True, True]))
    assert m.causal_cpu is not None and m.causal_cpu.tolist() == [0, 1, 1, 1, 1] and m.causal is False


def test_causal_flags_from_a_torch_tensor_are_refused() -> None:
    with pytest.raises(TypeError, match=r"causal: got a torch\.Tensor"):
        flash_attn.build(DOC_SPEC, Stager("cpu"), None, FlashAttentionInputs(causal=torch.tensor([True, False, True])))


def test_causal_flags_must_be_zero_or_one() -> None:
    with pytest.raises(ValueError, match=r"causal\[1\]=2; integer causal flags must be 0 or 1"):
        flash_attn.build(DOC_SPEC, Stager("cpu"), None, FlashAttentionInputs(causal=np.array([1, 2, 0])))


# --------------------------------------------------------------------------------------------------
# graph mode
# --------------------------------------------------------------------------------------------------


@given(steps=st.lists(cases(GRAPH_SPECS), min_size=1, max_size=4))
@example(steps=[(EMPTY_PADDED, FlashAttentionOptions(), None), (PADDED_SPEC, FULL_OPTIONS, FULL_FLAGS),
                (DOC_SPEC, FlashAttentionOptions(), None)])
def test_graph_mode(device: torch.device, steps: list[Case]) -> None:
    stager = Stager(device, profile=PROFILE)
    build_in_step(PADDED_SPEC, stager, FULL_OPTIONS, FULL_FLAGS)  # declare every field, then fix the layout
    stager.freeze()
    ptrs: dict[str, int] | None = None
    for spec, options, flags in steps:
        m, step = build_in_step(spec, stager, options, flags)
        check_flash(m, spec, options, device, flags)
        Bp = spec.padded_num_reqs
        dcp, causal = step.device_full(PREFIX + "dcp_context_kv_lens"), step.device_full(PREFIX + "causal")
        assert dcp.shape == causal.shape == (PROFILE.max_num_reqs,)
        # rows past this step (or every row, when the step did not stage the field) hold the sentinel
        staged_dcp = 0 if m.dcp_context_kv_lens is None else Bp
        staged_causal = 0 if m.causal_tensor is None else Bp
        assert (dcp.cpu()[staged_dcp:] == 0).all() and (causal.cpu()[staged_causal:] == 1).all()
        if m.dcp_context_kv_lens is not None:
            assert addr(m.dcp_context_kv_lens) == addr(dcp)
        if m.causal_tensor is not None:
            assert addr(m.causal_tensor) == addr(causal)
        now = {"dcp": addr(dcp), "causal": addr(causal), "qsl": addr(step.device_full("common.query_start_loc"))}
        assert ptrs is None or now == ptrs, "graph-mode fields must keep their addresses"
        ptrs = now


# --------------------------------------------------------------------------------------------------
# meta
# --------------------------------------------------------------------------------------------------


@settings(max_examples=scaled_examples(25))
@given(case=cases())
@example(case=(PADDED_SPEC, FULL_OPTIONS, FULL_FLAGS))
def test_meta_build(case: Case) -> None:
    spec, options, flags = case
    m, _ = build_in_step(spec, eager_stager(torch.device("meta")), options, flags)
    ref, _ = build_in_step(spec, eager_stager(torch.device("cpu")), options, flags)
    check_documented_layout(m, "meta")
    for name in m._DEVICE_FIELDS:
        t, r = getattr(m, name), getattr(ref, name)
        assert (t is None) == (r is None) and (t is None or (t.is_meta and t.shape == r.shape)), name
    for name in m._HOST_FIELDS:
        assert_matches_device(getattr(m, name), getattr(ref, name), name)
    for name in m._SCALAR_FIELDS:
        assert getattr(m, name) == getattr(ref, name), name


# --------------------------------------------------------------------------------------------------
# worked example
# --------------------------------------------------------------------------------------------------


def test_docstring_example() -> None:
    runner = doctest.DocTestRunner()
    tests = doctest.DocTestFinder(recurse=False).find(FlashAttentionMetadata, "FlashAttentionMetadata",
                                                      globs=dict(vars(flash_attn)))
    assert tests and tests[0].examples
    for t in tests:
        runner.run(t)
    assert runner.failures == 0


def test_worked_example_by_hand(device: torch.device) -> None:
    m, step = build_in_step(PADDED_SPEC, eager_stager(device), FULL_OPTIONS, FULL_FLAGS)
    assert isinstance(m.common, CommonAttentionMetadata)
    # contexts 5, 7, 0 (+ two padding rows 0); W=2, I=2, rank 1: 5 -> base 2 + clip(1 - 2, 0, 2) = 2,
    # 7 -> base 2 + clip(3 - 2, 0, 2) = 3; bound cdiv(max_seq_len 8, 4) * 2 = 4
    assert m.dcp_context_kv_lens is not None and m.dcp_context_kv_lens.cpu().tolist() == [2, 3, 0, 0, 0]
    assert m.max_dcp_context_kv_len == 4
    assert m.causal_tensor is not None and m.causal_tensor.cpu().tolist() == [1, 0, 1, 1, 1] and m.causal is False
    # q = [1, 1, 4, 0, 0] under DCP: two decodes; the 4-token row has no context (a pure prefill: vLLM's
    # split_dcp_context_queries counts it, and the padding rows, in neither count)
    assert (m.num_decode_reqs, m.num_prefill_reqs, m.num_decode_tokens, m.num_prefill_tokens) == (2, 0, 2, 0)
    assert m.slot_mapping.cpu().tolist() == [45, 87, 120, 121, 122, 123, -1, -1, -1]
    assert m.block_table.cpu().tolist() == [[10, 11], [20, 21], [30, 31], [0, 0], [0, 0]]
    assert step.stats.copies == 1
