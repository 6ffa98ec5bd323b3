"""The command line as a user meets it, and the bench's scenarios.

demo: readable output, every registered builder shown, a clear error for a device this machine lacks.
bench: --quick runs and its JSON parses; --scenario lists the names and rejects unknown ones; --plot
without matplotlib stops before anything runs; the plot draws every scenario, one colour per path.
audit: clean. warmup: a progress line per stage and a summary on stderr (--quiet: the summary only),
unknown builders rejected before anything runs. --help: plain text, no markup. Every registered builder has a bench scenario, and a
builder that is not built in is benchmarked against its reference by the same machinery.

Timings are never asserted (performance lives in benchmarks, not tests).
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import attnmeta
from attnmeta import BatchSpec, Builder, Staged, StagedCommon, Step
from attnmeta.__main__ import main
from attnmeta.bench import BenchRow, builder_cases, builder_scenarios, measure, scenario_names
from attnmeta.bench import cli as bench_cli
from attnmeta.bench.report import panels, path_colours
from attnmeta.testing.lab import register_lab, unregister_lab


def _exit_code(argv: list[str]) -> int:
    with pytest.raises(SystemExit) as e:
        main(argv)
    return int(e.value.code or 0)


def test_no_command_prints_the_commands(capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m attnmeta`` alone lists the commands (it once printed only argparse's "required" error)
    and fails with status 2, as a missing argument does."""
    assert main([]) == 2
    err = capsys.readouterr().err
    assert all(cmd in err for cmd in ("demo", "bench", "audit", "warmup")) and "COMMAND --help" in err, err


# ------------------------------------------------------------------------------------------- demo
def test_demo_prints_every_field(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    for needle in ("CommonAttentionMetadata", "query_start_loc", "slot_mapping", "FlashAttentionMetadata",
                   "FlashInferMetadata", "paged_kv_indices", "1 host->device copy"):
        assert needle in out, needle
    for name, b in attnmeta.registry().items():  # every registered builder, with its metadata type
        assert f"(builder {name!r})" in out and b.metadata_type.__name__ in out, name
    assert "[ 0, 1, 2,42,75,75,75]" in out.replace("  ", " ") or "[0,1,2,42,75,75,75]" in out.replace(" ", "")


def test_demo_renders_a_none_field_one_way(capsys: pytest.CaptureFixture[str]) -> None:
    """A field that is None reads ``None`` in the values column with ``-`` for where, dtype and shape,
    whatever its kind (device, host or scalar)."""
    assert main(["demo", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "NoneType" not in out
    nones = [line.split() for line in out.splitlines() if line.rstrip().endswith(" None") and "(" not in line]
    assert len(nones) > 10
    assert all(cells[1:] == ["-", "-", "-", "None"] for cells in nones), [c for c in nones if c[1:] != ["-"] * 3 + ["None"]]


def test_demo_tables_line_up_under_their_headers(capsys: pytest.CaptureFixture[str]) -> None:
    """Every table's columns start where its header's do, also in a table whose values are all narrower
    than a header word (a builder with only scalars and None fields: the columns once started at the
    values' width and the header ran past them)."""
    assert main(["demo", "--device", "cpu"]) == 0
    lines = capsys.readouterr().out.splitlines()
    heads = [i for i, line in enumerate(lines) if line.startswith("field ") and line.rstrip().endswith("values")]
    assert len(heads) == len(attnmeta.registry()) + 1, len(heads)  # (the common metadata's and each builder's)
    for i in heads:
        head = lines[i]
        starts = [head.index(word) for word in ("where", "dtype", "shape", "values")]
        rows = list(itertools.takewhile(lambda line: line.strip() and not line.startswith("options: "), lines[i + 1:]))
        assert rows, head
        for row in rows:
            for at in starts:  # (each column: two spaces of padding before it, its cell starting there)
                assert row[at - 2 : at] == "  " and row[at] != " ", (head, row)


def test_demo_on_meta_device(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--device", "meta"]) == 0
    assert "device:meta" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["demo", "bench", "audit", "warmup"])
def test_cuda_without_a_gpu_is_a_clear_error(command: str, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _exit_code([command, "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "no CUDA device is available" in err and "--device cpu" in err and "Traceback" not in err


def test_a_device_that_does_not_exist_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert _exit_code(["demo", "--device", "gpu0"]) == 2
    assert "'gpu0' is not a device" in capsys.readouterr().err
    assert _exit_code(["bench", "--device", "meta"]) == 2  # the bench times real data
    assert "use one of cuda, cpu" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------- help
HELP = [["--help"], ["demo", "--help"], ["bench", "--help"], ["audit", "--help"], ["warmup", "--help"]]


@pytest.mark.parametrize("argv", HELP, ids=lambda a: " ".join(a))
def test_help_is_plain_text(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert _exit_code(argv) == 0
    out = capsys.readouterr().out
    assert "usage: python -m attnmeta" in out
    assert "``" not in out, out
    assert not re.search(r":[a-z]+:`", out), out  # no Sphinx roles (:func:`...`, :class:`...`)


def test_bench_help_lists_every_scenario(capsys: pytest.CaptureFixture[str]) -> None:
    assert _exit_code(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    listed = out[out.index("scenarios:"):]
    names = re.findall(r"[\w:.-]+", listed.split(":", 1)[1])
    assert names == scenario_names()
    assert "builder:flash_attn" in names and "decode" in names


def test_unknown_scenario_is_an_argparse_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert _exit_code(["bench", "--scenario", "decode", "--scenario", "decod"]) == 2
    err = capsys.readouterr().err
    assert "--scenario: no scenario named 'decod'" in err and "builder:flashinfer" in err and "Traceback" not in err
    assert "pass its module with --import" in err


def test_bench_of_a_users_builder_by_name_after_import(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``--scenario builder:NAME`` of a builder that ``--import`` registers: the parser fixed the names
    to the built-in ones before the module was imported, so it refused the name the docs tell one to
    pass; ``--help`` with ``--import`` did not list it either."""
    (tmp_path / "my_bench_builders.py").write_text(
        "import attnmeta\n"
        "from attnmeta.backends.flash_attn import FLASH_ATTN\n"
        "class Mine(type(FLASH_ATTN)):\n"
        "    name = 'mine_via_bench'\n"
        "attnmeta.register(Mine())\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert _exit_code(["bench", "--help", "--import", "my_bench_builders"]) == 0
        assert "builder:mine_via_bench" in capsys.readouterr().out
        assert main(["bench", "--import", "my_bench_builders", "--scenario", "builder:mine_via_bench", "--quick",
                     "--device", "cpu", "--no-progress", "--reps", "1"]) == 0
        rows = [ln.split()[0] for ln in capsys.readouterr().out.splitlines() if ln.startswith("builder:")]
        assert rows and set(rows) == {"builder:mine_via_bench"}
    finally:
        if "mine_via_bench" in attnmeta.registry():
            attnmeta.unregister("mine_via_bench")


def test_bench_and_demo_refuse_bad_values_before_running(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A ``--json`` into a folder that does not exist failed with a traceback after the whole run, and
    ``demo --limit 0`` (or negative) printed broken arrays."""
    assert _exit_code(["bench", "--scenario", "staging", "--json", str(tmp_path / "no" / "x.json")]) == 2
    assert f"--json {tmp_path / 'no' / 'x.json'}: the folder {tmp_path / 'no'} does not exist" in capsys.readouterr().err
    for limit in ("0", "-3"):
        assert _exit_code(["demo", "--limit", limit]) == 2
        assert f"--limit: expected an int >= 1 (values shown per array), got {limit}" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------- bench
def test_bench_runs_under_pytest_in_a_fresh_process() -> None:
    """The bench's baselines upload read-only arrays with ``torch.as_tensor``, whose warning (issued once
    a process) the project's pytest filters turn into an error everywhere but in ``attnmeta.bench``. A
    fresh process that runs the bench test first must pass: pytest's per-test filters used to override
    the harness's own, so the test failed whenever no earlier test in its process had triggered the
    warning (found by the suite's run on two workers)."""
    import os
    import subprocess

    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                        "tests/test_cli.py::test_bench_quick_runs_and_json_parses"],
                       cwd=root, capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, ATTNMETA_HYPOTHESIS_PROFILE="dev"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "1 passed" in r.stdout


class _Stream(io.StringIO):
    """stderr as a terminal (``tty=True``) or as a log file or a pipe."""

    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.mark.parametrize("tty", [True, False])
def test_bench_progress_is_a_line_per_case_in_a_log_and_one_line_on_a_terminal(
        tty: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A terminal's progress line is rewritten in place and cleared at the end; a log (stderr not a
    terminal) gets one plain line per case, with no carriage returns (they once ran into one long line)."""
    from attnmeta.bench import harness

    cases = builder_cases(attnmeta.registry()["flash_attn"], torch.device("cpu"), quick=True)[:2]
    err = _Stream(tty)
    monkeypatch.setattr(sys, "stderr", err)
    harness.measure(cases, torch.device("cpu"), reps=1, warmup=0, count_steps=1, progress=True)
    text = err.getvalue()
    names = [f"[{i + 1}/2] {c.scenario} batch={c.batch}" for i, c in enumerate(cases)]
    if tty:
        assert "\n" not in text and text.count("\r") >= 3 and text.endswith("\r"), repr(text)
        assert all(n in text for n in names), repr(text)
    else:
        assert "\r" not in text and text.splitlines() == names, repr(text)


def test_bench_quick_runs_and_json_parses(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    rc = main(["bench", "--quick", "--reps", "2", "--no-progress", "--device", "cpu", "--scenario", "decode",
               "--scenario", "staging", "--json", str(out)])
    assert rc == 0
    table = capsys.readouterr().out
    assert "median us" in table and "attnmeta" in table and "per-tensor" in table
    assert table.rstrip().endswith(bench_cli.CPU_NOTE)  # a CPU bench says why uploads look free
    data = json.loads(out.read_text())
    assert data["device"] == "cpu" and data["date"] and data["torch"] == torch.__version__
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
            # The same step; the fused builder's block table, and its page indices staged at the table's
            # capacity, are wider by what its default table_column_step adds: up to 7 columns, or under a
            # quarter of the longest request's blocks past 64 (at most 32 of the decode scenario's 128),
            # 4 bytes a row each; the fields after them start up to one 64-byte alignment later.
            extra = fused[r["batch"]]["bytes_per_step"] - r["bytes_per_step"]
            assert 0 <= extra <= 2 * 4 * 32 * r["batch"] + 64, (r["batch"], extra)
        if r["path"] == "reference":
            assert r["syncs_per_step"] > 0
        if r["path"] == "per-tensor":
            assert r["h2d_per_step"] >= 3 and r["syncs_per_step"] == 0.0


def test_plot_without_matplotlib_stops_before_the_bench_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    ran: list[Any] = []

    def run_bench(**kw: Any) -> list[BenchRow]:
        ran.append(kw)
        return []

    monkeypatch.setattr(bench_cli, "run_bench", run_bench)
    out = tmp_path / "bench.json"
    assert _exit_code(["bench", "--device", "cpu", "--scenario", "staging", "--plot", str(tmp_path / "p.png"),
                       "--json", str(out)]) == 2
    err = capsys.readouterr().err
    assert "pip install 'attnmeta[plot]'" in err and "Traceback" not in err
    assert ran == [] and not out.exists()


def _rows() -> list[BenchRow]:
    spec = [("decode", 1, "attnmeta", 20.0), ("decode", 64, "attnmeta", 30.0), ("decode", 64, "fused", 15.0),
            ("decode", 1, "reference", 900.0), ("staging-8-arrays", 8, "per-tensor", 50.0),
            ("staging-8-arrays", 8, "attnmeta", 10.0), ("builder:toy", 4, "mine", 5.0)]
    return [BenchRow(s, b, p, t, 2 * t, 0.0, 1.0, 100.0, 0, 5) for s, b, p, t in spec]


def test_plot_panels_cover_every_scenario_and_colours_are_per_path() -> None:
    rows = _rows()
    drawn = panels(rows)
    assert list(drawn) == ["decode", "staging-8-arrays", "builder:toy"]  # single-batch scenarios too
    assert drawn["decode"] == {"attnmeta": [(1, 20.0), (64, 30.0)], "fused": [(64, 15.0)],
                               "reference": [(1, 900.0)]}
    colours = path_colours([r.path for r in rows])
    assert len(set(colours.values())) == len(colours)  # one colour per path ...
    assert path_colours([r.path for r in reversed(rows)])["attnmeta"] == colours["attnmeta"]  # ... in any plot


def test_plot_draws_every_scenario_in_one_colour_per_path(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="matplotlib not installed (pip install 'attnmeta[plot]')")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from attnmeta.bench.report import plot

    figures: list[Any] = []
    real_close = plt.close
    plt.close = lambda fig=None: figures.append(fig)  # type: ignore[assignment]  # keep the figure to inspect
    try:
        plot(_rows(), tmp_path / "p.png", title="test")
    finally:
        plt.close = real_close  # type: ignore[assignment]
    assert (tmp_path / "p.png").stat().st_size > 0
    fig = figures[0]
    axes = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in axes] == ["decode", "staging-8-arrays", "builder:toy"]
    seen: dict[str, set[Any]] = {}
    for ax in axes:
        for line in ax.get_lines():
            seen.setdefault(line.get_label(), set()).add(matplotlib.colors.to_hex(line.get_color()))
    assert set(seen) == {"attnmeta", "fused", "reference", "per-tensor", "mine"}
    assert all(len(c) == 1 for c in seen.values()), seen
    assert len({next(iter(c)) for c in seen.values()}) == len(seen)
    real_close(fig)


# ------------------------------------------------------------------------------------------- audit
def test_audit_cli_is_clean(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["audit", "--device", "meta", "--batches", "2"]) == 0
    out = capsys.readouterr().out
    assert "clean" in out
    for name in attnmeta.registry():
        assert name in out, name


# ------------------------------------------------------------------------------------------- warmup
def test_warmup_prints_a_line_per_stage_and_a_summary(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["warmup", "--builder", "flash_attn", "--builder", "mamba2"]) == 0
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    stages = [re.match(r"warmup: (.+) \((\d+)/(\d+)\) [\d.]+ s, (\d+) builds, (\d+) compiled, (\d+) loaded$", line)
              for line in lines[:-1]]
    assert all(stages), lines
    names = [m.group(1) for m in stages if m]
    assert names[:5] == ["BatchSpec", "common", "flash_attn", "mamba2", "fused"], names
    assert [int(m.group(2)) for m in stages if m] == list(range(1, len(names) + 1))
    assert {int(m.group(3)) for m in stages if m} == {len(names)}
    assert all(int(m.group(4)) > 0 for m in stages if m)
    assert re.fullmatch(rf"warmup: {len(names)} stages, \d+ builds in [\d.]+ s: \d+ kernel specializations "
                        r"compiled, \d+ loaded from the cache \(.+\)", lines[-1]), lines[-1]


def test_warmup_quiet_prints_the_summary_only(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["warmup", "--quiet", "--builder", "flash_attn"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("warmup: ") and "kernel specializations compiled" in err[0], err


def test_warmup_of_an_unknown_builder_is_an_argparse_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert _exit_code(["warmup", "--builder", "flash_atn"]) == 2
    err = capsys.readouterr().err
    assert "no builder named 'flash_atn'" in err and "flash_attn" in err and "warmup: BatchSpec" not in err
    assert "Traceback" not in err


# ------------------------------------------------------------------------------------------- registry scenarios
def test_every_registered_builder_has_a_bench_scenario() -> None:
    assert set(builder_scenarios()) == {f"builder:{n}" for n in attnmeta.registry()}
    assert set(builder_scenarios()) <= set(scenario_names())


@dataclasses.dataclass(frozen=True)
class _ToyOptions:
    prefix: str = "toy"
    factor: int = 2


class _Toy(Builder[_ToyOptions, None, None, torch.Tensor]):
    """A builder that is not built in: ``factor * seq_lens`` (int32, device)."""

    name = "toy_scaled_seq_lens"
    options_type = _ToyOptions
    metadata_type = torch.Tensor

    def derive(self, common: StagedCommon, step: Step, options: _ToyOptions, inputs: None) -> Staged[None, Any]:
        step.stage(options.prefix + ".scaled", common.host.seq_lens_cpu * options.factor)
        return Staged(step, None, lambda: step.device(options.prefix + ".scaled"))


def _toy_reference(spec: BatchSpec, options: _ToyOptions, device: torch.device, inputs: None) -> dict[str, Any]:
    from attnmeta.testing.reference import ref_common_fields

    return {"scaled": ref_common_fields(spec, device)["seq_lens"] * options.factor}


@pytest.fixture
def toy() -> Iterator[_Toy]:
    """The toy builder, registered with a lab reference for the test (and removed afterwards)."""
    b = attnmeta.register(_Toy())
    register_lab(b.name, reference=_toy_reference)
    try:
        yield b
    finally:
        unregister_lab(b.name)
        attnmeta.unregister(b.name)


def test_a_new_builder_is_benchmarked_against_its_reference(toy: _Toy) -> None:
    cases = builder_cases(toy, torch.device("cpu"), quick=True)
    assert [(c.scenario, c.batch, list(c.paths)) for c in cases] == [
        ("builder:toy_scaled_seq_lens", 4, ["attnmeta", "reference"]),
        ("builder:toy_scaled_seq_lens", 32, ["attnmeta", "reference"])]
    rows = measure(cases, torch.device("cpu"), reps=2, warmup=1, count_steps=2)
    by = {(r.batch, r.path): r for r in rows}
    for b in (4, 32):
        a, ref = by[(b, "attnmeta")], by[(b, "reference")]
        assert a.h2d_per_step == 1.0 and a.syncs_per_step == 0.0 and a.bytes_per_step and a.bytes_per_step > 0
        # The reference runs inside attnmeta.testing.reference (an oracle the CPU pass cannot see
        # into) and uploads on its own: nothing counted on CPU, rather than a wrong zero.
        assert ref.syncs_per_step is None and ref.h2d_per_step is None and ref.bytes_per_step is None
    # The attnmeta path builds the builder's metadata through the generic attnmeta.build.
    spec = BatchSpec(num_computed_tokens=[5, 0], num_scheduled_tokens=[1, 3], block_table=[[1, 2], [3, 4]],
                     block_size=4)
    assert attnmeta.build(spec, attnmeta.Stager("cpu"), toy).tolist() == [12, 6]
    assert [list(c.paths) for c in builder_cases(_Toy(), torch.device("cpu"), quick=True)] == [["attnmeta"]] * 2


def test_a_builder_whose_defaults_it_cannot_serve_is_named() -> None:
    class Picky(_Toy):
        name = "picky"

        def unsupported_reasons(self, spec: BatchSpec, options: _ToyOptions, inputs: None) -> list[str]:
            return ["no prefills, please"] if spec.max_query_len > 1 else []

    with pytest.raises(ValueError, match=r"builder:picky: the builder's defaults\(\) cannot serve .*no prefills"):
        builder_cases(Picky(), torch.device("cpu"), quick=True)


def test_import_loads_a_user_module_so_its_builder_is_registered(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A new process knows only the built-in builders: ``--import MODULE`` imports the user's module
    first (the commands had no way to find a builder of one's own)."""
    (tmp_path / "my_cli_builders.py").write_text(
        "import attnmeta\n"
        "from attnmeta.backends.flash_attn import FLASH_ATTN\n"
        "class Mine(type(FLASH_ATTN)):\n"
        "    name = 'mine_via_import'\n"
        "attnmeta.register(Mine())\n")
    (tmp_path / "broken_builders.py").write_text("raise RuntimeError('my module is broken')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert main(["audit", "--import", "my_cli_builders", "--batches", "1", "--device", "meta"]) == 0
        assert re.search(r"^mine_via_import\s+meta\s+1\s+0\s+0\s+0\s+0\s+clean$", capsys.readouterr().out, re.M)
    finally:
        if "mine_via_import" in attnmeta.registry():
            attnmeta.unregister("mine_via_import")
    assert _exit_code(["audit", "--import", "no_such_module_here"]) == 2
    assert "--import no_such_module_here: no module named 'no_such_module_here' here" in capsys.readouterr().err
    assert _exit_code(["demo", "--import", "broken_builders"]) == 2
    assert "--import broken_builders: RuntimeError: my module is broken (at " in capsys.readouterr().err
