"""Device-side reference implementations (layout); see attnmeta.testing.reference.

Each ``ref_*`` function computes what the matching :mod:`attnmeta.host.layout` or
:mod:`attnmeta.host.split` function computes, the straightforward way an engine would on device
tensors: ``cumsum``, ``repeat_interleave``, gathers from a device block table, boolean masks, and
``.item()`` where a host scalar is needed. They synchronise freely; they are oracles for tests,
never serving code. Inputs are tensors on any one device; outputs are on that device. None of them
validates its input (the host functions do); given valid input, each equals its host twin bit for bit.

The examples use ``i32 = lambda v: torch.tensor(v, dtype=torch.int32)`` and the batch
``c = i32([5, 0, 7])``, ``q = i32([1, 4, 2])``, ``bt = i32([[10, 11, 0], [20, 0, 0], [30, 31, 32]])``
with block size 4, the batch of the :mod:`attnmeta.host.layout` examples.

Shape legend
------------
- ``num_reqs`` / ``num_reqs_padded``: real request rows / rows including padding.
- ``num_tokens`` / ``num_tokens_padded``: real tokens / tokens including padding.
- ``max_blocks_per_req``: block-table width.
- ``world_size``: context-parallel world size.
- ``num_prefills``: prefill rows; ``num_swaps``: swaps the reorder makes.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnmeta.spec import BatchSpec, ContextParallel

__all__ = [
    "ref_block_table",
    "ref_common_fields",
    "ref_dcp_local_seq_lens",
    "ref_is_prefilling",
    "ref_num_decode_draft_tokens",
    "ref_positions",
    "ref_prefill_cpu_metadata",
    "ref_query_positions",
    "ref_query_start_loc",
    "ref_reorder",
    "ref_seq_lens",
    "ref_slot_mapping",
    "ref_split_decodes_and_prefills",
    "ref_split_decodes_prefills_and_extends",
    "ref_token_layout",
    "ref_token_req_indices",
]


def _pad_rows(x: Tensor, rows: int | None, value: int | bool) -> Tensor:
    if rows is None or rows == x.shape[0]:
        return x
    pad = torch.full((rows - x.shape[0],), value, dtype=x.dtype, device=x.device)
    return torch.cat([x, pad])


def ref_query_start_loc(num_scheduled_tokens: Tensor, num_reqs_padded: int | None = None) -> Tensor:
    """Reference for :func:`attnmeta.host.layout.query_start_loc`: ``[0, cumsum(q)...]``.

    Parameters
    ----------
    num_scheduled_tokens : (num_reqs,) int32, any device
        Query lengths ``q``.
    num_reqs_padded : int, optional
        Request rows including padding; padding rows repeat the total.

    Returns
    -------
    (num_reqs_padded + 1,) int32, same device

    Raises
    ------
    RuntimeError
        From torch, for inputs it cannot process; nothing is validated.

    Examples
    --------
    >>> i32 = lambda v: torch.tensor(v, dtype=torch.int32)
    >>> ref_query_start_loc(i32([1, 4, 2]), 5)
    tensor([0, 1, 5, 7, 7, 7], dtype=torch.int32)
    """
    q = num_scheduled_tokens
    cu = torch.cumsum(q.to(torch.int64), dim=0).to(torch.int32)
    qsl = torch.cat([torch.zeros(1, dtype=torch.int32, device=q.device), cu])
    last = int(qsl[-1].item())
    return _pad_rows(qsl, None if num_reqs_padded is None else num_reqs_padded + 1, last)


def ref_seq_lens(
    num_computed_tokens: Tensor, num_scheduled_tokens: Tensor, num_reqs_padded: int | None = None
) -> Tensor:
    """Reference for :func:`attnmeta.host.layout.seq_lens`: ``c + q``, padding rows 0.

    Parameters
    ----------
    num_computed_tokens, num_scheduled_tokens : (num_reqs,) int32, any device
        ``c`` and ``q``.
    num_reqs_padded : int, optional
        Request rows including padding.

    Returns
    -------
    (num_reqs_padded,) int32, same device

    Raises
    ------
    RuntimeError
        From torch, for inputs it cannot process; nothing is validated.

    Examples
    --------
    >>> i32 = lambda v: torch.tensor(v, dtype=torch.int32)
    >>> ref_seq_lens(i32([5, 0, 7]), i32([1, 4, 2]), 4)
    tensor([6, 4, 9, 0], dtype=torch.int32)
    """
    s = (num_computed_tokens.to(torch.int32) + num_scheduled_tokens.to(torch.int32)).to(torch.int32)
    return _pad_rows(s, num_reqs_padded, 0)


def ref_is_prefilling(
    num_computed_tokens: Tensor, num_prompt_tokens: Tensor, num_reqs_padded: int | None = None
) -> Tensor:
    """Reference for :func:`attnmeta.host.layout.is_prefilling`: ``c < P``, padding rows False.

    Parameters
    ----------
    num_computed_tokens, num_prompt_tokens : (num_reqs,) int32, any device
        ``c`` and ``P``.
    num_reqs_padded : int, optional
        Request rows including padding.

    Returns
    -------
    (num_reqs_padded,) bool, same device

    Raises
    ------
    RuntimeError
        From torch, for inputs it cannot process; nothing is validated.

    Examples
    --------
    >>> i32 = lambda v: torch.tensor(v, dtype=torch.int32)
    >>> ref_is_prefilling(i32([5, 0, 7]), i32([3, 8, 9]), 4)
    tensor([False,  True,  True, False])
    """
    return _pad_rows(num_computed_tokens < num_prompt_tokens, num_reqs_padded, False)


def ref_num_decode_draft_tokens(
    num_scheduled_tokens: Tensor,
    num_draft_tokens: Tensor,
    num_computed_tokens: Tensor,
    num_prompt_tokens: Tensor | None,
    num_reqs_padded: int | None = None,
) -> Tensor:
    """The runner's ``num_decode_draft_tokens`` under spec decode, as vLLM 0.33.0's
    ``GPUModelRunner._prepare_inputs`` fills it (not a host function's twin: the rule itself).

    Every row starts at -1. A row the scheduler gave drafts (``d > 0``) gets ``d`` when all of them
    and the bonus token are scheduled (``q == d + 1``). Then every row still at -1 that schedules one
    token past its prompt (``c >= prompt``) gets 0: a decode without drafts is a spec row with zero
    drafts, while a prompt chunk (a one-token one included) stays -1. Padding rows -1.

    Parameters
    ----------
    num_scheduled_tokens, num_draft_tokens, num_computed_tokens : (num_reqs,) int32, host (CPU tensors)
        ``q``, ``d`` and ``c``.
    num_prompt_tokens : (num_reqs,) int32, host (a CPU tensor), or None
        Prompt lengths; None: every row counts as past its prompt.
    num_reqs_padded : int, optional
        Request rows including padding.

    Returns
    -------
    (num_reqs_padded,) int32, host (a CPU tensor)

    Examples
    --------
    >>> i32 = lambda v: torch.tensor(v, dtype=torch.int32)
    >>> ref_num_decode_draft_tokens(i32([3, 1, 1, 4]), i32([2, 0, 0, 0]), i32([9, 17, 0, 5]),
    ...                             i32([4, 4, 10, 30]), 5)
    tensor([ 2,  0, -1, -1, -1], dtype=torch.int32)
    """
    q, d, c = num_scheduled_tokens, num_draft_tokens, num_computed_tokens
    out = torch.full_like(q, -1)
    scheduled_with_drafts = (d > 0) & (q == d + 1)
    out[scheduled_with_drafts] = d[scheduled_with_drafts]
    past_prompt = torch.ones_like(q, dtype=torch.bool) if num_prompt_tokens is None else c >= num_prompt_tokens
    out[(out < 0) & past_prompt & (q == 1)] = 0
    return _pad_rows(out, num_reqs_padded, -1)


def ref_token_req_indices(num_scheduled_tokens: Tensor) -> Tensor:
    """Reference for :func:`attnmeta.host.layout.token_req_indices`: ``repeat_interleave(arange(B), q)``.

    Parameters
    ----------
    num_scheduled_tokens : (num_reqs,) int32, any device
        Query lengths ``q``.

    Returns
    -------
    (num_tokens,) int32, same device

    Raises
    ------
    RuntimeError
        From torch, for inputs it cannot process; nothing is validated.

    Examples
    --------
    >>> ref_token_req_indices(torch.tensor([1, 0, 3, 2], dtype=torch.int32))
    tensor([0, 2, 2, 2, 3, 3], dtype=torch.int32)
    """
    q = num_scheduled_tokens.to(torch.int64)
    rows = torch.arange(q.shape[0], dtype=torch.int32, device=q.device)
    return torch.repeat_interleave(rows, q)


def ref_query_positions(num_scheduled_tokens: Tensor) -> Tensor:
    """Reference for :func:`attnmeta.host.layout.query_positions`: ``t - repeat_interleave(cumsum(q) - q, q)``.

    Parameters
    ----------
    num_scheduled_tokens : (num_reqs,) int32, any device
        Query lengths ``q``.

    Returns
    -------
    (num_tokens,) int32, same device

    Raises
    ------
    RuntimeError
        From torch, for inputs it cannot process; nothing is validated.

    Examples
    --------
    >>> ref_query_positions(torch.tensor([1, 0, 3, 2], dtype=torch.int32))
    tensor([0, 0, 1, 2, 0, 1], dtype=torch.int32)
    """
    q = num_scheduled_tokens.to(torch.int64)
    cu = torch.cumsum(q, dim=0)
    total = int(cu[-1].item()) if q.numel() else 0
    starts = torch.repeat_interleave(cu - q, q)
    return (torch.arange(total, dtype=torch.int64, device=q.device) - starts).to(torch.int32)


def ref_positions(
    num_computed_tokens: Tensor, num_scheduled_tokens: Tensor, num_tokens_padded: int | None = None
) -> Tensor:
    """Reference for :func:`attnmeta.host.layout.positions`: ``c[req_idx] + query_pos``, padding 0.

    Parameters
    ----------
    num_computed_tokens, num_scheduled_tokens : (num_reqs,) int32, any device
        ``c`` and ``q``.
    num_tokens_padded : int, optional
        Tokens including padding.

    Returns
    -------
    (num_tokens_padded,) int64, same device

    Raises
    ------
    RuntimeError
        From torch, for inputs it cannot process; nothing is validated.

    Examples
    --------
    >>> i32 = lambda v: torch.tensor(v, dtype=torch.int32)
    >>> ref_positions(i32([5, 0, 7]), i32([1, 4, 2]), 8)
    tensor([5, 0, 1, 2, 3, 7, 8, 0])
    """
    req = ref_token_req_indices(num_scheduled_tokens).to(torch.int64)
    pos = num_computed_tokens.to(torch.int64)[req] + ref_query_positions(num_scheduled_tokens).to(torch.int64)
    return _pad_rows(pos, num_tokens_padded, 0)


def ref_slot_mapping(
    num_computed_tokens: Tensor,
    num_scheduled_tokens: Tensor,
    block_table: Tensor,
    block_size: int,
    num_tokens_padded: int | None = None,
    context_parallel: ContextParallel | None = None,
) -> Tensor:
    """Reference for :func:`attnmeta.host.layout.slot_mapping`: a block-table gather per token.

    Parameters
    ----------
    num_computed_tokens, num_scheduled_tokens : (num_reqs,) int32, any device
        ``c`` and ``q``.
    block_table : (>= num_reqs, max_blocks_per_req) int32, same device
        Physical block ids.
    block_size : int
        Tokens per block.
    num_tokens_padded : int, optional
        Tokens including padding (slot -1).
    context_parallel : ContextParallel, optional
        DCP/PCP layout; tokens of other ranks get slot -1.

    Returns
    -------
    (num_tokens_padded,) int64, same device

    Raises
    ------
    IndexError
        From torch, when the block table is too narrow; nothing else is validated.

    Examples
    --------
    >>> i32 = lambda v: torch.tensor(v, dtype=torch.int32)
    >>> c, q, bt = i32([5, 0, 7]), i32([1, 4, 2]), i32([[10, 11, 0], [20, 0, 0], [30, 31, 32]])
    >>> ref_slot_mapping(c, q, bt, 4, 8)
    tensor([ 45,  80,  81,  82,  83, 127, 128,  -1])
    >>> ref_slot_mapping(c, q, bt, 4, None, ContextParallel(2, 1))
    tensor([ 42,  -1,  80,  -1,  81, 123,  -1])
    """
    req = ref_token_req_indices(num_scheduled_tokens).to(torch.int64)
    num_tokens = req.shape[0]
    pos = ref_positions(num_computed_tokens, num_scheduled_tokens)
    if context_parallel is None or context_parallel.world_size == 1:
        blocks = block_table[req, pos // block_size].to(torch.int64)
        slots = blocks * block_size + pos % block_size
    else:
        w, r, i = context_parallel.world_size, context_parallel.rank, context_parallel.interleave
        span = block_size * w
        offs = pos % span
        local = (offs // i) % w == r
        blocks = block_table[req, pos // span].to(torch.int64)
        local_off = (offs // (w * i)) * i + offs % i
        slots = torch.where(local, blocks * block_size + local_off, torch.full_like(offs, -1))
    assert slots.shape[0] == num_tokens
    return _pad_rows(slots, num_tokens_padded, -1)


def ref_token_layout(
    num_computed_tokens: Tensor,
    num_scheduled_tokens: Tensor,
    block_table: Tensor,
    block_size: int,
    num_tokens_padded: int | None = None,
    context_parallel: ContextParallel | None = None,
) -> tuple[Tensor, Tensor]:
    """Reference for :func:`attnmeta.host.layout.token_layout`: ``(ref_positions, ref_slot_mapping)``.

    Parameters
    ----------
    num_computed_tokens, num_scheduled_tokens : (num_reqs,) int32, any device
        ``c`` and ``q``.
    block_table : (>= num_reqs, max_blocks_per_req) int32, same device
        Physical block ids.
    block_size : int
        Tokens per block.
    num_tokens_padded : int, optional
        Tokens including padding.
    context_parallel : ContextParallel, optional
        DCP/PCP layout.

    Returns
    -------
    positions : (num_tokens_padded,) int64, same device
    slot_mapping : (num_tokens_padded,) int64, same device

    Raises
    ------
    IndexError
        From torch, when the block table is too narrow; nothing else is validated.

    Examples
    --------
    >>> i32 = lambda v: torch.tensor(v, dtype=torch.int32)
    >>> bt = i32([[10, 11, 0], [20, 0, 0], [30, 31, 32]])
    >>> ref_token_layout(i32([5, 0, 7]), i32([1, 4, 2]), bt, 4, 8)
    (tensor([5, 0, 1, 2, 3, 7, 8, 0]), tensor([ 45,  80,  81,  82,  83, 127, 128,  -1]))
    """
    return (
        ref_positions(num_computed_tokens, num_scheduled_tokens, num_tokens_padded),
        ref_slot_mapping(
            num_computed_tokens, num_scheduled_tokens, block_table, block_size, num_tokens_padded, context_parallel
        ),
    )


def ref_dcp_local_seq_lens(
    seq_lens: Tensor, world_size: int, rank: int | None = None, interleave: int = 1
) -> Tensor:
    """Reference for :func:`attnmeta.host.layout.dcp_local_seq_lens` (vLLM's tiled-tensor arithmetic).

    Parameters
    ----------
    seq_lens : (num_reqs,) int32, any device
        Sequence lengths.
    world_size, rank, interleave : int
        Context-parallel layout; ``rank=None`` computes every rank.

    Returns
    -------
    (num_reqs,) int32, same device
        For one rank.
    (num_reqs, world_size) int32, same device
        For ``rank=None``. Unlike vLLM's ``get_dcp_local_seq_lens``, ``world_size == 1`` keeps the
        ``(num_reqs, 1)`` matrix (vLLM squeezes it), as the host function does.

    Raises
    ------
    RuntimeError
        From torch, for inputs it cannot process; nothing is validated.

    Examples
    --------
    >>> s = torch.tensor([7, 8, 1], dtype=torch.int32)
    >>> ref_dcp_local_seq_lens(s, 2, 1, 2)
    tensor([3, 4, 0], dtype=torch.int32)
    >>> ref_dcp_local_seq_lens(s, 2, None, 2)
    tensor([[4, 3],
            [4, 4],
            [1, 0]], dtype=torch.int32)
    """
    s = seq_lens.to(torch.int32)
    if rank is None:
        ranks = torch.arange(world_size, dtype=torch.int32, device=s.device).unsqueeze(0)
    else:
        ranks = torch.full((1, 1), rank, dtype=torch.int32, device=s.device)
    tiled = s.unsqueeze(-1).expand(-1, ranks.shape[1])
    base = tiled // interleave // world_size * interleave
    rem = tiled - base * world_size
    local = (base + torch.clip(rem - ranks * interleave, 0, interleave)).to(torch.int32)
    return local if rank is None else local[:, 0]


def ref_prefill_cpu_metadata(
    query_start_loc_cpu: Tensor,
    seq_lens_upper_bound: Tensor,
    num_reqs: int,
    num_prefills: int,
    num_decode_tokens: int,
) -> tuple[Tensor, Tensor]:
    """Reference for :func:`attnmeta.host.layout.prefill_cpu_metadata`, sliced as vLLM slices.

    Parameters
    ----------
    query_start_loc_cpu : (num_reqs + 1,) int32, any device
        Query start offsets.
    seq_lens_upper_bound : (num_reqs,) int32, same device
        Upper bounds (exact on prefill rows).
    num_reqs, num_prefills, num_decode_tokens : int
        From the split.

    Returns
    -------
    num_computed_tokens_p : (num_prefills,) int32, same device
    query_start_loc_p : (num_prefills + 1,) int32, same device

    Raises
    ------
    RuntimeError
        From torch, for inputs it cannot process; nothing is validated.

    Examples
    --------
    >>> i32 = lambda v: torch.tensor(v, dtype=torch.int32)
    >>> ref_prefill_cpu_metadata(i32([0, 1, 2, 7, 10]), i32([9, 4, 5, 8]), 4, 2, 2)
    (tensor([0, 5], dtype=torch.int32), tensor([0, 5, 8], dtype=torch.int32))
    """
    qsl_p = (query_start_loc_cpu[-num_prefills - 1 :] - num_decode_tokens).to(torch.int32)
    q_p = qsl_p[1:] - qsl_p[:-1]
    nc_p = (seq_lens_upper_bound[num_reqs - num_prefills : num_reqs] - q_p).to(torch.int32)
    return nc_p, qsl_p


def ref_split_decodes_and_prefills(
    query_start_loc_cpu: Tensor,
    num_tokens: int,
    max_query_len: int,
    decode_threshold: int = 1,
    require_uniform: bool = False,
    treat_short_extends_as_decodes: bool = True,
    is_prefilling: Tensor | None = None,
) -> tuple[int, int, int, int]:
    """Reference for :func:`attnmeta.host.split.split_decodes_and_prefills` (section 5.1).

    Transcribed with torch masks, ``argmax`` and ``.item()``; ``num_reqs == 0`` returns
    ``(0, 0, num_tokens, 0)`` like the host function.

    Parameters
    ----------
    query_start_loc_cpu : (num_reqs + 1,) int32, any device
        Query start offsets.
    num_tokens, max_query_len, decode_threshold : int
        As for the host function.
    require_uniform, treat_short_extends_as_decodes : bool
        As for the host function.
    is_prefilling : (num_reqs,) bool, optional
        Needed when ``treat_short_extends_as_decodes`` is False.

    Returns
    -------
    tuple of 4 int
        ``(num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens)``.

    Raises
    ------
    AssertionError
        ``is_prefilling`` missing when it is needed; nothing else is validated.

    Examples
    --------
    >>> ref_split_decodes_and_prefills(torch.tensor([0, 2, 3, 6, 10], dtype=torch.int32), 10, 4, 3)
    (3, 1, 6, 4)
    """
    qsl = query_start_loc_cpu
    num_reqs = qsl.shape[0] - 1
    thr = decode_threshold
    if max_query_len <= thr and (not require_uniform or thr <= 1) and treat_short_extends_as_decodes:
        return num_reqs, 0, num_tokens, 0
    if num_reqs == 0:
        return 0, 0, num_tokens, 0
    q = qsl[1:] - qsl[:-1]
    if q[0].item() > thr:
        return 0, num_reqs, 0, num_tokens
    if require_uniform:
        if treat_short_extends_as_decodes and bool(torch.all((q == q[0]) | (q == 0)).item()):
            return num_reqs, 0, num_tokens, 0
        is_prefill = (q != q[0]) & (q != 0)
    else:
        is_prefill = q > thr
    if not treat_short_extends_as_decodes:
        assert is_prefilling is not None
        is_prefill = is_prefill | is_prefilling.to(q.device)
    if not bool(torch.any(is_prefill).item()):
        return num_reqs, 0, num_tokens, 0
    first = int(is_prefill.int().argmax().item())
    start = int(qsl[first].item())
    return first, num_reqs - first, start, num_tokens - start


def ref_split_decodes_prefills_and_extends(
    query_start_loc_cpu: Tensor,
    seq_lens_upper_bound: Tensor,
    num_tokens: int,
    max_query_len: int,
    decode_threshold: int,
) -> tuple[int, int, int, int, int, int]:
    """Reference for :func:`attnmeta.host.split.split_decodes_prefills_and_extends` (section 5.2).

    Parameters
    ----------
    query_start_loc_cpu : (num_reqs + 1,) int32, any device
        Query start offsets.
    seq_lens_upper_bound : (num_reqs,) int32, same device
        Upper bounds (exact on prefill rows).
    num_tokens, max_query_len, decode_threshold : int
        As for the host function.

    Returns
    -------
    tuple of 6 int
        ``(num_decodes, num_extends, num_prefills, num_decode_tokens, num_extend_tokens,
        num_prefill_tokens)``, vLLM's all-zeros quirk included.

    Raises
    ------
    RuntimeError
        From torch, for inputs it cannot process; nothing is validated.

    Examples
    --------
    >>> i32 = lambda v: torch.tensor(v, dtype=torch.int32)
    >>> ref_split_decodes_prefills_and_extends(i32([0, 1, 3, 7, 12, 18]), i32([10, 11, 20, 5, 6]), 18, 6, 3)
    (2, 1, 2, 3, 4, 11)
    """
    qsl = query_start_loc_cpu
    num_reqs = qsl.shape[0] - 1
    if max_query_len <= decode_threshold:
        return num_reqs, 0, 0, num_tokens, 0, 0
    q = qsl[1:] - qsl[:-1]
    is_pe = q > decode_threshold
    is_p = (seq_lens_upper_bound == q) & is_pe
    fe = int(is_pe.int().argmax().item()) if num_reqs else 0
    fp = int(is_p.int().argmax().item()) if num_reqs else 0
    nd = fe
    ndt = int(qsl[fe].item())
    if not bool(torch.any(is_pe).item()):
        return nd, 0, 0, ndt, 0, 0
    if not bool(torch.any(is_p).item()):
        return nd, num_reqs - nd, 0, ndt, num_tokens - ndt, 0
    npt_ = num_tokens - int(qsl[fp].item())
    return nd, fp - nd, num_reqs - fp, ndt, (num_tokens - ndt) - npt_, npt_


def ref_reorder(
    num_computed_tokens: Tensor,
    num_scheduled_tokens: Tensor,
    num_prompt_tokens: Tensor,
    decode_threshold: int = 1,
) -> tuple[Tensor, Tensor]:
    """Reference for :func:`attnmeta.host.split.reorder_decodes_and_prefills`: section 5.3's cycles.

    Transcribed from the prose: regions by masks, the misplaced rows, a stable argsort by region, a
    dict from source to destination, and the cycle walk that records each ``swap_states`` call.

    Parameters
    ----------
    num_computed_tokens, num_scheduled_tokens, num_prompt_tokens : (num_reqs,) int32, any device
        ``c``, ``q`` and ``P``.
    decode_threshold : int
        Longest query that counts as a decode.

    Returns
    -------
    swaps : (num_swaps, 2) int32, same device
        The swaps, in order.
    permutation : (num_reqs,) int32, same device
        ``permutation[slot]`` is the original row in ``slot`` after the swaps.

    Raises
    ------
    RuntimeError
        From torch, for inputs it cannot process; nothing is validated.

    Examples
    --------
    >>> i32 = lambda v: torch.tensor(v, dtype=torch.int32)
    >>> ref_reorder(i32([0, 4, 9, 7]), i32([5, 6, 1, 1]), i32([5, 12, 9, 7]))
    (tensor([[2, 0],
            [2, 3],
            [2, 1]], dtype=torch.int32), tensor([2, 3, 1, 0], dtype=torch.int32))
    """
    c, q, p = num_computed_tokens, num_scheduled_tokens, num_prompt_tokens
    dev = c.device
    has_context = c > 0
    below = q <= decode_threshold
    done = c >= p
    region = torch.zeros(c.shape[0], dtype=torch.int64, device=dev)
    region[has_context & below & ~done] = 1
    region[has_context & ~below] = 2
    region[~has_context] = 3
    counts = torch.bincount(region, minlength=4)
    target = torch.repeat_interleave(torch.arange(4, device=dev), counts)
    needs = region != target
    perm = list(range(c.shape[0]))
    swaps: list[tuple[int, int]] = []
    if bool(torch.any(needs).item()):
        where = torch.nonzero(needs).flatten()
        order = torch.argsort(region[needs], stable=True)
        sources = where[order].tolist()
        destinations = where.tolist()
        dest_of = dict(zip(sources, destinations))
        for src in dest_of:
            dst = dest_of[src]
            while src != dst:
                swaps.append((src, dst))
                perm[src], perm[dst] = perm[dst], perm[src]
                nxt = dest_of.get(dst, dst)
                dest_of[dst] = dst
                dst = nxt
    swaps_t = torch.tensor(swaps, dtype=torch.int32, device=dev).reshape(-1, 2)
    return swaps_t, torch.tensor(perm, dtype=torch.int32, device=dev)


def ref_block_table(spec: BatchSpec, device: torch.device | str) -> Tensor:
    """The block-table entries a paged kernel reads for ``spec``: each real row's first
    ``cdiv(num_computed_tokens + num_scheduled_tokens, block_size * world_size)`` columns, up to the
    longest row's (``world_size``: the spec's context-parallel world, else 1).

    Returns
    -------
    Tensor
        ``(num_reqs_padded, max_columns)`` int32 on ``device``: the real rows' leading columns of
        ``spec.block_table`` (a shorter row's entries past its own blocks included), padding rows 0.

    Examples
    --------
    >>> spec = BatchSpec(num_computed_tokens=[5, 0], num_scheduled_tokens=[1, 2], block_table=[[1, 2, 9], [3, 4, 9]],
    ...                  block_size=4, num_reqs_padded=3)
    >>> ref_block_table(spec, "cpu").tolist()
    [[1, 2], [3, 4], [0, 0]]
    """
    dev = torch.device(device)
    n = spec.num_reqs
    span = spec.block_size * (1 if spec.context_parallel is None else spec.context_parallel.world_size)
    lens = torch.tensor(spec.num_computed_tokens, dtype=torch.int64) + torch.tensor(spec.num_scheduled_tokens,
                                                                                    dtype=torch.int64)
    cols = int(((lens + span - 1) // span).max()) if n else 0
    table = torch.zeros((spec.padded_num_reqs, cols), dtype=torch.int32, device=dev)
    table[:n] = torch.tensor(spec.block_table[:n, :cols], dtype=torch.int32).to(dev)
    return table


def ref_common_fields(spec: BatchSpec, device: torch.device | str) -> dict[str, Tensor]:
    """The common metadata's per-row and per-token device fields of ``spec``, computed the
    reference way from raw uploads of its arrays.

    Parameters
    ----------
    spec : BatchSpec
        The step.
    device : torch.device or str
        Where to compute.

    Returns
    -------
    dict of str to Tensor
        ``query_start_loc`` ``(num_reqs_padded + 1,)`` int32, ``seq_lens`` ``(num_reqs_padded,)``
        int32, ``positions`` and ``slot_mapping`` ``(num_tokens_padded,)`` int64, on ``device``.

    Examples
    --------
    >>> spec = BatchSpec(num_computed_tokens=[5, 0], num_scheduled_tokens=[1, 2], block_table=[[1, 2], [3, 4]],
    ...                  block_size=4, num_reqs_padded=3)
    >>> f = ref_common_fields(spec, "cpu")
    >>> f["query_start_loc"].tolist(), f["seq_lens"].tolist(), f["slot_mapping"].tolist()
    ([0, 1, 3, 3], [6, 2, 0], [9, 12, 13])
    """
    dev = torch.device(device)
    c = torch.tensor(spec.num_computed_tokens).to(dev)
    q = torch.tensor(spec.num_scheduled_tokens).to(dev)
    table = torch.tensor(spec.block_table).to(dev)
    Bp, Tp = spec.padded_num_reqs, spec.padded_num_tokens
    positions, slots = ref_token_layout(c, q, table, spec.block_size, Tp, spec.context_parallel)
    return {"query_start_loc": ref_query_start_loc(q, Bp), "seq_lens": ref_seq_lens(c, q, Bp),
            "positions": positions, "slot_mapping": slots}


from attnmeta.testing._oracle import mark_oracles as _mark_oracles  # noqa: E402

_mark_oracles(globals(), __all__)
