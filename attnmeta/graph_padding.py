"""Capture-time fills of graph mode: the values some vLLM backends write only while a CUDA graph is captured.

At replay every backend's padded rows hold the runner's values (:data:`attnmeta.host.padding.REPLAY_PADDING`:
``seq_lens`` 0, ...), which attnmeta writes on the host. At *capture* (vLLM's
``build_for_cudagraph_capture``) a few backends overwrite the common metadata first (vLLM 0.33.0):

- Triton attention, ROCm attention, ROCm aiter unified attention, TurboQuant: ``seq_lens.fill_(1)``
  over the whole tensor, real rows too (keeps capture fast);
- ROCm attention also zeroes the device ``query_start_loc``.

Every other backend (FlashAttention, FlashInfer, MLA, Mamba, GDN, linear, FlexAttention) captures
with the step's values. :func:`capture_fill` gives a backend's :class:`CaptureFill`;
:func:`apply_capture_fill` applies it to a staged common metadata of a capture step before the commit,
on the host, so the device and host twins stay equal and the fill moves in the step's one copy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType

from attnmeta.metadata import StagedCommon

__all__ = ["CAPTURE_FILLS", "CaptureFill", "apply_capture_fill", "capture_fill"]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CaptureFill:
    """What a backend writes over the common metadata of a CUDA-graph capture step.

    Examples
    --------
    >>> capture_fill("triton_attn"), capture_fill("flash_attn")
    (CaptureFill(seq_lens=1, zero_query_start_loc=False), CaptureFill(seq_lens=None, zero_query_start_loc=False))
    """

    seq_lens: int | None = None
    """Value written over every row of ``seq_lens`` (real and padding), or None to keep the step's."""
    zero_query_start_loc: bool = False
    """Zero the whole staged ``query_start_loc`` (ROCm attention)."""

    def __post_init__(self) -> None:
        if self.seq_lens is not None and (type(self.seq_lens) is not int or self.seq_lens < 0):
            raise ValueError(f"CaptureFill.seq_lens: must be None or an int >= 0, got {self.seq_lens!r}")
        if type(self.zero_query_start_loc) is not bool:
            raise TypeError(f"CaptureFill.zero_query_start_loc: must be a bool, got {self.zero_query_start_loc!r}")


CAPTURE_FILLS: Mapping[str, CaptureFill] = MappingProxyType({
    "triton_attn": CaptureFill(seq_lens=1),
    "rocm_attn": CaptureFill(seq_lens=1, zero_query_start_loc=True),
    "rocm_aiter_unified_attn": CaptureFill(seq_lens=1),
    "turboquant": CaptureFill(seq_lens=1),
})
"""vLLM 0.33.0's backends that fill at capture, by backend name; any other backend: ``CaptureFill()``."""


def capture_fill(backend: str) -> CaptureFill:
    """The capture-time fill of vLLM backend ``backend`` (``CaptureFill()``, nothing, for most).

    Parameters
    ----------
    backend : str
        A backend name of :data:`CAPTURE_FILLS`, or any other (no fill).

    Returns
    -------
    CaptureFill
    """
    return CAPTURE_FILLS.get(backend, CaptureFill())


def apply_capture_fill(common: StagedCommon, fill: CaptureFill) -> None:
    """Write ``fill`` over ``common``'s staged ``seq_lens`` (its ``num_reqs`` rows) and, with
    ``zero_query_start_loc``, its whole staged ``query_start_loc``, before the step commits.

    For capture steps only: the host twins (``seq_lens_cpu``, ``query_start_loc_cpu``) are views of the
    same pinned memory and read the filled values; host scalars (``max_seq_len``, ``num_pages``) and
    builders already staged keep the step's values, so apply it before staging the backend's builder.

    Parameters
    ----------
    common : StagedCommon
        A common metadata from :func:`attnmeta.stage_common` (with its ``prefix``) of an open step.
    fill : CaptureFill

    Raises
    ------
    TypeError
        ``common`` was not written by :func:`attnmeta.stage_common` (a derived one) or ``fill`` is not
        a CaptureFill.
    RuntimeError
        The step has committed.

    Examples
    --------
    >>> from attnmeta import BatchSpec, Stager, stage_common
    >>> spec = BatchSpec(num_computed_tokens=[0, 0], num_scheduled_tokens=[1, 1], block_table=[[1], [2]],
    ...                  block_size=16, num_reqs_padded=3)
    >>> with Stager("cpu").step() as step:
    ...     common = stage_common(spec, step)
    ...     apply_capture_fill(common, capture_fill("triton_attn"))
    >>> common.result().seq_lens_cpu.tolist()  # (the host twin: the device view holds the same after the copy)
    [1, 1, 1]
    """
    if not isinstance(fill, CaptureFill):
        raise TypeError(f"fill: expected a CaptureFill, got {type(fill).__name__}")
    prefix = getattr(common, "prefix", None)
    if prefix is None:
        raise TypeError("common: expected the StagedCommon of stage_common (with its prefix), got a derived one")
    step = common.step
    if step.committed:
        raise RuntimeError("apply_capture_fill: the step has committed; apply the fill before the commit")
    if fill.seq_lens is not None:
        step.host(f"{prefix}.seq_lens")[: common.host.num_reqs] = fill.seq_lens
    if fill.zero_query_start_loc:
        step.host(f"{prefix}.query_start_loc")[:] = 0
