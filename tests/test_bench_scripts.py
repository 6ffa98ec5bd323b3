"""The benchmark scripts run end to end on the CPU, with tiny settings, and print every row.

docs/benchmarks.md quotes these scripts' output; a script that no longer runs (an API it calls
changed, a row it drops) fails here rather than on the GPU machine. Timings are never asserted
(performance lives in benchmarks, not tests): only that each row is there with positive numbers.
(bench_mamba2.py joins them when its scenarios move into attnmeta.bench.)
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from attnmeta.__main__ import main

ROOT = Path(__file__).resolve().parents[1]
BATCHES = (1, 64, 256, 1024)


def _script(script: str, *args: str) -> str:
    """Run ``benchmarks/<script>``; its standard output."""
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], capture_output=True,
                          text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _bench_engine(name: str) -> Any:
    """``benchmarks/bench_engine.py`` imported as module ``name`` (its own imports resolved from benchmarks/)."""
    import importlib.util

    spec_ = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / "bench_engine.py")
    assert spec_ is not None and spec_.loader is not None
    mod = importlib.util.module_from_spec(spec_)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        spec_.loader.exec_module(mod)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return mod


def _run(script: str, *args: str) -> list[list[str]]:
    """Run ``benchmarks/<script>`` and return its table rows (lines that start with a batch size)."""
    out = _script(script, *args)
    return [line.split() for line in out.splitlines() if line.split() and line.split()[0].isdigit()]


def test_bench_decode_prints_every_path_at_every_batch_size() -> None:
    paths = ("fused", "fused+spec", "floor", "jitter")
    rows = _run("bench_decode.py", "--device", "cpu", "--rounds", "1", "--steps", "8", "--warm", "1",
                "--paths", ",".join(paths))
    assert [(int(r[0]), r[1]) for r in rows] == [(b, p) for b in BATCHES for p in paths]
    for r in rows:  # median, best round, p99, p99/med
        assert all(float(x) > 0 for x in r[2:6]), r
    targets = {int(r[0]): r[6] for r in rows if r[1] == "fused" and len(r) > 6}
    assert targets == {1: "25.0", 256: "50.0", 1024: "150.0"}  # the limits; floor and jitter have none
    assert all(len(r) == 6 for r in rows if r[1] in ("floor", "jitter"))


def test_bench_spec_prints_every_batch_size() -> None:
    rows = _run("bench_spec.py", "--rounds", "1", "--steps", "3")
    assert [int(r[0]) for r in rows] == [1, 8, 64, 256, 1024]
    assert all(float(r[1]) > 0 and float(r[2]) > 0 for r in rows)


def test_bench_cold_start_prints_every_first_build_cold_and_warmed() -> None:
    out = _script("bench_cold_start.py", "--quick")
    lines = out.splitlines()
    head = lines.index(next(line for line in lines if line.startswith("first build (s)")))
    rows = [line.rsplit(None, 2) for line in lines[head + 1:] if not line.startswith("python -m attnmeta warmup")]
    assert [r[0].strip() for r in rows] == ["import attnmeta", "BatchSpec", "flash_attn", "fused (4 builds)",
                                            "all first builds"]
    assert all(float(r[1]) > 0 and float(r[2]) > 0 for r in rows), rows
    assert re.fullmatch(r"python -m attnmeta warmup: [\d.]+ s on an empty cache \(after the cold run\), "
                        r"[\d.]+ s on the warmed one \(process wall time\)", lines[-1]), lines[-1]


def test_report_turns_bench_json_into_the_docs_table(tmp_path: Path) -> None:
    data = tmp_path / "bench.json"
    assert main(["bench", "--quick", "--reps", "2", "--no-progress", "--device", "cpu", "--scenario", "staging",
                 "--scenario", "spec-decode-k3", "--scenario", "builder:flash_attn", "--json", str(data)]) == 0
    out = _script("report.py", str(data))
    assert out.startswith("device: cpu (cpu), torch ")
    table = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| ")]
    assert [c.strip() for c in table[0][:3]] == ["scenario", "batch", "attnmeta median / p99 us"]
    rows = {(c[0].strip(), int(c[1])): [x.strip() for x in c] for c in table[1:]}
    assert set(rows) == {("staging-8-arrays", 8), ("spec-decode-k3", 8), ("spec-decode-k3", 64),
                         ("builder:flash_attn", 4), ("builder:flash_attn", 32)}
    staging, spec = rows[("staging-8-arrays", 8)], rows[("spec-decode-k3", 64)]
    assert staging[3] == "-" and spec[3] != "-"  # the fused column: spec decode has the path
    assert staging[6].endswith("x") and staging[7].endswith("x")  # per-tensor and reference over attnmeta
    assert staging[8] == "0, 0, 8" and staging[9] == "1, 8, 8"  # syncs, copies: attnmeta, per-tensor, ref
    fa = rows[("builder:flash_attn", 4)]  # attnmeta and its reference only; the reference's counts are
    assert fa[4] == "-" and fa[6] == "-" and fa[7].endswith("x") and fa[8] == "0, -, -"  # CUDA-only
    ratios = _script("report.py", str(data), "--ratios")
    lines = [line.split("|")[1:-1] for line in ratios.splitlines() if line.startswith("| ")]
    assert "median" not in "".join(lines[0]) and " us" not in "".join(lines[0])  # no absolute times
    by = {(c[0].strip(), int(c[1])): [x.strip() for x in c] for c in lines[1:]}
    assert set(by) == set(rows)
    spec = by[("spec-decode-k3", 64)]  # reference / attnmeta, per-tensor / attnmeta, attnmeta / fused
    assert all(x.endswith("x") for x in spec[2:5]) and spec[5] == "0, 0, 0, 5" and spec[6] == "1, 1, 8, 3"


def test_ab_commit_compares_a_commit_with_this_checkout() -> None:
    """The A/B against another commit (here HEAD itself: any clone has it) prints every path, with a ratio."""
    rows = _run("ab_commit.py", "HEAD", "--device", "cpu", "--rounds", "1", "--steps", "5", "--batches", "1")
    names = [" ".join(r[1:-3]) for r in rows if r and r[0] == "1"]
    assert names == ["fused", "fused+spec", "composable", "engine graphs", "engine hybrid", "lifetimes on/off"], rows
    assert all(float(r[-1]) > 0 for r in rows if r and r[0] == "1")  # (--paths: the cold test below)


def test_bench_decode_cold_times_every_way_after_its_wait() -> None:
    """``--cold``: each path back to back, after a sleep and after a cache thrash (the event way is CUDA's)."""
    rows = _run("bench_decode.py", "--device", "cpu", "--rounds", "1", "--steps", "4", "--warm", "1", "--cold",
                "--cold-us", "100", "--paths", "fused")
    assert [(int(r[0]), r[1]) for r in rows] == [(b, f"fused@{w}") for b in BATCHES for w in ("tight", "sleep", "thrash")]
    assert all(float(x) > 0 for r in rows for x in r[2:5]), rows


def test_ab_commit_cold_times_each_step_after_a_thrash() -> None:
    """``--cold``, here with ``--walk`` and ``--paths``: each step timed after a cache thrash, the engine rows
    on one walk, only the rows named."""
    out = _script("ab_commit.py", "HEAD", "--device", "cpu", "--rounds", "1", "--steps", "3", "--batches", "1",
                  "--paths", "engine hybrid,engine graphs", "--cold", "--walk", "--mean")
    head = out.splitlines()[0]
    assert "each after a cache thrash" in head and "one walk, no step repeated" in head and "per-round means" in head, out
    rows = [line.split() for line in out.splitlines() if line.split() and line.split()[0] == "1"]
    assert [" ".join(r[1:-3]) for r in rows] == ["engine graphs", "engine hybrid"], rows
    assert all(float(r[-1]) > 0 for r in rows), rows


def test_ab_commit_rounds_take_the_median_or_the_mean() -> None:
    """``ab()`` on a fake clock: side ``b`` takes 1 us a step but every fifth step 21 us (a step that composes
    a new layout): the per-round median leaves those out, ``mean=True`` counts them (5 us a step)."""
    import importlib.util

    import torch

    spec_ = importlib.util.spec_from_file_location("ab_commit_mean", ROOT / "benchmarks" / "ab_commit.py")
    assert spec_ is not None and spec_.loader is not None
    mod = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(mod)
    now = [0]
    calls = [0]

    class Clock:
        @staticmethod
        def perf_counter_ns() -> int:
            return now[0]

    def a() -> None:
        now[0] += 2000

    def b() -> None:
        calls[0] += 1
        now[0] += 21000 if calls[0] % 5 == 0 else 1000

    mod.time = Clock  # (ab() reads only time.perf_counter_ns)
    cpu = torch.device("cpu")
    assert mod.ab(a, b, 2, 10, cpu) == (2.0, 1.0)
    assert mod.ab(a, b, 2, 10, cpu, mean=True) == (2.0, 5.0)


def test_ab_commit_walk_never_repeats_an_engine_step() -> None:
    """``--walk`` (run by the cold test above): the engine rows walk one decode walk (each step's counts new,
    the walk as long as the run needs); ``_Walk`` hands out no step twice, and without it the 64-step cycle."""
    import importlib.util

    import numpy as np
    import pytest

    from attnmeta.testing.workloads import advance, decode_spec

    spec_ = importlib.util.spec_from_file_location("ab_commit_walk", ROOT / "benchmarks" / "ab_commit.py")
    assert spec_ is not None and spec_.loader is not None
    mod = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(mod)
    raws = [dict(num_computed_tokens=s.num_computed_tokens, num_scheduled_tokens=s.num_scheduled_tokens)
            for s in advance(decode_spec(4, np.random.default_rng(0)), 64)]
    walk = mod._Walk(raws, 200)
    seen = {tuple(walk.counts(i)[0].tolist()) for i in range(200)}
    assert len(seen) == 200 and walk.longest() == int((raws[0]["num_computed_tokens"] + 1).max()) + 63 + 200
    cycle = mod._Walk(raws, 0)
    assert len({tuple(cycle.counts(i)[0].tolist()) for i in range(200)}) == 64
    with pytest.raises(RuntimeError, match="the walk has 200 steps"):
        walk.counts(200)
    assert mod.calls_per_side(2, 10) == 30 + 2 * (10 + 10)  # (ab()'s warm-ups: 3 * steps, then steps a round)


def test_bench_engine_cold_replica_reports_every_way(tmp_path: Path) -> None:
    """The engine's cold-step replica: its decode steps rebuilt outside the loop, timed back to back, after a
    sleep and after a cache thrash, with the control and the loop's ratios (CPU: torch's paged kernel)."""
    import json

    out = tmp_path / "bench.json"
    text = _script("bench_engine.py", "--device", "cpu", "--model", "tiny", "--modes", "paged", "--concurrency", "3",
                   "--prompt", "8", "--new", "12", "--rounds", "1", "--cold-us", "100", "--json", str(out))
    assert "loop/thrash" in text, text
    row = json.loads(out.read_text())["rows"][0]
    for k in ("cold_tight_ms", "cold_sleep_ms", "cold_thrash_ms", "control_tight_ms", "control_sleep_ms",
              "control_thrash_ms", "loop_over_cold", "loop_over_thrash"):
        assert row[k] > 0, (k, row)
    assert "cold_event_ms" not in row  # (CUDA only)


def test_bench_engine_pairs_the_rounds() -> None:
    """The headline summary's ``paired`` ratio: the median of the rounds' own ratios (its docstring's
    example, a drifting host's rounds, runs here too), which a drift between rounds does not move."""
    import doctest

    mod = _bench_engine("bench_engine_paired")
    runner = doctest.DocTestRunner()
    for test in doctest.DocTestFinder().find(mod.paired, "paired", globs={"paired": mod.paired}):
        runner.run(test)
    assert runner.summarize(verbose=False) == (0, 1)
    ours, theirs = [2.0, 4.0, 1.0], [3.0, 6.0, 1.5]  # every round 1.5x, the host twice as fast in round 3
    assert mod.paired(ours, theirs) == 1.5 == mod.paired([x * 3 for x in ours], [x * 3 for x in theirs])
    assert mod.paired([1.0, 2.0], [2.0, 3.0]) == 1.75  # (an even count: the mean of the middle two)


def test_bench_engine_timed_runs_make_steps_no_earlier_run_made() -> None:
    """Each timed round of bench_engine.py serves new requests (the same for every mode of the round), so
    its decode steps are, but for a few met by chance, not steps an earlier run made: a run that repeated
    the warm-up's requests would repeat its steps' exact shapes, which a serving loop, whose longest
    sequence grows every step, never does."""
    import torch

    from examples.engine.workload import make_model, tiny_config

    mod = _bench_engine("bench_engine_runs")

    model = make_model(tiny_config())
    vocab = model.config.vocab_size
    n, prompt, new = 16, 64, 8
    assert [r.prompt for r in mod._requests(n, prompt, new, vocab, 1000)] == [
        r.prompt for r in mod._requests(n, prompt, new, vocab, 1000)]  # (every mode of a round: the same requests)
    engine = mod.warm_engine(model, "paged", n, prompt, new, torch.device("cpu"))
    seen: set[tuple[int, ...]] = set()
    for seed in (0, 1000, 1001):  # the warm-up's requests, then two rounds'
        engine.trace = []
        engine.run(mod._requests(n, prompt, new, vocab, seed))
        shapes = {tuple(specs[0].shape) for specs, _inputs, _arrays in engine.trace
                  if int(specs[0].max_query_len) == 1}
        assert shapes, "no decode steps"
        if seed:
            assert len(shapes & seen) <= len(shapes) // 4, (seed, sorted(shapes & seen))  # (a few meet by chance)
        seen |= shapes
    engine.trace = None
