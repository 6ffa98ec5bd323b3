#!/usr/bin/env bash
# Everything attnmeta needs a GPU for, on the GPU machine (docs/benchmarks.md quotes its output):
#   gpu     tests/gpu: staging (one H2D per step from a profiler trace, a 10,000-step race test with
#           fencing on and a control with fencing off, CUDA-graph replay after 1,000 commits), real
#           kernels fed by attnmeta metadata; all under torch.cuda.set_sync_debug_mode("error");
#   decode  benchmarks/bench_decode.py on cuda: the steady-state decode step, composable and fused; then
#           its --cold mode (attnmeta, fused and the jitter control, back to back / after a blocking
#           event wait / after a sleep); benchmarks/bench_spec.py: constructing a step's BatchSpec;
#   ab      benchmarks/ab_commit.py on cuda against the base package exported into .ab_base/attnmeta
#           (git archive BASE attnmeta | tar -x -C .ab_base; carry .ab_base) -> ab.txt; AB_ROUNDS and
#           AB_STEPS (default 12, 300) set its rounds, AB_BATCHES and AB_PATHS its batches and rows (default
#           1,64,256,1024 and every row), AB_ARGS adds flags (e.g. "--engine-steps --cold": the engine rows on
#           the reference engine's own decode steps, each after a cache thrash);
#   floor   benchmarks/bench_replay_floor.py on cuda against .ab_base, as ab (carry .ab_base) -> floor.txt: the
#           fused step, hand-written replays of its layouts doing only what the contract requires, and one
#           making its objects by the builders' own calls, each against the base's fused step; FLOOR_ROUNDS,
#           FLOOR_STEPS, FLOOR_BATCHES (default 8, 300, 1,64,256,1024);
#   twin    benchmarks/bench_loop_twin.py on cuda: the ~1.2B Llama's graph-mode loop, its composer call timed alone
#           and right after a twin engine's composer call with the same arguments, and after three primers that
#           split what the twin warms: the interpreter, the libraries' entry points, attnmeta's compiled calls
#           (what goes cold in the loop; five variants a round, so about twice the time of the first two alone;
#           TWIN_CONCURRENCY, default 64,256; TWIN_MODELS, default 1b, "1b hybrid-1b" adds the hybrid's eager
#           loop, which needs .kernels carried as hybridbench) -> loop_twin.txt; needs FlashInfer as enginebench;
#   phases  benchmarks/bench_loop_phases.py on cuda: the engine loop's composer call split into phases, timing marks
#           put in at import (PHASES_MODELS, default "1b hybrid-1b": the Llama's graph-mode loop and the hybrid's
#           eager one, which needs .kernels; PHASES_CONCURRENCY, default 64,256) -> loop_phases.txt; needs FlashInfer
#           as enginebench (carry .whl and .kernels);
#   abengine  benchmarks/ab_engine.py on cuda: the reference engine's loop (1.24B Llama, graphs; ABENGINE_MODEL,
#           ABENGINE_MODE, ABENGINE_CONCURRENCY, ABENGINE_ROUNDS; ABENGINE_ARGS adds flags, e.g. --symmetric: both
#           import orders, each in a process of its own, twice the time) with this checkout's attnmeta against the base's,
#           exported into .ab_base (git archive BASE attnmeta examples/engine | tar -x -C .ab_base; carry .ab_base, or
#           carry a tarball of it beside .vllm and .kernels and unpack it first) -> ab_engine.txt; needs FlashInfer
#           as enginebench (ABENGINE_MODEL=hybrid-1b also .kernels, which both engines load: .vllm with .kernels
#           and .ab_base is over the call's 64 MiB, so carry .whl for FlashInfer there); the base's engine times
#           its own window (84c4997 made it the composer's call):
#           to compare only attnmeta across that commit, export the base's attnmeta with this checkout's
#           examples/engine;
#   before-after  a kernel test on this tree and on a copy of it with the files under $BEFORE (default
#           .ab_base/before-fix, carried) laid over it: the code before a fix, so the test that comes
#           with the fix shows it fails before and passes after -> before_after.log. $BEFORE_TEST
#           (default: the GDN suite's fresh one-token prompt over a dirty state slot) names it;
#   bench   `python -m attnmeta bench` on cuda, every scenario -> bench.json, and benchmarks/report.py's
#           Markdown table (bench_table.md) and plot (bench.png) of it;
#   mamba   benchmarks/bench_mamba2.py on cuda;
#   suites  the host / backend / staging / docs suites with the reference device fixture on cuda (these
#           tests read device results back to compare them, so they run without the session audit), and
#           the sync suite with the whole session under the audit in CUDA "error" mode;
#   audit   `python -m attnmeta audit` on cuda;
#   kernels tests/gpu/test_mla_kernels_cuda.py and test_gdn_kernels_cuda.py side by side, with -s (so the
#           "KERNEL ..." lines, each kernel's batches and worst error, reach kernels.log and
#           kernels_summary.txt; kernels_mla.log, kernels_gdn.log per file): FlashInfer's MLA paged wrapper
#           planned from attnmeta's MLA decode metadata and the chunked-context prefill through varlen_attn,
#           against a dense float32 MLA; fla-core's gated-delta-rule Triton kernels fed by the GDN metadata,
#           against a float64 recurrence. Needs FlashInfer (0.5.3) and fla-core (0.6.0) importable, else
#           both files skip with the reason; FlashInfer JIT-compiles its MLA kernels on the first run and
#           Triton autotunes fla's (a few minutes). The gpu part leaves these two files to this part.
#   engine  the reference engine (examples/engine): tests/gpu/test_engine_cuda.py (a small Llama through
#           every kernel, tokens against generate, the steady-state loop under the audit) -> engine.log,
#           then `python -m examples.engine --device cuda` (the ~1.2B Llama, every kernel, both
#           workloads) -> engine_check.txt. Needs transformers and FlashInfer (flashinfer kernels skip);
#   enginebench  benchmarks/bench_engine.py: steady-state decode of the ~1.2B engine at 1/64/256
#           requests, graphs / eager / per-tensor uploads ($ENGINE_MODES, default all three), with the
#           cold-step replica of the same composition -> engine_bench.txt, engine_bench.json. Needs FlashInfer:
#           .site's (installed from a carried .whl when it is not there yet), else vLLM's pinned one when
#           .vllm holds it (fetch_vllm.py --flashinfer; carry .vllm), else the part fails saying so
#           (hybridbench alike);
#   hybrid  the reference engine's hybrid model (Bamba: Mamba2 and attention layers), its Mamba2 layers through
#           vLLM 0.33.0's Triton kernels (needs .kernels carried, as mamba-kernels; its FlashInfer rows .whl or
#           .vllm, as enginebench, else they skip): the hybrid tests of
#           tests/gpu/test_engine_cuda.py (a small Bamba, both Mamba cache modes, tokens against generate and
#           teacher-forced, a broken initial-state flag caught, the loop under the audit) -> hybrid.log; then
#           `python -m examples.engine --device cuda --model hybrid-1b` (a ~1.4B Bamba, torch-paged and
#           FlashInfer attention, workloads hybrid and hybrid-align) -> hybrid_check.txt;
#   hybridbench  `benchmarks/bench_engine.py --model hybrid-1b` (its steady state, and the Mamba group's part
#           of the step) -> hybrid_bench.txt, hybrid_bench.json (carry .kernels). Triton autotunes the SSD
#           kernels in each process's warm-up.
#   mamba-kernels  tests/kernels/test_mamba_kernels.py with -s on cuda: vLLM 0.33.0's own Mamba2 Triton
#           kernels (mamba_chunk_scan_combined_varlen, causal_conv1d_fn / _update, selective_state_update,
#           store_prefill_checkpoint) and upstream mamba_ssm's mamba_chunk_scan_combined fed by attnmeta's
#           Mamba2 metadata, against a float64 recurrence -> mamba_kernels.log and mamba_kernels_summary.txt
#           (the "KERNEL ...", "NOTE ..." and "MUTATION ..." lines). The kernels are third-party files in
#           the ignored folder .kernels/ (vLLM's kernel files with stand-ins for what they import, and
#           mamba_ssm and einops unpacked; 2 MB): make it on the dev machine with
#           `python tests/kernels/fetch_kernels.py` (--vllm-dir PATH or --vllm-wheel PATH, else it downloads
#           the 340 MB vLLM wheel; a Python with torch, to build mamba_ssm) and carry it: the device call
#           names ".kernels" in carry. Without it the part fails with that message. Triton compiles and
#           autotunes the kernels on the first batches (about 300 configs, a few minutes);
#           ATTNMETA_KERNELS_FIRST_CONFIG=1 keeps each kernel's first config instead, should that not fit.
#   multi   needs 2 GPUs (the nvidia-h200-x2 machine; on fewer the part says so and fails), so it runs only
#           when named: tests/gpu/test_multi_cuda.py with -s (MultiStager on cuda:0 and cuda:1: one H2D per
#           device per step from a profiler trace, no sync, the race test with both streams held and its
#           control, CUDA-graph replay on both devices, the "MULTI ..." lines of host time against two
#           independent stagers; the shared ring with a reader process on cuda:1: its race test and control,
#           receives without a sync) -> multi_tests.log, multi_summary.txt; then benchmarks/bench_multi_rank.py
#           --device cuda --ranks 2 (independent / one-process / ring; decode batch 1 to 1024, then the mixed
#           step) -> multi_bench.txt. The gpu part leaves test_multi_cuda.py to this part.
#   vllm    the reference engine's vllm metadata mode (vLLM 0.33.0's runner buffers and builders; needs .vllm
#           carried, made on the dev machine with `python tests/kernels/fetch_vllm.py`, and .whl, .kernels):
#           tests/gpu/test_engine_vllm_cuda.py (tokens against generate and teacher-forced, Llama and Bamba, the
#           vllm mode's sync count) -> vllm.log; then the harness on vLLM's own builders on cuda,
#           tests/integrations/test_vllm_builders.py -m vllm (its "HARNESS ..." lines: cases, disagreements and
#           syncs per build of each builder) -> vllm_harness.log, vllm_harness_summary.txt; VLLM_ENGINE_TESTS, a
#           pytest -k expression, picks the engine tests to run (default: all), VLLM_HARNESS=0 skips the harness;
#   vllmbench  the headline: benchmarks/bench_engine.py on the ~1.2B Llama at 1/64/256 requests, the modes
#           alternating in rounds: --modes graphs,vllm-graphs (FlashInfer in CUDA graphs, fed by attnmeta or by
#           vLLM's FlashInfer builder) where .vllm holds vLLM's pinned FlashInfer, else varlen,vllm-varlen
#           (FlashAttention's varlen kernel, eager, fed by attnmeta or by vLLM's FlashAttention builder) ->
#           vllm_bench.txt, vllm_bench.json; then hybrid-1b, eager,vllm-eager (or varlen,vllm-varlen) ->
#           vllm_hybrid_bench.txt, vllm_hybrid_bench.json. FlashInfer's first use JIT-compiles its kernels for
#           minutes (vLLM's FA3 prefill among them) into the machine's cache, which lasts while the machine is
#           warm: run the parts in back-to-back calls, one model or concurrency a call
#           (carry .vllm, .whl, .kernels; VLLMBENCH_MODELS, default "1b hybrid-1b", picks the models,
#           VLLMBENCH_MODES the modes, VLLMBENCH_CONCURRENCY the requests, default 1,64,256, VLLMBENCH_ROUNDS
#           the alternating rounds, default 3; one model's three rows of two modes take about one call;
#           VLLMBENCH_ARRIVE the steps the timed runs' requests arrive over, default 0 (all at once): bench_engine.py
#           --arrive-over, a table of every step's metadata time, mixed steps included; VLLMBENCH_NEW each
#           request's new tokens, default 96;
#           VLLMBENCH_PROCESSES the fresh processes, one after another, default 1: bench_engine.py --processes,
#           the pairs' ratios per process and their median, every other process in the reverse order of
#           the modes; VLLMBENCH_REVERSE=1 reverses the order, for the other half of a run split over calls.
#           A process repeats the whole measurement: three
#           Llama processes at 64,256 took one call of 342 s, one hybrid process at 64,256 about half a call,
#           so give the hybrid one concurrency a call, and VLLMBENCH_TIMEOUT the call's time less about 40 s
#           of set-up; a mode MODE#2 in VLLMBENCH_MODES is a twin engine of MODE, an A/A). The
#           FlashInfer pairs (graphs,vllm-graphs and
#           eager,vllm-eager) need vLLM's FlashInfer backend, which imports only with the FlashInfer vLLM pins:
#           make .vllm with `fetch_vllm.py --flashinfer` (.vllm is then 58 MB and needs nothing of .whl: carry
#           [".vllm", ".kernels"] only, the call's 64 MiB limit); vllm_site puts that FlashInfer first on
#           PYTHONPATH.
#   launchprof  benchmarks/bench_launch_profile.py: engines of LAUNCHPROF_MODES (default eager,eager#2,vllm-eager)
#           on LAUNCHPROF_MODEL (default hybrid-1b) at LAUNCHPROF_CONCURRENCY requests (default 256), their launch
#           times unprofiled, then one run each under cProfile: the functions whose own time differs most
#           between the engines -> launch_profile.txt (carry .vllm .kernels, as vllmbench); LAUNCHPROF_ARGS more
#           flags (e.g. "--callers find_spec": who calls the functions that match);
#   replay  benchmarks/bench_replay.py on cuda: each builder that replays, its decode step through the step
#           composer's build_counts replayed against composed (a twin whose replay_key is None), at 1, 64 and
#           256 requests (REPLAY_ROUNDS, default 6) -> replay.txt (about 2 min; no carry);
#   regress the checks a change to staging or the builders must pass on the GPU, in one call (about 5 min):
#           tests/gpu as part gpu, then every test of tests/gpu/test_engine_cuda.py (the small Llama through
#           every kernel and the small Bamba, tokens against generate, the loops under the audit), with
#           FlashInfer -> regress.log; the 1.2B models' checks of parts engine and hybrid are left out
#           (carry .vllm .kernels, or .whl .kernels);
# Usage: bash benchmarks/gpu_all.sh [OUTDIR] [PARTS]   (logs, bench.json, bench_table.md and bench.png go
#   into OUTDIR, default ./out; PARTS is any of "gpu decode bench mamba suites audit kernels engine
#   enginebench mamba-kernels hybrid hybridbench multi ab before-after", default all but the last three). One device call allows
#   600 s, so a full run takes nine calls: PARTS="gpu decode bench", "mamba audit", "suites", "kernels",
#   "engine", "enginebench", then "mamba-kernels", "hybrid" and "hybridbench" (each with carry
#   [".kernels"]; the last two also ".whl");
#   on the nvidia-h200-x2 machine PARTS="multi" is one more; "twin" (carry .vllm or .whl for FlashInfer), "phases"
#   (carry .whl .kernels), "ab",
#   "abengine" and "before-after" (carry .ab_base;
#   before-after also .whl, for fla's kernels), "vllm", "vllmbench" and "launchprof" (carry .vllm .whl .kernels, or
#   .vllm .kernels when .vllm holds FlashInfer) are asked for by name.
set -u -o pipefail
OUT_DIR=${1:-${OUT:-out}}
PARTS=" ${2:-gpu decode bench mamba suites audit kernels engine enginebench mamba-kernels hybrid hybridbench} "  # multi, ab, floor, abengine, twin, phases, before-after, vllm, vllmbench, launchprof, regress, replay: by name
want() { [[ "$PARTS" == *" $1 "* ]]; }
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" ATTNMETA_HYPOTHESIS_PROFILE=gpu
PY=${PYTHON:-python3}
status=0
failed() {  # a step that failed: say which and how (124: it ran past its timeout), so a red run names its cause
  echo "FAILED: $1 (exit $2$([[ $2 == 124 ]] && echo ', timed out'))" | tee -a "$OUT_DIR/failures.txt" >&2
  status=1
}
$PY - <<'PYEOF' 2>&1 | tee "$OUT_DIR/env.txt"
import platform, torch, numba, numpy, hypothesis
print("date", __import__("datetime").date.today(), "python", platform.python_version(), "torch", torch.__version__,
      "numba", numba.__version__, "numpy", numpy.__version__, "hypothesis", hypothesis.__version__)
print("device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "NO CUDA")
PYEOF
vllm_site() {  # vLLM's Python package (.vllm, from tests/kernels/fetch_vllm.py) unpacked into .vsite, on PYTHONPATH
  if [[ ! -f .vllm/vllm-python.zip ]]; then
    echo "no .vllm/vllm-python.zip: run python tests/kernels/fetch_vllm.py on the dev machine and carry .vllm" >&2
    return 1
  fi
  $PY -m zipfile -e .vllm/vllm-python.zip .vsite || return 1  # always: a warm machine may hold an older one
  local stamp; stamp=$(ls .vllm/wheels | md5sum)
  if [[ "$(cat .vsite/.wheels 2>/dev/null)" != "$stamp" ]]; then  # the wheels not yet installed here
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .vsite .vllm/wheels/*.whl \
      || return 1
    echo "$stamp" > .vsite/.wheels
  fi
  local vsite_path="$PYTHONPATH:$PWD/.vsite"
  if [[ -f .vllm/flashinfer.zip ]]; then  # vLLM's pinned FlashInfer (fetch_vllm.py --flashinfer), ahead of .whl's
    stamp=$(md5sum < .vllm/flashinfer.zip)
    if [[ "$(cat .vfi/.zip 2>/dev/null)" != "$stamp" ]]; then
      rm -rf .vfi && $PY -m zipfile -e .vllm/flashinfer.zip .vfi && echo "$stamp" > .vfi/.zip || return 1
    fi
    vsite_path="$PWD/.vfi:$vsite_path"
  fi
  export PYTHONPATH="$vsite_path" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
    VLLM_CACHE_ROOT="$PWD/.vllm/cache"  # the model-info cache fetch_vllm.py made: no model module imported
  $PY -c "import vllm, vllm.config, vllm.v1.worker.block_table, vllm.v1.attention.backends.flash_attn, \
vllm.v1.attention.backends.mamba2_attn; print('vLLM', vllm.__version__, \
'imports from .vsite'); import importlib.util as u, sys; sys.exit(0) if u.find_spec('flashinfer') is None else None; \
import flashinfer; print('FlashInfer', flashinfer.__version__, 'from', flashinfer.__file__)" 2>&1 | grep -v "^INFO\|^WARNING" | tail -5
  [[ ${PIPESTATUS[0]} -eq 0 ]] || { echo "vLLM's Python package does not import (above)" >&2; return 1; }
}
flashinfer_site() {  # FlashInfer importable for the engine's benchmarks: .site's (.whl) or, carried in .vllm, vLLM's pinned one
  $PY -c "import flashinfer" 2>/dev/null && return 0
  if [[ -f .vllm/flashinfer.zip ]] && vllm_site && $PY -c "import flashinfer" 2>/dev/null; then return 0; fi
  if compgen -G ".whl/flashinfer_python-*.whl" > /dev/null; then  # .whl carried, not yet installed (gpu-wheels.sh)
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl || return 1
    export PYTHONPATH="$PYTHONPATH:$PWD/.site" FLASHINFER_CUDA_ARCH_LIST="${FLASHINFER_CUDA_ARCH_LIST:-9.0}"
    $PY -c "import flashinfer" 2>/dev/null && return 0
  fi
  echo "no FlashInfer: carry .whl (from gpu-wheels.sh) or .vllm made by tests/kernels/fetch_vllm.py --flashinfer" >&2
  return 1
}
gpu_tests() {  # tests/gpu but the kernel suites and engines other parts run, appended to log $1
  timeout 150 $PY -m pytest -p attnmeta.testing.pytest_plugin tests/gpu -q -rs -p no:cacheprovider \
    --ignore=tests/gpu/test_mla_kernels_cuda.py --ignore=tests/gpu/test_gdn_kernels_cuda.py \
    --ignore=tests/gpu/test_engine_cuda.py --ignore=tests/gpu/test_multi_cuda.py \
    --ignore=tests/gpu/test_engine_vllm_cuda.py 2>&1 | tee -a "$1" || status=1
}
if want gpu; then
echo "== gpu: tests/gpu" | tee "$OUT_DIR/gpu_tests.log"
gpu_tests "$OUT_DIR/gpu_tests.log"
fi
if want regress; then
echo "== regress: tests/gpu, then the engine's GPU tests with FlashInfer" | tee "$OUT_DIR/regress.log"
gpu_tests "$OUT_DIR/regress.log"
if flashinfer_site >> "$OUT_DIR/regress.log" 2>&1; then  # (no pipe: its PYTHONPATH must stay)
  export TRITON_CACHE_AUTOTUNING=1
  timeout 380 $PY -m pytest -p attnmeta.testing.pytest_plugin tests/gpu/test_engine_cuda.py -q -rs \
    -p no:cacheprovider 2>&1 | tee -a "$OUT_DIR/regress.log" || status=1
else
  status=1
fi
fi
if want decode; then
echo "== decode: steady-state decode step" | tee "$OUT_DIR/bench_decode.txt"
timeout 200 $PY benchmarks/bench_decode.py --device cuda --threads 4 2>&1 | tee -a "$OUT_DIR/bench_decode.txt" || status=1
timeout 150 $PY benchmarks/bench_decode.py --device cuda --cold --paths attnmeta,fused,jitter --rounds 6 2>&1 \
  | tee -a "$OUT_DIR/bench_decode.txt" || status=1
timeout 60 $PY benchmarks/bench_spec.py 2>&1 | tee -a "$OUT_DIR/bench_decode.txt" || status=1
fi
if want replay; then
echo "== replay: each replaying builder's decode step, replayed against composed" | tee "$OUT_DIR/replay.txt"
timeout 300 $PY benchmarks/bench_replay.py --device cuda --rounds "${REPLAY_ROUNDS:-6}" --steps 200 2>&1 \
  | tee -a "$OUT_DIR/replay.txt" || status=1
fi
if want ab; then
echo "== ab: this checkout against .ab_base (benchmarks/ab_commit.py)" | tee "$OUT_DIR/ab.txt"
if [[ -f .ab_base/attnmeta/__init__.py ]]; then
  # shellcheck disable=SC2086  # (AB_ARGS: flags, word-split on purpose: e.g. "--engine-steps --cold")
  timeout 480 $PY benchmarks/ab_commit.py .ab_base --device cuda --rounds "${AB_ROUNDS:-12}" --steps "${AB_STEPS:-300}" \
    --batches "${AB_BATCHES:-1,64,256,1024}" --paths "${AB_PATHS:-}" ${AB_ARGS:-} 2>&1 | tee -a "$OUT_DIR/ab.txt" || status=1
else
  echo "no .ab_base/attnmeta: export the base (git archive BASE attnmeta | tar -x -C .ab_base) and carry .ab_base" \
    | tee -a "$OUT_DIR/ab.txt"; status=1
fi
fi
if want floor; then
echo "== floor: the fused step and the contract's floor against .ab_base (benchmarks/bench_replay_floor.py)" \
  | tee "$OUT_DIR/floor.txt"
if [[ -f .ab_base/attnmeta/__init__.py ]]; then
  timeout 480 $PY benchmarks/bench_replay_floor.py .ab_base --device cuda --rounds "${FLOOR_ROUNDS:-8}" \
    --steps "${FLOOR_STEPS:-300}" --batches "${FLOOR_BATCHES:-1,64,256,1024}" 2>&1 | tee -a "$OUT_DIR/floor.txt" || status=1
else
  echo "no .ab_base/attnmeta: export the base (git archive 3786481 attnmeta | tar -x -C .ab_base) and carry .ab_base" \
    | tee -a "$OUT_DIR/floor.txt"; status=1
fi
fi
per_model() {  # PART SCRIPT OUT MODELS CONCURRENCY SECONDS: benchmarks/SCRIPT on cuda once per model, into OUT
  local part=$1 script=$2 out=$3 models=$4 concurrency=$5 seconds=$6 m rc
  if ! flashinfer_site >> "$out" 2>&1; then  # (no pipe: its PYTHONPATH must stay)
    failed "$part" 1; return
  fi
  for m in $models; do
    timeout "$seconds" $PY "benchmarks/$script" --device cuda --model "$m" --concurrency "$concurrency" \
      2>&1 | grep -v "flashinfer.jit\|artifactory\|Mamba SSU config" | tee -a "$out"
    rc=${PIPESTATUS[0]}; [[ $rc -eq 0 ]] || failed "$part $m" "$rc"
  done
}
if want twin; then
echo "== twin: the engine's composer call alone and right after a twin engine's (benchmarks/bench_loop_twin.py)" \
  | tee "$OUT_DIR/loop_twin.txt"
per_model twin bench_loop_twin.py "$OUT_DIR/loop_twin.txt" "${TWIN_MODELS:-1b}" "${TWIN_CONCURRENCY:-64,256}" 540
fi
if want phases; then
echo "== phases: the engine's composer call split into phases (benchmarks/bench_loop_phases.py)" \
  | tee "$OUT_DIR/loop_phases.txt"
per_model phases bench_loop_phases.py "$OUT_DIR/loop_phases.txt" "${PHASES_MODELS:-1b hybrid-1b}" \
  "${PHASES_CONCURRENCY:-64,256}" 280
fi
if want abengine; then
echo "== abengine: this checkout's engine loop against .ab_base's (benchmarks/ab_engine.py)" | tee "$OUT_DIR/ab_engine.txt"
if [[ -f .ab_base/attnmeta/__init__.py && -f .ab_base/examples/engine/__init__.py ]] && flashinfer_site >> "$OUT_DIR/ab_engine.txt" 2>&1; then
  timeout 540 $PY benchmarks/ab_engine.py .ab_base --device cuda --model "${ABENGINE_MODEL:-1b}" \
    --mode "${ABENGINE_MODE:-graphs}" --concurrency "${ABENGINE_CONCURRENCY:-64,256}" --rounds "${ABENGINE_ROUNDS:-8}" \
    ${ABENGINE_ARGS:-} 2>&1 | grep -v "flashinfer.jit\|artifactory" | tee -a "$OUT_DIR/ab_engine.txt"
  rc=${PIPESTATUS[0]}; [[ $rc -eq 0 ]] || failed "abengine" "$rc"
else
  echo "abengine needs .ab_base/attnmeta and .ab_base/examples/engine (git archive BASE attnmeta examples/engine |" \
    "tar -x -C .ab_base; carry .ab_base) and FlashInfer (carry .vllm made by fetch_vllm.py --flashinfer, or .whl)" \
    | tee -a "$OUT_DIR/ab_engine.txt"; status=1
fi
fi
if want before-after; then
BEFORE=${BEFORE:-.ab_base/before-fix}
BEFORE_TEST=${BEFORE_TEST:-tests/gpu/test_gdn_kernels_cuda.py::test_a_fresh_one_token_prompt_starts_from_zeros_not_a_recycled_state_slot}
echo "== before-after: $BEFORE_TEST, after (this tree) and before ($BEFORE laid over a copy)" | tee "$OUT_DIR/before_after.log"
if [[ -d "$BEFORE" ]]; then
  timeout 250 $PY -m pytest -p attnmeta.testing.pytest_plugin "$BEFORE_TEST" -q -rs -p no:cacheprovider 2>&1 \
    | tail -20 | sed 's/^/after:  /' | tee -a "$OUT_DIR/before_after.log"
  [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
  copy=$(mktemp -d)
  tar -c --exclude=./.site --exclude=./.whl --exclude=./.ab_base --exclude=./.ab_exports --exclude=./.kernels . | tar -x -C "$copy"
  cp -r "$BEFORE"/. "$copy"/
  (cd "$copy" && PYTHONPATH="$copy${PYTHONPATH#$PWD}" timeout 250 $PY -m pytest -p attnmeta.testing.pytest_plugin \
    "$BEFORE_TEST" -q -rs -p no:cacheprovider 2>&1) | tail -20 | sed 's/^/before: /' | tee -a "$OUT_DIR/before_after.log"
  [[ ${PIPESTATUS[0]} -ne 0 ]] || { echo "before: the test passed without the fix" | tee -a "$OUT_DIR/before_after.log"; status=1; }
else
  echo "no $BEFORE: put the files before the fix there (their paths as in the checkout) and carry it" \
    | tee -a "$OUT_DIR/before_after.log"; status=1
fi
fi
if want bench; then
echo "== bench: python -m attnmeta bench" | tee "$OUT_DIR/bench.txt"
timeout 150 $PY -m attnmeta bench --device cuda --no-progress --reps 100 --json "$OUT_DIR/bench.json" 2>&1 | tee -a "$OUT_DIR/bench.txt" || status=1
timeout 30 $PY benchmarks/report.py "$OUT_DIR/bench.json" --plot "$OUT_DIR/bench.png" > "$OUT_DIR/bench_table.md" || status=1
fi
if want mamba; then
echo "== mamba: the Mamba2 step" | tee "$OUT_DIR/bench_mamba.txt"
timeout 240 $PY benchmarks/bench_mamba2.py --device cuda 2>&1 | tee -a "$OUT_DIR/bench_mamba.txt" || status=1
fi
if want suites; then
echo "== suites: host derivations vs references on cuda (the device fixture runs cpu and cuda)" | tee "$OUT_DIR/suite_audit.log"
timeout 150 $PY -m pytest tests/host -q -p no:cacheprovider 2>&1 | tail -15 | tee -a "$OUT_DIR/suite_audit.log" || status=1
echo "== suites: builders, staging, docs vs references on cuda" | tee -a "$OUT_DIR/suite_audit.log"
timeout 150 $PY -m pytest tests/backends tests/staging tests/docs -q -p no:cacheprovider 2>&1 | tail -15 | tee -a "$OUT_DIR/suite_audit.log" || status=1
echo "== suites: the sync-audit suite on cuda, the whole session under the audit (CUDA error mode)" | tee -a "$OUT_DIR/suite_audit.log"
timeout 60 $PY -m pytest -p attnmeta.testing.pytest_plugin --attnmeta-sync-audit tests/sync -q -p no:cacheprovider 2>&1 | tail -5 | tee -a "$OUT_DIR/suite_audit.log" || status=1
fi
if want audit; then
echo "== audit" | tee "$OUT_DIR/audit.txt"
timeout 300 $PY -m attnmeta audit --device cuda --batches 10 2>&1 | tee -a "$OUT_DIR/audit.txt" || failed audit $?
fi
if want kernels; then
echo "== kernels: MLA (FlashInfer, varlen_attn) and GDN (fla) kernels fed by attnmeta metadata" | tee "$OUT_DIR/kernels.log"
pids=()
for f in mla gdn; do  # side by side: FlashInfer's nvcc JIT and Triton's compiles overlap
  timeout 400 $PY -m pytest -p attnmeta.testing.pytest_plugin "tests/gpu/test_${f}_kernels_cuda.py" -q -s -rs \
    -p no:cacheprovider > "$OUT_DIR/kernels_$f.log" 2>&1 &
  pids+=($!)
done
for k in "${!pids[@]}"; do wait "${pids[$k]}" || failed "kernels ($([[ $k == 0 ]] && echo mla || echo gdn))" $?; done
cat "$OUT_DIR/kernels_mla.log" "$OUT_DIR/kernels_gdn.log" | tee -a "$OUT_DIR/kernels.log"
grep "^KERNEL " "$OUT_DIR/kernels.log" | tee "$OUT_DIR/kernels_summary.txt"
fi
if want engine; then
echo "== engine: the reference engine through every kernel, tokens against generate" | tee "$OUT_DIR/engine.log"
timeout 250 $PY -m pytest -p attnmeta.testing.pytest_plugin tests/gpu/test_engine_cuda.py -q -s -rs \
  -k "not hybrid" -p no:cacheprovider 2>&1 | tee -a "$OUT_DIR/engine.log" || status=1
timeout 300 $PY -m examples.engine --device cuda 2>&1 | tee "$OUT_DIR/engine_check.txt" || status=1
fi
if want enginebench; then
echo "== enginebench: steady-state decode of the ~1.2B engine" | tee "$OUT_DIR/engine_bench.txt"
if flashinfer_site >> "$OUT_DIR/engine_bench.txt" 2>&1; then  # (no pipe: its PYTHONPATH must stay)
  timeout 560 $PY benchmarks/bench_engine.py --device cuda --modes "${ENGINE_MODES:-graphs,eager,per-tensor}" \
    --json "$OUT_DIR/engine_bench.json" 2>&1 \
    | tee -a "$OUT_DIR/engine_bench.txt" || status=1
else
  failed enginebench 1
fi
fi
if want mamba-kernels; then
echo "== mamba-kernels: vLLM's and mamba_ssm's Mamba2 kernels fed by attnmeta metadata" | tee "$OUT_DIR/mamba_kernels.log"
if [[ -f .kernels/MANIFEST.txt ]]; then
  timeout 560 $PY -m pytest -p attnmeta.testing.pytest_plugin tests/kernels/test_mamba_kernels.py -q -s -rs \
    --durations=5 -p no:cacheprovider 2>&1 | tee -a "$OUT_DIR/mamba_kernels.log" || status=1
  grep -E "^(KERNEL|NOTE|MUTATION) " "$OUT_DIR/mamba_kernels.log" | tee "$OUT_DIR/mamba_kernels_summary.txt"
else
  echo "no .kernels/: run python tests/kernels/fetch_kernels.py on the dev machine and carry .kernels" \
    | tee -a "$OUT_DIR/mamba_kernels.log"
  status=1
fi
fi
if want hybrid; then
echo "== hybrid: the hybrid engine, Mamba2 layers through vLLM's kernels" | tee "$OUT_DIR/hybrid.log"
if [[ -f .kernels/MANIFEST.txt ]]; then
  export TRITON_CACHE_AUTOTUNING=1  # where Triton supports it, the processes share autotuning results
  # FlashInfer for the flashinfer rows (.whl's or .vllm's; without it those rows skip, saying so)
  flashinfer_site >> "$OUT_DIR/hybrid.log" 2>&1 || echo "hybrid: no FlashInfer (carry .whl or .vllm): its rows skip" \
    | tee -a "$OUT_DIR/hybrid.log"
  timeout 260 $PY -m pytest -p attnmeta.testing.pytest_plugin tests/gpu/test_engine_cuda.py -q -s -rs -k hybrid \
    -p no:cacheprovider 2>&1 | tee -a "$OUT_DIR/hybrid.log" || status=1
  timeout 300 $PY -m examples.engine --device cuda --model hybrid-1b 2>&1 | tee "$OUT_DIR/hybrid_check.txt" || status=1
else
  echo "no .kernels/: run python tests/kernels/fetch_kernels.py on the dev machine and carry .kernels" \
    | tee -a "$OUT_DIR/hybrid.log"
  status=1
fi
fi
if want hybridbench; then
echo "== hybridbench: the ~1.4B hybrid engine's steady state" | tee "$OUT_DIR/hybrid_bench.txt"
if [[ -f .kernels/MANIFEST.txt ]]; then
  if flashinfer_site >> "$OUT_DIR/hybrid_bench.txt" 2>&1; then  # (no pipe: its PYTHONPATH must stay)
    timeout 560 $PY benchmarks/bench_engine.py --device cuda --model hybrid-1b --json "$OUT_DIR/hybrid_bench.json" 2>&1 \
      | tee -a "$OUT_DIR/hybrid_bench.txt" || status=1
  else
    failed hybridbench 1
  fi
else
  echo "no .kernels/: run python tests/kernels/fetch_kernels.py on the dev machine and carry .kernels" \
    | tee -a "$OUT_DIR/hybrid_bench.txt"
  status=1
fi
fi
if want vllm; then
echo "== vllm: the engine's vllm metadata mode, tokens against generate" | tee "$OUT_DIR/vllm.log"
if vllm_site; then
  timeout 300 $PY -m pytest -p attnmeta.testing.pytest_plugin tests/gpu/test_engine_vllm_cuda.py -q -s -rs \
    -p no:cacheprovider ${VLLM_ENGINE_TESTS:+-k "$VLLM_ENGINE_TESTS"} 2>&1 | tee -a "$OUT_DIR/vllm.log"
  rc=${PIPESTATUS[0]}; [[ $rc -eq 0 ]] || failed "vllm (engine)" "$rc"
  if [[ ${VLLM_HARNESS:-1} != 0 ]]; then
  echo "== vllm: the harness on vLLM's own builders, on cuda" | tee "$OUT_DIR/vllm_harness.log"
  timeout 240 $PY -m pytest -m vllm tests/integrations/test_vllm_builders.py -q -s -rs -p no:cacheprovider 2>&1 \
    | tee -a "$OUT_DIR/vllm_harness.log"
  rc=${PIPESTATUS[0]}; [[ $rc -eq 0 ]] || failed "vllm (harness)" "$rc"
  grep "^HARNESS " "$OUT_DIR/vllm_harness.log" | tee "$OUT_DIR/vllm_harness_summary.txt"
  fi
else
  failed "vllm (no .vllm)" 1
fi
fi
if want vllmbench; then
echo "== vllmbench: attnmeta against vLLM's own metadata code in the same engine" | tee "$OUT_DIR/vllm_bench.txt"
if vllm_site; then
  # default pairs: FlashInfer's (the goal's: graphs for the Llama, eager for the hybrid) where vLLM's pinned
  # FlashInfer was packed (fetch_vllm.py --flashinfer), else FlashAttention's varlen kernel
  if [[ -f .vllm/flashinfer.zip ]]; then llama_modes=graphs,vllm-graphs hybrid_modes=eager,vllm-eager
  else llama_modes=varlen,vllm-varlen hybrid_modes=varlen,vllm-varlen; fi
  for m in ${VLLMBENCH_MODELS:-1b hybrid-1b}; do
    if [[ $m == 1b ]]; then
      timeout "${VLLMBENCH_TIMEOUT:-540}" $PY benchmarks/bench_engine.py --device cuda --modes "${VLLMBENCH_MODES:-$llama_modes}" --no-cold \
        --concurrency "${VLLMBENCH_CONCURRENCY:-1,64,256}" --rounds "${VLLMBENCH_ROUNDS:-3}" \
        --processes "${VLLMBENCH_PROCESSES:-1}" ${VLLMBENCH_REVERSE:+--reverse} --arrive-over "${VLLMBENCH_ARRIVE:-0}" \
        --new "${VLLMBENCH_NEW:-96}" --json "$OUT_DIR/vllm_bench.json" 2>&1 \
        | tee -a "$OUT_DIR/vllm_bench.txt"
      rc=${PIPESTATUS[0]}  # (read before any other command: [[ ]] has a PIPESTATUS of its own)
      [[ $rc -eq 0 ]] || failed "vllmbench (1b)" "$rc"
    else
      timeout "${VLLMBENCH_TIMEOUT:-540}" $PY benchmarks/bench_engine.py --device cuda --model hybrid-1b --modes "${VLLMBENCH_MODES:-$hybrid_modes}" \
        --no-cold --concurrency "${VLLMBENCH_CONCURRENCY:-1,64,256}" --rounds "${VLLMBENCH_ROUNDS:-3}" \
        --processes "${VLLMBENCH_PROCESSES:-1}" ${VLLMBENCH_REVERSE:+--reverse} --arrive-over "${VLLMBENCH_ARRIVE:-0}" \
        --new "${VLLMBENCH_NEW:-96}" --json "$OUT_DIR/vllm_hybrid_bench.json" \
        2>&1 | tee "$OUT_DIR/vllm_hybrid_bench.txt"
      rc=${PIPESTATUS[0]}
      [[ $rc -eq 0 ]] || failed "vllmbench (hybrid-1b)" "$rc"
    fi
  done
else
  failed "vllmbench (no .vllm)" 1
fi
fi
if want launchprof; then
echo "== launchprof: the engines' launches under the profiler, side by side (benchmarks/bench_launch_profile.py)" \
  | tee "$OUT_DIR/launch_profile.txt"
if vllm_site >> "$OUT_DIR/launch_profile.txt" 2>&1; then
  # shellcheck disable=SC2086  # (LAUNCHPROF_ARGS: flags, word-split on purpose)
  timeout "${LAUNCHPROF_TIMEOUT:-540}" $PY benchmarks/bench_launch_profile.py --device cuda --model "${LAUNCHPROF_MODEL:-hybrid-1b}" \
    --modes "${LAUNCHPROF_MODES:-eager,eager#2,vllm-eager}" --concurrency "${LAUNCHPROF_CONCURRENCY:-256}" \
    --rounds "${LAUNCHPROF_ROUNDS:-2}" ${LAUNCHPROF_ARGS:-} 2>&1 | grep -v "flashinfer.jit\|artifactory\|Mamba SSU config" \
    | tee -a "$OUT_DIR/launch_profile.txt"
  rc=${PIPESTATUS[0]}; [[ $rc -eq 0 ]] || failed "launchprof" "$rc"
else
  failed "launchprof (no .vllm)" 1
fi
fi
if want multi; then
echo "== multi: several GPUs (MultiStager, the shared ring)" | tee "$OUT_DIR/multi_tests.log"
ngpu=$($PY -c "import torch; print(torch.cuda.device_count())")
if [ "$ngpu" -lt 2 ]; then
  echo "multi: needs 2 CUDA devices, this machine has $ngpu (run it on nvidia-h200-x2)" | tee -a "$OUT_DIR/multi_tests.log"
  status=1
else
  timeout 300 $PY -m pytest -p attnmeta.testing.pytest_plugin tests/gpu/test_multi_cuda.py -q -s -rs \
    -p no:cacheprovider 2>&1 | tee -a "$OUT_DIR/multi_tests.log" || status=1
  grep "^MULTI " "$OUT_DIR/multi_tests.log" | tee "$OUT_DIR/multi_summary.txt"
  echo "== multi: host work of a step, derived once vs by every rank" | tee "$OUT_DIR/multi_bench.txt"
  timeout 150 $PY benchmarks/bench_multi_rank.py --device cuda --ranks 2 2>&1 | tee -a "$OUT_DIR/multi_bench.txt" || status=1
  timeout 100 $PY benchmarks/bench_multi_rank.py --device cuda --ranks 2 --scenario mixed 2>&1 \
    | tee -a "$OUT_DIR/multi_bench.txt" || status=1
fi
fi
exit $status
