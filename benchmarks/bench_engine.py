"""The reference engine's steady-state decode on a ~1.2B Llama: steps and tokens per second, and
attnmeta's share of the step, with its one copy per step against per-tensor uploads.

For each concurrency (requests decoding together), every loop mode gets a fresh engine that serves the
workload until it is warm (FlashInfer's kernels compiled, the CUDA graphs captured, every ring slot's
layouts staged); then the modes' timed runs alternate in ``--rounds`` rounds (A B A B ...: drift on
the machine lands on every mode alike); then each serves it once under the sync audit and once under
the profiler (H2D copies counted from the trace). Every run serves new requests (prompts of ``--prompt``
tokens give or take a quarter, drawn per run; every mode of a round serves the same ones), as a serving
loop does: a run that repeated an earlier one would repeat its steps' exact shapes. The figures are the
medians over the rounds of each timed run's medians over its full-batch decode steps:

- ``step ms``: one iteration of the async loop (schedule, build, plan, launch, read the previous step's
  tokens): with the GPU busy, the GPU's step time;
- ``metadata ms``: building the step's metadata (attnmeta: the ``BatchSpec``, staging, the commit,
  the results);
  ``share``: of the step;
- ``plan ms``: the kernel's per-step preparation (FlashInfer's ``plan()``);
- ``copies/step``: the engine's metadata copies (attnmeta's stager, or the baseline's uploads);
  ``H2D/step`` every host-to-device memcpy in the profiler trace (FlashInfer's plan copies included);
- ``syncs/step``: syncs the audit records over the whole audited run (the loop's one deliberate wait,
  for the previous step's sampled tokens, is counted apart as ``waits/step``);
- ``launch ms``: host time from the end of the kernel's preparation to the step's last launch (the
  model's forward, or its graph's replay, and the sampled tokens' copy); ``wait ms``: time the loop's
  iteration spent blocked on that wait; ``behind``: the share of the steps whose launches began with
  the GPU still running the previous step. A loop bound by the host finds the GPU done (``behind``
  near 0%): its ``launch ms`` is the host's own. A loop bound by the GPU finds it behind (near 100%):
  its host blocks inside the launches once CUDA's launch queue is full, not in ``wait ms``, so its
  ``launch ms`` holds the GPU's time. When two engines' tokens/s differ, these columns say which of
  the two made the difference.

Modes: ``graphs`` (graph-mode stager, decode steps replayed as CUDA graphs, FlashInfer), ``eager``
(FlashInfer, no graphs), ``per-tensor`` (eager, the same host derivation with every field uploaded
on its own from freshly pinned memory, the pattern of vLLM's ``async_tensor_h2d``), and the headline's
baseline, ``vllm-graphs`` and ``vllm-eager``: the same engine, model and FlashInfer kernels with each
step's metadata built by vLLM 0.33.0's own runner buffers and ``FlashInferMetadataBuilder`` (and
``Mamba2AttentionMetadataBuilder`` for the hybrid model; ``examples/engine/vllm_metadata.py``), whose
``plan()`` calls are timed apart into ``plan ms`` as the attnmeta modes' are; ``varlen`` and
``vllm-varlen``: FlashAttention's varlen kernel (torch's ``varlen_attn``), eager, fed by attnmeta's
``flash_attn`` builder or by vLLM's ``FlashAttentionMetadataBuilder`` (vLLM's default backend on Hopper). In the vLLM modes
``metadata ms`` is the runner's part and the builders' ``build()`` less its ``plan()`` calls;
``copies/step`` counts the runner's own H2D copies. The sync audit runs in count mode (it records, it
does not raise): vLLM's code may sync. The summary at the end gives attnmeta over vLLM for each pair
(graphs and vllm-graphs, eager and vllm-eager, varlen and vllm-varlen, paged and vllm-paged): tokens/s
and metadata host time, as the ratio of the two medians and as ``paired``, the median over the rounds of
each round's ratio (a round runs the two modes back to back, so a drift of the machine between rounds,
which an eager step's host-bound time shows, cancels in it); ``launch x`` is attnmeta's launch ms over vLLM's.

``--processes N`` runs the whole measurement N times, each time in a fresh process, one after another,
and ends with each pair's ratios in each process and their median over the processes
(:func:`across_processes`). One process's ratio carries a spread of its own: two engines of the same
code in one process differ by up to about 15% in this host-bound time (docs/speed-tricks.md, the A/A of
``ab_engine.py``), because where the code, the objects and the caches land differs from process to
process; the median over processes does not rest on one such layout. Every other process makes its
engines, and runs each round, in the reverse of ``--modes``' order (``--reverse`` in that process;
``--same-order`` keeps one order): in the hybrid's eager steps the engine made first in a process was
sometimes much slower than a twin of the same code made after it (docs/benchmarks.md), and alternating
the order keeps that from always landing on the same mode.

A mode named with a suffix, ``MODE#2``, is a second engine of ``MODE`` made and timed beside the first
in the same process (``--modes eager,eager#2``): an A/A of the loop, whose summary gives the twin's
whole step, metadata and launch time over ``MODE``'s (the engine made second over the one made first,
or the other way round in a reversed process), and the requests whose tokens differ between the two
(none expected: the same code). It tells what one process does to two identical engines from what a
change does.

Every engine runs its loop inside ``torch.inference_mode()``, as vLLM's runner runs its steps
(``EngineConfig.inference_mode``). A mode named ``MODE+grad`` is ``MODE`` with its loop outside it, with
autograd's dispatch on every torch call (``--modes graphs,vllm-graphs,graphs+grad,vllm-graphs+grad``): a
summary gives each ``+grad`` engine's times over ``MODE``'s, what inference mode is worth to each side,
and ``+grad`` pairs get their own line in the pairs' summary.

More columns split attnmeta's time: ``fence ms``, the part spent blocked on a ring slot's fence (the
host ran ``num_slots - 1`` steps ahead of the GPU; reported apart), ``own ms``, attnmeta's time less
that wait, and ``replay``, the fraction of the timed decode steps the step composer replayed (the
same layout as the ring slot's previous step: only the per-step values are written).

The cold-step replica (``--cold``, on by default): after the timed run the same workload runs once
more with :attr:`Engine.trace` on, and its decode steps are built again through the engine's own
step composer (the same composition: common metadata, the kernel's builders, the engine's arrays;
the same ``BatchSpec`` construction), outside the loop, each timed right after a wait the way
``bench_decode.py --cold`` times its paths: ``tight`` (back to back), ``event`` (``--cold-us`` of GPU
work, then a blocking wait on an event), ``sleep``, and ``thrash`` (64 MiB of cache lines written and
20,000 small dicts read first: what the loop's own work between steps does to the caches).
``loop/cold`` is ``own ms`` over the ``event`` replica (an engine's host blocks on the GPU between
steps), ``loop/thrash`` over the ``thrash`` one. The control row (``control``) does the
same waits around plain Python work calibrated to the replica's tight time, without attnmeta: its
event / tight ratio is what any host code of that length pays after such a wait on that machine.

``--model hybrid-1b``: a ~1.4B Bamba (13 Mamba2 layers through vLLM's Triton kernels, 3 attention
layers through FlashInfer), eager steps only (the engine captures no graphs for a hybrid model), and a
second line per concurrency, ``prefill``, with the medians over the steps that carry prompt tokens
(where the Mamba2 chunk metadata is built).

On a CPU only ``paged`` and ``vllm-paged`` run (torch's paged kernel, eager): the comparison's smoke
test, ``--model tiny``; ``--model tiny-hybrid`` is a small Bamba with the same two KV-cache groups as
``hybrid-1b`` (its Mamba2 layers through the engine's torch kernels), the hybrid step's composition in a
loop the CPU can run (``ab_engine.py`` and ``bench_loop_twin.py`` take it too). Each pair's summary line
also gives the plan times, the host time of metadata and plan together (``host x``), and ``tokens
differ``: the requests whose greedy tokens differ between the two modes (the same kernels read either
metadata: 0 expected; with FlashInfer, the FlashInfer kernel's plans are printed above the pairs, and
only its ``vllm`` plans are vLLM's kernels: examples/engine/kernels.py, ``PLANS``).

``--arrive-over STEPS``: the timed runs' requests arrive over their first STEPS steps (drawn per run, in
the queue's order), so that prompts join running decodes in mixed steps, as in a server under a steady
load. The tables above still time the full-batch decode steps; a further table then gives every step of
the runs, mixed ones included: each mode's mean metadata ms a step, the share of attnmeta's steps its
composer composed (of all, of the decode and of the mixed steps), and each attnmeta / vLLM pair's ratio of
those means and of the runs' tokens/s (:func:`_print_arrivals`).

Usage: python benchmarks/bench_engine.py --device cuda [--model 1b|hybrid-1b|tiny|tiny-hybrid] [--concurrency 1,64,256]
[--modes graphs,eager,per-tensor] [--rounds 3] [--no-cold] [--cold-us US] [--processes N] [--arrive-over STEPS]
[--json FILE]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _args import device_arg  # benchmarks/_args.py
from _cold import jitter, timed_after, waits  # benchmarks/_cold.py

from attnmeta import BatchSpec
from attnmeta.sync import record_device_syncs
from examples.engine import Engine, EngineConfig, Request, make_kernel
from examples.engine.workload import config_1b, config_hybrid_1b, make_model, tiny_config, tiny_hybrid_config

MODES = {"graphs": ("flashinfer", True, "one-copy", "attnmeta"), "eager": ("flashinfer", False, "one-copy", "attnmeta"),
         "per-tensor": ("flashinfer", False, "per-tensor", "attnmeta"),
         "vllm-graphs": ("flashinfer", True, "one-copy", "vllm"), "vllm-eager": ("flashinfer", False, "one-copy", "vllm"),
         "varlen": ("torch-varlen", False, "one-copy", "attnmeta"), "vllm-varlen": ("torch-varlen", False, "one-copy", "vllm"),
         "paged": ("torch-paged", False, "one-copy", "attnmeta"), "vllm-paged": ("torch-paged", False, "one-copy", "vllm")}
"""Mode name: (kernel, CUDA graphs, uploads, who builds the metadata)."""
MODELS = {"1b": config_1b, "hybrid-1b": config_hybrid_1b, "tiny": tiny_config, "tiny-hybrid": tiny_hybrid_config}
"""``--model`` name: its config (``hybrid-1b`` and ``tiny-hybrid``: Bamba, Mamba2 and attention layers)."""


GRAD = "+grad"
"""The suffix of a mode whose engine runs its loop outside ``torch.inference_mode()``
(``EngineConfig(inference_mode=False)``): ``graphs+grad``."""


def base_mode(mode: str) -> str:
    """``mode`` without a twin's suffix (``eager#2``, a second engine of ``eager`` in the same process: an
    A/A of the loop) and without :data:`GRAD` (``eager+grad``: ``eager`` with its loop outside inference
    mode).

    >>> base_mode("eager#2"), base_mode("vllm-graphs"), base_mode("vllm-graphs+grad"), base_mode("eager+grad#2")
    ('eager', 'vllm-graphs', 'vllm-graphs', 'eager')
    """
    return mode.partition("#")[0].removesuffix(GRAD)


def inference_mode(mode: str) -> bool:
    """Whether ``mode``'s engine runs its loop inside ``torch.inference_mode()`` (every mode but a
    :data:`GRAD` one).

    >>> inference_mode("graphs"), inference_mode("graphs+grad#2")
    (True, False)
    """
    return not mode.partition("#")[0].endswith(GRAD)


PAIRS = (("graphs", "vllm-graphs"), ("eager", "vllm-eager"), ("varlen", "vllm-varlen"), ("paged", "vllm-paged"))
"""The headline's pairs: attnmeta's mode and vLLM's, the same loop otherwise."""


def modes_error(modes: list[str], hybrid: bool) -> str | None:
    """Why ``modes`` cannot run on a model (``hybrid``: Bamba's Mamba2 and attention layers), or None:
    an unknown mode, or for a hybrid model a mode with CUDA graphs or per-tensor uploads.

    >>> modes_error(["eager", "eager#2", "vllm-eager"], hybrid=True) is None
    True
    >>> modes_error(["graphs"], hybrid=True)
    'a hybrid model runs eager steps with one copy only (--modes eager,vllm-eager,varlen,vllm-varlen)'
    """
    unknown = [m for m in modes if base_mode(m) not in MODES]
    if unknown:
        return f"unknown modes {unknown}: {', '.join(MODES)}"
    if hybrid and any(MODES[base_mode(m)][1] or MODES[base_mode(m)][2] != "one-copy" for m in modes):
        return "a hybrid model runs eager steps with one copy only (--modes eager,vllm-eager,varlen,vllm-varlen)"
    return None


def cpu_error(modes: list[str]) -> str | None:
    """Why ``modes`` cannot run without CUDA, or None: only torch's paged kernel runs on the CPU."""
    if any(MODES.get(base_mode(m), ("",))[0] != "torch-paged" for m in modes):
        return ("needs CUDA (FlashInfer and varlen kernels, CUDA graphs); on the CPU only the paged and vllm-paged "
                "modes run (torch's paged kernel)")
    return None


def is_hybrid(config: Any) -> bool:
    """Whether a :data:`MODELS` config is a hybrid model (Bamba: Mamba2 and attention layers, two KV-cache
    groups), which the engine runs in eager steps only (it captures no CUDA graphs for it)."""
    return bool(config.model_type == "bamba")


def _requests(n: int, prompt: int, new: int, vocab: int, seed: int, request: Any = Request,
              arrive_over: int = 0, start: int = 0) -> list[Any]:
    """``n`` requests of ``new`` tokens each, their prompts of :func:`_prompt_range` lengths, drawn from
    ``seed``: each run of the workload is a new one, as a serving loop's steps are. (A run that repeated
    an earlier run's requests would repeat its steps exactly, every step's lengths included, and the step
    composer would find each step in its caches by exact step shape, which a serving loop misses on
    nearly every decode step: its longest sequence grows every step.) ``request``: the ``Request`` class
    of the engine that serves them (``ab_engine.py``'s other commit has its own). ``arrive_over``: the
    requests arrive at steps drawn uniformly from ``start .. start + arrive_over`` (0: all at once), in
    the order of their ids (the engine's scheduler admits its queue in order), so that prompts join
    running decodes in mixed steps, as in a server under a steady load; ``start``: the engine's next step
    (:func:`next_step`: an engine counts its steps over all its runs)."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = _prompt_range(prompt)
    lengths = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    prompts = [torch.randint(1, vocab, (k,), generator=g).tolist() for k in lengths]
    if not arrive_over:
        return [request(i, p, new) for i, p in enumerate(prompts)]
    arrivals = sorted(start + t for t in torch.randint(0, arrive_over + 1, (n,), generator=g).tolist())
    return [request(i, p, new, arrival=t) for i, (p, t) in enumerate(zip(prompts, arrivals, strict=True))]


def next_step(engine: Any) -> int:
    """The number of ``engine``'s next step, which request arrivals count from (0 for an engine whose
    scheduler does not say)."""
    return int(getattr(engine.scheduler, "step_index", 0))


def _prompt_range(prompt: int) -> tuple[int, int]:
    """The prompt lengths of a ``--prompt`` workload: ``prompt`` give or take a quarter."""
    return max(1, prompt - prompt // 4), prompt + prompt // 4


def _engine(model: Any, mode: str, n: int, prompt: int, new: int, device: torch.device, pkg: Any = None) -> Engine:
    """A fresh engine of ``mode`` sized for the workload; of ``pkg``'s ``Engine``, ``EngineConfig`` and
    ``make_kernel`` where given (``ab_engine.py``: another commit's ``examples/engine``)."""
    engine_cls, config_cls, kernel_of = (Engine, EngineConfig, make_kernel) if pkg is None else (
        pkg.Engine, pkg.EngineConfig, pkg.make_kernel)
    kernel, graphs, uploads, metadata = MODES[base_mode(mode)]
    sizes = tuple(s for s in (1, 2, 4, 8, 16, 32, 64, 128, 256) if s <= max(n, 1))
    blocks_per_req = -(-(_prompt_range(prompt)[1] + new) // 16)
    grad = {} if inference_mode(mode) else {"inference_mode": False}  # (an older commit's config has no such field)
    cfg = config_cls(block_size=16, num_blocks=n * blocks_per_req + 64, max_num_tokens=max(8192, n),
                     max_num_seqs=max(n, 1), max_model_len=blocks_per_req * 16, decode_sizes=sizes,
                     cuda_graphs=graphs, uploads=uploads, mamba_kernels="vllm" if device.type == "cuda" else "torch",
                     metadata=metadata, **grad)
    engine: Engine = engine_cls(model, kernel_of(kernel, model, device, cascade=False), cfg)
    return engine


def full_batch(kinds: list[str]) -> list[int]:
    """The indices of a run's full-batch decode steps (given each step's kind): its decode steps but the
    first and the last three (requests still arriving, or already finishing).

    Raises
    ------
    SystemExit
        The run has none (too few new tokens a request): a usage error that says what to raise."""
    decodes = [i for i, k in enumerate(kinds) if k == "decode"]
    if len(decodes) <= 6:
        raise SystemExit(f"the run had {len(decodes)} decode steps, and the timed ones leave out the first and the "
                         f"last three: raise --new (each request's new tokens) to 16 or more")
    return decodes[3:-3]


def _h2d_per_step(engine: Engine, reqs: list[Request]) -> float:
    from torch.profiler import ProfilerActivity, profile

    steps0 = engine.stats.steps
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.run(reqs)
        torch.cuda.synchronize()  # benchmark harness, after the run: flush the trace
    h2d = sum(1 for e in prof.events() if "Memcpy HtoD" in e.name)
    return h2d / max(engine.stats.steps - steps0, 1)


def cold_replica(engine: Engine, reqs: list[Request], cold_us: float, passes: int = 3) -> dict[str, float]:
    """The engine's decode steps of serving ``reqs``, built again through its step composer outside the
    loop and timed the ``--cold`` ways (module docstring), with the control; medians in ms."""
    engine.trace = []
    k0 = len(engine.stats.step_kinds)
    engine.run(reqs)
    trace, engine.trace = engine.trace, None
    kinds = engine.stats.step_kinds[k0:]
    decode = [trace[i] for i, k in enumerate(kinds) if k == "decode"][3:-3]
    composer = engine.composer

    def replay(specs: tuple[BatchSpec, ...], inputs: Any, arrays: dict[str, Any]) -> Any:
        first = specs[0]
        tables = [(s.block_table, s.block_size) for s in specs]

        def build() -> None:  # as Engine._step: the scheduler's arrays into the composer's counts entry
            composer.build_counts(first.num_computed_tokens, first.num_scheduled_tokens, tables,
                                  num_reqs_padded=first.num_reqs_padded, num_tokens_padded=first.num_tokens_padded,
                                  inputs=inputs, arrays=arrays)
        return build

    calls = [replay(*t) for t in decode] * passes
    ways = waits(engine.device, cold_us / 1e6)
    out: dict[str, float] = {}
    for name, pause, wait in ways:
        timed_after(calls[: len(decode)], pause, wait)  # one untimed pass: the slots' layouts
        out[f"cold_{name}_ms"] = float(np.median(timed_after(calls, pause, wait))) / 1e3
        if engine.device.type == "cuda":
            torch.cuda.synchronize(engine.device)  # harness only, between ways: drain the queue
    control = jitter(out["cold_tight_ms"] * 1e3)
    for name, pause, wait in ways:
        out[f"control_{name}_ms"] = float(np.median(timed_after([control] * len(calls), pause, wait))) / 1e3
    return out


def warm_engine(model: Any, mode: str, n: int, prompt: int, new: int, device: torch.device,
                arrive_over: int = 0) -> Engine:
    """A fresh engine of ``mode`` that has served the workload until it is in its steady state (JIT, graph
    capture, every ring slot's layouts); with ``arrive_over``, one more run whose requests arrive over
    that many steps (the mixed steps' shapes compiled; their layouts, new at nearly every such step, are
    not the point)."""
    vocab = model.config.vocab_size
    engine = _engine(model, mode, n, prompt, new, device)
    engine.run(_requests(n, prompt, new, vocab, 0))  # warm-up: JIT, graph capture, layouts
    if arrive_over:
        engine.run(_requests(n, prompt, new, vocab, 4, arrive_over=arrive_over, start=next_step(engine)))
    # More warm-up runs until every ring slot has staged a step with prompt tokens: a slot's first step
    # of a layout builds that layout's views, which is not the steady state the prefill medians report.
    ring = engine.stager.num_slots if engine.vllm is None else 1  # vLLM's buffers have no ring
    for seed in range(100, 100 + 2 * ring):
        if len({s for s, k in zip(engine.stats.step_slots, engine.stats.step_kinds, strict=True) if k == "mixed"}) == ring:
            break
        engine.run(_requests(n, prompt, new, vocab, seed))
    return engine


def timed_run(engine: Engine, n: int, prompt: int, new: int, vocab: int, seed: int,
              request: Any = Request, arrive_over: int = 0) -> dict[str, Any]:
    """One timed run of the workload (requests of ``seed``, of class ``request``, arriving over
    ``arrive_over`` steps, GC off): each step's kind, time, metadata time, fence wait, replay flag, launch
    time and time blocked on the GPU, the run's copies, plan time and waits, and the generated tokens."""
    reqs = _requests(n, prompt, new, vocab, seed, request, arrive_over, next_step(engine))
    st = engine.stats
    gc.collect()
    gc.disable()
    try:
        st0, s0 = len(st.step_times), len(st.step_kinds)
        c0, n0, w0, plan0 = st.metadata_copies, st.steps, st.token_waits, st.plan_s
        t0 = time.perf_counter()
        engine.run(reqs)
        wall = time.perf_counter() - t0
    finally:
        gc.enable()
    return {"kinds": st.step_kinds[s0:], "times": st.step_times[st0:], "metadata": st.step_metadata[s0:],
            "fence": st.step_fence[s0:], "replayed": st.step_replayed[s0:],
            # (an engine of an older commit, ab_engine.py's base, may time neither)
            "launch": getattr(st, "step_launch", [])[s0:], "wait": getattr(st, "step_wait", [])[st0:],
            "behind": getattr(st, "step_gpu_behind", [])[s0:],
            "steps": st.steps - n0,
            "copies": st.metadata_copies - c0, "plan_s": st.plan_s - plan0, "waits": st.token_waits - w0,
            "wall": wall, "tokens": [r.tokens[len(r.prompt):] for r in reqs]}


def summarize(engine: Engine, mode: str, runs: list[dict[str, Any]], n: int, prompt: int, new: int, vocab: int,
              cold_us: float | None) -> dict[str, Any]:
    """A mode's row from its timed runs (medians over each run's full-batch decode steps, then the median
    of the runs), then its audited run, its profiled run and, for attnmeta's one-copy modes with
    ``cold_us``, the cold-step replica."""

    def per_run(run: dict[str, Any]) -> dict[str, float]:
        kinds, times, md, fence = run["kinds"], run["times"], run["metadata"], run["fence"]
        idx = full_batch(kinds)
        out = {"step": statistics.median(times[i] for i in idx), "meta": statistics.median(md[i] for i in idx),
               "own": statistics.median(md[i] - fence[i] for i in idx),
               "fence": statistics.median(fence[i] for i in idx), "fenced": sum(fence[i] > 0 for i in idx),
               "replayed": sum(run["replayed"][i] for i in idx) / max(len(idx), 1), "decode_steps": len(idx),
               "launch": statistics.median(run["launch"][i] for i in idx),
               "wait": statistics.median(run["wait"][i] for i in idx),
               "behind": sum(run["behind"][i] for i in idx) / max(len(idx), 1)}
        # every step of the run, mixed ones included (a loop whose requests arrive: --arrive-over)
        out.update(all_meta=statistics.fmean(md), all_step=statistics.fmean(times), all_steps=len(md),
                   all_launch=statistics.fmean(run["launch"]) if run["launch"] else float("nan"),
                   composed=share_composed(kinds, run["replayed"]),
                   composed_decode=share_composed(kinds, run["replayed"], "decode"),
                   composed_mixed=share_composed(kinds, run["replayed"], "mixed"),
                   run_tokens_per_s=sum(len(t) for t in run["tokens"]) / run["wall"])
        pre = [i for i, k in enumerate(kinds) if k == "mixed"]
        if engine.hybrid and pre:  # the steps that carry prompt tokens
            out.update(pstep=statistics.median(times[i] for i in pre), pmeta=statistics.median(md[i] for i in pre),
                       prefill_steps=len(pre))
        return out

    rs = [per_run(r) for r in runs]

    def med(key: str) -> float:
        return statistics.median(r[key] for r in rs)

    step, meta, own = med("step"), med("meta"), med("own")
    steps = sum(r["steps"] for r in runs)
    extra: dict[str, Any] = {"fence_ms": med("fence") * 1e3, "fenced_steps": sum(r["fenced"] for r in rs),
                             "own_ms": own * 1e3, "own_share": own / step, "replayed": med("replayed"),
                             "rounds": len(runs), "step_ms_rounds": [r["step"] * 1e3 for r in rs],
                             "metadata_ms_rounds": [r["meta"] * 1e3 for r in rs],
                             "launch_ms": med("launch") * 1e3, "wait_ms": med("wait") * 1e3,
                             "gpu_behind": med("behind"),
                             "launch_ms_rounds": [r["launch"] * 1e3 for r in rs],
                             "all_metadata_ms": med("all_meta") * 1e3, "all_step_ms": med("all_step") * 1e3,
                             "all_metadata_ms_rounds": [r["all_meta"] * 1e3 for r in rs],
                             "all_steps": rs[0]["all_steps"], "composed_share": med("composed"),
                             "composed_decode_share": med("composed_decode"), "composed_mixed_share": med("composed_mixed"),
                             "all_launch_ms": med("all_launch") * 1e3,
                             "run_tokens_per_s": med("run_tokens_per_s"),
                             "run_tokens_per_s_rounds": [r["run_tokens_per_s"] for r in rs]}
    if all("pstep" in r for r in rs):
        extra.update(prefill_steps=rs[0]["prefill_steps"], prefill_step_ms=med("pstep") * 1e3,
                     prefill_metadata_ms=med("pmeta") * 1e3, prefill_share=med("pmeta") / med("pstep"))
    st = engine.stats
    w1, a0 = st.token_waits, st.steps
    with record_device_syncs(allow_async_d2h=True) as found:
        engine.run(_requests(n, prompt, new, vocab, 2))
    audited_steps = st.steps - a0
    audited_waits = st.token_waits - w1
    syncs = [e for e in found if e.kind == "sync"]
    unsafe = [e for e in found if e.kind != "sync"]
    h2d = _h2d_per_step(engine, _requests(n, prompt, new, vocab, 3)) if engine.device.type == "cuda" else float("nan")
    if cold_us is not None and MODES[base_mode(mode)][2:] == ("one-copy", "attnmeta"):
        extra.update(cold_replica(engine, _requests(n, prompt, new, vocab, 1), cold_us))
        extra["loop_over_cold"] = extra["own_ms"] / extra["cold_event_ms" if "cold_event_ms" in extra else "cold_sleep_ms"]
        extra["loop_over_thrash"] = extra["own_ms"] / extra["cold_thrash_ms"]
    return {"mode": mode, "concurrency": n, "step_ms": step * 1e3, "steps_per_s": 1 / step, "tokens_per_s": n / step,
            "metadata_ms": meta * 1e3, "share": meta / step,
            "plan_ms": sum(r["plan_s"] for r in runs) / steps * 1e3,
            "copies_per_step": sum(r["copies"] for r in runs) / steps, "h2d_per_step": h2d,
            "syncs_per_step": len(syncs) / audited_steps, "sync_ops": sorted({str(e).split(":")[0] for e in syncs})[:3],
            "other_findings_per_step": len(unsafe) / audited_steps,
            "other_findings": sorted({str(e)[:160] for e in unsafe})[:3],
            "waits_per_step": audited_waits / audited_steps, "wall_s": statistics.median(r["wall"] for r in runs),
            "steps_timed": steps, "decode_steps_timed": sum(r["decode_steps"] for r in rs),
            "waits_timed": sum(r["waits"] for r in runs), "graph_steps": st.graph_steps,
            "plan_waits": getattr(engine.kernel, "plan_waits", 0), "plans": getattr(engine.kernel, "plans", None),
            "tokens": runs[0]["tokens"], **extra}


def share_composed(kinds: list[str], replayed: list[bool], kind: str | None = None) -> float:
    """The share of a run's steps (of ``kind``, ``"decode"`` or ``"mixed"``, where given) that the step
    composer did not replay (0 where the run had none).

    >>> kinds, replayed = ["decode", "mixed", "decode", "mixed"], [True, False, False, False]
    >>> share_composed(kinds, replayed, "decode"), share_composed(kinds, replayed)
    (0.5, 0.75)
    """
    of_kind = [r for k, r in zip(kinds, replayed, strict=True) if kind is None or k == kind]
    return sum(not r for r in of_kind) / len(of_kind) if of_kind else 0.0


def paired(ours: list[float], theirs: list[float]) -> float:
    """The median over the rounds of ``theirs[k] / ours[k]`` (two modes' times of the same rounds, run back to
    back in each): a drift of the machine between rounds, which moves both runs of a round alike, cancels in
    each ratio, where it need not in the ratio of the two medians.

    >>> round(paired([26.4, 24.5, 15.4], [26.1, 21.1, 16.5]), 3)  # the ratio of medians: 21.1 / 24.5 = 0.861
    0.989
    """
    return float(statistics.median(t / o for o, t in zip(ours, theirs, strict=True)))


def measure_all(model: Any, modes: list[str], n: int, prompt: int, new: int, device: torch.device,
                cold_us: float | None, rounds: int, reverse: bool = False, arrive_over: int = 0) -> list[dict[str, Any]]:
    """Every mode at ``n`` requests in one process: a warmed engine per mode, then ``rounds`` timed runs
    alternating between the modes (A B A B ...: drift on the machine lands on every mode alike), then
    each mode's audited and profiled runs; rows in ``modes``' order. With ``reverse`` the engines are
    made, and each round's runs made, in the reverse of that order. ``arrive_over``: the timed runs'
    requests arrive over that many steps (the audited and profiled runs keep the workload's)."""
    vocab = model.config.vocab_size
    order = modes[::-1] if reverse else modes
    engines = {mode: warm_engine(model, mode, n, prompt, new, device, arrive_over) for mode in order}
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    for k in range(rounds):  # (each round its own requests, the same for every mode)
        for mode in order:
            runs[mode].append(timed_run(engines[mode], n, prompt, new, vocab, 1000 + k, arrive_over=arrive_over))
    rows = [summarize(engines[m], m, runs[m], n, prompt, new, vocab, cold_us) for m in modes]
    del engines
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def json_runs(script: str, argvs: list[list[str]], labels: list[str] | None = None) -> list[Any] | int:
    """``script`` (a path) run once per argument list of ``argvs``, one after another, each in a fresh
    Python process that writes its results with ``--json FILE``: the parsed files in order, or the exit
    status of the first run that failed (each run's output goes to this process's). ``labels``, one per
    run, are printed before each run."""
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, argv in enumerate(argvs):
            if labels is not None:
                print(labels[i], flush=True)
            path = Path(tmp) / f"run{i}.json"
            rc = subprocess.run([sys.executable, script, *argv, "--json", str(path)], check=False).returncode
            if rc != 0:
                return rc
            out.append(json.loads(path.read_text()))
    return out


def _child_args(a: argparse.Namespace, index: int = 0) -> list[str]:
    """The arguments of process ``index`` (from 0) of a ``--processes`` run: ``a``'s measurement (its
    ``--json`` is :func:`json_runs`'), the engines' order reversed in every other process unless
    ``--same-order`` (``a.reverse`` flips which)."""
    args = ["--device", a.device, "--concurrency", a.concurrency, "--modes", a.modes, "--prompt", str(a.prompt),
            "--new", str(a.new), "--model", a.model, "--rounds", str(a.rounds), "--cold-us", str(a.cold_us),
            "--arrive-over", str(a.arrive_over)]
    reverse = a.reverse != (index % 2 == 1 and not a.same_order)
    return args + (["--no-cold"] if a.no_cold else []) + (["--reverse"] if reverse else [])


def across_processes(runs: list[list[dict[str, Any]]], key: str = "paired_against") -> list[dict[str, Any]]:
    """Each pair's ratios in each process of a ``--processes`` run, and their medians over the processes.

    ``runs`` holds each process's rows (its JSON's ``rows``). ``key`` names the ratios a row keeps for
    each other mode it was compared with: ``paired_against`` (on attnmeta's row of a vLLM pair:
    ``metadata_x``, vLLM's metadata ms over attnmeta's; ``metadata_faster_x``, the same paired by round;
    ``tokens_x`` and ``tokens_per_s_x``, attnmeta's tokens/s over vLLM's, as a ratio of medians and
    paired; ``launch_x`` and ``launch_paired_x``, attnmeta's launch ms over vLLM's) or ``twins`` (on the
    first engine's row of an A/A: ``step_x``, ``metadata_x``, ``launch_x`` and their ``*_paired_x``,
    the twin's time over the first's). One entry per pair and concurrency that every
    process measured: ``pair`` (``"row's mode / other mode"``), ``concurrency``, each ratio as a list in
    process order, and ``median_<name>`` for each.

    >>> row = lambda mode, **kw: {"mode": mode, "concurrency": 64, **kw}
    >>> runs = [[row("graphs", paired_against={"vllm-graphs": {"metadata_x": 5.0, "metadata_faster_x": 4.9}}),
    ...          row("vllm-graphs")],
    ...         [row("graphs", paired_against={"vllm-graphs": {"metadata_x": 4.0, "metadata_faster_x": 4.1}}),
    ...          row("vllm-graphs")]]
    >>> s = across_processes(runs)[0]
    >>> s["pair"], s["concurrency"], s["metadata_x"], s["median_metadata_x"], s["median_metadata_faster_x"]
    ('graphs / vllm-graphs', 64, [5.0, 4.0], 4.5, 4.5)
    """
    found: dict[tuple[str, str, int], list[dict[str, float]]] = {}
    for rows in runs:
        for r in rows:
            for other, ratios in r.get(key, {}).items():
                found.setdefault((r["mode"], other, r["concurrency"]), []).append(ratios)
    out = []
    for (mode, other, n), per in found.items():
        if len(per) == len(runs):
            entry: dict[str, Any] = {"pair": f"{mode} / {other}", "concurrency": n}
            for name in per[0]:
                entry[name] = [p[name] for p in per]
                entry["median_" + name] = statistics.median(entry[name])
            out.append(entry)
    return out


def _print_across(title: str, entries: list[dict[str, Any]], columns: list[tuple[str, str]]) -> None:
    """``entries`` of :func:`across_processes` under ``title``: per column (its label, its ratio's name)
    the values per process, then their median."""
    print(f"\n{title}", flush=True)
    print(f"{'pair':>20} {'reqs':>5} " + " ".join(f"{label + ', per process':>30} {'median':>7}" for label, _ in columns),
          flush=True)
    for e in entries:
        cells = [f"{' '.join(f'{v:.3f}' for v in e[name]):>30} {e['median_' + name]:6.3f}x" for _, name in columns]
        print(f"{e['pair']:>20} {e['concurrency']:>5} " + " ".join(cells), flush=True)


def _processes(a: argparse.Namespace) -> int:
    """``--processes N``: the measurement in N fresh processes, each printing its own tables, then each
    pair's and each A/A twin's ratios per process and their medians (:func:`across_processes`);
    ``--json`` gets every process's rows and those summaries."""
    argvs = [_child_args(a, i) for i in range(a.processes)]
    runs = json_runs(str(Path(__file__).resolve()), argvs,
                     [f"== process {i + 1} of {a.processes}" + (" (engines made and timed in reverse order)"
                                                                 if "--reverse" in argv else "")
                      for i, argv in enumerate(argvs)])
    if isinstance(runs, int):
        print(f"bench_engine: a process of the {a.processes} failed (exit {runs})", file=sys.stderr)
        return runs
    pairs = across_processes([r["rows"] for r in runs])
    if pairs:
        _print_across(f"attnmeta against vLLM's code over {a.processes} processes (each process's ratio, then the "
                      "median over the processes)", pairs,
                      [("metadata faster", "metadata_x"), ("paired", "metadata_faster_x"), ("tok/s x", "tokens_x"),
                       ("launch, attnmeta/vLLM", "launch_x")])
    twins = across_processes([r["rows"] for r in runs], "twins")
    if twins:
        _print_across(f"A/A over {a.processes} processes (the twin engine's time over the first's, each process's, "
                      "then the median over the processes)", twins, [("whole step", "step_x"), ("metadata", "metadata_x"),
                                                              ("launch", "launch_x")])
    if a.json:
        Path(a.json).write_text(json.dumps({"device": runs[0]["device"], "params": runs[0]["params"],
                                            "processes": runs, "across_processes": pairs,
                                            "twins_across_processes": twins}, indent=1))
    return 0


def _print_arrivals(rows: list[dict[str, Any]], pairs: list[tuple[str, str]], concurrency: list[int],
                    arrive_over: int) -> None:
    """``--arrive-over``'s table: every step of the timed runs (mixed steps with the prompts that join the
    running decodes, and every decode step), each mode's mean metadata ms a step and the share of its
    steps the step composer composed rather than replayed, of all its steps and of its decode and its mixed
    steps apart (a decode step whose request count is new composes too); then each attnmeta / vLLM pair's
    ratio of those means (and paired, by round) and of the runs' tokens/s (every generated token over the
    run's wall time). Both modes of a pair serve the same requests through the same scheduler: the same
    steps. Each pair's ratios go into attnmeta's row (``paired_against``: ``all_metadata_x``,
    ``all_metadata_paired_x``, ``run_tokens_x``, ``run_tokens_paired_x``)."""
    print(f"\nevery step of the runs, requests arriving over {arrive_over} steps (means over the steps, medians over "
          "the rounds; composed: the steps the step composer did not replay)", flush=True)
    print(f"{'mode':>11} {'reqs':>5} {'steps':>6} {'composed':>8} {'of decode':>9} {'of mixed':>8} {'step ms':>8} "
          f"{'metadata ms':>11} {'share':>6} {'launch ms':>9} {'run tok/s':>9}", flush=True)
    for r in rows:
        composed = (f"{r['composed_share']:8.0%} {r['composed_decode_share']:9.0%} {r['composed_mixed_share']:8.0%}"
                    if MODES[base_mode(r["mode"])][3] == "attnmeta" else f"{'-':>8} {'-':>9} {'-':>8}")
        print(f"{r['mode']:>11} {r['concurrency']:>5} {r['all_steps']:>6} {composed} {r['all_step_ms']:8.3f} "
              f"{r['all_metadata_ms']:11.4f} {r['all_metadata_ms'] / r['all_step_ms']:6.1%} "
              f"{r['all_launch_ms']:9.3f} {r['run_tokens_per_s']:9.0f}", flush=True)
    if not pairs:
        return
    print(f"{'pair':>20} {'reqs':>5} {'metadata ms':>11} {'vLLM ms':>8} {'faster':>7} {'paired':>7} {'run tok/s x':>11} "
          f"{'paired':>7}", flush=True)
    by = {(r["mode"], r["concurrency"]): r for r in rows}
    for x, y in pairs:
        for n in concurrency:
            r, v = by[(x, n)], by[(y, n)]
            ratios = {"all_metadata_x": v["all_metadata_ms"] / r["all_metadata_ms"],
                      "all_metadata_paired_x": paired(r["all_metadata_ms_rounds"], v["all_metadata_ms_rounds"]),
                      "run_tokens_x": r["run_tokens_per_s"] / v["run_tokens_per_s"],
                      "run_tokens_paired_x": paired(v["run_tokens_per_s_rounds"], r["run_tokens_per_s_rounds"])}
            print(f"{x + ' / ' + y:>20} {n:>5} {r['all_metadata_ms']:11.4f} {v['all_metadata_ms']:8.4f} "
                  f"{ratios['all_metadata_x']:6.1f}x {ratios['all_metadata_paired_x']:6.1f}x "
                  f"{ratios['run_tokens_x']:10.2f}x {ratios['run_tokens_paired_x']:6.2f}x", flush=True)
            r.setdefault("paired_against", {}).setdefault(y, {}).update(ratios)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", type=device_arg, default="cuda")
    p.add_argument("--concurrency", default="1,64,256")
    p.add_argument("--modes", default="graphs,eager,per-tensor")
    p.add_argument("--prompt", type=int, default=64,
                   help="prompt length, give or take a quarter (default 64: prompts of 48 to 80 tokens)")
    p.add_argument("--new", type=int, default=96)
    p.add_argument("--model", choices=list(MODELS), default="1b")
    p.add_argument("--json", default=None)
    p.add_argument("--rounds", type=int, default=3,
                   help="timed runs per mode, alternating between the modes (default 3; rows are their medians)")
    p.add_argument("--no-cold", action="store_true", help="skip the cold-step replica (module docstring)")
    p.add_argument("--cold-us", type=float, default=2000.0, metavar="US",
                   help="the replica's GPU work before the event wait, and its sleep (default 2000)")
    p.add_argument("--processes", type=int, default=1, metavar="N",
                   help="run the whole measurement in N fresh processes, one after another, and summarize each "
                        "pair's ratios over them (default 1; module docstring)")
    p.add_argument("--reverse", action="store_true",
                   help="make the engines, and run each round, in the reverse of --modes' order (rows keep it)")
    p.add_argument("--arrive-over", type=int, default=0, metavar="STEPS",
                   help="the timed runs' requests arrive over their first STEPS steps, so prompts join running "
                        "decodes in mixed steps; adds a table of every step's metadata time (default 0: all at once)")
    p.add_argument("--same-order", action="store_true",
                   help="with --processes: every process in one order (default: every other process reversed)")
    a = p.parse_args(argv)
    if a.processes < 1:
        p.error("--processes: at least 1")
    if a.processes > 1:
        return _processes(a)
    device = torch.device(a.device)
    no_cuda = cpu_error(a.modes.split(",")) if device.type != "cuda" else None
    if no_cuda:
        print(f"bench_engine: {no_cuda}", file=sys.stderr)
        return 2
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    config = MODELS[a.model]()
    hybrid = is_hybrid(config)
    model = make_model(config, device, torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    kernels = "vLLM kernels" if device.type == "cuda" else "torch"
    print(f"model: {f'Bamba (Mamba2 layers: {kernels})' if hybrid else 'Llama'} {params / 1e9:.2f}B params, bf16, "
          f"{device_name}; prompts of {'-'.join(map(str, _prompt_range(a.prompt)))} tokens, {a.new} new tokens per "
          f"request, new requests every run", flush=True)
    modes = "eager" if hybrid and a.modes == p.get_default("modes") else a.modes
    if len(set(modes.split(","))) != len(modes.split(",")):
        print(f"bench_engine: a mode named twice in {modes!r}: name a second engine of a mode as MODE#2", file=sys.stderr)
        return 2
    error = modes_error(modes.split(","), hybrid)
    if error:
        print(f"bench_engine: {error}", file=sys.stderr)
        return 2
    order = modes.split(",")[::-1] if a.reverse else modes.split(",")
    print(f"engines made, and each round run, in the order {','.join(order)}", flush=True)
    rows = []
    print(f"{'mode':>11} {'reqs':>5} {'step ms':>8} {'steps/s':>8} {'tok/s':>8} {'metadata ms':>11} {'share':>6} "
          f"{'fence ms':>8} {'own ms':>7} {'own %':>6} {'replay':>6} {'plan ms':>8} {'copies':>6} {'H2D':>5} "
          f"{'syncs':>5} {'waits':>5} {'launch ms':>9} {'wait ms':>7} {'behind':>6}", flush=True)
    colds = []
    for n in [int(x) for x in a.concurrency.split(",")]:
        for r in measure_all(model, modes.split(","), n, a.prompt, a.new, device, None if a.no_cold else a.cold_us,
                             a.rounds, a.reverse, a.arrive_over):
            mode = r["mode"]
            rows.append(r)
            print(f"{mode:>11} {n:>5} {r['step_ms']:8.3f} {r['steps_per_s']:8.1f} {r['tokens_per_s']:8.0f} "
                  f"{r['metadata_ms']:11.4f} {r['share']:6.1%} {r['fence_ms']:8.4f} {r['own_ms']:7.4f} "
                  f"{r['own_share']:6.1%} {r['replayed']:6.0%} {r['plan_ms']:8.3f} {r['copies_per_step']:6.2f} "
                  f"{r['h2d_per_step']:5.1f} {r['syncs_per_step']:5.2f} {r['waits_per_step']:5.2f} "
                  f"{r['launch_ms']:9.3f} {r['wait_ms']:7.3f} {r['gpu_behind']:6.0%}"
                  + (f"  sync ops: {r['sync_ops']}" if r["sync_ops"] else "")
                  + (f"  other audit findings/step {r['other_findings_per_step']:.2f}: {r['other_findings']}"
                     if r["other_findings"] else ""), flush=True)
            if hybrid and r.get("prefill_steps"):
                print(f"{'prefill':>11} {n:>5} {r['prefill_step_ms']:8.3f} {'':>8} {'':>8} {r['prefill_metadata_ms']:11.4f} "
                      f"{r['prefill_share']:6.1%}  ({r['prefill_steps']} steps)", flush=True)
            if "cold_tight_ms" in r:
                colds.append(r)
    if colds:
        ev = "event" if "cold_event_ms" in colds[0] else "sleep"
        print(f"\ncold-step replica of the same composition (ms; loop/cold = own ms / {ev}; control: plain Python "
              f"work of the replica's tight time, the same waits)", flush=True)
        print(f"{'mode':>10} {'reqs':>5} {'own ms':>7} {'tight':>7} {'event':>7} {'sleep':>7} {'thrash':>7} "
              f"{'loop/cold':>9} {'loop/thrash':>11} {'ctl tight':>9} {'ctl event':>9} {'ctl sleep':>9} "
              f"{'ctl thrash':>10} {'ctl ev/tight':>12}", flush=True)
        for r in colds:
            print(f"{r['mode']:>10} {r['concurrency']:>5} {r['own_ms']:7.4f} {r['cold_tight_ms']:7.4f} "
                  f"{r.get('cold_event_ms', float('nan')):7.4f} {r['cold_sleep_ms']:7.4f} {r['cold_thrash_ms']:7.4f} "
                  f"{r['loop_over_cold']:8.2f}x {r['loop_over_thrash']:10.2f}x "
                  f"{r['control_tight_ms']:9.4f} {r.get('control_event_ms', float('nan')):9.4f} "
                  f"{r['control_sleep_ms']:9.4f} {r['control_thrash_ms']:10.4f} "
                  f"{r.get('control_event_ms', r['control_sleep_ms']) / r['control_tight_ms']:11.2f}x", flush=True)
    listed = modes.split(",")
    pairs = [(x + g, y + g) for x, y in PAIRS for g in ("", GRAD) if x + g in listed and y + g in listed]
    if pairs:
        print("\nattnmeta against vLLM 0.33.0's own metadata code, the same engine, model and kernels (ratios of "
              "medians; paired: the median over the rounds of each round's ratio, the two modes' runs of a round "
              "back to back; metadata: host ms per decode step without plan())", flush=True)
        plans = sorted({str(r["plans"]) for r in rows if r.get("plans")})
        if plans:  # (vllm: attnmeta's FlashInfer kernel plans the wrappers vLLM's builder plans: the same kernels)
            print(f"attnmeta's FlashInfer kernel plans: {', '.join(plans)} (examples/engine/kernels.py, PLANS)", flush=True)
        print(f"{'pair':>20} {'reqs':>5} {'tok/s':>9} {'vLLM tok/s':>10} {'tok/s x':>8} {'paired':>7} {'metadata ms':>11} "
              f"{'vLLM ms':>8} {'faster':>7} {'paired':>7} {'plan ms':>7} {'vLLM plan':>9} {'host x':>7} {'syncs':>5} "
              f"{'vLLM syncs':>10} {'H2D':>5} {'vLLM H2D':>8} {'tokens differ':>13} {'launch x':>8}", flush=True)
        by = {(r["mode"], r["concurrency"]): r for r in rows}
        for x, y in pairs:
            for n in [int(c) for c in a.concurrency.split(",")]:
                r, v = by[(x, n)], by[(y, n)]
                host = (v["metadata_ms"] + v["plan_ms"]) / (r["metadata_ms"] + r["plan_ms"])
                differ = sum(t != u for t, u in zip(r["tokens"], v["tokens"], strict=True))
                tok_paired = paired(r["step_ms_rounds"], v["step_ms_rounds"])  # (tok/s is n / step time)
                meta_paired = paired(r["metadata_ms_rounds"], v["metadata_ms_rounds"])
                print(f"{x + ' / ' + y:>20} {n:>5} {r['tokens_per_s']:9.0f} {v['tokens_per_s']:10.0f} "
                      f"{r['tokens_per_s'] / v['tokens_per_s']:7.2f}x {tok_paired:6.2f}x {r['metadata_ms']:11.4f} "
                      f"{v['metadata_ms']:8.4f} {v['metadata_ms'] / r['metadata_ms']:6.1f}x {meta_paired:6.1f}x "
                      f"{r['plan_ms']:7.3f} {v['plan_ms']:9.3f} "
                      f"{host:6.1f}x {r['syncs_per_step']:5.2f} {v['syncs_per_step']:10.2f} {r['h2d_per_step']:5.1f} "
                      f"{v['h2d_per_step']:8.1f} {differ:>6} of {n:<5} {r['launch_ms'] / v['launch_ms']:7.3f}x",
                      flush=True)
                r.setdefault("requests_with_other_tokens_than", {})[y] = differ
                r.setdefault("paired_against", {})[y] = {
                    "metadata_x": v["metadata_ms"] / r["metadata_ms"], "metadata_faster_x": meta_paired,
                    "tokens_x": r["tokens_per_s"] / v["tokens_per_s"], "tokens_per_s_x": tok_paired,
                    "launch_x": r["launch_ms"] / v["launch_ms"],
                    "launch_paired_x": paired(v["launch_ms_rounds"], r["launch_ms_rounds"])}
    if a.arrive_over:
        _print_arrivals(rows, pairs, [int(c) for c in a.concurrency.split(",")], a.arrive_over)
    for kind, title, variants in (
            ("twins", "A/A: a second engine of the same mode in this process against the first (the twin's time over "
             "the first's", [(m.partition("#")[0], m) for m in listed if "#" in m and m.partition("#")[0] in listed]),
            ("grad", f"Inference mode: each {GRAD} engine, its loop outside torch.inference_mode(), against the same "
             "mode inside it (the " + GRAD + " engine's time over the other's",
             [(m.removesuffix(GRAD), m) for m in listed if m.endswith(GRAD) and m.removesuffix(GRAD) in listed])):
        if not variants:
            continue
        print(f"\n{title}: the whole step, the metadata and the launches; paired: by round)", flush=True)
        print(f"{'engines':>20} {'reqs':>5} {'step ms':>8} {'other':>8} {'ratio':>7} {'paired':>7} {'metadata ms':>11} "
              f"{'other':>8} {'ratio':>7} {'paired':>7} {'tokens differ':>13} {'launch ms':>9} {'other':>7} {'ratio':>7}",
              flush=True)
        by = {(r["mode"], r["concurrency"]): r for r in rows}
        for x, y in variants:
            for n in [int(c) for c in a.concurrency.split(",")]:
                r, v = by[(x, n)], by[(y, n)]
                differ = sum(t != u for t, u in zip(r["tokens"], v["tokens"], strict=True))
                rel = {"step_x": v["step_ms"] / r["step_ms"], "step_paired_x": paired(r["step_ms_rounds"], v["step_ms_rounds"]),
                        "metadata_x": v["metadata_ms"] / r["metadata_ms"],
                        "metadata_paired_x": paired(r["metadata_ms_rounds"], v["metadata_ms_rounds"]),
                        "launch_x": v["launch_ms"] / r["launch_ms"],
                        "launch_paired_x": paired(r["launch_ms_rounds"], v["launch_ms_rounds"])}
                print(f"{x + ' / ' + y:>20} {n:>5} {r['step_ms']:8.3f} {v['step_ms']:8.3f} {rel['step_x']:6.3f}x "
                      f"{rel['step_paired_x']:6.3f}x {r['metadata_ms']:11.4f} {v['metadata_ms']:8.4f} "
                      f"{rel['metadata_x']:6.3f}x {rel['metadata_paired_x']:6.3f}x {differ:>6} of {n:<5} "
                      f"{r['launch_ms']:9.3f} {v['launch_ms']:7.3f} {rel['launch_x']:6.3f}x", flush=True)
                r.setdefault("requests_with_other_tokens_than", {})[y] = differ
                r.setdefault(kind, {})[y] = rel
    for r in rows:
        del r["tokens"]  # compared above; not written to the JSON
    if a.json:
        Path(a.json).write_text(json.dumps({"device": device_name, "params": params, "order": order,
                                            "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
