"""ab_engine.py: the A/B of the engine's loop in one process (this checkout against another commit)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from bench_script_helpers import load_benchmark, run_script, table_rows


def test_ab_engine_serves_the_same_requests_on_both_sides() -> None:
    # HEAD's engine and attnmeta (imported as engine_base / attnmeta_base, the script checks that the
    # base engine's composer is the base package's) against this checkout's: one table row per
    # concurrency, each side's metadata, step and plan times, and the same greedy tokens on both sides.
    rows = table_rows("ab_engine.py", "HEAD", "--device", "cpu", "--model", "tiny", "--mode", "paged",
                      "--concurrency", "2", "--rounds", "2", "--new", "16", "--prompt", "8", "--warm", "1")
    assert [r[0] for r in rows] == ["2"]
    _reqs, base_ms, this_ms, ratio, paired, base_step, this_step, base_plan, this_plan, plan_x, differ = rows[0]
    assert float(base_ms) > 0 and float(this_ms) > 0 and float(base_step) > 0 and float(this_step) > 0
    assert abs(float(ratio) - float(this_ms) / float(base_ms)) < 0.01
    assert float(paired) > 0
    assert float(base_plan) > 0 and float(this_plan) > 0  # (torch's paged kernel prepares each step on the host)
    assert abs(float(plan_x) - float(this_plan) / float(base_plan)) < 0.01
    assert differ == "0"


def test_ab_engine_symmetric_runs_both_import_orders(tmp_path: Path) -> None:
    # --symmetric: both sides exported copies (this checkout's working tree as attnmeta_new / engine_new), the
    # A/B once per import order, each in a process of its own, then per concurrency the geometric means of
    # the two runs' ratios, which --json keeps with both runs.
    out = tmp_path / "ab.json"
    text = run_script("ab_engine.py", "HEAD", "--device", "cpu", "--model", "tiny", "--mode", "paged",
                      "--concurrency", "2", "--rounds", "2", "--new", "16", "--prompt", "8", "--warm", "1",
                      "--symmetric", "--json", str(out))
    heads = [line for line in text.splitlines() if line.startswith("# cpu")]
    assert [h.split("imported in the order ")[1].split(";")[0] for h in heads] == ["base,this", "this,base"], text
    rows = [line.split() for line in text.splitlines() if line.split() and line.split()[0].isdigit()]
    assert [len(r) for r in rows] == [11, 11, 3], text  # (each order's row, then the means)
    assert rows[0][10] == rows[1][10] == "0"  # (the same tokens on both sides, in both orders)
    got = json.loads(out.read_text())
    ratios = [run["2"]["ratio"] for run in got["runs"]]
    assert len(ratios) == 2 and math.isclose(got["geometric_means"]["2"]["ratio"], math.sqrt(ratios[0] * ratios[1]))
    assert abs(float(rows[2][1]) - math.sqrt(ratios[0] * ratios[1])) < 0.001


def test_ab_engine_times_every_step_of_a_loop_whose_requests_arrive_over_steps() -> None:
    # --arrive-over: the requests arrive over the first steps, so prompts join running decodes (mixed steps);
    # --steps all: each run's mean over every step (the header says so), and each side's composed share.
    text = run_script("ab_engine.py", "HEAD", "--device", "cpu", "--model", "tiny", "--mode", "paged",
                      "--concurrency", "4", "--rounds", "2", "--new", "16", "--prompt", "8", "--warm", "1",
                      "--arrive-over", "12", "--steps", "all")
    head = text.splitlines()[0]
    assert "arriving over 12 steps" in head and "mean over every step" in head, text
    rows = [line.split() for line in text.splitlines() if line.split() and line.split()[0] == "4"]
    assert len(rows) == 1 and float(rows[0][1]) > 0 and float(rows[0][2]) > 0 and rows[0][10] == "0", text
    share = [line for line in text.splitlines() if line.startswith("#  4 requests: steps not replayed")]
    assert len(share) == 1 and share[0].endswith("%") and "base " in share[0] and "this " in share[0], text


def test_ab_engine_s_step_selections() -> None:
    # --steps: decode (the full-batch decode steps), composed (the steps not replayed) or all; a run without
    # the steps asked for is refused with what to change (an engine whose mixed steps replay composes few).
    mod = load_benchmark("ab_engine.py", "ab_engine_steps")
    run = {"kinds": ["mixed"] + ["decode"] * 10 + ["mixed"], "replayed": [False] + [True] * 4 + [False] + [True] * 6}
    assert mod.timed_steps(run, "composed") == [0, 5]
    assert mod.timed_steps(run, "all") == list(range(12))
    assert mod.timed_steps(run, "decode") == [4, 5, 6, 7]
    with pytest.raises(RuntimeError, match="no composed steps"):
        mod.timed_steps({"kinds": run["kinds"], "replayed": [True] * 12}, "composed")


def test_bench_engine_requests_arrive_over_the_steps_asked() -> None:
    # bench_engine._requests(arrive_over=N, start=S): arrivals drawn in S..S+N from the seed (the same on every
    # side of an A/B), in the order of the requests (the scheduler admits its queue in order; an engine counts
    # its steps over all its runs, hence S); every one at step 0 without them.
    mod = load_benchmark("bench_engine.py", "bench_engine_arrivals")
    spread = mod._requests(64, 8, 4, 100, seed=3, arrive_over=20)
    assert {r.arrival for r in spread} <= set(range(21)) and len({r.arrival for r in spread}) > 5
    assert [r.arrival for r in spread] == sorted(r.arrival for r in spread)
    later = mod._requests(64, 8, 4, 100, seed=3, arrive_over=20, start=500)
    assert [r.arrival for r in later] == [r.arrival + 500 for r in spread]
    assert [r.arrival for r in spread] == [r.arrival for r in mod._requests(64, 8, 4, 100, seed=3, arrive_over=20)]
    assert {r.arrival for r in mod._requests(8, 8, 4, 100, seed=3)} == {0}
    same = mod._requests(8, 8, 4, 100, seed=3)  # (the prompts do not depend on the arrivals)
    assert [r.prompt for r in same] == [r.prompt for r in mod._requests(8, 8, 4, 100, seed=3, arrive_over=20)]
