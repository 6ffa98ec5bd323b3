"""Device-side reference implementations (EPLB); see :mod:`attnmeta.testing.reference`.

Straightforward torch transcriptions of how vLLM 0.33.0 derives and publishes the EPLB expert maps
(``vllm/distributed/eplb/eplb_state.py``): ``scatter_add_`` replica counts, ``.max().item()`` for the
width, a per-slot loop with boolean-mask indexing, ``torch.nn.functional.pad`` with -1 and a
**blocking** ``copy_`` into the persistent device map. Obviously correct, synchronisations and all:
the blocking copy from pageable memory waits for every kernel queued on the GPU. Never use them on a
serving path; :mod:`attnmeta.eplb` is the sync-free form.

Unlike vLLM's ``compute_logical_maps`` (which asserts a CPU input), :func:`ref_compute_logical_maps`
runs on any device, so the same property tests exercise it on ``cpu`` and ``cuda``.

Shape legend
------------
- ``L``: MoE layers (absent for a 1-D, one-layer map); ``P``: physical slots; ``E``: logical experts.
- ``R``: the largest replica count; ``W``: the persistent map's width (``>= R``).
"""

from __future__ import annotations

import torch

__all__ = ["ref_commit_expert_maps", "ref_compute_logical_maps", "ref_pad_out_tensor"]


def ref_compute_logical_maps(
    physical_to_logical_map: torch.Tensor, num_logical_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's ``compute_logical_maps``: the logical-to-physical map at its natural width and the counts.

    Parameters
    ----------
    physical_to_logical_map : torch.Tensor
        ``(P,)`` or ``(L, P)`` integer tensor, any device; entries in ``[0, E)`` or -1 (ignored).
    num_logical_experts : int
        ``E``.

    Returns
    -------
    tuple of torch.Tensor
        ``logical_to_physical_map`` ``(L, E, R)`` and ``logical_replica_count`` ``(L, E)`` (``L``
        absent for a 1-D input), the input's dtype and device.

    Examples
    --------
    >>> l2p, count = ref_compute_logical_maps(torch.tensor([2, 2, 1, 0]), 3)
    >>> l2p.tolist(), count.tolist()
    ([[3, -1], [2, -1], [0, 1]], [1, 1, 2])
    """
    device, dtype = physical_to_logical_map.device, physical_to_logical_map.dtype
    per_layer = physical_to_logical_map.dim() == 1
    view = physical_to_logical_map.unsqueeze(0) if per_layer else physical_to_logical_map
    num_layers, num_physical = view.shape
    valid = view >= 0
    count = torch.zeros(num_layers, num_logical_experts, dtype=dtype, device=device)
    count.scatter_add_(1, view.clamp(min=0), valid.to(dtype))
    max_replicas = int(count.max().item())  # a device read: the width of the output
    l2p = torch.full((num_layers, num_logical_experts, max_replicas), -1, dtype=dtype, device=device)
    running = torch.zeros_like(count)
    layers = torch.arange(num_layers, device=device)
    for p in range(num_physical):
        experts = view[:, p]
        mask = experts >= 0
        if not mask.any():  # a device read per slot
            continue
        vl, ve = layers[mask], experts[mask]
        k = running[vl, ve]
        l2p[vl, ve, k] = p
        running[vl, ve] += 1
    if per_layer:
        return l2p.squeeze(0), count.squeeze(0)
    return l2p, count


def ref_pad_out_tensor(src: torch.Tensor, dst: torch.Tensor) -> None:
    """vLLM's ``_pad_out_tensor``: pad ``src``'s last dimension with -1 to ``dst``'s width and copy it
    into ``dst`` with a blocking ``copy_`` (from pageable host memory when ``src`` is a CPU tensor and
    ``dst`` a CUDA one: the host waits for all queued GPU work).

    Parameters
    ----------
    src : torch.Tensor
        ``(..., R)`` map (vLLM: on the CPU, pageable).
    dst : torch.Tensor
        ``(..., W)`` persistent map, ``W >= R``.

    Examples
    --------
    >>> dst = torch.zeros(2, 3, dtype=torch.int64)
    >>> ref_pad_out_tensor(torch.tensor([[4, 1], [2, -1]]), dst)
    >>> dst.tolist()
    [[4, 1, -1], [2, -1, -1]]
    """
    padding = dst.shape[-1] - src.shape[-1]
    if padding < 0:
        raise ValueError(f"ref_pad_out_tensor: src width {src.shape[-1]} > dst width {dst.shape[-1]}")
    dst.copy_(torch.nn.functional.pad(src, (0, padding), value=-1))


def ref_commit_expert_maps(
    physical_to_logical_map: torch.Tensor,
    logical_to_physical_map: torch.Tensor,
    logical_replica_count: torch.Tensor,
) -> None:
    """vLLM's ``_commit_eplb_maps`` (the logical maps): derive on ``physical_to_logical_map``'s device
    (vLLM: the CPU), pad out into the persistent map with :func:`ref_pad_out_tensor`, copy the counts
    with ``non_blocking=True``.

    Parameters
    ----------
    physical_to_logical_map : torch.Tensor
        ``(L, P)`` (or ``(P,)``) new placement (vLLM: a CPU tensor).
    logical_to_physical_map : torch.Tensor
        ``(L, E, W)`` (or ``(E, W)``) persistent device map; ``E`` is read from its shape.
    logical_replica_count : torch.Tensor
        ``(L, E)`` (or ``(E,)``) persistent device counts.

    Examples
    --------
    >>> l2p, count = torch.zeros(3, 3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64)
    >>> ref_commit_expert_maps(torch.tensor([2, 2, 1, 0]), l2p, count)
    >>> l2p.tolist(), count.tolist()
    ([[3, -1, -1], [2, -1, -1], [0, 1, -1]], [1, 1, 2])
    """
    new_l2p, new_count = ref_compute_logical_maps(physical_to_logical_map, logical_to_physical_map.shape[-2])
    ref_pad_out_tensor(new_l2p, logical_to_physical_map)
    logical_replica_count.copy_(new_count, non_blocking=True)
