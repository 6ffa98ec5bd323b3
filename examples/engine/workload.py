"""Models, workloads and the token-for-token check against ``transformers``' own ``generate``."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from .scheduler import Request


def tiny_config(**overrides: Any) -> Any:
    """A Llama config small enough for the CPU test (2 layers, 4 query / 2 KV heads of 16)."""
    from transformers import LlamaConfig

    kw: dict[str, Any] = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2048,
                          "initializer_range": 0.2}
    kw.update(overrides)
    return LlamaConfig(**kw)


def tiny_hybrid_config(**overrides: Any) -> Any:
    """A Bamba config (Mamba2 and attention layers in turn) small enough for the CPU test."""
    from transformers import BambaConfig

    kw: dict[str, Any] = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
                          "attn_layer_indices": [1, 3], "num_attention_heads": 4, "num_key_value_heads": 2,
                          "mamba_n_heads": 4, "mamba_d_head": 32, "mamba_n_groups": 2, "mamba_d_state": 16,
                          "mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": 16, "initializer_range": 0.2,
                          "max_position_embeddings": 2048}
    kw.update(overrides)
    return BambaConfig(**kw)


def config_hybrid_1b() -> Any:
    """A ~1.4B-parameter Bamba config: 16 layers, 3 of them attention (32 / 8 heads of 64), 13 Mamba2
    (64 heads of 64, one group, state size 128, chunk size 256): the proportions of Bamba 9B."""
    from transformers import BambaConfig

    return BambaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                       attn_layer_indices=[4, 9, 14], num_attention_heads=32, num_key_value_heads=8,
                       mamba_n_heads=64, mamba_d_head=64, mamba_n_groups=1, mamba_d_state=128, mamba_d_conv=4,
                       mamba_expand=2, mamba_chunk_size=256, max_position_embeddings=4096, tie_word_embeddings=True,
                       initializer_range=0.05)


def config_1b() -> Any:
    """A ~1.2B-parameter Llama config (Llama 3.2 1B's shapes: 16 layers, 32 / 8 heads of 64)."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=4096,
                       tie_word_embeddings=True, initializer_range=0.05)


def make_model(config: Any, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
               seed: int = 0) -> Any:
    """A randomly initialised ``LlamaForCausalLM`` (or ``BambaForCausalLM`` for a Bamba config; no
    download), eval mode, on ``device``."""
    from transformers import BambaForCausalLM, LlamaForCausalLM

    torch.manual_seed(seed)
    config._attn_implementation = "sdpa"
    cls = BambaForCausalLM if config.model_type == "bamba" else LlamaForCausalLM
    with torch.device(device):
        model = cls(config)
    return model.to(dtype).eval()  # type: ignore[arg-type]


def make_requests(num: int, vocab: int, *, seed: int = 0, prompt_len: tuple[int, int] = (5, 60),
                  new_tokens: tuple[int, int] = (1, 24), shared_prefix: int = 0, shared_every: int = 2,
                  arrive_over: int = 0) -> list[Request]:
    """``num`` requests with random prompts; every ``shared_every``-th one starts with the same
    ``shared_prefix`` tokens; arrivals spread uniformly over the first ``arrive_over`` steps."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(1, vocab, shared_prefix).tolist()
    out = []
    for i in range(num):
        body = rng.integers(1, vocab, int(rng.integers(*prompt_len, endpoint=True))).tolist()
        prompt = prefix + body if shared_prefix and i % shared_every == 0 else body
        out.append(Request(i, prompt, int(rng.integers(*new_tokens, endpoint=True)),
                           arrival=int(rng.integers(0, arrive_over + 1))))
    return out


@dataclasses.dataclass
class Comparison:
    """Tokens of the engine against ``generate``'s, request by request."""

    requests: int = 0
    generated: int = 0
    """Tokens the engine generated."""
    tokens: int = 0
    """Tokens compared (a request's comparison stops at its first near tie)."""
    mismatches: int = 0
    """Tokens that differ where ``generate``'s top-2 logit margin exceeds the tolerance."""
    near_ties: int = 0
    """Differing tokens where the margin is within the tolerance (allowed)."""
    min_margin: float = float("inf")
    """The smallest top-2 logit margin over the compared tokens."""


Reference = dict[tuple[tuple[int, ...], int], tuple[list[int], list[float]]]
"""``(prompt, max_new_tokens) -> (greedy tokens, top-2 logit margins)`` of ``generate``."""


@torch.inference_mode()
def generate_reference(model: Any, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """``model.generate``'s greedy tokens for ``prompt`` alone, and the top-2 margin of each step's logits."""
    dev = next(model.parameters()).device
    ids = torch.tensor([prompt], device=dev)
    # No end-of-sequence token: the engine's requests run to their length, and generate's
    # min_new_tokens would instead mask the EOS logit (a different argmax where EOS wins). Every
    # setting as an argument, no generation config: transformers deprecates a config passed beside
    # arguments, and fills a config's eos_token_id=None back in from the model's.
    out = model.generate(ids, attention_mask=torch.ones_like(ids), eos_token_id=None, pad_token_id=0,
                         max_new_tokens=max_new_tokens, do_sample=False, output_scores=True,
                         return_dict_in_generate=True)
    top2 = torch.stack([torch.topk(s[0].float(), 2).values for s in out.scores])
    return out.sequences[0, len(prompt):].tolist(), (top2[:, 0] - top2[:, 1]).tolist()


def compare_with_generate(model: Any, requests: list[Request], *, tolerance: float = 0.0,
                          cache: Reference | None = None) -> Comparison:
    """Run ``model.generate`` (greedy) on every request's prompt alone and compare with its output.

    A token may differ only where ``generate``'s top-2 logit margin is at most ``tolerance`` (0 on the
    CPU in float32: exact); the comparison of a request stops at its first difference (the texts
    diverge from there). ``cache`` keeps ``generate``'s results between calls."""
    cmp = Comparison()
    cache = {} if cache is None else cache
    for req in requests:
        key = (tuple(req.prompt), req.max_new_tokens)
        if key not in cache:
            cache[key] = generate_reference(model, req.prompt, req.max_new_tokens)
        ref, margins = cache[key]
        cmp.requests += 1
        cmp.generated += len(req.output)
        if len(req.output) != len(ref):
            raise AssertionError(f"request {req.rid}: {len(req.output)} tokens, generate made {len(ref)}")
        for a, b, margin in zip(req.output, ref, margins, strict=True):
            cmp.min_margin = min(cmp.min_margin, margin)
            cmp.tokens += 1
            if a != b:
                if margin <= tolerance:
                    cmp.near_ties += 1
                else:
                    cmp.mismatches += 1
                break
    return cmp


@dataclasses.dataclass
class ForcedComparison:
    """The engine's tokens against the model's own argmax over the same tokens (teacher forcing)."""

    requests: int = 0
    tokens: int = 0
    mismatches: int = 0
    """Tokens that differ where the model's top-2 logit margin exceeds ``tolerance``."""
    near_ties: int = 0
    """Differing tokens where the margin is within ``tolerance`` (allowed)."""
    tolerance: float = 0.0
    noise: float = 0.0
    """The largest logit difference between the model's forward in its dtype and in float32."""


@torch.inference_mode()
def compare_teacher_forced(model: Any, requests: list[Request]) -> ForcedComparison:
    """Check every generated token of every request, also after a near tie.

    One forward of ``transformers``' model over each request's prompt and generated tokens gives its
    greedy choice at every position; a float32 copy of the model over the same tokens measures the
    model dtype's own noise ``noise`` (the largest logit difference). A token of the engine may differ
    from the model's choice only where the model's top-2 margin is at most ``tolerance = 2 * noise``
    (each of the two logits may move by ``noise``). In float32, ``tolerance`` is 0."""
    import copy

    dtype = next(model.parameters()).dtype
    ref32 = None if dtype == torch.float32 else copy.deepcopy(model).float()
    dev = next(model.parameters()).device
    out = ForcedComparison()
    rows = []
    for req in requests:
        seq = torch.tensor([req.prompt + req.output], device=dev)
        logits = model(seq).logits[0, len(req.prompt) - 1 : -1].float()
        if ref32 is not None:
            out.noise = max(out.noise, float((ref32(seq).logits[0, len(req.prompt) - 1 : -1].float() - logits).abs().max()))
        rows.append((req, logits))
    out.tolerance = 2 * out.noise
    for req, logits in rows:
        out.requests += 1
        top2 = torch.topk(logits, 2, dim=-1)
        margins = (top2.values[:, 0] - top2.values[:, 1]).tolist()
        for tok, best, margin in zip(req.output, top2.indices[:, 0].tolist(), margins, strict=True):
            out.tokens += 1
            if tok != best:
                if margin <= out.tolerance:
                    out.near_ties += 1
                else:
                    out.mismatches += 1
    del ref32
    return out
