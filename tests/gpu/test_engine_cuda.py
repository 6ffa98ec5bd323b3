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
from examples.engine.workload import Reference, make_requests  # noqa: E402

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


# ---------------------------------------------------------------------------------------------------
# the hybrid model (Bamba: Mamba2 and attention layers), its Mamba2 layers through vLLM's kernels
# ---------------------------------------------------------------------------------------------------


def _vllm_mamba_kernels() -> None:
    from examples.engine.vllm_mamba import FETCH, KERNELS, OPS

    if not (KERNELS / "vllm" / OPS.replace(".", "/") / "ssd_combined.py").is_file():
        pytest.skip(f"vLLM's Mamba kernel files are not in .kernels/vllm: run {FETCH} on the dev machine and carry "
                    ".kernels (benchmarks/gpu_all.sh, part hybrid)")
    pytest.importorskip("triton", reason="vLLM's Mamba kernels are Triton kernels")


@pytest.mark.parametrize("cascade", [True, False], ids=["cascade", "fixed-mixed"])
@pytest.mark.parametrize("kernel", ["torch-paged", "flashinfer"])
@pytest.mark.parametrize(("workload", "mamba"), [("hybrid", "vllm"), ("hybrid", "torch"), ("hybrid-align", "vllm")])
def test_hybrid_engine_tokens(hybrid_model: Any, hybrid_reference: Reference, kernel: str, workload: str,
                              mamba: str, cascade: bool) -> None:
    """The hybrid workloads in bfloat16: tokens against ``generate`` and teacher-forced, as for the Llama
    engine; the Mamba2 layers through vLLM 0.33.0's Triton kernels, or the torch reference mixer on the
    GPU. ``hybrid``: chunked prefills that continue their Mamba states, preemption, padded decode steps;
    ``hybrid-align``: vLLM's "align" cache mode, with prefix-cache hits on Mamba states, state moves
    between blocks and prefill checkpoints (``store_prefill_checkpoint``). ``fixed-mixed``: the kernel
    without its cascade builder, so the engine's mixed steps replay one graph-mode layout of any counts
    (``EngineConfig.fixed_mixed_layout``; the Mamba2 metadata of a fixed layout feeding the kernels)."""
    if mamba == "vllm":
        _vllm_mamba_kernels()
    if kernel == "flashinfer" and not _have_flashinfer():
        pytest.skip("flashinfer is not importable (bash ../shared/tools/gpu-wheels.sh, then carry .whl)")
    st, cmp, forced = run_workload(hybrid_model, kernel, workload, tolerance=TOLERANCE, mamba_kernels=mamba,
                                   cache=hybrid_reference, cascade=cascade)
    mixed = [r for k, r in zip(st.step_kinds, st.step_replayed, strict=True) if k == "mixed"]
    if not cascade:  # (one fixed layout of any counts per ring slot: the first use of each composes)
        assert sum(mixed) >= len(mixed) - 2 * 3, (sum(mixed), len(mixed))
    print(f"\n{workload} {kernel} mamba={mamba} cascade={cascade}: mixed steps replayed {sum(mixed)} of {len(mixed)}, Mamba cache hits {st.mamba_cache_hits} checkpoints "
          f"{st.mamba_checkpoints} state moves {st.mamba_state_copies} | requests {cmp.requests} tokens {cmp.tokens} mismatches {cmp.mismatches} "
          f"near ties {cmp.near_ties} min margin {cmp.min_margin:.3g} steps {st.steps} partial prefills "
          f"{st.partial_prefills} preemptions {st.preemptions} padded {st.padded_steps} | teacher-forced {forced}")
    assert cmp.mismatches == 0, cmp
    assert forced.mismatches == 0 and forced.tokens == cmp.generated == st.sampled, forced
    assert forced.near_ties <= 0.1 * forced.tokens, forced
    assert st.partial_prefills > 0 and st.preemptions > 0 and st.padded_steps > 0
    assert st.metadata_copies == st.steps
    if workload == "hybrid-align":
        assert st.mamba_cache_hits > 0 and st.mamba_checkpoints > 0 and st.mamba_state_copies > 0


def test_hybrid_check_catches_a_lost_initial_state_on_the_gpu(hybrid_model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU check can fail: vLLM's kernels told that no prefill row continues its state (every chunk
    of a chunked prefill from zeros) change the tokens beyond the bfloat16 tolerance."""
    import dataclasses

    import numpy as np

    from examples.engine import hybrid
    from examples.engine.vllm_mamba import vllm_mamba2_mixer as real

    _vllm_mamba_kernels()

    def forgetful(ops: Any, mixer: Any, x: torch.Tensor, meta: Any, state: Any) -> torch.Tensor:
        if meta.has_initial_states_p is not None:
            meta = dataclasses.replace(meta, has_initial_states_p=torch.zeros_like(meta.has_initial_states_p),
                                       has_initial_states_p_cpu=np.zeros_like(meta.has_initial_states_p_cpu),
                                       prep_initial_states=False)
        return real(ops, mixer, x, meta, state)

    monkeypatch.setattr(hybrid, "vllm_mamba2_mixer", forgetful)
    _, _, forced = run_workload(hybrid_model, "torch-paged", "hybrid", mamba_kernels="vllm")
    assert forced.mismatches > 0, forced


def test_hybrid_steady_state_loop_has_no_sync(hybrid_model: Any) -> None:
    """After a warm-up (Triton's compiles and autotuning), a whole hybrid run with vLLM's Mamba kernels
    under the audit in CUDA error mode: neither attnmeta nor the kernels read the device."""
    _vllm_mamba_kernels()
    kernel = "flashinfer" if _have_flashinfer() else "torch-paged"
    cfg = EngineConfig(num_blocks=256, max_num_tokens=256, max_num_seqs=16, max_model_len=256,
                       decode_sizes=(8, 16), mamba_kernels="vllm")
    engine = Engine(hybrid_model, make_kernel(kernel, hybrid_model, torch.device("cuda"), cascade=False), cfg)
    engine.run(make_requests(16, 2048, prompt_len=(20, 90), new_tokens=(10, 20), seed=0))
    with no_device_sync(allow_async_d2h=True):
        st = engine.run(make_requests(16, 2048, prompt_len=(20, 90), new_tokens=(10, 20), arrive_over=4, seed=1))
    assert st.steps > 10 and len(st.step_replayed) == st.steps
