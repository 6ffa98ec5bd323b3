"""Kernel block sizes smaller than the KV manager's block size: choosing one, expanding the table.

A KV-cache manager allocates blocks of ``block_size`` tokens (the *manager* block size, the unit of
:attr:`attnmeta.BatchSpec.block_table`). An attention kernel may only support smaller pages (FlashMLA
64, FlashInfer-MLA 32 or 64, ...). vLLM 0.33.0 then views the KV cache in *kernel* blocks of
``kernel_block_size`` tokens, ``R = block_size // kernel_block_size`` per manager block, and hands
that backend a block table in kernel units: manager block ``b`` becomes kernel blocks
``b * S + 0 .. b * S + R - 1``, where ``S`` is the *kernel block stride* (``R``, or larger for
packed caches whose other layers' pages sit between one layer's blocks). Null and padding entries
(``NULL_BLOCK_ID = 0``) expand like any other id, to ``0, 1, ..., R - 1``: they do not stay 0.

The slot mapping is not changed: it stays in manager units. For ``S == R`` the flat slot index is the
same in both units, ``(b * R + o // k) * k + o % k == b * B + o`` (``B`` the manager block size,
``k`` the kernel one, ``o`` the offset in the manager block); under context parallelism this holds
when the interleave divides ``k`` (docs/semantics.md, "Kernel block sizes").

Everything here is host code, numpy in, numpy out; the expansion is one compiled pass over the table
(:func:`expand_block_table`). :func:`attnmeta.kernel_blocks.stage_kernel_block_table` stages it in a
step for the builders of one backend.

Shape legend
------------
- ``num_reqs``: block-table rows (padding rows included).
- ``max_blocks``: manager block-table columns.
- ``R``: ``block_size // kernel_block_size``, kernel blocks per manager block.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from attnmeta._checks import INT32_MAX, as_host_array, check_out
from attnmeta._numba import njit

__all__ = [
    "MultipleOf",
    "block_table_width",
    "expand_block_table",
    "kernel_block_size",
    "select_common_block_size",
]


@dataclasses.dataclass(frozen=True, slots=True)
class MultipleOf:
    """A supported kernel block size entry meaning "any multiple of ``base``" (vLLM's ``MultipleOf``).

    Examples
    --------
    >>> MultipleOf(16).accepts(64), MultipleOf(16).accepts(8)
    (True, False)
    """

    base: int
    """The size every accepted block size is a multiple of (positive)."""

    def __post_init__(self) -> None:
        if type(self.base) is not int or self.base <= 0:
            raise ValueError(f"MultipleOf.base: must be a positive int, got {self.base!r}")

    def accepts(self, block_size: int) -> bool:
        """Whether ``block_size`` is a multiple of :attr:`base`."""
        return block_size % self.base == 0


SupportedSizes = Sequence["int | MultipleOf"]
"""One backend's supported kernel block sizes: ints (exactly that size) and :class:`MultipleOf`."""


def _accepts(supported: SupportedSizes, block_size: int) -> bool:
    return any(s.accepts(block_size) if isinstance(s, MultipleOf) else s == block_size for s in supported)


def _check_supported(supported: SupportedSizes, name: str) -> None:
    if isinstance(supported, (str, bytes)) or not isinstance(supported, Sequence) or len(supported) == 0:
        raise ValueError(f"{name}: expected a non-empty sequence of ints and MultipleOf, got {supported!r}")
    for j, s in enumerate(supported):
        if isinstance(s, MultipleOf):
            continue
        if type(s) is not int or s <= 0:
            raise ValueError(f"{name}[{j}]: expected a positive int or a MultipleOf, got {s!r}")


def select_common_block_size(manager_block_size: int, supported: Sequence[SupportedSizes]) -> int:
    """The kernel block size every backend of a KV-cache group accepts (vLLM ``select_common_block_size``).

    A backend accepts a size when one of its entries does: an int entry must be equal to it, a
    :class:`MultipleOf` entry must divide it. If every backend accepts ``manager_block_size``, that
    is the answer (no splitting). Otherwise the largest int entry of any backend that divides
    ``manager_block_size`` and that every backend accepts.

    Parameters
    ----------
    manager_block_size : int
        The KV manager's block size (tokens, positive).
    supported : sequence of sequences of int or MultipleOf
        Each backend's supported kernel block sizes (host Python values).

    Returns
    -------
    int
        The kernel block size; it divides ``manager_block_size``.

    Raises
    ------
    ValueError
        No common size (the message lists every backend's sizes), no backend, or a malformed entry.

    Examples
    --------
    >>> select_common_block_size(256, [[64]])
    64
    >>> select_common_block_size(64, [[MultipleOf(16)]])
    64
    >>> select_common_block_size(128, [[32, 64], [MultipleOf(16)]])
    64
    >>> select_common_block_size(256, [[128], [32, 64]])
    Traceback (most recent call last):
    ...
    ValueError: No common block size for manager block size 256: no size divides 256 and is accepted by every backend (supported: [[128], [32, 64]])
    """
    if type(manager_block_size) is not int or manager_block_size <= 0:
        raise ValueError(f"manager_block_size: must be a positive int, got {manager_block_size!r}")
    if isinstance(supported, (str, bytes)) or not isinstance(supported, Sequence) or len(supported) == 0:
        raise ValueError(f"supported: expected one sequence of sizes per backend (at least one), got {supported!r}")
    for i, s in enumerate(supported):
        _check_supported(s, f"supported[{i}]")
    if all(_accepts(s, manager_block_size) for s in supported):
        return manager_block_size
    candidates = sorted({c for s in supported for c in s if not isinstance(c, MultipleOf)}, reverse=True)
    for c in candidates:
        if manager_block_size % c == 0 and all(_accepts(s, c) for s in supported):
            return int(c)
    shown = [[c if not isinstance(c, MultipleOf) else f"MultipleOf({c.base})" for c in s] for s in supported]
    raise ValueError(
        f"No common block size for manager block size {manager_block_size}: no size divides "
        f"{manager_block_size} and is accepted by every backend (supported: {shown})".replace("'", "")
    )


def kernel_block_size(manager_block_size: int, supported: SupportedSizes, *, block_outermost: bool = False) -> int:
    """The kernel block size of one attention backend over a KV-cache group (vLLM 0.33.0's choice).

    :func:`select_common_block_size` for this one backend. A group whose KV-cache tensor is packed
    block-outermost (``block_stride > layer_stride``) cannot be split: other layers' pages lie between
    its blocks. There vLLM keeps the manager size group-wide, and a backend that needs smaller blocks
    fails when its token KV cache is bound ("Reduce --block-size ... or set VLLM_KV_CACHE_LAYOUT to a
    layer-compact layout"); this raises the same. (vLLM's strided kernel blocks of compressed caches
    are not built here. Its Mamba groups, and specs without per-layer views, keep the manager size: do
    not call this for them.)

    Parameters
    ----------
    manager_block_size : int
        The KV manager's block size (tokens).
    supported : sequence of int or MultipleOf
        The backend's supported kernel block sizes.
    block_outermost : bool, default False
        The group's KV cache is packed block-outermost: no splitting (the manager size, or an error).

    Returns
    -------
    int
        The kernel block size (divides ``manager_block_size``).

    Raises
    ------
    ValueError
        As :func:`select_common_block_size`; with ``block_outermost``, a backend that does not accept
        the manager size.

    Examples
    --------
    >>> kernel_block_size(256, [64]), kernel_block_size(256, [256, 64], block_outermost=True)
    (64, 256)
    >>> kernel_block_size(256, [64], block_outermost=True)
    Traceback (most recent call last):
    ValueError: a backend that needs 64-token kernel blocks cannot read a KV cache packed block-outermost in 256-token blocks (other layers' pages lie between them; vLLM 0.33.0 refuses it too): reduce the block size to 64 or pack the cache layer-outermost
    """
    size = select_common_block_size(manager_block_size, [supported])
    if block_outermost and size != manager_block_size:
        raise ValueError(
            f"a backend that needs {size}-token kernel blocks cannot read a KV cache packed block-outermost in "
            f"{manager_block_size}-token blocks (other layers' pages lie between them; vLLM 0.33.0 refuses it "
            f"too): reduce the block size to {size} or pack the cache layer-outermost")
    return size


def block_table_width(max_num_blocks: int, block_size: int) -> int:
    """Columns of vLLM's persistent block table for an attention group (``get_block_table_width``).

    ``max_num_blocks`` rounded up to a multiple of ``128 // gcd(128, block_size)``, so a row spans a
    multiple of 128 tokens.

    Parameters
    ----------
    max_num_blocks : int
        ``cdiv(max_model_len, block_size)`` (non-negative).
    block_size : int
        Tokens per block (positive).

    Returns
    -------
    int

    Examples
    --------
    >>> [block_table_width(*a) for a in ((100, 16), (100, 256), (33, 48), (5, 1))]
    [104, 100, 40, 128]
    """
    if type(max_num_blocks) is not int or max_num_blocks < 0:
        raise ValueError(f"max_num_blocks: must be a non-negative int, got {max_num_blocks!r}")
    if type(block_size) is not int or block_size <= 0:
        raise ValueError(f"block_size: must be a positive int, got {block_size!r}")
    m = 128 // math.gcd(128, block_size)
    return -(-max_num_blocks // m) * m


@njit
def _expand_nb(table: np.ndarray, blocks: int, stride: int, out: np.ndarray) -> tuple[int, int]:
    """``out[r, c * blocks + j] = table[r, c] * stride + j``; returns ``(row, col)`` of the first entry
    whose expansion leaves int32, else ``(-1, -1)`` (the entries before it are written)."""
    rows, cols = table.shape
    hi = np.int64(2147483647) - (blocks - 1)
    lo = np.int64(-2147483648)
    for r in range(rows):
        src = table[r]
        dst = out[r]
        for c in range(cols):
            base = np.int64(src[c]) * stride
            if base > hi or base < lo:
                return r, c
            b = np.int32(base)
            o = c * blocks
            for j in range(blocks):
                dst[o + j] = b + j
    return -1, -1


def expand_block_table(
    block_table: npt.ArrayLike,
    blocks_per_kv_block: int,
    *,
    kernel_block_stride: int | None = None,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """The block table in kernel blocks (vLLM ``AttentionGroup.map_to_kernel_block_table``), on the host.

    ``out[r, c * R + j] = block_table[r, c] * S + j`` for ``j in 0..R-1``, with ``R =
    blocks_per_kv_block`` and ``S = kernel_block_stride`` (default ``R``). Every entry expands, null and
    padding entries (0) too: they become ``0, 1, ..., R - 1``. The output is packed: row stride
    ``max_blocks * R`` entries. One compiled pass over the table.

    Parameters
    ----------
    block_table : (num_reqs, max_blocks) int32, host
        Manager block ids (any int32 array-like; padding rows 0).
    blocks_per_kv_block : int
        ``R = manager_block_size // kernel_block_size`` (positive).
    kernel_block_stride : int, optional
        ``S``: kernel blocks between consecutive manager blocks of one layer (``>= R``; packed caches).
    out : (num_reqs, max_blocks * R) int32, host, optional
        Buffer to write into (e.g. a staging view).

    Returns
    -------
    (num_reqs, max_blocks * R) int32, host

    Raises
    ------
    TypeError
        ``block_table`` is a torch tensor or not an integer array.
    ValueError
        Not 2-D, ``R < 1``, ``S < R``, a bad ``out``, or an entry whose kernel ids leave int32 (named by
        row and column).

    Examples
    --------
    >>> t = [[7, 3, 0], [5, 0, 0], [0, 0, 0]]
    >>> expand_block_table(t, 4)
    array([[28, 29, 30, 31, 12, 13, 14, 15,  0,  1,  2,  3],
           [20, 21, 22, 23,  0,  1,  2,  3,  0,  1,  2,  3],
           [ 0,  1,  2,  3,  0,  1,  2,  3,  0,  1,  2,  3]], dtype=int32)
    >>> expand_block_table(t, 4, kernel_block_stride=6)[0].tolist()
    [42, 43, 44, 45, 18, 19, 20, 21, 0, 1, 2, 3]
    """
    table = as_host_array(block_table, "block_table", dtype=np.int32, ndim=2)
    R = blocks_per_kv_block
    if type(R) is not int or R < 1:
        raise ValueError(f"blocks_per_kv_block: must be a positive int (manager // kernel block size), got {R!r}")
    S = R if kernel_block_stride is None else kernel_block_stride
    if type(S) is not int or S < R:
        raise ValueError(f"kernel_block_stride: must be an int >= blocks_per_kv_block={R}, got {S!r}")
    rows, cols = table.shape
    if cols * R > INT32_MAX:
        raise ValueError(f"block_table: {cols} columns x {R} kernel blocks overflow a row")
    res = check_out(out, "out", (rows, cols * R), np.int32)
    r, c = _expand_nb(table, R, S, res)
    if r >= 0:
        v = int(table[r, c])
        raise ValueError(f"block_table[{r}, {c}]={v}: its kernel blocks {v} * {S} + 0..{R - 1} leave int32")
    return res
