"""Safety of a stager's steps: metadata objects expire with their step's memory, failed and abandoned
steps never leave a live step's memory changed, a spec is what it was constructed from, block ids are
checked against the KV cache's size, and one stager is driven by one thread at a time.

The first tests are the reproducers of the silent wrong results that motivated each rule; the last is
a hypothesis state machine over random sequences of builds, failed steps, abandoned steps, graph-mode
steps and reads of old metadata.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import attnmeta
from attnmeta import BatchSpec, Stager, StaticProfile, build_common, stage_common
from attnmeta.backends import flash_attn
from attnmeta.backends.fused import FusedStepBuilder
from attnmeta.builder import UnsupportedBatchError
from attnmeta.staging import CapacityError, StepExpiredError, is_expired
from attnmeta.testing import check_builder
from attnmeta.testing.lab import lab
from attnmeta.testing.strategies import batch_specs

TABLE = np.array([[10, 11], [20, 21], [30, 31]], np.int32)


def _spec(c: list[int], q: list[int], table: np.ndarray = TABLE, **kw: Any) -> BatchSpec:
    return BatchSpec(num_computed_tokens=np.array(c, np.int32), num_scheduled_tokens=np.array(q, np.int32),
                     block_table=table, block_size=4, **kw)


# ------------------------------------------------------------------------------------------ inputs
def test_a_spec_owns_its_vectors() -> None:
    """Reproducer: the caller's int32 arrays were kept by reference, so changing them after
    construction bypassed validation (a query start of [0, 0, 0, 6] with max_query_len 4, or an
    "internal status")."""
    q = np.array([1, 1, 4], np.int32)
    c = np.array([5, 7, 0], np.int32)
    spec = BatchSpec(num_computed_tokens=c, num_scheduled_tokens=q, block_table=TABLE.copy(), block_size=4)
    q[:] = [0, 0, 6]
    c[:] = [-1, -1, -1]
    m = flash_attn.build(spec, Stager("cpu"))
    assert m.common.query_start_loc_cpu.tolist() == [0, 1, 2, 6] and m.max_query_len == 4
    q[:] = [1, 1, 40]
    assert flash_attn.build(spec, Stager("cpu")).common.seq_lens_cpu.tolist() == [6, 8, 4]
    for name in ("num_computed_tokens", "num_scheduled_tokens"):
        with pytest.raises(ValueError, match="read-only"):
            getattr(spec, name)[0] = 3


def test_a_spec_owns_its_optional_vectors_too() -> None:
    p, d, u = np.array([9, 7, 4], np.int32), np.array([0, 0, 0], np.int32), np.array([6, 9, 4], np.int32)
    spec = _spec([5, 7, 0], [1, 1, 4], num_prompt_tokens=p, num_draft_tokens=d, seq_lens_upper_bound=u)
    p[:], d[:], u[:] = 0, 5, 1
    assert spec.num_prompt_tokens.tolist() == [9, 7, 4]
    assert spec.num_draft_tokens.tolist() == [0, 0, 0]
    assert spec.seq_lens_upper_bound.tolist() == [6, 9, 4]
    cm = build_common(spec, Stager("cpu"))
    assert cm.is_prefilling.tolist() == [True, False, True] and cm.seq_lens_cpu_upper_bound.tolist() == [6, 9, 4]


def test_a_block_table_changed_after_construction_is_checked_when_built() -> None:
    """The block table is read when the step is built: a used id made negative in between is a
    ValueError naming the entry, never a slot mapping through it."""
    table = TABLE.copy()
    spec = _spec([5, 7, 0], [1, 1, 4], table)
    table[1, 1] = -3
    stager = Stager("cpu")
    with pytest.raises(ValueError, match=r"block_table\[1, 1\]=-3 is negative .*request 1"):
        build_common(spec, stager)
    table[1, 1] = 21
    assert build_common(spec, stager).slot_mapping_cpu.tolist() == [45, 87, 120, 121, 122, 123]


@pytest.mark.parametrize("fused", [False, True])
def test_block_ids_past_the_cache_are_rejected(fused: bool) -> None:
    """Reproducer: a block id of 2**31 - 1 gave a slot of ~8.6e9 that a kernel would write through.
    With the cache's size on the stager, every used id at or past it is an error naming it."""
    table = TABLE.copy()
    table[2, 0] = 2**31 - 1
    spec = _spec([5, 7, 0], [1, 1, 4], table)
    stager = Stager("cpu", num_kv_blocks=64)
    build = FusedStepBuilder(stager).build if fused else (lambda s: build_common(s, stager))
    with pytest.raises(ValueError, match=r"block_table\[2, 0\]=2147483647 is past the KV cache's last block "
                                         r"\(num_kv_blocks=64\).*request 2"):
        build(spec)
    table[2, 0] = 64
    with pytest.raises(ValueError, match=r"block_table\[2, 0\]=64 is past"):
        build(spec)
    table[2, 0] = 63
    table[2, 1] = 99  # an unused column (request 2 has 4 tokens: one block) is never read
    for _ in range(4):  # (the fused builder: compose, then replay)
        got = build(spec)
    cm = got[0] if fused else got
    assert cm.slot_mapping_cpu.tolist() == [45, 87, 252, 253, 254, 255]
    with pytest.raises(ValueError, match="num_kv_blocks"):
        Stager("cpu", num_kv_blocks=0)


@pytest.mark.parametrize("threads", [1, 2])
def test_every_copy_path_checks_the_used_block_ids(threads: int) -> None:
    """The paged step checks the used ids among the page indices it copies (one rank, serial), or over
    the table's used columns (threads: the indices are copied after the compiled pass; no paged-KV
    layout): each path rejects a bad used id, naming it, and ignores a bad id in an unused column."""
    from attnmeta.compose import PARALLEL_MIN_ROWS

    n = PARALLEL_MIN_ROWS if threads > 1 else 5  # (threads copy from PARALLEL_MIN_ROWS rows)
    c = np.arange(n, dtype=np.int32) % 9
    table = (1 + np.arange(n * 4, dtype=np.int32)).reshape(n, 4)  # ids 1 .. 4n: request i uses cdiv(c + 1, 4)
    spec = BatchSpec(num_computed_tokens=c, num_scheduled_tokens=np.ones(n, np.int32), block_table=table, block_size=4)
    stager = Stager("cpu", num_kv_blocks=4 * n + 1)
    builder = FusedStepBuilder(stager, flash_attn=None, threads=threads)
    build = {"paged": builder.build, "unpaged": lambda s: build_common(s, stager)}
    for name, run in build.items():
        for _ in range(4):  # (the fused builder: compose, then replay, with the threads it was given)
            run(spec)
        assert name == "unpaged" or builder.stats.replayed == 1
        row = n - 2  # c = (n - 2) % 9, one or two blocks used of 4
        used = -(-int(c[row] + 1) // 4)
        table[row, used] = -7  # unused: never read
        run(spec)
        for bad, why in ((-7, "is negative"), (4 * n + 1, r"is past the KV cache's last block")):
            table[row, used - 1] = bad
            with pytest.raises(ValueError, match=rf"block_table\[{row}, {used - 1}\]={bad} {why}"):
                run(spec)
            table[row, used - 1] = 1
        table[row, used] = 1


def test_bad_scalars_of_a_spec() -> None:
    """Reproducer: ``block_size=True`` was taken as 1."""
    with pytest.raises(TypeError, match="block_size: expected a positive int, got bool True"):
        _spec([1], [1], TABLE[:1], ).__class__(num_computed_tokens=[1], num_scheduled_tokens=[1],
                                               block_table=[[1]], block_size=True)
    with pytest.raises(TypeError, match="num_reqs_padded: expected an int or None, got bool"):
        _spec([1], [1], TABLE[:1], num_reqs_padded=True)
    with pytest.raises(ValueError, match="block_size: 1099511627776 overflows int32"):
        BatchSpec(num_computed_tokens=[1], num_scheduled_tokens=[1], block_table=[[1]], block_size=2**40)


def test_a_page_count_past_int32_is_refused() -> None:
    """Reproducer: a step whose pages overflow int32 was staged with an int32 paged_kv_indptr. (No
    table that fits in memory reaches 2**31 pages, so the spec's count is set by hand here.)"""
    spec = _spec([5, 7, 0], [1, 1, 4])
    object.__setattr__(spec, "num_pages", 2**31)
    with pytest.raises(ValueError, match=r"2147483648 KV pages overflow paged_kv_indptr's int32"), \
            Stager("cpu").step() as step:
        stage_common(spec, step, paged_kv=True)


def test_split_refuses_a_decode_threshold_below_one() -> None:
    """Reproducer: ``decode_threshold`` 0 or negative made every row a prefill."""
    with Stager("cpu").step() as step:
        host = stage_common(_spec([5, 7, 0], [1, 1, 4]), step).host
    for bad in (0, -1, True):
        with pytest.raises(ValueError, match="decode_threshold must be an int >= 1"):
            host.split(bad)
    assert host.split(1).num_decodes == 2


def test_wrong_stager_arguments() -> None:
    with pytest.raises(TypeError, match=r"device: expected a torch\.device or a str"):
        Stager(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'gpu' is not a device"):
        Stager("gpu")
    with pytest.raises(TypeError, match="num_slots: expected an int"):
        Stager("cpu", num_slots=2.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="profile: expected a StaticProfile"):
        Stager("cpu", profile={"max_num_reqs": 4})  # type: ignore[arg-type]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a CUDA device")
def test_a_cuda_stager_without_a_gpu_says_so() -> None:
    """Reproducer: ``Stager("cuda")`` without a GPU gave torch's bare AssertionError."""
    with pytest.raises(ValueError, match=r"no CUDA device is available .*Stager\('cpu'\)"):
        Stager("cuda")


# --------------------------------------------------------------------------------------- lifetimes
def test_expired_metadata_raises_on_every_field() -> None:
    """Reproducer: a metadata object whose ring slot was reused read the newest step's values."""
    stager = Stager("cpu", num_slots=3)
    a = build_common(_spec([5, 7], [1, 1], TABLE[:2]), stager)
    kept = [build_common(_spec([1, 2], [1, 1], TABLE[:2]), stager) for _ in range(2)]
    assert a.seq_lens_cpu.tolist() == [6, 8] and a.seq_lens.tolist() == [6, 8]  # 2 later steps: still live
    build_common(_spec([1, 2], [1, 1], TABLE[:2]), stager)  # step 4 begins on step 1's slot
    for name in ("seq_lens", "seq_lens_cpu", "query_start_loc", "num_reqs", "max_seq_len"):
        with pytest.raises(StepExpiredError, match=r"CommonAttentionMetadata\.\w+: step 1 \(ring slot 0 of 3\) "
                                                   r"has expired: step 4 began on that slot"):
            getattr(a, name)
    assert is_expired(a) and not any(is_expired(k) for k in kept)
    assert "expired CommonAttentionMetadata" in repr(a)
    assert isinstance(a, attnmeta.CommonAttentionMetadata)


def test_nested_and_derived_objects_expire_with_their_step() -> None:
    stager = Stager("cpu", num_slots=2)
    fi = attnmeta.build(_spec([5, 7, 0], [1, 1, 4]), stager, "flashinfer")
    trimmed = fi.common.unpadded(2, 1)
    swapped = fi.common.replace(causal=False)
    with stager.step() as step:
        host_part = stage_common(_spec([1], [1], TABLE[:1]), step).host
    assert trimmed.seq_lens_cpu.tolist() == [6] and not swapped.causal
    build_common(_spec([1], [1], TABLE[:1]), stager)
    for obj in (fi, trimmed, swapped):
        assert is_expired(obj)
    with pytest.raises(StepExpiredError):
        _ = fi.paged_kv_indices
    assert not is_expired(host_part)
    build_common(_spec([1], [1], TABLE[:1]), stager)
    with pytest.raises(StepExpiredError, match=r"CommonHost\.seq_lens_cpu"):
        _ = host_part.seq_lens_cpu


def test_the_nested_parts_of_an_expired_object_expire() -> None:
    stager = Stager("cpu", num_slots=2)
    fi = attnmeta.build(_spec([5, 7, 0], [1, 1, 4]), stager, "flashinfer")
    common, paged = fi.common, fi.paged
    for _ in range(2):
        build_common(_spec([1], [1], TABLE[:1]), stager)
    assert is_expired(fi) and is_expired(common) and is_expired(paged)


def test_an_abandoned_step_never_leaves_a_live_step_mixed() -> None:
    """Reproducer: after a step that raised inside stage_common, an object built two commits earlier
    had seq_lens_cpu [1, 8] (the failed step's) while its seq_lens was [6, 8]. The failed step claimed
    that object's slot when it began: the object is expired, and every live one is intact."""
    stager = Stager("cpu", num_slots=2, num_kv_blocks=40)
    a = build_common(_spec([5, 7], [1, 1], TABLE[:2]), stager)
    b = build_common(_spec([2, 3], [1, 1], TABLE[:2]), stager)
    bad = TABLE[:2].copy()
    bad[1, 1] = 50  # past the cache: the common pass fails after writing some of its fields
    with pytest.raises(ValueError, match="past the KV cache"):
        build_common(_spec([0, 7], [1, 1], bad), stager)
    assert is_expired(a)
    with pytest.raises(StepExpiredError, match="step 3 began on that slot"):
        _ = a.seq_lens_cpu
    assert b.seq_lens_cpu.tolist() == b.seq_lens.tolist() == [3, 4]


def test_an_abandoned_graph_step_leaves_no_garbage_past_the_next_commit() -> None:
    """Graph mode: rows an abandoned step wrote past what its slot's last commit staged hold the
    sentinel again after the slot's next commit (they were copied as written)."""
    stager = Stager("cpu", num_slots=2, profile=StaticProfile(max_num_reqs=8, max_num_tokens=8,
                                                              max_blocks_per_req=2, block_size=4))

    def stage(rows: int, value: int, abandon: bool = False) -> None:
        step = stager.step()
        step.alloc("x", rows, np.int32, capacity=8, fill=-1)[:] = value
        step.abandon() if abandon else step.commit()

    stage(2, 1)  # slot 0
    stage(2, 2)  # slot 1
    stage(6, 9, abandon=True)  # slot 0: rows 2..5 hold 9 in its pinned bytes
    stage(6, 4)  # slot 1: the copy now spans 6 rows
    stage(2, 5)  # slot 0
    arena, f = stager.graph_arena, stager.graph_fields["x"]
    assert arena is not None
    assert arena[f.offset: f.offset + 32].view(torch.int32).tolist() == [5, 5, -1, -1, -1, -1, -1, -1]


def test_graph_mode_metadata_expires_at_the_next_commit() -> None:
    prof = StaticProfile(max_num_reqs=4, max_num_tokens=8, max_blocks_per_req=2, block_size=4)
    stager = Stager("cpu", profile=prof)
    a = build_common(_spec([5, 7], [1, 1], TABLE[:2]), stager)
    step = stager.step()
    stage_common(_spec([1, 2], [1, 1], TABLE[:2]), step)
    assert a.seq_lens.tolist() == [6, 8]  # not yet committed: the arena still holds step 1
    step.commit()
    with pytest.raises(StepExpiredError, match=r"step 1 \(graph mode, ring slot 0\) has expired: step 2 committed"):
        _ = a.seq_lens
    b = build_common(_spec([1, 2], [1, 1], TABLE[:2]), stager)
    with stager.step() as failed:  # an abandoned step does not touch the arena: b stays live
        failed.alloc("common.seq_lens", 2, np.int32)[:] = 99
        failed.abandon()
    assert b.seq_lens.tolist() == [2, 3]


def test_lifetime_checks_can_be_turned_off() -> None:
    stager = Stager("cpu", num_slots=2, check_lifetimes=False)
    a = build_common(_spec([5, 7], [1, 1], TABLE[:2]), stager)
    for _ in range(2):
        build_common(_spec([1, 2], [1, 1], TABLE[:2]), stager)
    assert not is_expired(a) and a.seq_lens_cpu.tolist() == [2, 3]  # the newer step's bytes: the caller's risk


def test_step_own_after_expiry_raises() -> None:
    stager = Stager("cpu", num_slots=2)
    with stager.step() as first:
        pass
    for _ in range(2):
        with stager.step():
            pass
    assert first.expired and "step 3 began" in first.expiry()
    with pytest.raises(StepExpiredError):
        first.own(object())


# ----------------------------------------------------------------------------------------- threads
def test_a_second_threads_step_names_both_threads() -> None:
    stager = Stager("cpu")
    step = stager.step()
    errors: list[BaseException] = []

    def other() -> None:
        try:
            stager.step()
        except RuntimeError as e:
            errors.append(e)

    t = threading.Thread(target=other, name="scheduler-2")
    t.start()
    t.join()
    assert len(errors) == 1
    msg = str(errors[0])
    assert "'scheduler-2'" in msg and f"'{threading.current_thread().name}'" in msg and "one thread at a time" in msg
    step.commit()
    handed = threading.Thread(target=lambda: build_common(_spec([1], [1], TABLE[:1]), stager))
    handed.start()  # handing the stager over between steps is fine
    handed.join()
    assert stager.stats.steps == 2


# ----------------------------------------------------------------------------------- state machine
_PROFILE = StaticProfile(max_num_reqs=8, max_num_tokens=64, max_blocks_per_req=24, block_size=16, chunk_size=16)
_SPECS = batch_specs(max_reqs=6, max_query_len=8, max_context_len=300, block_sizes=st.just(16),
                     kinds=("decode", "prefill", "chunked_prefill", "empty", "spec_decode"))


def _snapshot(obj: Any) -> dict[str, Any]:
    """Every field's value, copied to the host (what the object must still read while it is live)."""
    out: dict[str, Any] = {}
    for f in obj.__dataclass_fields__:
        v = getattr(obj, f)
        if isinstance(v, torch.Tensor):
            out[f] = v.cpu().clone()
        elif isinstance(v, np.ndarray):
            out[f] = v.copy()
        elif hasattr(v, "__dataclass_fields__"):
            out[f] = _snapshot(v)
        elif not isinstance(v, dict):
            out[f] = v
    return out


def _same(obj: Any, snap: dict[str, Any], where: str) -> None:
    for f, want in snap.items():
        got = getattr(obj, f)
        if isinstance(want, torch.Tensor):
            assert torch.equal(got.cpu(), want), f"{where}.{f}"
        elif isinstance(want, np.ndarray):
            assert np.array_equal(got, want), f"{where}.{f}"
        elif isinstance(want, dict):
            _same(got, want, f"{where}.{f}")
        else:
            assert got == want, f"{where}.{f}"


class StagerLifetimes(RuleBasedStateMachine):
    """A stager driven by random builds (every registered builder, the fused builder), failed steps,
    abandoned steps and reads of old metadata, in eager or graph mode. The model knows each object's
    step number: an object is live while fewer than ``num_slots`` steps have begun after its own and
    (graph mode) no later step has committed. Invariant: every live object reads exactly what it read
    when it was built (checked against the builder's reference then), every expired one raises."""

    def __init__(self) -> None:
        super().__init__()
        self.kept: list[tuple[Any, dict[str, Any], int]] = []  # (object, snapshot, its step's number)
        self.last_commit = 0

    @initialize(graph=st.booleans(), num_slots=st.integers(2, 4))
    def make(self, graph: bool, num_slots: int) -> None:
        self.graph = graph
        self.stager = Stager("cpu", num_slots=num_slots, num_kv_blocks=2000, profile=_PROFILE if graph else None)
        self.fused = FusedStepBuilder(self.stager)

    def _live(self, number: int) -> bool:
        begun = self.stager.stats.steps_begun
        return begun - number < self.stager.num_slots and (not self.graph or self.last_commit == number)

    def _keep(self, obj: Any) -> None:
        number = self.stager.stats.steps_begun
        self.last_commit = number
        self.kept = [*self.kept, (obj, _snapshot(obj), number)][-12:]

    @rule(data=st.data())
    def build(self, data: st.DataObject) -> None:
        spec = data.draw(_SPECS)
        name = data.draw(st.sampled_from(sorted(attnmeta.registry())))
        b = attnmeta.get_builder(name)
        options, inputs = lab(b).sample(spec, np.random.default_rng(data.draw(st.integers(0, 99))))
        if self.graph and hasattr(options, "chunk_size"):
            options = type(options)(**{**{f: getattr(options, f) for f in options.__dataclass_fields__},
                                       "chunk_size": _PROFILE.chunk_size})
        before = self.stager.stats.steps_begun
        try:  # the object is right when built: every field its reference names
            obj = check_builder(b, spec, "cpu", options, inputs, stager=self.stager)
        except (UnsupportedBatchError, CapacityError, ValueError):
            return  # (a failure before the step began, or an abandoned step: the model reads steps_begun)
        assert self.stager.stats.steps_begun == before + 1
        self._keep(obj)

    @rule(data=st.data())
    def fused_build(self, data: st.DataObject) -> None:
        spec = data.draw(_SPECS)
        try:
            out = self.fused.build(spec)
        except (CapacityError, ValueError):
            return
        self._keep(out.common)

    @rule(data=st.data())
    def failed_step(self, data: st.DataObject) -> None:
        """A step whose common pass fails (a block id past the cache) after writing some fields."""
        spec = data.draw(_SPECS.filter(lambda s: s.num_tokens > 0))
        table = spec.block_table.copy()
        table[np.flatnonzero(spec.num_scheduled_tokens)[0], 0] = 5000
        bad = BatchSpec(num_computed_tokens=spec.num_computed_tokens, num_scheduled_tokens=spec.num_scheduled_tokens,
                        block_table=table, block_size=spec.block_size)
        with pytest.raises((ValueError, CapacityError)):
            build_common(bad, self.stager)

    @rule(rows=st.integers(1, 8))
    def abandoned_step(self, rows: int) -> None:
        """A step that writes garbage over the common fields' bytes, then is abandoned."""
        step = self.stager.step()
        try:
            cap = {"capacity": 64} if self.graph else {}
            step.alloc("common.slot_mapping", rows, np.int64, **cap)[:] = 12345
            step.alloc("junk", 256, np.int32, **({"capacity": 256} if self.graph else {}))[:] = -7
        except CapacityError:
            pass  # graph mode after freeze-like growth limits: the step is abandoned all the same
        step.abandon()

    @precondition(lambda self: bool(self.kept))
    @invariant()
    def old_metadata_is_intact_or_raises(self) -> None:
        for i, (obj, snap, number) in enumerate(self.kept):
            if self._live(number):
                assert not is_expired(obj), f"kept {i} (step {number}) expired early"
                _same(obj, snap, f"kept {i} (step {number})")
            else:
                assert is_expired(obj), f"kept {i} (step {number}) should have expired"
                with pytest.raises(StepExpiredError):
                    getattr(obj, next(iter(snap)))


TestStagerLifetimes = StagerLifetimes.TestCase
TestStagerLifetimes.settings = settings(  # (max_examples from the loaded profile: dev 50, ci 100, thorough 1000)
    stateful_step_count=20, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


def test_stage_common_names_wrong_arguments() -> None:
    with Stager("cpu").step() as step:
        with pytest.raises(TypeError, match="spec: expected a BatchSpec, got NoneType"):
            stage_common(None, step)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"step: expected an open attnmeta\.Step"):
            stage_common(_spec([1], [1], TABLE[:1]), Stager("cpu"))  # type: ignore[arg-type]


def test_a_dropped_stager_is_freed() -> None:
    """The ring slots know their last step only weakly: a stager nobody holds is collected (its
    finalizer holds the slots, so a strong slot -> step -> stager path would make it immortal)."""
    import gc
    import weakref

    for graph in (False, True):
        stager = Stager("cpu", num_slots=2, profile=_PROFILE if graph else None)
        for _ in range(3):
            build_common(BatchSpec(num_computed_tokens=[5, 7], num_scheduled_tokens=[1, 1],
                                   block_table=np.zeros((2, 24), np.int32), block_size=16), stager)
        ref = weakref.ref(stager)
        del stager
        gc.collect()
        assert ref() is None
