"""BatchSpec: one test per class of bad input, each checking the message names field, row and rule."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import event, given
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

from attnmeta import Stager, build_common
from attnmeta._checks import INT32_MAX
from attnmeta.spec import BatchSpec, ContextParallel, spec_arguments
from attnmeta.staging import CapacityError
from attnmeta.staging._ring import DEFAULT_MAX_STEP_BYTES
from attnmeta.testing.strategies import batch_specs

_BT = np.arange(12, dtype=np.int32).reshape(3, 4)


def _spec(**overrides: Any) -> BatchSpec:
    """A valid 3-request step (block_size 4, seq_lens [6, 4, 9]) with some fields replaced."""
    fields: dict[str, Any] = {
        "num_computed_tokens": np.array([5, 0, 7], np.int32),
        "num_scheduled_tokens": np.array([1, 4, 2], np.int32),
        "block_table": _BT,
        "block_size": 4,
    }
    fields.update(overrides)
    return BatchSpec(**fields)


def test_valid_spec_scalars() -> None:
    spec = _spec(num_reqs_padded=4, num_tokens_padded=8, seq_lens_upper_bound=[7, 4, 9])
    assert (spec.num_reqs, spec.num_tokens, spec.max_query_len, spec.max_seq_len) == (3, 7, 4, 9)
    assert (spec.padded_num_reqs, spec.padded_num_tokens) == (4, 8)
    assert spec.num_computed_tokens.dtype == np.int32 and spec.block_table.flags.c_contiguous


def test_negative_counts() -> None:
    with pytest.raises(ValueError, match=r"num_computed_tokens\[1\]=-2 is negative \(request 1\); counts must be >= 0"):
        _spec(num_computed_tokens=[5, -2, 7])
    with pytest.raises(ValueError, match=r"num_scheduled_tokens\[2\]=-1 is negative \(request 2\)"):
        _spec(num_scheduled_tokens=[1, 4, -1])
    with pytest.raises(ValueError, match=r"num_prompt_tokens\[0\]=-3 is negative"):
        _spec(num_prompt_tokens=[-3, 4, 9])


def test_non_integer_dtype() -> None:
    with pytest.raises(TypeError, match="num_computed_tokens: expected an integer array, got dtype float64"):
        _spec(num_computed_tokens=np.array([5.0, 0.0, 7.0]))
    with pytest.raises(TypeError, match="num_scheduled_tokens: expected an integer array, got dtype bool"):
        _spec(num_scheduled_tokens=np.array([True, True, False]))


def test_torch_tensor_rejected() -> None:
    with pytest.raises(TypeError, match=r"block_table: got a torch\.Tensor \(cpu\).*host data only"):
        _spec(block_table=torch.from_numpy(_BT))


def test_length_mismatch() -> None:
    with pytest.raises(ValueError, match=r"num_scheduled_tokens: expected length 3, got shape \(2,\)"):
        _spec(num_scheduled_tokens=[1, 4])
    with pytest.raises(ValueError, match=r"num_draft_tokens: expected length 3, got shape \(4,\)"):
        _spec(num_draft_tokens=[0, 0, 0, 0])
    with pytest.raises(ValueError, match=r"block_table: has 2 rows, need one per request \(3\)"):
        _spec(block_table=_BT[:2])


def test_block_table_too_narrow() -> None:
    with pytest.raises(
        ValueError, match=r"block_table: row 2 needs cdiv\(seq_len=9, block_size=4\)=3 blocks but the table has 2 columns"
    ):
        _spec(block_table=_BT[:, :2])


def test_negative_block_id_in_used_column() -> None:
    """Block ids are checked when a step is built (the table is read then), by the pass that copies them."""
    bt = _BT.copy()
    bt[2, 2] = -1
    with pytest.raises(ValueError, match=r"block_table\[2, 2\]=-1 is negative but column 2 holds tokens of request 2"):
        build_common(_spec(block_table=bt), Stager("cpu"))
    bt = _BT.copy()
    bt[1, 3] = -1  # column 3 of request 1 (seq_len 4) is unused: allowed
    build_common(_spec(block_table=bt), Stager("cpu"))
    bt[0, 1] = -2  # block id 0 is valid: the first negative column is named
    with pytest.raises(ValueError, match=r"block_table\[0, 1\]=-2 is negative but column 1 holds tokens of request 0"):
        build_common(_spec(block_table=bt), Stager("cpu"))


def test_padding_smaller_than_batch() -> None:
    with pytest.raises(ValueError, match="num_reqs_padded: 2 < num_reqs=3; padding can only add rows"):
        _spec(num_reqs_padded=2)
    with pytest.raises(ValueError, match="num_tokens_padded: 6 < num_tokens=7; padding can only add tokens"):
        _spec(num_tokens_padded=6)


def test_int32_overflow() -> None:
    big = np.iinfo(np.int32).max
    with pytest.raises(ValueError, match=r"seq_lens\[0\]=num_computed_tokens\[0\]\+num_scheduled_tokens\[0\]=.* overflows int32"):
        _spec(num_computed_tokens=[big, 0, 7])
    with pytest.raises(ValueError, match=r"num_computed_tokens\[1\]=2147483648 does not fit int32"):
        _spec(num_computed_tokens=np.array([5, 2**31, 7], dtype=np.int64))
    table = np.zeros((3, 4), np.int64)
    table[2, 1] = 2**40
    with pytest.raises(ValueError, match=r"block_table\[2, 1\]=1099511627776 does not fit int32"):  # (was [9])
        _spec(block_table=table)
    with pytest.raises(ValueError, match=r"num_scheduled_tokens: total .* overflows int32"):
        _spec(
            num_computed_tokens=np.zeros(2, np.int32),
            num_scheduled_tokens=np.array([big, big], np.int32),
            block_table=np.zeros((2, 1), np.int32),
            block_size=big,
        )
    with pytest.raises(ValueError, match=r"num_tokens_padded: 2147483648 is more than attnmeta\.spec\.MAX_PADDED_TOKENS"):
        _spec(num_tokens_padded=2**31)


def test_drafts_exceed_scheduled() -> None:
    with pytest.raises(
        ValueError, match=r"num_draft_tokens\[1\]=5 > num_scheduled_tokens\[1\]=4 \(request 1\); drafts are part"
    ):
        _spec(num_draft_tokens=[0, 5, 1])


def test_upper_bound_below_seq_len() -> None:
    with pytest.raises(ValueError, match=r"seq_lens_upper_bound\[2\]=8 < seq_len=9 \(request 2\); an upper bound"):
        _spec(seq_lens_upper_bound=[6, 4, 8])


def test_bad_context_parallel() -> None:
    with pytest.raises(TypeError, match="context_parallel: expected ContextParallel, got tuple"):
        _spec(context_parallel=(2, 0, 1))
    with pytest.raises(ValueError, match="context_parallel: need 0 <= rank < world_size"):
        _spec(context_parallel=ContextParallel(2, 2))
    with pytest.raises(ValueError, match="context_parallel: need 0 <= rank < world_size"):
        _spec(context_parallel=ContextParallel(0, 0))
    with pytest.raises(ValueError, match=r"context_parallel\.interleave=3 must be >= 1 and divide block_size=4"):
        _spec(context_parallel=ContextParallel(2, 0, 3))


def test_bad_block_size() -> None:
    with pytest.raises(ValueError, match="block_size: must be a positive int, got 0"):
        _spec(block_size=0)


@given(spec=batch_specs(with_context_parallel=st.booleans(), long_prefills=True))
def test_strategy_draws_valid_specs(spec: BatchSpec) -> None:
    """batch_specs() is valid by construction: rebuilding from its fields re-validates cleanly."""
    again = BatchSpec(
        num_computed_tokens=spec.num_computed_tokens,
        num_scheduled_tokens=spec.num_scheduled_tokens,
        block_table=spec.block_table,
        block_size=spec.block_size,
        num_prompt_tokens=spec.num_prompt_tokens,
        num_draft_tokens=spec.num_draft_tokens,
        seq_lens_upper_bound=spec.seq_lens_upper_bound,
        num_reqs_padded=spec.num_reqs_padded,
        num_tokens_padded=spec.num_tokens_padded,
        context_parallel=spec.context_parallel,
    )
    assert again.num_tokens == spec.num_tokens
    assert spec.block_table.shape[0] == spec.padded_num_reqs


@pytest.mark.parametrize(
    "kwargs",
    [
        {"min_reqs": 3, "max_reqs": 2},
        {"min_reqs": -1},
        {"kinds": ["decode", "bogus"]},
        {"kinds": []},
        {"kinds": ["spec_decode"], "max_draft_tokens": 0},
        {"kinds": ["spec_decode"], "max_query_len": 1},
        {"max_query_len": 0},
        {"long_prefills": True, "max_query_len": 64, "max_long_prefill_len": 8},
    ],
)
def test_strategy_rejects_impossible_settings(kwargs: dict[str, Any]) -> None:
    @given(batch_specs(**kwargs))
    def draw(spec: BatchSpec) -> None:
        raise AssertionError("unreachable")

    with pytest.raises(InvalidArgument):
        draw()


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"kinds": "decode"}, r"kinds: expected a collection of request kinds \(e.g. \['decode'\]\), got the str"),
    ({"with_padding": True}, r"with_padding: expected a hypothesis strategy of bool \(e.g. st.just\(True\)"),
    ({"block_sizes": 16}, r"block_sizes: expected a hypothesis strategy of int \(e.g. st.just\(16\)"),
])
def test_strategy_names_a_value_where_it_takes_a_strategy_or_a_list(kwargs: dict[str, Any], message: str) -> None:
    """What a newcomer passes first: a plain value for a strategy knob, a str for the kinds (these were
    an AttributeError on 'validate' and 'unknown request kinds ['c', 'd', 'e', 'o']')."""
    @given(batch_specs(**kwargs))
    def draw(spec: BatchSpec) -> None:
        raise AssertionError("unreachable")

    with pytest.raises(InvalidArgument, match=message):
        draw()


@given(spec=batch_specs(kinds=["decode", "spec_decode"], with_padding=st.just(True), min_reqs=1))
def test_strategy_kinds_knobs(spec: BatchSpec) -> None:
    drafts = spec.num_draft_tokens if spec.num_draft_tokens is not None else 0
    assert (spec.num_scheduled_tokens == 1 + drafts).all()
    assert (spec.num_computed_tokens >= 1).all()
    assert spec.num_reqs_padded is not None and spec.num_tokens_padded is not None


@given(data=st.data(), bs=st.sampled_from([1, 2, 3, 4, 6, 16, 48]), world=st.sampled_from([1, 2, 3]))
def test_scalars_and_block_check_match_a_numpy_oracle(data: st.DataObject, bs: int, world: int) -> None:
    """Derived scalars and the negative-block rule (only used columns count; the first bad one in row
    order is named) against numpy, for power-of-two block sizes (shifts) and others (divisions)."""
    n = data.draw(st.integers(0, 6))
    c = np.array(data.draw(st.lists(st.integers(0, 200), min_size=n, max_size=n)), np.int32)
    q = np.array(data.draw(st.lists(st.integers(0, 20), min_size=n, max_size=n)), np.int32)
    seq = c.astype(np.int64) + q
    span = bs * world
    need = -(-seq // span)
    width = int(need.max(initial=0)) + data.draw(st.integers(0, 2))
    bt = np.array(data.draw(st.lists(st.integers(-2, 50), min_size=n * width, max_size=n * width)),
                  np.int32).reshape(n, width)
    cp = None if world == 1 else ContextParallel(world, data.draw(st.integers(0, world - 1)))
    used = np.arange(width)[None, :] < need[:, None]
    bad = np.argwhere((bt < 0) & used)
    if len(bad):
        i, j = bad[0]
        spec = BatchSpec(num_computed_tokens=c, num_scheduled_tokens=q, block_table=bt, block_size=bs,
                         context_parallel=cp)  # (the ids are checked when a step is built)
        with pytest.raises(ValueError, match=rf"block_table\[{i}, {j}\]={bt[i, j]} is negative"):
            build_common(spec, Stager("cpu"))
        return
    prompt = data.draw(st.none() | st.lists(st.integers(0, 220), min_size=n, max_size=n).map(
        lambda v: np.array(v, np.int32)), label="prompt lengths")
    spec = BatchSpec(num_computed_tokens=c, num_scheduled_tokens=q, block_table=bt, block_size=np.int64(bs),
                     context_parallel=cp, num_reqs_padded=np.int64(n + 1), num_prompt_tokens=prompt)
    assert (spec.num_reqs, spec.num_tokens, spec.num_pages) == (n, int(q.sum()), int((-(-seq // bs)).sum()))
    prefilling = prompt is not None and bool((c < prompt).any())
    assert type(spec.any_prefilling) is bool and spec.any_prefilling == spec.shape.any_prefilling == prefilling
    assert (spec.max_query_len, spec.max_exact_seq_len) == (int(q.max(initial=0)), int(seq.max(initial=0)))
    assert spec.max_seq_len == spec.max_exact_seq_len
    assert type(spec.block_size) is int and spec.block_size == bs and type(spec.num_reqs_padded) is int
    assert spec.block_table is bt  # the table is kept; the vectors are the spec's own read-only copies
    assert spec.num_computed_tokens is not c and np.array_equal(spec.num_computed_tokens, c)
    assert not spec.num_computed_tokens.flags.writeable


def test_replace_revalidates() -> None:
    """``dataclasses.replace`` builds a new, validated spec from the init fields."""
    spec = _spec()
    again = dataclasses.replace(spec, num_reqs_padded=5)
    assert again.padded_num_reqs == 5 and again.num_pages == spec.num_pages == 2 + 1 + 3
    with pytest.raises(ValueError, match="num_reqs_padded: 1 < num_reqs=3"):
        dataclasses.replace(spec, num_reqs_padded=1)


def test_fields_are_set_in_declaration_order() -> None:
    """Every field holds its own value: values that differ field from field, the upper bound above
    the exact lengths so max_seq_len != max_exact_seq_len."""
    c, q = np.array([5, 0, 7], np.int32), np.array([1, 4, 2], np.int32)
    prompt, drafts, ub = np.array([9, 4, 8], np.int32), np.array([0, 3, 1], np.int32), np.array([30, 4, 11], np.int32)
    cp = ContextParallel(2, 1)
    spec = BatchSpec(num_computed_tokens=c, num_scheduled_tokens=q, block_table=_BT, block_size=4,
                     num_prompt_tokens=prompt, num_draft_tokens=drafts, seq_lens_upper_bound=ub,
                     num_reqs_padded=5, num_tokens_padded=11, context_parallel=cp)
    for got, want in ((spec.num_computed_tokens, c), (spec.num_scheduled_tokens, q), (spec.num_prompt_tokens, prompt),
                      (spec.num_draft_tokens, drafts), (spec.seq_lens_upper_bound, ub)):
        assert got is not want and got.tolist() == want.tolist() and not got.flags.writeable
    assert spec.block_table is _BT
    assert (spec.block_size, spec.num_reqs_padded, spec.num_tokens_padded, spec.context_parallel) == (4, 5, 11, cp)
    assert (spec.num_reqs, spec.num_tokens, spec.max_query_len) == (3, 7, 4)
    assert (spec.max_seq_len, spec.max_exact_seq_len, spec.num_pages) == (30, 9, 2 + 1 + 3)
    assert spec.any_prefilling is True
    assert type(spec) is BatchSpec
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.num_reqs = 1  # type: ignore[misc]


def test_subclasses_construct_and_keep_their_class() -> None:
    """A subclass (with or without slots of its own) is built field by field and stays itself."""

    class Plain(BatchSpec):
        pass

    class Slotted(BatchSpec):
        __slots__ = ("tag",)

    for cls in (Plain, Slotted):
        spec = cls(num_computed_tokens=[5, 0, 7], num_scheduled_tokens=[1, 4, 2], block_table=_BT, block_size=4)
        assert type(spec) is cls
        assert (spec.num_reqs, spec.num_tokens, spec.max_seq_len, spec.num_pages) == (3, 7, 9, 6)
        with pytest.raises(dataclasses.FrozenInstanceError):
            spec.num_reqs = 1  # type: ignore[misc]


def test_dataclass_subclasses_are_validated_too() -> None:
    """A dataclass subclass with a field of its own: its generated __init__ ends in BatchSpec's
    validation (the derived fields are set, bad input still raises)."""

    @dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
    class Tagged(BatchSpec):
        tag: str = "x"

    spec = Tagged(num_computed_tokens=[5, 0, 7], num_scheduled_tokens=[1, 4, 2], block_table=_BT, block_size=4,
                  tag="step 3")
    assert type(spec) is Tagged and spec.tag == "step 3"
    assert (spec.num_reqs, spec.num_tokens, spec.max_seq_len, spec.num_pages) == (3, 7, 9, 6)
    assert spec.num_computed_tokens.dtype == np.int32
    with pytest.raises(ValueError, match="num_reqs_padded: 2 < num_reqs=3"):
        Tagged(num_computed_tokens=[5, 0, 7], num_scheduled_tokens=[1, 4, 2], block_table=_BT, block_size=4,
               num_reqs_padded=2)


@given(spec=batch_specs(with_context_parallel=st.booleans()), data=st.data())
def test_for_group_equals_a_new_spec_of_the_same_arguments(spec: BatchSpec, data: st.DataObject) -> None:
    """Another group's spec of the same step (its table and block size): every field equal to the
    constructor's for the same arguments, the per-request vectors shared; a table too narrow raises
    the constructor's error."""
    cp = spec.context_parallel
    step = 1 if cp is None else cp.interleave
    bs = step * data.draw(st.integers(1, 8), label="block size / interleave")
    span = bs * (1 if cp is None else cp.world_size)
    seq = spec.num_computed_tokens + spec.num_scheduled_tokens
    need = int(-(-seq.max() // span)) if spec.num_reqs else 0
    width = data.draw(st.integers(max(need, 1), need + 3), label="width")
    table = np.arange(spec.block_table.shape[0] * width, dtype=np.int32).reshape(-1, width)
    got = spec.for_group(block_table=table, block_size=bs)
    want = BatchSpec(**{**spec_arguments(spec), "block_table": table, "block_size": bs})
    for f in dataclasses.fields(BatchSpec):
        a, b = getattr(got, f.name), getattr(want, f.name)
        if f.name == "block_table":
            assert a is table
        elif isinstance(b, np.ndarray):
            assert a.dtype == b.dtype and np.array_equal(a, b) and not a.flags.writeable, f.name
        else:
            assert type(a) is type(b) and a == b, f.name
    assert got.num_computed_tokens is spec.num_computed_tokens
    if need > 1:
        narrow = table[:, : need - 1]
        with pytest.raises(ValueError) as new_error:
            BatchSpec(**{**spec_arguments(spec), "block_table": narrow, "block_size": bs})
        with pytest.raises(ValueError) as group_error:
            spec.for_group(block_table=narrow, block_size=bs)
        assert str(group_error.value) == str(new_error.value)


@given(spec=batch_specs(), data=st.data())
def test_specs_of_a_scan_equal_the_constructor_s(spec: BatchSpec, data: st.DataObject) -> None:
    """The specs the composer's counts entry makes of its scan (the steps it composes), for one to three
    groups: every field equal to ``BatchSpec(...)`` and ``for_group`` of the same arguments, the
    per-request vectors read-only copies the groups share (the caller's arrays may change after the
    call), each table the caller's own."""
    from attnmeta.spec import scan_counts, specs_of_scan

    args = spec_arguments(spec)
    copies = {k: None if args[k] is None else np.array(args[k]) for k in (
        "num_computed_tokens", "num_scheduled_tokens", "num_prompt_tokens", "num_draft_tokens", "seq_lens_upper_bound")}
    c, q, prompt, drafts, ub = copies.values()
    seq = c + q
    tables = [(np.array(spec.block_table), spec.block_size)]
    for g in range(data.draw(st.integers(0, 2), label="more groups")):
        bs = data.draw(st.integers(1, 64), label=f"group {g + 1}'s block size")
        need = int(-(-seq.max() // bs)) if spec.num_reqs else 0
        width = data.draw(st.integers(max(need, 1), need + 2), label=f"group {g + 1}'s width")
        tables.append((np.arange(len(c) * width, dtype=np.int32).reshape(len(c), width), bs))
    scan = scan_counts(c, q, tables, prompt, drafts, ub, spec.num_reqs_padded, spec.num_tokens_padded,
                       np.empty((len(tables) - 1, 3), np.int64))
    assert scan is not None  # (a valid spec's arrays: the scan keeps them)
    got = specs_of_scan(c, q, tables, prompt, drafts, ub, scan)
    first = BatchSpec(**{**args, **copies, "block_table": tables[0][0]})
    want = [first] + [first.for_group(block_table=t, block_size=bs) for t, bs in tables[1:]]
    assert len(got) == len(want)
    for g, (a_spec, b_spec) in enumerate(zip(got, want, strict=True)):
        assert type(a_spec) is BatchSpec
        for f in dataclasses.fields(BatchSpec):
            a, b = getattr(a_spec, f.name), getattr(b_spec, f.name)
            if f.name == "block_table":
                assert a is tables[g][0]
            elif isinstance(b, np.ndarray):
                assert a.dtype == b.dtype and np.array_equal(a, b) and not a.flags.writeable, (g, f.name)
                assert not np.shares_memory(a, copies[f.name]), (g, f.name)  # (its own copy)
            else:
                assert type(a) is type(b) and a == b, (g, f.name)
        assert a_spec.num_computed_tokens is got[0].num_computed_tokens
        assert a_spec.shape == b_spec.shape


def test_for_group_checks_the_block_size_and_keeps_a_subclass() -> None:
    spec = _spec()
    with pytest.raises(ValueError, match="must be a positive int"):
        spec.for_group(block_table=_BT, block_size=0)
    with pytest.raises(TypeError, match="expected a positive int"):
        spec.for_group(block_table=_BT, block_size=True)
    with pytest.raises(ValueError, match="need one per request"):
        spec.for_group(block_table=_BT[:2], block_size=4)
    with pytest.raises(ValueError, match="interleave=4 must be >= 1 and divide block_size=6"):
        _spec(context_parallel=ContextParallel(world_size=2, rank=0, interleave=4), block_size=8).for_group(
            block_table=_BT, block_size=6)

    @dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
    class Tagged(BatchSpec):
        tag: str = "x"

    tagged = Tagged(**spec_arguments(spec), tag="step 3").for_group(block_table=[[1], [2], [3]], block_size=64)
    assert type(tagged) is Tagged and tagged.tag == "step 3" and tagged.num_pages == 3


def test_pickle_and_copy_keep_every_field() -> None:
    import copy
    import pickle

    spec = _spec(num_reqs_padded=4, seq_lens_upper_bound=[7, 4, 9])
    for again in (pickle.loads(pickle.dumps(spec)), copy.copy(spec), copy.deepcopy(spec)):
        assert type(again) is BatchSpec
        for f in dataclasses.fields(BatchSpec):
            a, b = getattr(again, f.name), getattr(spec, f.name)
            assert np.array_equal(a, b) if isinstance(b, np.ndarray) else a == b, f.name


# ------------------------------------------------------------------ which rule is reported first
def _first_broken_rule(
    c: list[int], q: list[int], bt: list[list[int]], width: int, bs: int, world: int,
    prompt: list[int] | None, drafts: list[int] | None, ub: list[int] | None,
    num_reqs_padded: int | None, num_tokens_padded: int | None,
) -> str | None:
    """The reference: BatchSpec's rules on plain ints, row by row, each row's rules in order; the
    message of the first broken one, or None for a valid spec. (Block ids are checked when a step
    is built: :func:`_first_bad_block`.)"""
    span = bs * world
    total = 0
    for i in range(len(c)):
        seq = c[i] + q[i]
        if c[i] < 0:
            return f"num_computed_tokens[{i}]={c[i]} is negative (request {i}); counts must be >= 0"
        if q[i] < 0:
            return f"num_scheduled_tokens[{i}]={q[i]} is negative (request {i}); counts must be >= 0"
        if seq > INT32_MAX:
            return f"seq_lens[{i}]=num_computed_tokens[{i}]+num_scheduled_tokens[{i}]={seq} overflows int32"
        total += q[i]
        if total > INT32_MAX:
            return f"num_scheduled_tokens: total {sum(q)} overflows int32"
        need = -(-seq // span)
        if need > width:
            what = f"block_size={bs}" if world == 1 else f"block_size*world_size={span}"
            return (f"block_table: row {i} needs cdiv(seq_len={seq}, {what})={need} blocks but the table has "
                    f"{width} columns (request {i})")
        if prompt is not None and prompt[i] < 0:
            return f"num_prompt_tokens[{i}]={prompt[i]} is negative (request {i}); counts must be >= 0"
        if drafts is not None and drafts[i] < 0:
            return f"num_draft_tokens[{i}]={drafts[i]} is negative (request {i}); counts must be >= 0"
        if drafts is not None and drafts[i] > q[i]:
            return (f"num_draft_tokens[{i}]={drafts[i]} > num_scheduled_tokens[{i}]={q[i]} (request {i}); "
                    f"drafts are part of the scheduled tokens")
        if ub is not None and ub[i] < 0:
            return f"seq_lens_upper_bound[{i}]={ub[i]} is negative (request {i}); counts must be >= 0"
        if ub is not None and ub[i] < seq:
            return (f"seq_lens_upper_bound[{i}]={ub[i]} < seq_len={seq} (request {i}); "
                    f"an upper bound must be >= num_computed_tokens + num_scheduled_tokens")
    if num_reqs_padded is not None and num_reqs_padded < len(c):
        return f"num_reqs_padded: {num_reqs_padded} < num_reqs={len(c)}; padding can only add rows"
    if num_tokens_padded is not None and num_tokens_padded < total:
        return f"num_tokens_padded: {num_tokens_padded} < num_tokens={total}; padding can only add tokens"
    return None


def _first_bad_block(c: list[int], q: list[int], bt: list[list[int]], span: int) -> str | None:
    """The reference of the build's block-id check: the first negative used id, in row order."""
    for i in range(len(c)):
        seq = c[i] + q[i]
        for j in range(-(-seq // span)):
            if bt[i][j] < 0:
                return (f"block_table[{i}, {j}]={bt[i][j]} is negative but column {j} holds tokens of request {i} "
                        f"(seq_len {seq}); a slot mapping through it would write outside the cache")
    return None


_BREAKS = ("ub_short", "neg_ub", "drafts_over", "neg_d", "neg_p", "neg_block", "narrow", "big_q", "big_q", "big_c",
           "neg_q", "neg_c")
"""The ways :func:`test_first_broken_rule_is_reported` breaks a valid spec (one row each, or the table):
the later rules first, as hypothesis leans to the first (the earlier rules win often anyway)."""


def _int32(x: int) -> int:
    return max(-INT32_MAX - 1, min(INT32_MAX, x))


@given(
    spec=batch_specs(min_reqs=1, max_reqs=8, with_context_parallel=st.booleans()),
    scale=st.sampled_from([1, 1, 2**26]),
    data=st.data(),
)
def test_first_broken_rule_is_reported(spec: BatchSpec, scale: int, data: st.DataObject) -> None:
    """Break random rules at random rows of a valid spec: the ValueError names the first broken rule
    of the first broken row, as the row-by-row reference says (and a spec still valid constructs).
    ``scale`` multiplies the block size (a huge one lets the running total overflow before the table
    is too narrow, and 6 * 2**26 takes the divide path)."""
    kw = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in spec_arguments(spec).items()}
    kw["block_size"] = bs = spec.block_size * scale  # (any interleave still divides it)
    world = 1 if spec.context_parallel is None else spec.context_parallel.world_size
    n = spec.num_reqs
    c, q, bt = kw["num_computed_tokens"], kw["num_scheduled_tokens"], kw["block_table"]
    for rule in data.draw(st.permutations(_BREAKS))[: data.draw(st.integers(1, 3))]:
        i, k = data.draw(st.integers(0, n - 1)), data.draw(st.integers(1, 3))
        seq = int(c[i]) + int(q[i])
        if rule == "neg_c":
            c[i] = -k
        elif rule == "neg_q":
            q[i] = -k
        elif rule == "big_c":
            c[i] = INT32_MAX - k
        elif rule == "big_q":  # (two of them overflow the total)
            q[i] = data.draw(st.sampled_from([2**30 + k, INT32_MAX - k]))
        elif rule == "narrow":
            kw["block_table"] = bt = bt[:, : max(0, bt.shape[1] - k)]
        elif rule == "neg_block" and bt.shape[1]:  # a used column, or any
            used = min(bt.shape[1], max(1, -(-seq // (bs * world))))
            bt[i, data.draw(st.integers(0, used - 1) | st.integers(0, bt.shape[1] - 1))] = -k
        elif rule == "neg_p":
            if kw["num_prompt_tokens"] is None:
                kw["num_prompt_tokens"] = np.zeros(n, np.int32)
            kw["num_prompt_tokens"][i] = -k
        elif rule in ("neg_d", "drafts_over"):
            if kw["num_draft_tokens"] is None:
                kw["num_draft_tokens"] = np.zeros(n, np.int32)
            kw["num_draft_tokens"][i] = -k if rule == "neg_d" else _int32(int(q[i]) + k)
        elif rule in ("neg_ub", "ub_short"):
            if kw["seq_lens_upper_bound"] is None:
                kw["seq_lens_upper_bound"] = (c.astype(np.int64) + q).clip(0, INT32_MAX).astype(np.int32)
            kw["seq_lens_upper_bound"][i] = -k if rule == "neg_ub" else _int32(seq - k)
    expected = _first_broken_rule(
        c.tolist(), q.tolist(), bt.tolist(), bt.shape[1], bs, world,
        *(None if kw[f] is None else kw[f].tolist() for f in ("num_prompt_tokens", "num_draft_tokens",
                                                              "seq_lens_upper_bound")),
        kw["num_reqs_padded"], kw["num_tokens_padded"],
    )
    event("valid" if expected is None else re.sub(r"-?\d+", "#", expected.split(";")[0]))  # (--hypothesis-show-statistics)
    if expected is None:
        again = BatchSpec(**kw)
        seqs = c.astype(np.int64) + q
        assert (again.num_tokens, again.max_exact_seq_len) == (int(q.sum()), int(seqs.max()))
        assert again.num_pages == int((-(-seqs // bs)).sum())
        bad_block = _first_bad_block(c.tolist(), q.tolist(), bt.tolist(), bs * world)
        if bad_block is not None:  # the spec constructs; the build names the id (with the paged-KV layout
            for paged in (False, True):  # too: one rank checks the ids among the page indices it copies)
                with pytest.raises(ValueError) as err:
                    build_common(again, Stager("cpu"), paged_kv=paged)
                if again.num_tokens * 8 > DEFAULT_MAX_STEP_BYTES:  # (a step of 2**30 tokens: its fields
                    assert isinstance(err.value, CapacityError), err.value  # are reserved first)
                    continue
                assert str(err.value) == bad_block, paged
        return
    with pytest.raises(ValueError) as err:
        BatchSpec(**kw)
    assert str(err.value) == expected


def test_rule_precedence_examples() -> None:
    """Within a row the rules go in order (counts, table width, prompt, drafts, upper
    bound); across rows the earlier row wins whatever its rule."""
    bt = _BT.copy()
    bt[2, 0] = -1
    with pytest.raises(ValueError, match=r"num_prompt_tokens\[1\]=-1 is negative"):
        _spec(block_table=bt, num_prompt_tokens=[0, -1, 0])  # row 1's prompt before row 2's block id
    with pytest.raises(ValueError, match=r"num_prompt_tokens\[2\]=-1 is negative"):
        _spec(block_table=bt, num_prompt_tokens=[0, 0, -1])  # block ids are checked when a step is built
    with pytest.raises(ValueError, match=r"block_table: row 2 needs"):
        _spec(block_table=bt[:, :2], num_draft_tokens=[0, 0, 9])  # same row: the width first
    with pytest.raises(ValueError, match=r"num_draft_tokens\[1\]=-1 is negative"):
        _spec(num_draft_tokens=[0, -1, 9])  # negative before too many, in the earlier row
    with pytest.raises(ValueError, match=r"seq_lens_upper_bound\[0\]=-1 is negative"):
        _spec(seq_lens_upper_bound=[-1, 0, 0])  # negative before too small
    with pytest.raises(ValueError, match=r"seq_lens_upper_bound\[1\]=3 < seq_len=4"):
        _spec(seq_lens_upper_bound=[6, 3, -1])
    with pytest.raises(ValueError, match=r"num_scheduled_tokens: total 2147483648 overflows int32"):
        # row 1 both overflows the total and needs cdiv(2**31 - 1, 2**30) = 2 > 1 columns: the total first
        BatchSpec(num_computed_tokens=[0, 2**30 - 1], num_scheduled_tokens=[2**30, 2**30],
                  block_table=np.zeros((2, 1), np.int32), block_size=2**30)


@pytest.mark.parametrize("bs", [3, 6, 48])
def test_non_power_of_two_block_sizes(bs: int) -> None:
    """Block sizes that are not powers of two divide (no shift): pages, table width and messages."""
    c, q = np.array([5, 0, 7], np.int32), np.array([1, 4, 2], np.int32)
    need = -(-(c + q) // bs)
    bt = np.arange(3 * int(need.max()), dtype=np.int32).reshape(3, -1)
    spec = BatchSpec(num_computed_tokens=c, num_scheduled_tokens=q, block_table=bt, block_size=bs)
    assert spec.num_pages == int(need.sum())
    if bs == 3:
        with pytest.raises(ValueError, match=r"block_table: row 2 needs cdiv\(seq_len=9, block_size=3\)=3 blocks"):
            BatchSpec(num_computed_tokens=c, num_scheduled_tokens=q, block_table=bt[:, :2], block_size=bs)
        cp = ContextParallel(3, 1)
        with pytest.raises(ValueError, match=r"row 0 needs cdiv\(seq_len=6, block_size\*world_size=9\)=1 blocks"):
            BatchSpec(num_computed_tokens=c, num_scheduled_tokens=q, block_table=bt[:, :0], block_size=bs,
                      context_parallel=cp)


def _runner_spec_rows(spec: BatchSpec) -> np.ndarray:
    """vLLM's runner rule for ``num_decode_draft_tokens_cpu >= 0``, row by row (docs/semantics.md, draft
    tokens): ``d`` where ``d > 0`` and ``q == d + 1``; 0 where ``q == 1`` past the prompt; else -1."""
    q, c = spec.num_scheduled_tokens, spec.num_computed_tokens
    d = spec.num_draft_tokens if spec.num_draft_tokens is not None else np.zeros_like(q)
    past = np.ones_like(q, bool) if spec.num_prompt_tokens is None else c >= spec.num_prompt_tokens
    return ((d > 0) & (q == d + 1)) | ((q == 1) & past)


@given(spec=batch_specs(max_reqs=6, max_query_len=8), data=st.data())
def test_the_shape_s_row_classes_follow_the_split_and_the_runner_rules(spec: BatchSpec, data: st.DataObject) -> None:
    """``uniform_queries`` (every query ``q[0]`` tokens or none) and ``all_spec_rows`` (every real row a spec
    row by the runner's rule), from ``BatchSpec.shape`` and from the composer's scan of the same arrays,
    against the rules written out row by row; drafts drawn so that spec rows occur."""
    from attnmeta.compose import Group, StepBuilder

    q = spec.num_scheduled_tokens
    if spec.num_reqs and data.draw(st.booleans(), "drafts"):
        drafts = np.where(q > 1, q - 1, 0).astype(np.int32)
        spec = dataclasses.replace(spec, num_draft_tokens=drafts)
    s = spec.shape
    want_uniform = bool(np.all((q == 0) | (q == (q[0] if q.size else 0))))
    want_spec = bool(q.size) and bool(np.all(_runner_spec_rows(spec)))
    assert (s.uniform_queries, s.all_spec_rows) == (want_uniform, want_spec)
    composer = StepBuilder(Stager("cpu"), Group({}))
    seen: list[Any] = []
    composer._class_entry = lambda shapes, inputs: seen.append(shapes) or None  # type: ignore[method-assign]
    composer.build_counts(spec.num_computed_tokens, q, [(spec.block_table, spec.block_size)],
                          num_prompt_tokens=spec.num_prompt_tokens, num_draft_tokens=spec.num_draft_tokens,
                          seq_lens_upper_bound=spec.seq_lens_upper_bound, num_reqs_padded=spec.num_reqs_padded,
                          num_tokens_padded=spec.num_tokens_padded)
    if seen:  # (the counts entry scanned the arrays: its shape is the spec's)
        assert seen[0][0] == s


def test_a_decode_loop_s_shapes_name_its_spec_rows_and_uniform_queries() -> None:
    """Worked cases: three rows of 2 drafts each (all spec, uniform); one row with 1 draft among them
    (all spec, not uniform); a one-token row still in its prompt (not a spec row); a padding row."""
    table = np.arange(1, 13, dtype=np.int32).reshape(3, 4)

    def shape(q: list[int], d: list[int] | None, prompt: list[int] | None = None, **kw: Any) -> tuple[bool, bool]:
        s = BatchSpec(num_computed_tokens=[4, 5, 6], num_scheduled_tokens=q, num_draft_tokens=d,
                      num_prompt_tokens=prompt, block_table=table, block_size=4, **kw).shape
        return s.uniform_queries, s.all_spec_rows

    assert shape([3, 3, 3], [2, 2, 2]) == (True, True)
    assert shape([3, 2, 3], [2, 1, 2]) == (False, True)
    assert shape([3, 3, 3], [2, 1, 2]) == (True, False)  # (a row verifying 1 draft with 3 tokens: a prefill)
    assert shape([1, 1, 1], None) == (True, True)
    assert shape([1, 1, 1], None, prompt=[2, 5, 9]) == (True, False)  # (row 2 is still in its prompt)
    assert shape([1, 1, 1], None, num_reqs_padded=4, num_tokens_padded=4) == (True, True)
    assert shape([2, 0, 2], None) == (True, False)
