"""ab_engine.py: the A/B of the engine's loop in one process (this checkout against another commit)."""

from __future__ import annotations

from bench_script_helpers import table_rows


def test_ab_engine_serves_the_same_requests_on_both_sides() -> None:
    # HEAD's engine and attnmeta (imported as engine_base / attnmeta_base, the script checks that the
    # base engine's composer is the base package's) against this checkout's: one table row per
    # concurrency, each side's metadata and step times, and the same greedy tokens on both sides.
    rows = table_rows("ab_engine.py", "HEAD", "--device", "cpu", "--model", "tiny", "--mode", "paged",
                      "--concurrency", "2", "--rounds", "2", "--new", "16", "--prompt", "8", "--warm", "1")
    assert [r[0] for r in rows] == ["2"]
    _reqs, base_ms, this_ms, ratio, paired, base_step, this_step, differ = rows[0]
    assert float(base_ms) > 0 and float(this_ms) > 0 and float(base_step) > 0 and float(this_step) > 0
    assert abs(float(ratio) - float(this_ms) / float(base_ms)) < 0.01
    assert float(paired) > 0
    assert differ == "0"
