"""Device-side reference for kernel block tables; see attnmeta.testing.reference.

:func:`ref_kernel_block_table` is vLLM 0.33.0's ``AttentionGroup.map_to_kernel_block_table`` as it
runs on the device: one ``torch.add(offsets, table[..., None], alpha=S)`` into a persistent buffer.
It is the oracle of :func:`attnmeta.host.kernel_blocks.expand_block_table`.

Shape legend
------------
- ``num_reqs``: block-table rows.
- ``max_blocks``: manager block-table columns.
- ``R``: kernel blocks per manager block.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["ref_kernel_block_table"]


def ref_kernel_block_table(table: Tensor, blocks_per_kv_block: int, kernel_block_stride: int | None = None) -> Tensor:
    """``out[r, c * R + j] = table[r, c] * S + j``, the way vLLM computes it on the device.

    Parameters
    ----------
    table : (num_reqs, max_blocks) int32, any device
        Manager block ids.
    blocks_per_kv_block : int
        ``R``.
    kernel_block_stride : int, optional
        ``S`` (default ``R``).

    Returns
    -------
    (num_reqs, max_blocks * R) int32, on ``table``'s device

    Examples
    --------
    >>> t = torch.tensor([[7, 3, 0], [5, 0, 0]], dtype=torch.int32)
    >>> ref_kernel_block_table(t, 4)[1].tolist()
    [20, 21, 22, 23, 0, 1, 2, 3, 0, 1, 2, 3]
    """
    R = blocks_per_kv_block
    S = R if kernel_block_stride is None else kernel_block_stride
    rows, cols = table.shape
    offsets = torch.arange(R, dtype=torch.int32, device=table.device)
    out = torch.zeros((rows, cols, R), dtype=torch.int32, device=table.device)
    torch.add(offsets, table[..., None], alpha=S, out=out)
    return out.view(rows, cols * R)
