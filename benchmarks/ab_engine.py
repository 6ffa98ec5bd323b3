"""A/B of the engine's loop in one process: this checkout's attnmeta against another commit's, in the
reference engine (examples/engine), serving the same requests, rounds alternating.

``ab_commit.py`` times the step composer outside a loop (back to back, or after a synthetic cache
thrash, on a synthetic decode walk). This times what a change is for: attnmeta's part of each step
inside an engine's loop, where the scheduler, the kernel's ``plan()`` and the model's launches run
between two steps, and where each run serves new requests (so the step shapes, page counts included,
are those of a serving loop, not of a walk). Both packages run in the same process on the same model,
each with its own engine (its own copy of ``examples/engine``, importing its own attnmeta); each round
serves one set of new requests on both engines, back to back, their order alternating from round to
round.

For each concurrency the table gives, per side, the median over the rounds of each run's median
attnmeta time over its full-batch decode steps (the engine's ``metadata`` time, as
``bench_engine.py``'s ``metadata ms``), the ratio of the two medians (this / base) and ``paired``: the
median over the rounds of each round's ratio (a drift of the machine between rounds cancels in it);
also the step time of each side, and the requests whose tokens differ between the sides (0: the same
kernels and model read either side's metadata).

The other commit's package comes from ``ab_commit.base_package``; its engine from the same commit's
``examples/engine`` (imported as ``engine_base``, every attnmeta import renamed). On a machine without
the checkout's history, export both first and pass the folder:
``git archive BASE attnmeta examples/engine | tar -x -C FOLDER``.

Usage: python benchmarks/ab_engine.py BASE [--device cuda] [--model 1b|hybrid-1b|tiny]
[--mode graphs|eager|paged] [--concurrency 64,256] [--rounds 8] [--prompt 64] [--new 96] [--warm 3]
"""

from __future__ import annotations

import argparse
import gc
import importlib
import io
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from ab_commit import base_package  # noqa: E402  (benchmarks/ab_commit.py)
from bench_engine import MODES, _prompt_range  # noqa: E402  (benchmarks/bench_engine.py)

import examples.engine as engine_this  # noqa: E402
from examples.engine.workload import config_1b, config_hybrid_1b, make_model, tiny_config  # noqa: E402


def base_engine(commit: str, into: Path) -> Any:
    """``commit``'s ``examples/engine``, imported as the package ``engine_base`` (from a copy under
    ``into``) with its attnmeta imports renamed to ``attnmeta_base`` (:func:`ab_commit.base_package`
    imports that package). ``commit`` is a commit of this checkout, or a folder holding
    ``examples/engine`` exported from one."""
    exported = Path(commit) / "examples" / "engine"
    dst = into / "engine_base"
    if (exported / "__init__.py").is_file():
        shutil.copytree(exported, dst)
    else:
        data = subprocess.run(["git", "-C", str(ROOT), "archive", commit, "examples/engine"], capture_output=True,
                              check=True).stdout
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            tar.extractall(into / "_export", filter="data")
        (into / "_export" / "examples" / "engine").rename(dst)
    for f in dst.rglob("*.py"):
        text = f.read_text()
        text = re.sub(r"\battnmeta\.", "attnmeta_base.", text)
        text = re.sub(r"^(\s*)(import|from) attnmeta\b", r"\1\2 attnmeta_base", text, flags=re.M)
        text = re.sub(r"\bexamples\.engine\b", "engine_base", text)
        f.write_text(text)
    if str(into) not in sys.path:
        sys.path.insert(0, str(into))
    pkg = importlib.import_module("engine_base")
    composer = importlib.import_module("engine_base.engine").StepBuilder
    if not composer.__module__.startswith("attnmeta_base."):  # (else the A/B would time this checkout twice)
        raise RuntimeError(f"ab_engine: the base engine's step composer comes from {composer.__module__}, "
                           "not attnmeta_base")
    return pkg


def make_engine(pkg: Any, model: Any, mode: str, n: int, prompt: int, new: int, device: torch.device) -> Any:
    """An engine of package ``pkg`` (``examples.engine`` or ``engine_base``) configured as
    ``bench_engine.py``'s for ``mode`` at ``n`` requests."""
    kernel, graphs, uploads, metadata = MODES[mode]
    sizes = tuple(s for s in (1, 2, 4, 8, 16, 32, 64, 128, 256) if s <= max(n, 1))
    blocks_per_req = -(-(_prompt_range(prompt)[1] + new) // 16)
    cfg = pkg.EngineConfig(block_size=16, num_blocks=n * blocks_per_req + 64, max_num_tokens=max(8192, n),
                           max_num_seqs=max(n, 1), max_model_len=blocks_per_req * 16, decode_sizes=sizes,
                           cuda_graphs=graphs, uploads=uploads, metadata=metadata,
                           mamba_kernels="vllm" if device.type == "cuda" else "torch")
    return pkg.Engine(model, pkg.make_kernel(kernel, model, device, cascade=False), cfg)


def requests(pkg: Any, n: int, prompt: int, new: int, vocab: int, seed: int) -> list[Any]:
    """``bench_engine.py``'s workload of ``seed`` (``n`` requests, prompts of ``prompt`` tokens give or take
    a quarter, ``new`` tokens each) as ``pkg``'s own ``Request`` objects."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = _prompt_range(prompt)
    lengths = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [pkg.Request(i, torch.randint(1, vocab, (k,), generator=g).tolist(), new) for i, k in enumerate(lengths)]


def serve(engine: Any, reqs: list[Any]) -> tuple[float, float, list[list[int]]]:
    """Serve ``reqs`` (garbage collection off): the median attnmeta time and step time (seconds) over
    the run's full-batch decode steps, and the tokens each request generated."""
    st = engine.stats
    s0 = len(st.step_kinds)
    gc.collect()
    gc.disable()
    try:
        engine.run(reqs)
    finally:
        gc.enable()
    kinds, md, times = st.step_kinds[s0:], st.step_metadata[s0:], st.step_times[s0:]
    idx = [i for i, k in enumerate(kinds) if k == "decode"][3:-3]  # full batch: not the first few, not the tail
    if not idx:
        raise RuntimeError("ab_engine: the run had no full-batch decode steps (raise --new)")
    return (statistics.median(md[i] for i in idx), statistics.median(times[i] for i in idx),
            [r.tokens[len(r.prompt):] for r in reqs])


def ab(sides: dict[str, Any], model: Any, mode: str, n: int, prompt: int, new: int, device: torch.device,
       rounds: int, warm: int = 3) -> dict[str, Any]:
    """Both sides' engines at ``n`` requests, warmed by ``warm`` runs, then ``rounds`` rounds, each serving
    new requests on both (order alternating). Returns each side's per-round medians (ms) and the
    requests whose tokens differed in any round."""
    vocab = model.config.vocab_size
    engines = {name: make_engine(pkg, model, mode, n, prompt, new, device) for name, pkg in sides.items()}
    for name, eng in engines.items():
        for seed in range(warm):
            eng.run(requests(sides[name], n, prompt, new, vocab, seed))
    meta: dict[str, list[float]] = {name: [] for name in sides}
    step: dict[str, list[float]] = {name: [] for name in sides}
    differ = 0
    names = list(sides)
    for k in range(rounds):
        tokens = {}
        for name in (names if k % 2 == 0 else names[::-1]):
            m, s, tokens[name] = serve(engines[name], requests(sides[name], n, prompt, new, vocab, 1000 + k))
            meta[name].append(m * 1e3)
            step[name].append(s * 1e3)
        differ += sum(a != b for a, b in zip(tokens[names[0]], tokens[names[1]], strict=True))
    del engines
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"metadata_ms": meta, "step_ms": step, "tokens_differ": differ}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("base", help="the commit to compare with, or a folder holding its exported attnmeta and "
                                "examples/engine (git archive BASE attnmeta examples/engine | tar -x -C FOLDER)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", choices=["1b", "hybrid-1b", "tiny"], default="1b")
    p.add_argument("--mode", choices=["graphs", "eager", "paged"], default="graphs",
                   help="the engine's mode (bench_engine.py's modes of attnmeta; on a CPU: paged)")
    p.add_argument("--concurrency", default="64,256")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new", type=int, default=96)
    p.add_argument("--warm", type=int, default=3, help="untimed runs of each engine before the rounds")
    a = p.parse_args(argv)
    device = torch.device(a.device)
    if device.type != "cuda" and a.mode != "paged":
        print("ab_engine: on a CPU only --mode paged runs (torch's paged kernel)", file=sys.stderr)
        return 2
    if a.model == "hybrid-1b" and a.mode == "graphs":
        print("ab_engine: a hybrid model runs eager steps (--mode eager or paged)", file=sys.stderr)
        return 2
    config = {"1b": config_1b, "hybrid-1b": config_hybrid_1b, "tiny": tiny_config}[a.model]()
    model = make_model(config, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    with tempfile.TemporaryDirectory(prefix="attnmeta-ab-engine-") as tmp:
        base_package(a.base, Path(tmp))
        sides = {"base": base_engine(a.base, Path(tmp)), "this": engine_this}
        print(f"# {device.type}, torch {torch.__version__}, base {a.base}, model {a.model}, mode {a.mode}, "
              f"{a.rounds} rounds of new requests (prompts {'-'.join(map(str, _prompt_range(a.prompt)))}, "
              f"{a.new} new tokens); medians over rounds of each run's median over its full-batch decode steps (ms)",
              flush=True)
        print(f"{'reqs':>5} {'base ms':>8} {'this ms':>8} {'this/base':>9} {'paired':>7} {'base step':>9} "
              f"{'this step':>9} {'tokens differ':>13}", flush=True)
        for n in [int(x) for x in a.concurrency.split(",")]:
            r = ab(sides, model, a.mode, n, a.prompt, a.new, device, a.rounds, a.warm)
            mb, mt = r["metadata_ms"]["base"], r["metadata_ms"]["this"]
            paired = statistics.median(t / b for b, t in zip(mb, mt, strict=True))
            print(f"{n:>5} {statistics.median(mb):8.4f} {statistics.median(mt):8.4f} "
                  f"{statistics.median(mt) / statistics.median(mb):9.3f} {paired:7.3f} "
                  f"{statistics.median(r['step_ms']['base']):9.3f} {statistics.median(r['step_ms']['this']):9.3f} "
                  f"{r['tokens_differ']:>13}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
