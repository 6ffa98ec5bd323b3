"""The command line: demo output is readable, bench --quick runs and its JSON parses, audit is clean.

Timings are never asserted (performance lives in benchmarks, not tests).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from attnmeta.__main__ import main


def test_demo_prints_every_field(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    for needle in ("CommonAttentionMetadata", "query_start_loc", "slot_mapping", "FlashAttentionMetadata",
                   "FlashInferMetadata", "paged_kv_indices", "Mamba2Metadata", "cu_chunk_seqlen",
                   "1 host->device copy"):
        assert needle in out, needle
    assert "[ 0, 1, 2,42,75,75,75]" in out.replace("  ", " ") or "[0,1,2,42,75,75,75]" in out.replace(" ", "")


def test_demo_on_meta_device(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--device", "meta"]) == 0
    assert "device:meta" in capsys.readouterr().out


def test_bench_quick_runs_and_json_parses(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    rc = main(["bench", "--quick", "--reps", "2", "--no-progress", "--device", "cpu", "--scenario", "decode",
               "--scenario", "staging", "--json", str(out)])
    assert rc == 0
    table = capsys.readouterr().out
    assert "median us" in table and "attnmeta" in table and "per-tensor" in table
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert {r["path"] for r in rows} == {"attnmeta", "reference", "per-tensor", "fused"}
    assert {r["path"] for r in rows if r["scenario"] == "staging-8-arrays"} == {"attnmeta", "reference", "per-tensor"}
    assert {r["scenario"] for r in rows} == {"decode", "staging-8-arrays"}
    fused = {r["batch"]: r for r in rows if r["path"] == "fused"}
    for r in rows:
        assert r["median_us"] > 0 and r["p99_us"] >= r["median_us"] * 0.999
        if r["path"] in ("attnmeta", "fused"):
            assert r["h2d_per_step"] == 1.0 and r["syncs_per_step"] == 0.0
        if r["path"] == "attnmeta" and r["scenario"] == "decode":
            # The same step; the fused builder's block table is up to 7 columns wider (its default
            # table_column_step rounds the width up to 8), and the fields after it start up to one
            # 64-byte alignment later.
            extra = fused[r["batch"]]["bytes_per_step"] - r["bytes_per_step"]
            assert 0 <= extra <= 28 * r["batch"] + 64, (r["batch"], extra)
        if r["path"] == "reference":
            assert r["syncs_per_step"] > 0


def test_audit_cli_is_clean(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["audit", "--device", "meta", "--batches", "2"]) == 0
    out = capsys.readouterr().out
    assert "clean" in out and "flashinfer" in out and "mamba2" in out
