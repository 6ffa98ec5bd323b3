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

Shape legend
------------
- ``num_reqs``: request rows ``B``, padding rows included (unchanged by the transform).
- ``num_logits``: logits indices ``L``, the fast batch's ``num_actual_tokens``.
- ``num_logits_padded``: ``L`` padded for the CUDA-graph dispatcher (``>= L``).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np
import numpy.typing as npt
import torch

from attnmeta._checks import as_host_array, check_option_fields, option_rule
from attnmeta._fields import MetadataBase
from attnmeta.backends._shared import alloc_indptr
from attnmeta.builder import Builder, register
from attnmeta.host.fast_prefill import fast_prefill_query_start_loc, max_logits_per_req, pad_logits_indices
from attnmeta.metadata import CommonAttentionMetadata, StagedCommon
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
        opts = options
        logits_indices, num_logits_padded = inputs.logits_indices, inputs.num_logits_padded
        h = common.host
        prof = step.profile
        p = opts.prefix + "."
        if logits_indices is None:
            return _wrap(step, common, None, None, None, applied=False)

        qsl, sl, pos = h.query_start_loc_cpu, h.seq_lens_cpu, h.positions_cpu
        B = h.num_reqs
        li = as_host_array(logits_indices, "logits_indices")
        L = li.shape[0]
        n_pad = L if num_logits_padded is None else num_logits_padded
        if type(n_pad) is not int and (isinstance(n_pad, bool) or not isinstance(n_pad, np.integer)):
            raise TypeError(f"num_logits_padded: expected an int or None, got {type(n_pad).__name__} {n_pad!r}")
        if n_pad < L:
            raise ValueError(f"num_logits_padded={n_pad} < num_logits={L} (len(logits_indices)); padding can only add "
                             f"entries")
        n_pad = int(n_pad)
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
        pad_logits_indices(li, li_full.shape[0], out=li_full)
        li_padded = li_full[:n_pad]

        if h.max_query_len == 1:
            # Quirk 1 of the fast-prefill semantics: an all-decode step is already decode-like; the
            # common metadata stays as is.
            fast_prefill_query_start_loc(qsl, li)  # still validate the indices (a tiny host temporary)
            return _wrap(step, common, li_padded, p, L, applied=False)
        req_cap = prof.max_num_reqs if prof is not None else None
        fqsl_full = alloc_indptr(step, p + "query_start_loc", B, req_cap)
        fqsl = fast_prefill_query_start_loc(qsl, li, out=fqsl_full[: B + 1])  # validates the indices too
        fqsl_full[B + 1 :] = fqsl[B]
        fpos = step.alloc(p + "positions", L, np.int64, fill=0,
                          capacity=prof.max_num_tokens if prof is not None else None)
        np.take(pos, li, out=fpos)
        nc = (sl - np.diff(fqsl)).astype(np.int32)
        max_q = max_logits_per_req(fqsl)
        for a in (fqsl_full, fqsl, fpos, nc):
            a.flags.writeable = False
        fast_host = dataclasses.replace(
            h, query_start_loc_cpu=fqsl, positions_cpu=fpos, num_computed_tokens_cpu=nc,
            num_decode_draft_tokens_cpu=None, num_actual_tokens=L, num_real_tokens=L, max_query_len=max_q,
            causal=True, splits={},
        )

        def make_common() -> CommonAttentionMetadata:
            cm = common.result()
            return cm.replace(
                query_start_loc=step.device(p + "query_start_loc")[: B + 1], query_start_loc_cpu=fqsl,
                positions=step.device(p + "positions"), positions_cpu=fpos, num_computed_tokens_cpu=nc,
                num_decode_draft_tokens_cpu=None, num_actual_tokens=L, num_real_tokens=L, max_query_len=max_q,
                causal=True,
            )

        return _wrap(step, StagedCommon(step, fast_host, make_common), li_padded, p, L, applied=True)


def _wrap(
    step: Step,
    common: StagedCommon,
    li_padded: np.ndarray | None,
    prefix: str | None,
    num_logits: int | None,
    *,
    applied: bool,
) -> Staged[FastPrefillHost, FastPrefillMetadata]:
    """The staged :class:`FastPrefillMetadata` around ``common`` (the fast batch or the original)."""
    host = FastPrefillHost(common, applied, num_logits, li_padded)

    def make() -> FastPrefillMetadata:
        cm = common.result()
        li_d = None
        if li_padded is not None:
            assert prefix is not None
            li_d = step.device(prefix + "logits_indices_padded")[: li_padded.shape[0]]
            li_padded.flags.writeable = False
        return FastPrefillMetadata(
            common=cm,
            query_start_loc=cm.query_start_loc,
            logits_indices_padded=li_d,
            query_start_loc_cpu=cm.query_start_loc_cpu,
            logits_indices_padded_cpu=li_padded,
            applied=applied,
            num_logits_indices=num_logits,
            max_query_len=cm.max_query_len,
        )

    return Staged(step, host, make)


FAST_PREFILL = register(FastPrefillBuilder())
"""The registered fast-prefill builder."""
stage = FAST_PREFILL.stage
build = FAST_PREFILL.build
