"""MultiStager: one derivation per step, one copy per device, per-device metadata (CPU-simulated devices).

Several ``"cpu"`` entries stand for several devices: each has arenas of its own, so each device's
views are distinct memory, and the tests read them back to check that they hold the same bytes.
The CUDA half (two GPUs: streams, events, graphs, the race test) is tests/gpu/test_multi_cuda.py.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import attnmeta
from attnmeta import BatchSpec, StaticProfile, stage_common
from attnmeta.backends import flash_attn, flashinfer
from attnmeta.backends.fused import FusedStepBuilder
from attnmeta.common import CommonWriter
from attnmeta.staging import MultiStager, NotReplicableError, Stager, StepExpiredError, StepNotCommittedError
from attnmeta.staging.stager import is_expired
from attnmeta.sync import no_device_sync
from attnmeta.testing.lab import lab
from attnmeta.testing.multi import assert_replica
from attnmeta.testing.workloads import mixed_spec

PROFILE = StaticProfile(max_num_reqs=16, max_num_tokens=4096, max_blocks_per_req=256, block_size=16)


def _spec(rng: np.random.Generator) -> BatchSpec:
    return mixed_spec(rng, prefills=3, decodes=5, max_prompt=200, max_context=500)


# ------------------------------------------------------------------------------------------ structure
def test_devices_are_checked() -> None:
    with pytest.raises(TypeError, match="sequence of devices"):
        MultiStager("cpu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least one"):
        MultiStager([])
    with pytest.raises(ValueError, match="one type"):
        MultiStager(["cpu", "meta"])
    m = MultiStager(["cpu", "cpu", "cpu"])
    assert m.devices == (torch.device("cpu"),) * 3 and m.index(2) == 2
    with pytest.raises(ValueError, match="listed 3 times"):
        m.index("cpu")
    with pytest.raises(ValueError, match="not a position"):
        m.index(3)
    assert "MultiStager(devices=[cpu, cpu, cpu]" in repr(m)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_one_derivation_one_copy_per_device(graph: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Four simulated devices: each step runs the common pass once and copies once into each device;
    every device's metadata holds the primary's bytes in its own memory."""
    passes = [0]
    write = CommonWriter.write

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        passes[0] += 1
        return write(self, *args, **kwargs)

    monkeypatch.setattr(CommonWriter, "write", counted)
    multi = MultiStager(["cpu"] * 4, profile=PROFILE if graph else None)
    rng = np.random.default_rng(1)
    steps = 12
    for i in range(steps):
        spec = _spec(rng)
        with multi.step() as step:
            common = stage_common(spec, step, paged_kv=True)
            fa = flash_attn.stage(common, step)
            fi = flashinfer.stage(common, step)
        assert passes[0] == i + 1, "the host derivation runs once per step, whatever the device count"
        for k in range(1, 4):
            for staged in (common, fa, fi):
                assert assert_replica(staged.result(), multi.result(staged, k)) > 0
    assert [s.copies for s in multi.device_stats] == [steps] * 4
    assert len({s.bytes for s in multi.device_stats}) == 1
    assert multi.stats.copies == steps and multi.stats.waits == 0


def test_replicas_are_built_once_per_step_and_share_parts() -> None:
    multi = MultiStager(["cpu", "cpu"])
    spec = _spec(np.random.default_rng(2))
    with multi.step() as step:
        common = stage_common(spec, step, paged_kv=True)
        fa = flash_attn.stage(common, step)
        fi = flashinfer.stage(common, step)
    fa1, fi1 = multi.result(fa, 1), multi.result(fi, 1)
    assert multi.result(fa, 1) is fa1 and multi.view(fa.result(), 1) is fa1
    assert fa1.common is fi1.common is multi.result(common, 1), "a part shared on the primary is shared on the replica"
    assert multi.view(fa.result(), 0) is fa.result()
    t = step.device("common.seq_lens")
    t1 = multi.view(t, 1)
    assert torch.equal(t, t1) and t1.data_ptr() != t.data_ptr()
    host_only = fa.result().common.num_reqs
    assert multi.view(host_only, 1) == host_only


def test_replicas_expire_with_their_step() -> None:
    multi = MultiStager(["cpu", "cpu"], num_slots=2)
    spec = _spec(np.random.default_rng(3))
    with multi.step():
        pass
    first = attnmeta.build(spec, multi, "flash_attn")
    rep = multi.view(first, 1)
    attnmeta.build(spec, multi, "flash_attn")
    assert not is_expired(rep)
    attnmeta.build(spec, multi, "flash_attn")  # begins on the first one's slot
    assert is_expired(first) and is_expired(rep)
    with pytest.raises(StepExpiredError):
        _ = rep.query_start_loc
    with pytest.raises(StepExpiredError):
        multi.view(first, 1)


def test_views_before_commit_or_from_elsewhere_are_refused() -> None:
    multi = MultiStager(["cpu", "cpu"])
    with multi.step() as step:
        step.alloc("x", 4, np.int32)[:] = 1
        with pytest.raises(StepNotCommittedError):
            step.device("x")
    other = Stager("cpu")
    meta = attnmeta.build(_spec(np.random.default_rng(4)), other, "flash_attn")
    with pytest.raises(ValueError, match="another stager"):
        multi.view(meta, 1)
    with pytest.raises(NotReplicableError, match="not a view of the step's copy"):
        multi.view(torch.zeros(3, dtype=torch.int32), 1)


def test_device_computed_fields_are_refused() -> None:
    """FlashInfer's device gather runs when result() does, on the primary only: no replica of it."""
    multi = MultiStager(["cpu", "cpu"])
    spec = _spec(np.random.default_rng(5))
    meta = attnmeta.build(spec, multi, "flashinfer", flashinfer.FlashInferOptions(indices="device"))
    with pytest.raises(NotReplicableError, match=r"^FlashInferMetadata\.paged\.paged_kv_indices: .*computed it on the device"):
        multi.view(meta, 1)  # (the field named: the message gave only the tensor's shape and dtype)
    with pytest.raises(NotReplicableError, match=r"^list\[1\]\.paged\.paged_kv_indices: "):
        multi.view([meta.common, meta], 1)
    gmulti = MultiStager(["cpu", "cpu"], profile=PROFILE)
    gmeta = attnmeta.build(spec, gmulti, "flashinfer", flashinfer.FlashInferOptions(indices="device"))
    with pytest.raises(NotReplicableError, match="paged_kv_indices"):
        gmulti.view(gmeta, 1)


# ------------------------------------------------------------------------------------------ every builder
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_every_registered_builder_replicates(graph: bool) -> None:
    """Every registered builder, with its sampled options, through MultiStager: each device's
    metadata equals the primary's, in its own memory; only options that compute a field on the device
    at result() are refused."""
    rng = np.random.default_rng(6)
    profile = StaticProfile(max_num_reqs=16, max_num_tokens=4096, max_blocks_per_req=256, block_size=16)
    tried = refused = 0
    for builder in attnmeta.registry().values():
        for _ in range(3):
            spec = _spec(rng)
            opts, inputs = lab(builder).sample(spec, rng)
            if builder.unsupported_reasons(spec, builder.options(opts), builder.inputs(inputs)):
                opts, inputs = lab(builder).defaults(spec)
            multi = MultiStager(["cpu"] * 3, profile=profile if graph else None)
            try:
                meta = attnmeta.build(spec, multi, builder, opts, inputs)
            except ValueError:  # options a graph profile cannot serve (a chunk size other than its own)
                continue
            device_side = any(getattr(opts, a, None) == "device" for a in ("indices", "block_table"))
            tried += 1
            if device_side:
                with pytest.raises(NotReplicableError):
                    multi.view(meta, 1)
                refused += 1
                continue
            for k in (1, 2):
                assert_replica(meta, multi.view(meta, k))
    assert tried >= 2 * len(attnmeta.registry()) and refused < tried


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_fused_builder_on_several_devices(graph: bool) -> None:
    """FusedStepBuilder replays on MultiStager: each replayed step's replicas hold that step's bytes."""
    from attnmeta.bench.scenarios import decode_walks

    specs = dict(decode_walks(True))[8]
    multi = MultiStager(["cpu"] * 3, profile=StaticProfile(max_num_reqs=8, max_num_tokens=64, max_blocks_per_req=128,
                                                          block_size=16) if graph else None)
    builder = FusedStepBuilder(multi)
    for spec in specs[:20]:
        fs = builder.build(spec)
        for k in (1, 2):
            rep = multi.view(fs, k)
            assert type(rep) is type(fs)
            assert_replica(fs, rep)
    assert builder.stats.replayed > 0
    assert [s.copies for s in multi.device_stats] == [20] * 3


# ------------------------------------------------------------------------------------------ graph mode
def test_graph_mode_each_device_keeps_fixed_addresses() -> None:
    """Graph mode: each device has one arena; its full-capacity views keep their addresses across
    commits and hold each new step's bytes, sentinels included."""
    multi = MultiStager(["cpu"] * 3, profile=PROFILE)
    rng = np.random.default_rng(7)
    spec = _spec(rng)
    with multi.step() as step:
        stage_common(spec, step)
    multi.freeze()
    fulls = [multi.view(step.device_full("common.slot_mapping"), k) for k in range(3)]
    ptrs = [t.data_ptr() for t in fulls]
    assert len(set(ptrs)) == 3
    for _ in range(10):
        spec = _spec(rng)
        with multi.step() as step:
            stage_common(spec, step)
        now = [multi.view(step.device_full("common.slot_mapping"), k) for k in range(3)]
        assert [t.data_ptr() for t in now] == ptrs
        for k in range(1, 3):
            assert torch.equal(now[k], now[0])
        assert int(now[2][spec.num_tokens:].eq(-1).all()), "rows past the step hold the sentinel on every device"


def test_graph_layout_growth_reaches_every_device() -> None:
    """A field added before freeze() grows the layout: every device gets a new arena and a whole copy."""
    multi = MultiStager(["cpu", "cpu"], profile=PROFILE)
    with multi.step() as step:
        step.alloc("a", 3, np.int32, capacity=8, fill=-1)[:] = [1, 2, 3]
    with multi.step() as step:
        step.alloc("a", 2, np.int32, capacity=8, fill=-1)[:] = [4, 5]
        step.alloc("b", 2, np.int64, capacity=4, fill=7)[:] = [8, 9]
    for name in ("a", "b"):
        assert torch.equal(multi.view(step.device_full(name), 1), step.device_full(name))
    assert multi.view(step.device_full("a"), 1).tolist() == [4, 5, -1, -1, -1, -1, -1, -1]
    assert multi.view(step.device_full("b"), 1).tolist() == [8, 9, 7, 7]


def test_eager_slot_growth_reaches_every_device() -> None:
    multi = MultiStager(["cpu", "cpu"], num_slots=2, initial_bytes=256)
    for rows in (4, 5000, 10, 20000, 3):
        with multi.step() as step:
            step.alloc("x", rows, np.int64)[:] = np.arange(rows)
        rep = multi.view(step.device("x"), 1)
        assert torch.equal(rep, torch.arange(rows))
    assert multi.stats.grows > 0


# ------------------------------------------------------------------------------------------ audit
def test_views_read_no_device_data() -> None:
    """On meta devices (data-free) under the sync audit: committing to several devices and building
    every device's metadata reads nothing back."""
    multi = MultiStager(["meta", "meta", "meta"])
    builder = FusedStepBuilder(multi)
    spec = _spec(np.random.default_rng(8))
    with no_device_sync():
        for _ in range(4):
            fs = builder.build(spec)
            reps = [multi.view(fs, k) for k in (1, 2)]
    for r in reps:
        assert_replica(fs, r)
    assert [s.copies for s in multi.device_stats] == [4, 4, 4]


# ------------------------------------------------------------------------------------------------
# found by an adversarial review


def test_view_refuses_a_step_composers_result_and_replicates_its_parts() -> None:
    """``view(ComposedStep, d)`` returned the object itself: device 0's tensors as device 1's."""
    from attnmeta.compose import Group, StepBuilder

    multi = MultiStager(["cpu", "cpu"])
    spec = BatchSpec(num_computed_tokens=[5, 9], num_scheduled_tokens=[1, 1], block_table=[[1, 2, 3], [4, 5, 6]],
                     block_size=4)
    out = StepBuilder(multi, Group({"fa": attnmeta.get_builder("flash_attn")})).build(spec)
    with pytest.raises(TypeError, match=r"view\(\): attnmeta.compose.ComposedStep: .* view its .metadata"):
        multi.view(out, 1)
    twin = multi.view(out.metadata, 1)["fa"]
    assert twin.seq_lens.tolist() == [6, 10]
    assert twin.seq_lens.untyped_storage().data_ptr() != out["fa"].seq_lens.untyped_storage().data_ptr()


def test_replicas_in_a_container_of_two_steps_expire_each_with_its_own() -> None:
    """A container's replicas were all tied to its first object's step: the older step's replica outlived
    its step and read the newer step's bytes of the reused slot."""
    multi = MultiStager(["cpu", "cpu"], num_slots=3)

    def step(n: int) -> Any:
        spec = BatchSpec(num_computed_tokens=[n, n], num_scheduled_tokens=[1, 1], block_table=np.zeros((2, 40), np.int32),
                         block_size=16)
        return attnmeta.build(spec, multi, "flash_attn")

    old, new = step(100), step(200)
    twins = multi.view([new, old], 1)
    assert [t.seq_lens.tolist() for t in twins] == [[201, 201], [101, 101]]
    step(300)
    step(400)  # (reuses the old step's slot)
    assert is_expired(old) and is_expired(twins[1]) and not is_expired(twins[0])
    with pytest.raises(StepExpiredError):
        twins[1].seq_lens  # noqa: B018


def test_another_stagers_metadata_in_a_dict_is_named_as_such() -> None:
    """A dict of another stager's metadata got the message for a field a builder computed on the device."""
    multi = MultiStager(["cpu", "cpu"])
    spec = BatchSpec(num_computed_tokens=[9, 40], num_scheduled_tokens=[1, 1],
                     block_table=np.arange(16, dtype=np.int32).reshape(2, 8), block_size=16)
    attnmeta.build(spec, multi, "flash_attn")
    meta = attnmeta.build(spec, Stager("cpu"), "flash_attn")
    for obj in (meta, {"fa": meta}, [meta]):
        with pytest.raises(ValueError, match=r"view\(\): the object comes from a step of another stager"):
            multi.view(obj, 1)
    unleased = attnmeta.build(spec, Stager("cpu", check_lifetimes=False), "flash_attn")
    with pytest.raises(NotReplicableError, match=r"or it comes from another stager"):
        multi.view({"fa": unleased}, 1)
