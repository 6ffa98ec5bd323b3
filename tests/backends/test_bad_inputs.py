"""Bad input to every registered builder: each class of wrong argument, option and per-step input raises
a ``TypeError`` or ``ValueError`` that names what is wrong, never an ``AttributeError`` or a silent
result (issue 18, "every option and input checked where it enters").

The walk names no builder. The option fields come from ``dataclasses.fields`` of each builder's
options type, with the rule each declares (:class:`attnmeta.builder.OptionRule`, the one its
``__post_init__`` checks) or, without one, the kind its annotation says; the per-step inputs come from
``builder.inputs_type``, their valid values from the builder's lab samples. A builder registered tomorrow is walked
too. The second part pins the issue's reproducers, one test each.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

import attnmeta
from attnmeta import BatchSpec, Stager, stage_common
from attnmeta.backends import cascade, fast_prefill, flash_attn, mamba
from attnmeta.backends.cascade import CascadeInputs, CascadeOptions
from attnmeta.backends.fast_prefill import FastPrefillInputs
from attnmeta.backends.mamba import LinearAttentionOptions, Mamba1Options, Mamba2Inputs, Mamba2Options
from attnmeta.builder import AnyBuilder
from attnmeta.host.fast_prefill import fast_prefill_query_start_loc
from attnmeta.host.split import (
    reorder_decodes_and_prefills,
    split_decodes_and_prefills,
    split_decodes_prefills_and_extends,
)
from attnmeta.testing.lab import lab

I32 = np.int32
BUILDERS = sorted(attnmeta.registry())
STAGER = Stager("cpu")
ERRORS = (TypeError, ValueError)

# Steps the walk draws valid inputs on: decode rows first (row 0 a decode: every row-wise input is read
# there), then prefills; prompts given, no padding rows (a doubled per-request input is never a valid
# per-row one).
SPECS = (
    BatchSpec(num_computed_tokens=[9, 17, 0], num_scheduled_tokens=[1, 1, 6], num_prompt_tokens=[5, 9, 6],
              block_table=np.arange(1, 25, dtype=I32).reshape(3, 8), block_size=4),
    BatchSpec(num_computed_tokens=[9, 17, 4], num_scheduled_tokens=[3, 3, 1], num_prompt_tokens=[5, 9, 4],
              num_draft_tokens=[2, 2, 0], block_table=np.arange(1, 31, dtype=I32).reshape(3, 10), block_size=4),
)


def _names(field: str) -> str:
    """A pattern that finds ``field`` as a whole name in a message."""
    return rf"(?<![\w.]){re.escape(field)}\b"


# ------------------------------------------------------------------------------------------------
# the generic walk: arguments of build() and stage()
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", BUILDERS)
def test_wrong_arguments_of_build_name_the_argument(name: str) -> None:
    b = attnmeta.get_builder(name)
    spec = SPECS[0]
    options, inputs = lab(name).defaults(spec)
    for bad_spec in (None, "spec", {"num_computed_tokens": [1]}, spec.block_table):
        with pytest.raises(TypeError, match=r"spec: expected a BatchSpec"):
            attnmeta.build(bad_spec, STAGER, name, options, inputs)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"spec: expected a BatchSpec"):
            b.build(bad_spec, STAGER, options, inputs)  # type: ignore[arg-type]
    for bad_stager in ("cpu", None, torch.device("cpu")):
        with pytest.raises(TypeError, match=r"stager: expected an attnmeta\.Stager"):
            attnmeta.build(spec, bad_stager, name, options, inputs)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"stager: expected an attnmeta\.Stager"):
            b.build(spec, bad_stager, options, inputs)  # type: ignore[arg-type]
    for bad_options in ({}, {"prefix": "x"}, "default", 0):
        with pytest.raises(TypeError, match=rf"{name}: options must be {b.options_type.__name__}"):
            attnmeta.build(spec, STAGER, name, bad_options, inputs)
    for other in BUILDERS:
        theirs, their_inputs = lab(other).defaults(spec)
        if type(theirs) is not b.options_type:
            with pytest.raises(TypeError, match=rf"options must be {b.options_type.__name__}, got {type(theirs).__name__}"):
                attnmeta.build(spec, STAGER, name, theirs, inputs)
        if their_inputs is not None and type(their_inputs) is not b.inputs_type:
            with pytest.raises(TypeError, match=rf"{name}: (inputs must be|takes no per-step inputs)"):
                attnmeta.build(spec, STAGER, name, options, their_inputs)


def test_a_builder_that_is_neither_a_builder_nor_a_registered_name() -> None:
    spec = SPECS[0]
    with pytest.raises(ValueError, match=r"builder: no builder named 'nope'; registered: \['cascade'"):
        attnmeta.build(spec, STAGER, "nope")
    with pytest.raises(KeyError):  # get_builder's documented KeyError stays one
        attnmeta.get_builder("nope")
    for bad in (3, None, Mamba2Options(), type(attnmeta.get_builder("flash_attn"))):
        with pytest.raises(TypeError, match=r"builder: expected a Builder or a registered name"):
            attnmeta.build(spec, STAGER, bad)  # type: ignore[arg-type]


def test_argument_errors_come_before_any_step() -> None:
    stager = Stager("cpu")
    spec = SPECS[0]
    for args in ((None, stager, "flash_attn"), (spec, stager, 7), (spec, stager, "nope"),
                 (spec, stager, "flash_attn", {"causal": True})):
        with pytest.raises(ERRORS):
            attnmeta.build(*args)  # type: ignore[arg-type]
    assert stager.stats.steps_begun == 0


@pytest.mark.parametrize("name", BUILDERS)
def test_wrong_arguments_of_stage_name_the_argument(name: str) -> None:
    """``stage(common, step, options, inputs)`` called directly (an engine's own step): ``common``
    must be a StagedCommon of that step, ``options`` the builder's options, ``inputs`` its inputs."""
    b = attnmeta.get_builder(name)
    spec = SPECS[0]
    options, inputs = lab(name).defaults(spec)
    cols = b.needs(spec.shape, b.options(options)).block_table_columns
    for bad_common in ("common", None, spec, 3):
        with pytest.raises(TypeError, match=r"common: expected the StagedCommon"), STAGER.step() as step:
            b.stage(bad_common, step, options, inputs)
    other = Stager("cpu")
    with other.step() as other_step:
        theirs = stage_common(spec, other_step, block_table_columns=cols)
        with pytest.raises(ValueError, match=r"common: staged in another step"), STAGER.step() as step:
            b.stage(theirs, step, options, inputs)
    for bad_options in ({}, "x"):
        with pytest.raises(TypeError, match=rf"{name}: options must be"), STAGER.step() as step:
            b.stage(stage_common(spec, step, block_table_columns=cols), step, bad_options, inputs)
    for bad_inputs in ({}, "x", 3):
        with pytest.raises(TypeError, match=rf"{name}: (inputs must be|takes no per-step inputs)"), \
                STAGER.step() as step:
            b.stage(stage_common(spec, step, block_table_columns=cols), step, options, bad_inputs)


# ------------------------------------------------------------------------------------------------
# the generic walk: every option field
# ------------------------------------------------------------------------------------------------


class _Rule(typing.NamedTuple):
    kind: str
    minimum: int | None = None
    maximum: int | None = None
    below: str | None = None
    choices: tuple[Any, ...] = ()
    allow_none: bool = False


def _rule(options_type: type, field: dataclasses.Field[Any]) -> _Rule:
    """The field's declared rule, or the one its annotation implies."""
    declared = field.metadata.get("rule")
    if declared is not None:
        return _Rule(declared.kind, declared.minimum, declared.maximum, declared.below, tuple(declared.choices),
                     declared.allow_none)
    hint = typing.get_type_hints(options_type)[field.name]
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    args = typing.get_args(hint) if union else (hint,)
    none = type(None) in args
    core = [a for a in args if a is not type(None)]
    kind = core[0] if len(core) == 1 else None
    if typing.get_origin(kind) is typing.Literal:
        return _Rule("choice", choices=typing.get_args(kind), allow_none=none)
    if kind in (bool, int):
        return _Rule(kind.__name__, allow_none=none)  # type: ignore[union-attr]
    if kind is str:
        return _Rule("prefix" if field.name == "prefix" else "str", allow_none=none)
    return _Rule("object", allow_none=none)


def _bad_values(rule: _Rule, good: Any) -> Iterator[Any]:
    """Values that break ``rule``: wrong types, then out-of-range values where there is a range."""
    if rule.kind == "int":
        yield from ("3", 2.5, True, [1])
        if not rule.allow_none:
            yield None
        if rule.minimum is not None:
            yield rule.minimum - 1
        if rule.maximum is not None:
            yield rule.maximum + 1
        if rule.below is not None:
            yield getattr(good, rule.below)
    elif rule.kind == "bool":
        yield from (1, "yes", 0.0)
        if not rule.allow_none:
            yield None
    elif rule.kind == "choice":
        yield from ("no-such-choice", 1.5, None)
    elif rule.kind == "prefix":
        yield from ("", "a.b", 1.5, None)
    elif rule.kind == "str":
        yield from (1.5, None)
    else:
        yield from ("not an option", 1.5)


@pytest.mark.parametrize("name", BUILDERS)
def test_every_option_field_rejects_wrong_types_and_out_of_range_values(name: str) -> None:
    good, _ = lab(name).defaults(SPECS[0])
    owner = type(good).__name__
    walked = 0
    for f in dataclasses.fields(good):
        rule = _rule(type(good), f)
        for bad in _bad_values(rule, good):
            with pytest.raises(ERRORS, match=rf"{owner}\.{f.name}\b"):
                dataclasses.replace(good, **{f.name: bad})
            walked += 1
    assert walked >= 2 * len(dataclasses.fields(good))


def test_the_declared_rules_are_the_ones_checked() -> None:
    """The built-in options declare every int, bool, choice and prefix field's rule (one source of truth
    for __post_init__ and this walk); the ranges the issue names are among them."""
    for name in BUILDERS:
        b = attnmeta.get_builder(name)
        if type(b).__module__.startswith("attnmeta."):
            for f in dataclasses.fields(b.options_type):
                if _rule(b.options_type, f).kind != "object":
                    assert "rule" in f.metadata, f"{b.options_type.__name__}.{f.name} declares no rule"
    fa = {f.name: f.metadata["rule"] for f in dataclasses.fields(flash_attn.FlashAttentionOptions)}
    assert fa["max_num_splits"].minimum == 0 and fa["dcp_rank"].below == "dcp_world_size"


# ------------------------------------------------------------------------------------------------
# the generic walk: every per-step input
# ------------------------------------------------------------------------------------------------


def _valid_inputs(b: AnyBuilder) -> tuple[BatchSpec, Any, Any]:
    """A spec of the walk, options and inputs from the builder's lab samples that set every field of its
    inputs type."""
    it = b.inputs_type
    assert it is not None
    for spec in SPECS:
        for seed in range(100):
            options, inputs = lab(b).sample(spec, np.random.default_rng(seed))
            if inputs is None:
                continue
            every = all(getattr(inputs, f.name) is not None for f in dataclasses.fields(it))
            if every and not b.unsupported_reasons(spec, options, inputs):
                return spec, options, inputs
    raise AssertionError(f"{b.name}: the lab's sample() never gave every field of {it.__name__} on the walk's specs")


def _corruptions(value: Any) -> Iterator[tuple[str, Any]]:
    """``(class, bad value)`` for a valid input value: wrong types, a negative value, a wrong length."""
    if isinstance(value, int | np.integer) and not isinstance(value, bool):
        yield from (("a str", str(value)), ("a float", float(value) + 0.5), ("a list", [int(value)]),
                    ("a bool", True), ("an array", np.array([value])), ("negative", -1))
        return
    arr = np.asarray(value)
    yield from (("a float array", arr.astype(np.float64) + 0.5), ("a str", "1, 2"), ("a dict", {"x": 1}),
                ("a torch tensor", torch.from_numpy(arr.astype(np.int32))),
                ("negative", np.full(arr.shape, -1, np.int32)), ("twice as long", np.concatenate([arr, arr])),
                ("2-D", arr.reshape(1, -1)))


@pytest.mark.parametrize("name", [n for n in BUILDERS if attnmeta.get_builder(n).inputs_type is not None])
def test_every_input_rejects_wrong_types_negative_values_and_wrong_lengths(name: str) -> None:
    b = attnmeta.get_builder(name)
    spec, options, inputs = _valid_inputs(b)
    attnmeta.build(spec, STAGER, b, options, inputs)  # the valid inputs build
    cols = b.needs(spec.shape, options).block_table_columns
    for f in dataclasses.fields(inputs):
        key = f.name
        for what, bad in _corruptions(getattr(inputs, key)):
            given = dataclasses.replace(inputs, **{key: bad})
            for path in ("build", "stage"):
                try:
                    if path == "build":
                        attnmeta.build(spec, STAGER, b, options, given)
                    else:  # an engine's own step: stage() checks it too
                        with STAGER.step() as step:
                            b.stage(stage_common(spec, step, block_table_columns=cols), step, options, given)
                except ERRORS as e:
                    assert re.search(_names(key), str(e)), f"{name}.{path}: {key} as {what}: not named in {e!r}"
                else:
                    pytest.fail(f"{name}.{path}: {key} as {what} ({bad!r}) was accepted")


# ------------------------------------------------------------------------------------------------
# the reproducers
# ------------------------------------------------------------------------------------------------


def _spec_decode_spec() -> BatchSpec:
    """Three spec-decode rows (1 + 2 drafts), then a 6-token prefill."""
    return BatchSpec(num_computed_tokens=[9, 17, 5, 0], num_scheduled_tokens=[3, 3, 3, 6],
                     num_prompt_tokens=[5, 9, 4, 6], num_draft_tokens=[2, 2, 2, 0],
                     block_table=np.arange(1, 41, dtype=I32).reshape(4, 10), block_size=4)


def test_accepted_counts_outside_one_to_one_plus_k_name_the_row() -> None:
    """Item 1: a decode row's accepted count must lie in [1, 1 + num_speculative_tokens] (vLLM reads
    ``num_accepted_tokens[:num_decodes]``); the prefill rows' counts are not read."""
    spec, opts = _spec_decode_spec(), Mamba2Options(chunk_size=8, num_speculative_tokens=2)
    for counts, row in (([99, -5, 1, 1], 0), ([3, -5, 1, 1], 1), ([1, 2, 0, 1], 2), ([1, 2, 4, 1], 2)):
        msg = rf"num_accepted_tokens\[{row}\]={counts[row]} is outside \[1, 3\] \(row {row}, a decode row; 1 \+ Mamba2Options\.num_speculative_tokens=2\)"
        with pytest.raises(ValueError, match=msg):
            attnmeta.build(spec, STAGER, "mamba2", opts, Mamba2Inputs(num_accepted_tokens=np.array(counts, I32)))
        with pytest.raises(ValueError, match=msg), STAGER.step() as step:
            mamba.mamba2.stage(stage_common(spec, step, block_table_columns=8, token_arrays=False), step, opts,
                               Mamba2Inputs(num_accepted_tokens=counts))
    m = attnmeta.build(spec, STAGER, "mamba2", opts, Mamba2Inputs(num_accepted_tokens=np.array([1, 3, 2, 99], I32)))
    assert m.num_decodes == 3 and m.num_accepted_tokens_cpu.tolist() == [1, 3, 2]  # row 3 (a prefill): unread


@pytest.mark.parametrize("options_type", [Mamba2Options, Mamba1Options, LinearAttentionOptions])
def test_align_mode_with_a_mamba_block_smaller_than_the_block_size_is_refused(options_type: type) -> None:
    """Item 2: with ``cache_mode="align"`` the state column is ``(s - 1) // mamba_block_size``; a mamba
    block smaller than the block size puts it past the row's ``cdiv(s, block_size)`` blocks (a zero
    column: the null block). vLLM sets ``mamba_block_size = block_size`` in align mode."""
    spec = BatchSpec(num_computed_tokens=[9, 0], num_scheduled_tokens=[1, 7], block_table=[[5, 6, 0, 0], [7, 0, 0, 0]],
                     block_size=8)
    name = {Mamba2Options: "mamba2", Mamba1Options: "mamba1", LinearAttentionOptions: "linear_attn"}[options_type]
    opts = options_type(cache_mode="align", mamba_block_size=2)
    msg = (rf"{options_type.__name__}\.mamba_block_size=2 < block_size=8: cache_mode='align' reads the state of "
           r"column \(s - 1\) // mamba_block_size")
    with pytest.raises(ValueError, match=msg):
        attnmeta.build(spec, STAGER, name, opts)
    with pytest.raises(ValueError, match=msg), STAGER.step() as step:
        attnmeta.get_builder(name).stage(stage_common(spec, step, block_table_columns=4), step, opts)
    for ok in (8, 16, 24, None):  # at least the block size: a column the row's blocks cover
        m = attnmeta.build(spec, STAGER, name, options_type(cache_mode="align", mamba_block_size=ok))
        assert m is not None
    assert attnmeta.build(spec, STAGER, name, options_type(cache_mode="none", mamba_block_size=2)) is not None


def _eight_decodes(table: np.ndarray) -> BatchSpec:
    return BatchSpec(num_computed_tokens=np.arange(300, 380, 10, dtype=I32), num_scheduled_tokens=np.ones(8, I32),
                     block_table=table, block_size=128)


def test_cascade_prefix_blocks_the_rows_do_not_share_name_the_row_and_column() -> None:
    """Item 3: the shared prefix is row 0's first ``common_prefix_len // block_size`` blocks; every real
    row must hold the same blocks there (checked on the host over those columns)."""
    table = np.array([[3, 4, 10 + i, 20 + i] for i in range(8)], I32)
    opts = CascadeOptions(num_query_heads=8, num_kv_heads=8, num_sms=132)
    assert cascade.build(_eight_decodes(table), STAGER, opts, CascadeInputs(num_common_prefix_blocks=2)).use_cascade
    # 3 blocks offered, capped at the smallest context (300 tokens): 2 prefix columns, which they share
    assert cascade.build(_eight_decodes(table), STAGER, opts, CascadeInputs(num_common_prefix_blocks=3)).num_prefix_blocks == 2
    bad = table.copy()
    bad[5, 1] = 99
    msg = (r"num_common_prefix_blocks=2: block_table\[5, 1\]=99 != block_table\[0, 1\]=4; the 2 shared prefix "
           r"blocks \(common_prefix_len=256\) must be the same in every request \(row 5 differs\)")
    with pytest.raises(ValueError, match=msg):
        cascade.build(_eight_decodes(bad), STAGER, opts, CascadeInputs(num_common_prefix_blocks=2))
    with pytest.raises(ValueError, match=msg), STAGER.step() as step:
        cascade.stage(stage_common(_eight_decodes(bad), step), step, opts, CascadeInputs(num_common_prefix_blocks=2))
    assert cascade.build(_eight_decodes(bad), STAGER, opts, CascadeInputs(num_common_prefix_blocks=1)).num_prefix_blocks == 0
    # fewer than 8 requests never cascade, but a wrong count is still named
    few = BatchSpec(num_computed_tokens=[300, 400], num_scheduled_tokens=[1, 1], block_table=[[3, 4, 5, 6], [3, 9, 8, 7]],
                    block_size=128)
    with pytest.raises(ValueError, match=r"block_table\[1, 1\]=9 != block_table\[0, 1\]=4"):
        cascade.build(few, STAGER, opts, CascadeInputs(num_common_prefix_blocks=2))


def test_duplicate_logits_indices_name_the_position() -> None:
    """Item 4: the runner's logits indices are strictly increasing (each request's last tokens, once);
    a repeated index would count one token twice."""
    spec = BatchSpec(num_computed_tokens=[0, 0], num_scheduled_tokens=[4, 4], block_table=[[1], [2]], block_size=8)
    msg = r"logits_indices\[1\]=3 == logits_indices\[0\]=3; logits indices must be strictly increasing"
    with pytest.raises(ValueError, match=msg):
        attnmeta.build(spec, STAGER, "fast_prefill", None, FastPrefillInputs(logits_indices=[3, 3, 7]))
    with pytest.raises(ValueError, match=msg):
        fast_prefill_query_start_loc(np.array([0, 4, 8], I32), np.array([3, 3, 7], I32))
    with pytest.raises(ValueError, match=r"logits_indices\[2\]=2 < logits_indices\[1\]=7"):
        attnmeta.build(spec, STAGER, "fast_prefill", None, FastPrefillInputs(logits_indices=[3, 7, 2]))
    with pytest.raises(ValueError, match=r"logits_indices\[1\]=8 is outside \[0, query_start_loc_cpu\[-1\]=8\)"):
        attnmeta.build(spec, STAGER, "fast_prefill", None, FastPrefillInputs(logits_indices=[3, 8]))


def test_a_decode_threshold_below_one_is_refused_wherever_it_enters() -> None:
    """Item 5: with a threshold of 0 every row would be a prefill (none has a query of length <= 0)."""
    for threshold in (0, -1):
        msg = rf"decode_threshold: must be >= 1, got {threshold}"
        with pytest.raises(ValueError, match=msg):
            split_decodes_and_prefills([0, 1, 2], num_tokens=2, max_query_len=1, decode_threshold=threshold)
        with pytest.raises(ValueError, match=msg):
            split_decodes_prefills_and_extends([0, 1, 2], [3, 3], num_tokens=2, max_query_len=1,
                                               decode_threshold=threshold)
        with pytest.raises(ValueError, match=msg):
            reorder_decodes_and_prefills([1, 1], [1, 1], [1, 1], decode_threshold=threshold)
    with pytest.raises(TypeError, match="decode_threshold: expected an int, got bool"):
        split_decodes_and_prefills([0, 1], num_tokens=1, max_query_len=1, decode_threshold=True)


def test_wrong_input_types_name_the_input() -> None:
    """Item 6: a list where an int is expected, a float where an int is expected, a float array."""
    spec = SPECS[0]
    opts = CascadeOptions(num_query_heads=8, num_kv_heads=8, num_sms=132)
    with pytest.raises(TypeError, match=r"num_common_prefix_blocks: expected an int, got list \[2\]"):
        cascade.build(spec, STAGER, opts, CascadeInputs(num_common_prefix_blocks=[2]))
    with pytest.raises(TypeError, match=r"num_logits_padded: expected an int or None, got float 3\.0"):
        fast_prefill.build(spec, STAGER, None, FastPrefillInputs(logits_indices=[3, 7], num_logits_padded=3.0))
    with pytest.raises(TypeError, match=r"logits_indices: expected an integer array, got dtype float64"):
        fast_prefill.build(spec, STAGER, None, FastPrefillInputs(logits_indices=np.array([3.0, 7.0])))
    with pytest.raises(TypeError, match=r"flash_attn: options must be FlashAttentionOptions, got dict"):
        flash_attn.build(spec, STAGER, {"causal": True})  # type: ignore[arg-type]


def test_a_ragged_block_table_names_the_field_and_the_short_row() -> None:
    """Item 7: numpy's "inhomogeneous shape" error becomes one that names the field and the row."""
    with pytest.raises(ValueError, match=r"block_table: rows have different lengths \(row 1 has 1 entries, row 0 has 2 entries\); pass a rectangular"):
        BatchSpec(num_computed_tokens=[0, 0], num_scheduled_tokens=[4, 4], block_table=[[1, 2], [3]], block_size=8)
    with pytest.raises(ValueError, match=r"block_table: rows have different lengths \(row 2 has 3 entries, row 0 has 2 entries\)"):
        BatchSpec(num_computed_tokens=[0, 0, 0], num_scheduled_tokens=[4, 4, 4], block_table=[[1, 2], [3, 4], [5, 6, 7]],
                  block_size=8)
