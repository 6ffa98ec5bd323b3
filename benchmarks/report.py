"""Turn ``python -m attnmeta bench --json FILE`` output into the Markdown tables of docs/benchmarks.md
(and, with ``--plot``, its scaling plot).

Usage: ``python benchmarks/report.py bench.json [--ratios] [--plot out.png]``: the table of host times
(median / p99 per path, the ratios, syncs and copies), or with ``--ratios`` the ratios, syncs and
copies alone (how the page quotes a machine whose absolute times mean little elsewhere).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

if importlib.util.find_spec("attnmeta") is None:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attnmeta.bench.report import (
    PlotUnavailableError,
    markdown_table,
    plot,
    ratio_table,
    read_json,
    require_matplotlib,
)


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0].replace("``", ""))
    ap.add_argument("json", help="a file written by python -m attnmeta bench --json")
    ap.add_argument("--ratios", action="store_true", help="the ratios, syncs and copies only (no absolute times)")
    ap.add_argument("--plot", default=None, metavar="FILE.png", help="also write the plot (needs matplotlib)")
    args = ap.parse_args()
    if args.plot:
        try:
            require_matplotlib()
        except PlotUnavailableError as e:
            ap.error(f"--plot: {e}")
    info, rows = read_json(args.json)
    when = f", {info['date']}" if "date" in info else ""
    print(f"device: {info['device_name']} ({info['device']}), torch {info['torch']}{when}\n")
    print(ratio_table(rows) if args.ratios else markdown_table(rows))
    if args.plot:
        plot(rows, args.plot, title=f"attnmeta bench, {info['device_name']}{when}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
