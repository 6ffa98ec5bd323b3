"""FlashAttention varlen metadata (vllm-semantics.md section 7), derived on the host.

``FlashAttentionMetadata`` carries what ``flash_attn_varlen_func`` (and
``torch.nn.attention.varlen.varlen_attn``) take: ``cu_seqlens_q`` (``query_start_loc``),
``seqused_k`` (``seq_lens``), the paged ``block_table``, ``slot_mapping`` for the KV write, and the
host ints ``max_query_len`` / ``max_seq_len`` a kernel wrapper needs as plain arguments, plus the
decode/prefill counts and the DCP fields. Everything comes from the common metadata's host twins; the
only staged additions are the DCP context lengths and a per-request ``causal`` array, which travel in
the step's one copy.

Not produced: FA3's AOT ``scheduler_metadata`` (a device-side call of the FA3 library, with no host
sync, that a backend can run on these fields) — ``scheduler_metadata`` is always None here.

Shape legend
------------
- ``num_reqs``: request rows, padding included.
- ``num_actual_tokens``: tokens, padding included.
- ``max_blocks``: staged block-table columns.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar, NamedTuple

import numpy as np
import torch

from attnmeta._fields import MetadataBase, Staged, fast_constructor
from attnmeta.backends._shared import require_same_step
from attnmeta.host.flash_attn import causal_per_request, dcp_context_kv_lens, max_dcp_context_kv_len
from attnmeta.metadata import CommonAttentionMetadata, common_split, stage_common
from attnmeta.spec import BatchSpec
from attnmeta.staging import Stager, Step

__all__ = ["FlashAttentionMetadata", "FlashAttnOptions", "build", "stage"]


class FlashAttnOptions(NamedTuple):
    """Options of the FlashAttention builder."""

    causal: bool | Sequence[bool] | np.ndarray | None = None
    """One flag for every request, or one per real request (staged as an int32 device array);
    default: the common metadata's ``causal``."""
    dcp_world_size: int = 1
    """Decode-context-parallel world size ``W`` (1: off)."""
    dcp_rank: int = 0
    """This rank, ``0 <= dcp_rank < dcp_world_size``."""
    dcp_interleave: int = 1
    """Consecutive tokens per DCP rank (``cp_kv_cache_interleave_size``)."""
    max_num_splits: int = 0
    """FA3 ``num_splits`` (0: the kernel's heuristic; vLLM fixes it under full CUDA graphs)."""
    decode_threshold: int = 1
    """Longest query counted as a decode in the decode/prefill counts."""
    prefix: str = "flash_attn"
    """Namespace of this builder's staged fields."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True, repr=False, eq=False)
class FlashAttentionMetadata(MetadataBase):
    """Metadata for FlashAttention's varlen paged kernels; contains the step's common metadata.

    Examples
    --------
    >>> import numpy as np
    >>> from attnmeta import BatchSpec, Stager
    >>> spec = BatchSpec(num_computed_tokens=[5, 7, 0], num_scheduled_tokens=[1, 1, 4],
    ...                  block_table=[[10, 11], [20, 21], [30, 31]], block_size=4)
    >>> fa = build(spec, Stager("cpu"), FlashAttnOptions(dcp_world_size=2, dcp_rank=1))
    >>> fa.query_start_loc.tolist(), fa.seq_lens.tolist(), fa.max_query_len, fa.max_seq_len
    ([0, 1, 2, 6], [6, 8, 4], 4, 8)
    >>> fa.dcp_context_kv_lens_cpu.tolist(), fa.max_dcp_context_kv_len
    ([2, 3, 0], 4)
    >>> fa.num_decode_reqs, fa.num_prefill_reqs, fa.num_decode_tokens, fa.num_prefill_tokens
    (2, 1, 2, 4)
    """

    _DEVICE_FIELDS: ClassVar[tuple[str, ...]] = (
        "query_start_loc",
        "seq_lens",
        "block_table",
        "slot_mapping",
        "dcp_context_kv_lens",
        "causal_tensor",
    )
    _HOST_FIELDS: ClassVar[tuple[str, ...]] = (
        "query_start_loc_cpu",
        "seq_lens_cpu",
        "dcp_context_kv_lens_cpu",
        "causal_cpu",
    )
    _SCALAR_FIELDS: ClassVar[tuple[str, ...]] = (
        "num_actual_tokens",
        "max_query_len",
        "max_seq_len",
        "causal",
        "num_decode_reqs",
        "num_prefill_reqs",
        "num_decode_tokens",
        "num_prefill_tokens",
        "max_dcp_context_kv_len",
        "max_num_splits",
    )
    _TWINS: ClassVar[tuple[tuple[str, str], ...]] = (
        ("query_start_loc", "query_start_loc_cpu"),
        ("seq_lens", "seq_lens_cpu"),
        ("dcp_context_kv_lens", "dcp_context_kv_lens_cpu"),
        ("causal_tensor", "causal_cpu"),
    )

    common: CommonAttentionMetadata
    """The step's common metadata (the same device views, not copies)."""
    query_start_loc: torch.Tensor
    """(num_reqs + 1,) int32, device. ``cu_seqlens_q``."""
    seq_lens: torch.Tensor
    """(num_reqs,) int32, device. ``seqused_k``."""
    block_table: torch.Tensor
    """(num_reqs, max_blocks) int32, device. Paged KV block ids."""
    slot_mapping: torch.Tensor
    """(num_actual_tokens,) int64, device. KV-cache write slots; padding -1."""
    dcp_context_kv_lens: torch.Tensor | None
    """(num_reqs,) int32, device, DCP only (else None). This rank's share of each context
    ``seq_lens - query_lens``."""
    causal_tensor: torch.Tensor | None
    """(num_reqs,) int32, device, when per-request causal flags were given (else None)."""
    query_start_loc_cpu: np.ndarray
    """(num_reqs + 1,) int32, host twin."""
    seq_lens_cpu: np.ndarray
    """(num_reqs,) int32, host twin."""
    dcp_context_kv_lens_cpu: np.ndarray | None
    """(num_reqs,) int32, host twin of ``dcp_context_kv_lens``."""
    causal_cpu: np.ndarray | None
    """(num_reqs,) int32, host twin of ``causal_tensor``; padding rows 1."""
    num_actual_tokens: int
    """Tokens, padding included."""
    max_query_len: int
    """``max_seqlen_q`` (host int)."""
    max_seq_len: int
    """``max_seqlen_k`` (host int; an upper bound under async spec decode)."""
    causal: bool
    """True when every request is causal (the kernel's scalar flag)."""
    num_decode_reqs: int
    """Leading decode rows (``decode_threshold`` split)."""
    num_prefill_reqs: int
    """Rows from the first prefill on."""
    num_decode_tokens: int
    """Tokens of the decode rows."""
    num_prefill_tokens: int
    """Tokens of the prefill rows (token padding included, as vLLM counts it)."""
    max_dcp_context_kv_len: int
    """DCP: host upper bound ``cdiv(max_seq_len, W*I) * I`` of ``dcp_context_kv_lens`` (else 0)."""
    max_num_splits: int
    """FA3 ``num_splits``."""
    scheduler_metadata: None = None
    """FA3 AOT schedule: not produced (see the module docstring)."""


_new_fa = fast_constructor(FlashAttentionMetadata)


def stage(
    common: Staged[CommonAttentionMetadata], step: Step, options: FlashAttnOptions = FlashAttnOptions()
) -> Staged[FlashAttentionMetadata]:
    """Derive FlashAttention metadata from the staged common metadata, staging into the same step.

    Parameters
    ----------
    common : Staged[CommonAttentionMetadata]
        From :func:`attnmeta.stage_common` on the same ``step``.
    step : Step
        The open step.
    options : FlashAttnOptions
        Causal flags, DCP layout, split count.

    Returns
    -------
    Staged[FlashAttentionMetadata]
        ``.result()`` after the commit.

    Raises
    ------
    ValueError
        Bad DCP layout or per-request ``causal`` of the wrong length.
    """
    require_same_step(common, step)
    h = common.host
    T = h["num_actual_tokens"]
    split = common_split(h, decode_threshold=options.decode_threshold)
    causal = h["causal"] if options.causal is None else options.causal
    max_splits = options.max_num_splits
    dcp = dcp_host = causal_host = None
    causal_name = ""
    max_dcp = 0
    all_causal = causal
    if options.dcp_world_size > 1 or not (causal is True or causal is False):  # else nothing is staged
        qsl, sl = h["query_start_loc_cpu"], h["seq_lens_cpu"]
        B = h["num_reqs"]
        p = options.prefix + "."
        prof = step.profile
        kw: dict[str, Any] = {"capacity": prof.max_num_reqs} if prof is not None else {}
        if options.dcp_world_size > 1:
            dcp = p + "dcp_context_kv_lens"
            dcp_host = step.alloc(dcp, B, np.int32, fill=0, **kw)
            dcp_context_kv_lens(sl, np.diff(qsl).astype(np.int32), options.dcp_world_size, options.dcp_rank,
                                options.dcp_interleave, out=dcp_host)
            max_dcp = max_dcp_context_kv_len(h["max_seq_len"], options.dcp_world_size, options.dcp_interleave)
            dcp_host.flags.writeable = False  # this step's own view: handed out read-only
        if not isinstance(causal, bool | np.bool_):
            flags = np.asarray(causal)
            n_real = h["num_real_reqs"]
            if flags.shape != (n_real,):
                raise ValueError(f"causal: expected one flag per real request ({n_real}), got shape {flags.shape}")
            causal_name = p + "causal"
            causal_host = step.alloc(causal_name, B, np.int32, fill=1, **kw)
            causal_per_request(flags, out=causal_host[:n_real])
            causal_host[n_real:] = 1  # padding rows: causal
            all_causal = bool(causal_host.all())
            causal_host.flags.writeable = False
        else:
            all_causal = bool(causal)

    def make() -> FlashAttentionMetadata:
        cm = common.result()
        return _new_fa(
            cm, cm.query_start_loc, cm.seq_lens, cm.block_table_tensor, cm.slot_mapping,
            step.device(dcp) if dcp is not None else None,
            step.device(causal_name) if causal_host is not None else None,
            cm.query_start_loc_cpu, cm.seq_lens_cpu, dcp_host, causal_host,
            T, cm.max_query_len, cm.max_seq_len, all_causal,
            split.num_decodes, split.num_prefills, split.num_decode_tokens, split.num_prefill_tokens,
            max_dcp, max_splits, None,
        )

    return Staged(step, {"split": split}, make)


def build(spec: BatchSpec, stager: Stager, options: FlashAttnOptions = FlashAttnOptions()) -> FlashAttentionMetadata:
    """Common + FlashAttention metadata of ``spec`` in one step of its own (one copy)."""
    with stager.step() as step:
        staged = stage(stage_common(spec, step), step, options)
    return staged.result()
