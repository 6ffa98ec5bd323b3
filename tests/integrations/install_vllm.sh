#!/usr/bin/env bash
# A virtual environment of its own where vLLM 0.33.0's Python package imports on a machine without a GPU,
# for the vLLM adapter's real-class tests (pytest -m vllm; docs/vllm.md, "Testing against vLLM").
#
#   bash tests/integrations/install_vllm.sh [ENV_DIR]     # default: ../vllm-env beside the checkout
#   cd CHECKOUT && ENV_DIR/bin/python -m pytest -m vllm tests/integrations -ra
#
# torch comes from PyTorch's CPU wheel index (PyPI's default torch wheel for Linux is the CUDA build).
# vLLM goes in with --no-deps: its own pins (torch==2.14.0 and CUDA wheels) would replace the CPU torch,
# and tests/integrations/requirements-vllm.txt brings what importing its Python code needs instead.
# pip checks no pins with --no-deps, so it prints nothing about them; the versions it leaves differ
# from vLLM's (torch, numba, transformers, xgrammar, llguidance), and the import works all the same.
# Never install vLLM into the project's own .venv: the library does not depend on it.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
ENV_DIR="${1:-$ROOT/../vllm-env}"
python3 -m venv "$ENV_DIR"
"$ENV_DIR/bin/pip" install -q torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
"$ENV_DIR/bin/pip" install -q -e "$ROOT[test,dev]" -r "$ROOT/tests/integrations/requirements-vllm.txt"
"$ENV_DIR/bin/pip" install -q --no-deps vllm==0.33.0
"$ENV_DIR/bin/python" -c "
import vllm
from vllm.v1.attention.backends.utils import CommonAttentionMetadata
print('vLLM', vllm.__version__, 'importable in $ENV_DIR')"
echo "run (from the checkout, whose pyproject.toml registers the marker): cd $ROOT && $ENV_DIR/bin/python -m pytest -m vllm tests/integrations -ra"
