"""Device-side reference implementations (multimodal prefix ranges); see :mod:`attnmeta.testing.reference`.

Straightforward transcriptions of vLLM 0.33.0's three functions, the way the engine computes them:
``compute_mm_prefix_ranges`` (a dict of inclusive ranges per request, here read from span tensors on
the device with ``.tolist()``), ``compute_mm_prefix_range_tensor`` (the Triton/Flex form, a nested
Python list uploaded with ``torch.tensor``) and ``fill_mm_prefix_query_ranges`` (the FlashAttention-4
form, Python loops over rows and ranges writing device slices). Obviously correct, synchronisations
and all; never use them on a serving path.

Shape legend
------------
- ``num_reqs``: request rows; ``num_spans``: placeholder spans; ``num_tokens``: scheduled tokens.
"""

from __future__ import annotations

import torch

__all__ = ["ref_mm_prefix_query_ranges", "ref_mm_prefix_range_tensor", "ref_mm_prefix_ranges"]


def ref_mm_prefix_ranges(
    span_indptr: torch.Tensor,
    span_starts: torch.Tensor,
    span_lengths: torch.Tensor,
    is_embed: torch.Tensor | None,
    *,
    sliding_window: int | None = None,
    clamp_sliding_window: bool = False,
    span_pad: int | None = None,
) -> dict[int, list[tuple[int, int]]]:
    """vLLM's ``compute_mm_prefix_ranges`` over span tensors: ``{row: [(start, end), ...]}``, inclusive.

    Parameters
    ----------
    span_indptr : (num_reqs + 1,) int32, any device
        Row ``i``'s spans are ``span_indptr[i]:span_indptr[i + 1]``.
    span_starts : (num_spans,) int32, any device
        Placeholder offsets.
    span_lengths : (num_spans,) int32, any device
        Placeholder lengths.
    is_embed : (sum(span_lengths),) bool, any device, or None
        The spans' masks concatenated (None: no span has one).
    sliding_window : int, optional
        Drop a range with ``end - start + 1 > sliding_window``.
    clamp_sliding_window : bool, default False
        Keep it instead.
    span_pad : int, optional
        One range ``(round_down(offset, span_pad) + span_pad - 1, offset + length - 1)`` per span.

    Returns
    -------
    dict of int to list of (int, int)
        Every row a key, possibly with an empty list (host values).
    """
    ip = span_indptr.tolist()
    starts, lengths = span_starts.tolist(), span_lengths.tolist()
    out: dict[int, list[tuple[int, int]]] = {}
    base = 0
    for row in range(len(ip) - 1):
        doc: list[tuple[int, int]] = []
        for j in range(ip[row], ip[row + 1]):
            offset, length = starts[j], lengths[j]
            mask = None if is_embed is None else is_embed[base:base + length]
            base += length
            if span_pad is not None:
                found = [(offset // span_pad * span_pad + span_pad - 1, offset + length - 1)]
            elif mask is None:
                found = [(offset, offset + length - 1)]
            else:  # PlaceholderRange.extract_embeds_range: one range per run of True
                m = torch.cat([mask.new_zeros(1), mask, mask.new_zeros(1)]).to(torch.int8)
                edges = torch.diff(m)
                run_starts = torch.nonzero(edges == 1).flatten().tolist()
                run_ends = (torch.nonzero(edges == -1).flatten() - 1).tolist()
                found = [(offset + a, offset + b) for a, b in zip(run_starts, run_ends, strict=True)]
            for r in found:
                if sliding_window is not None and not clamp_sliding_window and r[1] - r[0] + 1 > sliding_window:
                    continue
                doc.append(r)
        out[row] = doc
    return out


def ref_mm_prefix_range_tensor(
    mm_prefix_range: dict[int, list[tuple[int, int]]] | None,
    num_seqs: int,
    device: torch.device,
) -> torch.Tensor | None:
    """vLLM's ``compute_mm_prefix_range_tensor``: ``(num_seqs, max_ranges, 2)`` int32 on ``device``, or None.

    Parameters
    ----------
    mm_prefix_range : dict of int to list of (int, int), or None
        From :func:`ref_mm_prefix_ranges`.
    num_seqs : int
        Rows (padding rows included: they get ``(0, 0)``).
    device : torch.device
        Where the tensor is made.

    Returns
    -------
    torch.Tensor or None
        None when every row is ``[(0, 0)]`` (an empty row counts as ``[(0, 0)]``).
    """
    if mm_prefix_range is None:
        return None
    range_lists = [mm_prefix_range.get(i, [(0, 0)]) or [(0, 0)] for i in range(num_seqs)]
    if all(r == [(0, 0)] for r in range_lists):
        return None
    max_ranges = max(len(r) for r in range_lists)
    padded = [list(r) + [(0, 0)] * (max_ranges - len(r)) for r in range_lists]
    return torch.tensor(padded, dtype=torch.int32, device=device).view(num_seqs, max_ranges, 2)


def ref_mm_prefix_query_ranges(
    mm_prefix_range: dict[int, list[tuple[int, int]]] | None,
    query_start_loc: torch.Tensor,
    seq_lens_upper_bound: torch.Tensor,
) -> torch.Tensor | None:
    """vLLM's ``fill_mm_prefix_query_ranges`` on device tensors: ``(num_tokens, 2)`` int32, or None.

    Parameters
    ----------
    mm_prefix_range : dict of int to list of (int, int), or None
        From :func:`ref_mm_prefix_ranges`.
    query_start_loc : (num_reqs + 1,) int32, any device
        Query starts; ``num_tokens = query_start_loc[-1]``.
    seq_lens_upper_bound : (num_real_reqs,) int32, same device
        vLLM's ``ub``: a row's context is ``ub[row] - q``.

    Returns
    -------
    torch.Tensor or None
        Per token the covering range (``start < end`` only), else ``(-1, -1)``; None (vLLM's return
        value 0) when there are no ranges, no tokens, or no covered token.
    """
    total = int(query_start_loc[-1].item())
    if mm_prefix_range is None or total <= 0:
        return None
    qsl = query_start_loc.tolist()
    ub = seq_lens_upper_bound.tolist()
    out = torch.full((total, 2), -1, dtype=torch.int32, device=query_start_loc.device)
    covered = False
    for row, ranges in mm_prefix_range.items():
        q = qsl[row + 1] - qsl[row]
        if not ranges or q <= 0:
            continue
        c = ub[row] - q
        for start, end in ranges:
            if start >= end:
                continue
            first, last = max(start - c, 0), min(end - c, q - 1)
            if first <= last:
                out[qsl[row] + first: qsl[row] + last + 1] = torch.tensor([start, end], dtype=torch.int32,
                                                                          device=out.device)
                covered = True
    return out if covered else None


from attnmeta.testing._oracle import mark_oracles as _mark_oracles  # noqa: E402

_mark_oracles(globals(), __all__)
