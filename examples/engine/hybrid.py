"""A hybrid model (attention and Mamba2 layers: ``transformers``' Bamba) through the engine's forward.

Attention layers read the paged KV cache as in :mod:`.model`; Mamba2 layers read a state pool, one
conv state and one SSM state per slot and layer, through attnmeta's ``mamba2`` metadata of the step's
second KV-cache group:

- decode rows ``[0, num_decodes)``: one token each; their slots are ``state_indices_tensor_d[:, 0]``
  (padding rows: slot 0, the null slot); one recurrent update for all of them;
- prefill rows: their tokens are ``query_start_loc_p`` (from ``num_decode_tokens`` on), their slots
  ``state_indices_tensor_p``, and ``has_initial_states_p`` says whether a row continues the state in
  its slot (a later chunk of a chunked prefill) or starts from zeros;
- in vLLM's "align" cache mode, a slot is the Mamba block of the row's last token, and a prefill row
  may also store a checkpoint (``checkpoint_meta``: the state after ``offsets`` tokens of its chunk,
  into ``state_indices``), a block's end state for the prefix cache.

Two Mamba2 mixers read that metadata: :func:`mamba2_mixer`, the reference (the conv and the SSM
recurrence written in torch, row by row and token by token, in float32; CPU or GPU), and
:func:`.vllm_mamba.vllm_mamba2_mixer`, vLLM's own Triton kernels (GPU), chosen by ``PagedBamba``'s
``mamba_ops``.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn.functional as F

from attnmeta.backends.mamba.mamba2 import Mamba2Metadata

from .kernels import AttentionKernel
from .vllm_mamba import vllm_mamba2_mixer


def _apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers.models.bamba.modeling_bamba import apply_rotary_pos_emb

    return apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)  # type: ignore[no-any-return,no-untyped-call]


class Mamba2State:
    """One Mamba2 layer's state pool: ``conv`` (slots, conv_dim, d_conv - 1) and ``ssm`` (slots, heads,
    head_dim, d_state) float32, on the model's device; slot 0 is the null slot (padding rows).

    ``conv`` is a transposed view of (slots, d_conv - 1, conv_dim) storage: channels have stride 1, the
    layout vLLM's conv1d kernels take."""

    def __init__(self, mixer: Any, num_slots: int, device: torch.device) -> None:
        self.conv = torch.zeros(num_slots, mixer.conv_kernel_size - 1, mixer.conv_dim, device=device).transpose(1, 2)
        self.ssm = torch.zeros(num_slots, mixer.num_heads, mixer.head_dim, mixer.ssm_state_size, device=device)


def _ssm_update(mixer: Any, h: torch.Tensor, x: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                dt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One recurrence step for ``n`` rows: ``h`` (n, H, P, N), ``x`` (n, H, P), ``b``/``c`` (n, G, N),
    ``dt`` (n, H) raw. Returns the new state and ``y`` (n, H, P)."""
    heads, groups = mixer.num_heads, mixer.n_groups
    dt = F.softplus(dt.float() + mixer.dt_bias.float())
    lo, hi = mixer.time_step_limit
    dt = dt.clamp(lo, hi)
    a = -torch.exp(mixer.A_log.float())
    b = b.float().repeat_interleave(heads // groups, dim=1)  # (n, H, N)
    c = c.float().repeat_interleave(heads // groups, dim=1)
    h = h * torch.exp(dt * a)[:, :, None, None] + (dt[:, :, None] * x.float())[..., None] * b[:, :, None, :]
    y = (h * c[:, :, None, :]).sum(-1) + mixer.D.float()[None, :, None] * x.float()
    return h, y


def mamba2_mixer(mixer: Any, x: torch.Tensor, meta: Mamba2Metadata, state: Mamba2State) -> torch.Tensor:
    """A Bamba Mamba2 mixer over one step's tokens ``x`` (T, hidden), states read and written through
    ``meta``'s state indices. Returns (T, hidden)."""
    t = x.shape[0]
    inner, conv_dim, heads, hd = mixer.intermediate_size, mixer.conv_dim, mixer.num_heads, mixer.head_dim
    gn = mixer.n_groups * mixer.ssm_state_size
    gate, xbc, dt = mixer.in_proj(x).split([inner, conv_dim, heads], dim=-1)
    w = mixer.conv1d.weight[:, 0, :].float()  # (conv_dim, d_conv)
    bias = mixer.conv1d.bias.float() if mixer.conv1d.bias is not None else torch.zeros(conv_dim, device=x.device)
    y = torch.zeros(t, heads, hd, device=x.device)
    nd = meta.num_decode_tokens if meta.num_decodes else 0

    def ssm_inputs(conv_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        xs, b, c = torch.split(conv_out, [inner, gn, gn], dim=-1)
        n = xs.shape[0]
        return xs.reshape(n, heads, hd), b.reshape(n, mixer.n_groups, -1), c.reshape(n, mixer.n_groups, -1)

    if meta.num_decodes:  # one token a row, all rows at once
        slots = meta.state_indices_tensor_d[:, 0].long()
        window = torch.cat([state.conv[slots], xbc[:nd].float()[:, :, None]], dim=2)  # (D, conv_dim, d_conv)
        state.conv[slots] = window[:, :, 1:]
        xs, b, c = ssm_inputs(F.silu((window * w).sum(-1) + bias))
        state.ssm[slots], y[:nd] = _ssm_update(mixer, state.ssm[slots], xs, b, c, dt[:nd])
    if meta.num_prefills and meta.query_start_loc_p_cpu is not None and meta.has_initial_states_p is not None:
        qsl = meta.query_start_loc_p_cpu
        ck = meta.checkpoint_meta  # align mode: a row may also store its state at a block end inside its chunk
        for i in range(meta.num_prefills):
            a, e = nd + int(qsl[i]), nd + int(qsl[i + 1])
            if a == e:
                continue
            slot = meta.state_indices_tensor_p[i : i + 1].long()
            keep = meta.has_initial_states_p[i : i + 1].float()  # 0: start from zeros
            seq = torch.cat([state.conv[slot][0] * keep, xbc[a:e].float().T], dim=1)  # (conv_dim, k - 1 + n)
            state.conv[slot] = seq[None, :, seq.shape[1] - w.shape[1] + 1 :]
            conv = F.silu(F.conv1d(seq[None], w[:, None, :], bias, groups=conv_dim)[0].T)  # (n, conv_dim)
            xs, b, c = ssm_inputs(conv)
            h = state.ssm[slot] * keep
            off = int(ck.offsets_cpu[i]) if ck is not None else 0
            for j in range(e - a):
                h, y[a + j : a + j + 1] = _ssm_update(mixer, h, xs[j : j + 1], b[j : j + 1], c[j : j + 1],
                                                      dt[a + j : a + j + 1])
                if off and j + 1 == off:  # the state after `off` tokens, and the inputs before them
                    assert ck is not None and ck.state_indices_cpu is not None
                    cslot = int(ck.state_indices_cpu[i])
                    state.ssm[cslot] = h[0]
                    state.conv[cslot] = seq[:, off : off + w.shape[1] - 1]
            state.ssm[slot] = h
    out = mixer.norm(y.reshape(t, -1).to(x.dtype), gate)
    return mixer.out_proj(out.to(x.dtype))  # type: ignore[no-any-return]


class PagedBamba:
    """A ``BambaForCausalLM``'s weights over a paged KV cache (its attention layers) and a state pool of
    ``num_state_slots`` slots (its Mamba2 layers).

    ``mamba_ops``: vLLM's kernels (:func:`.vllm_mamba.load_ops`) for the Mamba2 layers, or ``None`` for
    the torch reference mixer."""

    def __init__(self, model: Any, num_blocks: int, block_size: int, num_state_slots: int,
                 mamba_ops: types.SimpleNamespace | None = None) -> None:
        cfg = model.config
        if mamba_ops is not None and tuple(cfg.time_step_limit or (0.0, float("inf"))) != (0.0, float("inf")):
            # selective_state_update (decode rows) takes no dt limit
            raise ValueError(f"vLLM's Mamba2 kernels: time_step_limit must be (0, inf), not {cfg.time_step_limit}")
        self.mamba_ops = mamba_ops
        self.model = model.eval()
        self.layer_types = list(cfg.layer_types)
        first_attn = model.model.layers[self.layer_types.index("full_attention")].self_attn
        self.num_heads = int(cfg.num_attention_heads)
        self.num_kv_heads = int(cfg.num_key_value_heads)
        self.head_dim = int(first_attn.head_dim)
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        shape = (num_blocks, block_size, self.num_kv_heads, self.head_dim)
        self.k_cache: dict[int, torch.Tensor] = {}
        self.v_cache: dict[int, torch.Tensor] = {}
        self.states: dict[int, Mamba2State] = {}
        for i, (kind, layer) in enumerate(zip(self.layer_types, model.model.layers, strict=True)):
            if kind == "full_attention":
                self.k_cache[i] = torch.zeros(shape, dtype=p.dtype, device=p.device)
                self.v_cache[i] = torch.zeros(shape, dtype=p.dtype, device=p.device)
            else:
                self.states[i] = Mamba2State(layer.mamba, num_state_slots, p.device)

    def reset_slots(self, slots: list[int]) -> None:
        """Zero the states of newly assigned slots (host-known slot numbers: device writes, no read)."""
        for st in self.states.values():
            for s in slots:
                st.conv[s].zero_()
                st.ssm[s].zero_()

    def copy_slots(self, moves: list[tuple[int, int]]) -> None:
        """Copy every Mamba layer's states from slot ``src`` to slot ``dst`` for each ``(src, dst)``
        (host-known slot numbers: device copies, no read)."""
        for st in self.states.values():
            for src, dst in moves:
                st.conv[dst].copy_(st.conv[src])
                st.ssm[dst].copy_(st.ssm[src])

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                logits_index: torch.Tensor, kernel: AttentionKernel, mamba: Mamba2Metadata) -> torch.Tensor:
        """As :meth:`.model.PagedLlama.forward`, with the step's ``mamba2`` metadata for the Mamba layers."""
        m = self.model.model
        t = input_ids.shape[0]
        h = m.embed_tokens(input_ids)
        cos, sin = m.rotary_emb(h, positions.long()[None])
        cos, sin = cos[0], sin[0]
        slots = slot_mapping.long().clamp(min=0)
        for i, layer in enumerate(m.layers):
            x = layer.input_layernorm(h)
            if i in self.states and self.mamba_ops is not None:
                h = h + vllm_mamba2_mixer(self.mamba_ops, layer.mamba, x, mamba, self.states[i])
            elif i in self.states:
                h = h + mamba2_mixer(layer.mamba, x, mamba, self.states[i])
            else:
                att = layer.self_attn
                q = att.q_proj(x).view(t, self.num_heads, self.head_dim)
                k = att.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
                v = att.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
                q, k = _apply_rotary(q, k, cos, sin)
                self.k_cache[i].view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, slots, k)
                self.v_cache[i].view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, slots, v)
                o = kernel.attend(i, q, self.k_cache[i], self.v_cache[i])
                h = h + att.o_proj(o.reshape(t, -1))
            h = h + layer.feed_forward(layer.pre_ff_layernorm(h))
        h = m.final_layernorm(h[logits_index])
        return self.model.lm_head(h).float()  # type: ignore[no-any-return]
