"""The reference engine on a GPU: every kernel, tokens equal to ``generate``'s in bfloat16 wherever
``generate``'s top-2 logit margin exceeds the tolerance, and the steady-state loop without a sync.

A small Llama (4 layers, 8 query / 2 KV heads of 64) keeps it quick; ``python -m examples.engine
--device cuda`` runs the same checks on the ~1.2B config (benchmarks/gpu_all.sh, part ``engine``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # pragma: no cover - CPU CI
    pytest.skip("needs a CUDA device (run on the GPU machine)", allow_module_level=True)
pytest.importorskip("transformers", reason="the reference engine needs transformers")

from attnmeta.sync import no_device_sync  # noqa: E402
from examples.engine import Engine, EngineConfig, make_kernel  # noqa: E402
from examples.engine.__main__ import run_workload  # noqa: E402
from examples.engine.workload import Reference, make_model, make_requests, tiny_config  # noqa: E402

TOLERANCE = 0.5
"""bfloat16, generate comparison: a token may differ from generate's only where generate's top-2 logits
are this close (this model's bf16 logits differ from its float32 logits by up to ~0.3). The
teacher-forced comparison measures that noise in the run and uses twice it."""

KERNELS = ["torch-paged", "torch-varlen", "flashinfer", "flashinfer+graphs"]


def _have_flashinfer() -> bool:
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module")
def model() -> Any:
    cfg = tiny_config(vocab_size=2048, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=64, initializer_range=0.05)
    return make_model(cfg, "cuda", torch.bfloat16)


@pytest.fixture(scope="module")
def reference() -> Reference:
    return {}


@pytest.mark.parametrize("workload", ["mixed", "cascade"])
@pytest.mark.parametrize("kernel", KERNELS)
def test_engine_tokens_equal_generate(model: Any, reference: Reference, kernel: str, workload: str) -> None:
    if kernel.startswith("flashinfer") and not _have_flashinfer():
        pytest.skip("flashinfer is not importable (bash ../shared/tools/gpu-wheels.sh, then carry .whl)")
    st, cmp, forced = run_workload(model, kernel.removesuffix("+graphs"), workload, cuda_graphs=kernel.endswith("+graphs"),
                           tolerance=TOLERANCE, cache=reference)
    print(f"\n{kernel} {workload}: requests {cmp.requests} tokens {cmp.tokens} mismatches {cmp.mismatches} "
          f"near ties {cmp.near_ties} min margin {cmp.min_margin:.3g} steps {st.steps} graph steps {st.graph_steps} "
          f"cascade steps {st.cascade_steps} preemptions {st.preemptions} | teacher-forced {forced}")
    assert cmp.mismatches == 0, cmp
    assert forced.mismatches == 0 and forced.tokens == cmp.generated, forced
    assert forced.near_ties <= 0.1 * forced.tokens, forced
    assert st.metadata_copies == st.steps
    if kernel.endswith("+graphs") and workload == "mixed":
        assert st.graph_steps > 0
    if workload == "cascade" and kernel in ("torch-paged", "flashinfer"):
        assert st.cascade_steps > 0


@pytest.mark.parametrize("graphs", [False, True])
def test_steady_state_loop_has_no_sync(model: Any, graphs: bool) -> None:
    """After a warm-up (FlashInfer's JIT, graph capture), a whole run under the audit in CUDA error
    mode: nothing reads the device; the loop's only wait is the deliberate one for the previous step's
    sampled tokens (allowed and counted)."""
    if not _have_flashinfer():
        pytest.skip("flashinfer is not importable")
    cfg = EngineConfig(num_blocks=512, max_num_tokens=512, max_num_seqs=32, max_model_len=256,
                       decode_sizes=(8, 16, 32), cuda_graphs=graphs)
    engine = Engine(model, make_kernel("flashinfer", model, torch.device("cuda"), cascade=False), cfg)
    engine.run(make_requests(32, 2048, prompt_len=(20, 40), new_tokens=(20, 30), seed=0))
    with no_device_sync(allow_async_d2h=True):
        st = engine.run(make_requests(32, 2048, prompt_len=(20, 40), new_tokens=(20, 30), seed=1))
    assert st.steps > 20 and (st.graph_steps > 0) == graphs
