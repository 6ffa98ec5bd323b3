"""Benchmarks: attnmeta against the ways engines build metadata, measured side by side.

``python -m attnmeta bench`` and the scripts in ``benchmarks/`` use this package; docs/benchmarks.md
says what each measures and quotes its figures. Its modules, each importing only those before it:

- :mod:`~attnmeta.bench.harness`: :class:`Case` (a scenario at one batch size: one callable per
  path, each one whole step), :class:`Uploads`, the interleaved timing (:func:`time_case`), the
  sync and copy counting (:func:`count_path`), :func:`measure` -> :class:`BenchRow`;
- :mod:`~attnmeta.bench.report`: :func:`format_table`, :func:`markdown_table`, :func:`plot`,
  :func:`write_json` / :func:`read_json`;
- :mod:`~attnmeta.bench.mamba2`: the Mamba2 prefill-step workload and its cases (three builder
  configurations, :data:`~attnmeta.bench.mamba2.MODES`);
- :mod:`~attnmeta.bench.scenarios`: the curated scenarios (staging, decode with the fused path,
  mixed, spec decode, fast prefill, local attention, the common metadata alone, Mamba2);
- :mod:`~attnmeta.bench.builders`: a scenario ``builder:<name>`` for every registered builder;
- :mod:`~attnmeta.bench.suite`: every scenario by name, :func:`run_bench`;
- :mod:`~attnmeta.bench.cli`: the ``bench`` sub-command.

Examples
--------
>>> rows = run_bench(device="cpu", scenarios=["staging"], quick=True, progress=False)
>>> sorted(r.path for r in rows)
['attnmeta', 'per-tensor', 'reference']
>>> [r.h2d_per_step for r in rows if r.path == "attnmeta"]
[1.0]
"""

from attnmeta.bench.builders import builder_cases, builder_scenarios
from attnmeta.bench.cli import add_arguments, argument_error, run_from_args
from attnmeta.bench.harness import (
    BenchRow,
    Case,
    Counts,
    Uploads,
    blocking_uploader,
    count_path,
    measure,
    pinned_uploader,
    time_case,
)
from attnmeta.bench.report import format_table, markdown_table, plot, read_json, write_json
from attnmeta.bench.scenarios import decode_walks, fused_step, spec_decode_walks
from attnmeta.bench.suite import run_bench, scenario_names, scenarios

__all__ = [
    "BenchRow",
    "Case",
    "Counts",
    "Uploads",
    "add_arguments",
    "argument_error",
    "blocking_uploader",
    "builder_cases",
    "builder_scenarios",
    "count_path",
    "decode_walks",
    "format_table",
    "fused_step",
    "markdown_table",
    "measure",
    "pinned_uploader",
    "plot",
    "read_json",
    "run_bench",
    "run_from_args",
    "scenario_names",
    "scenarios",
    "spec_decode_walks",
    "time_case",
    "write_json",
]
