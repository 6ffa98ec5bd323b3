"""FlashAttention varlen metadata (docs/semantics-attention.md), derived on the host.

``FlashAttentionMetadata`` carries what ``flash_attn_varlen_func`` (and
``torch.nn.attention.varlen.varlen_attn``) take: ``cu_seqlens_q`` (``query_start_loc``),
``seqused_k`` (``seq_lens``), the paged ``block_table``, ``slot_mapping`` for the KV write, and the
host ints ``max_query_len`` / ``max_seq_len`` a kernel wrapper needs as plain arguments, plus the
DCP fields (context lengths, their bound, the decode / context-query counts: all 0 without DCP, as
in vLLM). Everything comes from the common metadata's host twins; the only staged additions are the
DCP context lengths and a per-request ``causal`` array, which travel in the step's one copy.

Not produced: FA3's AOT ``scheduler_metadata`` (a device-side call of the FA3 library, with no host
sync, that a backend can run on these fields) — ``scheduler_metadata`` is always None here.

The builder is :data:`FLASH_ATTN` (registry name ``"flash_attn"``); :func:`stage` and :func:`build`
are its methods.

Shape legend
------------
- ``num_reqs``: request rows, padding included.
- ``num_actual_tokens``: tokens, padding included.
- ``max_blocks``: staged block-table columns.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt
import torch

from attnmeta._checks import check_option_fields, option_rule, reject_tensor
from attnmeta._fields import MetadataBase, keyword_factory, template
from attnmeta.builder import Builder, Replayer, register
from attnmeta.host.flash_attn import (
    causal_per_request,
    dcp_context_is_empty,
    dcp_context_kv_lens,
    dcp_context_split,
    max_dcp_context_kv_len,
)
from attnmeta.metadata import CommonAttentionMetadata, CommonHost, PagedKVMetadata, StagedCommon
from attnmeta.spec import BatchSpec, StepShape
from attnmeta.staging import Staged, Step

__all__ = [
    "FLASH_ATTN",
    "FlashAttentionBuilder",
    "FlashAttentionInputs",
    "FlashAttentionMetadata",
    "FlashAttentionOptions",
    "build",
    "stage",
]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class FlashAttentionOptions:
    """Options of the FlashAttention builder (validated when constructed).

    Examples
    --------
    >>> FlashAttentionOptions(dcp_world_size=2, dcp_rank=1).dcp_interleave
    1
    >>> FlashAttentionOptions(dcp_world_size=2, dcp_rank=2)
    Traceback (most recent call last):
    ValueError: FlashAttentionOptions.dcp_rank: must be <= 1, got 2
    """

    causal: bool | None = dataclasses.field(default=None, metadata=option_rule("bool", allow_none=True))
    """One causal flag for every request; None: the common metadata's ``causal``. Per-request flags
    are a per-step input (``FlashAttentionInputs(causal=flags)``)."""
    dcp_world_size: int = dataclasses.field(default=1, metadata=option_rule("int", minimum=1))
    """Decode-context-parallel world size ``W`` (1: off)."""
    dcp_rank: int = dataclasses.field(default=0, metadata=option_rule("int", minimum=0, below="dcp_world_size"))
    """This rank, ``0 <= dcp_rank < dcp_world_size``."""
    dcp_interleave: int = dataclasses.field(default=1, metadata=option_rule("int", minimum=1))
    """Consecutive tokens per DCP rank (``cp_kv_cache_interleave_size``)."""
    max_num_splits: int = dataclasses.field(default=0, metadata=option_rule("int", minimum=0))
    """FA3 ``num_splits`` (0: the kernel's heuristic; vLLM fixes it under full CUDA graphs)."""
    prefix: str = dataclasses.field(default="flash_attn", metadata=option_rule("prefix"))
    """Namespace of this builder's staged fields."""

    def __post_init__(self) -> None:
        check_option_fields(self)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True, repr=False, eq=False)
class FlashAttentionMetadata(MetadataBase):
    """Metadata for FlashAttention's varlen paged kernels; contains the step's common metadata.

    Examples
    --------
    >>> import numpy as np
    >>> from attnmeta import BatchSpec, Stager
    >>> spec = BatchSpec(num_computed_tokens=[5, 7, 0], num_scheduled_tokens=[1, 1, 4],
    ...                  block_table=[[10, 11], [20, 21], [30, 31]], block_size=4)
    >>> fa = build(spec, Stager("cpu"), FlashAttentionOptions(dcp_world_size=2, dcp_rank=1))
    >>> fa.query_start_loc.tolist(), fa.seq_lens.tolist(), fa.max_query_len, fa.max_seq_len
    ([0, 1, 2, 6], [6, 8, 4], 4, 8)
    >>> fa.dcp_context_kv_lens_cpu.tolist(), fa.max_dcp_context_kv_len
    ([2, 3, 0], 4)
    >>> fa.num_decode_reqs, fa.num_prefill_reqs, fa.num_decode_tokens, fa.num_prefill_tokens
    (2, 0, 2, 0)
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
    """(num_reqs,) int32, device, when per-request causal flags were given (the ``causal`` input;
    else None)."""
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
    """DCP with a query longer than one token (else 0, as vLLM's builder): the leading one-token rows
    (:func:`attnmeta.host.flash_attn.dcp_context_split`)."""
    num_prefill_reqs: int
    """DCP, as ``num_decode_reqs``: the rows after them with a longer query and context (vLLM's
    extends; rows without context are in neither count)."""
    num_decode_tokens: int
    """Tokens of the ``num_decode_reqs`` rows."""
    num_prefill_tokens: int
    """Tokens of the ``num_prefill_reqs`` rows."""
    max_dcp_context_kv_len: int
    """DCP: host upper bound ``cdiv(max_seq_len, W*I) * I`` of ``dcp_context_kv_lens``, 0 when no row has
    context (else 0)."""
    max_num_splits: int
    """FA3 ``num_splits``."""
    scheduler_metadata: None = None
    """FA3 AOT schedule: not produced (see the module docstring)."""


_make_fa = keyword_factory(FlashAttentionMetadata)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class FlashAttentionInputs:
    """Per-step inputs of the FlashAttention builder.

    Examples
    --------
    >>> FlashAttentionInputs(causal=[True, False]).causal
    [True, False]
    """

    causal: npt.ArrayLike | None = None
    """(num_real_reqs,) bool or 0/1 int, host: this step's causal flag of every real request, staged
    as an int32 device array (padding rows 1); overrides ``FlashAttentionOptions.causal``."""


_View = tuple[np.ndarray, np.ndarray, str]
"""A staged field of the builder's own: its writable host view, the read-only view handed out, its name."""


def _write_dcp(h: CommonHost, opts: FlashAttentionOptions, out: np.ndarray) -> None:
    """This rank's share of every row's context, into ``out`` (``(num_reqs,)`` int32)."""
    dcp_context_kv_lens(h.seq_lens_cpu, np.diff(h.query_start_loc_cpu).astype(np.int32), opts.dcp_world_size,
                        opts.dcp_rank, opts.dcp_interleave, out=out)


def _write_causal(h: CommonHost, flags: Any, out: np.ndarray) -> None:
    """The step's causal flag of every real request into ``out`` (``(num_reqs,)`` int32, padding rows 1)."""
    reject_tensor(flags, "causal")  # host data only: a device tensor here would mean a sync
    flags = np.asarray(flags)
    n_real = h.num_real_reqs
    if flags.shape != (n_real,):
        raise ValueError(f"causal: expected one flag per real request ({n_real}), got shape {flags.shape}")
    causal_per_request(flags, out=out[:n_real])
    out[n_real:] = 1  # padding rows: causal


_PER_STEP = ("common", "max_query_len", "max_seq_len", "causal", "num_decode_reqs", "num_prefill_reqs",
             "num_decode_tokens", "num_prefill_tokens", "max_dcp_context_kv_len")
"""The fields a step of one layout changes (:func:`_per_step` computes them; the rest are the layout's)."""


def _per_step(cm: CommonAttentionMetadata, h: CommonHost, opts: FlashAttentionOptions,
              causal_cpu: np.ndarray | None) -> tuple[Any, ...]:
    """The values of :data:`_PER_STEP` of a step: every value a step of a layout changes, computed here for
    a staged and a replayed step alike."""
    if causal_cpu is not None:
        is_causal = bool(causal_cpu.all())
    else:
        is_causal = h.causal if opts.causal is None else opts.causal
    W = opts.dcp_world_size
    if W == 1:  # vLLM's builder counts and bounds nothing without DCP
        return cm, cm.max_query_len, cm.max_seq_len, is_causal, 0, 0, 0, 0, 0
    qsl, ub = h.query_start_loc_cpu, h.seq_lens_cpu_upper_bound
    split = dcp_context_split(qsl, ub, num_tokens=cm.num_actual_tokens, max_query_len=cm.max_query_len)
    max_dcp = 0 if dcp_context_is_empty(qsl, ub) else max_dcp_context_kv_len(h.max_seq_len, W, opts.dcp_interleave)
    return cm, cm.max_query_len, cm.max_seq_len, is_causal, *split, max_dcp


def _metadata(cm: CommonAttentionMetadata, h: CommonHost, opts: FlashAttentionOptions,
              dcp: tuple[torch.Tensor, np.ndarray] | None,
              causal: tuple[torch.Tensor, np.ndarray] | None) -> FlashAttentionMetadata:
    """The step's FlashAttention metadata from its common metadata and host part, and the device and
    read-only host views of the builder's own staged fields (after the commit)."""
    _, max_q, max_seq, is_causal, nd, np_, ndt, npt, max_dcp = _per_step(
        cm, h, opts, causal[1] if causal is not None else None)
    return _make_fa(
        common=cm, query_start_loc=cm.query_start_loc, seq_lens=cm.seq_lens, block_table=cm.block_table_tensor,
        slot_mapping=cm.slot_mapping, dcp_context_kv_lens=dcp[0] if dcp is not None else None,
        causal_tensor=causal[0] if causal is not None else None, query_start_loc_cpu=cm.query_start_loc_cpu,
        seq_lens_cpu=cm.seq_lens_cpu, dcp_context_kv_lens_cpu=dcp[1] if dcp is not None else None,
        causal_cpu=causal[1] if causal is not None else None, num_actual_tokens=cm.num_actual_tokens,
        max_query_len=max_q, max_seq_len=max_seq, causal=is_causal, num_decode_reqs=nd, num_prefill_reqs=np_,
        num_decode_tokens=ndt, num_prefill_tokens=npt, max_dcp_context_kv_len=max_dcp,
        max_num_splits=opts.max_num_splits,
    )


def _views(step: Step, field: _View | None) -> tuple[torch.Tensor, np.ndarray] | None:
    """The device and read-only host views of an own field of a committed step."""
    return None if field is None else (step.device(field[2]), field[1])


def _own_field(step: Step, name: str, rows: int, fill: int) -> _View:
    """Stage an int32 field of ``rows`` rows (graph mode: at the profile's request capacity)."""
    prof = step.profile
    w = step.alloc(name, rows, np.int32, fill=fill, capacity=prof.max_num_reqs if prof is not None else None)
    ro = w.view()
    ro.flags.writeable = False  # the step's own view: handed out read-only
    return w, ro, name


class FlashAttentionBuilder(Builder[FlashAttentionOptions, FlashAttentionInputs, None, FlashAttentionMetadata]):
    """The FlashAttention builder (:data:`FLASH_ATTN`)."""

    name = "flash_attn"
    options_type = FlashAttentionOptions
    inputs_type = FlashAttentionInputs
    metadata_type = FlashAttentionMetadata

    def derive(self, common: StagedCommon, step: Step, options: FlashAttentionOptions,
               inputs: FlashAttentionInputs) -> Staged[None, FlashAttentionMetadata]:
        """Derive FlashAttention metadata from the staged common metadata, staging into the same step.

        Parameters
        ----------
        common : StagedCommon
            From :func:`attnmeta.stage_common` on the same ``step``.
        step : Step
            The open step.
        options : FlashAttentionOptions
            DCP layout, split threshold, split count.
        inputs : FlashAttentionInputs
            Per-request causal flags (optional).

        Returns
        -------
        Staged[None, FlashAttentionMetadata]
            ``.result()`` after the commit.

        Raises
        ------
        ValueError
            ``causal`` flags of the wrong length or values.
        TypeError
            ``causal`` flags that are a torch tensor or not bool / integer.
        """
        h = common.host
        p = options.prefix + "."
        dcp = causal = None
        if options.dcp_world_size > 1:
            dcp = _own_field(step, p + "dcp_context_kv_lens", h.num_reqs, 0)
            _write_dcp(h, options, dcp[0])
        if inputs.causal is not None:
            causal = _own_field(step, p + "causal", h.num_reqs, 1)
            _write_causal(h, inputs.causal, causal[0])
        return _Staged(step, None, common, h, options, dcp, causal)

    def unsupported_reasons(self, spec: BatchSpec, options: FlashAttentionOptions,
                            inputs: FlashAttentionInputs) -> list[str]:
        """A ``causal`` input without one flag per real request."""
        flags = inputs.causal
        if flags is not None and np.shape(flags) != (spec.num_reqs,):
            return [f"causal: expected one flag per real request ({spec.num_reqs}), got shape {np.shape(flags)}"]
        return []

    def replay_key(self, shape: StepShape, options: FlashAttentionOptions, inputs: FlashAttentionInputs) -> Hashable:
        """Whether the step has per-request causal flags (the only field the options do not fix)."""
        return inputs.causal is not None

    def reads_lengths(self, options: FlashAttentionOptions) -> bool:
        """False: neither :meth:`needs` nor :meth:`replay_key` reads the step's lengths."""
        return False

    def replayer(self, staged: Staged[None, FlashAttentionMetadata], common: StagedCommon, step: Step,
                 options: FlashAttentionOptions, inputs: FlashAttentionInputs) -> _Replayer:
        """Replays keep the recorded step's own fields (the DCP lengths, the causal flags) and rewrite them."""
        assert isinstance(staged, _Staged)
        return _Replayer(staged.result(), options, staged.dcp, staged.causal)


class _Staged(Staged[None, FlashAttentionMetadata]):
    """A staged step's FlashAttention part: what :func:`_metadata` needs after the commit."""

    __slots__ = ("causal", "dcp")

    def __init__(self, step: Step, host: None, common: StagedCommon, h: CommonHost, options: FlashAttentionOptions,
                 dcp: _View | None, causal: _View | None) -> None:
        super().__init__(step, host, lambda: _metadata(common.result(), h, options, _views(step, dcp),
                                                       _views(step, causal)))
        self.dcp, self.causal = dcp, causal


class _Replayer(Replayer[FlashAttentionInputs, FlashAttentionMetadata]):
    """Replays of a FlashAttention layout: rewrite the own fields, then the recorded step's metadata with
    this step's :data:`_PER_STEP` values (:func:`_per_step`); the other fields (views of the common
    metadata's and of the own fields, which a replay stages at the same places of the same slot) are
    the layout's."""

    __slots__ = ("causal", "dcp", "make", "options")

    def __init__(self, recorded: FlashAttentionMetadata, options: FlashAttentionOptions, dcp: _View | None,
                 causal: _View | None) -> None:
        self.options, self.dcp, self.causal = options, dcp, causal
        self.make = template(recorded, _PER_STEP)

    def rewrite(self, step: Step, host: CommonHost, inputs: FlashAttentionInputs) -> None:
        if self.dcp is not None:
            _write_dcp(host, self.options, self.dcp[0])
        if self.causal is not None:
            _write_causal(host, inputs.causal, self.causal[0])

    def result(self, step: Step, common: CommonAttentionMetadata, host: CommonHost, paged: PagedKVMetadata | None,
               inputs: FlashAttentionInputs) -> FlashAttentionMetadata:
        c = self.causal
        return self.make(*_per_step(common, host, self.options, c[1] if c is not None else None))


FLASH_ATTN = register(FlashAttentionBuilder())
"""The registered FlashAttention builder."""
stage = FLASH_ATTN.stage
build = FLASH_ATTN.build
