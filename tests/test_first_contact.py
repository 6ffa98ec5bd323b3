"""What a new user meets first: a first run that speaks, sizes with bounds that name themselves,
errors instead of traps (issue 31, items 3 to 5). Each test fails on the code before its fix.

Timings are never asserted: the first-run tests check the order of what is printed, not how fast.
"""

from __future__ import annotations

import gc
import inspect
import os
import subprocess
import sys
import threading
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import attnmeta
from attnmeta import BatchSpec, Stager, StaticProfile, build_common, stage_common
from attnmeta._announce import announce
from attnmeta._numba import COMPILE_NOTE, compile_progress
from attnmeta.backends import flash_attn, mm_prefix
from attnmeta.backends.mamba import mamba2
from attnmeta.compose import Group, StepBuilder
from attnmeta.spec import MAX_PADDED_REQS, MAX_PADDED_TOKENS
from attnmeta.staging import (
    CapacityError,
    MultiStager,
    StepExpiredError,
    StepNotCommittedError,
    UncheckedBlockIdsWarning,
)
from attnmeta.staging._ring import ring_slots
from attnmeta.sync import AuditRow, AuditTable, format_audit_table

ROOT = Path(__file__).resolve().parents[1]
TABLE = np.arange(8, dtype=np.int32).reshape(2, 4)


def _spec(**kw: Any) -> BatchSpec:
    args: dict[str, Any] = dict(num_computed_tokens=[3, 0], num_scheduled_tokens=[1, 4], block_table=TABLE,
                                block_size=4)
    args.update(kw)
    return BatchSpec(**args)


# ------------------------------------------------------------------------------------- 3. a first run
def test_the_command_line_speaks_before_the_slow_imports(tmp_path: Path) -> None:
    """``python -m attnmeta demo`` on a cold numba cache: a line on stderr first (printed by the module
    the package imports before anything else, which imports nothing heavy), then the demo's title, then
    the compile progress, then the metadata."""
    init = (ROOT / "attnmeta" / "__init__.py").read_text()
    first = next(line for line in init.splitlines() if line.startswith(("import ", "from ")) and "typing" not in line)
    assert first.startswith("import attnmeta._announce")
    announcer = (ROOT / "attnmeta" / "_announce.py").read_text()
    assert {line for line in announcer.splitlines() if line.startswith(("import ", "from "))} == {
        "from __future__ import annotations", "import sys"}
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    r = subprocess.run([sys.executable, "-m", "attnmeta", "demo", "--device", "meta"], stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stdout
    lines = r.stdout.splitlines()
    assert lines[0] == "python -m attnmeta demo: loading torch and numba ..."
    assert lines[1] == "attnmeta demo: one step of a mixed batch, built on the host and staged in ONE copy"
    assert lines[2].startswith(COMPILE_NOTE) and " compiled in " in lines[2]
    assert "BatchSpec(num_reqs=4" in r.stdout


def test_announce_names_only_the_commands_that_take_a_while() -> None:
    assert announce(["python", "-m", "attnmeta", "audit", "--batches", "3"]) == \
        "python -m attnmeta audit: loading torch and numba ..."
    assert announce(["python", "-m", "attnmeta", "bench"]) is None
    assert announce(["python", "-m", "attnmeta", "demo", "-h"]) is None
    assert announce(["python", "-m", "pytest", "attnmeta"]) is None
    assert announce(["python", "-c", "import attnmeta"]) is None


def test_compile_progress_reports_compiles_and_stays_quiet_when_warm() -> None:
    from io import StringIO

    import numba

    out = StringIO()

    @numba.njit(cache=False)
    def fresh(x: int) -> int:  # never compiled before: one compile event
        return x + 1

    with compile_progress(out):
        fresh(1)
    text = out.getvalue()
    assert text.startswith(COMPILE_NOTE + " .") and text.rstrip().endswith("s") and " 1 compiled in " in text
    out = StringIO()
    with compile_progress(out):
        fresh(2)  # in memory now
    assert out.getvalue() == ""


def test_audit_prints_each_row_as_its_builder_finishes(capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The header comes first and each builder's row is printed (flushed) before the next builder runs."""
    from attnmeta.__main__ import main
    from attnmeta.sync import _targets

    seen: list[str] = []
    real = _targets.run_audit

    def spy(**kw: Any) -> Any:
        seen.append(capsys.readouterr().out)  # what was printed before this builder ran
        return real(**kw)

    monkeypatch.setattr("attnmeta.sync.run_audit", spy)
    assert main(["audit", "--device", "meta", "--batches", "1"]) == 0
    names = list(attnmeta.registry())
    assert seen[0].startswith("attnmeta sync audit: ") and "builder" in seen[0]
    assert names[0] in seen[1] and names[1] not in seen[1]  # the first row, before the second builder ran


def test_audit_header_and_table_agree_on_what_a_batch_is(capsys: pytest.CaptureFixture[str]) -> None:
    from attnmeta.__main__ import main

    assert main(["audit", "--device", "meta", "--batches", "2"]) == 0
    out = capsys.readouterr().out
    assert "x 2 batches of each kind" in out and "seeds" not in out
    assert "flash_attn    meta          2" in out


def test_audit_batches_below_one_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    from attnmeta.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(["audit", "--batches", "0"])
    assert e.value.code == 2
    assert "--batches: expected an int >= 1" in capsys.readouterr().err


def test_audit_table_rows_line_up_with_the_whole_table() -> None:
    rows = [AuditRow("flash_attn", "meta", 50), AuditRow("gdn", "meta", 50, syncs=3, first_problem="seed 1: x")]
    table = AuditTable(["flash_attn", "gdn"], ["meta"], [[50, 3, 0, 0, 0]])
    streamed = "\n".join([table.header(), *(table.row(r) for r in rows), "", table.problems(rows)])
    assert streamed == format_audit_table(rows)


# ------------------------------------------------------------------------------------- 4. bounds
def test_padding_past_its_bound_names_the_field() -> None:
    with pytest.raises(ValueError, match=r"num_tokens_padded: 268435456 is more than .*MAX_PADDED_TOKENS"):
        _spec(num_tokens_padded=2**28)
    with pytest.raises(ValueError, match=r"num_reqs_padded: 2147483647 is more than .*MAX_PADDED_REQS"):
        _spec(num_reqs_padded=2**31 - 1)
    assert _spec(num_reqs_padded=MAX_PADDED_REQS, num_tokens_padded=MAX_PADDED_TOKENS).padded_num_tokens == 1 << 24


def test_a_step_past_max_step_bytes_names_the_field_and_allocates_nothing() -> None:
    stager = Stager("cpu", max_step_bytes=1 << 20)
    with pytest.raises(CapacityError, match=r"common\.\w+: the step would stage .*max_step_bytes=1048576"):
        build_common(_spec(num_tokens_padded=1 << 20), stager)
    assert build_common(_spec(), stager).seq_lens_cpu.tolist() == [4, 4]  # the stager goes on
    assert max(s.host_np.shape[0] for s in ring_slots(stager)) <= 1 << 20  # type: ignore[union-attr]
    graph = Stager("cpu", profile=StaticProfile(max_num_reqs=4, max_num_tokens=1 << 18, max_blocks_per_req=4,
                                                block_size=4), max_step_bytes=1 << 20)
    with pytest.raises(CapacityError, match=r"the graph layout would take .*max_step_bytes"):
        build_common(_spec(), graph)


def test_stager_sizes_have_bounds() -> None:
    with pytest.raises(ValueError, match="num_slots: at most 64"):
        Stager("cpu", num_slots=10**6)
    with pytest.raises(ValueError, match="initial_bytes: 1099511627776 is more than max_step_bytes"):
        Stager("cpu", initial_bytes=2**40)
    with pytest.raises(ValueError, match="max_step_bytes: expected an int >= 64"):
        Stager("cpu", max_step_bytes=0)
    # a wrong type is a TypeError, as for every other argument (these were ValueErrors)
    with pytest.raises(TypeError, match=r"num_kv_blocks: expected an int >= 1 \(the KV cache's blocks\) or None, "
                                        r"got float 8.0"):
        Stager("cpu", num_kv_blocks=8.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="max_step_bytes: expected an int >= 64, got str '1024'"):
        Stager("cpu", max_step_bytes="1024")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="initial_bytes: expected an int >= 0, got bool True"):
        Stager("cpu", initial_bytes=True)


def test_an_unchecked_cuda_stager_warns_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a GPU the warning is checked on its own (tests/gpu checks it on a CUDA stager)."""
    from attnmeta.staging import _ring

    monkeypatch.setattr(_ring, "_WARNED", [])
    with pytest.warns(UncheckedBlockIdsWarning, match="num_kv_blocks"):
        _ring._warn_unchecked_block_ids()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _ring._warn_unchecked_block_ids()  # once per process


# ------------------------------------------------------------------------------------- 5. traps
def test_a_step_dropped_while_open_is_abandoned_by_the_next_with_a_warning() -> None:
    stager = Stager("cpu")
    stager.step().alloc("x", 3, np.int32)  # begun outside `with`, its object lost
    gc.collect()
    with pytest.warns(RuntimeWarning, match="dropped without a commit; it is abandoned"):
        common = build_common(_spec(), stager)
    assert common.query_start_loc_cpu.tolist() == [0, 1, 5] and stager.stats.copies == 1


@pytest.mark.parametrize("multi", [False, True], ids=["Stager", "MultiStager"])
def test_a_step_dropped_after_staging_metadata_is_abandoned_with_the_collector_off(multi: bool) -> None:
    """The metadata a step owns names the step (its lease): a reference cycle, which only the cycle
    collector frees. A loop that keeps the collector off, as docs/serving.md advises, still gets the
    dropped step abandoned by the next one, not an error asking it to commit a step it no longer holds."""
    stager = MultiStager(["cpu", "cpu"]) if multi else Stager("cpu")

    def begin_and_drop() -> None:
        stage_common(_spec(), stager.step())  # begun outside `with`, metadata staged, never committed

    gc.collect()
    gc.disable()
    try:
        begin_and_drop()
        with pytest.warns(RuntimeWarning, match="dropped without a commit; it is abandoned"):
            common = build_common(_spec(), stager)
    finally:
        gc.enable()
    assert common.seq_lens_cpu.tolist() == [4, 4] and stager.stats.copies == 1


def test_a_step_after_an_exception_says_it_was_abandoned() -> None:
    """Every use of a step an exception abandoned says so (it once said 'not committed' for the
    metadata and 'already committed' for the commit, and its repr said 'open')."""
    stager = Stager("cpu")
    with pytest.raises(KeyError), stager.step() as step:
        common = stage_common(_spec(), step)
        raise KeyError("the engine's own error")
    assert step.state == "abandoned" and "abandoned" in repr(step) and "abandoned" in repr(common)
    with pytest.raises(StepNotCommittedError, match="was abandoned"):
        common.result()
    with pytest.raises(RuntimeError, match="was abandoned"):
        step.commit()
    with pytest.raises(RuntimeError, match=r"flash_attn: stage\(\): step 1 was abandoned"):
        flash_attn.stage(common, step)
    with pytest.raises(RuntimeError, match="was abandoned"):
        step.alloc("x", 1, np.int32)
    with pytest.raises(RuntimeError, match="was abandoned"), step:
        pass
    with stager.step() as done:
        common = stage_common(_spec(), done)
    assert done.state == "committed"
    with pytest.raises(RuntimeError, match=r"flash_attn: stage\(\): step 2 has already committed"):
        flash_attn.stage(common, done)  # (it stages no field of its own without inputs: refused up front)


def test_a_builder_that_reads_token_arrays_refuses_a_common_without_them() -> None:
    """FlashAttention's metadata holds the slot mapping its kernel writes KV through: staged on a common
    metadata without the per-token arrays it held an empty one, silently."""
    with Stager("cpu").step() as step:
        common = stage_common(_spec(), step, token_arrays=False)
        with pytest.raises(ValueError, match="flash_attn: reads the per-token arrays"):
            flash_attn.stage(common, step)
        mamba2.stage(common, step)  # (the Mamba family reads none)


def test_a_step_still_held_blocks_the_next_until_reset() -> None:
    stager = Stager("cpu")
    held = stager.step()
    with pytest.raises(RuntimeError, match=r"stager\.reset\(\) to abandon it"):
        stager.step()
    assert stager.reset() and not held.committed
    assert not stager.reset()  # nothing open any more
    assert build_common(_spec(), stager).seq_lens_cpu.tolist() == [4, 4]


def test_a_step_dropped_in_graph_mode_leaves_every_sentinel_in_place() -> None:
    profile = StaticProfile(max_num_reqs=4, max_num_tokens=16, max_blocks_per_req=4, block_size=4)
    stager = Stager("cpu", profile=profile, num_slots=2)
    for _ in range(2):
        build_common(_spec(), stager)
    step = stager.step()  # a step that writes past the last one's rows, then is lost
    stage_common(_spec(num_scheduled_tokens=[5, 6]), step)
    del step
    gc.collect()
    with pytest.warns(RuntimeWarning):
        build_common(_spec(), stager)
    again = build_common(_spec(), stager)  # on the lost step's slot: its rows back to the sentinel
    full = stager.graph_fields["common.slot_mapping"]
    arena = stager.graph_arena
    assert arena is not None
    raw = arena[full.offset: full.offset + full.nbytes].view(torch.int64)
    assert raw[5:].tolist() == [-1] * 11 and again.slot_mapping_cpu.tolist() == [3, 16, 17, 18, 19]


def test_a_second_thread_gets_the_thread_error_even_while_a_step_is_being_begun() -> None:
    """The other thread calls step() while this one is inside step() (between the check for an open step
    and the claim of the slot): it must get the thread error, and share nothing."""
    stager = Stager("cpu")
    errors: list[BaseException] = []
    began: list[Any] = []
    real_wait = stager._wait_slot

    def other() -> None:
        try:
            began.append(stager.step())
        except BaseException as e:
            errors.append(e)

    def wait_and_let_the_other_in(slot: Any) -> Any:
        t = threading.Thread(target=other, name="intruder")
        t.start()
        t.join()
        return real_wait(slot)

    stager._wait_slot = wait_and_let_the_other_in  # type: ignore[method-assign]
    mine = stager.step()
    del stager._wait_slot
    assert not began and len(errors) == 1 and isinstance(errors[0], RuntimeError), errors
    assert "'intruder'" in str(errors[0]) and "one thread at a time" in str(errors[0])
    mine.alloc("x", 1, np.int32)[:] = 7
    mine.commit()
    assert mine.device("x").tolist() == [7]
    with pytest.raises(StepExpiredError):  # (and the ring goes on: three steps later it expires)
        for _ in range(3):
            build_common(_spec(), stager)
        mine.device("x")


def test_wrong_arguments_to_the_common_pass_are_named() -> None:
    stager = Stager("cpu")
    with pytest.raises(TypeError, match=r"stager: expected an attnmeta\.Stager"):
        build_common(_spec(), None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="token_arrays: expected a bool, got str 'no'"):
        build_common(_spec(), stager, token_arrays="no")
    with pytest.raises(ValueError, match=r"prefix: must be a non-empty name without '\.'"):
        build_common(_spec(), stager, prefix="a.b")
    with pytest.raises(TypeError, match="prefix: expected a str"):
        build_common(_spec(), stager, prefix=3)
    with pytest.raises(ValueError, match="block_table_columns: must be >= 1"):
        build_common(_spec(), stager, block_table_columns=0)
    with pytest.raises(ValueError, match=r"Group\.prefix: must be a non-empty name without '\.'"):
        StepBuilder(stager, Group({}, prefix="a.b"))
    assert build_common(_spec(), stager, token_arrays=np.bool_(False)).positions_cpu.shape == (0,)


def test_overlapping_mm_prefix_spans_are_an_error() -> None:
    spec = _spec(num_scheduled_tokens=[1, 4])
    bad = mm_prefix.MMPrefixInputs(mm_span_indptr=[0, 0, 2], mm_span_starts=[0, 2], mm_span_lengths=[3, 2])
    with pytest.raises(ValueError, match=r"spans 0 \[0, 3\) and 1 \[2, 4\) of request 1 overlap"):
        mm_prefix.build(spec, Stager("cpu"), None, bad)
    ok = mm_prefix.MMPrefixInputs(mm_span_indptr=[0, 1, 2], mm_span_starts=[0, 0], mm_span_lengths=[3, 3])
    mm_prefix.build(spec, Stager("cpu"), None, ok)  # the same offsets in two requests are fine


def test_the_engine_without_transformers_says_what_to_install(tmp_path: Path) -> None:
    """``python -m examples.engine --help`` on a machine without transformers (a stand-in package that
    fails to import, first on the path): the message and what to install, no traceback."""
    (tmp_path / "transformers").mkdir()
    (tmp_path / "transformers" / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'transformers'\")\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
    r = subprocess.run([sys.executable, "-m", "examples.engine", "--help"], capture_output=True, text=True, cwd=ROOT,
                       env=env, timeout=300)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "examples.engine needs transformers" in r.stderr and "pip install transformers" in r.stderr


def test_the_strategies_without_hypothesis_name_the_extra() -> None:
    """On a machine without hypothesis (hidden here: ``sys.modules['hypothesis'] = None`` makes its import
    fail as a missing module's does), importing the strategies says what to install."""
    code = ("import sys\n"
            "sys.modules['hypothesis'] = None\n"
            "try:\n"
            "    import attnmeta.testing.strategies\n"
            "except ImportError as e:\n"
            "    print(type(e).__name__, e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert "ImportError attnmeta.testing.strategies needs hypothesis" in r.stdout, (r.stdout, r.stderr)
    assert "pip install 'attnmeta[test]'" in r.stdout


# ------------------------------------------------------------------------------------------------
# found by a new user's review: errors that named nothing, or named the wrong thing


def test_check_builder_on_meta_says_where_values_are_compared() -> None:
    """It failed inside a reference with torch's ``repeat_interleave`` error about meta tensors."""
    from attnmeta.testing import check_builder

    spec = BatchSpec(num_computed_tokens=[5], num_scheduled_tokens=[1], block_table=[[1, 2]], block_size=4)
    with pytest.raises(ValueError, match="meta tensors have none: pass device='cpu' or 'cuda'"):
        check_builder("flash_attn", spec, "meta")
    with pytest.raises(ValueError, match="audit_builder runs a builder on 'meta'"):
        check_builder("flash_attn", spec, "cpu", stager=Stager("meta"))


def test_a_value_the_builder_never_wrote_is_named_as_the_debug_fill() -> None:
    """``host np.int32(-1515870811) vs expected 0`` did not say it was the stager's 0xA5 fill."""
    from attnmeta.testing.assertions import DEBUG_FILL, assert_host_equal

    fill = np.frombuffer(bytes([DEBUG_FILL] * 4), np.int32)
    with pytest.raises(AssertionError, match=r"-1515870811\) \(0xa5 in every byte: the stager's debug fill"):
        assert_host_equal(np.array([7, fill[0]], np.int32), np.array([7, 0], np.int32), "toy.padding")
    with pytest.raises(AssertionError) as info:
        assert_host_equal(np.array([7, 8], np.int32), np.array([7, 0], np.int32), "toy.padding")
    assert "debug fill" not in str(info.value)


def test_a_reference_of_the_wrong_type_is_a_type_error_naming_the_accepted_ones() -> None:
    """A reference that gave a list for a device field failed with ``tensor([5, 7]) != [5, 7]``."""
    from attnmeta.builder import MetadataBase
    from attnmeta.testing.builders import _compare

    class Toy(MetadataBase):
        _DEVICE_FIELDS = ("x",)

        def __init__(self) -> None:
            object.__setattr__(self, "x", torch.tensor([5, 7], dtype=torch.int32))

    with pytest.raises(TypeError, match=r"toy\.x: the reference gives a list for a field that holds a Tensor; "
                                        r"a reference gives a torch\.Tensor for a device field"):
        _compare(Toy(), {"x": [5, 7]}, "toy", torch.device("cpu"))


def test_groups_take_builder_names_and_refuse_a_list_saying_how() -> None:
    """``Group([FLASH_ATTN])`` raised ``AttributeError: 'list' object has no attribute 'items'``; a
    builder's registry name (which ``attnmeta.build`` takes) was refused."""
    with pytest.raises(TypeError, match=r"Group\.builders: expected a dict of name -> builder"):
        StepBuilder(Stager("cpu"), Group([flash_attn.FLASH_ATTN]))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"pass the groups as separate arguments"):
        StepBuilder(Stager("cpu"), [Group({"fa": flash_attn.FLASH_ATTN})])  # type: ignore[arg-type]
    spec = BatchSpec(num_computed_tokens=[5], num_scheduled_tokens=[1], block_table=[[1, 2]], block_size=4)
    sb = StepBuilder(Stager("cpu"), Group({"fa": "flash_attn", "fi": ("flashinfer", None)}))
    step = sb.build(spec)
    assert step["fa"].seq_lens_cpu.tolist() == [6] and step["fi"].num_decodes == 1
    with pytest.raises(attnmeta.UnknownBuilderError, match="no builder named 'flash_atn'"):
        StepBuilder(Stager("cpu"), Group({"fa": "flash_atn"}))


def test_alloc_with_a_torch_dtype_names_the_field_and_numpys() -> None:
    with Stager("cpu").step() as step, pytest.raises(TypeError, match=r"ids: dtype torch\.int32 is not a numpy "
                                                                       r"dtype \(a torch dtype: pass numpy's"):
        step.alloc("ids", 4, torch.int32)


def test_a_profile_with_fewer_tokens_than_requests_is_refused() -> None:
    """A full decode step of every request could never fit it (vLLM's SchedulerConfig refuses it too)."""
    with pytest.raises(ValueError, match=r"max_num_tokens=4 < max_num_reqs=8"):
        StaticProfile(max_num_reqs=8, max_num_tokens=4, max_blocks_per_req=4, block_size=16)
    StaticProfile(max_num_reqs=8, max_num_tokens=8, max_blocks_per_req=4, block_size=16)


def test_a_stager_given_its_options_positionally_names_itself_and_the_keywords() -> None:
    """Python's own error named ``Ring.__init__``, a base class users never see."""
    with pytest.raises(TypeError, match=r"^Stager\(\): only the device is positional, got 2 positional .*num_slots="):
        Stager("cpu", 4)  # type: ignore[misc]
    assert "*positional" not in str(inspect.signature(Stager))  # (help() shows the call users make)


@pytest.mark.parametrize(("dtype", "fill"), [(np.uint8, -1), (np.int32, 0.7), (np.bool_, 5), (np.int32, "x"),
                                             (np.int32, [1])])
def test_an_eager_fill_its_dtype_cannot_hold_is_refused_as_graph_mode_refuses_it(dtype: Any, fill: Any) -> None:
    """Eager mode ignored the fill, so code developed eager first failed when it moved to graph mode."""
    with pytest.raises(ValueError, match=r"engine.flags: fill=.* is not a .* value"), Stager("cpu").step() as step:
        step.alloc("engine.flags", 2, dtype, fill=fill)
    for _ in range(2):  # (a value that passed once is remembered, and still passes)
        with Stager("cpu").step() as step:
            step.alloc("engine.flags", 2, np.uint8, fill=255)[:] = 1
            step.alloc("engine.nan", 1, np.float32, fill=float("nan"))[:] = 0


def test_builders_that_stage_under_one_prefix_are_named_up_front_saying_how_to_part_them() -> None:
    """Two FlashInfer groups (a full and a sliding-window group) composed fine on decode steps and failed on
    the first mixed step ("flashinfer.qo_indptr_prefill: staged twice in one step") without a word at
    construction. The composer now warns there; it does not refuse, since two FlashAttention groups, which
    stage nothing of their own without DCP or causal inputs, are a usual hybrid model's and never collide."""
    from attnmeta.backends.flashinfer import FlashInferOptions
    from attnmeta.compose import Array, SharedPrefixWarning

    mixed = _spec()  # (a decode row beside a prefill)
    with pytest.warns(SharedPrefixWarning, match=r"Group.builders\['fi_swa'\]: flashinfer stages its fields under "
                                                 r"prefix 'flashinfer', as builder 'fi_full' \(flashinfer\) does.*"
                                                 r"'fi_swa': \('flashinfer', dataclasses.replace\(options, "
                                                 r"prefix='fi_swa'\)\)"):
        shared = StepBuilder(Stager("cpu"), Group({"fi_full": "flashinfer"}, prefix="full"),
                             Group({"fi_swa": "flashinfer"}, prefix="swa"))
    with pytest.raises(ValueError, match=r"staged twice in one step \(two builders of one step share a prefix"):
        shared.build([mixed, mixed])
    with pytest.warns(SharedPrefixWarning, match=r"prefix 'common', as group 'common''s common metadata does"):
        StepBuilder(Stager("cpu"), Group({"fa": ("flash_attn", flash_attn.FlashAttentionOptions(prefix="common"))}))
    with pytest.warns(SharedPrefixWarning, match=r"Array\('flash_attn.x'\): its prefix 'flash_attn' is builder 'fa'"):
        StepBuilder(Stager("cpu"), Group({"fa": "flash_attn"}), arrays=[Array("flash_attn.x", np.int32)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        parted = StepBuilder(Stager("cpu"), Group({"fi_full": "flashinfer"}, prefix="full"),
                             Group({"fi_swa": ("flashinfer", FlashInferOptions(prefix="fi_swa"))}, prefix="swa"))
    out = parted.build([mixed, mixed])
    assert out["fi_full"].num_prefills == out["fi_swa"].num_prefills == 1
    with pytest.warns(SharedPrefixWarning):  # (two FlashAttention groups: named, and they serve every step)
        both = StepBuilder(Stager("cpu"), Group({"full": "flash_attn"}, prefix="g0"),
                           Group({"swa": "flash_attn"}, prefix="g1"))
    assert both.build([mixed, mixed])["swa"].max_seq_len == 4


def test_a_group_s_causal_flag_must_be_a_bool() -> None:
    """``causal="False"`` was truthy: every request attended causally, no error."""
    with pytest.raises(TypeError, match=r"Group.causal: expected a bool, got str 'False'"):
        StepBuilder(Stager("cpu"), Group({"fa": "flash_attn"}, causal="False"))  # type: ignore[arg-type]
    assert StepBuilder(Stager("cpu"), Group({"fa": "flash_attn"}, causal=False)).build(_spec())["fa"].causal is False


def test_a_comparison_that_compared_nothing_is_not_ok() -> None:
    """``compare_with_reference(None, ref).ok`` was True: nothing compared, every field listed missing, and
    testing.md's ``assert result.ok`` passed."""
    from attnmeta.testing.harness import compare_with_reference

    ref = {"seq_lens": np.array([4, 4], np.int32), "max_seq_len": 4}
    assert not compare_with_reference(None, ref).ok
    got = flash_attn.build(_spec(), Stager("cpu"))
    partial = compare_with_reference(got, {**ref, "no_such_field": 1})
    assert partial.ok and not partial.complete and partial.missing == ("no_such_field",)
    assert compare_with_reference(got, ref).complete
    with pytest.raises(TypeError, match=r"reference: expected a mapping of field name to value.*got NoneType"):
        compare_with_reference(got, None)  # type: ignore[arg-type]


def test_a_small_max_step_bytes_alone_is_accepted() -> None:
    """Any ``max_step_bytes`` below 1 MiB failed, blaming ``initial_bytes``, which the caller never gave."""
    stager = Stager("cpu", max_step_bytes=65536)
    assert build_common(_spec(), stager).seq_lens_cpu.tolist() == [4, 4]
    with pytest.raises(ValueError, match=r"initial_bytes: 1048576 is more than max_step_bytes=65536"):
        Stager("cpu", max_step_bytes=65536, initial_bytes=1 << 20)


def test_misused_calls_name_the_argument_instead_of_failing_deep_inside() -> None:
    """Each of these failed with an AttributeError, a bare KeyError, an unpacking error or numpy's own
    message, or was accepted until a later step."""
    from attnmeta.compose import Array
    from attnmeta.testing import check_builder
    from attnmeta.testing.lab import lab

    spec = _spec()
    with pytest.raises(TypeError, match=r"check_builder: spec must be a BatchSpec, got list \(call it once per spec\)"):
        check_builder("flashinfer", [spec], "cpu")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"lab\(\): expected a builder or a registered builder's name, got NoneType"):
        lab(None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"Group.builders\['fa'\]: expected a builder or \(builder, options\), got a "
                                        r"tuple of 3"):
        StepBuilder(Stager("cpu"), Group({"fa": ("flash_attn", None, None)}))  # type: ignore[dict-item]
    with pytest.raises(TypeError, match=r"Array\('x'\): dtype 'foo' is not a numpy dtype \(one of \["):
        Array("x", "foo")
    with pytest.raises(ValueError, match=r"Array\('x'\): capacity must be >= 0, got -1"):
        Array("x", np.int32, capacity=-1)
    with pytest.raises(TypeError, match=r"Array\('x'\): capacity must be an int or None, got float 2.0"):
        Array("x", np.int32, capacity=2.0)  # type: ignore[arg-type]
    with Stager("cpu").step() as step:
        with pytest.raises(TypeError, match=r"a: shape must be an int or a tuple of ints \(rows, \*row_shape\), got "
                                            r"float 2.0"):
            step.alloc("a", 2.0, np.int32)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"a: shape must be an int or a tuple of ints .*got \(2, 1.5\)"):
            step.alloc("a", (2, 1.5), np.int32)  # type: ignore[arg-type]
        for bad, kind in ((None, TypeError), (3, TypeError), ("", ValueError)):
            with pytest.raises(kind, match=r"alloc\(\): a field's name"):
                step.alloc(bad, 2, np.int32)  # type: ignore[arg-type]
        with pytest.raises(CapacityError, match=r"a: needs 4 rows but its capacity is 2"):
            step.alloc("a", 4, np.int32, capacity=2)  # (eager too: graph mode would refuse it)
        step.alloc("a", 2, np.int32, capacity=2)[:] = 1
    assert step.device("a").tolist() == [1, 1]
    with pytest.raises(KeyError, match=r"'nope': not staged in step 1 \(its fields: a\)"):
        step.device("nope")
    with pytest.raises(KeyError, match=r"'nope': not staged in step 1 \(its fields: a\)"):
        step.host("nope")
    out = StepBuilder(Stager("cpu"), Group({"fa": "flash_attn"})).build(spec)
    with pytest.raises(KeyError, match=r"'nope': no builder of that name in this step \(its builders: \['fa'\]"):
        out["nope"]
    with pytest.raises(TypeError, match=r"Stager\(\): no argument 'num_blocks' \(did you mean 'num_kv_blocks'\?\)"):
        Stager("cpu", num_blocks=48)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"stream: expected a torch.cuda.Stream or None, got object"):
        Stager("cpu", stream=object())
    multi = MultiStager(["cpu", "cpu"])
    with multi.step() as mstep:
        staged = flash_attn.stage(stage_common(spec, mstep), mstep)
    with pytest.raises(TypeError, match=r"MultiStager.result\(\): expected what a builder's stage\(\) returned .*got "
                                        r"FlashAttentionMetadata \(for metadata already made, call view"):
        multi.result(staged.result(), 1)  # type: ignore[arg-type]
    assert multi.result(staged, 1).seq_lens_cpu.tolist() == [4, 4]


def test_strategy_arguments_of_the_wrong_kind_are_invalid_arguments_with_the_right_hint() -> None:
    from hypothesis.errors import InvalidArgument

    from attnmeta.testing.strategies import batch_specs, logits_indices_for

    with pytest.raises(InvalidArgument, match=r"max_reqs: expected an int, got str '8'"):
        batch_specs(max_reqs="8").validate()  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match=r"block_sizes: .*st.sampled_from\(\[4\]\) to draw from those values"):
        batch_specs(block_sizes=[4]).validate()  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match=r"query_start_loc: expected a \(num_reqs \+ 1,\) int array, got NoneType"):
        logits_indices_for(None)  # type: ignore[arg-type]


def test_the_cli_reports_a_command_s_unknown_flag_in_that_command_s_usage(capsys: pytest.CaptureFixture[str]) -> None:
    from attnmeta.__main__ import main

    with pytest.raises(SystemExit):
        main(["demo", "--bogus"])
    err = capsys.readouterr().err
    assert "python -m attnmeta demo: error: unrecognized arguments: --bogus" in err and "[--limit LIMIT]" in err
    with pytest.raises(SystemExit) as version:
        main(["--version"])
    assert version.value.code == 0 and capsys.readouterr().out.strip() == f"attnmeta {attnmeta.__version__}"


def test_the_review_s_false_alarms_stay_quiet() -> None:
    """A review of this round's checks: each of these was refused or flagged, and is legitimate."""
    from attnmeta.staging.shared import RingReader, RingWriter, SharedRing
    from attnmeta.sync import no_device_sync
    from attnmeta.testing.workloads import reshuffled

    with Stager("cpu").step() as step:  # a numpy array or torch.Size as the shape
        assert step.alloc("a", np.array([3, 2]), np.int32).shape == (3, 2)
        assert step.alloc("b", torch.Size([2]), np.int32).shape == (2,)
    with no_device_sync():
        repr(torch.empty(0, device="meta"))  # (an empty tensor prints without reading data)
        torch.multinomial(torch.ones(2, 4, device="meta"), 1)  # (torch validates it on the device)
    with pytest.raises(ValueError, match=r"reshuffled: steps must be an int >= 1"):
        reshuffled(_spec(), 0, np.random.default_rng(0))
    ring = SharedRing.create(num_readers=1, num_slots=3, slot_bytes=1 << 16)
    try:
        writer = RingWriter(ring, "cpu", timeout=10)
        reader = RingReader(SharedRing.attach(ring.name), 0, "cpu")
        build_common(_spec(), writer)
        with warnings.catch_warnings():  # (a filter that raises: the skip is sent and the ring closed first)
            warnings.simplefilter("error")
            with pytest.raises(UserWarning, match="never published"):
                writer.close()
        assert reader.receive(timeout=10) is None and reader.stats.steps == 1
        reader.close()
    finally:
        ring.unlink()
