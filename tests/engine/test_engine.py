"""The reference engine (examples/engine) on the CPU: a tiny Llama served over a paged KV cache with
attnmeta's metadata, every request's greedy tokens equal to ``transformers``' own ``generate``.

The workloads force what a metadata bug would break: chunked prefill (rows whose chunk stops short of
the prompt), prefix caching (blocks reused), preemption by recompute (a pool too small for the
batch), padded decode steps (CUDA-graph sizes), cascade attention (10 requests sharing 270 tokens),
and async scheduling (input tokens taken from the previous step's sampled tokens on the device).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("transformers", reason="the reference engine needs transformers (pip install -e '.[test]')")

from attnmeta.sync import no_device_sync
from examples.engine import BlockPool, Engine, EngineConfig, Request, Scheduler, make_kernel
from examples.engine.__main__ import run_workload
from examples.engine.kv_cache import block_hashes
from examples.engine.workload import Reference, make_model, make_requests, tiny_config


@pytest.fixture(scope="module")
def model() -> Any:
    return make_model(tiny_config())


@pytest.fixture(scope="module")
def reference() -> Reference:
    return {}


class _DoneEvent:
    """``torch.cuda.Event`` on a machine without CUDA: recorded at once, always done."""

    def record(self) -> None:
        pass

    def query(self) -> bool:
        return True


def _stand_in_flashinfer(monkeypatch: pytest.MonkeyPatch, lib: Any, **submodules: Any) -> None:
    """Make ``lib`` the ``flashinfer`` package (each of ``submodules`` its ``flashinfer.<name>``) and
    ``torch.cuda.Event`` a :class:`_DoneEvent`, for the test's duration: the FlashInfer kernel's tests on a
    machine without CUDA or FlashInfer."""
    import sys

    monkeypatch.setitem(sys.modules, "flashinfer", lib)
    for name, module in submodules.items():
        monkeypatch.setitem(sys.modules, f"flashinfer.{name}", module)
    monkeypatch.setattr(torch.cuda, "Event", _DoneEvent)


def test_mixed_workload_equals_generate(model: Any, reference: Reference) -> None:
    st, cmp, forced = run_workload(model, "torch-paged", "mixed", cache=reference)
    assert forced.mismatches == forced.near_ties == 0 and forced.tokens == cmp.tokens
    assert cmp.requests == 24 and cmp.tokens == st.sampled > 200
    assert cmp.mismatches == 0 and cmp.near_ties == 0, cmp  # float32 on the CPU: exact
    # the workload exercised what it is for
    assert st.partial_prefills > 0 and st.preemptions > 0 and st.prefix_cache_hits > 0
    assert st.padded_steps > 0 and st.decode_steps > 0 and st.decode_steps < st.steps
    assert st.metadata_copies == st.steps  # one copy per step


def test_the_generate_reference_runs_without_a_transformers_warning(model: Any) -> None:
    """The reference run passes every setting in its one generation config: transformers warns (on its
    own logger) about a config passed beside loose generation arguments, and the engine's first run
    printed that warning."""
    import io
    import logging

    from examples.engine.workload import generate_reference

    seen = io.StringIO()
    handler = logging.StreamHandler(seen)
    log = logging.getLogger("transformers")
    log.addHandler(handler)
    try:
        tokens, margins = generate_reference(model, [5, 17, 3, 9], 4)
    finally:
        log.removeHandler(handler)
    assert len(tokens) == len(margins) == 4
    assert "generation_config" not in seen.getvalue(), seen.getvalue()


def test_the_generate_reference_runs_to_its_length_past_the_models_eos(model: Any,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's requests run to their length, so ``generate``'s reference must not stop at the model's
    end-of-sequence token: with the EOS made the very token greedy decoding emits third, it still makes
    every token. (A generation config with ``eos_token_id=None`` gets the model's EOS filled back in by
    transformers, and its reference once stopped short: the hybrid workload failed on it.)"""
    from examples.engine.workload import generate_reference

    prompt = [5, 17, 3, 9]
    tokens, _m = generate_reference(model, prompt, 6)
    monkeypatch.setattr(model.generation_config, "eos_token_id", tokens[2])
    monkeypatch.setattr(model.config, "eos_token_id", tokens[2])
    again, _m = generate_reference(model, prompt, 6)
    assert again == tokens and len(again) == 6


def test_the_cli_reports_each_run_verdict_first_and_only_nonzero_counters(model: Any, reference: Reference) -> None:
    """``python -m examples.engine``'s report of a run: its verdict and size on the first line, the two
    comparisons and the engine's counters that are not 0 on indented lines (it was one line of several
    hundred characters ending in a dict of every counter)."""
    from examples.engine.__main__ import report

    st, cmp, forced = run_workload(model, "torch-paged", "cascade", cache=reference)
    lines = report("torch-paged", "cascade", 1.25, st, cmp, forced).splitlines()
    assert lines[0].split()[:3] == ["torch-paged", "cascade", "OK"] and f"{cmp.requests} requests" in lines[0]
    assert lines[1].strip().startswith("against generate:") and lines[2].strip().startswith("teacher-forced:")
    assert all(line.startswith("    ") and len(line) < 200 for line in lines[1:]), lines
    engine = lines[3].split("engine: ")[1].split(", ")
    assert f"steps {st.steps}" in engine and f"cascade steps {st.cascade_steps}" in engine and st.cascade_steps > 0
    assert not any(item.endswith(" 0") for item in engine), engine  # (graph steps, preemptions ...: 0 here)
    bad = dataclasses.replace(cmp, mismatches=1)
    assert report("torch-paged", "cascade", 1.25, st, bad, forced).split()[2] == "FAIL"


@pytest.mark.parametrize(("args", "says"), [
    (["--kernels", "torch-paged,nope"], "--kernels: unknown 'nope'"),
    (["--workloads", "mixd"], "--workloads: unknown 'mixd'"),
    (["--metadata", "vlm"], "--metadata: unknown 'vlm'"),
    (["--device", "xpu"], "--device 'xpu': expected cpu or cuda"),
    (["--device", "cuda"], "no CUDA device is available here"),
    (["--metadata", "vllm"], "--metadata vllm: the engine's vllm metadata mode needs vLLM"),
])
def test_the_cli_rejects_unknown_names_before_making_a_model(args: list[str], says: str,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """A misspelt kernel, workload or metadata mode, a device this machine lacks, or the vllm mode without
    vLLM's package, is a usage error (status 2) naming the flag and what it needs, before a model is made
    (they were tracebacks from deep inside a run)."""
    from examples.engine.__main__ import main

    if args == ["--device", "cuda"] and torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    if args == ["--metadata", "vllm"] and importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is importable here")
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2 and says in capsys.readouterr().err


def test_cascade_workload_equals_generate(model: Any, reference: Reference) -> None:
    st, cmp, _ = run_workload(model, "torch-paged", "cascade", cache=reference)
    assert st.cascade_steps > 0 and st.prefix_cache_hits > 0
    assert cmp.mismatches == 0 and cmp.near_ties == 0, cmp


@pytest.mark.parametrize("mode", ["sync-scheduling", "per-tensor"])
def test_other_loop_modes_give_the_same_tokens(model: Any, reference: Reference, mode: str) -> None:
    st, cmp, _ = run_workload(model, "torch-paged", "mixed", cache=reference,
                           async_scheduling=mode != "sync-scheduling",
                           uploads="per-tensor" if mode == "per-tensor" else "one-copy")
    assert cmp.mismatches == 0 and cmp.near_ties == 0, cmp
    if mode == "per-tensor":
        assert st.metadata_copies > 3 * st.steps  # the baseline: one upload per field


def test_the_whole_loop_never_reads_the_device(model: Any) -> None:
    """The sync audit over the entire loop, CPU tensors declared device data: the engine, the model's
    forward, the kernel and attnmeta read nothing back (the sampled tokens reach the host only through
    the copy into the host ring, read a step later)."""
    reqs = make_requests(12, model.config.vocab_size, shared_prefix=32, arrive_over=4, seed=5)
    cfg = EngineConfig(num_blocks=40, max_num_tokens=64, max_num_seqs=16, max_model_len=256)
    engine = Engine(model, make_kernel("torch-paged", model, torch.device("cpu")), cfg)
    with no_device_sync(devices={"cpu"}, allow_async_d2h=True):
        st = engine.run(reqs)
    assert st.steps > 10 and all(len(r.output) == r.max_new_tokens for r in reqs)


def test_a_wrong_slot_mapping_is_caught(model: Any, reference: Reference, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check can fail: KV written one slot off (an off-by-one in ``slot_mapping``) changes the tokens.
    (A shift of every position would not: rotary embeddings see only relative positions.)"""
    from examples.engine import model as model_mod

    real = model_mod.PagedLlama.forward

    def shifted(self: Any, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                *a: Any) -> torch.Tensor:
        return real(self, input_ids, positions, slot_mapping - 1, *a)

    monkeypatch.setattr(model_mod.PagedLlama, "forward", shifted)
    _, cmp, forced = run_workload(model, "torch-paged", "mixed", cache=reference)
    assert cmp.mismatches > 0 and forced.mismatches > 0


# ---------------------------------------------------------------------------------------------------
# the block pool and the scheduler on their own
# ---------------------------------------------------------------------------------------------------


def test_block_pool_reference_counts_and_prefix_cache() -> None:
    pool = BlockPool(6, 4)
    a = pool.allocate(3)
    assert 0 not in a and pool.num_free == 2
    hashes = block_hashes(list(range(12)), 4, 3)
    for b, h in zip(a, hashes):
        pool.cache(b, h)
    assert pool.lookup(hashes[:2]) == a[:2] and pool.refs[a[0]] == 2
    pool.free(a)
    assert pool.num_free == 3 and pool.refs[a[0]] == 1  # still held by the lookup
    pool.free(a[:2])
    assert pool.num_free == 5
    assert pool.lookup(hashes) == a  # freed blocks keep their KV until handed out again
    pool.free(a)
    pool.allocate(5)  # evicts every cached block
    assert pool.lookup(hashes) == []
    with pytest.raises(MemoryError):
        pool.allocate(1)


def test_scheduler_respects_budget_and_frees_everything() -> None:
    pool = BlockPool(20, 4)
    sched = Scheduler(pool, max_num_tokens=10, max_num_seqs=4, max_blocks_per_req=16)
    rng = np.random.default_rng(0)
    reqs = [Request(i, rng.integers(1, 50, int(rng.integers(3, 20))).tolist(), int(rng.integers(1, 8)))
            for i in range(8)]
    for r in reqs:
        sched.add(r)
    steps = 0
    while sched.has_work:
        out = sched.schedule()
        assert out.num_tokens <= 10 and len(out.rows) <= 4
        sizes = [r.num_new for r in out.rows]
        assert sizes == sorted(sizes, key=lambda n: n != 1)  # decodes first
        sched.receive(out, np.full(len(out.rows), 7))
        steps += 1
        assert steps < 500
    sched.schedule()  # frees the last finished requests' blocks
    assert all(r.output == [7] * r.max_new_tokens for r in reqs)
    assert pool.num_free == 19 and sum(pool.refs) == 0
    # a finished request is the caller's: the scheduler keeps none (a serving loop's memory stays bounded)
    import gc
    import weakref

    gone = [weakref.ref(r) for r in reqs]
    del reqs, r, out
    gc.collect()
    assert [w() for w in gone] == [None] * 8


def test_per_tensor_baseline_uploads_every_device_field(model: Any) -> None:
    """The baseline hands kernels no tensor of its host-side stager: every device field is a fresh
    upload (FlashInfer's page indices, which have no host twin in the nested layout, included)."""
    from attnmeta import BatchSpec
    from attnmeta.backends import flashinfer

    cfg = EngineConfig(num_blocks=64, max_num_tokens=64, max_num_seqs=8, max_model_len=128, uploads="per-tensor")
    engine = Engine(model, make_kernel("torch-paged", model, torch.device("cpu")), cfg)
    spec = BatchSpec(num_computed_tokens=[5, 7, 0], num_scheduled_tokens=[1, 1, 4],
                     block_table=[[10, 11], [20, 21], [30, 31]], block_size=16)
    fi = flashinfer.build(spec, engine.stager)
    engine._per_tensor(fi.common, np.zeros(6, np.int32), np.zeros(6, np.int32))
    moved = engine.kernel.transform(fi)
    for obj, orig in ((moved, fi), (moved.paged, fi.paged), (moved.common, fi.common)):
        for name in orig._DEVICE_FIELDS:
            new, old = getattr(obj, name), getattr(orig, name)
            if old is not None:
                assert new.data_ptr() != old.data_ptr() and torch.equal(new, old), name


def test_attnmeta_s_time_is_the_composer_s_call(model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``metadata_s`` and ``step_metadata`` time the step composer's call and nothing of the engine's
    own preparation of its arguments (the kernel's inputs, the block table's rows), as the vllm mode
    leaves its ``set_batch`` out: on a clock that only the kernel's ``inputs`` (100 s) and the
    composer's call (1 s) advance, every step took exactly 1 s of attnmeta's time."""
    import examples.engine.engine as engine_module

    clock = [0.0]
    monkeypatch.setattr(engine_module.time, "perf_counter", lambda: clock[0])
    cfg = EngineConfig(num_blocks=40, max_num_tokens=64, max_num_seqs=16, max_model_len=256)
    engine = Engine(model, make_kernel("torch-paged", model, torch.device("cpu")), cfg)
    inputs, build_counts = engine.kernel.inputs, engine.composer.build_counts

    def slow_inputs(*a: Any) -> Any:
        clock[0] += 100.0
        return inputs(*a)

    def timed_build(*a: Any, **kw: Any) -> Any:
        clock[0] += 1.0
        return build_counts(*a, **kw)

    monkeypatch.setattr(engine.kernel, "inputs", slow_inputs)
    monkeypatch.setattr(engine.composer, "build_counts", timed_build)
    st = engine.run(make_requests(6, model.config.vocab_size, seed=2))
    assert st.steps > 5 and st.step_metadata == [1.0] * st.steps and st.metadata_s == st.steps


def test_each_step_is_built_inside_inference_mode(model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop builds every step's metadata inside ``torch.inference_mode()``, as vLLM's runner builds its
    steps (``GPUModelRunner.execute_model``); the composer's memory stays plain tensors (the stager makes
    them so), and the tokens are ``generate``'s (test_mixed_workload_equals_generate)."""
    cfg = EngineConfig(num_blocks=40, max_num_tokens=64, max_num_seqs=16, max_model_len=256)
    engine = Engine(model, make_kernel("torch-paged", model, torch.device("cpu")), cfg)
    build_counts, modes, inference_tensors = engine.composer.build_counts, [], []

    def recording(*a: Any, **kw: Any) -> Any:
        modes.append(torch.is_inference_mode_enabled())
        built = build_counts(*a, **kw)
        inference_tensors.append(built.common.seq_lens.is_inference())
        return built

    monkeypatch.setattr(engine.composer, "build_counts", recording)
    st = engine.run(make_requests(6, model.config.vocab_size, seed=3))
    assert st.steps > 5 and modes == [True] * st.steps
    assert inference_tensors == [False] * st.steps, "views of the stager's plain memory"


def test_launch_and_wait_times_split_the_loop(model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``step_launch`` times the step's launches (the forward: 10 s on a clock only it and the token
    wait advance) and ``step_wait`` the loop's iteration blocked on the sampled tokens' event (5 s a
    wait, events standing in for CUDA's that are never done when asked): one entry per step each, and
    the waits' seconds are the waits counted; ``step_gpu_behind`` finds the GPU still on the previous
    step as each step's launches begin."""
    import examples.engine.engine as engine_module

    clock = [0.0]
    monkeypatch.setattr(engine_module.time, "perf_counter", lambda: clock[0])

    class Pending:
        def query(self) -> bool:
            return False

        def synchronize(self) -> None:
            clock[0] += 5.0

        def record(self) -> None:
            pass

    cfg = EngineConfig(num_blocks=40, max_num_tokens=64, max_num_seqs=16, max_model_len=256)
    engine = Engine(model, make_kernel("torch-paged", model, torch.device("cpu")), cfg)
    engine._events = [Pending(), Pending()]  # type: ignore[list-item]
    forward = engine._forward

    def slow_forward(*a: Any) -> None:
        clock[0] += 10.0
        forward(*a)

    monkeypatch.setattr(engine, "_forward", slow_forward)
    st = engine.run(make_requests(6, model.config.vocab_size, seed=2))
    assert st.steps > 5 and st.step_launch == [10.0] * st.steps
    assert len(st.step_wait) == len(st.step_times) == st.steps
    assert set(st.step_wait) <= {0.0, 5.0} and st.step_wait[0] == 0.0  # (the first step has no tokens to wait for)
    assert sum(st.step_wait) == 5.0 * (st.token_waits - 1)  # (the loop's last wait ends no step)
    # (each step's launches began with the GPU behind, the events never done; the first had no step before it)
    assert st.step_gpu_behind == [False] + [True] * (st.steps - 1)


# ---------------------------------------------------------------------------------------------------
# a hybrid model: Mamba2 layers read attnmeta's mamba2 metadata of the step's second KV-cache group
# ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hybrid_model() -> Any:
    from examples.engine.workload import tiny_hybrid_config

    return make_model(tiny_hybrid_config())


def test_hybrid_workload_equals_generate(hybrid_model: Any) -> None:
    st, cmp, forced = run_workload(hybrid_model, "torch-paged", "hybrid")
    assert cmp.mismatches == cmp.near_ties == 0 and cmp.tokens == cmp.generated == st.sampled > 150, cmp
    assert forced.mismatches == forced.near_ties == 0, forced
    # chunked prefills continue their Mamba state; preempted requests start theirs again
    assert st.partial_prefills > 0 and st.preemptions > 0 and st.padded_steps > 0
    assert st.metadata_copies == st.steps  # both KV-cache groups in the step's one copy


@pytest.mark.parametrize("which", ["llama", "hybrid"])
def test_mixed_steps_replay_one_fixed_layout(model: Any, hybrid_model: Any, which: str) -> None:
    """``EngineConfig.fixed_mixed_layout``: an engine without CUDA graphs builds its unpadded (mixed) steps
    through a second composer over a graph-mode stager, where one layout serves them whatever their
    counts: they replay, where the ring stager's exact layouts compose nearly every one (the counts are
    new at each step). The tokens are ``generate``'s either way, and each step is still one copy."""
    from examples.engine.workload import compare_teacher_forced, compare_with_generate

    m = hybrid_model if which == "hybrid" else model
    replayed: dict[bool, tuple[int, int]] = {}
    for fixed in (True, False):
        reqs = make_requests(16, m.config.vocab_size, arrive_over=12, seed=5)
        cfg = EngineConfig(num_blocks=40, max_num_tokens=48, max_num_seqs=8, max_model_len=256, fixed_mixed_layout=fixed)
        engine = Engine(m, make_kernel("torch-paged", m, torch.device("cpu"), cascade=False), cfg)
        assert (engine.mixed_composer is not None) is fixed
        st = engine.run(reqs)
        cmp, forced = compare_with_generate(m, reqs), compare_teacher_forced(m, reqs)
        assert cmp.mismatches == cmp.near_ties == 0 and cmp.tokens == cmp.generated == st.sampled > 100, cmp
        assert forced.mismatches == forced.near_ties == 0, forced
        assert st.metadata_copies == st.steps
        mixed = [r for k, r in zip(st.step_kinds, st.step_replayed, strict=True) if k == "mixed"]
        replayed[fixed] = (sum(mixed), len(mixed))
    (fixed_replays, n), (plain_replays, n2) = replayed[True], replayed[False]
    assert n == n2 > 12 and fixed_replays >= n - 2 * 3 and plain_replays <= n // 2, replayed  # (3 ring slots)


def test_hybrid_check_catches_a_lost_initial_state(hybrid_model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check can fail: a Mamba layer that ignores ``has_initial_states_p`` (every chunk of a chunked
    prefill starting from zeros) changes the tokens."""
    import dataclasses

    from examples.engine import hybrid

    real = hybrid.mamba2_mixer

    def forgetful(mixer: Any, x: torch.Tensor, meta: Any, state: Any) -> torch.Tensor:
        if meta.has_initial_states_p is not None:
            meta = dataclasses.replace(meta, has_initial_states_p=torch.zeros_like(meta.has_initial_states_p),
                                       has_initial_states_p_cpu=np.zeros_like(meta.has_initial_states_p_cpu))
        return real(mixer, x, meta, state)

    monkeypatch.setattr(hybrid, "mamba2_mixer", forgetful)
    _, _, forced = run_workload(hybrid_model, "torch-paged", "hybrid")
    assert forced.mismatches > 0


@pytest.mark.parametrize("mode", ["none", "align"])
def test_hybrid_loop_never_reads_the_device(hybrid_model: Any, mode: str) -> None:
    reqs = make_requests(8, hybrid_model.config.vocab_size, arrive_over=3, seed=7, shared_prefix=20)
    cfg = EngineConfig(num_blocks=40, max_num_tokens=48, max_num_seqs=8, max_model_len=256,
                       mamba_cache_mode=mode)  # type: ignore[arg-type]
    engine = Engine(hybrid_model, make_kernel("torch-paged", hybrid_model, torch.device("cpu")), cfg)
    with no_device_sync(devices={"cpu"}, allow_async_d2h=True):
        st = engine.run(reqs)
    assert st.steps > 5 and all(len(r.output) == r.max_new_tokens for r in reqs)


def test_vllm_mamba_kernels_missing_names_the_fetch_command(hybrid_model: Any, tmp_path: Any) -> None:
    """Without vLLM's kernel files the engine refuses ``mamba_kernels="vllm"`` with the command that
    fetches them; an unknown mixer name is refused too."""
    from examples.engine import vllm_mamba

    with pytest.raises(FileNotFoundError, match=r"fetch_kernels\.py"):
        vllm_mamba.load_ops(tmp_path)
    cfg = EngineConfig(num_blocks=24, max_num_tokens=48, max_num_seqs=8, max_model_len=256,
                       mamba_kernels="triton")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="mamba_kernels"):
        Engine(hybrid_model, make_kernel("torch-paged", hybrid_model, torch.device("cpu")), cfg)


# ---------------------------------------------------------------------------------------------------
# the hybrid model in vLLM's "align" Mamba cache mode: prefix caching of Mamba states
# ---------------------------------------------------------------------------------------------------


def test_hybrid_align_workload_equals_generate(hybrid_model: Any) -> None:
    """Align mode: a state block per KV block, block-aligned prompt chunks, states moved to the block of
    each row's last token, prefill checkpoints, and prefix-cache hits that resume from a cached Mamba
    state (and preempted requests that find their own); every token equal to ``generate``'s."""
    st, cmp, forced = run_workload(hybrid_model, "torch-paged", "hybrid-align")
    assert cmp.mismatches == cmp.near_ties == 0 and cmp.tokens == cmp.generated == st.sampled > 200, cmp
    assert forced.mismatches == forced.near_ties == 0, forced
    assert st.prefix_cache_hits > 0 and st.mamba_cache_hits > 0 and st.mamba_checkpoints > 0
    assert st.mamba_state_copies > 0 and st.preemptions > 0 and st.partial_prefills > 0 and st.padded_steps > 0
    assert st.metadata_copies == st.steps


@pytest.mark.parametrize("broken", ["no state moves", "no checkpoints"])
def test_hybrid_align_check_catches_broken_state_handling(hybrid_model: Any, monkeypatch: pytest.MonkeyPatch,
                                                          broken: str) -> None:
    """The check can fail: a step that leaves the running state in its old block, or a mixer that
    ignores ``checkpoint_meta`` (a later hit resumes from a block that holds no state), change tokens."""
    import dataclasses

    from examples.engine import hybrid

    if broken == "no state moves":
        monkeypatch.setattr(hybrid.PagedBamba, "copy_slots", lambda self, moves: None)
    else:
        real = hybrid.mamba2_mixer

        def no_checkpoints(mixer: Any, x: torch.Tensor, meta: Any, state: Any) -> torch.Tensor:
            return real(mixer, x, dataclasses.replace(meta, checkpoint_meta=None), state)

        monkeypatch.setattr(hybrid, "mamba2_mixer", no_checkpoints)
    _, _, forced = run_workload(hybrid_model, "torch-paged", "hybrid-align")
    assert forced.mismatches > 0, forced


def test_align_scheduler_chunks_end_on_block_boundaries_and_hits_need_a_state() -> None:
    """A prompt chunk that stops short of the prompt ends on a block boundary; a prefix hit stops at the
    last block whose Mamba state is cached; both pools are empty once everything has finished."""
    pool, mpool = BlockPool(40, 4), BlockPool(40, 4)
    sched = Scheduler(pool, max_num_tokens=10, max_num_seqs=4, max_blocks_per_req=16, mamba_pool=mpool)
    first = Request(0, list(range(1, 23)), 2)  # 22 prompt tokens
    sched.add(first)
    chunks = []
    while first.num_generated == 0:
        out = sched.schedule()
        chunks += [(r.start, r.num_new) for r in out.rows]
        sched.receive(out, np.full(len(out.rows), 7))
    assert chunks == [(0, 8), (8, 8), (16, 6)]  # 10-token budget: aligned to 4-token blocks, then the rest
    assert len(first.mamba_blocks) == len(first.blocks) == 6
    # the chunk ends at 8 and 16 named the states of blocks 1 and 3; no state is cached for block 4
    for col in (0, 2, 4):
        assert not mpool.cached(block_hashes(first.prompt, 4, col + 1)[col])
    second = Request(1, [*range(1, 21), 99, 98, 97], 1)  # shares 5 blocks with the first
    sched.add(second)
    out = sched.schedule()
    row = next(r for r in out.rows if r.req is second)
    assert row.start == 16  # 5 attention blocks cached, the hit stops at the state after block 3
    assert second.mamba_blocks[:3] == [0, 0, 0] and second.mamba_blocks[3] == first.mamba_blocks[3]
    while sched.has_work:
        sched.receive(out, np.full(len(out.rows), 7))
        out = sched.schedule()
    sched.schedule()
    assert sum(pool.refs) == sum(mpool.refs) == 0


# ---------------------------------------------------------------------------------------------------
# the vllm metadata mode (examples/engine/vllm_metadata.py): its checks before vLLM is imported; its
# tokens are tested where vLLM is importable (tests/integrations/test_vllm_engine.py, marker vllm;
# tests/gpu/test_engine_vllm_cuda.py on the GPU machine)
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("kernel", "cfg", "message"), [
    ("torch-varlen", {}, "torch-varlen kernel needs CUDA"),
    ("torch-paged", {"uploads": "per-tensor"}, "makes vLLM's own copies"),
    ("torch-paged", {"metadata": "vLLM"}, "metadata is 'attnmeta' or 'vllm'"),
])
def test_vllm_mode_refuses_what_it_does_not_run(model: Any, kernel: str, cfg: dict[str, Any], message: str) -> None:
    from examples.engine.kernels import VarlenKernel

    k = VarlenKernel(4, 2, 16) if kernel == "torch-varlen" else make_kernel(kernel, model, torch.device("cpu"))
    with pytest.raises(ValueError, match=message):
        Engine(model, k, EngineConfig(**{"metadata": "vllm", **cfg}))  # type: ignore[arg-type]


def test_vllm_mode_without_vllm_names_the_install_command(model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "vllm", None)  # as on a machine without vLLM: import vllm fails
    with pytest.raises(ImportError, match=r"install_vllm\.sh .*fetch_vllm\.py"):
        Engine(model, make_kernel("torch-paged", model, torch.device("cpu")), EngineConfig(metadata="vllm"))


def test_vllm_mode_times_every_builders_plans_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """FlashInfer's decode plan is a module function of vLLM's shared by every builder: a second engine's
    builder must count its plans too (a per-engine counter missed them), and no call is timed twice. A
    clock that ticks one second a read makes each timed call count exactly 1."""
    import itertools
    import types

    from examples.engine import vllm_metadata as vm

    ticks = itertools.count()
    monkeypatch.setattr(vm.time, "perf_counter", lambda: float(next(ticks)))

    class PrefillWrapper:
        def plan(self) -> None:
            pass

    class Builder:
        def __init__(self) -> None:
            self._wrapper = PrefillWrapper()

        def _get_prefill_wrapper(self) -> PrefillWrapper:
            return self._wrapper

    module = types.SimpleNamespace(fast_plan_decode=lambda: None)
    first, second = Builder(), Builder()
    vm._time_plans(module, first)
    vm._time_plans(module, second)  # the second engine in the process
    for builder in (first, second):
        before = vm._PLAN_SECONDS[0]
        module.fast_plan_decode()
        builder._get_prefill_wrapper().plan()
        builder._get_prefill_wrapper().plan()  # the same wrapper again: wrapped once
        assert vm._PLAN_SECONDS[0] - before == 3.0


def test_flashinfer_kernel_runs_each_wrapper_over_the_rows_its_indptr_covers(monkeypatch: pytest.MonkeyPatch) -> None:
    """A padded eager decode step: its padding row counts in ``num_decode_tokens`` but not in the query
    indptr, and FlashInfer 0.7.2's prefill wrapper refuses a query longer than the indptr's last entry
    (0.5.3 read past it; found on the H200 by tests/gpu/test_engine_cuda.py). A stand-in FlashInfer that
    keeps that rule: the kernel's split mode hands each wrapper exactly its indptr's rows."""
    import types

    from attnmeta import BatchSpec, Stager
    from attnmeta.compose import Group, StepBuilder
    from examples.engine.kernels import FlashInferKernel

    ran: list[int] = []

    class Wrapper:  # FlashInfer's BatchPrefillWithPagedKVCacheWrapper, as far as the kernel uses it
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.rows = -1

        def plan(self, qo_indptr: torch.Tensor, *args: Any, **kwargs: Any) -> None:
            self.rows = int(qo_indptr[-1])

        def run(self, q: torch.Tensor, kv: Any, out: torch.Tensor | None = None) -> torch.Tensor:
            if q.shape[0] != self.rows:
                raise ValueError(f"q.shape[0] ({q.shape[0]}) does not match qo_indptr[-1] ({self.rows})")
            ran.append(q.shape[0])
            if out is None:
                return torch.ones_like(q)
            assert out.shape == q.shape
            return out.fill_(1.0)

    _stand_in_flashinfer(monkeypatch, types.SimpleNamespace(BatchPrefillWithPagedKVCacheWrapper=Wrapper))
    kernel = FlashInferKernel(4, 2, 8, torch.float32, torch.device("meta"), cascade_options=None)
    composer = StepBuilder(Stager("cpu"), Group(kernel.builders()))
    table = np.arange(1, 13, dtype=np.int32).reshape(4, 3)
    for n, padded in ((3, 4), (4, 4)):  # a padded step (3 requests in 4 rows), then one without padding
        ran.clear()
        spec = BatchSpec(num_computed_tokens=np.full(n, 6, np.int32), num_scheduled_tokens=np.ones(n, np.int32),
                         block_table=table[:n], block_size=4, num_reqs_padded=padded, num_tokens_padded=padded)
        built = composer.build(spec)
        kernel.prepare(built.common, built.metadata)
        out = kernel.attend(0, torch.zeros(padded, 4, 8), torch.zeros(1), torch.zeros(1))
        assert ran == [n] and out.shape == (padded, 4, 8) and bool((out[:n] == 1).all())
    ran.clear()  # a mixed step: two decode rows, then a prompt of 3 tokens; each wrapper writes its own rows
    spec = BatchSpec(num_computed_tokens=np.array([6, 7, 0], np.int32), num_scheduled_tokens=np.array([1, 1, 3], np.int32),
                     block_table=table[:3], block_size=4)
    built = composer.build(spec)
    kernel.prepare(built.common, built.metadata)
    out = kernel.attend(0, torch.zeros(5, 4, 8), torch.zeros(1), torch.zeros(1))
    assert ran == [2, 3] and bool((out == 1).all())


def test_flashinfer_kernel_plans_as_vllm_s_builder(monkeypatch: pytest.MonkeyPatch) -> None:
    """``plans="vllm"`` (the default with FlashInfer 0.7 or later): the wrappers and plan arguments of vLLM
    0.33.0's ``FlashInferMetadataBuilder`` on Hopper (``_get_decode_wrapper``, ``_get_prefill_wrapper``, its
    ``build``): an eager step's decode rows through the decode wrapper with tensor cores and backend
    ``auto``, planned over the decode rows' page table with their KV lengths and the model's scale, after
    FlashInfer's host ``arange`` of the rows is pinned (its plan copies it ``non_blocking``); the other rows
    through the prefill wrapper with backend ``auto``, causal. A stand-in FlashInfer records what the
    kernel asks of it; the token test on the GPU machine (tests/gpu/test_engine_vllm_cuda.py) checks that
    the two metadata modes then produce the same tokens."""
    import types

    from attnmeta import BatchSpec, Stager
    from attnmeta.compose import Group, StepBuilder
    from examples.engine import kernels as km

    made: list[tuple[str, dict[str, Any]]] = []
    plans: list[tuple[str, list[Any], dict[str, Any]]] = []

    class Wrapper:
        kind = ""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            made.append((self.kind, kwargs))
            self.backend = kwargs.get("backend")

        def plan(self, *args: Any, **kwargs: Any) -> None:
            plans.append((f"{self.kind} {self.backend}", [a.tolist() if isinstance(a, torch.Tensor) else a
                                                          for a in args], kwargs))

        def run(self, q: torch.Tensor, kv: Any, out: torch.Tensor | None = None) -> torch.Tensor:
            return torch.ones_like(q) if out is None else out.fill_(1.0)

    class Decode(Wrapper):
        kind = "decode"
        rows = -1

        def plan(self, *args: Any, **kwargs: Any) -> None:
            super().plan(*args, **kwargs)
            self.rows = len(args[2])  # (its batch: the rows of its last page lengths)

        def run(self, q: torch.Tensor, kv: Any, out: torch.Tensor | None = None) -> torch.Tensor:
            if q.shape[0] != self.rows:  # FlashInfer 0.7.2: one query token a planned row, no fewer
                raise ValueError(f"q implies q_len_per_req={q.shape[0] // self.rows} but plan() used 1")
            return super().run(q, kv, out)

    class Prefill(Wrapper):
        kind = "prefill"

    class Buffer:  # a cached host arange: pinning it is recorded
        def __init__(self, pinned: bool = False) -> None:
            self.pinned = pinned

        def is_pinned(self) -> bool:
            return self.pinned

        def pin_memory(self) -> Buffer:
            return Buffer(True)

    cache: dict[tuple[str, str], Buffer] = {}

    def get_range_buf(n: int, device: str) -> None:
        cache.setdefault((f"range_{1 << (n - 1).bit_length()}", device), Buffer())

    utils = types.SimpleNamespace(_get_range_buf=get_range_buf, _cache_buf=cache)
    lib = types.SimpleNamespace(__version__="0.7.2.post1", BatchDecodeWithPagedKVCacheWrapper=Decode,
                                BatchPrefillWithPagedKVCacheWrapper=Prefill, utils=utils)
    _stand_in_flashinfer(monkeypatch, lib, utils=utils)
    marked: list[tuple[str, ...]] = []
    monkeypatch.setattr(km, "mark_absent", lambda names: marked.append(names) or [])
    kernel = km.FlashInferKernel(4, 2, 8, torch.float32, torch.device("meta"), ring=1)
    assert kernel.plans == "vllm" and marked == [km.FLASHINFER_OPTIONAL]
    assert ("decode", {"use_tensor_cores": True, "backend": "auto"}) in made
    assert ("prefill", {"backend": "auto"}) in made
    composer = StepBuilder(Stager("cpu"), Group(kernel.builders()))
    table = np.arange(1, 13, dtype=np.int32).reshape(4, 3)
    # two decode rows (contexts 6 and 9: 2 and 3 pages of 4), then a prompt of 3 tokens after 2 cached ones
    spec = BatchSpec(num_computed_tokens=np.array([6, 9, 2], np.int32), num_scheduled_tokens=np.array([1, 1, 3], np.int32),
                     block_table=table[:3], block_size=4)
    built = composer.build(spec)
    kernel.prepare(built.common, built.metadata)
    scale = {"q_data_type": torch.float32, "kv_data_type": torch.float32, "sm_scale": 8 ** -0.5}
    decode, prefill = plans
    assert decode[0] == "decode auto"
    assert decode[1] == [[0, 2, 5], [1, 2, 4, 5, 6, 7, 8], [3, 2], 4, 2, 8, 4]  # (indptr, indices, last lengths, ...)
    assert decode[2].pop("seq_lens").tolist() == [7, 10]
    assert decode[2] == {"pos_encoding_mode": "NONE", **scale}
    assert prefill[0] == "prefill auto"
    assert prefill[1][0] == [0, 3] and prefill[1][1] == [5, 7] and prefill[1][3] == [1]
    assert prefill[2]["causal"] is True and prefill[2]["seq_lens"].tolist() == [5]
    assert {k: prefill[2][k] for k in scale} == scale
    assert cache[("range_4", "cpu")].is_pinned()  # the decode plan's 3 query offsets: the entry of 4, pinned
    out = kernel.attend(0, torch.zeros(5, 4, 8), torch.zeros(1), torch.zeros(1))
    assert bool((out == 1).all())
    # a padded eager decode step (3 requests in 4 rows): as vLLM's builder, the decode wrapper takes all 4 rows,
    # the padding row's (no pages, no KV) included, and runs over all of them
    plans.clear()
    spec = BatchSpec(num_computed_tokens=np.full(3, 6, np.int32), num_scheduled_tokens=np.ones(3, np.int32),
                     block_table=table[:3], block_size=4, num_reqs_padded=4, num_tokens_padded=4)
    built = composer.build(spec)
    kernel.prepare(built.common, built.metadata)
    assert [p[0] for p in plans] == ["decode auto"] and plans[0][1][0] == [0, 2, 4, 6, 6]
    assert plans[0][2]["seq_lens"].tolist() == [7, 7, 7, 0] and cache[("range_8", "cpu")].is_pinned()
    out = kernel.attend(0, torch.zeros(4, 4, 8), torch.zeros(1), torch.zeros(1))
    assert bool((out == 1).all())
    import doctest

    runner = doctest.DocTestRunner()
    for test in doctest.DocTestFinder().find(km.resolve_plans, "resolve_plans", globs={"resolve_plans": km.resolve_plans}):
        runner.run(test)
    assert runner.summarize(verbose=False) == (0, 1)
    with pytest.raises(ValueError, match=r"needs FlashInfer 0\.7"):
        km.resolve_plans("vllm", "0.5.3")
    with pytest.raises(ValueError, match="plans: one of"):
        km.resolve_plans("fa3", "0.7.2")


@pytest.mark.parametrize("plans", ["vllm", "fa2"])
def test_flashinfer_graph_wrappers_read_the_stager_s_fields(monkeypatch: pytest.MonkeyPatch, plans: str) -> None:
    """``use_graph_buffers`` (the engine calls it before capturing): the CUDA-graph decode wrappers are made
    over the graph-mode stager's fixed-address fields of the page table, the first rows of each (so the
    captured kernels read what the step's one copy wrote). Under the ``vllm`` plans a wrapper's first plan
    is FlashInfer's ``plan()`` and every later one ``fast_decode_plan`` (which copies nothing into the
    buffers), as vLLM's builder plans its graph wrappers; under ``fa2`` every plan is ``plan()``. A step
    whose page table is elsewhere is refused, and so is binding the buffers once wrappers exist. A
    stand-in FlashInfer records what the kernel asks of it."""
    import types

    from attnmeta import BatchSpec, Stager, StaticProfile
    from attnmeta.compose import Group, StepBuilder
    from examples.engine import kernels as km

    calls: list[tuple[str, Any, list[Any], dict[str, Any]]] = []

    class Decode:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.buffers = {k: v for k, v in kwargs.items() if k.endswith("_buffer")}

        def plan(self, *args: Any, **kwargs: Any) -> None:
            calls.append(("plan", self, [a.tolist() if isinstance(a, torch.Tensor) else a for a in args], kwargs))

    def fast_decode_plan(w: Any, *args: Any, **kwargs: Any) -> None:
        calls.append(("fast", w, [a.tolist() if isinstance(a, torch.Tensor) else a for a in args], kwargs))

    decode_mod = types.SimpleNamespace(fast_decode_plan=fast_decode_plan)
    utils = types.SimpleNamespace(_get_range_buf=lambda n, d: None, _cache_buf={})
    lib = types.SimpleNamespace(__version__="0.7.2.post1" if plans == "vllm" else "0.5.3",
                                BatchDecodeWithPagedKVCacheWrapper=Decode, BatchPrefillWithPagedKVCacheWrapper=Decode,
                                utils=utils, decode=decode_mod)
    _stand_in_flashinfer(monkeypatch, lib, utils=utils, decode=decode_mod)
    monkeypatch.setattr(km, "mark_absent", lambda names: [])
    kernel = km.FlashInferKernel(4, 2, 8, torch.float32, torch.device("cpu"), ring=1)
    assert kernel.plans == plans
    profile = StaticProfile(max_num_reqs=8, max_num_tokens=64, max_blocks_per_req=4, block_size=4)
    kernel.max_pages = profile.max_num_pages

    def composer() -> StepBuilder:
        return StepBuilder(Stager("cpu", profile=profile), Group(kernel.builders()))

    table = np.arange(1, 17, dtype=np.int32).reshape(4, 4)

    def decode_step(c: StepBuilder, computed: int) -> Any:  # 3 requests padded to 4 rows
        return c.build(BatchSpec(num_computed_tokens=np.array([computed, 9, 2], np.int32),
                                 num_scheduled_tokens=np.ones(3, np.int32), block_table=table[:3], block_size=4,
                                 num_reqs_padded=4, num_tokens_padded=4))

    comp = composer()
    first = decode_step(comp, 6)
    names = ("paged_kv_indptr", "paged_kv_last_page_len", "paged_kv_indices")
    full = [first.step.device_full(f"common.{n}") for n in names]
    kernel.use_graph_buffers(*full)
    for computed in (6, 7):
        built = decode_step(comp, computed)
        kernel.prepare(built.common, built.metadata, graph_batch=4)
    w = kernel.graph_wrapper(4)
    bufs = w.buffers
    assert bufs["paged_kv_indptr_buffer"].data_ptr() == full[0].data_ptr() and len(bufs["paged_kv_indptr_buffer"]) == 5
    assert bufs["paged_kv_last_page_len_buffer"].data_ptr() == full[1].data_ptr()
    assert len(bufs["paged_kv_last_page_len_buffer"]) == 4
    assert bufs["paged_kv_indices_buffer"] is full[2]
    assert [(kind, who is w) for kind, who, _a, _k in calls] == [("plan", True), ("fast" if plans == "vllm" else "plan", True)]
    _k, _w, args, kwargs = calls[1]
    # the second step: contexts 8, 10, 3 (2, 3 and 1 pages of 4; the padding row none), the indices' device view
    assert args[:3] == [[0, 2, 5, 6, 6], [1, 2, 5, 6, 7, 9], [4, 2, 3, 0]] and args[3:] == [4, 2, 8, 4]
    assert kernel.fast_plans == (1 if plans == "vllm" else 0)
    if plans == "vllm":
        assert kwargs == {"pos_encoding_mode": "NONE", "q_data_type": torch.float32, "kv_data_type": torch.float32,
                          "sm_scale": 8 ** -0.5}
    other = decode_step(composer(), 6)  # another stager's step: its page table is not in the wrappers' buffers
    with pytest.raises(ValueError, match="not in the tensors of use_graph_buffers"):
        kernel.prepare(other.common, other.metadata, graph_batch=4)
    with pytest.raises(RuntimeError, match="before capturing"):
        kernel.use_graph_buffers(*full)
    fresh = km.FlashInferKernel(4, 2, 8, torch.float32, torch.device("cpu"), ring=1)
    fresh.max_pages = profile.max_num_pages
    with pytest.raises(ValueError, match=r"indices must be a 1-D int32 tensor on cpu of at least \d+ rows"):
        fresh.use_graph_buffers(full[0], full[1], full[2][:3])
    fresh.use_graph_buffers(full[0][:4], full[1], full[2])  # (a graph of 4 rows needs 5 offsets)
    with pytest.raises(ValueError, match="a graph of 4 rows needs 5 rows of indptr"):
        fresh.graph_wrapper(4)


def test_flashinfer_kernel_takes_the_current_cuda_device_s_tensors() -> None:
    """A kernel made for ``cuda`` takes graph buffers on ``cuda:0`` (the stager's fields carry the index;
    found on the GPU machine, where ``use_graph_buffers`` refused them), and refuses another device's;
    ``_on``'s doctest runs too."""
    import doctest
    import types

    from examples.engine import kernels as km

    def on(name: str) -> Any:  # (a tensor's device without CUDA: all the rule reads)
        return types.SimpleNamespace(device=torch.device(name))

    assert km._on(on("cuda:0"), torch.device("cuda")) and km._on(on("cuda:1"), torch.device("cuda:1"))
    assert not km._on(on("cuda:1"), torch.device("cuda:0")) and not km._on(on("cpu"), torch.device("cuda"))
    runner = doctest.DocTestRunner()
    for test in doctest.DocTestFinder().find(km._on, "_on", globs={"_on": km._on, "torch": torch}):
        runner.run(test)
    assert runner.summarize(verbose=False) == (0, 1)


def test_vllm_mode_marks_flashinfer_s_missing_optional_packages_absent(monkeypatch: pytest.MonkeyPatch) -> None:
    """``mark_absent`` (the vllm mode, before vLLM's FlashInfer backend is imported): a package no finder
    can import becomes ``None`` in ``sys.modules``, so importing it fails at once, as FlashInfer's checks
    expect, instead of searching the whole path at every plan; an importable one is left alone. Its
    docstring's example runs too."""
    import doctest
    import importlib
    import sys

    from examples.engine import vllm_metadata

    runner = doctest.DocTestRunner()
    for test in doctest.DocTestFinder().find(vllm_metadata.mark_absent, "mark_absent",
                                             globs={"mark_absent": vllm_metadata.mark_absent}):
        runner.run(test)
    assert runner.summarize(verbose=False) == (0, 3)
    name = "attnmeta_test_missing_package"
    monkeypatch.delitem(sys.modules, name, raising=False)
    assert vllm_metadata.mark_absent((name, "json")) == [name] and sys.modules[name] is None
    searched: list[str] = []
    monkeypatch.setattr(sys, "meta_path", [_Recorder(searched), *sys.meta_path])
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(name)
    assert searched == []  # (no finder was asked)
    assert vllm_metadata.mark_absent((name,)) == []  # (already marked: left as it is)
    assert vllm_metadata.FLASHINFER_OPTIONAL == ("cudnn",)


class _Recorder:
    """A meta-path finder that records the names it is asked for and finds nothing."""

    def __init__(self, names: list[str]) -> None:
        self.names = names

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        self.names.append(name)


def test_every_cli_option_says_what_it_takes(capsys: pytest.CaptureFixture[str]) -> None:
    """``--help`` describes every option (``--workloads`` had no help text)."""
    from examples.engine.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    options = out[out.index("options:"):].split("\n")[1:]
    described: dict[str, str] = {}
    flag = ""
    for line in options:
        if line.startswith("  -"):
            flag = line.split()[0].rstrip(",")
            described[flag] = line.strip()[len(line.split()[0]):]
        elif flag:
            described[flag] += line.strip()
    undocumented = [f for f, text in described.items() if text.strip().strip(f.upper().lstrip("-")).strip() == ""]
    assert described and not undocumented, undocumented
