"""Multimodal bidirectional prefix ranges (docs/semantics-attention.md, "MMPrefixMetadata").

Prefix-LM multimodal models (Gemma3, PaliGemma, Molmo2, DeepSeek V4 vision, ...) let the tokens of one
image or video attend to each other bidirectionally. vLLM 0.33.0 derives, once per step, the inclusive
prompt ranges of every request's image/video placeholders (``compute_mm_prefix_ranges``), then each
backend turns them into its own array: the Triton/Flex form ``(num_reqs, max_ranges, 2)`` (a nested
Python list and a fresh pinned tensor per step) or the FlashAttention-4 form, one ``[start, end]`` per
scheduled query token (Python loops over rows and ranges). This builder does both on the host from
flat arrays, in compiled loops, and stages the chosen form in the step's one copy; the ranges
themselves stay host-only (never staged), as vLLM's ``keep_on_cpu`` multimodal fields do.

The per-step inputs (:class:`MMPrefixInputs`, host only, a CSR over the real requests)
-------------------------------------------------------------------------------------
- ``mm_span_indptr``: ``(num_real_reqs + 1,)`` int, ``[0] == 0``, non-decreasing; request ``i``'s
  spans are ``indptr[i]:indptr[i + 1]``.
- ``mm_span_starts`` / ``mm_span_lengths``: ``(num_spans,)`` int; each placeholder's ``offset >= 0``
  and ``length >= 1`` (vLLM's ``PlaceholderRange``), image and video features only, in the order of
  the request's features; no two spans of a request overlap.
- ``mm_is_embed``: ``(sum(mm_span_lengths),)`` bool, optional: every span's ``is_embed`` mask, the
  spans concatenated (all True for a span without one; None: all True).

Rules (vLLM's, kept exactly)
----------------------------
- A span gives one range per run of True in its ``is_embed`` (``(offset, offset + length - 1)``
  without one); with ``span_pad`` it gives the single range ``(offset // pad * pad + pad - 1, offset +
  length - 1)`` whatever its mask.
- A range longer than ``sliding_window`` tokens is dropped, unless ``clamp_sliding_window`` (then it is
  kept unchanged: the kernel clamps it).
- Triton form: each row padded with ``(0, 0)`` to the longest row; an empty row is ``[(0, 0)]``; None
  when every row is ``[(0, 0)]`` (a lone real range ``(0, 0)`` included).
- FlashAttention form: one-token ranges (``start == end``) and ranges with ``start > end`` are skipped;
  a token gets the range that covers its absolute position (context ``c = seq_lens_upper_bound - q``),
  so a later prefill chunk gets the part of a range inside it; None when no token is covered.

What is staged, and replay
--------------------------
A step without spans stages nothing. With spans, the FlashAttention form is staged for every scheduled
token (``-1`` where no range covers one; the metadata holds it only when a token is covered), and in
graph mode the Triton form at ``(num_reqs, graph_max_ranges, 2)`` (zeros where the form is None); in
eager mode the Triton form is staged only when a row has a range, ``max_ranges`` wide. (In graph mode a
field a step does not stage holds its sentinel, ``-1`` or 0: the same bytes, so a captured kernel sees
no difference.) The staged rows are therefore a function of the step's scalars and whether it has spans
(:meth:`MMPrefixBuilder.replay_key`), but for the eager Triton form, whose width is the widest row's
range count (per-row data): those steps are always composed. A replay (:class:`attnmeta.compose.StepBuilder`)
checks the spans and derives the ranges as ``derive`` does (:func:`_host_ranges`), writes the form into
every staged byte with the same compiled fills (:func:`_write`) and makes the metadata with the same
function (:func:`_metadata`).

Shape legend
------------
- ``num_reqs``: request rows, padding included; ``num_real_reqs``: before padding.
- ``num_spans``: placeholder spans of the step; ``num_ranges``: ranges derived from them.
- ``max_ranges``: the most ranges of one row (at least 1) in the Triton form.
- ``num_tokens``: ``query_start_loc_cpu[-1]``, the scheduled tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable
from typing import Any, ClassVar, Literal, NamedTuple

import numpy as np
import numpy.typing as npt
import torch

from attnmeta._checks import as_host_array, check_option_fields, option_rule
from attnmeta._fields import MetadataBase, keyword_factory
from attnmeta._numba import njit
from attnmeta.backends._shared import read_only_view
from attnmeta.builder import Builder, CommonNeeds, Replayer, register
from attnmeta.metadata import CommonAttentionMetadata, CommonHost, PagedKVMetadata, StagedCommon
from attnmeta.spec import BatchSpec, StepShape
from attnmeta.staging import CapacityError, Staged, Step

__all__ = [
    "MM_PREFIX",
    "MMPrefixBuilder",
    "MMPrefixInputs",
    "MMPrefixMetadata",
    "MMPrefixOptions",
    "build",
    "mm_prefix_ranges",
    "stage",
]

_I32_MAX = 2**31 - 1


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class MMPrefixOptions:
    """Options of the multimodal prefix-range builder (the spans are per-step inputs)."""

    form: Literal["triton", "flash_attn"] = dataclasses.field(
        default="triton", metadata=option_rule("choice", choices=("triton", "flash_attn")))
    """Which backend form is staged: ``"triton"`` (Triton/Flex: ``mm_prefix_range_tensor``, per row) or
    ``"flash_attn"`` (FA4 mask mod: ``mm_prefix_query_range_tensor``, per query token)."""
    sliding_window: int | None = dataclasses.field(default=None, metadata=option_rule("int", minimum=1,
                                                                                     allow_none=True))
    """Drop ranges longer than this many tokens (None: keep every range)."""
    clamp_sliding_window: bool = dataclasses.field(default=False, metadata=option_rule("bool"))
    """Keep the ranges longer than ``sliding_window`` (Gemma4 sliding layers; the kernel clamps them)."""
    span_pad: int | None = dataclasses.field(default=None, metadata=option_rule("int", minimum=1,
                                                                               allow_none=True))
    """DeepSeek V4's ``mm_prefix_span_leading_pad_modulus``: one range per span, starting at
    ``offset // span_pad * span_pad + span_pad - 1`` (None: the ``is_embed`` runs)."""
    prefix: str = dataclasses.field(default="mm_prefix", metadata=option_rule("prefix"))
    """Namespace of this builder's staged fields."""
    graph_max_ranges: int = dataclasses.field(default=8, metadata=option_rule("int", minimum=1))
    """Graph mode, Triton form: the ranges of a row the fixed buffer holds. Every graph-mode step with
    spans stages ``(num_reqs, graph_max_ranges, 2)`` (rows' unused ranges ``(0, 0)``), so a captured
    kernel reads one row stride whatever the step; a row with more ranges raises ``CapacityError``."""

    def __post_init__(self) -> None:
        check_option_fields(self)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True, repr=False, eq=False)
class MMPrefixMetadata(MetadataBase):
    """The bidirectional ranges of a step: the staged backend form and the host-only ranges.

    Examples
    --------
    The worked example of docs/semantics-attention.md: row 0 has an image at offset 2 (5 tokens), row
    1 nothing, row 2 an image at offset 0 with ``is_embed = [F, T, T, F, T, T]`` and a 300-token video
    at offset 20:

    >>> import numpy as np
    >>> from attnmeta import BatchSpec, Stager
    >>> spec = BatchSpec(num_computed_tokens=[0, 0, 0], num_scheduled_tokens=[7, 3, 8],
    ...                  block_table=np.zeros((3, 1), np.int32), block_size=512)
    >>> spans = MMPrefixInputs(mm_span_indptr=[0, 1, 1, 3], mm_span_starts=[2, 0, 20], mm_span_lengths=[5, 6, 300],
    ...                        mm_is_embed=np.array([1] * 5 + [0, 1, 1, 0, 1, 1] + [1] * 300, bool))
    >>> m = build(spec, Stager("cpu"), None, spans)
    >>> m.doc_ranges()
    {0: [(2, 6)], 1: [], 2: [(1, 2), (4, 5), (20, 319)]}
    >>> m.mm_prefix_range_tensor.tolist()
    [[[2, 6], [0, 0], [0, 0]], [[0, 0], [0, 0], [0, 0]], [[1, 2], [4, 5], [20, 319]]]
    """

    _DEVICE_FIELDS: ClassVar[tuple[str, ...]] = ("mm_prefix_range_tensor", "mm_prefix_query_range_tensor")
    _HOST_FIELDS: ClassVar[tuple[str, ...]] = (
        "mm_prefix_range_tensor_cpu", "mm_prefix_query_range_tensor_cpu", "mm_range_indptr_cpu", "mm_ranges_cpu",
    )
    _SCALAR_FIELDS: ClassVar[tuple[str, ...]] = ("form", "num_ranges", "max_ranges", "num_query_range_rows")
    _TWINS: ClassVar[tuple[tuple[str, str], ...]] = (
        ("mm_prefix_range_tensor", "mm_prefix_range_tensor_cpu"),
        ("mm_prefix_query_range_tensor", "mm_prefix_query_range_tensor_cpu"),
    )

    mm_prefix_range_tensor: torch.Tensor | None
    """(num_reqs, max_ranges, 2) int32, device, or None (the ``"flash_attn"`` form, or every row
    ``[(0, 0)]``). Triton/Flex form: row ``i``'s inclusive ``[start, end]`` ranges, padded with
    ``(0, 0)``; padding rows and rows without ranges ``(0, 0)``."""
    mm_prefix_query_range_tensor: torch.Tensor | None
    """(num_tokens, 2) int32, device, or None (the ``"triton"`` form, or no token covered). FA4 form:
    per scheduled token the absolute ``[start, end]`` of the range (``start < end``) covering its
    position, else ``(-1, -1)``."""
    mm_prefix_range_tensor_cpu: np.ndarray | None
    """(num_reqs, max_ranges, 2) int32, host (pinned staged view), or None. Twin of
    ``mm_prefix_range_tensor``."""
    mm_prefix_query_range_tensor_cpu: np.ndarray | None
    """(num_tokens, 2) int32, host (pinned staged view), or None. Twin of
    ``mm_prefix_query_range_tensor``."""
    mm_range_indptr_cpu: np.ndarray
    """(num_real_reqs + 1,) int32, host only (never staged). Request ``i``'s ranges are
    ``mm_ranges_cpu[indptr[i]:indptr[i + 1]]``."""
    mm_ranges_cpu: np.ndarray
    """(num_ranges, 2) int32, host only (never staged). vLLM's ``mm_req_doc_ranges``: inclusive absolute
    prompt positions, one-token ranges included."""
    form: str
    """The staged form: ``"triton"`` or ``"flash_attn"``."""
    num_ranges: int
    """Ranges after the sliding-window rule."""
    max_ranges: int
    """Columns of ``mm_prefix_range_tensor`` (0 when it is None)."""
    num_query_range_rows: int
    """Rows of ``mm_prefix_query_range_tensor`` (0 when it is None: vLLM's return value)."""

    def doc_ranges(self) -> dict[int, list[tuple[int, int]]]:
        """vLLM's ``mm_req_doc_ranges`` dict from the host-only fields: every real row a key (possibly an
        empty list), inclusive ``(start, end)`` tuples. Reads host memory only."""
        ip, r = self.mm_range_indptr_cpu.tolist(), self.mm_ranges_cpu.tolist()
        return {i: [(s, e) for s, e in r[ip[i]:ip[i + 1]]] for i in range(len(ip) - 1)}


_make_mm = keyword_factory(MMPrefixMetadata)


# ------------------------------------------------------------------------------------------------
# host derivation: private compiled kernels behind the validating wrapper
# ------------------------------------------------------------------------------------------------


@njit
def _ranges_nb(indptr: np.ndarray, starts: np.ndarray, lengths: np.ndarray, is_embed: np.ndarray,
               has_embed: bool, window: int, clamp: bool, pad: int, out_indptr: np.ndarray,
               out: np.ndarray, write: bool) -> int:  # pragma: no cover (compiled)
    """Count (``write`` False) or write the ranges of every request; returns the count.
    ``window``/``pad`` 0 mean unset."""
    n = 0
    emb_off = np.int64(0)
    nreq = indptr.shape[0] - 1
    for r in range(nreq):
        if write:
            out_indptr[r] = n
        for j in range(indptr[r], indptr[r + 1]):
            s = np.int64(starts[j])
            ln = np.int64(lengths[j])
            base = emb_off
            emb_off = emb_off + ln
            if pad > 0:
                a = s // pad * pad + pad - 1
                b = s + ln - 1
                if window > 0 and not clamp and b - a + 1 > window:
                    continue
                if write:
                    out[n, 0] = a
                    out[n, 1] = b
                n += 1
                continue
            k = 0
            while k < ln:
                if has_embed and not is_embed[base + k]:
                    k += 1
                    continue
                e = k
                while e + 1 < ln and (not has_embed or is_embed[base + e + 1]):
                    e += 1
                a = s + k
                b = s + e
                k = e + 1
                if window > 0 and not clamp and b - a + 1 > window:
                    continue
                if write:
                    out[n, 0] = a
                    out[n, 1] = b
                n += 1
    if write:
        out_indptr[nreq] = n
    return n


@njit
def _triton_rows_nb(range_indptr: np.ndarray, ranges: np.ndarray, num_rows: int) -> int:  # pragma: no cover
    """``max_ranges`` of the Triton form, or 0 when every row is ``[(0, 0)]`` (the form is None)."""
    nreal = range_indptr.shape[0] - 1
    width = 1
    trivial = True
    for i in range(min(nreal, num_rows)):
        c = range_indptr[i + 1] - range_indptr[i]
        if c > width:
            width = c
        if c > 1 or (c == 1 and (ranges[range_indptr[i], 0] != 0 or ranges[range_indptr[i], 1] != 0)):
            trivial = False
    return 0 if trivial else width


@njit
def _triton_fill_nb(range_indptr: np.ndarray, ranges: np.ndarray, num_rows: int, width: int,
                    out: np.ndarray) -> None:  # pragma: no cover (compiled)
    """Write the ``(num_rows, width, 2)`` Triton form, flattened, into ``out``."""
    out[:] = 0
    nreal = range_indptr.shape[0] - 1
    for i in range(min(nreal, num_rows)):
        for k in range(range_indptr[i + 1] - range_indptr[i]):
            o = (i * width + k) * 2
            out[o] = ranges[range_indptr[i] + k, 0]
            out[o + 1] = ranges[range_indptr[i] + k, 1]


@njit
def _query_ranges_nb(range_indptr: np.ndarray, ranges: np.ndarray, qsl: np.ndarray, ub: np.ndarray,
                     out: np.ndarray, write: bool) -> bool:  # pragma: no cover (compiled)
    """vLLM's ``fill_mm_prefix_query_ranges`` loop: whether any token is covered; with ``write`` the
    ``(-1, -1)`` fill and the covered spans into ``out`` (``(qsl[-1], 2)``)."""
    covered = False
    if write:
        out[:, :] = -1
    nreal = range_indptr.shape[0] - 1
    for row in range(nreal):
        q = np.int64(qsl[row + 1]) - qsl[row]
        if q <= 0:
            continue
        c = np.int64(ub[row]) - q
        for k in range(range_indptr[row], range_indptr[row + 1]):
            start = np.int64(ranges[k, 0])
            end = np.int64(ranges[k, 1])
            if start >= end:
                continue
            first = max(start - c, 0)
            last = min(end - c, q - 1)
            if first <= last:
                covered = True
                if write:
                    for t in range(qsl[row] + first, qsl[row] + last + 1):
                        out[t, 0] = start
                        out[t, 1] = end
    return covered


def _span_where(indptr: np.ndarray, j: int) -> str:
    """``request i, span j`` of flat span index ``j``."""
    return f"request {int(np.searchsorted(indptr, j, side='right')) - 1}, span {j}"


def _check_spans(mm_span_indptr: Any, mm_span_starts: Any, mm_span_lengths: Any, mm_is_embed: Any,
                 num_reqs: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """The validated spans (int32 CSR, bool mask or None); errors name the input, request and span."""
    indptr = as_host_array(mm_span_indptr, "mm_span_indptr", length=num_reqs + 1)
    starts = as_host_array(mm_span_starts, "mm_span_starts")
    lengths = as_host_array(mm_span_lengths, "mm_span_lengths")
    n = starts.shape[0]
    if lengths.shape[0] != n:
        raise ValueError(f"mm_span_lengths: {lengths.shape[0]} entries but mm_span_starts has {n} (one offset and "
                         f"one length per span)")
    if indptr[0] != 0:
        raise ValueError(f"mm_span_indptr[0]={int(indptr[0])}, expected 0")
    d = np.diff(indptr)
    if d.size and int(d.min()) < 0:
        i = int(np.argmax(d < 0))
        raise ValueError(f"mm_span_indptr[{i + 1}]={int(indptr[i + 1])} < mm_span_indptr[{i}]={int(indptr[i])} "
                         f"(request {i}): the offsets must not decrease")
    if int(indptr[-1]) != n:
        raise ValueError(f"mm_span_indptr[-1]={int(indptr[-1])} != {n} spans (len(mm_span_starts))")
    if n:
        if int(starts.min()) < 0:
            j = int(np.argmax(starts < 0))
            raise ValueError(f"mm_span_starts[{j}]={int(starts[j])} < 0 ({_span_where(indptr, j)})")
        if int(lengths.min()) < 1:
            j = int(np.argmax(lengths < 1))
            raise ValueError(f"mm_span_lengths[{j}]={int(lengths[j])} < 1 ({_span_where(indptr, j)}): a placeholder "
                             f"holds at least one token")
        ends = starts.astype(np.int64) + lengths
        if int(ends.max()) > _I32_MAX:
            j = int(np.argmax(ends > _I32_MAX))
            raise ValueError(f"mm_span_starts[{j}] + mm_span_lengths[{j}] = {int(ends[j])} does not fit int32 "
                             f"({_span_where(indptr, j)})")
        if n > 1:  # a request's placeholders are distinct prompt tokens: no two of its spans overlap
            req = np.repeat(np.arange(num_reqs), np.diff(indptr))
            order = np.lexsort((starts, req))
            s, e, r = starts[order], ends[order], req[order]
            bad = (r[1:] == r[:-1]) & (s[1:] < e[:-1])
            if bad.any():
                k = int(np.argmax(bad))
                i, j = sorted((int(order[k]), int(order[k + 1])))
                raise ValueError(f"mm_span_starts: spans {i} [{int(starts[i])}, {int(ends[i])}) and {j} "
                                 f"[{int(starts[j])}, {int(ends[j])}) of request {int(r[k])} overlap (a request's "
                                 f"placeholders are distinct prompt tokens)")
    embed = None
    if mm_is_embed is not None:
        total = int(lengths.sum(dtype=np.int64))
        embed = as_host_array(mm_is_embed, "mm_is_embed", dtype=np.bool_)
        if embed.shape[0] != total:
            raise ValueError(f"mm_is_embed: {embed.shape[0]} entries, expected sum(mm_span_lengths)={total} (every "
                             f"span's mask, concatenated)")
    return indptr, starts, lengths, embed


def mm_prefix_ranges(
    mm_span_indptr: Any,
    mm_span_starts: Any,
    mm_span_lengths: Any,
    mm_is_embed: Any = None,
    *,
    sliding_window: int | None = None,
    clamp_sliding_window: bool = False,
    span_pad: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """vLLM's ``compute_mm_prefix_ranges`` on flat host arrays: every request's inclusive ranges.

    Parameters
    ----------
    mm_span_indptr : (num_reqs + 1,) int, host
        Request ``i``'s spans are ``indptr[i]:indptr[i + 1]``; ``[0] == 0``, non-decreasing.
    mm_span_starts : (num_spans,) int, host
        Each image/video placeholder's prompt offset (``>= 0``).
    mm_span_lengths : (num_spans,) int, host
        Each placeholder's length (``>= 1``).
    mm_is_embed : (sum(mm_span_lengths),) bool, host, optional
        The spans' ``is_embed`` masks, concatenated (None: all True).
    sliding_window : int, optional
        Drop ranges longer than this (``end - start + 1 > sliding_window``).
    clamp_sliding_window : bool, default False
        Keep those ranges instead.
    span_pad : int, optional
        One range per span: ``(offset // span_pad * span_pad + span_pad - 1, offset + length - 1)``.

    Returns
    -------
    range_indptr : (num_reqs + 1,) int32, host
        Request ``i``'s ranges are ``ranges[range_indptr[i]:range_indptr[i + 1]]``.
    ranges : (num_ranges, 2) int32, host
        Inclusive ``(start, end)``.

    Raises
    ------
    ValueError
        A malformed CSR, a negative offset, a length below 1 (naming the request and span), a mask of
        the wrong length.
    TypeError
        A torch tensor, a non-integer array or a non-bool mask.

    Examples
    --------
    >>> import numpy as np
    >>> emb = np.array([1] * 5 + [0, 1, 1, 0, 1, 1] + [1] * 300, bool)
    >>> ip, r = mm_prefix_ranges([0, 1, 1, 3], [2, 0, 20], [5, 6, 300], emb)
    >>> ip.tolist(), r.tolist()
    ([0, 1, 1, 4], [[2, 6], [1, 2], [4, 5], [20, 319]])
    >>> mm_prefix_ranges([0, 1, 1, 3], [2, 0, 20], [5, 6, 300], emb, sliding_window=256)[1].tolist()
    [[2, 6], [1, 2], [4, 5]]
    >>> mm_prefix_ranges([0, 1, 1, 3], [2, 0, 20], [5, 6, 300], emb, span_pad=4)[1].tolist()
    [[3, 6], [3, 5], [23, 319]]
    """
    ip = as_host_array(mm_span_indptr, "mm_span_indptr")
    indptr, starts, lengths, embed = _check_spans(ip, mm_span_starts, mm_span_lengths, mm_is_embed,
                                                  max(ip.shape[0] - 1, 0))
    for name, v in (("sliding_window", sliding_window), ("span_pad", span_pad)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int | np.integer) or v < 1):
            raise ValueError(f"{name}: expected None or an int >= 1, got {v!r}")
    return _derive_ranges(indptr, starts, lengths, embed, sliding_window, bool(clamp_sliding_window), span_pad)


_NO_EMBED = np.zeros(0, np.bool_)


def _derive_ranges(indptr: np.ndarray, starts: np.ndarray, lengths: np.ndarray, embed: np.ndarray | None,
                   window: int | None, clamp: bool, pad: int | None) -> tuple[np.ndarray, np.ndarray]:
    """The compiled two passes (count, write) over validated spans."""
    out_ip = np.zeros(indptr.shape[0], np.int32)
    e = _NO_EMBED if embed is None else embed
    args = (indptr, starts, lengths, e, embed is not None, window or 0, clamp, pad or 0, out_ip)
    n = _ranges_nb(*args, np.zeros((0, 2), np.int32), False)
    out = np.empty((n, 2), np.int32)
    _ranges_nb(*args, out, True)
    return out_ip, out


# ------------------------------------------------------------------------------------------------
# the builder
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class MMPrefixInputs:
    """Per-step inputs of the multimodal prefix-range builder: the step's image/video spans (all None:
    no request has a span).

    Examples
    --------
    >>> MMPrefixInputs(mm_span_indptr=[0, 1], mm_span_starts=[2], mm_span_lengths=[5]).mm_is_embed is None
    True
    """

    mm_span_indptr: npt.ArrayLike | None = None
    """(num_real_reqs + 1,) int, host: the spans of real request ``i`` are ``indptr[i]:indptr[i + 1]``."""
    mm_span_starts: npt.ArrayLike | None = None
    """(num_spans,) int, host: each image/video placeholder's prompt offset (``>= 0``)."""
    mm_span_lengths: npt.ArrayLike | None = None
    """(num_spans,) int, host: each placeholder's length (``>= 1``)."""
    mm_is_embed: npt.ArrayLike | None = None
    """(sum(mm_span_lengths),) bool, host: the spans' ``is_embed`` masks, concatenated (None: all True)."""


class MMPrefixBuilder(Builder[MMPrefixOptions, MMPrefixInputs, None, MMPrefixMetadata]):
    """The multimodal bidirectional prefix-range builder (:data:`MM_PREFIX`).

    Examples
    --------
    The FlashAttention form of the worked example, a later prefill chunk included: row 2 is at
    positions 21-24 of its prompt, inside the video range (20, 319):

    >>> import numpy as np
    >>> from attnmeta import BatchSpec, Stager
    >>> spec = BatchSpec(num_computed_tokens=[0, 17, 21], num_scheduled_tokens=[6, 3, 4],
    ...                  block_table=np.zeros((3, 1), np.int32), block_size=512)
    >>> m = build(spec, Stager("cpu"), MMPrefixOptions(form="flash_attn"), MMPrefixInputs(
    ...           mm_span_indptr=[0, 1, 1, 3], mm_span_starts=[2, 0, 20], mm_span_lengths=[5, 6, 300],
    ...           mm_is_embed=np.array([1] * 5 + [0, 1, 1, 0, 1, 1] + [1] * 300, bool)))
    >>> m.num_query_range_rows, m.mm_prefix_query_range_tensor[:, 0].tolist()
    (13, [-1, -1, 2, 2, 2, 2, -1, -1, -1, 20, 20, 20, 20])
    """

    name = "mm_prefix"
    options_type = MMPrefixOptions
    inputs_type = MMPrefixInputs
    metadata_type = MMPrefixMetadata

    def needs(self, shape: StepShape, options: MMPrefixOptions) -> CommonNeeds:
        """Only the query starts and sequence lengths: no per-token arrays."""
        return CommonNeeds(token_arrays=False)

    def derive(self, common: StagedCommon, step: Step, options: MMPrefixOptions,
               inputs: MMPrefixInputs) -> Staged[None, MMPrefixMetadata]:
        """Derive the ranges and the chosen backend form on the host, staging the form into ``step``.

        Parameters
        ----------
        common : StagedCommon
            From :func:`attnmeta.stage_common` on the same ``step``.
        step : Step
            The open step.
        options : MMPrefixOptions
            The form, the sliding-window rule and ``span_pad``.
        inputs : MMPrefixInputs
            The step's spans (all None: no request has a span).

        Returns
        -------
        Staged[None, MMPrefixMetadata]
            ``.result()`` after the commit.

        Raises
        ------
        ValueError
            Malformed spans (the input, request and span named).
        TypeError
            A torch tensor (pass the host array), a non-integer array or a non-bool mask.
        attnmeta.staging.CapacityError
            Graph mode: more scheduled tokens, requests or ranges than the profile holds.
        """
        h = common.host
        p = options.prefix + "."
        graph = step.profile is not None
        r_ip, ranges, spans = _host_ranges(step, p, h.num_real_reqs, options, inputs)
        width = _triton_width(r_ip, ranges, h.num_reqs, options, graph) if options.form == "triton" else 0
        own = _alloc(step, p, h, options, spans, width)
        max_ranges, rows = _write(h, options, r_ip, ranges, width, own)
        views = _host_views(own, h.num_reqs)
        if options.form == "flash_attn":
            layout: Hashable | None = ("flash_attn", int(h.query_start_loc_cpu[-1])) if spans else "none"
        else:
            layout = ("triton" if graph else None) if spans else "none"

        def make() -> MMPrefixMetadata:
            """The metadata, after the commit."""
            return _metadata(views, _device_views(step, p, own, h.num_reqs), r_ip, ranges, options.form, max_ranges,
                             rows)

        return _Staged(step, make, own, views, layout)

    def unsupported_reasons(self, spec: BatchSpec, options: MMPrefixOptions, inputs: MMPrefixInputs) -> list[str]:
        """A context-parallel batch: the ranges are absolute prompt positions and this builder does not
        model a rank's share of the KV (vLLM's mm-prefix backends, Triton and FA4, have no DCP path)."""
        if spec.context_parallel is not None:
            return ["mm_prefix: context-parallel batches are not supported (the ranges are absolute prompt "
                    "positions; a rank's local KV share is not modelled)"]
        return []

    def replay_key(self, shape: StepShape, options: MMPrefixOptions, inputs: MMPrefixInputs) -> Hashable | None:
        """What the staged form's rows depend on (module docstring, "What is staged, and replay"):
        ``"none"`` for a step without spans (nothing staged); with spans, ``("flash_attn", num_tokens)``
        (the per-token form, staged for every token) or ``"triton"`` (graph mode's ``(num_reqs,
        graph_max_ranges, 2)``; in eager mode its width is the widest row's range count, per-row data:
        :meth:`replayer` declines those steps). None for inputs the staged step refuses (some spans given
        but not the offsets, offsets that are not one-dimensional)."""
        starts = inputs.mm_span_starts
        if starts is None:
            given = (inputs.mm_span_indptr, inputs.mm_span_lengths, inputs.mm_is_embed)
            return "none" if all(v is None for v in given) else None
        shp = np.shape(starts)
        if len(shp) != 1:
            return None
        if not shp[0]:
            return "none"
        return ("flash_attn", shape.num_tokens) if options.form == "flash_attn" else "triton"

    def reads_lengths(self, options: MMPrefixOptions) -> bool:
        """False: neither :meth:`needs` nor :meth:`replay_key` reads the step's lengths."""
        return False

    def replayer(self, staged: Staged[None, MMPrefixMetadata], common: StagedCommon, step: Step,
                 options: MMPrefixOptions, inputs: MMPrefixInputs) -> _Replayer | None:
        """Replays rewrite the recorded step's staged form (:func:`_write`) and make the metadata with
        :func:`_metadata`. None for an eager step of the Triton form with spans (its width is per-row data:
        such steps are always composed), and where the step staged another layout than its key names."""
        if not isinstance(staged, _Staged) or staged.layout is None:
            return None
        spec = common.spec
        if spec is not None and staged.layout != self.replay_key(spec.shape, options, inputs):
            return None
        h = common.host
        return _Replayer(options, staged.own, staged.views,
                         _device_views(step, options.prefix + ".", staged.own, h.num_reqs), step.profile is not None)


class _Own(NamedTuple):
    """The writable host views of a step's staged form (the slot's memory, which a replay of its layout
    rewrites)."""

    triton: np.ndarray | None
    """The Triton form, flat ``(num_reqs * width * 2,)``; None when not staged."""
    width: int
    """The Triton form's staged ranges per row (graph mode: ``graph_max_ranges``); 0 when not staged."""
    query: np.ndarray | None
    """(num_tokens, 2), the FlashAttention form; None when not staged."""


class _Views(NamedTuple):
    """The views of a step's staged form its metadata holds: read-only host views of :class:`_Own` (the same
    memory), or the device views of a committed step."""

    triton: Any
    """(num_reqs, width, 2) int32, or None when not staged."""
    query: Any
    """(num_tokens, 2) int32, or None when not staged."""


def _host_ranges(step: Step, p: str, num_real_reqs: int, options: MMPrefixOptions,
                 inputs: MMPrefixInputs) -> tuple[np.ndarray, np.ndarray, bool]:
    """The step's checked spans turned into ranges (:func:`_derive_ranges`), read-only and recorded as the
    step's host-only fields (``keep_on_cpu``: never staged): ``(range_indptr, ranges, whether any span was
    given)``. A staged and a replayed step alike.

    Raises
    ------
    TypeError, ValueError
        As :meth:`MMPrefixBuilder.derive`.
    """
    ip, starts_in, lengths_in, emb = (inputs.mm_span_indptr, inputs.mm_span_starts, inputs.mm_span_lengths,
                                      inputs.mm_is_embed)
    if ip is None and starts_in is None and lengths_in is None and emb is None:
        ip, starts_in, lengths_in = np.zeros(num_real_reqs + 1, np.int32), _NO_I32, _NO_I32
    indptr, starts, lengths, embed = _check_spans(ip, starts_in, lengths_in, emb, num_real_reqs)
    r_ip, ranges = _derive_ranges(indptr, starts, lengths, embed, options.sliding_window,
                                  options.clamp_sliding_window, options.span_pad)
    for a in (r_ip, ranges):
        a.flags.writeable = False
    step.host_only(p + "mm_range_indptr", r_ip)
    step.host_only(p + "mm_ranges", ranges)
    return r_ip, ranges, starts.shape[0] > 0


def _triton_width(r_ip: np.ndarray, ranges: np.ndarray, num_reqs: int, options: MMPrefixOptions, graph: bool) -> int:
    """The Triton form's ``max_ranges`` of the step's data (0: every row ``[(0, 0)]``, the form is None).

    Raises
    ------
    attnmeta.staging.CapacityError
        Graph mode: a row with more than ``graph_max_ranges`` ranges.
    """
    width = int(_triton_rows_nb(r_ip, ranges, num_reqs))
    g = options.graph_max_ranges
    if graph and width > g:
        raise CapacityError(f"{options.prefix}.mm_prefix_range_tensor: a row has {width} ranges but "
                            f"MMPrefixOptions.graph_max_ranges={g} (graph mode stages (num_reqs, graph_max_ranges, 2))")
    return width


def _alloc(step: Step, p: str, h: CommonHost, options: MMPrefixOptions, spans: bool, width: int) -> _Own:
    """Stage the step's form: in eager mode the Triton form when a row has a range (``width`` of the step's
    data), in graph mode whenever a span is given (``graph_max_ranges`` wide: one row stride for a captured
    kernel, zeros when the form is None), and the FlashAttention form whenever a span is given and a token
    is scheduled (``-1`` rows where no range covers a token; the metadata holds it only when one does)."""
    prof = step.profile
    if options.form == "triton":
        B = h.num_reqs
        if prof is not None:
            if not spans:
                return _Own(None, 0, None)
            g = options.graph_max_ranges
            return _Own(step.alloc(p + "mm_prefix_range_tensor", B * g * 2, np.int32, capacity=prof.max_num_reqs * g * 2),
                        g, None)
        if not width:
            return _Own(None, 0, None)
        return _Own(step.alloc(p + "mm_prefix_range_tensor", B * width * 2, np.int32), width, None)
    T = int(h.query_start_loc_cpu[-1])
    if not spans or T <= 0:
        return _Own(None, 0, None)
    cap = None if prof is None else prof.max_num_tokens
    return _Own(None, 0, step.alloc(p + "mm_prefix_query_range_tensor", (T, 2), np.int32, capacity=cap, fill=-1))


def _write(h: CommonHost, options: MMPrefixOptions, r_ip: np.ndarray, ranges: np.ndarray, width: int,
           own: _Own) -> tuple[int, int]:
    """Write the step's form into every byte of ``own`` (compiled): a staged and a replayed step alike.
    Returns the metadata's ``(max_ranges, num_query_range_rows)``: ``own.width`` when a row has a range
    (``width``, :func:`_triton_width`), else 0 (the Triton form is None); the tokens when one is covered,
    else 0 (the FlashAttention form is None)."""
    if options.form == "triton":
        if own.triton is not None:
            _triton_fill_nb(r_ip, ranges, h.num_reqs, own.width, own.triton)
        return (own.width if width else 0), 0
    if own.query is None:
        return 0, 0
    covered = _query_ranges_nb(r_ip, ranges, h.query_start_loc_cpu, h.seq_lens_cpu_upper_bound, own.query, True)
    return 0, (own.query.shape[0] if covered else 0)


def _host_views(own: _Own, num_reqs: int) -> _Views:
    """The read-only host views of ``own`` (made once per layout: a replay writes the same memory)."""
    tri = None if own.triton is None else own.triton.reshape(num_reqs, own.width, 2)
    return _Views(read_only_view(tri), read_only_view(own.query))


def _device_views(step: Step, p: str, own: _Own, num_reqs: int) -> _Views:
    """The device views of a committed step's staged form (of prefix ``p``)."""
    tri = None if own.triton is None else step.device(p + "mm_prefix_range_tensor").view(num_reqs, own.width, 2)
    return _Views(tri, None if own.query is None else step.device(p + "mm_prefix_query_range_tensor"))


def _metadata(views: _Views, dv: _Views, r_ip: np.ndarray, ranges: np.ndarray, form: str, max_ranges: int,
              rows: int) -> MMPrefixMetadata:
    """The step's metadata from its ranges, the views of its staged form and :func:`_write`'s counts (a
    form the counts say is None is None, whatever was staged)."""
    return _make_mm(
        mm_prefix_range_tensor=dv.triton if max_ranges else None, mm_prefix_query_range_tensor=dv.query if rows else None,
        mm_prefix_range_tensor_cpu=views.triton if max_ranges else None,
        mm_prefix_query_range_tensor_cpu=views.query if rows else None, mm_range_indptr_cpu=r_ip,
        mm_ranges_cpu=ranges, form=form, num_ranges=int(ranges.shape[0]), max_ranges=max_ranges,
        num_query_range_rows=rows,
    )


class _Staged(Staged[None, MMPrefixMetadata]):
    """A staged mm-prefix step: its form's writable and read-only host views, and the layout it staged (the
    :meth:`MMPrefixBuilder.replay_key` it matches; None for the eager Triton form with spans)."""

    __slots__ = ("layout", "own", "views")

    def __init__(self, step: Step, make: Callable[[], MMPrefixMetadata], own: _Own, views: _Views,
                 layout: Hashable | None) -> None:
        super().__init__(step, None, make)
        self.own, self.views, self.layout = own, views, layout


class _Replayer(Replayer[MMPrefixInputs, MMPrefixMetadata]):
    """Replays of an mm-prefix layout: the step's ranges (:func:`_host_ranges`), written into the recorded
    step's staged form (:func:`_write`, the slot's memory at the same places), and the metadata with
    :func:`_metadata` and the recorded step's views."""

    __slots__ = ("dv", "graph", "options", "own", "prefix", "views", "written")

    def __init__(self, options: MMPrefixOptions, own: _Own, views: _Views, dv: _Views, graph: bool) -> None:
        self.options, self.own, self.views, self.dv, self.graph = options, own, views, dv, graph
        self.prefix = options.prefix + "."
        self.written: tuple[Step, np.ndarray, np.ndarray, int, int] | None = None

    def rewrite(self, step: Step, host: CommonHost, inputs: MMPrefixInputs) -> None:
        """Check the step's spans, derive its ranges and write its form into every staged byte."""
        self.written = None  # (until the write succeeds)
        opts = self.options
        r_ip, ranges, _spans = _host_ranges(step, self.prefix, host.num_real_reqs, opts, inputs)
        width = _triton_width(r_ip, ranges, host.num_reqs, opts, self.graph) if opts.form == "triton" else 0
        self.written = (step, r_ip, ranges, *_write(host, opts, r_ip, ranges, width, self.own))

    def result(self, step: Step, common: CommonAttentionMetadata, host: CommonHost, paged: PagedKVMetadata | None,
               inputs: MMPrefixInputs) -> MMPrefixMetadata:
        """The step's metadata (:func:`_metadata`) from what :meth:`rewrite` wrote."""
        w, self.written = self.written, None
        assert w is not None and w[0] is step, "result() without this step's rewrite()"
        return _metadata(self.views, self.dv, w[1], w[2], self.options.form, w[3], w[4])


_NO_I32 = np.zeros(0, np.int32)

MM_PREFIX = register(MMPrefixBuilder())
"""The registered multimodal prefix-range builder."""
stage = MM_PREFIX.stage
build = MM_PREFIX.build
