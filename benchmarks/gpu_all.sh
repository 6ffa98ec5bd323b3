#!/usr/bin/env bash
# Everything attnmeta needs a GPU for, in ONE call on the GPU machine (see docs/benchmarks.md):
#   1. tests/gpu: staging (one H2D per step from a profiler trace, 10,000-step race test with fencing on
#      and a control with fencing off, CUDA-graph replay after 1,000 commits), real kernels fed by
#      attnmeta metadata; all under torch.cuda.set_sync_debug_mode("error");
#   2. `python -m attnmeta bench` on cuda (JSON for docs/benchmarks.md);
#   3. the host / backend / staging / docs suites with the reference device fixture on cuda (these
#      tests read device results back to compare them, so they run without the session audit), and the
#      sync suite with the whole session under the audit in CUDA "error" mode;
#   4. `python -m attnmeta audit` on cuda.
#   5. benchmarks/bench_decode.py: the steady-state decode step (issue #6) on cuda, composable and fused.
# Usage: bash benchmarks/gpu_all.sh [OUTDIR] [PARTS]   (writes logs and bench.json into OUTDIR, default ./out;
#   PARTS is any of "gpu bench suites audit decode", default all; one device call allows 600 s, so a
#   full run is two calls: PARTS="gpu decode bench" then PARTS="suites audit")
set -u -o pipefail
OUT_DIR=${1:-${OUT:-out}}
PARTS=" ${2:-gpu bench suites audit decode} "
want() { [[ "$PARTS" == *" $1 "* ]]; }
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" ATTNMETA_HYPOTHESIS_PROFILE=gpu
PY=${PYTHON:-python3}
status=0
$PY - <<'PYEOF' 2>&1 | tee "$OUT_DIR/env.txt"
import platform, torch, numba, numpy, hypothesis
print("date", __import__("datetime").date.today(), "python", platform.python_version(), "torch", torch.__version__,
      "numba", numba.__version__, "numpy", numpy.__version__, "hypothesis", hypothesis.__version__)
print("device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "NO CUDA")
PYEOF
if want gpu; then
echo "== 1. tests/gpu" | tee "$OUT_DIR/gpu_tests.log"
timeout 120 $PY -m pytest -p attnmeta.testing.pytest_plugin tests/gpu -q -rs -p no:cacheprovider 2>&1 | tee -a "$OUT_DIR/gpu_tests.log" || status=1
fi
if want decode; then
echo "== 5. steady-state decode step" | tee "$OUT_DIR/bench_decode.txt"
timeout 200 $PY benchmarks/bench_decode.py --device cuda 2>&1 | tee -a "$OUT_DIR/bench_decode.txt" || status=1
fi
if want bench; then
echo "== 2. bench" | tee "$OUT_DIR/bench.txt"
timeout 220 $PY -m attnmeta bench --no-progress --reps 100 --json "$OUT_DIR/bench.json" \
  --scenario staging --scenario decode --scenario mixed --scenario spec-decode-k3 --scenario mamba2-prefill \
  --scenario fast-prefill --scenario local-attention 2>&1 | tee -a "$OUT_DIR/bench.txt" || status=1
fi
if want suites; then
echo "== 3a. host derivations vs references on cuda (the device fixture runs cpu and cuda)" | tee "$OUT_DIR/suite_audit.log"
timeout 150 $PY -m pytest tests/host -q -p no:cacheprovider 2>&1 | tail -15 | tee -a "$OUT_DIR/suite_audit.log" || status=1
echo "== 3b. builders, staging, docs vs references on cuda" | tee -a "$OUT_DIR/suite_audit.log"
timeout 150 $PY -m pytest tests/backends tests/staging tests/docs -q -p no:cacheprovider 2>&1 | tail -15 | tee -a "$OUT_DIR/suite_audit.log" || status=1
echo "== 3c. the sync-audit suite on cuda, the whole session under the audit (CUDA error mode)" | tee -a "$OUT_DIR/suite_audit.log"
timeout 60 $PY -m pytest -p attnmeta.testing.pytest_plugin --attnmeta-sync-audit tests/sync -q -p no:cacheprovider 2>&1 | tail -5 | tee -a "$OUT_DIR/suite_audit.log" || status=1
fi
if want audit; then
echo "== 4. audit" | tee "$OUT_DIR/audit.txt"
timeout 40 $PY -m attnmeta audit --device cuda --batches 10 2>&1 | tee -a "$OUT_DIR/audit.txt" || status=1
fi
exit $status
