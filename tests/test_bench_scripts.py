"""The benchmark scripts run end to end on the CPU, with tiny settings, and print every row.

docs/benchmarks.md quotes these scripts' output; a script that no longer runs (an API it calls
changed, a row it drops) fails here rather than on the GPU machine. Timings are never asserted
(performance lives in benchmarks, not tests): only that each row is there with positive numbers.
(bench_mamba2.py joins them when its scenarios move into attnmeta.bench.) ab_commit.py and
bench_engine.py have their file, test_bench_ab_engine.py (two files: the test workers share them).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from bench_script_helpers import BATCHES, ROOT, load_benchmark, run_script, table_rows

import attnmeta
from attnmeta.__main__ import main


def test_bench_decode_prints_every_path_at_every_batch_size() -> None:
    paths = ("fused", "fused+spec", "floor", "jitter")
    rows = table_rows("bench_decode.py", "--device", "cpu", "--rounds", "1", "--steps", "8", "--warm", "1",
                "--paths", ",".join(paths))
    assert [(int(r[0]), r[1]) for r in rows] == [(b, p) for b in BATCHES for p in paths]
    for r in rows:  # median, best round, p99, p99/med
        assert all(float(x) > 0 for x in r[2:6]), r
    targets = {int(r[0]): r[6] for r in rows if r[1] == "fused" and len(r) > 6}
    assert targets == {1: "25.0", 256: "50.0", 1024: "150.0"}  # the limits; floor and jitter have none
    assert all(len(r) == 6 for r in rows if r[1] in ("floor", "jitter"))


def test_bench_spec_prints_every_batch_size() -> None:
    rows = table_rows("bench_spec.py", "--rounds", "1", "--steps", "3")
    assert [int(r[0]) for r in rows] == [1, 8, 64, 256, 1024]
    assert all(float(r[1]) > 0 and float(r[2]) > 0 for r in rows)


def test_bench_replay_prints_every_replaying_builder_at_every_batch_size() -> None:
    """Every builder with a replayer gets a row per batch; its replaying composer replayed (a builder whose
    replays stopped, a replay_key gone None, shows as 0%)."""
    bench = load_benchmark("bench_replay.py", "bench_replay_names")
    names = bench.replaying_builders()
    out = run_script("bench_replay.py", "--rounds", "1", "--steps", "6", "--batches", "1,8")
    rows = [line.split() for line in out.splitlines() if line.split() and line.split()[0] in names]
    assert {"flash_attn", "flashinfer", "mamba1", "mamba2", "mla"} <= set(names)
    assert [(r[0], int(r[1])) for r in rows] == [(n, b) for n in names for b in (1, 8)]
    for r in rows:  # composed us, replayed us, saving, replays
        assert float(r[2]) > 0 and float(r[3]) > 0 and r[4].endswith("x"), r
        assert r[5] == "100%", r


def test_bench_replay_with_drafts_replays_spec_decode_steps_where_a_key_names_them() -> None:
    """``--drafts 2``: GDN's and MLA's spec-decode steps replay (the row classes of their shapes say every
    row is a spec row with uniform queries); local attention composes them (its virtual rows depend on
    chunk crossings)."""
    out = run_script("bench_replay.py", "--rounds", "1", "--steps", "6", "--batches", "8", "--drafts", "2",
                     "--builders", "gdn,mla,local_attn")
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split()[:1] in (["gdn"], ["mla"],
                                                                                                   ["local_attn"])}
    assert "2 drafts a request" in out
    assert rows["gdn"][5] == rows["mla"][5] == "100%" and rows["local_attn"][5] == "0%", rows


def test_bench_replay_with_arrivals_replays_steps_of_new_counts_where_a_builder_allows() -> None:
    """``--arrivals``: graph-mode steps of new counts every step replay one layout for the builders that
    replay any counts (the default set: FlashInfer, Mamba1 and Mamba2), and compose for one that does not (FlashAttention's key
    names the step's counts, new each step: 0%)."""
    bench = load_benchmark("bench_replay.py", "bench_replay_arrivals")
    assert bench.any_rows_builders() == ["flashinfer", "mamba1", "mamba2"]
    fi = attnmeta.get_builder("flashinfer")  # (the composed side keys no step, an any-counts one neither)
    composed, shape = bench.without_replay(fi), bench.arrivals_walk(8, 1, 0)[0].shape
    assert fi.any_rows_key(shape, fi.options(None), None) == "mixed"
    assert composed.any_rows_key(shape, fi.options(None), None) is None is composed.replay_key(shape, fi.options(None), None)
    walk = bench.arrivals_walk(8, 20, 0)
    assert len({(s.num_reqs, s.num_tokens) for s in walk}) > 10 and all(s.num_reqs_padded is None for s in walk)
    out = run_script("bench_replay.py", "--rounds", "1", "--steps", "6", "--batches", "8", "--arrivals")
    assert "graph-mode steps of arriving requests" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split()[:1] in (["flashinfer"],
                                                                                                   ["flash_attn"])}
    assert list(rows) == ["flashinfer"] and rows["flashinfer"][5] == "100%", rows
    out = run_script("bench_replay.py", "--rounds", "1", "--steps", "6", "--batches", "8", "--arrivals",
                     "--builders", "flash_attn")
    assert [line.split()[5] for line in out.splitlines() if line.split()[:1] == ["flash_attn"]] == ["0%"], out


def test_bench_cold_start_prints_every_first_build_cold_and_warmed() -> None:
    """``--quick``: flash_attn's first builds on an empty cache, then on the cache that run filled (no
    warmup: ``python -m attnmeta warmup`` is tested in test_cli.py and test_deployment.py)."""
    out = run_script("bench_cold_start.py", "--quick")
    lines = out.splitlines()
    head = lines.index(next(line for line in lines if line.startswith("first build (s)")))
    assert lines[head].split()[-2:] == ["cache", "filled"], lines[head]
    rows = [line.rsplit(None, 2) for line in lines[head + 1:] if not line.startswith("python -m attnmeta warmup")]
    assert [r[0].strip() for r in rows] == ["import attnmeta", "BatchSpec", "flash_attn", "fused (4 builds)",
                                            "all first builds"]
    assert all(float(r[1]) > 0 and float(r[2]) > 0 for r in rows), rows
    assert lines[-1] == "python -m attnmeta warmup: not run (--quick; the second column read the cold run's cache)"


def test_report_turns_bench_json_into_the_docs_table(tmp_path: Path) -> None:
    data = tmp_path / "bench.json"
    assert main(["bench", "--quick", "--reps", "2", "--no-progress", "--device", "cpu", "--scenario", "staging",
                 "--scenario", "spec-decode-k3", "--scenario", "builder:flash_attn", "--json", str(data)]) == 0
    out = run_script("report.py", str(data))
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
    ratios = run_script("report.py", str(data), "--ratios")
    lines = [line.split("|")[1:-1] for line in ratios.splitlines() if line.startswith("| ")]
    assert "median" not in "".join(lines[0]) and " us" not in "".join(lines[0])  # no absolute times
    by = {(c[0].strip(), int(c[1])): [x.strip() for x in c] for c in lines[1:]}
    assert set(by) == set(rows)
    spec = by[("spec-decode-k3", 64)]  # reference / attnmeta, per-tensor / attnmeta, attnmeta / fused
    assert all(x.endswith("x") for x in spec[2:5]) and spec[5] == "0, 0, 0, 5" and spec[6] == "1, 1, 8, 3"


def test_bench_decode_cold_times_every_way_after_its_wait() -> None:
    """``--cold``: each path back to back, after a sleep and after a cache thrash (the event way is CUDA's)."""
    rows = table_rows("bench_decode.py", "--device", "cpu", "--rounds", "1", "--steps", "4", "--warm", "1", "--cold",
                "--cold-us", "100", "--paths", "fused")
    assert [(int(r[0]), r[1]) for r in rows] == [(b, f"fused@{w}") for b in BATCHES for w in ("tight", "sleep", "thrash")]
    assert all(float(x) > 0 for r in rows for x in r[2:5]), rows


def test_bench_loop_twin_times_the_call_alone_and_after_its_twin() -> None:
    out = run_script("bench_loop_twin.py", "--concurrency", "3", "--rounds", "1", "--prompt", "8", "--new", "12")
    lines = out.splitlines()
    head = lines.index(next(line for line in lines if line.split()[:3] == ["reqs", "alone", "twin"]))
    row = lines[head + 1].split()
    assert row[0] == "3" and float(row[1]) > 0 and float(row[2]) > 0 and row[3].endswith("x"), row
    assert int(row[4]) > 0, row  # full-batch decode steps timed in each variant
    # the primers: the interpreter's loop, the libraries' entry points, attnmeta's compiled calls
    assert lines[head].split()[5:] == ["interp", "interp/alone", "libs", "libs/alone", "kernels", "kernels/alone"]
    assert all(float(row[k]) > 0 and row[k + 1].endswith("x") for k in (5, 7, 9)), row


def test_bench_loop_twin_runs_the_hybrid_composition() -> None:
    """The twin diagnostic on the hybrid model's two KV-cache groups (``--model tiny-hybrid`` on the CPU)."""
    out = run_script("bench_loop_twin.py", "--model", "tiny-hybrid", "--concurrency", "3", "--rounds", "1",
                     "--prompt", "8", "--new", "12")
    assert "model tiny-hybrid" in out, out
    row = next(line.split() for line in out.splitlines() if line.split()[:1] == ["3"])
    assert float(row[1]) > 0 and float(row[2]) > 0 and int(row[4]) > 0, row


def test_bench_loop_phases_splits_the_replayed_call_at_every_mark_of_its_path() -> None:
    """The loop's composer call split into phases (the marks put in at import): every phase of the CPU's
    replay path is there, and every timed step replayed."""
    out = run_script("bench_loop_phases.py", "--model", "tiny-hybrid", "--concurrency", "3", "--rounds", "1",
                     "--prompt", "8", "--new", "12")
    head = next(line for line in out.splitlines() if line.startswith("## 3 requests"))
    kept, timed = (int(x) for x in head.split("(")[1].split(" steps")[0].split(" of "))
    assert kept == timed > 0, head
    rows = [(line.rsplit(maxsplit=2)[0], float(line.rsplit(maxsplit=2)[1]))
            for line in out.splitlines()[out.splitlines().index(head) + 2:] if line.strip()]
    driver = {"commit: sentinels (graph mode), the copy's size", "commit: torch's modes, device and stream checked",
              "commit: the copy's driver call"}  # (CUDA only)
    # (a group with a page table: FlashInfer's; the CPU's torch kernel stages none)
    paged = {"page-indices views (a group's)", "paged-KV metadata object (a group's)"}
    phases = load_benchmark("bench_loop_phases.py", "bench_loop_phases_rows")
    expected = []
    for _m, _s, label, _a in phases.MARKS:
        if not label.startswith("(") and label not in driver | paged:
            expected += [label] * (2 if label == "common metadata object (a group's)" else 1)  # (two groups)
    assert [label for label, _us in rows] == [*expected, phases._END], out
    assert all(us > 0 for _label, us in rows), rows


def test_bench_loop_phases_finds_each_mark_once_in_the_package_source() -> None:
    """Each mark's line is in the package's source where :data:`MARKS` says (a refactor that moves one
    fails here, not on the GPU machine), and a missing line is an error, not a silently absent phase."""
    phases = load_benchmark("bench_loop_phases.py", "bench_loop_phases_source")
    for module in sorted({m for m, *_r in phases.MARKS}):
        source = (ROOT / (module.replace(".", "/") + ".py")).read_text()
        marked = phases.instrument(source, module)
        added = marked.count("_bench_phase_mark(")
        assert added == sum(m == module for m, *_r in phases.MARKS), module
        if module == "attnmeta.spec":  # (its compiled kernels' cache keys hold their line numbers)
            assert marked.count("\n") == source.count("\n")
    source = (ROOT / "attnmeta/compose.py").read_text()
    with pytest.raises(LookupError, match="update MARKS"):
        phases.instrument(source.replace("shapes = shapes_of(scan)", "shapes = tuple(shapes_of(scan))"),
                          "attnmeta.compose")


def test_bench_loop_phases_medians_the_phases_of_the_most_common_path() -> None:
    phases = load_benchmark("bench_loop_phases.py", "bench_loop_phases_medians")
    replay = [[("(call)", 0), ("(x)", 1000), ("a", 3000), ("end", 4000)],
              [("(call)", 0), ("(x)", 2000), ("a", 4000), ("end", 7000)],
              [("(call)", 0), ("(x)", 1000), ("a", 2000), ("end", 3000)]]
    composed = [[("(call)", 0), ("b", 9000), ("end", 10000)]]
    rows, kept = phases.phases(replay + composed)
    assert kept == 3
    assert rows == [("a", 3.0), ("end", 1.0)]  # ((x)'s median, 1 us, joins a's, 2 us; the end's: 1 us)


def test_bench_launch_profile_sets_the_engines_launches_side_by_side() -> None:
    """``bench_launch_profile.py`` on the CPU (the tiny hybrid, an engine and its twin): each engine's
    unprofiled step and launch times, the callers ``--callers`` asks for, and the functions whose own
    time differs most, one column pair per engine."""
    out = run_script("bench_launch_profile.py", "--device", "cpu", "--model", "tiny-hybrid", "--modes", "paged,paged#2",
                     "--concurrency", "3", "--rounds", "1", "--prompt", "8", "--new", "12", "--top", "5",
                     "--callers", "vllm_mamba2_mixer|mamba2_mixer")
    lines = out.splitlines()
    for mode in ("paged", "paged#2"):
        row = next(line.split() for line in lines if line.split()[:2] == [mode, "step"])
        assert row[5] == "launch" and float(row[4]) > float(row[8]) > 0, row  # (a step outlasts its launches)
        assert any(line.startswith(f"{mode}: callers of") for line in lines), out
    assert any("hybrid.py" in line and "forward" in line for line in lines), out  # (the mixer's caller)
    head = lines.index(next(line for line in lines if line.startswith("function")))
    table = [line.split() for line in lines[head + 1 : head + 6]]
    assert len(table) == 5 and all(len(r) >= 5 and float(r[-1]) >= 0 for r in table), table


def test_bench_launch_profile_ranks_by_the_largest_difference(capsys: pytest.CaptureFixture[str]) -> None:
    """The functions listed are those whose own time per step differs most from the first engine's, in
    either direction, a function one engine never called counting as 0 there (its docstring's example
    runs too); fewer than two distinct modes, an unknown mode, one that needs CUDA on the CPU, and one a
    hybrid model cannot run are refused, each saying why."""
    import doctest

    mod = load_benchmark("bench_launch_profile.py", "bench_launch_profile_rank")
    runner = doctest.DocTestRunner()
    for test in doctest.DocTestFinder().find(mod.differences, "differences", globs={"differences": mod.differences}):
        runner.run(test)
    assert runner.summarize(verbose=False) == (0, 3)
    first = {("a", 1, "f"): (1.0, 10.0), ("a", 2, "g"): (1.0, 3.0)}
    others = {"B": {("a", 1, "f"): (1.0, 11.0)}, "C": {("a", 1, "f"): (1.0, 2.0), ("a", 3, "h"): (2.0, 5.0)}}
    got = mod.differences({"A": first, **others}, 3)
    assert got == [(("a", 1, "f"), -8.0), (("a", 3, "h"), 5.0), (("a", 2, "g"), -3.0)]
    assert mod.name_of(("~", 0, "<built-in method posix.stat>")) == "<built-in method posix.stat>"
    assert mod.name_of(("/x/y/engine/hybrid.py", 12, "forward")) == "engine/hybrid.py:12(forward)"
    assert mod.main(["--device", "cpu", "--modes", "paged"]) == 2
    assert mod.main(["--device", "cpu", "--modes", "paged,paged"]) == 2
    refused = {"paged,nope": "unknown modes", "eager,vllm-eager": "needs CUDA", "paged,per-tensor": "one copy only"}
    for modes, why in refused.items():
        assert mod.main(["--device", "cpu", "--model", "tiny-hybrid", "--modes", modes]) == 2
        assert why in capsys.readouterr().err, modes


def test_every_scripts_device_is_checked_when_parsed() -> None:
    """Every script in benchmarks/ that takes ``--device`` parses it with ``_args.device_arg``: a device
    this machine lacks is a usage error that says so (it was a traceback from torch, often after a model
    was made)."""
    scripts = sorted((ROOT / "benchmarks").glob("*.py"))
    takes = [p for p in scripts if 'add_argument("--device"' in p.read_text()]
    assert len(takes) >= 9, [p.name for p in takes]
    unchecked = [p.name for p in takes if 'add_argument("--device", type=device_arg' not in p.read_text()]
    assert not unchecked, unchecked
    args = load_benchmark("_args.py", "bench_args")
    assert args.device_arg("cpu") == "cpu" and args.device_arg("meta") == "meta"
    for bad, says in (("xpu", "expected cpu, cuda or meta"), ("nonsense", "expected cpu, cuda or meta")):
        with pytest.raises(argparse.ArgumentTypeError, match=says):
            args.device_arg(bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_bench_engine_on_a_machine_without_cuda_says_so_before_anything_runs() -> None:
    """``bench_engine.py``'s default device is cuda: without one, status 2 and a message naming the flag."""
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_engine.py")], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 2 and "--device: cuda: no CUDA device is available here" in done.stderr, done.stderr[-2000:]


def test_bench_engine_says_to_raise_new_when_a_run_has_no_full_batch_decode_steps() -> None:
    """``--new 4`` ended in a StatisticsError traceback (the median of no steps)."""
    bench = load_benchmark("bench_engine.py", "bench_engine_full_batch")
    assert bench.full_batch(["mixed"] + ["decode"] * 8) == [4, 5]
    with pytest.raises(SystemExit, match=r"the run had 3 decode steps.*raise --new"):
        bench.full_batch(["mixed", "decode", "decode", "decode"])


def test_every_script_s_help_describes_it_in_whole_sentences() -> None:
    """``--help`` shows the module docstring's first paragraph (several scripts cut it at its first line,
    mid-sentence: "... another commit's, in the")."""
    import ast

    cut = []
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        text = path.read_text()
        if "argparse.ArgumentParser(" not in text:
            continue
        assert '__doc__.split("\\n")[0]' not in text, path.name
        doc = ast.get_docstring(ast.parse(text)) or ""
        first = doc.split("\n\n")[0].rstrip()
        if not first.endswith((".", ":", ")")):
            cut.append((path.name, first[-40:]))
    assert not cut, cut
