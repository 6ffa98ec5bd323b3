"""Generic checks of a builder: its fields against its own reference, and the sync audit.

Every registered builder can be checked the same way, which is how a new one is tested by the same
machinery as the built-in ones (docs/extending.md):

- :func:`check_builder`: build the metadata of a batch through :func:`attnmeta.build` and compare every
  field the builder's lab reference (:meth:`attnmeta.testing.lab.Lab.reference`) names with that
  reference: a device field's values, dtype and shape, its host twin (``<name>_cpu``) where there is
  one, and host values and scalars by equality;
- :func:`check_reads_lengths`: the promise of :meth:`attnmeta.builder.Builder.reads_lengths` on one step
  shape, and :func:`check_any_rows_key` that of :meth:`attnmeta.builder.Builder.any_rows_key`
  (:func:`check_builder` checks both);
- :func:`audit_builder`: run the builder under the sync audit (:func:`attnmeta.sync.run_audit`) on
  generated batches of every kind, with options and inputs its lab entry draws
  (:meth:`attnmeta.testing.lab.Lab.sample`).

These are test helpers: :func:`check_builder` reads device tensors back to compare them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from attnmeta.builder import AnyBuilder, build, get_builder
from attnmeta.profile import StaticProfile
from attnmeta.spec import BatchSpec, StepShape
from attnmeta.staging import Stager
from attnmeta.sync import AuditRow, register_audit_target, run_audit, unregister_audit_target
from attnmeta.testing.assertions import DEBUG_FILL, assert_host_equal, assert_matches_device
from attnmeta.testing.lab import LeadingColumns, lab
from attnmeta.testing.workloads import KINDS, random_spec

__all__ = ["audit_builder", "audit_stager", "builder_target", "check_any_rows_key", "check_builder", "check_metadata",
           "check_reads_lengths", "check_replay", "writable_host_arrays"]


def check_builder(
    builder: AnyBuilder | str,
    spec: BatchSpec,
    device: torch.device | str = "cpu",
    options: Any = None,
    inputs: Any = None,
    *,
    stager: Stager | None = None,
    strict: bool = False,
) -> Any:
    """Build ``builder``'s metadata of ``spec`` and assert every field its lab reference names equals it.

    Parameters
    ----------
    builder : Builder or str
        The builder or its registry name; its lab entry (:func:`attnmeta.testing.lab.register_lab`)
        must have a reference.
    spec : BatchSpec
        The batch.
    device : torch.device or str, default "cpu"
        Where the metadata and the reference live.
    options : the builder's options, optional
        Default: the builder's defaults.
    inputs : the builder's inputs, optional
        The builder's per-step inputs (its ``<Family>Inputs``).
    stager : Stager, optional
        Stage through this stager (e.g. a graph-mode one); default a new eager one on ``device`` whose
        memory starts as the byte :data:`DEBUG_FILL` (``Stager(debug_fill=...)``), so a byte the builder
        hands out without writing it shows, not a zero that the reference may expect by chance. Pass
        one stager to many calls, too: a builder that reads what an earlier step left in its slot is
        caught only where the slot held another step.
    strict : bool, default False
        Also assert that the reference names every declared field of the metadata that holds a value
        (its device, host and scalar fields; a host twin counts as named with its device field): the
        fields it leaves out are otherwise not compared, without a word (:func:`unchecked_fields`
        lists them).

    Returns
    -------
    The builder's metadata
        For further checks.

    Raises
    ------
    AssertionError
        Naming the first field that differs, and where (the first differing index and both values).
    TypeError
        ``spec`` is not a :class:`~attnmeta.BatchSpec`.
    ValueError
        The builder has no reference, or ``device`` (or ``stager``'s device) is ``meta``: values are
        compared, and meta tensors have none (:func:`audit_builder` runs a builder on ``meta``).

    Examples
    --------
    >>> from attnmeta import BatchSpec
    >>> spec = BatchSpec(num_computed_tokens=[5, 0], num_scheduled_tokens=[1, 3], block_table=[[1, 2], [3, 4]],
    ...                  block_size=4)
    >>> check_builder("flashinfer", spec).num_pages
    3
    """
    b = get_builder(builder) if isinstance(builder, str) else builder
    if not isinstance(spec, BatchSpec):
        raise TypeError(f"check_builder: spec must be a BatchSpec, got {type(spec).__name__}"
                        + (" (call it once per spec)" if isinstance(spec, list | tuple) else ""))
    opts, inp = b.options(options), b.inputs(inputs)
    dev = torch.device(device)
    if dev.type == "meta" or (stager is not None and stager.device.type == "meta"):
        raise ValueError("check_builder compares values, and meta tensors have none: pass device='cpu' or 'cuda' "
                         "(audit_builder runs a builder on 'meta' under the sync audit)")
    stager = stager if stager is not None else Stager(dev, debug_fill=DEBUG_FILL)
    expected = _reference(b, spec, opts, dev, inp, stager.profile)
    meta = build(spec, stager, b, opts, inp)
    _compare(meta, expected, b.name, dev)
    writable = writable_host_arrays(meta, b.name)
    assert not writable, (f"{b.name}: host arrays handed out writable: {writable} (hand out the staged views, "
                          f"which are read-only; an edit of a copy would disagree with its device field)")
    _no_device_field_in_host_memory(meta, b.name, stager)
    if strict:
        left = unchecked_fields(meta, expected)
        assert not left, f"{b.name}: the reference names no value for {left} (strict=True)"
    check_reads_lengths(b, spec.shape, opts, inp)
    check_any_rows_key(b, spec.shape, opts, inp)
    return meta


def writable_host_arrays(obj: Any, path: str = "metadata") -> list[str]:
    """The paths of the writable, non-empty host arrays reachable from ``obj``, a metadata object (fields
    of dataclasses, dict and sequence entries, and an object's ``chunk(i)`` parts). A builder hands out
    read-only views of its staged arrays: a host array a caller could edit would disagree with its
    device field. :func:`check_builder` asserts there are none.

    Examples
    --------
    >>> import numpy as np
    >>> from attnmeta import BatchSpec, Stager, build_common
    >>> spec = BatchSpec(num_computed_tokens=[5], num_scheduled_tokens=[1], block_table=[[1, 2]], block_size=4)
    >>> writable_host_arrays(build_common(spec, Stager("cpu")), "common")
    []
    >>> writable_host_arrays({"lens": np.array([1, 2])}, "mine")
    ["mine['lens']"]
    """
    return [p for p, value, _dev in _arrays(obj, path, set())
            if isinstance(value, np.ndarray) and value.flags.writeable and value.size]


def _arrays(obj: Any, path: str, seen: set[int]) -> Iterator[tuple[str, np.ndarray | torch.Tensor, bool]]:
    """Every host array and tensor reachable from ``obj`` (fields of dataclasses, dict and sequence entries,
    an object's ``chunk(i)`` parts), as ``(path, value, whether a dataclass declares it a device field)``."""
    if obj is None or id(obj) in seen or isinstance(obj, int | float | str | bool | slice):
        return
    seen.add(id(obj))
    items: list[tuple[str, Any, bool]] = []
    if isinstance(obj, dict):
        items = [(f"{path}[{k!r}]", v, False) for k, v in obj.items()]
    elif isinstance(obj, list | tuple):
        items = [(f"{path}[{i}]", v, False) for i, v in enumerate(obj)]
    elif dataclasses.is_dataclass(obj):
        device = set(getattr(obj, "_DEVICE_FIELDS", ()))
        items = [(f"{path}.{f.name}", getattr(obj, f.name), f.name in device) for f in dataclasses.fields(obj)]
        chunk, count = getattr(obj, "chunk", None), getattr(obj, "num_chunks", None)
        if callable(chunk) and isinstance(count, int):
            items += [(f"{path}.chunk({i})", chunk(i), False) for i in range(count)]
    for sub, value, dev in items:
        if isinstance(value, np.ndarray | torch.Tensor):
            yield sub, value, dev
        else:
            yield from _arrays(value, sub, seen)


def _no_device_field_in_host_memory(meta: Any, name: str, stager: Stager) -> None:
    """Assert that no device field of ``meta`` (a CPU stager's: its device is the host too) shares memory
    with a host array ``meta`` hands out, as ``torch.from_numpy`` of a staged host view would: such a
    field was never copied (on a GPU it would be a host tensor). Each array's memory is the bytes its
    elements occupy (:func:`_byte_extent`), not ``nbytes`` from its first element: a broadcast view
    (strides of 0) holds a few bytes whatever its shape."""
    if stager.device.type != "cpu":
        return  # (elsewhere the device comparison names a host tensor)
    found = list(_arrays(meta, name, set()))
    hosts = [(*_byte_extent(v.ctypes.data, v.shape, v.strides, v.itemsize), p)
             for p, v, _d in found if isinstance(v, np.ndarray) and v.size]
    for where, value, device in found:
        if device and isinstance(value, torch.Tensor) and value.numel():
            size = value.element_size()
            lo, hi = _byte_extent(value.data_ptr(), tuple(value.shape), tuple(st * size for st in value.stride()), size)
            for h_lo, h_hi, host in hosts:
                assert not (lo < h_hi and h_lo < hi), (
                    f"{where}: a device field in the memory of the host array {host} (a host view made a tensor, "
                    f"never copied): hand out step.device(...) views")


def _byte_extent(ptr: int, shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> tuple[int, int]:
    """``[lo, hi)``: the bytes the elements of a non-empty strided array at ``ptr`` (its first element)
    occupy; ``strides`` in bytes, negative and zero ones included."""
    lo = hi = ptr
    for n, st in zip(shape, strides, strict=True):
        if st < 0:
            lo += (n - 1) * st
        else:
            hi += (n - 1) * st
    return lo, hi + itemsize


def check_reads_lengths(builder: AnyBuilder | str, shape: StepShape, options: Any = None, inputs: Any = None) -> None:
    """Assert :meth:`~attnmeta.builder.Builder.reads_lengths`'s promise on ``shape``: where the builder
    says False for ``options``, its ``replay_key`` (and for an unpadded shape its ``any_rows_key``) equals
    that of ``shape`` with the three lengths 0, and so does its ``needs``, but for ``block_table_columns``, which may add the longest request's blocks;
    and the same for ``shape`` with lengths of a million tokens (a promise broken only past some length).
    (A builder that says False wrongly would replay a layout recorded for other lengths.)

    Raises
    ------
    AssertionError
        Naming the builder, the shape and what differs.

    Examples
    --------
    >>> from attnmeta import BatchSpec
    >>> spec = BatchSpec(num_computed_tokens=[5, 40], num_scheduled_tokens=[1, 1], block_table=[[1, 0, 0], [2, 3, 4]],
    ...                  block_size=16)
    >>> check_reads_lengths("flashinfer", spec.shape)
    """
    b = get_builder(builder) if isinstance(builder, str) else builder
    opts, inp = b.options(options), b.inputs(inputs)
    if b.reads_lengths(opts):
        return
    blank = shape._replace(max_seq_len=0, max_exact_seq_len=0, num_pages=0)
    want, base = b.replay_key(blank, opts, inp), b.needs(blank, opts)
    unpadded = shape.num_reqs_padded is None
    free = b.any_rows_key(blank, opts, inp) if unpadded else None
    # (the shape's own lengths, then far longer ones: a promise broken only past some length, a kernel
    # switch at long contexts say, shows there; the scalars alone are read, so any lengths may be asked)
    longest = 1 << 20
    pages = max(shape.num_pages, shape.num_reqs * -(-longest // shape.block_size))
    for probe in (shape, shape._replace(max_seq_len=longest, max_exact_seq_len=longest, num_pages=pages)):
        got = b.replay_key(probe, opts, inp)
        assert got == want, (f"{b.name}.reads_lengths() is False, but replay_key changes with the lengths: {got!r} "
                             f"for {probe}, {want!r} without its lengths")
        got = b.any_rows_key(probe, opts, inp) if unpadded else None
        assert got == free, (f"{b.name}.reads_lengths() is False, but any_rows_key changes with the lengths: {got!r} "
                             f"for {probe}, {free!r} without its lengths")
        needs = b.needs(probe, opts)
        used = max(1, -(-probe.max_exact_seq_len // probe.block_size))
        columns = None if base.block_table_columns is None else max(base.block_table_columns, used)
        assert needs == dataclasses.replace(base, block_table_columns=columns), (
            f"{b.name}.reads_lengths() is False, but needs changes with the lengths: {needs} for {probe}, {base} "
            f"without its lengths (only block_table_columns may add the longest request's {used} blocks)")


def check_any_rows_key(builder: AnyBuilder | str, shape: StepShape, options: Any = None, inputs: Any = None) -> None:
    """Assert :meth:`~attnmeta.builder.Builder.any_rows_key`'s promise on ``shape``, an unpadded step's:
    where the builder gives it a key, the key and ``needs`` are those of the same shape with other request
    and token counts (one more of each, and ten times as many). (A builder that promises wrongly would
    replay a graph-mode layout recorded for other counts.) Padded shapes are not checked.

    Raises
    ------
    AssertionError
        Naming the builder, the shapes and what differs.

    Examples
    --------
    >>> from attnmeta import BatchSpec
    >>> spec = BatchSpec(num_computed_tokens=[5, 40], num_scheduled_tokens=[1, 7], block_table=[[1, 0, 0], [2, 3, 4]],
    ...                  block_size=16)
    >>> check_any_rows_key("flashinfer", spec.shape)
    """
    b = get_builder(builder) if isinstance(builder, str) else builder
    opts, inp = b.options(options), b.inputs(inputs)
    if shape.num_reqs_padded is not None:
        return
    want = b.any_rows_key(shape, opts, inp)
    if want is None:
        return
    base = b.needs(shape, opts)
    n, t = shape.num_reqs, shape.num_tokens
    for probe in (shape._replace(num_reqs=n + 1, num_tokens=t + 1), shape._replace(num_reqs=10 * n + 1, num_tokens=10 * t + 1)):
        got = b.any_rows_key(probe, opts, inp)
        assert got == want, (f"{b.name}.any_rows_key changes with the counts: {got!r} for {probe}, {want!r} for "
                             f"{shape}")
        needs = b.needs(probe, opts)
        assert needs == base, (f"{b.name}.any_rows_key is not None, but needs changes with the counts: {needs} for "
                               f"{probe}, {base} for {shape}")


def check_replay(builder: AnyBuilder | str, specs: Sequence[BatchSpec], options: Any = None, inputs: Any = None, *,
                 stager: Stager | None = None, device: torch.device | str = "cpu") -> int:
    """Build ``specs`` in turn through a step composer of ``builder`` alone and check every step's metadata
    against the builder's lab reference (:func:`check_metadata`); returns how many steps replayed.

    A composer (:class:`attnmeta.compose.StepBuilder`) replays a step whose layout its ring slot recorded
    (the builder's :meth:`~attnmeta.builder.Builder.replay_key` and the step's shape): the builder's
    :meth:`~attnmeta.builder.Builder.replayer` rewrites only what changes from step to step, and the rest
    of the slot keeps the recorded step's bytes. A replayer that leaves a changing field unwritten, a
    ``replay_key`` that misses something the layout depends on, or a result that reuses a recorded
    step's value is wrong only on replayed steps, which :func:`check_builder` never makes. Steps of one
    shape with other contents (:func:`attnmeta.testing.workloads.reshuffled`, a decode walk's
    :func:`~attnmeta.testing.workloads.advance`) are what shows them.

    Parameters
    ----------
    builder : Builder or str
        The builder, or its registry name (its lab entry must have a reference).
    specs : sequence of BatchSpec
        The steps, in order.
    options : the builder's options, optional
        Default: its defaults.
    inputs : the builder's inputs, or a sequence of them (one per step), optional
        Default: none.
    stager : Stager, optional
        Default: an eager one on ``device`` with 2 slots, its memory starting as :data:`DEBUG_FILL`
        (pass a graph-mode one to check graph-mode replays).
    device : torch.device or str, default "cpu"
        Where a default stager stages.

    Returns
    -------
    int
        The steps that replayed (0: none did; check that your steps repeat a shape on a slot).

    Raises
    ------
    AssertionError
        Naming the step, whether it replayed, and the first field that differs.

    Examples
    --------
    >>> import numpy as np
    >>> from attnmeta import BatchSpec
    >>> from attnmeta.testing.workloads import reshuffled
    >>> spec = BatchSpec(num_computed_tokens=[5, 7, 9], num_scheduled_tokens=[1, 1, 1],
    ...                  block_table=[[1, 2, 0], [3, 8, 0], [4, 5, 6]], block_size=4)
    >>> check_replay("flashinfer", reshuffled(spec, 8, np.random.default_rng(0)))  # steps 3-8 replay (2 slots)
    6
    """
    from attnmeta.compose import Group, StepBuilder  # (the composer builds on the builders: imported late)

    b = get_builder(builder) if isinstance(builder, str) else builder
    opts = b.options(options)
    per_step = isinstance(inputs, list | tuple)
    if per_step and len(inputs) != len(specs):
        raise ValueError(f"check_replay: {len(inputs)} inputs for {len(specs)} steps (one per step, or one for all)")
    stager = stager if stager is not None else Stager(device, num_slots=2, debug_fill=DEBUG_FILL)
    composer = StepBuilder(stager, Group({b.name: (b, opts)}))
    replayed = 0
    for i, spec in enumerate(specs):
        if not isinstance(spec, BatchSpec):
            raise TypeError(f"check_replay: specs[{i}] is a {type(spec).__name__}, not a BatchSpec")
        inp = b.inputs(inputs[i] if per_step else inputs)
        before = composer.stats.replayed
        out = composer.build(spec, inputs=None if inp is None else {b.name: inp})
        again = composer.stats.replayed > before
        replayed += again
        check_metadata(b, out[b.name], spec, opts, inp, where=f"step {i} ({'replayed' if again else 'composed'})",
                       profile=stager.profile)
    return replayed


def check_metadata(builder: AnyBuilder | str, metadata: Any, spec: BatchSpec, options: Any = None,
                   inputs: Any = None, *, where: str = "", skip: Collection[str] = (),
                   profile: StaticProfile | None = None) -> None:
    """Assert that ``metadata``, made by ``builder`` for ``spec`` however it was staged, equals the
    builder's lab reference field for field (the comparison of :func:`check_builder`).

    For metadata that did not come from :func:`attnmeta.build`: a step composer's
    (:class:`attnmeta.compose.StepBuilder`, replayed steps included), a multi-rank stager's, or an
    engine's own composition. The reference runs on the device of ``metadata``'s tensors.

    Parameters
    ----------
    builder : Builder or str
        The builder that made it, or its registry name (its lab entry must have a reference).
    metadata : the builder's metadata
        The object to check: device tensors are read back (a test helper).
    spec : BatchSpec
        The step it was made for (its KV-cache group's spec).
    options, inputs : optional
        The options and per-step inputs it was made with (default: the builder's defaults, no inputs).
    where : str, optional
        A prefix for the failure message (e.g. ``"step 7"``).
    skip : collection of str, optional
        Fields of the reference not to compare (with their host twins): values your staging defines
        differently on purpose (the built-in references already leave the block-table entries kernels
        do not read to the staging: :class:`~attnmeta.testing.lab.LeadingColumns`).
    profile : StaticProfile, optional
        The graph-mode profile ``metadata`` was staged under (its stager's ``profile``; None: eager):
        graph mode fixes some shapes (e.g. ``mm_prefix``'s ranges per row).

    Raises
    ------
    AssertionError
        Naming the first field that differs, and where.
    ValueError
        The builder has no reference.

    Examples
    --------
    >>> from attnmeta import BatchSpec, Stager
    >>> from attnmeta.backends.flashinfer import FLASHINFER
    >>> from attnmeta.compose import Group, StepBuilder
    >>> spec = BatchSpec(num_computed_tokens=[5, 0], num_scheduled_tokens=[1, 3], block_table=[[1, 2], [3, 4]],
    ...                  block_size=4)
    >>> out = StepBuilder(Stager("cpu"), Group({"fi": FLASHINFER})).build(spec)
    >>> check_metadata("flashinfer", out["fi"], spec)
    """
    b = get_builder(builder) if isinstance(builder, str) else builder
    opts, inp = b.options(options), b.inputs(inputs)
    dev = _device_of(metadata)
    expected = {k: v for k, v in _reference(b, spec, opts, dev, inp, profile).items() if k not in skip}
    _compare(metadata, expected, f"{where} {b.name}".strip(), dev)


def _reference(b: AnyBuilder, spec: BatchSpec, options: Any, device: torch.device, inputs: Any,
               profile: StaticProfile | None = None) -> dict[str, Any]:
    """``b``'s lab reference of ``spec`` (staged under graph-mode ``profile``, or eagerly), or a ValueError
    when its lab entry has none."""
    expected = lab(b).reference(spec, options, device, inputs, profile=profile)
    if expected is None:
        raise ValueError(f"{b.name}: the builder's lab entry has no reference to check against "
                         f"(attnmeta.testing.lab.register_lab)")
    return expected


def _device_of(metadata: Any) -> torch.device:
    """The device of the first device tensor of a metadata object (or of its parts); CPU without one."""
    for name in getattr(metadata, "_DEVICE_FIELDS", ()):
        t = getattr(metadata, name, None)
        if isinstance(t, torch.Tensor):
            return t.device
    for f in dataclasses.fields(metadata) if dataclasses.is_dataclass(metadata) else ():
        v = getattr(metadata, f.name, None)
        if isinstance(v, torch.Tensor):
            return v.device
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            return _device_of(v)
    return torch.device("cpu")


def _compare(obj: Any, expected: dict[str, Any], path: str, dev: torch.device) -> None:
    """Every field ``expected`` names against ``obj`` (a metadata object or one of its parts; a dict
    value is the expected fields of the part of that name)."""
    host_fields = set(getattr(obj, "_HOST_FIELDS", ()))
    device_fields = set(getattr(obj, "_DEVICE_FIELDS", ()))
    for name, want in expected.items():
        where = f"{path}.{name}"
        assert hasattr(obj, name), f"{where}: the reference names it, but {type(obj).__name__} has no such field"
        got = getattr(obj, name)
        if isinstance(want, dict):
            assert got is not None, f"{where}: None, expected fields {sorted(want)}"
            _compare(got, want, where, dev)
        elif isinstance(want, torch.Tensor | LeadingColumns) and isinstance(got, np.ndarray) and (
                name not in device_fields):
            _match(got, want, where)  # a host field whose reference the oracle computed on the device
        elif isinstance(want, torch.Tensor | LeadingColumns):
            assert isinstance(got, torch.Tensor), (
                f"{where}: expected a device tensor, got {type(got).__name__}"
                + (" (a device field holding a host array: it was never uploaded)" if isinstance(got, np.ndarray) else ""))
            assert got.device.type == dev.type, f"{where}: on {got.device}, expected {dev}"
            _match(got.cpu().numpy(), want, where)  # test-only read-back
            prefix = set(getattr(obj, "_PREFIX_TWINS", ()))
            for twin in sorted(t for t in _host_twins(obj, name) if t in host_fields and t not in expected):
                value = getattr(obj, twin)
                if value is None:
                    continue
                ref = want
                if twin in prefix and isinstance(want, torch.Tensor) and value.ndim == 1 and value.shape[0] < want.shape[0]:
                    ref = want[: value.shape[0]]  # (a twin of the leading entries: the class declares it)
                _match(value, ref, f"{path}.{twin}")
        elif isinstance(want, np.ndarray):
            assert_host_equal(got, want, where)
        elif isinstance(want, list | tuple) or isinstance(got, torch.Tensor | np.ndarray):
            raise TypeError(
                f"{where}: the reference gives a {type(want).__name__} for a field that holds a "
                f"{type(got).__name__}; a reference gives a torch.Tensor for a device field (on the device "
                f"it is given), a numpy array for a host array, LeadingColumns for a table compared on its "
                f"leading columns, a dict for a part's fields, and a plain value for a scalar")
        elif isinstance(want, bool | np.bool_) or isinstance(got, bool | np.bool_):
            assert isinstance(got, bool | np.bool_) and bool(got) == bool(want), f"{where}: {got!r} != {want!r}"
        elif isinstance(want, int | np.integer):
            assert isinstance(got, int | np.integer) and int(got) == int(want), f"{where}: {got!r} != {want!r}"
        else:
            assert got == want, f"{where}: {got!r} != {want!r}"


def _match(got: np.ndarray, want: torch.Tensor | LeadingColumns, where: str) -> None:
    """A host array (a field's, or a device field's read back) against its reference: all of it, or
    for a :class:`~attnmeta.testing.lab.LeadingColumns` reference its rows and leading columns."""
    if isinstance(want, LeadingColumns):
        ref = want.value
        cut = want.leading(got)
        assert cut is not None, (
            f"{where}: shape {tuple(got.shape)}, expected {ref.shape[0]} rows of at least {ref.shape[1]} columns")
        got, want = cut[0], ref
    assert_matches_device(got, want, where)


def _host_twins(obj: Any, name: str) -> set[str]:
    """The names a host twin of ``obj``'s field ``name`` may have: ``<name>_cpu``, and the twin the class
    declares (:meth:`~attnmeta.builder.MetadataBase.host_twin`) where it declares one."""
    twin_of = getattr(obj, "host_twin", None)
    declared = twin_of(name) if twin_of is not None else None
    return {name + "_cpu", declared} if isinstance(declared, str) else {name + "_cpu"}


def unchecked_fields(metadata: Any, expected: dict[str, Any]) -> list[str]:
    """The declared fields of ``metadata`` (``_DEVICE_FIELDS``, ``_HOST_FIELDS``, ``_SCALAR_FIELDS``)
    that hold a value (not None) and that ``expected`` (a lab reference's fields) names neither directly
    nor through a device field's host twin: what :func:`check_builder` does not compare."""
    named = set(expected).union(*(_host_twins(metadata, name) for name in expected))
    declared = [*getattr(metadata, "_DEVICE_FIELDS", ()), *getattr(metadata, "_HOST_FIELDS", ()),
                *getattr(metadata, "_SCALAR_FIELDS", ())]
    return [f for f in declared if f not in named and getattr(metadata, f) is not None]


_STAGERS: dict[str, Stager] = {}


def audit_stager(device: torch.device) -> Stager:
    """The stager the audit targets build on, one per device (kept: a target runs many seeds)."""
    key = str(device)
    st = _STAGERS.get(key)
    if st is None:
        st = _STAGERS[key] = Stager(device)
    return st


def builder_target(builder: AnyBuilder) -> Callable[[torch.device, int], None]:
    """The audit target of ``builder``: ``run(device, seed)`` builds one random batch of every kind of
    :data:`~attnmeta.testing.workloads.KINDS` with options and inputs from ``builder.sample`` (a batch
    the builder reports it cannot serve is skipped), each through :func:`attnmeta.build`."""

    def run(device: torch.device, seed: int) -> None:
        rng = np.random.default_rng(seed)
        stager = audit_stager(device)
        entry = lab(builder)
        for kind in KINDS:
            spec = random_spec(rng, kind)
            options, inputs = entry.sample(spec, rng)
            if builder.unsupported_reasons(spec, builder.options(options), builder.inputs(inputs)):
                continue
            builder.build(spec, stager, options, inputs)

    run.__name__ = f"audit_{builder.name}"
    return run


def audit_builder(
    builder: AnyBuilder | str,
    *,
    devices: tuple[str, ...] = ("meta", "cpu"),
    batches: int = 4,
) -> list[AuditRow]:
    """Run ``builder`` under the sync audit on generated batches of every kind, one row per device.

    The target is :func:`builder_target` (what ``python -m attnmeta audit`` runs for
    every registered builder), registered for the run and removed afterwards.

    Parameters
    ----------
    builder : Builder or str
        The builder or its registry name.
    devices : tuple of str, default ("meta", "cpu")
        Devices to audit on (``cpu`` is declared device data, so a host read of it is caught).
    batches : int, default 4
        Seeds per device; each builds one batch of every kind.

    Returns
    -------
    list of AuditRow
        ``row.clean`` is True when nothing read device data on the host; ``row.first_problem`` says
        what did.

    Examples
    --------
    >>> [row.clean for row in audit_builder("flash_attn", batches=1)]
    [True, True]
    """
    b = get_builder(builder) if isinstance(builder, str) else builder
    name = f"check:{b.name}"
    register_audit_target(name, builder_target(b), replace=True)
    try:
        return run_audit(devices=list(devices), batches=batches, targets=[name])
    finally:
        unregister_audit_target(name)
