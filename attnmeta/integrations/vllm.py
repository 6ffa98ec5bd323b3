"""vLLM 0.33.0 adapter: a :class:`~attnmeta.BatchSpec` from vLLM's ``CommonAttentionMetadata``, and
vLLM's ``CommonAttentionMetadata`` from attnmeta's (docs/vllm.md).

vLLM is imported lazily: importing this module never imports it, and only :func:`to_vllm_common`
and :func:`vllm_common_class` do, when called. Nothing here reads a device tensor: both directions
read host arrays and host scalars only, and hand device tensors on as they are (the sync audit,
:func:`attnmeta.sync.no_device_sync`, passes over both; tests/integrations runs them under it).

- :func:`spec_from_vllm`: the step's :class:`~attnmeta.BatchSpec` from a vLLM
  ``CommonAttentionMetadata``'s host fields (``query_start_loc_cpu``, ``seq_lens_cpu_upper_bound``,
  ``is_prefilling``, ``num_reqs``, ``num_actual_tokens``) plus the caller's **host** block table.
  vLLM's metadata holds the block table on the device only, and attnmeta has no mode that builds
  from a device block table (its device-gather modes, ``FlashInferOptions(indices="device")`` and
  ``LocalAttentionOptions(block_table="device")``, gather from the table attnmeta itself staged from the
  host one): without a host table the call raises, saying where vLLM keeps it.
- :func:`to_vllm_common`: a real vLLM ``CommonAttentionMetadata`` whose device fields are attnmeta's
  device views and whose host fields are CPU torch tensors sharing attnmeta's host arrays' memory (no
  copy; ``query_start_loc_cpu`` is the step's pinned slot); :func:`vllm_common_kwargs` gives the
  same keyword arguments without importing vLLM.
- :data:`VLLM_COMMON_FIELDS` / :data:`VLLM_COMMON_DEFAULTS` pin vLLM 0.33.0's dataclass (names,
  order, defaults); :data:`VLLM_FIELD_MAP` says where each of its fields comes from, or why attnmeta
  does not produce it; :data:`ATTNMETA_ONLY_FIELDS` lists attnmeta's fields vLLM has no place for.

Shape legend
------------
- ``num_reqs``: request rows, CUDA-graph padding rows included (vLLM's ``num_reqs``).
- ``num_actual_tokens``: tokens, padding tokens included.
- ``max_blocks``: block-table columns (attnmeta stages what the batch uses unless told
  ``block_table_columns=``; vLLM's persistent table is wider).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import numpy as np
import numpy.typing as npt
import torch

from attnmeta._checks import as_host_array
from attnmeta.backends.flashinfer import host_tensor
from attnmeta.metadata import CommonAttentionMetadata
from attnmeta.spec import BatchSpec, ContextParallel

if TYPE_CHECKING:  # never imported at run time here: see vllm_common_class()
    from vllm.v1.attention.backends.utils import CommonAttentionMetadata as VllmCommonAttentionMetadata

__all__ = [
    "ATTNMETA_ONLY_FIELDS",
    "VLLM_COMMON_DEFAULTS",
    "VLLM_COMMON_FIELDS",
    "VLLM_FIELD_MAP",
    "VLLM_INPUT_FIELDS",
    "VLLM_VERSION",
    "FieldMapping",
    "spec_from_vllm",
    "to_vllm_common",
    "vllm_common_class",
    "vllm_common_kwargs",
]

VLLM_VERSION = "0.33.0"
"""The vLLM release whose ``CommonAttentionMetadata`` this adapter maps."""

VLLM_COMMON_FIELDS: tuple[str, ...] = (
    "query_start_loc",
    "query_start_loc_cpu",
    "seq_lens",
    "num_reqs",
    "num_actual_tokens",
    "max_query_len",
    "max_seq_len",
    "block_table_tensor",
    "slot_mapping",
    "causal",
    "logits_indices_padded",
    "num_logits_indices",
    "max_logits_per_req",
    "encoder_seq_lens",
    "encoder_seq_lens_cpu",
    "dcp_local_seq_lens",
    "dcp_local_seq_lens_cpu_upper_bound",
    "positions",
    "is_prefilling",
    "seq_lens_cpu_upper_bound",
    "req_idx",
    "mm_req_doc_ranges",
    "rswa_prefix_lens",
    "replayssm_decode_base_cpu",
    "_num_computed_tokens_cache",
    "_token_to_req_indices_cache",
)
"""Every field of vLLM 0.33.0's ``CommonAttentionMetadata`` dataclass, in declaration order
(``vllm/v1/attention/backend.py``)."""

VLLM_COMMON_DEFAULTS: Mapping[str, object] = MappingProxyType({
    "causal": True,
    **{name: None for name in VLLM_COMMON_FIELDS[10:]},
})
"""The default of every vLLM 0.33.0 field that has one (``causal`` True, the 16 after it None); the
first nine fields have none (required)."""


class FieldMapping(NamedTuple):
    """Where one field of vLLM's ``CommonAttentionMetadata`` comes from in :func:`vllm_common_kwargs`.

    ``role`` is one of:

    - ``"device"``: attnmeta's device view of field ``source``, as it is (the same tensor);
    - ``"host"``: attnmeta's numpy host array ``source`` as a CPU torch tensor sharing its memory;
      read-only in use;
    - ``"scalar"``: attnmeta's host int / bool ``source``;
    - ``"input"``: attnmeta's common metadata does not derive it; the caller passes it
      (:data:`VLLM_INPUT_FIELDS`), else vLLM's default (None);
    - ``"memo"``: one of vLLM's private memo caches, left at its default (None): vLLM fills it itself.
    """

    vllm: str
    """The vLLM field."""
    role: Literal["device", "host", "scalar", "input", "memo"]
    """How it is filled (see the class docstring)."""
    source: str | None
    """The :class:`attnmeta.CommonAttentionMetadata` field it comes from (None for inputs and memos)."""
    note: str
    """What it holds, or why attnmeta does not produce it."""


VLLM_FIELD_MAP: tuple[FieldMapping, ...] = (
    FieldMapping("query_start_loc", "device", "query_start_loc",
                 "(num_reqs + 1,) int32; padding rows repeat the last value"),
    FieldMapping("query_start_loc_cpu", "host", "query_start_loc_cpu", "(num_reqs + 1,) int32"),
    FieldMapping("seq_lens", "device", "seq_lens", "(num_reqs,) int32; padding rows 0"),
    FieldMapping("num_reqs", "scalar", "num_reqs", "request rows, padding included"),
    FieldMapping("num_actual_tokens", "scalar", "num_actual_tokens", "tokens, padding included"),
    FieldMapping("max_query_len", "scalar", "max_query_len", "max query length over the real rows"),
    FieldMapping("max_seq_len", "scalar", "max_seq_len",
                 "max of seq_lens_cpu_upper_bound over the real rows (vLLM's CUDA-graph capture passes "
                 "max_model_len instead)"),
    FieldMapping("block_table_tensor", "device", "block_table_tensor",
                 "(num_reqs, max_blocks) int32; padding rows 0; max_blocks is what the batch uses unless "
                 "staged with block_table_columns= (vLLM hands a view of its full-width table)"),
    FieldMapping("slot_mapping", "device", "slot_mapping",
                 "(num_actual_tokens,) int64; padding -1; (0,) when staged with token_arrays=False "
                 "(vLLM's SlotMappingMode.NONE groups, whose layers read none)"),
    FieldMapping("causal", "scalar", "causal",
                 "one bool for the step; vLLM's per-request int32 tensor form is not in attnmeta's common "
                 "metadata (attnmeta.backends.flash_attn stages per-request flags as causal_tensor)"),
    FieldMapping("logits_indices_padded", "input", None,
                 "KV-sharing fast prefill: the logits indices are an input of attnmeta's fast_prefill "
                 "builder, which derives its own metadata from them; the common metadata has none"),
    FieldMapping("num_logits_indices", "input", None, "as logits_indices_padded"),
    FieldMapping("max_logits_per_req", "input", None, "as logits_indices_padded"),
    FieldMapping("encoder_seq_lens", "input", None,
                 "cross-attention (encoder-decoder) groups: attnmeta has no cross-attention builder"),
    FieldMapping("encoder_seq_lens_cpu", "input", None, "as encoder_seq_lens (a numpy array in vLLM)"),
    FieldMapping("dcp_local_seq_lens", "input", None,
                 "decode context parallelism: attnmeta derives each rank's lengths in the builders that "
                 "read them (FlashAttentionMetadata.dcp_context_kv_lens, the FlashInfer and MLA DCP "
                 "fields), not in the common metadata"),
    FieldMapping("dcp_local_seq_lens_cpu_upper_bound", "input", None, "as dcp_local_seq_lens"),
    FieldMapping("positions", "device", "positions",
                 "(num_actual_tokens,) int64; padding 0; None when staged with token_arrays=False"),
    FieldMapping("is_prefilling", "host", "is_prefilling",
                 "(num_reqs,) bool; padding rows False; all False when the spec had no prompt lengths"),
    FieldMapping("seq_lens_cpu_upper_bound", "host", "seq_lens_cpu_upper_bound",
                 "(num_reqs,) int32; optimistic under async spec decode, else equal to seq_lens"),
    FieldMapping("req_idx", "input", None,
                 "prefill context parallelism splits a request over adjacent rows; a BatchSpec has one "
                 "row per request"),
    FieldMapping("mm_req_doc_ranges", "input", None,
                 "PrefixLM bidirectional ranges: an input of attnmeta's mm_prefix builder, not derived"),
    FieldMapping("rswa_prefix_lens", "input", None,
                 "R-SWA prompt lengths: the common metadata keeps is_prefilling, not the prompt lengths"),
    FieldMapping("replayssm_decode_base_cpu", "input", None,
                 "Mamba2 ReplaySSM ring origin: runner state that attnmeta does not model"),
    FieldMapping("_num_computed_tokens_cache", "memo", None,
                 "vLLM's private memo of compute_num_computed_tokens(), filled on first call (on the device, "
                 "no sync)"),
    FieldMapping("_token_to_req_indices_cache", "memo", None,
                 "vLLM's private memo of token_to_req_indices(), filled on first call"),
)
"""One :class:`FieldMapping` for each of :data:`VLLM_COMMON_FIELDS`, in the same order."""

VLLM_INPUT_FIELDS: frozenset[str] = frozenset(m.vllm for m in VLLM_FIELD_MAP if m.role == "input")
"""The vLLM fields :func:`vllm_common_kwargs` takes from its caller (attnmeta does not derive them)."""

ATTNMETA_ONLY_FIELDS: Mapping[str, str] = MappingProxyType({
    "seq_lens_cpu": "exact host lengths; vLLM 0.33.0 removed its seq_lens_cpu (a sync) for "
                    "seq_lens_cpu_upper_bound, which equals it outside async spec decode",
    "num_computed_tokens_cpu": "removed from vLLM 0.33.0 (compute_num_computed_tokens() derives it on the device)",
    "block_table_cpu": "host twin of block_table_tensor; vLLM keeps the block table on the device only",
    "slot_mapping_cpu": "host twin of slot_mapping; vLLM computes the slot mapping on the device only",
    "positions_cpu": "host twin of positions; vLLM's CommonAttentionMetadata has the device tensor only",
    "num_decode_draft_tokens_cpu": "vLLM passes it to its Mamba2 / GDN / linear-attention builders as a "
                                   "build() keyword, not in CommonAttentionMetadata",
    "block_size": "vLLM builders read it from their kv_cache_spec",
    "num_real_reqs": "vLLM keeps the padded count only",
    "num_real_tokens": "vLLM keeps the padded count only (query_start_loc_cpu[-1] is the real one)",
})
"""attnmeta :class:`~attnmeta.CommonAttentionMetadata` fields vLLM's has no place for, and why."""

_INSTALL_HINT = (
    "tests/integrations/install_vllm.sh makes a separate virtual environment where it imports (docs/vllm.md, "
    "'Testing against vLLM')"
)


# ------------------------------------------------------------------ vLLM -> attnmeta


def _host(value: Any, name: str) -> np.ndarray | None:
    """``value`` (None, a numpy array, a CPU torch tensor or a sequence) as a host numpy array, never
    reading device memory: a tensor on any other device is a ``TypeError``."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu":
            raise TypeError(
                f"{name}: a {value.device.type} tensor; spec_from_vllm reads host data only (reading a device "
                f"tensor on the host is a GPU->CPU sync). Pass the host copy vLLM's runner already holds"
            )
        return value.numpy()  # zero copy: a CPU tensor's memory
    return np.asarray(value)


def _no_host_table(got: str) -> ValueError | TypeError:
    message = (
        f"block_table: {got}. attnmeta derives the slot mapping and the staged block table on the host from "
        f"the block ids, so it needs the host block table: vLLM's CommonAttentionMetadata carries only the "
        f"device block_table_tensor, which attnmeta never reads (a GPU->CPU sync). Pass the runner's host "
        f"table, input_batch.block_table[kv_cache_group_id].get_numpy_array() (its rows [0, num_reqs) are "
        f"what block_table_tensor was copied from). attnmeta has no mode that builds from a device block "
        f"table: its device-gather modes (FlashInferOptions(indices='device'), "
        f"LocalAttentionOptions(block_table='device')) gather from the table it staged from the host one "
        f"(docs/vllm.md, 'The block table')"
    )
    return ValueError(message) if got == "None" else TypeError(message)


def _rows(arr: np.ndarray | None, name: str, n: int) -> np.ndarray | None:
    """The first ``n`` entries of a per-request host array (at least ``n`` long: the real rows)."""
    if arr is None:
        return None
    if arr.ndim != 1 or arr.shape[0] < n:
        raise ValueError(f"{name}: expected a 1-D array with an entry for each of the {n} real requests at least, "
                         f"got shape {arr.shape}")
    return arr[:n]


def _count(value: Any, name: str) -> int:
    """``value``, a host int of vLLM's metadata (``num_reqs``, ``num_actual_tokens``); a tensor is refused
    unread (a device tensor's ``int()`` is a sync)."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name}: expected a host int, got {type(value).__name__}"
                        + ("" if isinstance(value, torch.Tensor) else f" {value!r:.40}"))
    return int(value)


def spec_from_vllm(
    cm: Any,
    *,
    block_size: int,
    block_table: npt.ArrayLike | torch.Tensor | None = None,
    num_computed_tokens: npt.ArrayLike | torch.Tensor | None = None,
    num_prompt_tokens: npt.ArrayLike | torch.Tensor | None = None,
    num_draft_tokens: npt.ArrayLike | torch.Tensor | None = None,
    num_real_reqs: int | None = None,
    context_parallel: ContextParallel | None = None,
) -> BatchSpec:
    """The :class:`~attnmeta.BatchSpec` of the step a vLLM 0.33 ``CommonAttentionMetadata`` describes.

    Reads host data only: ``cm.query_start_loc_cpu``, ``cm.seq_lens_cpu_upper_bound``,
    ``cm.is_prefilling`` (each a CPU tensor or numpy array, or None where optional), ``cm.num_reqs``,
    ``cm.num_actual_tokens``, and the arrays passed here. No device field of ``cm`` is touched. Any
    object with these attributes works (a stand-in in tests).

    How the spec is derived (``B = cm.num_reqs``, ``q = diff(query_start_loc_cpu)``):

    - real rows ``n``: ``num_real_reqs``, else ``B`` less the trailing rows that vLLM's CUDA-graph
      padding made (query length 0 and, where given, upper bound 0; a real vLLM request always has
      a query); ``num_reqs_padded = B`` when ``B > n``;
    - ``num_scheduled_tokens = q[:n]``; ``num_tokens_padded = cm.num_actual_tokens`` when it exceeds
      ``query_start_loc_cpu[-1]``;
    - ``num_computed_tokens``: as given, else ``seq_lens_cpu_upper_bound - q``, which is exact
      whenever async spec decode is off (vLLM: "precise for prefill rows and for all rows outside async
      spec decode"); under async spec decode pass the exact counts, and the upper bound becomes the
      spec's ``seq_lens_upper_bound``;
    - ``num_prompt_tokens``: as given, else ``num_computed_tokens + is_prefilling`` (one more than
      the context where the row still prefills), which reproduces ``is_prefilling`` for this step
      but is not the true prompt length: pass the real ones where the spec is split further
      (:mod:`attnmeta.ubatch`);
    - ``max_query_len`` / ``max_seq_len`` are re-derived from the arrays (vLLM's agree, except in its
      CUDA-graph capture, which passes ``max_model_len`` as ``max_seq_len``).

    Parameters
    ----------
    cm : vllm.v1.attention.backends.utils.CommonAttentionMetadata
        The step's metadata as vLLM's runner built it (or an object with the same host attributes).
    block_size : int
        Tokens per KV block of the block table (the KV-cache group's ``kv_cache_spec.block_size``).
    block_table : (>= n, max_blocks_per_req) int32, host
        The **host** block table (numpy, or a CPU tensor): vLLM's
        ``input_batch.block_table[kv_cache_group_id].get_numpy_array()``. Required: None or a device
        tensor raises (see Raises). Only its first ``n`` rows are read (and converted, for an int64 or
        strided table): the rows past them may hold anything.
    num_computed_tokens : (>= n,) int32, host, optional
        Exact tokens already in the KV cache of each row (vLLM's ``input_batch.num_computed_tokens_cpu``);
        default ``seq_lens_cpu_upper_bound - q`` (see above). Required when ``cm`` has no upper bound.
    num_prompt_tokens : (>= n,) int32, host, optional
        Prompt lengths (vLLM's ``input_batch.num_prompt_tokens_cpu``); default from ``cm.is_prefilling``.
    num_draft_tokens : (>= n,) int32, host, optional
        Speculative draft tokens scheduled per row; gives ``num_decode_draft_tokens_cpu``.
    num_real_reqs : int, optional
        Rows before CUDA-graph padding; default: inferred as above.
    context_parallel : ContextParallel, optional
        DCP/PCP layout (vLLM's ``decode_context_parallel_size`` x PCP size, this rank,
        ``cp_kv_cache_interleave_size``); None: none.

    Returns
    -------
    BatchSpec
        Validated; ``attnmeta.build_common(spec, stager)`` (or any builder) derives the step from it.

    Raises
    ------
    ValueError
        ``block_table`` is None (the message says where vLLM's host table is, and that attnmeta has no
        device-block-table mode); ``cm``'s host fields break vLLM's invariants (named with the row);
        neither an upper bound nor ``num_computed_tokens`` is available; any rule of
        :class:`~attnmeta.BatchSpec` (re-raised with the batch's sizes, the cause chained).
    TypeError
        ``cm`` lacks a host field; a host field or ``block_table`` is a tensor on a device (never read).

    Examples
    --------
    Two decodes and a prefill, padded by vLLM to 4 rows and 8 tokens (a stand-in with vLLM's host
    fields):

    >>> from types import SimpleNamespace
    >>> import torch
    >>> cm = SimpleNamespace(
    ...     num_reqs=4, num_actual_tokens=8,
    ...     query_start_loc_cpu=torch.tensor([0, 1, 2, 6, 6], dtype=torch.int32),
    ...     seq_lens_cpu_upper_bound=torch.tensor([6, 8, 4, 0], dtype=torch.int32),
    ...     is_prefilling=torch.tensor([False, False, True, False]))
    >>> table = np.array([[10, 11], [20, 21], [30, 31], [0, 0]], np.int32)
    >>> spec = spec_from_vllm(cm, block_table=table, block_size=4)
    >>> # (numpy arrays: host data)
    >>> spec.num_computed_tokens.tolist(), spec.num_scheduled_tokens.tolist(), spec.num_prompt_tokens.tolist()  # (host arrays)
    ([5, 7, 0], [1, 1, 4], [5, 7, 1])
    >>> spec.num_reqs, spec.num_reqs_padded, spec.num_tokens, spec.num_tokens_padded
    (3, 4, 6, 8)
    """
    try:
        B, T = _count(cm.num_reqs, "cm.num_reqs"), _count(cm.num_actual_tokens, "cm.num_actual_tokens")
        qsl_raw = cm.query_start_loc_cpu
    except AttributeError as e:
        raise TypeError(
            f"cm: expected a vLLM CommonAttentionMetadata (num_reqs, num_actual_tokens, query_start_loc_cpu, ...), "
            f"got {type(cm).__name__} without {e.name!r}"
        ) from e
    qsl = as_host_array(_host(qsl_raw, "cm.query_start_loc_cpu"), "cm.query_start_loc_cpu", length=B + 1)
    if qsl[0] != 0:
        raise ValueError(f"cm.query_start_loc_cpu[0]={int(qsl[0])} != 0")
    q = np.diff(qsl).astype(np.int32)
    if (q < 0).any():
        i = int(np.argmax(q < 0))
        raise ValueError(f"cm.query_start_loc_cpu decreases at row {i}: {int(qsl[i])} -> {int(qsl[i + 1])}")
    total = int(qsl[-1])
    if total > T:
        raise ValueError(f"cm.query_start_loc_cpu[-1]={total} > cm.num_actual_tokens={T}")
    ub_all = _host(getattr(cm, "seq_lens_cpu_upper_bound", None), "cm.seq_lens_cpu_upper_bound")
    if ub_all is not None:
        ub_all = as_host_array(ub_all, "cm.seq_lens_cpu_upper_bound", length=B)
    if num_real_reqs is None:
        n = B
        while n and q[n - 1] == 0 and (ub_all is None or ub_all[n - 1] == 0):
            n -= 1
    else:
        if isinstance(num_real_reqs, bool) or not isinstance(num_real_reqs, int | np.integer):
            raise TypeError(f"num_real_reqs: expected an int or None, got {type(num_real_reqs).__name__}")
        n = int(num_real_reqs)
        if not 0 <= n <= B:
            raise ValueError(f"num_real_reqs={n}: must be within [0, cm.num_reqs={B}]")
        if (q[n:] != 0).any():
            i = n + int(np.argmax(q[n:] != 0))
            raise ValueError(f"cm.query_start_loc_cpu: padding row {i} (>= num_real_reqs={n}) has {int(q[i])} "
                             f"query tokens; padding rows have none")
    c = _rows(_host(num_computed_tokens, "num_computed_tokens"), "num_computed_tokens", n)
    ub = None if ub_all is None else ub_all[:n]
    if c is None:
        if ub is None:
            raise ValueError(
                "num_computed_tokens: required when cm.seq_lens_cpu_upper_bound is None: the sequence lengths are "
                "then only on the device (cm.seq_lens), which attnmeta never reads; pass the runner's host counts "
                "(input_batch.num_computed_tokens_cpu)"
            )
        c = ub - q[:n]
        if (c < 0).any():
            i = int(np.argmax(c < 0))
            raise ValueError(f"cm.seq_lens_cpu_upper_bound[{i}]={int(ub[i])} < query length {int(q[i])} (row {i})")
        ub = None  # exactly c + q: nothing to add
    prompt = _rows(_host(num_prompt_tokens, "num_prompt_tokens"), "num_prompt_tokens", n)
    if prompt is None:
        pre = _rows(_host(getattr(cm, "is_prefilling", None), "cm.is_prefilling"), "cm.is_prefilling", n)
        if pre is not None:
            prompt = c.astype(np.int64) + as_host_array(pre, "cm.is_prefilling", dtype=np.bool_)
    drafts = _rows(_host(num_draft_tokens, "num_draft_tokens"), "num_draft_tokens", n)
    if block_table is None:
        raise _no_host_table("None")
    if isinstance(block_table, torch.Tensor) and block_table.device.type != "cpu":
        raise _no_host_table(f"a {block_table.device.type} tensor")
    table = _host(block_table, "block_table")
    assert table is not None  # (None was rejected above)
    if table.ndim == 2:  # (the real rows only: the runner's persistent table has stale rows past them, and a
        table = table[:n]  # view or an int64 table is converted, and checked, for these rows alone)
    try:
        return BatchSpec(
            num_computed_tokens=c, num_scheduled_tokens=q[:n], block_table=table, block_size=block_size,
            num_prompt_tokens=prompt, num_draft_tokens=drafts, seq_lens_upper_bound=ub,
            num_reqs_padded=B if n < B else None, num_tokens_padded=T if total < T else None,
            context_parallel=context_parallel,
        )
    except ValueError as e:  # q is a numpy array of host data: its tolist() reads no device
        raise ValueError(
            f"spec_from_vllm: {e} (vLLM batch: num_reqs={B}, real rows {n}, num_actual_tokens={T}, "
            f"query lengths {q[:8].tolist()}{' ...' if B > 8 else ''})"
        ) from e


# ------------------------------------------------------------------ attnmeta -> vLLM


def vllm_common_kwargs(common: CommonAttentionMetadata, **inputs: Any) -> dict[str, Any]:
    """The keyword arguments of vLLM 0.33.0's ``CommonAttentionMetadata`` for ``common``, without
    importing vLLM (:func:`to_vllm_common` passes them to vLLM's class).

    One entry per field of :data:`VLLM_FIELD_MAP` except the two memo caches (left at vLLM's default):

    - device fields: ``common``'s device views as they are (no copy, same stream contract);
    - host fields (``query_start_loc_cpu``, ``seq_lens_cpu_upper_bound``, ``is_prefilling``): CPU torch
      tensors sharing ``common``'s host arrays' memory. ``query_start_loc_cpu`` is a view of the step's
      pinned slot (on CUDA ``is_pinned()`` holds: a ``non_blocking`` copy from it is real DMA);
      ``seq_lens_cpu_upper_bound`` and ``is_prefilling`` are attnmeta's host-only arrays, in ordinary
      (pageable) memory of the step's slot, which vLLM's builders read for host arithmetic (vLLM's own
      ``is_prefilling`` is pageable too; its upper bound is a pinned view). The arrays are read-only and
      so are these tensors **in use**: torch cannot mark a tensor read-only, and a write into one
      rewrites the step's memory. vLLM 0.33.0's builders write only into copies of them (the Mamba
      builder clones ``is_prefilling``), but its EAGLE drafter adds 1 to ``seq_lens_cpu_upper_bound`` in
      place for each draft step after the first: metadata handed to a drafter needs that field cloned
      (``replace(seq_lens_cpu_upper_bound=t.clone())``);
    - ``positions`` is None when ``common`` was staged with ``token_arrays=False`` (it is then empty);
    - the fields attnmeta does not derive (:data:`VLLM_INPUT_FIELDS`) are the caller's ``inputs``, else
      None.

    Lifetime: the tensors are views of ``common``'s step. ``common`` itself raises
    :class:`attnmeta.StepExpiredError` once the stager reuses the step's slot; the vLLM object cannot:
    use it within the same window (the step's metadata is valid until ``num_slots`` steps later).

    Parameters
    ----------
    common : attnmeta.CommonAttentionMetadata
        The committed common metadata of a step (``build_common`` or ``StagedCommon.result()``).
    **inputs
        Values of :data:`VLLM_INPUT_FIELDS` (e.g. ``mm_req_doc_ranges=...``, ``encoder_seq_lens=...``),
        passed on as they are.

    Returns
    -------
    dict[str, Any]
        Field name -> value, in :data:`VLLM_COMMON_FIELDS` order.

    Raises
    ------
    TypeError
        ``common`` is not an attnmeta ``CommonAttentionMetadata``; an input is not a vLLM field, or is a
        field attnmeta derives (change those on ``common`` with ``common.replace(...)`` instead).

    Examples
    --------
    >>> from attnmeta import BatchSpec, Stager, build_common
    >>> spec = BatchSpec(num_computed_tokens=[5, 7, 0], num_scheduled_tokens=[1, 1, 4],
    ...                  block_table=[[10, 11], [20, 21], [30, 31]], block_size=4)
    >>> kw = vllm_common_kwargs(build_common(spec, Stager("cpu")))
    >>> kw["query_start_loc_cpu"], kw["num_reqs"], kw["max_seq_len"], kw["req_idx"]
    (tensor([0, 1, 2, 6], dtype=torch.int32), 3, 8, None)
    >>> kw["seq_lens_cpu_upper_bound"].tolist(), kw["is_prefilling"].dtype  # (host arrays)
    ([6, 8, 4], torch.bool)
    """
    if not isinstance(common, CommonAttentionMetadata):
        raise TypeError(
            f"common: expected an attnmeta.CommonAttentionMetadata (build_common(...) or StagedCommon.result()), "
            f"got {type(common).__name__}"
        )
    unknown = sorted(set(inputs) - VLLM_INPUT_FIELDS)
    if unknown:
        derived = [k for k in unknown if k in VLLM_COMMON_FIELDS]
        raise TypeError(
            f"vllm_common_kwargs(): {unknown} not accepted: "
            + (f"{derived} come from attnmeta's metadata (change them with common.replace(...)); " if derived else "")
            + f"inputs are {sorted(VLLM_INPUT_FIELDS)}"
        )
    out: dict[str, Any] = {}
    for m in VLLM_FIELD_MAP:
        if m.role == "input":
            out[m.vllm] = inputs.get(m.vllm)
        elif m.role == "memo":
            continue
        else:
            value = getattr(common, m.source)  # type: ignore[arg-type]  # (every non-input, non-memo has one)
            out[m.vllm] = host_tensor(value) if m.role == "host" else value
    if common.positions.shape[0] == 0 and common.num_actual_tokens:  # staged without token arrays
        out["positions"] = None
    return out


@functools.cache
def vllm_common_class() -> type[VllmCommonAttentionMetadata]:
    """vLLM's ``CommonAttentionMetadata`` class, imported now, checked against the pinned fields.

    Returns
    -------
    type
        ``vllm.v1.attention.backends.utils.CommonAttentionMetadata``.

    Raises
    ------
    ImportError
        vLLM is not importable (the message says how to get a venv where it is).
    RuntimeError
        Its dataclass fields (names, order, defaults) differ from :data:`VLLM_COMMON_FIELDS` /
        :data:`VLLM_COMMON_DEFAULTS`, which this adapter maps (vLLM 0.33.0): the message lists the
        differences.
    """
    import dataclasses

    try:
        from vllm.v1.attention.backends.utils import CommonAttentionMetadata as cls
    except ImportError as e:
        raise ImportError(
            f"attnmeta.integrations.vllm.to_vllm_common needs vLLM {VLLM_VERSION} importable "
            f"(`from vllm.v1.attention.backends.utils import CommonAttentionMetadata` failed: {e}); {_INSTALL_HINT}"
        ) from e
    got = [(f.name, f.default if f.default is not dataclasses.MISSING else "<required>")
           for f in dataclasses.fields(cls)]
    want = [(name, VLLM_COMMON_DEFAULTS.get(name, "<required>")) for name in VLLM_COMMON_FIELDS]
    if got != want:
        import vllm

        names = {name for name, _ in got}
        raise RuntimeError(
            f"vLLM {getattr(vllm, '__version__', '?')}'s CommonAttentionMetadata is not the one this adapter maps "
            f"(vLLM {VLLM_VERSION}): fields added {sorted(names - set(VLLM_COMMON_FIELDS))}, removed "
            f"{sorted(set(VLLM_COMMON_FIELDS) - names)}; (name, default) in order: got {got}, expected {want}"
        )
    return cls  # type: ignore[no-any-return]


def to_vllm_common(common: CommonAttentionMetadata, **inputs: Any) -> VllmCommonAttentionMetadata:
    """A vLLM 0.33.0 ``CommonAttentionMetadata`` holding ``common``'s metadata (no copy, no sync).

    ``vllm_common_class()(**vllm_common_kwargs(common, **inputs))``: device fields are ``common``'s
    device views; ``query_start_loc_cpu``, ``seq_lens_cpu_upper_bound`` and ``is_prefilling`` are CPU
    tensors sharing ``common``'s host arrays' memory (read-only in use; see
    :func:`vllm_common_kwargs`, which also says which are pinned and gives the lifetime); the fields
    attnmeta does not derive are
    ``inputs`` or None (:data:`VLLM_FIELD_MAP` says why each one is not derived).

    Parameters
    ----------
    common : attnmeta.CommonAttentionMetadata
        The committed common metadata of a step.
    **inputs
        Values of :data:`VLLM_INPUT_FIELDS`, passed on as they are.

    Returns
    -------
    vllm.v1.attention.backends.utils.CommonAttentionMetadata
        vLLM's own dataclass: its methods (``unpadded``, ``compute_num_computed_tokens``, ...) and
        helpers (``split_decodes_and_prefills``) work on it.

    Raises
    ------
    ImportError, RuntimeError
        As :func:`vllm_common_class` (vLLM missing, or not the pinned release's class).
    TypeError
        As :func:`vllm_common_kwargs`.
    """
    kwargs = vllm_common_kwargs(common, **inputs)
    return vllm_common_class()(**kwargs)
