"""Presenting bench rows: a fixed-width table, a Markdown table, a JSON file and a scaling plot.

Ratios are always between paths of the same run: ``vs reference`` is the reference path's median
over attnmeta's at the same scenario and batch, ``vs per-tensor`` the per-tensor path's.

Examples
--------
>>> rows = [BenchRow("decode", 1, "attnmeta", 20.0, 40.0, 0.0, 1.0, 2048.0, 0, 100),
...         BenchRow("decode", 1, "reference", 1000.0, 1500.0, 20.0, 3.0, None, 0, 100)]
>>> print(markdown_table(rows))  # doctest: +NORMALIZE_WHITESPACE
| scenario | batch | attnmeta median / p99 us | fused median / p99 us | per-tensor median / p99 us | reference median / p99 us | vs per-tensor | vs reference | syncs/step (attnmeta, per-tensor, ref) | H2D/step (a, p, r) | KB/step |
|---|---:|---:|---:|---:|---:|---:|---:|---|---|---:|
| decode | 1 | 20 / 40 | - | - | 1000 / 1500 | - | 50.0x | 0, -, 20 | 1, -, 3 | 2.0 |
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
from pathlib import Path
from typing import Any

from attnmeta.bench.harness import BenchRow

__all__ = [
    "PATH_ORDER",
    "PlotUnavailableError",
    "format_table",
    "markdown_table",
    "panels",
    "path_colours",
    "plot",
    "ratio_table",
    "read_json",
    "require_matplotlib",
    "write_json",
]

PATH_ORDER = ("attnmeta", "fused", "per-tensor", "reference")
"""The paths the scenarios use, in the order tables and legends list them (others follow)."""

_INSTALL_HINT = "pip install 'attnmeta[plot]'"


class PlotUnavailableError(ImportError):
    """A plot was asked for, but matplotlib (the ``plot`` extra) is not installed."""


def require_matplotlib() -> None:
    """Check that :func:`plot` can run.

    Raises
    ------
    PlotUnavailableError
        matplotlib is not installed; the message says how to install it (the ``plot`` extra).
    """
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise PlotUnavailableError(
            f"plotting needs matplotlib, which is not installed: {_INSTALL_HINT} (the 'plot' extra)"
        ) from e


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def format_table(rows: list[BenchRow]) -> str:
    """A readable fixed-width table, with each path's speedup over ``reference`` at the same batch.

    Parameters
    ----------
    rows : list of BenchRow
        One run's rows.

    Returns
    -------
    str
        One line per row after a header; counts that were not measured print as ``-``.
    """
    ref = {(r.scenario, r.batch): r.median_us for r in rows if r.path == "reference"}
    width = max([16, *(len(r.scenario) for r in rows)])
    head = (f"{'scenario':<{width}} {'batch':>6} {'path':<11} {'median us':>10} {'p99 us':>9} {'vs ref':>7} "
            f"{'syncs':>6} {'H2D':>5} {'bytes':>9} {'waits':>5}")
    out = [head, "-" * len(head)]
    for r in rows:
        base = ref.get((r.scenario, r.batch))
        speed = f"{base / r.median_us:6.1f}x" if base and r.path != "reference" else "      -"
        out.append(
            f"{r.scenario:<{width}} {r.batch:>6} {r.path:<11} {r.median_us:>10.1f} {r.p99_us:>9.1f} {speed:>7} "
            f"{_fmt(r.syncs_per_step, '.1f'):>6} {_fmt(r.h2d_per_step, '.1f'):>5} {_fmt(r.bytes_per_step, '.0f'):>9} "
            f"{r.waits:>5}"
        )
    return "\n".join(out)


def _groups(rows: list[BenchRow]) -> list[tuple[str, int, BenchRow, BenchRow | None, BenchRow | None, BenchRow | None]]:
    """Per (scenario, batch) with an ``attnmeta`` row, in the run's scenario order then by batch:
    ``(scenario, batch, attnmeta, fused, per-tensor, reference)`` (None for a missing path)."""
    by = {(r.scenario, r.batch, r.path): r for r in rows}
    order = list(dict.fromkeys(r.scenario for r in rows))
    keys = sorted({(r.scenario, r.batch) for r in rows}, key=lambda k: (order.index(k[0]), k[1]))
    return [(s, b, by[(s, b, "attnmeta")], by.get((s, b, "fused")), by.get((s, b, "per-tensor")),
             by.get((s, b, "reference"))) for s, b in keys if (s, b, "attnmeta") in by]


def _counts(field: str, paths: tuple[BenchRow | None, ...]) -> str:
    """A per-step count of each path, ``-`` where the path is missing or the count was not measured."""
    vals = [None if x is None else getattr(x, field) for x in paths]
    return ", ".join("-" if v is None else f"{v:g}" for v in vals)


def markdown_table(rows: list[BenchRow]) -> str:
    """One Markdown table: per (scenario, batch) the paths side by side, with the per-tensor and
    reference paths' medians over attnmeta's (the table of docs/benchmarks.md).

    Parameters
    ----------
    rows : list of BenchRow
        One run's rows; (scenario, batch) pairs without an ``attnmeta`` row are left out.

    Returns
    -------
    str
        The table; ``-`` where a scenario has no such path or a count was not measured.
    """
    out = ["| scenario | batch | attnmeta median / p99 us | fused median / p99 us | per-tensor median / p99 us "
           "| reference median / p99 us | vs per-tensor | vs reference | syncs/step (attnmeta, per-tensor, ref) "
           "| H2D/step (a, p, r) | KB/step |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---|---|---:|"]
    for s, b, a, f, p, r in _groups(rows):

        def times(x: BenchRow | None) -> str:
            return "-" if x is None else f"{x.median_us:.0f} / {x.p99_us:.0f}"

        def ratio(x: BenchRow | None, a: BenchRow = a) -> str:
            return "-" if x is None else f"{x.median_us / a.median_us:.1f}x"

        def counts(field: str, a: BenchRow = a, p: BenchRow | None = p, r: BenchRow | None = r) -> str:
            return _counts(field, (a, p, r))

        kb = "-" if a.bytes_per_step is None else f"{a.bytes_per_step / 1024:.1f}"
        out.append(f"| {s} | {b} | {times(a)} | {times(f)} | {times(p)} | {times(r)} | {ratio(p)} | {ratio(r)} | "
                   f"{counts('syncs_per_step')} | {counts('h2d_per_step')} | {kb} |")
    return "\n".join(out)


def ratio_table(rows: list[BenchRow]) -> str:
    """One Markdown table of ratios only (medians of one run over each other), with the syncs and
    copies per step: the form in which docs/benchmarks.md quotes a run on a machine whose absolute
    times mean little elsewhere.

    Parameters
    ----------
    rows : list of BenchRow
        One run's rows; (scenario, batch) pairs without an ``attnmeta`` row are left out.

    Returns
    -------
    str
        Columns: reference over attnmeta, per-tensor over attnmeta, attnmeta over fused (how many
        times faster the fused path is), then syncs and H2D copies per step of attnmeta, fused,
        per-tensor and reference; ``-`` where a scenario has no such path or a count was not measured.

    Examples
    --------
    >>> rows = [BenchRow("decode", 1, "attnmeta", 30.0, 60.0, 0.0, 1.0, 2048.0, 0, 100),
    ...         BenchRow("decode", 1, "fused", 15.0, 40.0, 0.0, 1.0, 2048.0, 0, 100),
    ...         BenchRow("decode", 1, "reference", 1500.0, 2000.0, 20.0, 3.0, None, 0, 100)]
    >>> print(ratio_table(rows).splitlines()[-1])
    | decode | 1 | 50.0x | - | 2.0x | 0, 0, -, 20 | 1, 1, -, 3 |
    """
    out = ["| scenario | batch | reference / attnmeta | per-tensor / attnmeta | attnmeta / fused "
           "| syncs/step (attnmeta, fused, per-tensor, ref) | H2D/step (a, f, p, r) |",
           "|---|---:|---:|---:|---:|---|---|"]
    for s, b, a, f, p, r in _groups(rows):

        def over(x: BenchRow | None, y: BenchRow | None) -> str:
            return "-" if x is None or y is None else f"{x.median_us / y.median_us:.1f}x"

        def counts(field: str, a: BenchRow = a, f: BenchRow | None = f, p: BenchRow | None = p,
                   r: BenchRow | None = r) -> str:
            return _counts(field, (a, f, p, r))

        out.append(f"| {s} | {b} | {over(r, a)} | {over(p, a)} | {over(a, f)} | {counts('syncs_per_step')} | "
                   f"{counts('h2d_per_step')} |")
    return "\n".join(out)


def write_json(path: str | os.PathLike[str], rows: list[BenchRow], *, device: str, device_name: str) -> None:
    """Write a run's rows and where it ran (device, versions, date) as JSON.

    Parameters
    ----------
    path : str or path-like
        The file to write.
    rows : list of BenchRow
        The run's rows.
    device : str
        The device the run used (``cuda``, ``cpu``).
    device_name : str
        Its name (``torch.cuda.get_device_name``, or ``cpu``).
    """
    import numba
    import numpy
    import torch

    data = {
        "device": device, "device_name": device_name, "date": datetime.date.today().isoformat(),
        "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
        "python": platform.python_version(), "torch": torch.__version__, "numba": numba.__version__,
        "numpy": numpy.__version__, "rows": [dataclasses.asdict(r) for r in rows],
    }
    Path(path).write_text(json.dumps(data, indent=1) + "\n")


def read_json(path: str | os.PathLike[str]) -> tuple[dict[str, Any], list[BenchRow]]:
    """Read a file :func:`write_json` (``python -m attnmeta bench --json``) wrote.

    Parameters
    ----------
    path : str or path-like
        The file.

    Returns
    -------
    (dict, list of BenchRow)
        Where the run ran (every key but ``rows``; files of older versions lack some), and its rows.
    """
    data = json.loads(Path(path).read_text())
    rows = [BenchRow(**r) for r in data.pop("rows")]
    return data, rows


def path_colours(paths: list[str]) -> dict[str, str]:
    """One colour per path, the same in every panel and every plot: :data:`PATH_ORDER` first,
    then any other path in the order given.

    Parameters
    ----------
    paths : list of str
        The paths to colour.

    Returns
    -------
    dict of str to str
        Matplotlib colour names (``C0``, ``C1``, ...) by path.

    Examples
    --------
    >>> path_colours(["reference", "attnmeta", "mine"])
    {'attnmeta': 'C0', 'fused': 'C1', 'per-tensor': 'C2', 'reference': 'C3', 'mine': 'C4'}
    """
    extra = [p for p in dict.fromkeys(paths) if p not in PATH_ORDER]
    return {p: f"C{i % 10}" for i, p in enumerate((*PATH_ORDER, *extra))}


def panels(rows: list[BenchRow]) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """What :func:`plot` draws: per scenario (every one, in the order of the rows), per path (in the
    order of :func:`path_colours`), the (batch, median host microseconds) points sorted by batch.

    Parameters
    ----------
    rows : list of BenchRow
        One run's rows.

    Returns
    -------
    dict of str to dict of str to list of (int, float)
        ``panels(rows)[scenario][path]``.

    Examples
    --------
    >>> rows = [BenchRow("decode", b, p, t, t, 0.0, 1.0, 0.0, 0, 5)
    ...         for b, p, t in [(64, "reference", 900.0), (1, "attnmeta", 20.0), (64, "attnmeta", 30.0)]]
    >>> panels(rows + [BenchRow("staging", 8, "attnmeta", 9.0, 9.0, 0.0, 1.0, 0.0, 0, 5)])
    {'decode': {'attnmeta': [(1, 20.0), (64, 30.0)], 'reference': [(64, 900.0)]}, 'staging': {'attnmeta': [(8, 9.0)]}}
    """
    order = list(path_colours([r.path for r in rows]))
    out: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for s in dict.fromkeys(r.scenario for r in rows):
        mine = [r for r in rows if r.scenario == s]
        present = {r.path for r in mine}
        out[s] = {p: sorted((r.batch, r.median_us) for r in mine if r.path == p) for p in order if p in present}
    return out


def plot(rows: list[BenchRow], path: str | os.PathLike[str], *, title: str | None = None) -> None:
    """Write a PNG with one panel per scenario: each path's median host time against the batch
    size (log-log), one colour per path across all panels, one legend for the figure.

    A scenario measured at one batch size is drawn as one point per path.

    Parameters
    ----------
    rows : list of BenchRow
        One run's rows.
    path : str or path-like
        The PNG to write.
    title : str, optional
        The figure's title (e.g. the device and the date).

    Raises
    ------
    PlotUnavailableError
        matplotlib is not installed.
    """
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = panels(rows)
    if not series:
        raise ValueError("plot(): no rows to draw")
    colours = path_colours([r.path for r in rows])
    ncols = min(4, len(series))
    nrows = -(-len(series) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.4 * nrows + 0.8), squeeze=False)
    handles: dict[str, Any] = {}
    for ax, (s, lines) in zip(axes.flat, series.items()):
        for p, pts in lines.items():
            (line,) = ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", color=colours[p], label=p)
            handles.setdefault(p, line)
        ax.set_xscale("log")
        ax.set_yscale("log")
        batches = {b for pts in lines.values() for b, _ in pts}
        if len(batches) == 1:  # one batch size: centre its points
            (b,) = batches
            ax.set_xlim(b / 2, b * 2)
        ax.set_xlabel("batch (requests)")
        ax.set_ylabel("host us per step (median)")
        ax.set_title(s, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    for ax in list(axes.flat)[len(series):]:
        ax.set_visible(False)
    order = [p for p in colours if p in handles]
    height = 3.4 * nrows + 0.8  # inches: the panels, and 0.8 in at the top for the title and the legend
    fig.legend([handles[p] for p in order], order, loc="upper center", bbox_to_anchor=(0.5, 1 - 0.3 / height),
               ncol=len(order), frameon=False)
    if title:
        fig.suptitle(title, y=1 - 0.05 / height, fontsize=11, va="top")
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.65 / height))
    fig.savefig(path, dpi=110)
    plt.close(fig)
