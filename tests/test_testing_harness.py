"""The test toolkit's comparisons catch what they claim to: a device field that holds a host array, a
declared host twin, a field the object lacks, a nested part's missing fields, scalars of another kind.

Each of these once passed silently (found by a review that planted the bugs in a builder of its own).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, ClassVar

import numpy as np
import pytest
import torch

import attnmeta
from attnmeta import BatchSpec, Stager, StaticProfile
from attnmeta.backends.flash_attn import FlashAttentionBuilder, FlashAttentionInputs
from attnmeta.backends.flashinfer import FlashInferBuilder, host_tensor
from attnmeta.backends.local_attn import LocalAttentionOptions
from attnmeta.builder import Builder, CommonNeeds, MetadataBase, Replayer
from attnmeta.metadata import StagedCommon
from attnmeta.spec import StepShape
from attnmeta.staging import Staged, Step
from attnmeta.testing import builders, check_any_rows_key, check_builder, check_metadata, check_reads_lengths
from attnmeta.testing.builders import _compare, unchecked_fields
from attnmeta.testing.harness import compare_with_reference
from attnmeta.testing.lab import LeadingColumns, lab, register_lab, unregister_lab
from attnmeta.testing.labs import BUILTIN

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


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class _LensOptions:
    prefix: str = "unwritten_pad"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True, repr=False, eq=False)
class _LensMetadata(MetadataBase):
    _DEVICE_FIELDS: ClassVar[tuple[str, ...]] = ("lens",)
    _HOST_FIELDS: ClassVar[tuple[str, ...]] = ()
    _SCALAR_FIELDS: ClassVar[tuple[str, ...]] = ()
    _TWINS: ClassVar[tuple[tuple[str, str], ...]] = ()

    lens: torch.Tensor
    """(num_reqs,) int32, device: each row's query length, padding rows 0."""


class _Lens(Builder[_LensOptions, None, None, _LensMetadata]):
    """Each request's query length, padding rows 0: a builder of a test's own, whose subclasses plant bugs."""

    name = "lens"
    options_type = _LensOptions
    metadata_type = _LensMetadata

    def needs(self, shape: StepShape, options: _LensOptions) -> CommonNeeds:
        return CommonNeeds(token_arrays=False)

    def write(self, h: Any, lens: np.ndarray) -> None:
        np.subtract(h.query_start_loc_cpu[1:], h.query_start_loc_cpu[:-1], out=lens)

    def derive(self, common: StagedCommon, step: Step, options: _LensOptions, inputs: None) -> Staged[None, Any]:
        h, name = common.host, options.prefix + ".lens"
        self.write(h, step.alloc(name, h.num_reqs, np.int32))
        return Staged(step, None, lambda: _LensMetadata(lens=step.device(name)))


class _UnwrittenPadding(_Lens):
    """The bug: the padding rows are never written, so they hold whatever the slot held."""

    name = "unwritten_pad"

    def write(self, h: Any, lens: np.ndarray) -> None:
        qsl = h.query_start_loc_cpu
        lens[: h.num_real_reqs] = qsl[1 : h.num_real_reqs + 1] - qsl[: h.num_real_reqs]  # (rows past: unwritten)


def _lens_reference(spec: BatchSpec, options: _LensOptions, device: torch.device, inputs: None) -> dict[str, Any]:
    lens = np.zeros(spec.padded_num_reqs, np.int32)
    lens[: spec.num_reqs] = spec.num_scheduled_tokens
    return {"lens": torch.from_numpy(lens).to(device)}


def test_check_builder_s_own_stager_shows_a_byte_the_builder_never_wrote() -> None:
    """A fresh CPU stager's memory was zeros, the very padding value the reference expects: a builder
    that never writes its padding rows passed. check_builder's own stagers now start as 0xA5 bytes."""
    b = attnmeta.register(_UnwrittenPadding())
    register_lab(b.name, reference=_lens_reference)
    try:
        padded = BatchSpec(num_computed_tokens=[3, 0], num_scheduled_tokens=[1, 4], block_table=[[1, 2], [3, 4]],
                           block_size=4, num_reqs_padded=4)
        assert attnmeta.build(padded, Stager("cpu"), b).lens.tolist() == [1, 4, 0, 0]  # (zeros by chance)
        with pytest.raises(AssertionError, match=r"unwritten_pad\.lens: first difference at \(2,\)"):
            check_builder(b, padded)
        check_builder(b, SPEC)  # (no padding rows: every byte written)
    finally:
        unregister_lab(b.name)
        attnmeta.unregister(b.name)


def test_debug_fill_fills_every_new_byte_and_is_checked() -> None:
    with Stager("cpu", debug_fill=0xA5).step() as step:
        assert (step.alloc("x", 3, np.int32) == np.int32(-0x5A5A5A5B)).all()  # 0xA5A5A5A5 as int32
    with pytest.raises(ValueError, match="debug_fill: a byte value, at most 255, got 256"):
        Stager("cpu", debug_fill=256)
    with pytest.raises(TypeError, match="debug_fill: expected an int >= 0"):
        Stager("cpu", debug_fill=0.5)  # type: ignore[arg-type]


def test_strict_lists_the_declared_fields_the_reference_leaves_out() -> None:
    """Fields a reference does not name were skipped without a word; ``strict=True`` names them. (Every
    built-in reference names every field: tests/backends/test_registry.py checks them with strict=True.)"""
    check_builder("flash_attn", SPEC, strict=True)
    meta = check_builder("flash_attn", SPEC)
    assert "num_actual_tokens" in unchecked_fields(meta, {"slot_mapping": None})
    builtin = BUILTIN["flash_attn"]
    assert builtin.reference is not None

    def partial(spec: BatchSpec, options: Any, device: torch.device, inputs: Any) -> dict[str, Any]:
        ref = builtin.reference(spec, options, device, inputs)  # type: ignore[misc]
        return {k: v for k, v in ref.items() if k != "num_actual_tokens"}

    register_lab("flash_attn", reference=partial, sample=builtin.sample, replace=True)
    try:
        check_builder("flash_attn", SPEC)  # (not strict: the field left out goes unchecked)
        with pytest.raises(AssertionError, match=r"flash_attn: the reference names no value for \['num_actual_tokens'\]"):
            check_builder("flash_attn", SPEC, strict=True)
    finally:
        register_lab("flash_attn", reference=builtin.reference, sample=builtin.sample, defaults=builtin.defaults,
                     replace=True)


def test_a_block_table_is_compared_on_the_columns_kernels_read() -> None:
    """A block table's width follows the staging (an eager step the longest request's blocks, a graph-mode
    one its profile's): the reference names the read columns (``LeadingColumns``); wider staging passes,
    a wrong entry in them or a missing row or column fails."""
    wide = Stager("cpu", profile=StaticProfile(max_num_reqs=4, max_num_tokens=16, max_blocks_per_req=5, block_size=4))
    meta = check_builder("flash_attn", SPEC, stager=wide, strict=True)
    assert meta.block_table.shape == (2, 5)
    meta = check_builder("mla", SPEC, stager=wide, strict=True)
    assert meta.block_table.shape == (2, 5)
    local = BatchSpec(num_computed_tokens=[9, 0], num_scheduled_tokens=[1, 4], block_table=[[1, 2, 3], [4, 5, 6]],
                      block_size=4)
    options = LocalAttentionOptions(attn_chunk_size=8)  # (a virtual row's entries past its blocks follow the width)
    assert not np.array_equal(check_builder("local_attn", local, options=options).block_table_cpu,
                              check_builder("local_attn", local, options=options, stager=wide, strict=True).block_table_cpu)
    table = torch.tensor([[1, 2], [3, 4]], dtype=torch.int32)

    def check_metadata_fields(obj: object, expected: dict[str, Any]) -> None:  # (the comparison check_builder makes)
        _compare(obj, expected, "t", torch.device("cpu"))

    fields = {"block_table": table[:, :1]}
    check_metadata_fields(SimpleNamespace(**fields), {"block_table": LeadingColumns(table[:, :1])})
    with pytest.raises(AssertionError, match=r"block_table: shape \(2, 1\), expected 2 rows of at least 2 columns"):
        check_metadata_fields(SimpleNamespace(**fields), {"block_table": LeadingColumns(table)})
    with pytest.raises(AssertionError, match=r"block_table: shape \(1, 2\), expected 2 rows"):
        check_metadata_fields(SimpleNamespace(block_table=table[:1]), {"block_table": LeadingColumns(table)})
    read = LeadingColumns(torch.tensor([[1, 2], [3, 0]], dtype=torch.int32), read=torch.tensor([2, 1]))
    check_metadata_fields(SimpleNamespace(block_table=table), {"block_table": read})  # (row 1's second entry: unread)
    with pytest.raises(AssertionError, match=r"block_table: first difference at \(0, 1\)"):
        check_metadata_fields(SimpleNamespace(block_table=torch.tensor([[1, 9], [3, 4]], dtype=torch.int32)),
                              {"block_table": read})
    with pytest.raises(AssertionError, match=r"block_table: first difference at \(1, 0\)"):
        check_metadata_fields(SimpleNamespace(block_table=table),
                              {"block_table": LeadingColumns(torch.tensor([[1], [5]], dtype=torch.int32))})


def test_a_reference_gets_the_graph_mode_profile_its_shapes_follow() -> None:
    """Graph mode fixes mm_prefix's ranges per row (``graph_max_ranges``, unused ranges ``(0, 0)``): the
    reference takes the stager's profile (a ``profile`` keyword) and pads alike, so ``check_builder``
    passes on a graph-mode stager; a reference without the keyword is called as before."""
    spec = BatchSpec(num_computed_tokens=[0, 0], num_scheduled_tokens=[6, 4], block_table=[[1, 2], [3, 4]],
                     block_size=4)
    options, inputs = lab("mm_prefix").defaults(spec)
    eager = check_builder("mm_prefix", spec, "cpu", options, inputs, strict=True)
    prof = StaticProfile(max_num_reqs=4, max_num_tokens=16, max_blocks_per_req=4, block_size=4)
    graph = check_builder("mm_prefix", spec, "cpu", options, inputs, stager=Stager("cpu", profile=prof), strict=True)
    assert eager.mm_prefix_range_tensor.shape == (2, 1, 2)
    assert graph.mm_prefix_range_tensor.shape == (2, options.graph_max_ranges, 2) and graph.max_ranges == 8
    assert (graph.mm_prefix_range_tensor_cpu[:, 1:] == 0).all()
    assert lab("flash_attn").reference(spec, None, "cpu", profile=prof) is not None  # (its reference takes none)



# ------------------------------------------------------------------ what check_builder catches in a user's builder
class _Tampered(FlashAttentionBuilder):
    """FlashAttention's builder whose result is changed by ``tamper`` (a planted bug of a user's builder)."""

    name = "tampered_flash_attn"

    def __init__(self, tamper: Callable[[Any], Any]) -> None:
        self.tamper = tamper

    def derive(self, common: Any, step: Any, options: Any, inputs: Any) -> Any:
        staged = super().derive(common, step, options, inputs)
        return Staged(step, staged.host, lambda: self.tamper(staged.result()))


def _check_tampered(tamper: Callable[[Any], Any], spec: BatchSpec) -> None:
    """check_builder on :class:`_Tampered`, registered with FlashAttention's lab reference."""
    b = attnmeta.register(_Tampered(tamper))
    register_lab(b.name, reference=BUILTIN["flash_attn"].reference)
    try:
        check_builder(b, spec)
    finally:
        unregister_lab(b.name)
        attnmeta.unregister(b.name)


def test_check_builder_refuses_a_writable_host_twin() -> None:
    """A copy with equal values passed every check (found by a toolkit review on a builder of its own)."""
    spec = BatchSpec(num_computed_tokens=[5, 0], num_scheduled_tokens=[1, 3], block_table=[[1, 2], [3, 4]],
                     block_size=4)
    _check_tampered(lambda m: m, spec)
    with pytest.raises(AssertionError, match=r"handed out writable: \['tampered_flash_attn.seq_lens_cpu'\]"):
        _check_tampered(lambda m: dataclasses.replace(m, seq_lens_cpu=m.seq_lens_cpu.copy()), spec)


def test_check_builder_refuses_a_device_field_that_is_a_host_view() -> None:
    """A tensor of the staged host view (``torch.from_numpy``), never uploaded: on the CPU the device types agree."""
    spec = BatchSpec(num_computed_tokens=[5, 0], num_scheduled_tokens=[1, 3], block_table=[[1, 2], [3, 4]],
                     block_size=4)
    with pytest.raises(AssertionError, match=r"tampered_flash_attn.seq_lens: a device field in the memory of the host "
                                             r"array tampered_flash_attn\..*seq_lens_cpu"):
        _check_tampered(lambda m: dataclasses.replace(m, seq_lens=host_tensor(m.seq_lens_cpu)), spec)


@dataclasses.dataclass
class _HostAndDevice:
    """A host array and a device field (a CPU stager's: host memory too), for the memory-sharing check."""

    _DEVICE_FIELDS: ClassVar[tuple[str, ...]] = ("dev",)
    host: np.ndarray
    dev: torch.Tensor


def test_the_memory_check_reads_the_bytes_an_array_occupies() -> None:
    """A broadcast host array (local attention's device-mode ``block_table_cpu``: ``-1`` broadcast, 4 bytes
    whatever its shape) was taken to span ``nbytes`` from its first element, so a device tensor that the
    allocator placed just after those 4 bytes was reported as sharing its memory: a flaky failure of
    test_local_attn_backend.py under the thorough hypothesis profile. And a device field that began
    before a host array and ran into it was not seen: only its first byte was looked at."""
    check = builders._no_device_field_in_host_memory
    stager = Stager("cpu")
    buf = np.zeros(64, np.int32)
    broadcast = np.broadcast_to(buf[:1], (8, 8))
    assert broadcast.nbytes == 256
    check(_HostAndDevice(broadcast, torch.from_numpy(buf[4:8])), "pair", stager)  # 16 bytes past its one element
    for host, dev in ((broadcast, buf[:4]),  # its element
                      (buf[8:16], buf[4:12]),  # begins before the host array, ends inside it
                      (buf[10:2:-1], buf[3:5])):  # a negative stride: the host array spans buf[3:11]
        with pytest.raises(AssertionError, match=r"pair\.dev: a device field in the memory of the host array pair\.host"):
            check(_HostAndDevice(host, torch.from_numpy(dev)), "pair", stager)


def test_check_reads_lengths_probes_lengths_past_the_shape_s_own() -> None:
    """A promise broken only at long contexts (a kernel switch past 1,024 tokens) passed on every batch the
    strategies draw."""
    class SwitchesLate(FlashAttentionBuilder):
        def reads_lengths(self, options: Any) -> bool:
            return False

        def needs(self, shape: Any, options: Any) -> CommonNeeds:
            return dataclasses.replace(super().needs(shape, options), paged_kv=shape.max_seq_len > 1024)

    spec = BatchSpec(num_computed_tokens=[5, 0], num_scheduled_tokens=[1, 3], block_table=[[1, 2], [3, 4]],
                     block_size=4)
    with pytest.raises(AssertionError, match=r"reads_lengths\(\) is False, but needs changes with the lengths"):
        check_reads_lengths(SwitchesLate(), spec.shape)


def test_check_any_rows_key_finds_a_key_or_needs_that_reads_the_counts() -> None:
    """A builder whose any-counts key names the request count, or whose needs change with the token count,
    breaks the promise (a graph-mode layout recorded for other counts would be replayed); FlashInfer's keeps
    it, and a padded shape is not checked."""
    class KeysTheRows(FlashInferBuilder):
        def any_rows_key(self, shape: Any, options: Any, inputs: Any) -> Any:
            return (super().any_rows_key(shape, options, inputs), shape.num_reqs)

    class NeedsTheTokens(FlashInferBuilder):
        def needs(self, shape: Any, options: Any) -> CommonNeeds:
            return dataclasses.replace(super().needs(shape, options), token_arrays=shape.num_tokens < 20)

    spec = BatchSpec(num_computed_tokens=[5, 0], num_scheduled_tokens=[1, 3], block_table=[[1, 2], [3, 4]],
                     block_size=4)
    check_any_rows_key("flashinfer", spec.shape)
    check_any_rows_key(KeysTheRows(), spec.shape._replace(num_reqs_padded=4, num_tokens_padded=8))
    with pytest.raises(AssertionError, match=r"any_rows_key changes with the counts"):
        check_any_rows_key(KeysTheRows(), spec.shape)
    with pytest.raises(AssertionError, match=r"any_rows_key is not None, but needs changes with the counts"):
        check_any_rows_key(NeedsTheTokens(), spec.shape)


class _LensReplayer(Replayer[None, Any]):
    """The planted bug: ``rewrite`` writes nothing, so a replayed step's lengths are the recorded step's."""

    def __init__(self, name: str) -> None:
        self.name = name

    def result(self, step: Any, common: Any, host: Any, paged: Any, inputs: None) -> Any:
        return _LensMetadata(lens=step.device(self.name))


class _StaleReplay(_Lens):
    """Each request's query length, with replay support whose rewrite forgets to write."""

    name = "stale_replay"

    def replay_key(self, shape: StepShape, options: _LensOptions, inputs: None) -> tuple[()]:
        return ()

    def replayer(self, staged: Any, common: Any, step: Any, options: _LensOptions, inputs: None) -> _LensReplayer:
        return _LensReplayer(options.prefix + ".lens")


def test_check_replay_catches_a_replayer_that_leaves_a_field_stale() -> None:
    """Replay bugs show only on replayed steps, which check_builder never makes, and only when a step of the
    recorded shape brings other contents (a toolkit review's planted bugs passed every documented check)."""
    from attnmeta.testing import check_replay
    from attnmeta.testing.workloads import reshuffled

    spec = BatchSpec(num_computed_tokens=[5, 0, 9, 2], num_scheduled_tokens=[1, 3, 2, 1],
                     block_table=[[1, 2, 0], [3, 8, 0], [4, 5, 6], [7, 0, 0]], block_size=4)
    walk = reshuffled(spec, 8, np.random.default_rng(0))
    assert check_replay("mamba2", walk) > 0
    b = attnmeta.register(_StaleReplay())
    register_lab(b.name, reference=_lens_reference)
    try:
        for s in walk:
            check_builder(b, s)  # (each step staged afresh: no replay, no error)
        with pytest.raises(AssertionError, match=r"step \d \(replayed\)"):
            check_replay(b, walk)
    finally:
        unregister_lab(b.name)
        attnmeta.unregister(b.name)
