"""``python -m examples.engine``: serve workloads with the reference engine and check every request's
tokens against ``transformers``' own ``generate``.

Two workloads per kernel: ``mixed`` (24 requests arriving over 6 steps, a shared prompt prefix, chunked
prefill, a KV pool small enough to preempt, padded decode steps) and ``cascade`` (10 requests sharing a
270-token prefix: steps that cascade). A hybrid model (``--model tiny-hybrid`` or ``hybrid-1b``) serves
``hybrid`` (16 requests, one Mamba state slot each: chunked prefills that continue their states,
preemption, padded decode steps) and ``hybrid-align`` (20 requests sharing a 40-token prefix in vLLM's
"align" Mamba cache mode: prefix-cache hits that resume from cached Mamba states, prefill
checkpoints). Exits non-zero if a token differs where ``generate``'s top-2 logit margin exceeds the
tolerance.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from typing import Any

import torch

from .engine import Engine, EngineConfig, EngineStats, make_kernel
from .workload import (
    Comparison,
    ForcedComparison,
    Reference,
    compare_teacher_forced,
    compare_with_generate,
    config_1b,
    config_hybrid_1b,
    make_model,
    make_requests,
    tiny_config,
    tiny_hybrid_config,
)

WORKLOADS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    # name: (make_requests arguments, EngineConfig arguments)
    "mixed": ({"num": 24, "shared_prefix": 40, "arrive_over": 6, "seed": 1},
              {"num_blocks": 40, "max_num_tokens": 64, "max_num_seqs": 16, "max_model_len": 256}),
    "cascade": ({"num": 10, "shared_prefix": 270, "shared_every": 1, "prompt_len": (1, 20), "new_tokens": (4, 12),
                 "seed": 2}, {"num_blocks": 120, "max_num_tokens": 512, "max_num_seqs": 16, "max_model_len": 512,
                              "decode_sizes": ()}),
    # for the hybrid model: no prefix caching (a Mamba state has no per-block cache), the rest as "mixed"
    "hybrid": ({"num": 16, "arrive_over": 6, "seed": 3},
               {"num_blocks": 24, "max_num_tokens": 48, "max_num_seqs": 8, "max_model_len": 256}),
    # the hybrid model in vLLM's "align" Mamba cache mode: prefix caching of Mamba states (a shared
    # 40-token prefix), block-aligned prompt chunks, prefill checkpoints, preemption
    "hybrid-align": ({"num": 20, "shared_prefix": 40, "arrive_over": 8, "seed": 4},
                     {"num_blocks": 26, "max_num_tokens": 48, "max_num_seqs": 8, "max_model_len": 256,
                      "mamba_cache_mode": "align"}),
}


def run_workload(model: Any, kernel: str, workload: str, *, cuda_graphs: bool = False, async_scheduling: bool = True,
                 uploads: str = "one-copy", tolerance: float = 0.0, mamba_kernels: str = "torch",
                 cache: Reference | None = None, metadata: str = "attnmeta", cascade: bool = True
                 ) -> tuple[EngineStats, Comparison, ForcedComparison]:
    """Serve one workload and compare it with ``generate`` (until each request's first near tie) and
    with the model's own argmax over the engine's tokens (every token); returns the engine's stats and
    both comparisons. ``mamba_kernels``: a hybrid model's Mamba2 mixer (``EngineConfig.mamba_kernels``);
    ``metadata``: who builds the metadata (``EngineConfig.metadata``: ``"attnmeta"`` or ``"vllm"``);
    ``cascade``: the kernel's cascade builder (:func:`make_kernel`; without it the engine's mixed steps go
    through its fixed-layout composer, :attr:`EngineConfig.fixed_mixed_layout`)."""
    req_kw, cfg_kw = WORKLOADS[workload]
    reqs = make_requests(vocab=model.config.vocab_size, **req_kw)
    if workload == "cascade":
        for r in reqs[1:]:  # the first request computes the prefix; the others find it cached
            r.arrival = 2
    device = next(model.parameters()).device
    cfg = EngineConfig(cuda_graphs=cuda_graphs, async_scheduling=async_scheduling, uploads=uploads,  # type: ignore[arg-type]
                       mamba_kernels=mamba_kernels, metadata=metadata, **cfg_kw)  # type: ignore[arg-type]
    engine = Engine(model, make_kernel(kernel, model, device, cascade=cascade), cfg)
    stats = engine.run(reqs)
    return stats, compare_with_generate(model, reqs, tolerance=tolerance, cache=cache), compare_teacher_forced(model, reqs)


def report(label: str, workload: str, seconds: float, st: EngineStats, cmp: Comparison,
           forced: ForcedComparison) -> str:
    """One run's lines: the verdict first, then the two comparisons, then the engine's nonzero counters."""
    ok = cmp.mismatches == 0 and forced.mismatches == 0
    counts = [f"{k.replace('_', ' ')} {v}" for k, v in dataclasses.asdict(st).items() if isinstance(v, int) and v]
    return (f"{label:18} {workload:12} {'OK  ' if ok else 'FAIL'} {seconds:6.1f}s  {cmp.requests} requests, "
            f"{cmp.generated} tokens\n"
            f"    against generate: {cmp.tokens} tokens compared, {cmp.mismatches} mismatches, {cmp.near_ties} near "
            f"ties (top-2 margin at most the tolerance), smallest margin {cmp.min_margin:.3g}\n"
            f"    teacher-forced:   {forced.tokens} tokens, {forced.mismatches} mismatches, {forced.near_ties} near "
            f"ties (tolerance {forced.tolerance:.3g}: twice the logit noise against float32)\n"
            f"    engine: {', '.join(counts)}")


KERNELS = ("torch-paged", "torch-varlen", "flashinfer", "flashinfer+graphs")
"""The kernels ``--kernels`` names (``make_kernel``'s, and FlashInfer with CUDA graphs)."""


def _checked_args(p: argparse.ArgumentParser, a: argparse.Namespace) -> torch.device:
    """``--device`` as a device of this machine, and every name in ``--kernels``, ``--workloads`` and
    ``--metadata`` known, before a model is made; else the parser's error (status 2) says which."""
    try:
        device = torch.device(a.device)
    except RuntimeError:
        p.error(f"--device {a.device!r}: expected cpu or cuda")
    if device.type not in ("cpu", "cuda"):
        p.error(f"--device {a.device!r}: expected cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {a.device}: no CUDA device is available here (torch {torch.__version__}); use --device cpu")
    for flag, given, known in (("--kernels", a.kernels, KERNELS), ("--workloads", a.workloads, tuple(WORKLOADS)),
                               ("--metadata", a.metadata, ("attnmeta", "vllm"))):
        unknown = [n for n in (given or "").split(",") if given and n not in known]
        if unknown:
            p.error(f"{flag}: unknown {', '.join(map(repr, unknown))}; expected a comma-separated list of {', '.join(known)}")
    if "vllm" in a.metadata.split(","):  # (vLLM's package, before a model is made: how to get it, not a traceback)
        from .vllm_metadata import _import_vllm

        try:
            _import_vllm()
        except ImportError as e:
            p.error(f"--metadata vllm: {e}")
    return device


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m examples.engine", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--model", choices=["tiny", "1b", "tiny-hybrid", "hybrid-1b"], default=None,
                   help="tiny (float32, default on cpu), 1b (a ~1.2B Llama in bfloat16, default on cuda), "
                        "tiny-hybrid (a Bamba of Mamba2 and attention layers, float32) or hybrid-1b (a ~1.4B "
                        "Bamba in bfloat16); a hybrid's default workloads are hybrid and hybrid-align")
    p.add_argument("--mamba-kernels", choices=["torch", "vllm"], default=None,
                   help="a hybrid model's Mamba2 layers: the torch reference (default on cpu) or vLLM's Triton "
                        "kernels (default on cuda; python tests/kernels/fetch_kernels.py puts them in .kernels/)")
    p.add_argument("--kernels", default=None,
                   help="comma-separated: torch-paged, torch-varlen, flashinfer, flashinfer+graphs "
                        "(default: torch-paged on cpu, all on cuda)")
    p.add_argument("--workloads", default="mixed,cascade",
                   help="comma-separated: mixed (24 requests arriving over 6 steps, a shared prompt prefix, chunked "
                        "prefill), cascade (10 requests behind a 270-token shared prefix), and for a hybrid --model "
                        "hybrid (16 requests) and hybrid-align (vLLM's align Mamba cache mode: prefix caching of "
                        "Mamba states) (default: mixed,cascade; a hybrid model's: hybrid,hybrid-align)")
    p.add_argument("--metadata", default="attnmeta",
                   help="comma-separated: attnmeta, vllm (vLLM 0.33.0's runner buffers and builders; needs vLLM's "
                        "Python package; kernels torch-paged and flashinfer, not the hybrid-align workload)")
    p.add_argument("--tolerance", type=float, default=None,
                   help="generate comparison: top-2 logit margin below which a differing token is a near tie "
                        "(default 0 in float32, 0.5 in bfloat16); the teacher-forced comparison measures its own")
    a = p.parse_args(argv)
    device = _checked_args(p, a)
    size = a.model or ("1b" if device.type == "cuda" else "tiny")
    dtype = torch.bfloat16 if size.endswith("1b") else torch.float32
    mamba_kernels = a.mamba_kernels or ("vllm" if device.type == "cuda" else "torch")
    if "hybrid" in size:
        print(f"Mamba2 layers: {mamba_kernels}", flush=True)
    if "hybrid" in size and a.workloads == "mixed,cascade":
        a.workloads = "hybrid,hybrid-align"
    tol = a.tolerance if a.tolerance is not None else (0.5 if dtype == torch.bfloat16 else 0.0)
    on_gpu = ("torch-paged,flashinfer" if "hybrid" in size  # a hybrid model runs eager steps only
              else "torch-paged,torch-varlen,flashinfer,flashinfer+graphs")
    kernels = (a.kernels or (on_gpu if device.type == "cuda" else "torch-paged")).split(",")
    print(f"model {size} ({dtype}), device {device}, tolerance {tol}", flush=True)
    config = {"1b": config_1b, "tiny": tiny_config, "tiny-hybrid": tiny_hybrid_config,
              "hybrid-1b": config_hybrid_1b}[size]()
    model = make_model(config, device, dtype)
    cache: Reference = {}
    bad = 0
    runs = [(k, w, m) for m in a.metadata.split(",") for k in kernels for w in a.workloads.split(",")]
    for kernel, workload, metadata in runs:
        label = kernel if metadata == "attnmeta" else f"{kernel}/{metadata}"
        if metadata == "vllm" and (workload == "hybrid-align" or kernel.startswith("torch-varlen")):
            print(f"{label:18} {workload:12} not run: the vllm mode runs kernels torch-paged and flashinfer, and "
                  "the 'none' Mamba cache mode", flush=True)
            continue
        t0 = time.perf_counter()
        st, cmp, forced = run_workload(model, kernel.removesuffix("+graphs"), workload,
                                       cuda_graphs=kernel.endswith("+graphs"), tolerance=tol, mamba_kernels=mamba_kernels,
                                       cache=cache, metadata=metadata)
        bad += cmp.mismatches + forced.mismatches
        print(report(label, workload, time.perf_counter() - t0, st, cmp, forced), flush=True)
    print("OK: every token equal" if bad == 0 else f"FAIL: {bad} mismatches", flush=True)
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
