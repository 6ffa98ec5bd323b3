"""A Hugging Face Llama run through the engine's own forward over a paged KV cache.

The weights are ``transformers``' ``LlamaForCausalLM``'s (its modules are called as they are); the
forward is the engine's: every token of the step in one flat batch, rotary positions from attnmeta's
``positions``, K/V written into the paged cache through attnmeta's ``slot_mapping``, attention through
the engine's kernel, logits only at each request row's last token.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from .kernels import AttentionKernel


class PagedLlama:
    """``model``'s weights with a paged KV cache of ``num_blocks`` blocks of ``block_size`` tokens.

    The caches are one (num_blocks, block_size, num_kv_heads, head_dim) tensor per layer for K and one
    for V, on the model's device in its dtype (FlashInfer's ``NHD`` layout).
    """

    def __init__(self, model: Any, num_blocks: int, block_size: int) -> None:
        cfg = model.config
        self.model = model.eval()
        self.num_heads = int(cfg.num_attention_heads)
        self.num_kv_heads = int(cfg.num_key_value_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        shape = (num_blocks, block_size, self.num_kv_heads, self.head_dim)
        layers = len(model.model.layers)
        self.k_cache = [torch.zeros(shape, dtype=p.dtype, device=p.device) for _ in range(layers)]
        self.v_cache = [torch.zeros(shape, dtype=p.dtype, device=p.device) for _ in range(layers)]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                logits_index: torch.Tensor, kernel: AttentionKernel) -> torch.Tensor:
        """One step: ``input_ids``, ``positions``, ``slot_mapping`` (T,) on the model's device (padding
        tokens have slot -1: they write the null block's slot 0); ``logits_index`` (R,) int64, the token
        whose logits each row needs. Returns (R, vocab) float32 logits."""
        m = self.model.model
        t = input_ids.shape[0]
        h = m.embed_tokens(input_ids)
        cos, sin = m.rotary_emb(h, positions.long()[None])  # (1, T, head_dim) each
        cos, sin = cos[0], sin[0]
        slots = slot_mapping.long().clamp(min=0)
        for i, layer in enumerate(m.layers):
            att = layer.self_attn
            x = layer.input_layernorm(h)
            q = att.q_proj(x).view(t, self.num_heads, self.head_dim)
            k = att.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
            v = att.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
            q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
            self.k_cache[i].view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, slots, k)
            self.v_cache[i].view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, slots, v)
            o = kernel.attend(i, q, self.k_cache[i], self.v_cache[i])
            h = h + att.o_proj(o.reshape(t, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        h = m.norm(h[logits_index])
        return self.model.lm_head(h).float()  # type: ignore[no-any-return]
