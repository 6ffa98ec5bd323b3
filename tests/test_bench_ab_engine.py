"""ab_commit.py (the A/B in one process against another commit) and bench_engine.py (the engine's loop,
attnmeta against vLLM's code) end to end on the CPU, with tiny settings, and their pieces: as
test_bench_scripts.py, timings are never asserted."""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path
from typing import Any

import pytest
from bench_script_helpers import load_benchmark, run_script


def test_ab_commit_compares_a_commit_with_this_checkout() -> None:
    """The A/B against another commit (here HEAD itself: any clone has it) prints every path named in
    ``--paths`` (here all of them, named out of order), in its own order, with a ratio; with ``--cold``,
    ``--walk`` and ``--mean``: each step timed after a cache thrash, the engine rows on one walk, per-round
    means. (One run: the rounds' medians without ``--cold`` are the fake-clock test's below. The base's copy
    and its compiled kernels are kept in ``.ab_exports``: whichever of this and test_bench_ab_loop.py runs
    second compiles nothing.)"""
    out = run_script("ab_commit.py", "HEAD", "--device", "cpu", "--rounds", "1", "--steps", "3", "--batches", "1",
                     "--paths", "lifetimes on/off, engine hybrid,engine graphs,composable,fused+spec,fused",
                     "--cold", "--walk", "--mean")
    head = out.splitlines()[0]
    assert "each after a cache thrash" in head and "one walk, no step repeated" in head and "per-round means" in head, out
    rows = [line.split() for line in out.splitlines() if line.split() and line.split()[0] == "1"]
    names = [" ".join(r[1:-3]) for r in rows]
    assert names == ["fused", "fused+spec", "composable", "engine graphs", "engine hybrid", "lifetimes on/off"], rows
    assert all(float(r[-1]) > 0 for r in rows), rows


def test_ab_commit_split_times_each_part_of_the_composable_step_on_both_sides() -> None:
    """``--split``: the composable step's parts (the claim, each staging, the commit, each result), in the
    order a step passes them, with both sides' medians, their difference, and a sum of the parts."""
    mod = load_benchmark("ab_commit.py", "ab_commit_split")
    out = run_script("ab_commit.py", "HEAD", "--device", "cpu", "--rounds", "2", "--steps", "3", "--batches", "1,64",
                     "--split")
    assert "the composable step's parts" in out.splitlines()[0], out
    for batch in ("1", "64"):
        rows = [line.split() for line in out.splitlines() if line.split()[:1] == [batch]]
        names = [" ".join(r[1:-3]) for r in rows]
        assert names == [*mod.SPLIT, "(sum)"], rows
        base, this = [float(r[-3]) for r in rows], [float(r[-2]) for r in rows]
        assert all(t > 0 for t in base + this), rows
        assert abs(sum(base[:-1]) - base[-1]) < 0.05 * len(mod.SPLIT) and abs(sum(this[:-1]) - this[-1]) < 0.05 * len(mod.SPLIT)


def test_bench_replay_floor_times_the_fused_step_and_each_floor_against_the_base() -> None:
    """``bench_replay_floor.py`` against HEAD (the same exported copy as the A/B above): the fused step and
    the five hand-written replays, in order, each against the base's fused step, at every batch asked."""
    out = run_script("bench_replay_floor.py", "HEAD", "--device", "cpu", "--rounds", "1", "--steps", "3",
                     "--batches", "1,64")
    rows = [line.split() for line in out.splitlines() if line.split() and line.split()[0] in ("1", "64")]
    floors = ["shared", "+ objects", "+ lifetimes", "+ layout key", "builders' calls"]
    assert [(r[0], " ".join(r[1:-3])) for r in rows] == [(b, p) for b in ("1", "64") for p in ["fused", *floors]], out
    assert all(float(r[-3]) > 0 and float(r[-2]) > 0 for r in rows), rows
    cold = run_script("bench_replay_floor.py", "HEAD", "--device", "cpu", "--rounds", "1", "--steps", "2",
                      "--batches", "1", "--cold")  # (each step after a cache thrash)
    assert "each step after a cache thrash" in cold.splitlines()[0], cold
    rows = [line.split() for line in cold.splitlines() if line.split() and line.split()[0] == "1"]
    assert [" ".join(r[1:-3]) for r in rows] == ["fused", *floors], cold


def test_bench_replay_floor_refuses_a_replay_that_differs_from_the_fused_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """The hand-written replay is checked against the fused step's objects field for field before any
    timing: one wrong scalar (the longest sequence off by one) is found and named; a slot without the
    step's recorded layout is refused (the step abandoned); ``differs`` compares nested objects, tensors
    and arrays."""
    import numpy as np
    import torch

    import attnmeta

    mod = load_benchmark("bench_replay_floor.py", "bench_replay_floor_check")
    assert set(mod.floor_paths(1, torch.device("cpu"))) == set(mod.FLOORS)
    real = mod.Floor._objects

    def off_by_one(self: Any, step: Any, rec: Any, shape: Any) -> tuple[Any, ...]:
        return real(self, step, rec, shape._replace(max_seq_len=shape.max_seq_len + 1))

    monkeypatch.setattr(mod.Floor, "_objects", off_by_one)
    with pytest.raises(AssertionError, match=r"`\+ layout key` replay's common\.max_seq_len"):
        mod.floor_paths(1, torch.device("cpu"))
    monkeypatch.setattr(mod.Floor, "_objects", real)
    real_step = mod.Floor.step

    def calls_off_by_one(self: Any, spec: Any, upto: str) -> tuple[Any, ...] | None:
        objs = real_step(self, spec, upto)
        if upto != "builders' calls" or objs is None:
            return objs
        cm, *rest = objs
        return (cm.replace(max_seq_len=cm.max_seq_len + 1), *rest)

    monkeypatch.setattr(mod.Floor, "step", calls_off_by_one)  # (the builders' calls' replay is checked too)
    with pytest.raises(AssertionError, match=r"`builders' calls` replay's common\.max_seq_len"):
        mod.floor_paths(1, torch.device("cpu"))
    monkeypatch.setattr(mod.Floor, "step", real_step)
    spec = attnmeta.BatchSpec(num_computed_tokens=[5], num_scheduled_tokens=[1], block_table=[[1, 2]], block_size=4)
    builder = mod.FusedStepBuilder(attnmeta.Stager("cpu"))  # (it has recorded nothing yet)
    with pytest.raises(RuntimeError, match="has not recorded the step's layout"):
        mod.Floor(builder, [spec]).step(spec, "shared")
    assert builder.build(spec).common.max_seq_len == 6  # (the step was abandoned: the stager goes on)
    a = attnmeta.build_common(spec, attnmeta.Stager("cpu"))
    b = attnmeta.build_common(spec, attnmeta.Stager("cpu"))
    assert mod.differs(a, b) == ""
    assert mod.differs(torch.tensor([1, 2]), torch.tensor([1, 3])) == " (tensor)"
    assert mod.differs(np.array([1], np.int32), np.array([1], np.int64)) == " (array)"
    assert mod.differs(a, attnmeta.build_common(spec, attnmeta.Stager("cpu"), causal=False)).startswith("causal")


def test_ab_commit_engine_steps_are_the_reference_engine_s_decode_steps(monkeypatch: pytest.MonkeyPatch,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """``--engine-steps``: the engine rows walk the reference engine's own full-batch decode steps, recorded
    on the CPU (each step's counts and table as the engine hands them to its composer: one new token a
    request, the tables' block ids those of their requests' pages), as many runs of new requests as the
    walk needs steps (none timed twice), and both engine rows build them; ``--walk`` with it is refused."""
    import sys

    import torch

    import attnmeta

    mod = load_benchmark("ab_commit.py", "ab_commit_engine_steps")
    steps = mod.engine_steps(3)  # (one run)
    assert len(steps) >= 20, len(steps)
    more = mod.engine_steps(3, at_least=len(steps) + 1)  # (a second run of new requests)
    assert len(more) >= len(steps) + 20 and all(
        (a["num_computed_tokens"] == b["num_computed_tokens"]).all() for a, b in zip(steps, more))
    for s in steps:
        c, q, table = s["num_computed_tokens"], s["num_scheduled_tokens"], s["block_table"]
        assert q.tolist() == [1, 1, 1] and table.shape[0] == 3 and s["block_size"] == 16
        pages = -(-(c + q) // 16)
        assert all((table[r, : pages[r]] >= 0).all() for r in range(3))
    assert len({int((-(-(s["num_computed_tokens"] + 1) // 16)).sum()) for s in steps}) > 1  # (page counts change)
    built = mod.paths(attnmeta, 3, torch.device("cpu"), engine=steps)
    for name in ("engine graphs", "engine hybrid"):
        for _ in range(len(steps) + 2):  # (once round the cycle)
            out = built[name]()
        assert out.common.num_reqs == 3 or out.common.num_reqs == 4, name  # (graph mode pads to 4)
    monkeypatch.setattr(sys, "argv", ["ab_commit.py", "HEAD", "--walk", "--engine-steps"])
    with pytest.raises(SystemExit):
        mod.main()
    assert "the engine rows take one of them" in capsys.readouterr().err


def test_ab_commit_keeps_and_reuses_the_exported_base(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``import_exported`` keeps the renamed copy per content and reuses it untouched (numba's cache of the
    base's kernels, kept beside their source, stays valid only while the source's files do), makes a new
    copy when the content changes, and keeps only the ``KEEP_EXPORTS`` most recently used copies; a folder's
    key leaves compiled caches out; where it cannot write, the error says how to choose another folder.
    (The A/B tests above and in test_bench_ab_loop.py share one copy of HEAD this way: the second compiles
    nothing.)"""
    import sys

    mod = load_benchmark("ab_commit.py", "ab_commit_exports")
    exports = tmp_path / "exports"
    monkeypatch.setattr(mod, "KEEP_EXPORTS", 2)

    def base(version: int) -> Path:
        folder = tmp_path / f"base{version}"
        pkg = folder / "abx" / "sub"
        pkg.mkdir(parents=True, exist_ok=True)
        (folder / "abx" / "__init__.py").write_text(f"from abx.sub import VERSION\nimport abx.sub as s\nV = {version}\n")
        (pkg / "__init__.py").write_text(f"VERSION = {version}\n")
        return folder

    def load(folder: Path) -> Any:
        for name in [m for m in sys.modules if m == "abx_base" or m.startswith("abx_base.")]:
            del sys.modules[name]
        sys.path[:] = [p for p in sys.path if not p.startswith(str(exports))]
        return mod.import_exported(str(folder), "abx", "abx_base", {"abx": "abx_base"}, exports)

    one = base(1)
    first = load(one)
    assert first.V == 1 and first.VERSION == 1 and first.s.__name__ == "abx_base.sub"  # (imports renamed)
    copy = Path(first.__file__)
    stamp = copy.stat().st_mtime_ns
    (copy.parent / "marker").write_text("compiled")  # (stands for the kernels numba cached beside the source)
    key = mod.export_key(str(one), "abx")
    (one / "abx" / "__pycache__").mkdir()
    (one / "abx" / "__pycache__" / "x.nbi").write_bytes(b"cache")
    assert mod.export_key(str(one), "abx") == key  # (compiled caches are not content)
    again = load(one)
    assert Path(again.__file__) == copy and copy.stat().st_mtime_ns == stamp and (copy.parent / "marker").exists()
    for version in (2, 3):
        assert version == load(base(version)).V
    homes = sorted(d.name for d in exports.iterdir())
    assert len(homes) == 2 and copy.parent.parent.name not in homes, homes  # (the least recently used went)
    assert load(one).V == 1 and not (Path(load(one).__file__).parent / "marker").exists()  # (a fresh copy)
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    with pytest.raises(OSError, match="--exports DIR names a writable folder"):
        mod.import_exported(str(base(4)), "abx", "abx_base", {"abx": "abx_base"}, blocked / "exports")


def test_ab_commit_rounds_take_the_median_or_the_mean() -> None:
    """``ab()`` on a fake clock: side ``b`` takes 1 us a step but every fifth step 21 us (a step that composes
    a new layout): the per-round median leaves those out, ``mean=True`` counts them (5 us a step)."""
    import torch

    mod = load_benchmark("ab_commit.py", "ab_commit_mean")
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
    """``--walk`` (run by the A/B test above): the engine rows walk one decode walk (each step's counts new,
    the walk as long as the run needs); ``_Walk`` hands out no step twice, and without it the 64-step cycle."""
    import numpy as np

    from attnmeta.testing.workloads import advance, decode_spec

    mod = load_benchmark("ab_commit.py", "ab_commit_walk")
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
    text = run_script("bench_engine.py", "--device", "cpu", "--model", "tiny", "--modes", "paged", "--concurrency", "3",
                   "--prompt", "8", "--new", "12", "--rounds", "1", "--cold-us", "100", "--json", str(out))
    assert "loop/thrash" in text, text
    row = json.loads(out.read_text())["rows"][0]
    for k in ("cold_tight_ms", "cold_sleep_ms", "cold_thrash_ms", "control_tight_ms", "control_sleep_ms",
              "control_thrash_ms", "loop_over_cold", "loop_over_thrash"):
        assert row[k] > 0, (k, row)
    assert "cold_event_ms" not in row  # (CUDA only)


def test_bench_engine_grad_mode_runs_the_loop_outside_inference_mode(tmp_path: Path) -> None:
    """``MODE+grad``: the same mode with its loop outside ``torch.inference_mode()`` (the engine's config
    says so), summarised against ``MODE`` (what inference mode is worth), the same tokens."""
    import json

    out = tmp_path / "bench.json"
    text = run_script("bench_engine.py", "--device", "cpu", "--model", "tiny", "--modes", "paged,paged+grad",
                      "--concurrency", "3", "--prompt", "8", "--new", "12", "--rounds", "1", "--no-cold", "--json", str(out))
    assert "Inference mode: each +grad engine" in text, text
    line = next(ln for ln in text.splitlines() if ln.split()[:3] == ["paged", "/", "paged+grad"])
    assert "0 of 3" in line, line  # the same greedy tokens
    rows = {r["mode"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"paged", "paged+grad"} and rows["paged"]["grad"]["paged+grad"]["metadata_x"] > 0
    bench = load_benchmark("bench_engine.py", "bench_engine_grad")
    import torch

    from examples.engine.workload import make_model

    model = make_model(bench.MODELS["tiny"]())
    cpu = torch.device("cpu")
    assert bench._engine(model, "paged", 3, 8, 12, cpu).cfg.inference_mode
    assert not bench._engine(model, "paged+grad", 3, 8, 12, cpu).cfg.inference_mode


def test_bench_engine_runs_the_hybrid_composition_on_the_cpu() -> None:
    """``--model tiny-hybrid``: the hybrid step's two KV-cache groups (attention and the Mamba2 state group)
    in the engine's loop on the CPU (its Mamba2 layers through the engine's torch kernels), with the
    decode row, every step replayed once warm, and the prefill row the hybrid model adds."""
    text = run_script("bench_engine.py", "--device", "cpu", "--model", "tiny-hybrid", "--modes", "paged",
                      "--concurrency", "3", "--prompt", "8", "--new", "12", "--rounds", "1", "--no-cold")
    assert "Mamba2 layers: torch" in text, text
    rows = {line.split()[0]: line.split() for line in text.splitlines() if line.split()[:2] in (["paged", "3"],
                                                                                                ["prefill", "3"])}
    assert set(rows) == {"paged", "prefill"}, text
    assert float(rows["paged"][5]) > 0 and rows["paged"][10] == "100%", rows["paged"]  # metadata ms; replay
    assert float(rows["prefill"][3]) > 0, rows["prefill"]


def test_ab_engine_refuses_graphs_for_any_hybrid_model(capsys: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A hybrid model (the tiny one too) runs eager steps only: ``--mode graphs`` is refused before any
    engine is made, rather than timed as eager steps under the graphs label. (``--device cuda`` passes the
    device check here as on a GPU machine: the refusal comes before anything touches the device.)"""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    mod = load_benchmark("ab_engine.py", "ab_engine_hybrid_graphs")
    for model in ("hybrid-1b", "tiny-hybrid"):
        assert mod.main(["HEAD", "--device", "cuda", "--model", model, "--mode", "graphs"]) == 2
        assert "a hybrid model runs eager steps" in capsys.readouterr().err


def test_bench_engine_pairs_the_rounds() -> None:
    """The headline summary's ``paired`` ratio: the median of the rounds' own ratios (its docstring's
    example, a drifting host's rounds, runs here too), which a drift between rounds does not move."""
    import doctest

    mod = load_benchmark("bench_engine.py", "bench_engine_paired")
    runner = doctest.DocTestRunner()
    for test in doctest.DocTestFinder().find(mod.paired, "paired", globs={"paired": mod.paired}):
        runner.run(test)
    assert runner.summarize(verbose=False) == (0, 1)
    ours, theirs = [2.0, 4.0, 1.0], [3.0, 6.0, 1.5]  # every round 1.5x, the host twice as fast in round 3
    assert mod.paired(ours, theirs) == 1.5 == mod.paired([x * 3 for x in ours], [x * 3 for x in theirs])
    assert mod.paired([1.0, 2.0], [2.0, 3.0]) == 1.75  # (an even count: the mean of the middle two)


def test_bench_engine_summarizes_each_pair_over_processes() -> None:
    """``--processes``' summary: per pair and concurrency, each process's ratios (as its rows keep them:
    vLLM pairs on attnmeta's row, A/A twins on the first engine's row), in process order, and their
    medians; a concurrency one process lacks gives no entry. Its docstring's example runs too."""
    import doctest

    mod = load_benchmark("bench_engine.py", "bench_engine_processes")
    runner = doctest.DocTestRunner()
    for f in (mod.across_processes, mod.base_mode, mod.inference_mode, mod.modes_error):
        for test in doctest.DocTestFinder().find(f, f.__name__, globs={f.__name__: f}):
            runner.run(test)
    assert runner.summarize(verbose=False).failed == 0 and runner.summarize(verbose=False).attempted >= 5

    def rows(n: int, ours: float, theirs: float, paired: float) -> list[dict[str, Any]]:
        return [{"mode": "eager", "concurrency": n, "metadata_ms": ours,
                 "paired_against": {"vllm-eager": {"metadata_x": theirs / ours, "metadata_faster_x": paired,
                                                   "tokens_x": 1.1, "tokens_per_s_x": 1.1}},
                 "twins": {"eager#2": {"step_x": paired / 4, "metadata_x": 1.0}}},
                {"mode": "vllm-eager", "concurrency": n, "metadata_ms": theirs}]

    runs = [rows(64, 0.2, 1.0, 5.0) + rows(256, 0.2, 0.8, 4.0), rows(64, 0.25, 1.0, 4.0),
            rows(64, 0.2, 0.9, 4.4) + rows(256, 0.25, 1.0, 4.0)]
    (entry,) = mod.across_processes(runs)  # (256: the second process has none)
    assert entry["pair"] == "eager / vllm-eager" and entry["concurrency"] == 64
    assert entry["metadata_x"] == pytest.approx([5.0, 4.0, 4.5]) and entry["median_metadata_x"] == pytest.approx(4.5)
    assert entry["metadata_faster_x"] == [5.0, 4.0, 4.4] and entry["median_metadata_faster_x"] == 4.4
    assert entry["median_tokens_x"] == pytest.approx(1.1) and entry["median_tokens_per_s_x"] == 1.1
    (twin,) = mod.across_processes(runs, "twins")
    assert twin["pair"] == "eager / eager#2" and twin["step_x"] == [1.25, 1.0, 1.1] and twin["median_step_x"] == 1.1
    assert mod.across_processes([[r for r in rows(64, 0.2, 1.0, 5.0) if r["mode"] == "vllm-eager"]]) == []


def test_bench_engine_runs_fresh_processes_with_an_a_a_twin(tmp_path: Path) -> None:
    """``--processes 2`` with ``--modes paged,paged#2``: the measurement twice, each in a process of its own,
    the second making and timing its engines in the reverse order (each prints its table and its A/A line:
    the twin engine, the same code, gives the same tokens), then the twin's ratios per process and their
    median; the JSON holds both processes' rows, in --modes' order, and that summary. A mode named twice,
    and fewer than one process, are refused; ``_child_args`` alternates the order unless ``--same-order``."""
    import json

    out = tmp_path / "bench.json"
    text = run_script("bench_engine.py", "--device", "cpu", "--model", "tiny", "--modes", "paged,paged#2",
                      "--concurrency", "3", "--prompt", "8", "--new", "12", "--rounds", "1", "--no-cold",
                      "--processes", "2", "--json", str(out))
    assert "== process 1 of 2\n" in text and "== process 2 of 2 (engines made and timed in reverse order)" in text, text
    assert [line for line in text.splitlines() if line.startswith("engines made")] == [
        "engines made, and each round run, in the order paged,paged#2",
        "engines made, and each round run, in the order paged#2,paged"], text
    assert sum(line.split()[:2] == ["paged", "3"] for line in text.splitlines()) == 2, text
    a_a = [line.split() for line in text.splitlines() if line.split()[:4] == ["paged", "/", "paged#2", "3"]]
    # (2 processes, then the summary; tokens differ: 0 of 3, then the two engines' launch ms and their ratio)
    assert len(a_a) == 3 and all(row[-6:-3] == ["0", "of", "3"] for row in a_a[:2]), text
    got = json.loads(out.read_text())
    assert [[(r["mode"], r["concurrency"]) for r in p["rows"]] for p in got["processes"]] == [
        [("paged", 3), ("paged#2", 3)]] * 2
    assert [p["order"] for p in got["processes"]] == [["paged", "paged#2"], ["paged#2", "paged"]]  # (rows: --modes')
    assert got["across_processes"] == []  # (no vLLM pair among the modes)
    (twin,) = got["twins_across_processes"]
    assert twin["pair"] == "paged / paged#2" and len(twin["step_x"]) == 2 and twin["median_metadata_x"] > 0
    assert len(twin["launch_x"]) == 2 and twin["median_launch_x"] > 0
    assert [p["rows"][0]["requests_with_other_tokens_than"] for p in got["processes"]] == [{"paged#2": 0}] * 2
    mod = load_benchmark("bench_engine.py", "bench_engine_processes_refused")
    def child(flags: str, i: int, arrive_over: int = 0) -> list[str]:  # (process i's arguments)
        a = argparse.Namespace(device="cpu", concurrency="3", modes="paged", prompt=8, new=12, model="tiny", rounds=1,
                               cold_us=1.0, no_cold=True, reverse="r" in flags, same_order="s" in flags,
                               arrive_over=arrive_over)
        return mod._child_args(a, i)

    def reversed_in(flags: str) -> list[bool]:  # (per process of three: is its order reversed?)
        return ["--reverse" in child(flags, i) for i in range(3)]

    orders = {flags: reversed_in(flags) for flags in ("", "r", "s", "rs")}
    assert orders == {"": [False, True, False], "r": [True, False, True], "s": [False] * 3, "rs": [True] * 3}
    args = child("", 1, arrive_over=100)  # (every process serves the same workload: arrivals included)
    assert args[args.index("--arrive-over") + 1] == "100"
    with pytest.raises(SystemExit):
        mod.main(["--device", "cpu", "--processes", "0"])
    assert mod.main(["--device", "cpu", "--model", "tiny", "--modes", "paged,paged"]) == 2


def test_bench_engine_timed_runs_make_steps_no_earlier_run_made() -> None:
    """Each timed round of bench_engine.py serves new requests (the same for every mode of the round), so
    its decode steps are, but for a few met by chance, not steps an earlier run made: a run that repeated
    the warm-up's requests would repeat its steps' exact shapes, which a serving loop, whose longest
    sequence grows every step, never does."""
    import torch

    from examples.engine.workload import make_model, tiny_config

    mod = load_benchmark("bench_engine.py", "bench_engine_runs")

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


def test_ab_engine_s_base_engine_finds_this_checkout_s_mamba_kernels(tmp_path: Path) -> None:
    """The base engine (an exported copy under the exports folder) loads vLLM's Mamba kernels for the
    hybrid model from this checkout's ``.kernels``, where ``tests/kernels/fetch_kernels.py`` puts them and
    a GPU machine's call carries them, not from beside its own copy, which has none."""
    mod = load_benchmark("ab_engine.py", "ab_engine_kernels")
    mod.base_package("HEAD", tmp_path)
    engine = mod.side_engine("HEAD", tmp_path)
    mamba = importlib.import_module(engine.__name__ + ".vllm_mamba")
    assert mamba.KERNELS == mod.ROOT / ".kernels"
    assert str(tmp_path) in mamba.__file__  # (the base's own copy, imported from the exports folder)


def test_bench_engine_arrivals_time_every_step_of_the_loop(tmp_path: Path) -> None:
    """``--arrive-over``: the timed runs' requests arrive over that many steps, so prompts join running
    decodes in mixed steps, which the engine's fixed-layout composer replays (EngineConfig.fixed_mixed_layout,
    on since the warm-up's arrival run); a table gives every step's mean metadata time, the composed share
    and the run's tokens/s, beside the full-batch decode rows."""
    import json

    out = tmp_path / "bench.json"
    text = run_script("bench_engine.py", "--device", "cpu", "--model", "tiny", "--modes", "paged", "--concurrency",
                      "8", "--prompt", "8", "--new", "16", "--rounds", "1", "--no-cold", "--arrive-over", "12",
                      "--json", str(out))
    assert "every step of the runs, requests arriving over 12 steps" in text, text
    line = next(ln.split() for ln in text.splitlines()[text.splitlines().index(
        next(ln for ln in text.splitlines() if ln.startswith("every step of the runs"))):] if ln.split()[:2] == ["paged", "8"])
    steps, composed, of_mixed, meta = int(line[2]), float(line[3].rstrip("%")), float(line[5].rstrip("%")), float(line[7])
    assert steps > 16 and 0 <= composed < 100 and of_mixed < 50 and meta > 0, line  # (mixed steps replay)
    row = json.loads(out.read_text())["rows"][0]
    assert row["all_steps"] == steps and row["all_metadata_ms"] > 0 and row["run_tokens_per_s"] > 0, row


def test_bench_engine_arrivals_pair_the_means_of_every_step(capsys: pytest.CaptureFixture[str]) -> None:
    """The arrivals table's pair line: vLLM's mean metadata ms over attnmeta's, paired by round, and the runs'
    tokens/s, kept in attnmeta's row beside the decode steps' ratios; the composed shares by kind (its
    docstring's example runs)."""
    import doctest

    mod = load_benchmark("bench_engine.py", "bench_engine_arrivals")
    runner = doctest.DocTestRunner()
    for test in doctest.DocTestFinder().find(mod.share_composed, "share_composed",
                                             globs={"share_composed": mod.share_composed}):
        runner.run(test)
    assert runner.summarize(verbose=False).failed == 0 and runner.summarize(verbose=False).attempted == 2
    assert mod.share_composed(["mixed"], [False], "decode") == 0.0  # (no step of the kind)

    def row(mode: str, meta: list[float], tok: list[float]) -> dict[str, Any]:
        return {"mode": mode, "concurrency": 64, "all_steps": 140, "composed_share": 0.3, "composed_decode_share": 0.1,
                "composed_mixed_share": 0.9, "all_step_ms": 10.0,
                "all_metadata_ms": sorted(meta)[1], "all_metadata_ms_rounds": meta, "all_launch_ms": 5.0,
                "run_tokens_per_s": sorted(tok)[1], "run_tokens_per_s_rounds": tok,
                "paired_against": {"vllm-graphs": {"metadata_x": 5.0}}}

    ours, theirs = row("graphs", [0.2, 0.3, 0.25], [100, 90, 110]), row("vllm-graphs", [0.6, 0.6, 1.0], [90, 90, 100])
    mod._print_arrivals([ours, theirs], [("graphs", "vllm-graphs")], [64], 100)
    text = capsys.readouterr().out
    vllm_row = next(ln.split() for ln in text.splitlines() if ln.split()[:1] == ["vllm-graphs"])
    assert "graphs / vllm-graphs" in text and vllm_row[3] == "-", text  # (no composed share for vLLM's code)
    got = ours["paired_against"]["vllm-graphs"]
    assert got["metadata_x"] == 5.0  # (the decode steps' ratio stays)
    assert got["all_metadata_x"] == pytest.approx(0.6 / 0.25) and got["all_metadata_paired_x"] == pytest.approx(3.0)
    assert got["run_tokens_x"] == pytest.approx(100 / 90) and got["run_tokens_paired_x"] == pytest.approx(1.1)
