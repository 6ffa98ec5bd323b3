"""KV-sharing fast prefill (docs/semantics-attention.md), derived on the host.

With ``kv_sharing_fast_prefill``, the layers that reuse an earlier layer's KV cache compute only the
tokens whose logits are needed. Their attention runs a decode-like batch: row ``i`` holds the ``cnt_i``
logits positions of request ``i`` (its last tokens), aligned to the end of its full ``seq_lens[i]``-long
KV. This module turns the step's common metadata plus the host logits indices (the step's
:class:`FastPrefillInputs`) into that batch.

vLLM 0.33.0 derives the new ``query_start_loc`` on the device (``bucketize`` + ``scatter_add_`` +
``cumsum``) and takes its host twin from a non-blocking D2H copy that is still queued when builders read
it: a race (section 5.5). attnmeta computes it on the host from the host ``query_start_loc_cpu`` and the
host logits indices (:func:`attnmeta.host.fast_prefill.fast_prefill_query_start_loc`) and stages it, so
host and device twins agree by construction and nothing is read back.

The result type, and why
------------------------
:func:`stage` returns a :class:`FastPrefillMetadata` that **contains** a new
:class:`~attnmeta.metadata.CommonAttentionMetadata` (``.common``) plus the runner's logits fields. vLLM
instead builds a dynamic subclass of every wrapped backend's metadata class and re-attaches
``logits_indices_padded`` / ``num_logits_indices`` to it. attnmeta composes instead of subclassing
(composition over subclassing): the transformed batch *is* a common metadata object, every twin consistent, so any
backend builder takes it unchanged (``Staged.host.common`` is the staged form to pass to, e.g.,
:func:`attnmeta.backends.flash_attn.stage` in the same step), and the logits fields, which only the
runner and the KV-sharing layers read, stay out of the shared common type.

The fast-prefill common metadata (columns as in the 5.5 table):

===============================  ====================================================================
field                            value
===============================  ====================================================================
``query_start_loc`` (+_cpu)      ``[0, cumsum(cnt)]``, staged; ``cnt_i`` logits of row ``i``
``num_actual_tokens``            ``L = len(logits_indices)``
``num_real_tokens``              ``L``
``max_query_len``                ``max(cnt)``, exact (vLLM's ``max_logits_per_req``)
``positions`` (+_cpu)            ``positions[logits_indices]``, staged (vLLM: None; see below)
``num_computed_tokens_cpu``      ``seq_lens_cpu - cnt`` (re-derived)
``num_decode_draft_tokens_cpu``  None (as vLLM)
``causal``                       True
everything else                  unchanged: ``seq_lens``, ``seq_lens_cpu_upper_bound``,
                                 ``block_table_tensor``, ``slot_mapping`` (full length: KV-sharing
                                 layers write no KV), ``max_seq_len``, ``num_reqs``, ``is_prefilling``,
                                 ``block_size``
===============================  ====================================================================

Deviations from vLLM, both because attnmeta's common type always carries these fields: ``positions``
holds the fast batch's own per-token positions (vLLM sets None: the original ``(T,)`` positions would
be misaligned with the ``L`` fast tokens), and ``is_prefilling`` (a per-request fact the transform does
not change) is kept where vLLM drops it.

Quirks kept: if ``max_query_len == 1`` (an all-decode step) or no logits indices are given (not armed:
capture, a pure-decode step), the common metadata is returned unchanged.

Replay (:class:`attnmeta.compose.StepBuilder`): every step's staged fields are a function of its
scalars and the inputs' sizes: the padded logits indices (``num_logits_padded`` rows; graph mode the
full capacity), and when the transform runs (``max_query_len != 1``) the fast query starts (``num_reqs
+ 1``; graph mode the full capacity) and positions (``L`` rows). So every step replays its slot's layout
of that key (:meth:`FastPrefillBuilder.replay_key`): a replay checks the logits indices and writes every
own field with the derive's own function (:func:`_write`), and makes the fast batch's common metadata
and the metadata with the same functions (:func:`_changes`, :func:`_fast_common`, :func:`_metadata`).

Shape legend
------------
- ``num_reqs``: request rows ``B``, padding rows included (unchanged by the transform).
- ``num_logits``: logits indices ``L``, the fast batch's ``num_actual_tokens``.
- ``num_logits_padded``: ``L`` padded for the CUDA-graph dispatcher (``>= L``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable
from typing import Any, ClassVar, NamedTuple

import numpy as np
import numpy.typing as npt
import torch

from attnmeta._checks import as_host_array, check_option_fields, option_rule
from attnmeta._fields import MetadataBase, keyword_factory
from attnmeta.backends._shared import alloc_indptr, read_only_view
from attnmeta.builder import Builder, Replayer, register
from attnmeta.host.fast_prefill import fast_prefill_query_start_loc, max_logits_per_req, pad_logits_indices
from attnmeta.metadata import CommonAttentionMetadata, CommonHost, PagedKVMetadata, StagedCommon
from attnmeta.spec import StepShape
from attnmeta.staging import CapacityError, Staged, Step

__all__ = [
    "FAST_PREFILL",
    "FastPrefillBuilder",
    "FastPrefillHost",
    "FastPrefillInputs",
    "FastPrefillMetadata",
    "FastPrefillOptions",
    "build",
    "stage",
]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class FastPrefillOptions:
    """Options of the fast-prefill builder (the padded logits count is a per-step input)."""

    prefix: str = dataclasses.field(default="fast_prefill", metadata=option_rule("prefix"))
    """Namespace of this builder's staged fields."""

    def __post_init__(self) -> None:
        check_option_fields(self)


@dataclasses.dataclass(frozen=True, slots=True)
class FastPrefillHost:
    """The host part of a staged fast-prefill metadata, for builders staged after it."""

    common: StagedCommon
    """The fast batch as a staged common metadata (the step's own one when not ``applied``): stage
    other backends over it in the same step."""
    applied: bool
    """Whether the transform ran."""
    num_logits_indices: int | None
    """``L``, or None without logits indices."""
    logits_indices_padded_cpu: np.ndarray | None
    """(num_logits_padded,) int32, host, or None."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True, repr=False, eq=False)
class FastPrefillMetadata(MetadataBase):
    """The fast-prefill common metadata plus the runner's logits fields (see the module docstring).

    Examples
    --------
    The worked example of docs/semantics-attention.md: ``s = [41, 31, 40]``, ``q = [15, 5, 8]``, logits at ``[14, 18, 19, 27]``
    (two for the second request: spec decode), padded to 5:

    >>> import numpy as np
    >>> from attnmeta import BatchSpec, Stager
    >>> spec = BatchSpec(num_computed_tokens=[26, 26, 32], num_scheduled_tokens=[15, 5, 8],
    ...                  block_table=np.arange(9, dtype=np.int32).reshape(3, 3), block_size=16)
    >>> fp = build(spec, Stager("cpu"), None,
    ...            FastPrefillInputs(logits_indices=np.array([14, 18, 19, 27]), num_logits_padded=5))
    >>> fp.applied, fp.common.query_start_loc_cpu, fp.common.query_start_loc
    (True, array([0, 1, 3, 4], dtype=int32), tensor([0, 1, 3, 4], dtype=torch.int32))
    >>> fp.common.num_actual_tokens, fp.common.max_query_len, fp.common.seq_lens_cpu
    (4, 2, array([41, 31, 40], dtype=int32))
    >>> fp.logits_indices_padded, fp.num_logits_indices
    (tensor([14, 18, 19, 27, 27], dtype=torch.int32), 4)
    >>> fp.common.positions_cpu, fp.common.num_computed_tokens_cpu
    (array([40, 29, 30, 39]), array([40, 29, 39], dtype=int32))
    """

    _DEVICE_FIELDS: ClassVar[tuple[str, ...]] = ("query_start_loc", "logits_indices_padded")
    _HOST_FIELDS: ClassVar[tuple[str, ...]] = ("query_start_loc_cpu", "logits_indices_padded_cpu")
    _SCALAR_FIELDS: ClassVar[tuple[str, ...]] = ("applied", "num_logits_indices", "max_query_len")
    _TWINS: ClassVar[tuple[tuple[str, str], ...]] = (
        ("query_start_loc", "query_start_loc_cpu"),
        ("logits_indices_padded", "logits_indices_padded_cpu"),
    )

    common: CommonAttentionMetadata
    """The fast-prefill common metadata; the step's original one when ``applied`` is False."""
    query_start_loc: torch.Tensor
    """(num_reqs + 1,) int32, device. ``common.query_start_loc`` (the same view)."""
    logits_indices_padded: torch.Tensor | None
    """(num_logits_padded,) int32, device, or None without logits indices. The runner's buffer: the
    logits indices, then the last index repeated (every entry a valid token index)."""
    query_start_loc_cpu: np.ndarray
    """(num_reqs + 1,) int32, host. ``common.query_start_loc_cpu`` (the same view)."""
    logits_indices_padded_cpu: np.ndarray | None
    """(num_logits_padded,) int32, host (pinned staged view). Twin of ``logits_indices_padded``."""
    applied: bool
    """Whether the transform ran (False: ``max_query_len == 1`` or no logits indices)."""
    num_logits_indices: int | None
    """``L``, or None without logits indices."""
    max_query_len: int
    """``common.max_query_len``: ``max(cnt)`` when applied."""


_make_fp = keyword_factory(FastPrefillMetadata)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class FastPrefillInputs:
    """Per-step inputs of the fast-prefill builder.

    Examples
    --------
    >>> FastPrefillInputs(logits_indices=[0, 1], num_logits_padded=4).num_logits_padded
    4
    """

    logits_indices: npt.ArrayLike | None = None
    """(num_logits,) int, host: token positions whose logits are needed (unpadded), strictly
    increasing, each in ``[0, query_start_loc_cpu[-1])``: each request's last ``cnt_i`` tokens
    (``cnt_i = num_draft_tokens + 1`` under spec decode). None: not armed, nothing changes."""
    num_logits_padded: int | None = None
    """Length of ``logits_indices_padded`` (the CUDA-graph dispatcher's padded count, ``>= L``);
    default ``L``."""


class FastPrefillBuilder(Builder[FastPrefillOptions, FastPrefillInputs, FastPrefillHost, FastPrefillMetadata]):
    """The KV-sharing fast-prefill builder (:data:`FAST_PREFILL`).

    Examples
    --------
    An all-decode step is returned unchanged (the first quirk of the semantics):

    >>> from attnmeta import BatchSpec, Stager
    >>> spec = BatchSpec(num_computed_tokens=[4, 9], num_scheduled_tokens=[1, 1],
    ...                  block_table=[[1, 2], [3, 4]], block_size=8)
    >>> fp = build(spec, Stager("cpu"), None, FastPrefillInputs(logits_indices=[0, 1]))
    >>> fp.applied, fp.common.query_start_loc_cpu, fp.logits_indices_padded_cpu
    (False, array([0, 1, 2], dtype=int32), array([0, 1], dtype=int32))
    """

    name = "fast_prefill"
    options_type = FastPrefillOptions
    inputs_type = FastPrefillInputs
    metadata_type = FastPrefillMetadata

    def derive(self, common: StagedCommon, step: Step, options: FastPrefillOptions,
               inputs: FastPrefillInputs) -> Staged[FastPrefillHost, FastPrefillMetadata]:
        """Derive the fast-prefill batch from the staged common metadata, staging into the same step.

        Parameters
        ----------
        common : StagedCommon
            From :func:`attnmeta.stage_common` on the same ``step``.
        step : Step
            The open step.
        options : FastPrefillOptions
            Field namespace.
        inputs : FastPrefillInputs
            The logits indices (None: not armed, nothing changes) and their padded count.

        Returns
        -------
        Staged[FastPrefillHost, FastPrefillMetadata]
            ``.result()`` after the commit. ``.host.common`` is the :class:`~attnmeta.StagedCommon` of
            the fast batch, to stage other backends over it in the same step.

        Raises
        ------
        ValueError
            Logits indices out of range, unsorted, repeated or empty, or ``num_logits_padded < L``.
        TypeError
            ``logits_indices`` is a torch tensor (pass the host array) or not an integer array,
            ``num_logits_padded`` not an int.
        attnmeta.staging.CapacityError
            Graph mode: ``num_logits_padded`` above ``profile.max_num_tokens``.
        """
        h = common.host
        p = options.prefix + "."
        if inputs.logits_indices is None:  # not armed: the step's own common metadata

            def make_off() -> FastPrefillMetadata:
                """The metadata around the step's common metadata, after the commit."""
                return _metadata(common.result(), None, None, None)

            return _Staged(step, FastPrefillHost(common, False, None, None), make_off, None, None)
        li, L, n_pad = _logits(inputs)
        B = h.num_reqs
        own = _alloc(step, p, B, L, n_pad, applied=h.max_query_len != 1)
        fast = _write(h, li, own)
        views = _host_views(own, B, n_pad)
        if fast is None:
            # Quirk 1 of the fast-prefill semantics: an all-decode step is already decode-like; the
            # common metadata stays as is.
            out = common
        else:
            changes = _changes(views, L, *fast)
            fast_host = dataclasses.replace(h, **changes, splits={})

            def make_common() -> CommonAttentionMetadata:
                """The fast batch's common metadata, after the commit."""
                return _fast_common(common.result(), _device_views(step, p, own, B, n_pad), changes)

            out = StagedCommon(step, fast_host, make_common)

        def make() -> FastPrefillMetadata:
            """The metadata around the fast batch (or the step's own common metadata), after the commit."""
            return _metadata(out.result(), _device_views(step, p, own, B, n_pad), views, L)

        return _Staged(step, FastPrefillHost(out, fast is not None, L, views.logits_indices), make, own, views)

    def replay_key(self, shape: StepShape, options: FastPrefillOptions, inputs: FastPrefillInputs) -> Hashable | None:
        """Every step: ``"off"`` without logits indices (nothing staged); else whether the transform runs
        (``max_query_len != 1``: the fast query starts and positions are staged too), the logits count
        ``L`` (the positions' rows) and the padded count (the padded indices' rows in eager mode). None
        where the staged step raises (indices that are not one-dimensional, a padded count that is not an
        int >= ``L``)."""
        li = inputs.logits_indices
        if li is None:
            return "off"
        shp = np.shape(li)
        if len(shp) != 1:
            return None
        L = int(shp[0])
        n_pad = inputs.num_logits_padded
        if n_pad is None:
            n_pad = L
        elif isinstance(n_pad, bool) or not isinstance(n_pad, int | np.integer) or n_pad < L:
            return None
        return shape.max_query_len != 1, L, int(n_pad)

    def reads_lengths(self, options: FastPrefillOptions) -> bool:
        """False: neither :meth:`needs` (the default) nor :meth:`replay_key` reads the step's lengths."""
        return False

    def replayer(self, staged: Staged[FastPrefillHost, FastPrefillMetadata], common: StagedCommon, step: Step,
                 options: FastPrefillOptions, inputs: FastPrefillInputs) -> _Replayer | None:
        """Replays rewrite the recorded step's own fields (:func:`_write`) and make the metadata with this
        step's values (:func:`_changes`, :func:`_fast_common`, :func:`_metadata`); None where the step
        staged another layout than its key names (which it never does: the key and :func:`_alloc` read the
        same facts)."""
        if not isinstance(staged, _Staged):
            return None
        m = staged.result()
        own, views = staged.own, staged.views
        staged_key: Hashable = "off"
        if own is not None and views is not None:
            staged_key = (own.query_start_loc is not None, m.num_logits_indices, views.logits_indices.shape[0])
        spec = common.spec
        if (own is None) != (views is None) or (spec is not None and staged_key != self.replay_key(
                spec.shape, options, inputs)):
            return None
        dv = None if views is None else _device_views(step, options.prefix + ".", own, m.common.num_reqs,
                                                      views.logits_indices.shape[0])
        return _Replayer(m, own, views, dv)


class _Own(NamedTuple):
    """The writable host views of a step's own fields (the slot's memory, which a replay of its layout
    rewrites)."""

    logits_indices: np.ndarray
    """The staged ``logits_indices_padded`` in full (graph mode: all ``max_num_tokens`` entries)."""
    query_start_loc: np.ndarray | None
    """The staged fast query starts in full (graph mode: ``max_num_reqs + 1`` entries); None unless the
    transform runs."""
    positions: np.ndarray | None
    """(num_logits,) int64, the staged fast positions; None unless the transform runs."""


class _Views(NamedTuple):
    """The views of a step's own fields its metadata holds: read-only host views of :class:`_Own` (the same
    memory), or the device views of a committed step."""

    logits_indices: Any
    """(num_logits_padded,) int32."""
    query_start_loc: Any
    """(num_reqs + 1,) int32, or None unless the transform runs."""
    positions: Any
    """(num_logits,) int64, or None unless the transform runs."""


def _logits(inputs: FastPrefillInputs) -> tuple[np.ndarray, int, int]:
    """The step's logits indices (int32, host), their count ``L`` and the padded count, checked.

    Raises
    ------
    TypeError, ValueError
        As :meth:`FastPrefillBuilder.derive`.
    """
    li = as_host_array(inputs.logits_indices, "logits_indices")
    L = li.shape[0]
    n_pad = L if inputs.num_logits_padded is None else inputs.num_logits_padded
    if type(n_pad) is not int and (isinstance(n_pad, bool) or not isinstance(n_pad, np.integer)):
        raise TypeError(f"num_logits_padded: expected an int or None, got {type(n_pad).__name__} {n_pad!r}")
    if n_pad < L:
        raise ValueError(f"num_logits_padded={n_pad} < num_logits={L} (len(logits_indices)); padding can only add "
                         f"entries")
    return li, L, int(n_pad)


def _alloc(step: Step, p: str, B: int, L: int, n_pad: int, *, applied: bool) -> _Own:
    """Stage the own fields of a step of ``B`` rows and ``L`` logits padded to ``n_pad`` (graph mode: at
    the profile's capacities); the fast query starts and positions only when the transform runs.

    Raises
    ------
    attnmeta.staging.CapacityError
        Graph mode: ``n_pad`` above ``profile.max_num_tokens``.
    """
    prof = step.profile
    if prof is None:
        li_full = step.alloc(p + "logits_indices_padded", n_pad, np.int32)
    else:
        cap = prof.max_num_tokens
        if n_pad > cap:
            raise CapacityError(
                f"{p}logits_indices_padded: needs {n_pad} entries but its graph-mode capacity is {cap} "
                f"(StaticProfile.max_num_tokens)"
            )
        # The runner's buffer repeats the last index through its whole tail: stage the full capacity.
        li_full = step.alloc(p + "logits_indices_padded", cap, np.int32, capacity=cap)
    if not applied:
        return _Own(li_full, None, None)
    qsl_full = alloc_indptr(step, p + "query_start_loc", B, prof.max_num_reqs if prof is not None else None)
    pos = step.alloc(p + "positions", L, np.int64, fill=0, capacity=prof.max_num_tokens if prof is not None else None)
    return _Own(li_full, qsl_full, pos)


def _write(h: CommonHost, li: np.ndarray, own: _Own) -> tuple[np.ndarray, int] | None:
    """Write the step's values into every byte of ``own`` (graph mode's full-capacity tails included),
    checking the logits indices against the step's query starts: a staged and a replayed step alike.

    Returns the fast batch's per-step host values ``(num_computed_tokens_cpu, max_query_len)`` when the
    transform runs (``own`` has its query starts), else None.

    Raises
    ------
    ValueError
        Logits indices out of range, unsorted or repeated.
    """
    pad_logits_indices(li, own.logits_indices.shape[0], out=own.logits_indices)
    qsl = h.query_start_loc_cpu
    full, pos = own.query_start_loc, own.positions
    if full is None or pos is None:
        fast_prefill_query_start_loc(qsl, li)  # still validate the indices (a tiny host temporary)
        return None
    B = h.num_reqs
    fqsl = fast_prefill_query_start_loc(qsl, li, out=full[: B + 1])  # validates the indices too
    full[B + 1 :] = fqsl[B]
    np.take(h.positions_cpu, li, out=pos)
    nc = (h.seq_lens_cpu - np.diff(fqsl)).astype(np.int32)
    nc.flags.writeable = False
    return nc, max_logits_per_req(fqsl)


def _host_views(own: _Own, B: int, n_pad: int) -> _Views:
    """The read-only host views of ``own`` for a step of ``B`` rows (made once per layout: a replay writes
    the same memory)."""
    qsl = own.query_start_loc
    return _Views(read_only_view(own.logits_indices[:n_pad]), None if qsl is None else read_only_view(qsl[: B + 1]),
                  read_only_view(own.positions))


def _device_views(step: Step, p: str, own: _Own | None, B: int, n_pad: int) -> _Views | None:
    """The device views of a committed step's own fields (of prefix ``p``, ``B`` rows)."""
    if own is None:
        return None
    li = step.device(p + "logits_indices_padded")[:n_pad]
    if own.query_start_loc is None:
        return _Views(li, None, None)
    return _Views(li, step.device(p + "query_start_loc")[: B + 1], step.device(p + "positions"))


def _changes(views: _Views, L: int, nc: np.ndarray, max_q: int) -> dict[str, Any]:
    """The fast batch's host fields and scalars (the module docstring's table), for its host part and its
    common metadata: the own fields' views, and a step's values from :func:`_write`."""
    return {
        "query_start_loc_cpu": views.query_start_loc, "positions_cpu": views.positions,
        "num_computed_tokens_cpu": nc, "num_decode_draft_tokens_cpu": None, "num_actual_tokens": L,
        "num_real_tokens": L, "max_query_len": max_q, "causal": True,
    }


def _fast_common(cm: CommonAttentionMetadata, dv: _Views | None, changes: dict[str, Any]) -> CommonAttentionMetadata:
    """The fast batch's common metadata, after the commit: the step's ``cm`` with the own fields' device
    views ``dv`` and :func:`_changes`."""
    assert dv is not None
    return cm.replace(query_start_loc=dv.query_start_loc, positions=dv.positions, **changes)


def _metadata(cm: CommonAttentionMetadata, dv: _Views | None, views: _Views | None,
              num_logits: int | None) -> FastPrefillMetadata:
    """The step's metadata around ``cm`` (the fast batch's common metadata, or the step's own one), from
    the device and host views of its own fields (None without logits indices)."""
    return _make_fp(
        common=cm, query_start_loc=cm.query_start_loc, logits_indices_padded=None if dv is None else dv.logits_indices,
        query_start_loc_cpu=cm.query_start_loc_cpu,
        logits_indices_padded_cpu=None if views is None else views.logits_indices,
        applied=views is not None and views.query_start_loc is not None, num_logits_indices=num_logits,
        max_query_len=cm.max_query_len,
    )


class _Staged(Staged[FastPrefillHost, FastPrefillMetadata]):
    """A staged fast-prefill step: its own fields' writable and read-only host views (for a replayer of
    its layout)."""

    __slots__ = ("own", "views")

    def __init__(self, step: Step, host: FastPrefillHost, make: Callable[[], FastPrefillMetadata], own: _Own | None,
                 views: _Views | None) -> None:
        super().__init__(step, host, make)
        self.own, self.views = own, views


class _Replayer(Replayer[FastPrefillInputs, FastPrefillMetadata]):
    """Replays of a fast-prefill layout: :func:`_write` into the recorded step's own fields (the slot's
    memory, at the same places), then the metadata with :func:`_metadata` around this step's common
    metadata or its fast batch (:func:`_fast_common` with this step's :func:`_changes`) and the recorded
    step's views (which a replay stages at the same places of the same slot)."""

    __slots__ = ("dv", "fast", "num_logits", "own", "views")

    def __init__(self, recorded: FastPrefillMetadata, own: _Own | None, views: _Views | None,
                 dv: _Views | None) -> None:
        self.own, self.views, self.dv = own, views, dv
        self.num_logits = recorded.num_logits_indices  # (the layout's: its key names it)
        self.fast: tuple[Step, tuple[np.ndarray, int] | None] | None = None

    def rewrite(self, step: Step, host: CommonHost, inputs: FastPrefillInputs) -> None:
        """Check the step's logits indices and write them, padded, and (when the transform runs) the fast
        query starts and positions into the own fields (:func:`_write`)."""
        self.fast = None  # (until the write succeeds)
        if self.own is not None:
            li, _L, _n_pad = _logits(inputs)
            self.fast = (step, _write(host, li, self.own))

    def result(self, step: Step, common: CommonAttentionMetadata, host: CommonHost, paged: PagedKVMetadata | None,
               inputs: FastPrefillInputs) -> FastPrefillMetadata:
        """The step's metadata (:func:`_metadata`) around its common metadata or its fast batch."""
        views = self.views
        if self.own is None or views is None:
            return _metadata(common, None, None, None)
        f, self.fast = self.fast, None
        assert f is not None and f[0] is step, "result() without this step's rewrite()"
        L = self.num_logits
        assert L is not None
        cm = common if f[1] is None else _fast_common(common, self.dv, _changes(views, L, *f[1]))
        return _metadata(cm, self.dv, views, L)


FAST_PREFILL = register(FastPrefillBuilder())
"""The registered fast-prefill builder."""
stage = FAST_PREFILL.stage
build = FAST_PREFILL.build
