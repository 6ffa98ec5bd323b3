"""``CommonAttentionMetadata``: the per-step metadata every attention-like layer shares.

Field names, dtypes, shapes and semantics follow vLLM 0.33.0's ``CommonAttentionMetadata``
(shared/reference/vllm-semantics.md section 2), so a vLLM backend can take attnmeta's object in place
of its own. Differences, all deliberate:

- every device field has its numpy host twin (``<name>_cpu``), filled on the host first and copied to
  the device in the step's one H2D copy; nothing is ever copied back;
- there are no memo caches: ``replace()`` can never carry a stale derived value, and changing a device
  field without its host twin (or the reverse) is an error;
- ``block_table_tensor`` has ``max_blocks`` columns: in eager mode the most blocks any request uses
  (columns past a request's own blocks are never read by kernels), in graph mode the profile's
  ``max_blocks_per_req``; vLLM stages its full persistent width;
- ``seq_lens_cpu`` (exact, from the host) exists; vLLM removed it because its host could not know
  exact lengths under async spec decode, where attnmeta's caller passes the optimistic lengths as
  ``BatchSpec.seq_lens_upper_bound`` (see docs/serving.md).

Build one with :func:`build_common` (its own step) or :func:`stage_common` (into a step shared with
backend builders, so everything moves in the same single copy).

Shape legend
------------
- ``num_reqs``: request rows including CUDA-graph padding rows.
- ``num_actual_tokens``: tokens including CUDA-graph padding tokens.
- ``max_blocks``: block-table columns staged (see above).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import numpy as np
import torch

from attnmeta._fields import MetadataBase, Staged, fast_constructor
from attnmeta.host.common import _common_nb, _common_packed_nb, _paged_from_staged_nb
from attnmeta.host.split import SplitCounts, _split_nb
from attnmeta.spec import BatchSpec
from attnmeta.staging import CapacityError, FieldGroup, Stager, Step

__all__ = ["CommonAttentionMetadata", "build_common", "common_split", "stage_common"]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True, repr=False, eq=False)
class CommonAttentionMetadata(MetadataBase):
    """Per-step metadata shared by every attention-like layer of one KV-cache group.

    Device tensors are views into a step's device arena, valid for kernels enqueued on the commit
    stream after the step commits. Host arrays are read-only views into the step's pinned slot (the
    host-only ones into buffers that belong to that slot); they stay valid until the stager reuses
    that slot (``num_slots`` steps later): copy them if you keep them longer.

    Examples
    --------
    Two decodes with 5 and 7 cached tokens, one fresh 4-token prefill, block size 4, padded to 4
    rows and 8 tokens:

    >>> import numpy as np
    >>> from attnmeta import BatchSpec, Stager, build_common
    >>> spec = BatchSpec(num_computed_tokens=[5, 7, 0], num_scheduled_tokens=[1, 1, 4],
    ...                  block_table=[[10, 11], [20, 21], [30, 31]], block_size=4,
    ...                  num_reqs_padded=4, num_tokens_padded=8)
    >>> cm = build_common(spec, Stager("cpu"))
    >>> cm.query_start_loc_cpu.tolist(), cm.seq_lens_cpu.tolist()
    ([0, 1, 2, 6, 6], [6, 8, 4, 0])
    >>> cm.slot_mapping_cpu.tolist()
    [45, 87, 120, 121, 122, 123, -1, -1]
    >>> cm.query_start_loc
    tensor([0, 1, 2, 6, 6], dtype=torch.int32)
    >>> cm.num_reqs, cm.num_actual_tokens, cm.max_query_len, cm.max_seq_len
    (4, 8, 4, 8)
    """

    _DEVICE_FIELDS: ClassVar[tuple[str, ...]] = (
        "query_start_loc",
        "seq_lens",
        "block_table_tensor",
        "slot_mapping",
        "positions",
    )
    _HOST_FIELDS: ClassVar[tuple[str, ...]] = (
        "query_start_loc_cpu",
        "seq_lens_cpu",
        "seq_lens_cpu_upper_bound",
        "num_computed_tokens_cpu",
        "block_table_cpu",
        "slot_mapping_cpu",
        "positions_cpu",
        "is_prefilling",
        "num_decode_draft_tokens_cpu",
    )
    _SCALAR_FIELDS: ClassVar[tuple[str, ...]] = (
        "num_reqs",
        "num_actual_tokens",
        "max_query_len",
        "max_seq_len",
        "block_size",
        "causal",
        "num_real_reqs",
        "num_real_tokens",
    )
    _TWINS: ClassVar[tuple[tuple[str, str], ...]] = (
        ("query_start_loc", "query_start_loc_cpu"),
        ("seq_lens", "seq_lens_cpu"),
        ("block_table_tensor", "block_table_cpu"),
        ("slot_mapping", "slot_mapping_cpu"),
        ("positions", "positions_cpu"),
    )

    # ---- device fields
    query_start_loc: torch.Tensor
    """(num_reqs + 1,) int32, device. Exclusive prefix sum of query lengths; [0] == 0; padding rows
    repeat the last value (their query length is 0)."""
    seq_lens: torch.Tensor
    """(num_reqs,) int32, device. ``num_computed_tokens + num_scheduled_tokens``; padding rows 0."""
    block_table_tensor: torch.Tensor
    """(num_reqs, max_blocks) int32, device. Physical block ids; padding rows 0 (NULL_BLOCK_ID)."""
    slot_mapping: torch.Tensor
    """(num_actual_tokens,) int64, device. KV slot of each token; padding (and non-local, under
    context parallelism) tokens -1 (PAD_SLOT_ID). ``(0,)`` when staged with ``token_arrays=False``."""
    positions: torch.Tensor
    """(num_actual_tokens,) int64, device. Absolute position of each token; padding tokens 0. ``(0,)``
    when staged with ``token_arrays=False``."""
    # ---- host fields
    query_start_loc_cpu: np.ndarray
    """(num_reqs + 1,) int32, host. Twin of ``query_start_loc``."""
    seq_lens_cpu: np.ndarray
    """(num_reqs,) int32, host. Twin of ``seq_lens`` (exact)."""
    seq_lens_cpu_upper_bound: np.ndarray
    """(num_reqs,) int32, host. ``BatchSpec.seq_lens_upper_bound`` (optimistic under async spec decode),
    else equal to ``seq_lens_cpu``; padding rows 0."""
    num_computed_tokens_cpu: np.ndarray
    """(num_reqs,) int32, host. ``seq_lens_cpu - diff(query_start_loc_cpu)``; padding rows 0."""
    block_table_cpu: np.ndarray
    """(num_reqs, max_blocks) int32, host. Twin of ``block_table_tensor``."""
    slot_mapping_cpu: np.ndarray
    """(num_actual_tokens,) int64, host. Twin of ``slot_mapping``."""
    positions_cpu: np.ndarray
    """(num_actual_tokens,) int64, host. Twin of ``positions``."""
    is_prefilling: np.ndarray
    """(num_reqs,) bool, host only. ``num_computed_tokens < num_prompt_tokens``; padding rows False;
    all False when the spec gives no prompt lengths."""
    num_decode_draft_tokens_cpu: np.ndarray | None
    """(num_reqs,) int32, host only, or None without spec decode. Drafts of row i when
    ``q_i == drafts_i + 1``, else -1; padding rows -1 (vllm-semantics.md 3.4)."""
    # ---- host scalars
    num_reqs: int
    """Request rows, padding included."""
    num_actual_tokens: int
    """Tokens, padding included (may exceed ``query_start_loc_cpu[-1]``)."""
    max_query_len: int
    """Max scheduled tokens over the real rows."""
    max_seq_len: int
    """Max of ``seq_lens_cpu_upper_bound`` over the real rows (an upper bound under async spec decode)."""
    block_size: int
    """Tokens per KV block."""
    causal: bool = True
    """Causal attention for every request."""
    num_real_reqs: int
    """Requests before padding."""
    num_real_tokens: int
    """Tokens before padding (``query_start_loc_cpu[-1]``)."""

    # ------------------------------------------------------------------ methods
    def replace(self, **changes: Any) -> CommonAttentionMetadata:
        """A new object with ``changes`` applied.

        A device field and its host twin must change together. ``num_computed_tokens_cpu`` is
        re-derived when ``seq_lens_cpu`` or ``query_start_loc_cpu`` change (unless given), so no stale
        derived value survives.
        """
        self._check_twins(changes)
        if ("seq_lens_cpu" in changes or "query_start_loc_cpu" in changes) and "num_computed_tokens_cpu" not in changes:
            sl = changes.get("seq_lens_cpu", self.seq_lens_cpu)
            qsl = changes.get("query_start_loc_cpu", self.query_start_loc_cpu)
            if np.shape(qsl) != (np.shape(sl)[0] + 1,):
                raise ValueError(
                    f"replace(): cannot re-derive num_computed_tokens_cpu: seq_lens_cpu has shape {np.shape(sl)} "
                    f"but query_start_loc_cpu has shape {np.shape(qsl)} (need len(seq_lens_cpu) + 1 entries); "
                    f"fix the shapes or pass num_computed_tokens_cpu explicitly"
                )
            changes["num_computed_tokens_cpu"] = (sl - np.diff(qsl)).astype(np.int32)
        return dataclasses.replace(self, **changes)

    def unpadded(self, num_actual_tokens: int, num_reqs: int) -> CommonAttentionMetadata:
        """The first ``num_reqs`` rows and ``num_actual_tokens`` tokens (drops padding).

        ``max_query_len`` / ``max_seq_len`` are kept as they are (vLLM's ``unpadded``).
        """
        if not 0 <= num_reqs <= self.num_reqs or not 0 <= num_actual_tokens <= self.num_actual_tokens:
            raise ValueError(
                f"unpadded({num_actual_tokens}, {num_reqs}): must be within num_actual_tokens="
                f"{self.num_actual_tokens}, num_reqs={self.num_reqs}"
            )
        B, T = num_reqs, num_actual_tokens
        ddt = self.num_decode_draft_tokens_cpu
        return dataclasses.replace(
            self,
            query_start_loc=self.query_start_loc[: B + 1],
            query_start_loc_cpu=self.query_start_loc_cpu[: B + 1],
            seq_lens=self.seq_lens[:B],
            seq_lens_cpu=self.seq_lens_cpu[:B],
            seq_lens_cpu_upper_bound=self.seq_lens_cpu_upper_bound[:B],
            num_computed_tokens_cpu=self.num_computed_tokens_cpu[:B],
            block_table_tensor=self.block_table_tensor[:B],
            block_table_cpu=self.block_table_cpu[:B],
            slot_mapping=self.slot_mapping[:T],
            slot_mapping_cpu=self.slot_mapping_cpu[:T],
            positions=self.positions[:T],
            positions_cpu=self.positions_cpu[:T],
            is_prefilling=self.is_prefilling[:B],
            num_decode_draft_tokens_cpu=None if ddt is None else ddt[:B],
            num_reqs=B,
            num_actual_tokens=T,
            num_real_reqs=min(self.num_real_reqs, B),
            num_real_tokens=int(self.query_start_loc_cpu[B]),
        )

    def query_lens_cpu(self) -> np.ndarray:
        """(num_reqs,) int32, host: ``diff(query_start_loc_cpu)``."""
        return np.diff(self.query_start_loc_cpu).astype(np.int32)

    def compute_num_computed_tokens(self) -> torch.Tensor:
        """(num_reqs,) int32, device: ``seq_lens - diff(query_start_loc)``, computed on the device (no
        sync; a new tensor each call, never memoised)."""
        return self.seq_lens - (self.query_start_loc[1:] - self.query_start_loc[:-1])

    def validate(self) -> None:
        """Check the invariants of vllm-semantics.md section 2 on the host twins (never syncs).

        Raises
        ------
        ValueError
            Naming the invariant, the first offending row and the values.
        """
        qsl, B, T = self.query_start_loc_cpu, self.num_reqs, self.num_actual_tokens
        if qsl.shape != (B + 1,):
            raise ValueError(f"query_start_loc_cpu: shape {qsl.shape} != (num_reqs + 1,) = ({B + 1},)")
        for name in ("seq_lens_cpu", "seq_lens_cpu_upper_bound", "num_computed_tokens_cpu", "is_prefilling",
                     "num_decode_draft_tokens_cpu"):
            arr = getattr(self, name)
            if arr is not None and arr.shape != (B,):
                raise ValueError(f"{name}: shape {arr.shape} != (num_reqs,) = ({B},)")
        if qsl[0] != 0:
            raise ValueError(f"query_start_loc_cpu[0]={int(qsl[0])} != 0")
        q = np.diff(qsl)
        if (q < 0).any():
            i = int(np.argmax(q < 0))
            raise ValueError(f"query_start_loc_cpu decreases at row {i}: {int(qsl[i])} -> {int(qsl[i + 1])}")
        if int(qsl[-1]) > T:
            raise ValueError(f"query_start_loc_cpu[-1]={int(qsl[-1])} > num_actual_tokens={T}")
        if (self.seq_lens_cpu < q).any():
            i = int(np.argmax(self.seq_lens_cpu < q))
            raise ValueError(f"seq_lens_cpu[{i}]={int(self.seq_lens_cpu[i])} < query_lens[{i}]={int(q[i])} (request {i})")
        if (self.seq_lens_cpu_upper_bound < self.seq_lens_cpu).any():
            i = int(np.argmax(self.seq_lens_cpu_upper_bound < self.seq_lens_cpu))
            raise ValueError(
                f"seq_lens_cpu_upper_bound[{i}]={int(self.seq_lens_cpu_upper_bound[i])} < seq_lens_cpu[{i}]="
                f"{int(self.seq_lens_cpu[i])} (request {i})"
            )
        for name, rows in (("block_table_tensor", B), ("slot_mapping", T), ("seq_lens", B), ("positions", T)):
            got = getattr(self, name).shape[0]
            if got == 0 and name in ("slot_mapping", "positions"):
                continue  # not computed (token_arrays=False)
            if got < rows:
                raise ValueError(f"{name}: {got} rows < required {rows}")
        for dev, host in self._TWINS:
            d, h = getattr(self, dev), getattr(self, host)
            if tuple(d.shape) != h.shape:
                raise ValueError(f"{dev} shape {tuple(d.shape)} != its host twin {host} shape {h.shape}")


_new_common = fast_constructor(CommonAttentionMetadata)
_NAMES: dict[str, tuple[str, ...]] = {}  # prefix -> staged field names
_PAGED = ("paged_kv_indptr", "paged_kv_last_page_len", "paged_kv_indices")  # staged with paged_kv=True


def _bucket(n: int) -> int:
    """``n`` rounded up to one of 8 steps per power of two (at most 12.5% more; at least 64): a row
    count for fields whose exact length changes almost every step, so their layout stays cached."""
    if n <= 64:
        return 64
    step = 1 << (n.bit_length() - 4)
    return (n + step - 1) // step * step
_I32, _I64 = np.dtype(np.int32), np.dtype(np.int64)
_EMPTY_I32 = np.zeros(0, np.int32)


def _host_only(group: FieldGroup, key: tuple[Any, ...], Bp: int, W: int) -> tuple[Any, ...]:
    """Per-group state of :func:`stage_common`: the host-only buffer and every array view handed out.

    Returns ``(offsets, dims, host_only_bytes, qsl, upper, computed, prefilling, drafts)``: the
    arguments of :func:`attnmeta.host.common._common_packed_nb` and read-only views.
    """
    has_d, has_p, has_ub, bs, cp, tokens, paged = key
    a4 = (4 * Bp + 63) // 64 * 64
    hbuf = np.zeros(3 * a4 + Bp, np.uint8)
    ub, nc, ddt = (hbuf[i * a4 : i * a4 + 4 * Bp].view(np.int32) for i in range(3))
    pre = hbuf[3 * a4 : 3 * a4 + Bp].view(np.bool_)
    frozen = []
    for a in (ub, nc, pre, ddt):
        a.flags.writeable = False  # the kernel writes through the byte buffer, never through these
        frozen.append(a)
    qsl_full = group.host[0]
    fo = [f.offset for f in group.fields]
    offsets = np.zeros(13, np.int64)  # (offsets[9:] stay 0 without the paged-KV fields)
    offsets[: 9 + len(fo[5:])] = [*fo[:5], 0, a4, 2 * a4, 3 * a4, *fo[5:]]
    ws, rank, il = (1, 0, 1) if cp is None else (cp.world_size, cp.rank, cp.interleave)
    Tr = group.fields[3].rows  # staged per-token rows: Tp in graph mode, bucketed in eager mode
    dims = np.array([Bp, Tr, W, qsl_full.shape[0], bs, ws, rank, il, has_p, has_d, has_ub, tokens, paged,
                     group.fields[7].rows if paged else 0, Bp + 1, 0, 0, 0], np.int64)
    return (offsets, dims, hbuf, group.frozen[0][: Bp + 1], frozen[0], frozen[1], frozen[2],
            frozen[3] if has_d else None)


def stage_common(
    spec: BatchSpec,
    step: Step,
    *,
    prefix: str = "common",
    causal: bool = True,
    block_table_columns: int | None = None,
    token_arrays: bool = True,
    paged_kv: bool = False,
) -> Staged[CommonAttentionMetadata]:
    """Derive the common metadata of ``spec`` on the host, writing straight into ``step``'s pinned slot.

    Parameters
    ----------
    spec : BatchSpec
        The step's host description.
    step : Step
        An open step; everything staged here moves in its one H2D copy.
    prefix : str, default "common"
        Namespace of the staged field names (use one per KV-cache group sharing a step).
    causal : bool, default True
        Stored as ``causal``.
    block_table_columns : int, optional
        Columns of ``block_table_tensor``. Default: eager mode, the most blocks any request uses (at
        least 1; ``cdiv(seq_len, block_size * world_size)`` under context parallelism, where one column
        holds a block on every rank); graph mode, ``profile.max_blocks_per_req``.
    token_arrays : bool, default True
        Compute and stage the per-token ``slot_mapping`` and ``positions``. ``False`` is vLLM's
        ``SlotMappingMode.NONE`` for KV-cache groups whose layers read neither (Mamba, linear
        attention): both fields (and their host twins) are then empty, ``(0,)``, and a step of ``T``
        tokens stages ``16 * T`` fewer bytes.
    paged_kv : bool, default False
        Also build FlashInfer's paged-KV arrays (``paged_kv_indptr``, ``paged_kv_indices``,
        ``paged_kv_last_page_len``, page size = block size) in the same compiled pass, from the block
        table rows just staged (still in cache), and stage them with the common fields. A FlashInfer
        builder staged into the same step (:func:`attnmeta.backends.flashinfer.stage`, default options)
        then reuses them instead of a pass of its own. Eager mode without context parallelism only
        (elsewhere it is ignored and the backend builds its own).

    Returns
    -------
    Staged[CommonAttentionMetadata]
        ``.host`` is the :class:`CommonAttentionMetadata` field dict of host values plus ``num_pages``
        (:attr:`BatchSpec.num_pages`), for other builders in the same step; ``.result()`` after the
        commit gives the metadata.

    Raises
    ------
    attnmeta.staging.CapacityError
        Graph mode: the batch exceeds a profile capacity.
    """
    B, T = spec.num_reqs, spec.num_tokens
    Bp = B if spec.num_reqs_padded is None else spec.num_reqs_padded
    Tp = T if spec.num_tokens_padded is None else spec.num_tokens_padded
    bs = spec.block_size
    prof = step.profile
    graph = prof is not None
    cp = spec.context_parallel
    span = bs if cp is None else bs * cp.world_size  # tokens per block-table column (section 4)
    need = -(-spec.max_exact_seq_len // span)
    if block_table_columns is None:
        block_table_columns = prof.max_blocks_per_req if prof is not None else max(1, need)
    W = block_table_columns
    if need > W:
        raise CapacityError(
            f"block_table_tensor: a request needs {need} blocks but only {W} columns are staged "
            f"(block_table_columns / StaticProfile.max_blocks_per_req)"
        )
    Tt = Tp if token_arrays else 0  # rows of the per-token arrays
    names = _NAMES.get(prefix)
    if names is None:
        names = _NAMES[prefix] = tuple(f"{prefix}.{n}" for n in (*CommonAttentionMetadata._DEVICE_FIELDS, *_PAGED))
    if prof is not None:
        if prof.block_size != bs:
            raise ValueError(f"block_size: the spec's {bs} != StaticProfile.block_size={prof.block_size}")
        if Bp > prof.max_num_reqs or Tp > prof.max_num_tokens:
            raise CapacityError(
                f"batch of {Bp} rows / {Tp} tokens exceeds the profile (max_num_reqs={prof.max_num_reqs}, "
                f"max_num_tokens={prof.max_num_tokens})"
            )
        R, Q = prof.max_num_reqs, prof.max_num_tokens
        # query_start_loc's sentinel is data-dependent (it repeats the total): stage the full capacity.
        group = step.alloc_fields((
            (names[0], R + 1, _I32, R + 1, 0),
            (names[1], Bp, _I32, R, 0),
            (names[2], (Bp, W), _I32, R, 0),
            (names[3], Tt, _I64, Q, -1),
            (names[4], Tt, _I64, Q, 0),
        ))
    else:
        paged_rows = _bucket(spec.num_pages) if paged_kv and cp is None else 0
        # The per-token fields are staged at a bucketed row count (<= 12.5% slack, padded like the
        # padding tokens) and handed out as exact-length views: a step's token count changes almost
        # every step in a mixed batch, and a layout per count would rebuild the group every step.
        Tc = _bucket(Tt) if Tt else 0

        def eager_specs() -> tuple[tuple[str, Any, Any, int | None, Any], ...]:
            base: tuple[tuple[str, Any, Any, int | None, Any], ...] = (
                (names[0], Bp + 1, _I32, None, 0),
                (names[1], Bp, _I32, None, 0),
                (names[2], (Bp, W), _I32, None, 0),
                (names[3], Tc, _I64, None, -1),
                (names[4], Tc, _I64, None, 0),
            )
            if not paged_rows:
                return base
            return (*base, (names[5], Bp + 1, _I32, None, 0), (names[6], Bp, _I32, None, 0),
                    (names[7], paged_rows, _I32, None, 0))  # bucketed: <= 12.5% slack, never read

        # The layout depends on the token count only through the bucketed per-token rows (Tc): without
        # them (token_arrays=False) steps of any length share one cached layout per row count.
        group = step.alloc_fields(eager_specs, (names, Bp, W, Tc, paged_rows))
    prompt, drafts, upper = spec.num_prompt_tokens, spec.num_draft_tokens, spec.seq_lens_upper_bound
    has_d = drafts is not None
    # Host-only arrays (never staged) and the read-only views handed out live with the group: built
    # once per slot and layout (and kind of spec), rewritten every step like the slot itself.
    key = (has_d, prompt is not None, upper is not None, bs, cp, token_arrays, len(group.fields) > 5)
    cached = group.extras.get(key)
    if cached is None:
        cached = group.extras[key] = _host_only(group, key, Bp, W)
    offsets, dims, hbuf, qsl_ro, ub_ro, nc_ro, pre_ro, ddt_ro = cached
    args = (spec.num_computed_tokens, spec.num_scheduled_tokens, spec.block_table,
            _EMPTY_I32 if prompt is None else prompt, _EMPTY_I32 if drafts is None else drafts,
            _EMPTY_I32 if upper is None else upper)
    if group.buf is not None:
        status = _common_packed_nb(*args, group.buf, hbuf, offsets, dims)
    else:  # the slot grew while the group was reserved: write the fields through their own views
        a4 = int(offsets[6])
        ub, nc, ddt = (hbuf[i * a4 : i * a4 + 4 * Bp].view(np.int32) for i in range(3))
        qsl_w, sl_w, bt_w, sm_w, pos_w = group.host[:5]
        status = _common_nb(
            *args[:3], bs, int(dims[5]), int(dims[6]), int(dims[7]), args[3], prompt is not None, args[4], has_d,
            args[5], upper is not None, token_arrays, True, qsl_w, sl_w, bt_w, pos_w, sm_w, ub, nc,
            hbuf[3 * a4 : 3 * a4 + Bp].view(np.bool_), ddt,
        )
        if len(group.host) > 5:
            status |= _paged_from_staged_nb(sl_w, bt_w, bs, group.host[5], group.host[7], group.host[6])
    if status:  # unreachable for a validated spec (kept as a guard)
        raise ValueError(f"stage_common: internal status {status}; the spec is inconsistent")
    _sl_ro, bt_ro, sm_ro, pos_ro = group.frozen[1:5]
    exact_tokens = group.fields[3].rows == Tt
    if not exact_tokens:  # bucketed per-token rows: exact views, cached by token count
        tv = group.extras.get("tokens")
        if tv is None or tv[0] != Tt:
            tv = group.extras["tokens"] = (Tt, sm_ro[:Tt], pos_ro[:Tt])
        sm_ro, pos_ro = tv[1], tv[2]
    max_query_len, max_seq_len = spec.max_query_len, spec.max_seq_len
    host: dict[str, Any] = {
        "query_start_loc_cpu": qsl_ro,
        "seq_lens_cpu": _sl_ro,
        "seq_lens_cpu_upper_bound": ub_ro,
        "num_computed_tokens_cpu": nc_ro,
        "block_table_cpu": bt_ro,
        "slot_mapping_cpu": sm_ro,
        "positions_cpu": pos_ro,
        "is_prefilling": pre_ro,
        "num_decode_draft_tokens_cpu": ddt_ro,
        "num_reqs": Bp,
        "num_actual_tokens": Tp,
        "max_query_len": max_query_len,
        "max_seq_len": max_seq_len,
        "block_size": bs,
        "causal": causal,
        "num_real_reqs": B,
        "num_real_tokens": T,
        "num_pages": spec.num_pages,
        "max_exact_seq_len": spec.max_exact_seq_len,
        # The group and its kernel state: what attnmeta.backends.fused replays a cached step from.
        "_group": (group, cached),
    }
    if len(group.fields) > 5:  # paged_kv: what a FlashInfer builder of this step reuses
        total = spec.num_pages
        pv = group.extras.get("paged")
        if pv is None or pv[3] != total:
            pv = group.extras["paged"] = (group.frozen[5], group.frozen[6], group.frozen[7][:total], total)
        host["_paged"] = pv

    def make() -> CommonAttentionMetadata:
        dev = group.device(step)
        qd, sld, btd, smd, posd = dev[:5]
        if graph:
            qd = qd[: Bp + 1]
        elif not exact_tokens:
            tv = group.extras.get("tokens_device")
            if tv is None or tv[0] is not dev or tv[1] != Tt:
                tv = group.extras["tokens_device"] = (dev, Tt, smd[:Tt], posd[:Tt])
            smd, posd = tv[2], tv[3]
        return _new_common(
            qd, sld, btd, smd, posd,
            qsl_ro, _sl_ro, ub_ro, nc_ro, bt_ro, sm_ro, pos_ro, pre_ro, ddt_ro,
            Bp, Tp, max_query_len, max_seq_len, bs, causal, B, T,
        )

    return Staged(step, host, make)


def common_split(
    host: dict[str, Any],
    *,
    decode_threshold: int = 1,
    require_uniform: bool = False,
    treat_short_extends_as_decodes: bool = True,
) -> SplitCounts:
    """:func:`attnmeta.host.split.split_decodes_and_prefills` of a staged common metadata's host part.

    Backends staged into one step share the result: it is computed once per step and flag set and
    kept in ``host`` (the per-step dict of :func:`stage_common`'s ``Staged.host``), so it can never
    outlive the step. The inputs were validated when the step was staged, so the compiled split runs
    directly.

    Parameters
    ----------
    host : dict
        ``Staged[CommonAttentionMetadata].host``.
    decode_threshold : int, default 1
        Longest query that counts as a decode.
    require_uniform : bool, default False
        Decodes must share row 0's query length (zero-length padding rows allowed).
    treat_short_extends_as_decodes : bool, default True
        When False, rows still prefilling are prefills (``is_prefilling`` comes from ``host``).

    Returns
    -------
    SplitCounts
        ``(num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens)``.
    """
    if treat_short_extends_as_decodes and host["max_query_len"] <= decode_threshold and (
        not require_uniform or decode_threshold <= 1
    ):  # every row decodes (the split's first rule): no pass over the rows needed
        every = host.get("_all_decodes")
        if every is None:
            every = host["_all_decodes"] = SplitCounts(host["num_reqs"], 0, host["num_actual_tokens"], 0)
        return every
    key = ("split", decode_threshold, require_uniform, treat_short_extends_as_decodes)
    memo: dict[Any, SplitCounts] = host.setdefault("_memo", {})
    found = memo.get(key)
    if found is None:
        nd, np_, ndt, npt = _split_nb(
            host["query_start_loc_cpu"], host["num_actual_tokens"], host["max_query_len"], decode_threshold,
            require_uniform, treat_short_extends_as_decodes, host["is_prefilling"],
        )
        found = memo[key] = SplitCounts(int(nd), int(np_), int(ndt), int(npt))
    return found


def build_common(spec: BatchSpec, stager: Stager, **kwargs: Any) -> CommonAttentionMetadata:
    """Stage ``spec``'s common metadata in a step of its own, commit it, and return the result.

    Keyword arguments go to :func:`stage_common`. For backends staged alongside, use
    :func:`stage_common` inside ``with stager.step() as step:`` instead.
    """
    with stager.step() as step:
        staged = stage_common(spec, step, **kwargs)
    return staged.result()

