"""Turn ``python -m attnmeta bench --json FILE`` output into a Markdown table and a scaling plot.

Usage: python benchmarks/report.py bench.json [--plot out.png]
"""

from __future__ import annotations

import argparse
import json

from attnmeta.bench import BenchRow, _plot


def markdown(rows: list[BenchRow]) -> str:
    """One Markdown table: per (scenario, batch) the paths side by side, with speedups over attnmeta's
    composable path (and a ``fused`` column where the scenario has that path)."""
    by = {(r.scenario, r.batch, r.path): r for r in rows}
    keys = sorted({(r.scenario, r.batch) for r in rows}, key=lambda k: ([r.scenario for r in rows].index(k[0]), k[1]))
    out = ["| scenario | batch | attnmeta median / p99 us | fused median / p99 us | per-tensor median / p99 us "
           "| reference median / p99 us | vs per-tensor | vs reference | syncs/step (attnmeta, per-tensor, ref) "
           "| H2D/step (a, p, r) | KB/step |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---|---|---:|"]
    for s, b in keys:
        a, p, r = (by.get((s, b, x)) for x in ("attnmeta", "per-tensor", "reference"))
        if a is None or p is None or r is None:
            continue
        f = by.get((s, b, "fused"))
        fused = "-" if f is None else f"{f.median_us:.0f} / {f.p99_us:.0f}"
        out.append(
            f"| {s} | {b} | {a.median_us:.0f} / {a.p99_us:.0f} | {fused} | {p.median_us:.0f} / {p.p99_us:.0f} | "
            f"{r.median_us:.0f} / {r.p99_us:.0f} | {p.median_us / a.median_us:.1f}x | {r.median_us / a.median_us:.1f}x | "
            f"{a.syncs_per_step:g}, {p.syncs_per_step:g}, {r.syncs_per_step:g} | "
            f"{a.h2d_per_step:g}, {p.h2d_per_step:g}, {r.h2d_per_step:g} | {a.bytes_per_step / 1024:.1f} |"
        )
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("json")
    ap.add_argument("--plot", default=None)
    args = ap.parse_args()
    with open(args.json) as f:
        data = json.load(f)
    rows = [BenchRow(**r) for r in data["rows"]]
    print(f"device: {data['device_name']} ({data['device']}), torch {data['torch']}\n")
    print(markdown(rows))
    if args.plot:
        _plot(rows, args.plot)


if __name__ == "__main__":
    main()
