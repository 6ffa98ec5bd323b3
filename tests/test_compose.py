"""The step composer (attnmeta.compose.StepBuilder): a replayed step equals the same step staged through
the builders' own ``stage``, field for field, for any set of registered builders over one or more groups
and the engine's arrays, in eager and graph mode; and its counts entry (``build_counts``, the scheduler's
arrays without a BatchSpec) equals ``build`` of the specs they make, its errors included."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from compose_helpers import assert_same, check_steps, compare_replays, composers, counts_arguments

from attnmeta import BatchSpec, Stager, StaticProfile, UnsupportedBatchError, stage_common
from attnmeta.backends.flash_attn import FLASH_ATTN, FlashAttentionInputs, FlashAttentionOptions
from attnmeta.backends.flashinfer import FLASHINFER, FlashInferOptions
from attnmeta.backends.mamba import CheckpointConfig, mamba2
from attnmeta.compose import Array, Group, StepBuilder, table_columns
from attnmeta.staging import CapacityError, StepExpiredError, bucket_rows, is_expired
from attnmeta.sync import no_device_sync
from attnmeta.testing.workloads import advance, decode_spec, mixed_spec

_PROFILE = StaticProfile(max_num_reqs=72, max_num_tokens=320, max_blocks_per_req=40, block_size=16)


def _hybrid_groups() -> list[Group]:
    """The reference engine's hybrid step: FlashInfer over the attention group, Mamba2 over a state group
    whose table has one column per block (table_column_step 1)."""
    return [Group({"fi": FLASHINFER}), Group({"mamba": (mamba2.MAMBA2, mamba2.Mamba2Options(chunk_size=16))},
                                             prefix="mamba_common", table_column_step=1)]


def _walk(batch: int, steps: int, seed: int = 0) -> list[BatchSpec]:
    return advance(decode_spec(batch, np.random.default_rng(seed), max_context=300, table_width=40), steps)


@pytest.mark.parametrize("profile", [None, _PROFILE], ids=["eager", "graph"])
def test_flash_attention_with_engine_arrays_replays_and_matches(device: torch.device, profile: Any) -> None:
    arrays = [Array("engine.input_ids", np.int32, capacity=_PROFILE.max_num_tokens, fill=0),
              Array("engine.prev_rows", np.int32, capacity=_PROFILE.max_num_tokens, fill=-1)]
    composer, reference, counts = composers(device, lambda: [Group({"fa": FLASH_ATTN})], arrays, profile)
    rng = np.random.default_rng(1)
    steps = []
    for spec in _walk(8, 20):
        n = spec.num_tokens
        steps.append((spec, None, {"engine.input_ids": rng.integers(0, 1000, n).astype(np.int32),
                                   "engine.prev_rows": rng.integers(-1, 8, n).astype(np.int32)}))
    check_steps(composer, reference, counts, steps)
    assert composer.stats.replayed >= 10, composer.stats


@pytest.mark.parametrize("groups", ["fi", "fi+common", "fi+mamba2"])
def test_graph_mode_unpadded_steps_of_any_counts_replay_one_layout(device: torch.device, groups: str) -> None:
    """Graph mode: the unpadded steps of a loop whose requests keep arriving (prompt chunks joining running
    decodes, every step of other request and token counts) replay one recorded layout per kind of step and
    ring slot (FlashInfer and Mamba2 key them without their counts: Builder.any_rows_key), and each equals the
    same step staged through the builders, every fixed buffer included, with the engine's arrays of the step's
    rows. ``fi+mamba2`` is a hybrid model's step: its Mamba group has blocks of its own size (one state block a
    request, the profile's longest request: StaticProfile.for_block_size) and chunks of 16 tokens."""
    arrays = [Array("engine.input_ids", np.int32, capacity=_PROFILE.max_num_tokens, fill=0)]
    profile = _PROFILE
    extra: list[Group] = []
    state_block = 16
    if groups == "fi+common":
        extra = [Group({}, prefix="plain", token_arrays=False)]
    elif groups == "fi+mamba2":
        profile = dataclasses.replace(_PROFILE, chunk_size=16)
        state_block = _PROFILE.max_blocks_per_req * _PROFILE.block_size
        extra = [Group({"mamba": (mamba2.MAMBA2, mamba2.Mamba2Options(chunk_size=16))}, prefix="mamba_common",
                       table_column_step=1)]
    composer, reference, counts = composers(device, lambda: [Group({"fi": FLASHINFER}), *extra], arrays, profile)
    rng = np.random.default_rng(7)
    steps = []
    for i in range(36):
        d = int(rng.integers(1, 40))
        p = 0 if i % 6 == 5 else int(rng.integers(1, 4))  # (now and then every request decodes, unpadded)
        c = np.concatenate([rng.integers(1, 300, d), rng.integers(0, 200, p)]).astype(np.int32)
        q = np.concatenate([np.ones(d, np.int32), rng.integers(1, 40, p)]).astype(np.int32)
        spec = BatchSpec(num_computed_tokens=c, num_scheduled_tokens=q, block_size=16,
                         num_prompt_tokens=np.where(np.arange(d + p) < d, np.minimum(c, 16), c + q + 10).astype(np.int32),
                         block_table=rng.integers(0, 5000, (d + p, 40)).astype(np.int32))
        other = (rng.permutation(100)[: d + p, None] + 1 if groups == "fi+mamba2" else spec.block_table[::-1]).astype(np.int32)
        specs = (spec, spec.for_group(block_table=other.copy(), block_size=state_block)) if extra else spec
        steps.append((specs, None, {"engine.input_ids": rng.integers(0, 1000, spec.num_tokens).astype(np.int32)}))
    assert len({(s[0] if extra else s).num_reqs for s, _i, _a in steps}) > 20  # (the counts change from step to step)
    check_steps(composer, reference, counts, steps)
    composed = len(steps) - composer.stats.replayed
    assert composed <= 2 * composer.stager.num_slots, composer.stats  # (one layout per kind and slot)


def test_graph_mode_hybrid_steps_of_one_decode_count_and_other_prompt_counts(device: torch.device) -> None:
    """Graph mode, a hybrid model's step (FlashInfer, and Mamba2 over state blocks of their own size): mixed
    steps with as many decodes and another number of prompt chunks replay one layout on each slot; the
    Mamba2 views of a replay are of its own split (its decode and prefill rows), not of the slot's last
    step with as many decodes (a view cache keyed by the decodes alone handed those out)."""
    profile = dataclasses.replace(_PROFILE, chunk_size=16)
    groups = [Group({"fi": FLASHINFER}), Group({"mamba": (mamba2.MAMBA2, mamba2.Mamba2Options(chunk_size=16))},
                                               prefix="mamba_common", table_column_step=1)]
    rng = np.random.default_rng(11)
    steps = []
    prompts = (1, 2, 3, 1, 3, 2, 2, 1, 3, 3, 1, 2)  # (each slot of three sees every prompt count)
    for p in prompts:
        d = 5
        c = np.concatenate([rng.integers(20, 200, d), rng.integers(0, 40, p)]).astype(np.int32)
        q = np.concatenate([np.ones(d, np.int32), rng.integers(2, 30, p)]).astype(np.int32)
        spec = BatchSpec(num_computed_tokens=c, num_scheduled_tokens=q, block_size=16,
                         block_table=rng.integers(0, 5000, (d + p, 40)).astype(np.int32))
        states = (1 + rng.permutation(50)[: d + p, None]).astype(np.int32)
        steps.append(((spec, spec.for_group(block_table=states, block_size=640)), None, None))
    composer = compare_replays(device, lambda: groups, steps, profile)
    assert composer.stats.replayed >= len(steps) - 2 * composer.stager.num_slots, composer.stats  # (the arena settles)
    # (the composers above share each layout's view cache with their reference: the rows, against the step's own)
    composer = StepBuilder(Stager(device, profile=profile), *groups)
    for ((attn, states), _i, _a), p in zip(steps, prompts):
        m = composer.build((attn, states))["mamba"]
        assert (m.num_decodes, m.num_prefills, m.num_reqs) == (5, p, 5 + p)
        assert m.state_indices_tensor_p.shape == m.has_initial_states_p.shape == m.last_chunk_indices_p.shape == (p,)
        assert m.state_indices_tensor_p_cpu.tolist() == states.block_table[5:, 0].tolist()
        assert m.query_start_loc_p_cpu.tolist() == [0, *np.cumsum(attn.num_scheduled_tokens[5:]).tolist()]
    assert composer.stats.replayed >= len(steps) - 2 * composer.stager.num_slots, composer.stats


def test_graph_mode_steps_of_other_counts_share_their_class_entry(device: torch.device,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """build_counts, graph mode: unpadded steps that differ in their counts only (a mixed step's decodes
    come and go; its prompt chunk is as long) find their key from one class entry, asked of the builders
    once (Builder.any_rows_key promises that neither the key nor needs reads the counts); a padded step is
    a class of its own."""
    composer = StepBuilder(Stager(device, profile=_PROFILE), Group({"fi": FLASHINFER}))
    asked = []
    entry = composer._class_entry
    monkeypatch.setattr(composer, "_class_entry", lambda *a: asked.append(1) or entry(*a))
    rng = np.random.default_rng(3)
    for d in range(3, 13):
        c = np.concatenate([rng.integers(1, 300, d), [40]]).astype(np.int32)
        q = np.concatenate([np.ones(d, np.int32), [5]]).astype(np.int32)
        composer.build_counts(c, q, [(rng.integers(0, 5000, (d + 1, 40)).astype(np.int32), 16)],
                              num_prompt_tokens=np.where(np.arange(d + 1) < d, 1, 60).astype(np.int32))
    assert len(asked) == 1 and composer.stats.replayed >= 10 - 2 * composer.stager.num_slots, composer.stats
    composer.build_counts(np.array([7, 9], np.int32), np.array([1, 1], np.int32), [(np.ones((2, 40), np.int32), 16)],
                          num_reqs_padded=4, num_tokens_padded=4)
    assert len(asked) == 2


def test_graph_mode_a_step_of_counts_past_the_profile_raises_as_a_composed_one(device: torch.device) -> None:
    """A step whose counts exceed the profile, of a class whose recorded layout serves any counts, is
    composed, so the error is the profile's, as for any step; the step is abandoned and the next one is
    served."""
    prof = StaticProfile(max_num_reqs=8, max_num_tokens=64, max_blocks_per_req=8, block_size=16)
    composer = StepBuilder(Stager(device, profile=prof), Group({"fi": FLASHINFER}))

    def step(d: int, chunk: int) -> Any:
        c = np.concatenate([np.full(d, 20), [0]]).astype(np.int32)
        q = np.concatenate([np.ones(d, np.int32), [chunk]]).astype(np.int32)
        return composer.build_counts(c, q, [(np.ones((d + 1, 8), np.int32), 16)],
                                     num_prompt_tokens=np.where(np.arange(d + 1) < d, 1, 90).astype(np.int32))

    for d in (3, 4, 5, 6, 5, 4, 3, 2):
        step(d, 7)
    assert composer.stats.replayed >= 4, composer.stats
    for d, chunk in ((9, 7), (3, 70)):  # (more requests, then more tokens, than the profile holds)
        with pytest.raises(CapacityError, match="exceeds the profile"):
            step(d, chunk)
    assert step(4, 7)["fi"].num_prefills == 1


def test_own_fields_of_a_builder_are_rewritten_on_replay(device: torch.device) -> None:
    """FlashAttention's DCP lengths and per-request causal flags are its own staged fields: a replay
    rewrites them for its step."""
    opts = FlashAttentionOptions(dcp_world_size=2, dcp_rank=1)
    composer, reference, counts = composers(device, lambda: [Group({"fa": (FLASH_ATTN, opts)})])
    rng = np.random.default_rng(2)
    steps = [(s, {"fa": FlashAttentionInputs(causal=rng.random(s.num_reqs) < 0.5)}, None) for s in _walk(6, 16)]
    check_steps(composer, reference, counts, steps)
    assert composer.stats.replayed >= 8, composer.stats


def test_a_replayed_mixed_step_rewrites_the_prefill_query_starts(device: torch.device) -> None:
    """Graph mode, FlashInfer: mixed steps of one shape whose prefill rows trade query lengths replay one
    layout; each replay must rewrite FlashInfer's own ``qo_indptr_prefill`` (a mutant that skipped it
    handed out the previous step's, and only 1,000-example oracle runs drew the case)."""
    prof = StaticProfile(max_num_reqs=8, max_num_tokens=64, max_blocks_per_req=8, block_size=4)
    composer, reference, counts = composers(device, lambda: [Group({"fi": FLASHINFER})], profile=prof)
    bt = [[1, 2, 3, 4]] * 3
    a = BatchSpec(num_computed_tokens=[5, 7, 0], num_scheduled_tokens=[1, 3, 5], block_table=bt, block_size=4,
                  num_reqs_padded=4, num_tokens_padded=16)
    b = BatchSpec(num_computed_tokens=[5, 5, 2], num_scheduled_tokens=[1, 5, 3], block_table=bt, block_size=4,
                  num_reqs_padded=4, num_tokens_padded=16)
    got = check_steps(composer, reference, counts, [(s, None, None) for s in (a, b, a, b, a)])
    assert composer.stats.replayed >= 1, composer.stats
    assert got[-1]["fi"].qo_indptr_prefill_cpu[:3].tolist() == [0, 3, 8]


def test_mixed_and_prefill_steps_between_decodes(device: torch.device) -> None:
    composer, reference, counts = composers(device, lambda: [Group({"fa": FLASH_ATTN})])
    rng = np.random.default_rng(3)
    walk = _walk(4, 12)
    steps = [(s, None, None) for s in walk[:6]]
    steps += [(mixed_spec(rng, prefills=2, decodes=3), None, None) for _ in range(3)]
    steps += [(s, None, None) for s in walk[6:]]
    check_steps(composer, reference, counts, steps)


@pytest.mark.parametrize("profile", [None, _PROFILE], ids=["eager", "graph"])
def test_a_mixed_layout_makes_its_pass_plan_at_its_first_replay(device: torch.device, profile: Any) -> None:
    """A mixed step's recorded layout (queries of many lengths: prompt chunks beside decodes) seldom comes
    back, so its compiled-pass plan is made at its first replay, not when it is recorded; a decode step's
    at once. Either way every replay equals the same step staged through the builders."""
    composer, reference, counts = composers(device, lambda: [Group({"fa": FLASH_ATTN}), Group({}, prefix="second")],
                                            profile=profile)
    mixed = BatchSpec(num_computed_tokens=[30, 50, 70, 0, 20], num_scheduled_tokens=[1, 1, 1, 13, 9],
                      num_prompt_tokens=[10, 10, 10, 40, 60], block_table=np.arange(1, 51).reshape(5, 10),
                      block_size=16)
    decode = _walk(4, 1)[0]
    slots = composer.stager.num_slots
    check_steps(composer, reference, counts, [((s, s.for_group(block_table=s.block_table, block_size=s.block_size)),
                                               None, None) for s in [mixed] * slots + [decode] * slots])

    def plans() -> list[Any]:
        found = []
        for slot in composer.stager._slots:  # (test-only: the composer's records on each ring slot)
            records = slot.extras.get(composer._token, {})
            found += [(r.passes is not False) for r in records.values()]
        return found

    first = plans()
    assert composer.stats.replayed == 0 and first.count(True) == slots, first  # (every decode layout planned)
    # (eager: every mixed layout recorded, unplanned; graph mode: the first step grew the arena, unrecorded)
    assert first.count(False) == (slots if profile is None else slots - 1), first
    specs = [(s, s.for_group(block_table=s.block_table, block_size=s.block_size)) for s in (mixed, decode)]
    check_steps(composer, reference, counts, [(sp, None, None) for sp in specs for _ in range(slots)])
    assert composer.stats.replayed == len(first), composer.stats  # (each recorded layout replayed once)
    if profile is None:
        assert plans() == [True] * (2 * slots)
    else:  # (the slot that had not recorded its mixed layout composed it again and recorded it, unplanned)
        assert sorted(plans()) == [False] + [True] * (2 * slots - 1)


def test_inputs_and_arrays_are_checked() -> None:
    composer = StepBuilder(Stager("cpu"), Group({"fa": FLASH_ATTN}), arrays=[Array("ids", np.int32)])
    spec = _walk(2, 1)[0]
    with pytest.raises(TypeError, match="arrays: expected exactly \\['ids'\\]"):
        composer.build(spec)
    with pytest.raises(TypeError, match="1-D numpy array of int32"):
        composer.build(spec, arrays={"ids": np.zeros(2, np.int64)})
    with pytest.raises(TypeError, match="arrays: expected exactly \\['ids'\\], got \\['idz'\\]"):  # (as many, named otherwise)
        composer.build(spec, arrays={"idz": np.zeros(2, np.int32)})
    with pytest.raises(TypeError, match="1-D numpy array of int32"):  # (an equal kind, another byte order)
        composer.build(spec, arrays={"ids": np.zeros(2, ">i4")})
    with pytest.raises(TypeError, match="1-D numpy array of int32"):
        composer.build(spec, arrays={"ids": np.zeros((2, 1), np.int32)})
    with pytest.raises(TypeError, match=r"arrays\['ids'\]: expected a 1-D numpy array of int32, got list \[1, 2\]$"):
        composer.build(spec, arrays={"ids": [1, 2]})  # (it ended in two blanks)
    graph = StepBuilder(Stager("cpu", profile=_PROFILE), Group({"fa": FLASH_ATTN}),
                        arrays=[Array("ids", np.int32, capacity=4)])
    with pytest.raises(ValueError, match="arrays\\['ids'\\]: 5 rows exceed the capacity 4"):
        graph.build(spec, arrays={"ids": np.zeros(5, np.int32)})
    with pytest.raises(TypeError, match="inputs: no builder named \\['nope'\\]"):
        composer.build(spec, {"nope": None}, {"ids": np.zeros(2, np.int32)})
    with pytest.raises(TypeError, match="flash_attn: inputs must be FlashAttentionInputs"):
        composer.build(spec, {"fa": {"causal": None}}, {"ids": np.zeros(2, np.int32)})
    with pytest.raises(ValueError, match="one BatchSpec per group"):
        composer.build([spec, spec], arrays={"ids": np.zeros(2, np.int32)})
    # (these were "'NoneType' object is not iterable", "spec: expected a BatchSpec, got str 'x'" and
    # "expected one BatchSpec per group (1), got 2")
    ids = {"ids": np.zeros(2, np.int32)}
    expected = r"specs: expected a BatchSpec, or a list or tuple of one BatchSpec per group \(1\), got "
    with pytest.raises(TypeError, match=expected + "NoneType"):
        composer.build(None, arrays=ids)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=expected + "dict"):
        composer.build({"x": spec}, arrays=ids)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=expected + "a list holding int"):
        composer.build([1, 2], arrays=ids)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="names must be unique across groups"):
        StepBuilder(Stager("cpu"), Group({"fa": FLASH_ATTN}), Group({"fa": FLASH_ATTN}, prefix="other"))
    with pytest.raises(ValueError, match="a graph-mode stager needs its capacity"):
        StepBuilder(Stager("cpu", profile=_PROFILE), Group({}), arrays=[Array("ids", np.int32)])


def test_an_unsupported_step_raises_and_the_stager_goes_on() -> None:
    composer = StepBuilder(Stager("cpu"), Group({"fa": FLASH_ATTN}))
    spec = _walk(3, 1)[0]
    with pytest.raises(UnsupportedBatchError, match="fa: cannot serve"):
        composer.build(spec, {"fa": FlashAttentionInputs(causal=[True])})
    assert composer.build(spec).common.num_reqs == 3


def test_table_columns_rounds_the_longest_request_up() -> None:
    spec = BatchSpec(num_computed_tokens=[70], num_scheduled_tokens=[1], block_table=[list(range(16))],
                     block_size=8)
    assert (table_columns(spec), table_columns(spec, 1), table_columns(spec, 4)) == (16, 9, 12)
    narrow = BatchSpec(num_computed_tokens=[70], num_scheduled_tokens=[1], block_table=[list(range(10))],
                       block_size=8)
    assert (table_columns(narrow), table_columns(narrow, 4)) == (10, 10)  # (the table's own width: never past it)


def test_an_eager_table_is_never_wider_than_the_spec_table() -> None:
    """A table of 10 columns, the longest request at 9 blocks then 10: the step-8 rounding would stage 16
    columns (6 of zeros); the composer stages the table's 10, and replays equal the composed steps."""
    table = np.arange(3 * 10, dtype=np.int32).reshape(3, 10)
    composer = StepBuilder(Stager("cpu"), Group({"fi": FLASHINFER, "fa": FLASH_ATTN}))
    reference = StepBuilder(Stager("cpu"), Group({"fi": FLASHINFER, "fa": FLASH_ATTN}))
    for k in range(24):
        spec = BatchSpec(num_computed_tokens=[20 + k, 130 + k, 5], num_scheduled_tokens=[1, 1, 1], block_table=table,
                         block_size=16)
        got = composer.build(spec)
        want = reference.build(spec)  # (same steps, same replays)
        assert got.common.block_table_cpu.shape == (3, 10)
        assert_same(got["fi"], want["fi"], "fi")
        assert_same(got["fa"], want["fa"], "fa")
        with Stager("cpu").step() as step:  # the composable path with table_columns: the same table
            staged = stage_common(spec, step, paged_kv=True, block_table_columns=table_columns(spec))
        assert np.array_equal(staged.result().block_table_cpu, got.common.block_table_cpu)
    assert composer.stats.replayed > 12


def test_one_copy_a_step_and_no_device_read() -> None:
    composer = StepBuilder(Stager("meta"), Group({"fa": FLASH_ATTN}), arrays=[Array("ids", np.int32)])
    with no_device_sync():
        for spec in _walk(4, 8):
            out = composer.build(spec, arrays={"ids": np.zeros(spec.num_tokens, np.int32)})
            assert out.step.stats.copies == 1
    assert composer.stats.replayed >= 4


@pytest.mark.parametrize("reads", [False, True], ids=["no-lengths", "lengths"])
def test_a_decode_walk_asks_its_builders_once_unless_they_read_the_lengths(reads: bool) -> None:
    """Builder.reads_lengths: the steps of a decode walk differ only in their lengths, so a composer asks
    builders that do not read them (replay_key, needs) about the walk's one class of shapes once; a
    builder that reads them is asked every step. Both replay, and equal the composed steps."""
    calls = {"replay_key": 0, "needs": 0}

    class Counting(type(FLASHINFER)):  # type: ignore[misc]
        def replay_key(self, shape: Any, options: Any, inputs: Any) -> Any:
            calls["replay_key"] += 1
            return super().replay_key(shape, options, inputs)

        def needs(self, shape: Any, options: Any) -> Any:
            calls["needs"] += 1
            return super().needs(shape, options)

        def reads_lengths(self, options: Any) -> bool:
            return reads

    composer = StepBuilder(Stager("cpu"), Group({"fi": Counting()}, table_column_step=1))
    reference = StepBuilder(Stager("cpu"), Group({"fi": FLASHINFER}, table_column_step=1))
    walk = _walk(4, 40)
    assert len({(s.max_exact_seq_len, s.num_pages) for s in walk}) == len(walk)  # (new lengths every step)
    for spec in walk:
        want = reference.build(spec)
        got = composer.build(spec)
        assert_same(got["fi"], want["fi"], "fi")
    assert composer.stats.replayed == reference.stats.replayed > len(walk) // 2
    steps_asked = len(walk) if reads else 1
    assert calls["replay_key"] == steps_asked
    composed = composer.stats.steps - composer.stats.replayed
    assert calls["needs"] == steps_asked + composed  # (and once a composed step, staging it)


def test_an_eager_layout_lasts_while_its_table_width_does_whatever_the_page_count(device: torch.device) -> None:
    """A decode walk of 64 requests whose longest sequence stays in one block-table width (16 columns of
    16 tokens) while the page count grows by about 4 a step, past several of bucket_rows' steps: the
    page indices are staged at the table's capacity, so each ring slot composes its first step and every
    later step replays (a layout keyed by the page count's bucket composed again at each new bucket, on
    each slot), equal to the steps staged through the builders."""
    rng = np.random.default_rng(3)
    c = rng.integers(130, 200, size=64).astype(np.int32)
    first = BatchSpec(num_computed_tokens=c, num_scheduled_tokens=np.ones(64, np.int32), block_table=(
        rng.permutation(64 * 16).astype(np.int32).reshape(64, 16)), block_size=16)
    walk = advance(first, 40)
    assert {-(-s.max_exact_seq_len // 16) for s in walk} <= {9, 10, 11, 12, 13, 14, 15, 16}  # (one width: 16)
    assert len({bucket_rows(s.num_pages) for s in walk}) >= 3  # (buckets the walk passes)
    composer = compare_replays(device, lambda: [Group({"fi": FLASHINFER, "fa": FLASH_ATTN})], walk)
    assert composer.stats.replayed == len(walk) - composer.stager.num_slots, composer.stats


def test_a_long_request_keeps_its_eager_table_width_longer() -> None:
    """Past 8 steps of columns the eager width rounds to an eighth of the next power of two: a walk whose
    longest request grows from 65 to 96 blocks (16-token blocks) stages 80 then 96 columns, two layouts
    a slot where multiples of 8 made four; each width holds the longest request with under a quarter
    more, and every step equals the same step staged through the builders."""
    rng = np.random.default_rng(5)
    c = np.concatenate([[64 * 16 + 1], rng.integers(200, 900, size=3)]).astype(np.int32)
    first = BatchSpec(num_computed_tokens=c, num_scheduled_tokens=np.ones(4, np.int32),
                      block_table=rng.permutation(4 * 128).astype(np.int32).reshape(4, 128), block_size=16)
    walk = advance(first, 500)
    needs = [-(-s.max_exact_seq_len // 16) for s in walk]
    assert (min(needs), max(needs)) == (65, 96)
    widths = [table_columns(s) for s in walk]
    assert sorted(set(widths)) == [80, 96] and all(n <= w < 1.25 * n for n, w in zip(needs, widths))
    assert len({-(-n // 8) for n in needs}) == 4  # (the multiples of 8 alone: four widths)
    composer = compare_replays(torch.device("cpu"), lambda: [Group({"fi": FLASHINFER, "fa": FLASH_ATTN})], walk)
    assert composer.stats.replayed == len(walk) - 2 * composer.stager.num_slots, composer.stats


def test_a_replayed_steps_objects_expire_with_their_slot() -> None:
    composer = StepBuilder(Stager("cpu", num_slots=2), Group({"fa": FLASH_ATTN}))
    walk = _walk(2, 6)
    outs = [composer.build(s) for s in walk]
    assert composer.stats.replayed >= 2
    with pytest.raises(StepExpiredError):
        _ = outs[-3]["fa"].seq_lens
    last = walk[-1]
    assert outs[-1]["fa"].seq_lens_cpu.tolist() == (last.num_computed_tokens + last.num_scheduled_tokens).tolist()


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_a_composed_step_expires_with_its_slot_arrays_included(graph: bool) -> None:
    """The engine's own arrays in a ComposedStep once read a newer step's values silently after the slot
    was reused (the builders' objects raised); the ComposedStep now expires with them, fresh or replayed."""
    stager = Stager("cpu", num_slots=2, profile=_PROFILE if graph else None)
    composer = StepBuilder(stager, Group({"fa": FLASH_ATTN}), arrays=[Array("engine.ids", np.int32, capacity=72)])
    walk = _walk(2, 6)
    outs = [composer.build(s, arrays={"engine.ids": np.full(2, k, np.int32)}) for k, s in enumerate(walk)]
    assert composer.stats.replayed >= 2
    expired = outs[:-1] if graph else outs[:-2]  # (graph mode: every step before the last commit)
    for out in expired:
        with pytest.raises(StepExpiredError, match=r"ComposedStep\.arrays"):
            _ = out.arrays
        with pytest.raises(StepExpiredError):
            _ = out["fa"]
    assert is_expired(outs[0]) and not is_expired(outs[-1])
    assert outs[-1].arrays["engine.ids"].tolist() == [5, 5]


def test_flashinfer_and_mamba2_groups(device: torch.device) -> None:
    """An attention group and a Mamba group (its own spec: one state block a request) in one step."""
    def groups() -> list[Group]:
        return [Group({"fa": FLASH_ATTN, "fi": (FLASHINFER, FlashInferOptions())}),
                Group({"mamba": (mamba2.MAMBA2, mamba2.Mamba2Options(chunk_size=16))}, prefix="mamba_common")]

    composer, reference, counts = composers(device, groups)
    steps = []
    for spec in _walk(5, 16):
        n = spec.num_reqs
        mspec = BatchSpec(num_computed_tokens=spec.num_computed_tokens, num_scheduled_tokens=spec.num_scheduled_tokens,
                          block_table=(1 + np.arange(n, dtype=np.int32))[:, None], block_size=4096)
        steps.append(((spec, mspec), None, None))
    check_steps(composer, reference, counts, steps)


def test_a_none_mode_decode_step_reads_its_state_slots_from_the_common_block_table(device: torch.device) -> None:
    """vLLM's "none" mode: ``state_indices_tensor_d`` is the first column of the Mamba group's block
    table (``block_table_tensor[:D, :1]``). An eager decode-only layout stages no field of its own for
    it, so a replayed step whose requests changed state slots reads the new ones."""
    def groups() -> list[Group]:
        return [Group({"fi": FLASHINFER}),
                Group({"mamba": (mamba2.MAMBA2, mamba2.Mamba2Options(chunk_size=16))}, prefix="mamba_common",
                      table_column_step=1)]

    composer, reference, counts = composers(device, groups)
    rng = np.random.default_rng(3)
    steps = []
    for spec in _walk(6, 16):
        n = spec.num_reqs
        slots = rng.permutation(64)[: n * 2].astype(np.int32).reshape(n, 2)  # (new slots every step; 2 columns)
        steps.append(((spec, spec.for_group(block_table=slots, block_size=4096)), None, None))
    built = check_steps(composer, reference, counts, steps)
    assert composer.stats.replayed >= 10, composer.stats
    for (specs, _i, _a), step in zip(steps[-2:], built[-2:]):  # (the slots of the last two steps are not reused yet)
        m, cm = step["mamba"], step.commons[1]
        assert m.num_decodes == specs[0].num_reqs and m.num_prefills == 0
        assert m.state_indices_tensor_d_cpu.tolist() == specs[1].block_table[:, :1].tolist()
        assert m.state_indices_tensor_d.cpu().tolist() == specs[1].block_table[:, :1].tolist()  # test-only read-back
        assert m.state_indices_tensor_d.data_ptr() == cm.block_table_tensor.data_ptr()  # a view, not a copy
        assert np.shares_memory(m.state_indices_tensor_d_cpu, cm.block_table_cpu)
        assert "mamba2.state_indices_tensor_d" not in step.step.layout().fields


@pytest.mark.parametrize("profile", [None, dataclasses.replace(_PROFILE, chunk_size=16)], ids=["eager", "graph"])
def test_a_replayed_step_writes_every_group_s_common_fields_in_one_compiled_call(
        device: torch.device, profile: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A replayed step of two groups (``build`` of specs made by ``for_group``, and ``build_counts``)
    writes both groups' common fields with one compiled call (``CommonPasses``), and equals the step
    staged through the builders. Tables of two compiled types (one read-only), and specs whose counts are
    arrays of their own, are written group by group, with the same result."""
    import attnmeta.common as common_module

    calls = {"passes": 0, "groups": 0}
    passes, group = common_module.common_passes_nb, common_module.CommonWriter.write_arrays

    def counted_passes(*a: Any) -> int:
        calls["passes"] += 1
        return passes(*a)  # type: ignore[no-any-return]

    def counted_group(self: Any, *a: Any, **k: Any) -> None:
        calls["groups"] += 1
        group(self, *a, **k)

    monkeypatch.setattr(common_module, "common_passes_nb", counted_passes)
    monkeypatch.setattr(common_module.CommonWriter, "write_arrays", counted_group)

    for case in ("for_group", "read-only table", "counts of its own"):
        composer, reference, counts = composers(device, _hybrid_groups, profile=profile)
        steps = []
        for spec in _walk(6, 12):
            if profile is not None:  # (padded to a captured size: unpadded steps of any counts share a layout
                # whose writer writes group by group, as test_graph_mode_unpadded_steps_of_any_counts_... checks)
                spec = BatchSpec(num_computed_tokens=spec.num_computed_tokens, num_scheduled_tokens=spec.num_scheduled_tokens,
                                 block_table=spec.block_table, block_size=spec.block_size, num_reqs_padded=8,
                                 num_tokens_padded=8)
            states = np.repeat((1 + np.arange(spec.num_reqs, dtype=np.int32))[:, None], spec.block_table.shape[1], 1)
            states.flags.writeable = case != "read-only table"
            other = (spec.for_group(block_table=states, block_size=16) if case != "counts of its own" else
                     BatchSpec(num_computed_tokens=spec.num_computed_tokens.copy(),
                               num_scheduled_tokens=spec.num_scheduled_tokens.copy(), block_table=states, block_size=16,
                               num_reqs_padded=spec.num_reqs_padded, num_tokens_padded=spec.num_tokens_padded))
            steps.append(((spec, other), None, None))
        calls.update(passes=0, groups=0)
        check_steps(composer, reference, counts, steps)
        replayed, built = composer.stats.replayed + counts.stats.replayed, 3 * len(steps)
        assert replayed >= 10, composer.stats
        if case == "read-only table":  # (a writable attention table beside a read-only state table: two types)
            assert calls == {"passes": 0, "groups": 2 * built}, calls
        elif case == "counts of its own":  # (build: group by group; build_counts: one set of counts)
            assert calls == {"passes": counts.stats.replayed, "groups": 2 * (built - counts.stats.replayed)}, calls
        else:  # (every composed step, the reference's all, writes group by group as it stages)
            assert calls == {"passes": replayed, "groups": 2 * (built - replayed)}, calls


@pytest.mark.parametrize("profile", [None, dataclasses.replace(_PROFILE, chunk_size=16)], ids=["eager", "graph"])
def test_two_groups_device_fields_hold_their_host_values_when_a_prefill_step_grows_the_layout(
        device: torch.device, profile: Any) -> None:
    """Decode steps, then prefill steps whose Mamba fields grow the layout (graph mode: new fields of the
    fixed arena) while the Mamba group's common fields come back from the slot's cache: every group's
    device fields hold the step's host values (before the staging fix, the Mamba group's query starts
    were the last decode step's)."""
    composer, reference, counts = composers(device, _hybrid_groups, profile=profile)
    walk, steps = _walk(6, 10), []
    for k, w in enumerate(walk):
        c, q, prompt = w.num_computed_tokens, w.num_scheduled_tokens, w.num_prompt_tokens
        if k >= 7:  # the first four rows decoding, two prefilling (one from scratch, one continuing)
            c = np.concatenate([c[:4], [0, 37 + k]]).astype(np.int32)
            q = np.array([1, 1, 1, 1, 20 + k, 33], np.int32)
            prompt = np.concatenate([c[:4], [40, 90]]).astype(np.int32)
        spec = BatchSpec(num_computed_tokens=c, num_scheduled_tokens=q, block_table=w.block_table, block_size=16,
                         num_prompt_tokens=prompt)
        states = np.repeat((1 + np.arange(6, dtype=np.int32))[:, None], w.block_table.shape[1], 1)
        steps.append(((spec, spec.for_group(block_table=states, block_size=16)), None, None))
    for i, step in enumerate(steps):
        (out,) = check_steps(composer, reference, counts, [step])
        for g, cm in enumerate(out.commons):
            for dev, host in (("query_start_loc", "query_start_loc_cpu"), ("seq_lens", "seq_lens_cpu"),
                              ("block_table_tensor", "block_table_cpu")):
                assert getattr(cm, dev).cpu().tolist() == getattr(cm, host).tolist(), f"step {i} group {g} {dev}"


def _mamba_specs(specs: list[BatchSpec]) -> list[BatchSpec]:
    """A Mamba group's specs of an attention walk: one state block a request (block size: the context)."""
    out = []
    for spec in specs:
        n = spec.num_reqs
        out.append(BatchSpec(num_computed_tokens=spec.num_computed_tokens, num_scheduled_tokens=spec.num_scheduled_tokens,
                             num_prompt_tokens=spec.num_prompt_tokens, block_table=(1 + np.arange(n, dtype=np.int32))[:, None],
                             block_size=4096, num_reqs_padded=spec.num_reqs_padded,
                             num_tokens_padded=spec.num_tokens_padded))
    return out


@pytest.mark.parametrize("profile", [None, StaticProfile(max_num_reqs=72, max_num_tokens=320, max_blocks_per_req=1,
                                                         block_size=4096, chunk_size=16)], ids=["eager", "graph"])
def test_a_mamba2_group_replays_decode_steps_and_composes_prefills(device: torch.device, profile: Any) -> None:
    opts = mamba2.Mamba2Options(chunk_size=16)
    composer, reference, counts = composers(device, lambda: [Group({"mamba": (mamba2.MAMBA2, opts)}, prefix="mamba_common")],
                                profile=profile)
    rng = np.random.default_rng(4)
    walk = _mamba_specs(_walk(6, 14))
    mixed = _mamba_specs([mixed_spec(rng, prefills=2, decodes=3, max_prompt=40, max_context=200) for _ in range(3)])
    steps = [(s, None, None) for s in [*walk[:7], *mixed, *walk[7:]]]
    check_steps(composer, reference, counts, steps)
    assert composer.stats.replayed >= 6, composer.stats


@pytest.mark.parametrize("profile", [None, StaticProfile(max_num_reqs=72, max_num_tokens=320, max_blocks_per_req=3,
                                                         block_size=4096, chunk_size=16)], ids=["eager", "graph"])
def test_a_mamba2_group_replays_spec_decode_steps(device: torch.device, profile: Any) -> None:
    """Spec decode: every row verifies 2 drafts (3 query tokens), the accepted counts change every step
    (inputs, not layout) and so do the splits when a row runs out of drafts; replays equal stage(). A
    state slot per draft position: three state columns a request."""
    opts = mamba2.Mamba2Options(chunk_size=16, num_speculative_tokens=2)
    composer, reference, counts = composers(device, lambda: [Group({"mamba": (mamba2.MAMBA2, opts)}, prefix="mamba_common")],
                                profile=profile)
    rng = np.random.default_rng(7)
    n, steps = 6, []
    computed = rng.integers(20, 200, n).astype(np.int32)
    table = 1 + np.arange(3 * n, dtype=np.int32).reshape(n, 3)
    for k in range(14):
        drafts = np.full(n, 2, np.int32)
        if k in (5, 6, 11):  # a row without drafts this step: a 1-token decode among the 3-token ones
            drafts[k % n] = 0
        spec = BatchSpec(num_computed_tokens=computed, num_scheduled_tokens=drafts + 1, num_draft_tokens=drafts,
                         num_prompt_tokens=np.full(n, 10, np.int32), block_table=table,
                         block_size=4096)
        accepted = np.minimum(rng.integers(1, 4, n), drafts + 1).astype(np.int32)
        steps.append((spec, {"mamba": mamba2.Mamba2Inputs(num_accepted_tokens=accepted)}, None))
        computed = computed + accepted
    check_steps(composer, reference, counts, steps)
    assert composer.stats.replayed >= 6, composer.stats


@pytest.mark.parametrize("profile", [None, _PROFILE], ids=["eager", "graph"])
def test_a_group_without_builders_stages_the_whole_common_metadata(device: torch.device, profile: Any) -> None:
    """An engine whose kernel has no builder (the reference engine's torch-paged kernel without cascade)
    reads ``positions`` and ``slot_mapping`` from the common metadata: a group without builders stages
    them, as ``stage_common`` does by default, fresh and replayed alike; ``token_arrays=False`` leaves
    them out."""
    composer, reference, counts = composers(device, lambda: [Group({})], profile=profile)
    built = check_steps(composer, reference, counts, [(s, None, None) for s in _walk(4, 8)])
    assert composer.stats.replayed >= 4, composer.stats
    spec = _walk(4, 8)[-1]  # (graph mode: only the last step is live)
    assert built[-1].common.positions.shape == built[-1].common.slot_mapping.shape == (spec.num_tokens,)
    bare = StepBuilder(Stager(device, profile=profile), Group({}, token_arrays=False)).build(_walk(4, 1)[0])
    assert bare.common.positions.shape == (0,) and bare.common.slot_mapping.shape == (0,)
    with pytest.raises(TypeError, match="token_arrays"):
        StepBuilder(Stager("cpu"), Group({}, token_arrays=1))  # type: ignore[arg-type]


def _error(call: Callable[[], Any]) -> tuple[type, str]:
    with pytest.raises(Exception) as info:
        call()
    return type(info.value), str(info.value)


def test_build_counts_raises_what_the_specs_raise() -> None:
    """Every broken rule of the counts, the tables and the padding, on a step that would replay and on a
    first step: ``build_counts`` raises the error ``build`` of the specs raises (the constructor's, naming
    the field, the row and the rule), and the stager goes on."""
    composer = StepBuilder(Stager("cpu", num_kv_blocks=64), *_hybrid_groups())
    reference = StepBuilder(Stager("cpu", num_kv_blocks=64), *_hybrid_groups())
    c, q = np.array([5, 9], np.int32), np.array([1, 1], np.int32)
    table, states = np.arange(8, dtype=np.int32).reshape(2, 4), np.array([[1], [2]], np.int32)

    def both(c: Any, q: Any, table: Any, states: Any, **kw: Any) -> None:
        got = _error(lambda: composer.build_counts(c, q, [(table, 4), (states, 64)], **kw))
        def specs() -> tuple[BatchSpec, BatchSpec]:
            spec = BatchSpec(num_computed_tokens=c, num_scheduled_tokens=q, block_table=table, block_size=4, **kw)
            return spec, spec.for_group(block_table=states, block_size=64)

        want = _error(lambda: reference.build(specs()))
        assert got == want

    for _ in range(4):  # the layout is recorded on every slot: the next steps would replay
        composer.build_counts(c, q, [(table, 4), (states, 64)])
    both(np.array([5, -1], np.int32), q, table, states)                       # a negative count
    both(c, np.array([1, -2], np.int32), table, states)                       # a negative query
    both(np.array([5, 40], np.int32), q, table, states)                       # the attention table too narrow
    both(np.array([5, 70], np.int32), q, np.arange(40, dtype=np.int32).reshape(2, 20), states)  # the states'
    both(c, q, np.array([[1, 99, 3, 4], [4, 5, 6, 7]], np.int32), states)     # a block id past num_kv_blocks
    both(c, q, table[:1], states)                                             # a table row short
    both(c, q, table, states, num_reqs_padded=1)                              # padding below the batch
    both(c, q, table, states, num_tokens_padded=1)
    both(c, q, table, states, num_prompt_tokens=np.array([3, -3], np.int32))
    both(c, q, table, states, num_draft_tokens=np.array([0, 2], np.int32))    # drafts past the query
    both(c, q, table, states, seq_lens_upper_bound=np.array([6, 3], np.int32))
    both([5, "x"], q, table, states)                                          # not integers (the slow path)
    both(c.astype(np.float32), q, table, states)
    with pytest.raises(TypeError, match="tables"):
        composer.build_counts(c, q, table)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="one BatchSpec per group"):
        composer.build_counts(c, q, [(table, 4)])
    out = composer.build_counts(c, q, [(table, 4), (states, 64)])  # the stager went on
    assert out["fi"].paged_kv_indices_cpu.tolist() == [0, 1, 4, 5, 6] and out.common.num_reqs == 2


def test_build_counts_takes_lists_and_other_dtypes_as_build_does() -> None:
    """Arguments a spec would convert (lists, int64 arrays, a table slice that is not contiguous) take
    the ordinary path and give the same step."""
    composer, reference = StepBuilder(Stager("cpu"), Group({"fa": FLASH_ATTN})), StepBuilder(Stager("cpu"),
                                                                                              Group({"fa": FLASH_ATTN}))
    wide = np.arange(24, dtype=np.int32).reshape(2, 12)
    got = composer.build_counts([5, 9], np.array([1, 1], np.int64), [(wide[:, ::2], 4)], num_reqs_padded=4)
    want = reference.build(BatchSpec(num_computed_tokens=[5, 9], num_scheduled_tokens=[1, 1], block_table=wide[:, ::2],
                                     block_size=4, num_reqs_padded=4))
    assert_same(got.metadata, want.metadata, "metadata")
    assert_same(got.commons, want.commons, "commons")


@pytest.mark.parametrize("profile", [None, dataclasses.replace(_PROFILE, chunk_size=16)], ids=["eager", "graph"])
def test_build_and_build_counts_find_each_other_s_layouts(device: torch.device, profile: Any) -> None:
    """``build`` keys a step by its specs' shapes, ``build_counts`` by its counts' scan (the scan's class,
    the scan without its lengths, then the lengths): on one composer, steps alternating between the two entries replay
    the layouts the other entry recorded on their ring slots, with every step's lengths new (a serving
    loop's decode walk), and equal the reference."""
    composer, reference, _counts = composers(device, _hybrid_groups, profile=profile)
    walk = _walk(6, 15)
    assert len({(s.max_seq_len, s.num_pages) for s in walk}) == len(walk)  # (no step's lengths repeat)
    slots = composer.stager.num_slots
    for k, spec in enumerate(walk):
        states = np.repeat((1 + np.arange(spec.num_reqs, dtype=np.int32))[:, None], spec.block_table.shape[1], 1)
        specs = (spec, spec.for_group(block_table=states, block_size=16))
        before = composer.stats.replayed
        if (k // slots) % 2:  # (each slot's previous step came through the other entry)
            args, kw = counts_arguments(specs)
            got = composer.build_counts(*args, **kw)
        else:
            got = composer.build(specs)
        want = reference.build(specs)
        if k >= 2 * slots:  # (a slot's first step grows it, and a step that grew records no layout)
            assert composer.stats.replayed == before + 1, f"step {k} was composed, not replayed"
        assert_same(got.commons, want.commons, f"step {k} commons")
        assert_same(got.metadata, want.metadata, f"step {k} metadata")


def test_build_counts_from_another_thread_never_changes_a_steps_group_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled scan wrote each extra group's block size, width and page count into one scratch array
    of the composer, before the stager's one-thread check: a second thread's scan between the first's
    scan and its read of them gave the first thread's step the other's group shapes (found by an
    adversarial review, 5 in about 300 steps of two threads): its step replayed the other's recorded
    layout. Here thread A pauses right after its compiled scan while the main thread composes a whole
    step of other shapes."""
    import threading

    import attnmeta.spec as spec_module

    composer = StepBuilder(Stager("cpu", num_slots=3), Group({"fi": FLASHINFER}),
                           Group({"fi2": (FLASHINFER, FlashInferOptions(prefix="fi2"))}, prefix="g2"))
    c, q = np.full(6, 300, np.int32), np.ones(6, np.int32)
    table = np.arange(6 * 40, dtype=np.int32).reshape(6, 40)
    mine, other = [(table, 16), (table.copy(), 16)], [(table, 16), (table[:, :10].copy(), 64)]
    real, scanned, done = spec_module._scan_nb, threading.Event(), threading.Event()

    def paused_scan(*args: Any) -> Any:
        out = real(*args)
        if threading.current_thread().name == "A":  # (before it reads its groups' scalars back)
            scanned.set()
            assert done.wait(10)
        return out

    for _ in range(3):  # every ring slot records a layout of each (a step of the other's shapes replays it)
        composer.build_counts(c, q, mine)
        composer.build_counts(c, q, other)
    monkeypatch.setattr(spec_module, "_scan_nb", paused_scan)
    got: dict[str, Any] = {}
    a = threading.Thread(target=lambda: got.update(a=composer.build_counts(c, q, mine)), name="A")
    a.start()
    assert scanned.wait(10)
    assert composer.build_counts(c, q, other)["fi2"].page_size == 64  # (the main thread's whole step)
    done.set()
    a.join(10)
    assert got["a"]["fi2"].page_size == 16 and got["a"]["fi2"].paged_kv_indptr_cpu[1] == 19  # cdiv(301, 16)


@pytest.mark.parametrize("profile", [None, dataclasses.replace(_PROFILE, chunk_size=16)], ids=["eager", "graph"])
def test_a_replayed_steps_nested_metadata_expires_with_it(profile: Any) -> None:
    """A replayed Mamba2 prefill step's ``checkpoint_meta`` (a metadata object inside the builder's) was
    never owned by the step: after its slot was reused it read the newer step's values instead of
    raising (found by an adversarial review; a composed step's expired)."""
    bs = 16
    ck = CheckpointConfig(hash_block_size=bs, cache_hit_alignment_tokens=bs, mamba_block_size=bs,
                          checkpoint_alignment=1)
    opts = mamba2.Mamba2Options(chunk_size=16, cache_mode="align", checkpoint=ck)
    composer = StepBuilder(Stager("cpu", num_slots=2, profile=profile),
                           Group({"m": (mamba2.MAMBA2, opts)}, table_column_step=1))
    table = np.arange(1, 13, dtype=np.int32).reshape(1, 12)
    kept = []
    for c in (0, 0, 0, 0, 16, 0, 48, 0):
        out = composer.build(BatchSpec(num_computed_tokens=[c], num_scheduled_tokens=[40], num_prompt_tokens=[190],
                                       block_table=table, block_size=bs))
        kept.append(out["m"].checkpoint_meta)
        assert kept[-1].cols_cpu.tolist() == [c // bs + 1]
    assert composer.stats.replayed >= 4, composer.stats
    for ckm in kept[:-2]:  # every step but the last two (2 slots): a later one claimed its memory
        assert is_expired(ckm)
        with pytest.raises(StepExpiredError):
            ckm.cols_cpu  # noqa: B018


def test_a_replayed_step_that_cannot_be_served_raises_unsupported_batch_error() -> None:
    """Wrong-length per-request inputs raised ``UnsupportedBatchError`` on a composed step but a plain
    ``ValueError`` from the builder's own check when the step replayed its slot's layout (an engine
    catching the documented error missed it on steady-state steps only)."""
    table = np.arange(1, 17, dtype=np.int32).reshape(2, 8)

    def spec(i: int) -> BatchSpec:
        return BatchSpec(num_computed_tokens=[20 + i, 30 + i], num_scheduled_tokens=[2, 2], num_draft_tokens=[1, 1],
                         block_table=table, block_size=16)

    cases = [
        ([Group({"fa": FLASH_ATTN})], "fa", FlashAttentionInputs(causal=[1, 1]), FlashAttentionInputs(causal=[1, 1, 1])),
        ([Group({"m": (mamba2.MAMBA2, mamba2.Mamba2Options(chunk_size=16, num_speculative_tokens=1))},
                table_column_step=1)], "m", mamba2.Mamba2Inputs(num_accepted_tokens=[1, 2]),
         mamba2.Mamba2Inputs(num_accepted_tokens=[1, 2, 1, 1, 1])),
    ]
    for groups, name, good, bad in cases:
        composer = StepBuilder(Stager("cpu", num_slots=2), *groups)
        for i in range(6):
            composer.build(spec(i), {name: good})
        assert composer.stats.replayed >= 2
        with pytest.raises(UnsupportedBatchError, match=f"{name}: cannot serve this batch"):
            composer.build(spec(2), {name: bad})
        args, kw = counts_arguments(spec(2))
        for i in range(6):
            composer.build(spec(i), {name: good})
        with pytest.raises(UnsupportedBatchError, match=f"{name}: cannot serve this batch"):
            composer.build_counts(*args, **kw, inputs={name: bad})
        composer.build(spec(3), {name: good})  # the stager goes on


def test_a_group_of_another_block_size_gets_its_own_width_in_graph_mode(device: torch.device) -> None:
    """Graph mode, a hybrid model's step as vLLM lays it out: the Mamba group's blocks hold the longest
    request (one column, StaticProfile.for_block_size), or Group(table_columns=) sets its width (vLLM's
    max_num_blocks_per_req: one state block and one per draft); a request past the width, or a bad
    width, raises."""
    prof = StaticProfile(max_num_reqs=8, max_num_tokens=64, max_blocks_per_req=8, block_size=16,
                         max_num_pages_override=20, chunk_size=16)
    wide = prof.for_block_size(8 * 16)
    assert (wide.max_blocks_per_req, wide.block_size, wide.max_num_pages, wide.max_num_reqs) == (1, 128, 8, 8)
    assert prof.for_block_size(16) is prof and prof.for_block_size(128) is wide
    assert prof.for_block_size(8).max_blocks_per_req == 16 and prof.for_block_size(8).max_num_pages == 48
    with pytest.raises(ValueError, match="for_block_size: block_size must be a positive int"):
        prof.for_block_size(0)
    spec = BatchSpec(num_computed_tokens=[30, 5], num_scheduled_tokens=[1, 9], block_size=16,
                     block_table=np.arange(16, dtype=np.int32).reshape(2, 8))
    for columns, width in ((None, 1), (3, 3)):
        mamba = Group({"mamba": (mamba2.MAMBA2, mamba2.Mamba2Options(chunk_size=16))}, prefix="mamba_common",
                      table_column_step=1, table_columns=columns)
        composer = StepBuilder(Stager(device, profile=prof), Group({"fi": FLASHINFER}), mamba)
        states = np.array([[5, 6, 7], [8, 9, 10]], np.int32)[:, :width]
        out = composer.build((spec, spec.for_group(block_table=states, block_size=128)))
        assert out.commons[1].block_table_cpu.shape == (2, width)
        assert composer.stager.graph_fields["mamba_common.block_table_tensor"].nbytes == 8 * width * 4
        assert out["mamba"].state_indices_tensor_p_cpu.tolist() == [8]  # (row 1 prefills: its state block)
        too_long = BatchSpec(num_computed_tokens=[200, 5], num_scheduled_tokens=[1, 9], block_size=16,
                             block_table=np.zeros((2, 16), np.int32))
        with pytest.raises(CapacityError):  # (the attention group's 8 columns: the profile's longest request)
            composer.build((too_long, too_long.for_group(block_table=np.ones((2, 3), np.int32), block_size=128)))
    with pytest.raises(ValueError, match=r"Group\.table_columns: expected an int >= 1 or None"):
        StepBuilder(Stager(device, profile=prof), Group({}, table_columns=0))
