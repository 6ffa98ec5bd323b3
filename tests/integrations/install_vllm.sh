#!/usr/bin/env bash
# A virtual environment of its own where vLLM 0.33.0's CommonAttentionMetadata imports on a machine
# without a GPU, for the vLLM adapter's real-class tests (pytest -m vllm; docs/vllm.md).
#
#   bash tests/integrations/install_vllm.sh [ENV_DIR]     # default: ../vllm-env beside the checkout
#   ENV_DIR/bin/python -m pytest -m vllm tests/integrations -ra
#
# vLLM goes in with --no-deps: its own pins (torch==2.14.0 and CUDA wheels) would replace the CPU
# torch. The `vllm-test` extra brings what importing the class needs; pip then warns that vLLM's pins
# are not met (torch, numba, transformers, xgrammar, llguidance versions): expected, the import works.
# Never install vLLM into the project's own .venv: the library does not depend on it.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
ENV_DIR="${1:-$ROOT/../vllm-env}"
python3 -m venv "$ENV_DIR"
"$ENV_DIR/bin/pip" install -q torch==2.13.0
"$ENV_DIR/bin/pip" install -q -e "$ROOT[test,dev,vllm-test]"
"$ENV_DIR/bin/pip" install -q --no-deps vllm==0.33.0
"$ENV_DIR/bin/python" -c "
import vllm
from vllm.v1.attention.backends.utils import CommonAttentionMetadata
print('vLLM', vllm.__version__, 'importable in $ENV_DIR')"
echo "run: $ENV_DIR/bin/python -m pytest -m vllm $ROOT/tests/integrations -ra"
