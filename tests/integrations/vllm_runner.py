"""vLLM 0.33.0's ``CommonAttentionMetadata`` built the way its V1 runner builds it, in torch, with nothing
of attnmeta: the input every vLLM builder gets (tests/integrations; needs vLLM importable)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from vllm.v1.attention.backends.utils import CommonAttentionMetadata as VllmCommon

from attnmeta import BatchSpec

__all__ = ["assert_same_as_vllm", "host_copy", "vllm_runner_common"]


def vllm_runner_common(spec: BatchSpec, device: torch.device) -> tuple[Any, np.ndarray]:
    """vLLM's ``CommonAttentionMetadata`` for ``spec``'s step, built as vLLM 0.33.0's V1 runner builds it
    (``_prepare_inputs`` + ``_build_attention_metadata``, docs of vllm-semantics sections 3 and 4) in
    torch, without attnmeta; and the host block table it was copied from."""
    n, B, T, bs = spec.num_reqs, spec.padded_num_reqs, spec.padded_num_tokens, spec.block_size
    c = torch.from_numpy(spec.num_computed_tokens.astype(np.int64))
    q = torch.from_numpy(spec.num_scheduled_tokens.astype(np.int64))
    total = int(q.sum())
    qsl_cpu = torch.zeros(B + 1, dtype=torch.int32)
    qsl_cpu[1 : n + 1] = torch.cumsum(q, 0).to(torch.int32)
    qsl_cpu[n + 1 :] = qsl_cpu[n]  # padding rows repeat the last value
    ub = c + q if spec.seq_lens_upper_bound is None else torch.from_numpy(spec.seq_lens_upper_bound.astype(np.int64))
    optimistic = torch.zeros(B, dtype=torch.int32)
    optimistic[:n] = ub.to(torch.int32)
    seq_lens = torch.zeros(B, dtype=torch.int32)
    seq_lens[:n] = (c + q).to(torch.int32)  # exact on the device (vLLM corrects it there)
    host_table = np.zeros((B, spec.block_table.shape[1]), np.int32)
    host_table[:n] = spec.block_table[:n]  # padding rows NULL_BLOCK_ID
    table = torch.from_numpy(host_table)
    req = torch.repeat_interleave(torch.arange(n), q)
    pos = c[req] + (torch.arange(total) - qsl_cpu[req].to(torch.int64))
    positions = torch.zeros(T, dtype=torch.int64)
    positions[:total] = pos
    slots = torch.full((T,), -1, dtype=torch.int64)
    cp = spec.context_parallel
    if cp is None or cp.world_size == 1:
        slots[:total] = table[req, pos // bs].to(torch.int64) * bs + pos % bs
    else:
        W, r, il = cp.world_size, cp.rank, cp.interleave
        vb, o = pos // (bs * W), pos % (bs * W)
        local = (o // il) % W == r
        off = (o // (W * il)) * il + o % il
        slots[:total] = torch.where(local, table[req, vb].to(torch.int64) * bs + off, -1)
    prefilling = torch.zeros(B, dtype=torch.bool)
    if spec.num_prompt_tokens is not None:
        prefilling[:n] = c < torch.from_numpy(spec.num_prompt_tokens.astype(np.int64))
    cm = VllmCommon(
        query_start_loc=qsl_cpu.to(device), query_start_loc_cpu=qsl_cpu, seq_lens=seq_lens.to(device),
        num_reqs=B, num_actual_tokens=T, max_query_len=int(q.max()) if n else 0,
        max_seq_len=int(ub.max()) if n else 0, block_table_tensor=table.to(device), slot_mapping=slots.to(device),
        causal=True, positions=positions.to(device), is_prefilling=prefilling, seq_lens_cpu_upper_bound=optimistic,
    )
    return cm, host_table


def host_copy(x: Any) -> np.ndarray:
    """A tensor or array as a host numpy array (a copy: test code reads device tensors back)."""
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy().copy()
    return np.array(x, copy=True)


def assert_same_as_vllm(field: str, got: Any, want: Any, *, dtype: bool = True, vllm: str = "vLLM") -> None:
    """``got`` (attnmeta's) equals ``want`` (``vllm``'s, e.g. "vLLM V2"): shape, dtype where asked, values."""
    g, w = host_copy(got), host_copy(want)
    assert g.shape == w.shape, f"{field}: shape {g.shape} (attnmeta) != {w.shape} ({vllm})\n{g}\n{w}"
    if dtype:
        assert g.dtype == w.dtype, f"{field}: dtype {g.dtype} (attnmeta) != {w.dtype} ({vllm})"
    assert np.array_equal(g, w), f"{field}: attnmeta {g.tolist()} != {vllm} {w.tolist()}"
