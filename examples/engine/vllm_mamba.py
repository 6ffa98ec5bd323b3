"""The hybrid model's Mamba2 mixer through vLLM 0.33.0's own Triton kernels (the GPU path).

vLLM's kernel files are third-party code and never part of this repository:
``python tests/kernels/fetch_kernels.py`` copies them, byte for byte, into the ignored folder
``.kernels/vllm/`` with tiny stand-ins for the few vLLM modules they import. :func:`load_ops` imports
them from there under their own names and takes them out of ``sys.modules`` again, so they never
shadow an installed vLLM.

:func:`vllm_mamba2_mixer` hands attnmeta's ``mamba2`` metadata to the kernels the way vLLM's
``MambaMixer2.forward`` does:

- prefill rows: ``causal_conv1d_fn`` with ``query_start_loc_p``, ``state_indices_tensor_p``,
  ``has_initial_states_p`` and the metadata object itself (its ``nums_dict``, ``batch_ptr`` and
  ``token_chunk_offset_ptr``, the conv1d programs); then ``mamba_chunk_scan_combined_varlen`` with
  ``cu_chunk_seqlen_p``, ``seq_idx_p``, ``last_chunk_indices_p``, the initial states
  ``where(has_initial_states_p, ssm[state_indices_tensor_p], 0)`` when ``prep_initial_states``, and
  the final states written into ``ssm[state_indices_tensor_p]``; in vLLM's "align" cache mode with
  prefill checkpoints (``checkpoint_meta``), the scan returns its chunk states instead, and
  ``store_prefill_checkpoint`` writes each checkpoint's SSM and conv state into
  ``checkpoint_meta.state_indices`` (the chunk ``checkpoint_chunk_idx`` ends at it) before the final
  states are gathered from ``last_chunk_indices_p``;
- decode rows: ``causal_conv1d_update`` and ``selective_state_update`` with ``state_indices_tensor_d``
  (a padding row's slot is the null slot 0, which both kernels skip).

Everything between the input and output projections runs in float32, as the CPU reference mixer
(:func:`.hybrid.mamba2_mixer`) does; the kernels round their ``tl.dot`` inputs to TF32.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from attnmeta.backends.mamba.mamba2 import Mamba2Metadata

KERNELS = Path(__file__).resolve().parents[2] / ".kernels"
"""The ignored folder ``tests/kernels/fetch_kernels.py`` writes (``vllm/`` holds vLLM's kernel files)."""
OPS = "vllm.model_executor.layers.mamba.ops"
FETCH = "python tests/kernels/fetch_kernels.py"

__all__ = ["FETCH", "KERNELS", "OPS", "isolated_import", "load_ops", "vllm_mamba2_mixer"]


@contextlib.contextmanager
def isolated_import(prefix: str, path: Path | None, bare: dict[str, list[str]]) -> Iterator[None]:
    """Import modules named ``prefix...`` from ``path`` (put first on ``sys.path``) and bare packages
    (name -> ``__path__``), then restore ``sys.modules`` and ``sys.path``: the imported modules live
    on through the functions taken from them, and never shadow an installed package of that name."""
    saved = {k: v for k, v in sys.modules.items() if k == prefix or k.startswith(prefix + ".")}
    for k in saved:
        del sys.modules[k]
    if path is not None:
        sys.path.insert(0, str(path))
    for name, where in bare.items():
        pkg = types.ModuleType(name)
        pkg.__path__ = where
        sys.modules[name] = pkg
    try:
        yield
    finally:
        if path is not None:
            sys.path.remove(str(path))
        for k in [k for k in sys.modules if k == prefix or k.startswith(prefix + ".")]:
            del sys.modules[k]
        sys.modules.update(saved)


def load_ops(root: Path | None = None) -> types.SimpleNamespace:
    """vLLM 0.33.0's Mamba2 kernel functions from ``root`` (default ``.kernels/vllm``).

    Returns a namespace of ``ssd_varlen`` (``mamba_chunk_scan_combined_varlen``), ``conv1d_fn``,
    ``conv1d_update``, ``state_update`` (``selective_state_update``), ``store_checkpoint``
    (``store_prefill_checkpoint``), ``checkpoint_type`` (``MambaPrefillCheckpointMetadata``) and
    ``modules`` (the kernel modules by short name).

    Raises
    ------
    FileNotFoundError
        The kernel files are not there; the message names the command that fetches them.
    """
    root = KERNELS / "vllm" if root is None else root
    if not (root / OPS.replace(".", "/") / "ssd_combined.py").is_file():
        raise FileNotFoundError(f"vLLM 0.33.0's Mamba kernel files are not in {root}: run {FETCH} "
                                "(--vllm-dir PATH or --vllm-wheel PATH, else it downloads the wheel)")
    with isolated_import("vllm", root, {}):
        mods = {n: importlib.import_module(f"{OPS}.{n}")
                for n in ("ssd_combined", "causal_conv1d", "mamba_ssm", "ssd_checkpoint", "ssd_chunk_scan",
                          "ssd_chunk_state", "ssd_state_passing", "ssd_bmm")}
        ckpt = importlib.import_module("vllm.model_executor.layers.mamba.checkpoint")
    return types.SimpleNamespace(
        ssd_varlen=mods["ssd_combined"].mamba_chunk_scan_combined_varlen,
        conv1d_fn=mods["causal_conv1d"].causal_conv1d_fn,
        conv1d_update=mods["causal_conv1d"].causal_conv1d_update,
        state_update=mods["mamba_ssm"].selective_state_update,
        store_checkpoint=mods["ssd_checkpoint"].store_prefill_checkpoint,
        checkpoint_type=ckpt.MambaPrefillCheckpointMetadata,
        modules=mods,
    )


def vllm_mamba2_mixer(ops: types.SimpleNamespace, mixer: Any, x: torch.Tensor, meta: Mamba2Metadata,
                      state: Any) -> torch.Tensor:
    """A Bamba Mamba2 mixer over one step's tokens through vLLM's kernels.

    Parameters
    ----------
    ops : SimpleNamespace
        :func:`load_ops`'s kernels.
    mixer : transformers' ``BambaMixer``
        Weights (``in_proj``, ``conv1d``, ``A_log``, ``D``, ``dt_bias``, ``norm``, ``out_proj``).
    x : torch.Tensor
        (T, hidden) in the model's dtype, on the GPU: the step's tokens, decode rows first.
    meta : Mamba2Metadata
        The step's ``mamba2`` metadata (device fields on the GPU, counts on the host).
    state : .hybrid.Mamba2State
        The layer's state pool: ``conv`` (slots, conv_dim, width - 1) float32 with the channel stride 1,
        ``ssm`` (slots, heads, head_dim, d_state) float32; read and written in place.

    Returns
    -------
    torch.Tensor
        (T, hidden) in the model's dtype; zeros through the norm for padding tokens.
    """
    t = x.shape[0]
    inner, conv_dim, heads, hd = mixer.intermediate_size, mixer.conv_dim, mixer.num_heads, mixer.head_dim
    groups, dstate = mixer.n_groups, mixer.ssm_state_size
    gate, xbc, dt = mixer.in_proj(x).split([inner, conv_dim, heads], dim=-1)
    xbc, dt = xbc.float().contiguous(), dt.float().contiguous()
    w = mixer.conv1d.weight[:, 0, :].float()  # (conv_dim, width)
    bias = mixer.conv1d.bias.float() if mixer.conv1d.bias is not None else None
    a = -torch.exp(mixer.A_log.float())
    d_skip, dt_bias = mixer.D.float(), mixer.dt_bias.float()
    y = torch.zeros(t, heads, hd, device=x.device)
    nd = meta.num_decode_tokens if meta.num_decodes else 0

    def ssm_inputs(conv_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        xs, b, c = torch.split(conv_out, [inner, groups * dstate, groups * dstate], dim=-1)
        n = xs.shape[0]
        return xs.reshape(n, heads, hd), b.reshape(n, groups, dstate), c.reshape(n, groups, dstate)

    if meta.num_prefills:
        p = slice(nd, nd + meta.num_prefill_tokens)
        x_t = xbc[p].transpose(0, 1)  # (conv_dim, Pt), channel stride 1
        conv = ops.conv1d_fn(x_t, w, bias, conv_states=state.conv,
                             query_start_loc=meta.query_start_loc_p, cache_indices=meta.state_indices_tensor_p,
                             has_initial_state=meta.has_initial_states_p, activation="silu",
                             metadata=meta).transpose(0, 1)
        xs, b, c = ssm_inputs(conv)
        init = None
        if meta.prep_initial_states:  # a host flag: some row continues the state in its slot
            assert meta.has_initial_states_p is not None and meta.state_indices_tensor_p is not None
            init = torch.where(meta.has_initial_states_p[:, None, None, None],
                               state.ssm[meta.state_indices_tensor_p.long()], 0)
        ck = meta.checkpoint_meta  # align mode: rows that also store a block end's state inside their chunk
        chunk_states = ops.ssd_varlen(
            xs, dt[p], a, b, c, chunk_size=meta.chunk_size, cu_seqlens=meta.query_start_loc_p,
            cu_chunk_seqlens=meta.cu_chunk_seqlen_p, last_chunk_indices=meta.last_chunk_indices_p,
            seq_idx=meta.seq_idx_p, out=y[p], D=d_skip, dt_bias=dt_bias, initial_states=init, dt_softplus=True,
            dt_limit=tuple(mixer.time_step_limit or (0.0, float("inf"))), state_dtype=torch.float32,
            return_intermediate_states=ck is not None, final_states_out=None if ck is not None else state.ssm,
            final_state_indices=None if ck is not None else meta.state_indices_tensor_p)
        if ck is not None:  # the chunk states come back: store the checkpoints, then each row's final state
            assert meta.checkpoint_chunk_idx is not None and meta.last_chunk_indices_p is not None
            ops.store_checkpoint(ops.checkpoint_type(ck.offsets, ck.state_indices), meta.checkpoint_chunk_idx, x_t,
                                 state.conv, chunk_states, state.ssm, meta.query_start_loc_p, state_len=w.shape[1] - 1)
            state.ssm[meta.state_indices_tensor_p.long()] = chunk_states[meta.last_chunk_indices_p.long()]
    if meta.num_decodes:
        si = meta.state_indices_tensor_d
        conv = ops.conv1d_update(xbc[:nd], state.conv, w, bias, "silu", conv_state_indices=si,
                                 num_accepted_tokens=meta.num_accepted_tokens, query_start_loc=meta.query_start_loc_d,
                                 max_query_len=si.size(-1))
        xs, b, c = ssm_inputs(conv)
        ops.state_update(state.ssm, xs, dt[:nd, :, None].expand(-1, -1, hd), a[:, None, None].expand(-1, hd, dstate),
                         b, c, d_skip[:, None].expand(-1, hd), dt_bias[:, None].expand(-1, hd), dt_softplus=True,
                         state_batch_indices=si, dst_state_batch_indices=si, out=y[:nd],
                         num_accepted_tokens=meta.num_accepted_tokens, cu_seqlens=meta.query_start_loc_d)
    out = mixer.norm(y.reshape(t, -1).to(x.dtype), gate)
    return mixer.out_proj(out.to(x.dtype))  # type: ignore[no-any-return]
