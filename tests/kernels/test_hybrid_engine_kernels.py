"""The reference engine's hybrid model (``transformers``' Bamba: Mamba2 and attention layers) with its
Mamba2 layers through vLLM 0.33.0's own Triton kernels, on the CPU under Triton's interpreter, in
float32: every request's greedy tokens equal ``generate``'s, exactly.

The kernels are the same as on the GPU (:mod:`examples.engine.vllm_mamba`); the interpreter runs their
Triton code with numpy, program by program, so the run is exact in float32 (no TF32 ``tl.dot``) and
slow (about a minute per workload on two cores), and CI skips it. On CUDA, the bfloat16 check of the
same engine is ``tests/gpu/test_engine_cuda.py -k hybrid`` (``bash benchmarks/gpu_all.sh OUT hybrid``).

Run: ``python tests/kernels/fetch_kernels.py``, then ``TRITON_INTERPRET=1 python -m pytest
tests/kernels/test_hybrid_engine_kernels.py -s``.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from triton_interpreter import INTERPRET, conv1d_metadata, first_config_only, int1_comparisons

RUN = "TRITON_INTERPRET=1 python -m pytest tests/kernels/test_hybrid_engine_kernels.py -s"
if not INTERPRET:  # pragma: no cover - CI and the GPU machine
    pytest.skip(f"runs under Triton's interpreter on the CPU: {RUN} (on CUDA: tests/gpu/test_engine_cuda.py "
                "-k hybrid)", allow_module_level=True)
pytest.importorskip("triton", reason=f"needs triton (pip install triton), then {RUN}")
pytest.importorskip("transformers", reason="the reference engine needs transformers")

from examples.engine import vllm_mamba  # noqa: E402
from examples.engine.__main__ import run_workload  # noqa: E402
from examples.engine.workload import make_model, tiny_hybrid_config  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _interpreter_ops() -> Iterator[None]:
    """vLLM's kernels as the interpreter takes them: int1 comparisons, each autotuned kernel's first
    config, and ``causal_conv1d_fn``'s program arrays as the interpreter's pointers; skips where the
    kernel files are absent."""
    try:
        ops = vllm_mamba.load_ops()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    first_config_only(list(ops.modules.values()))
    conv1d_fn = ops.conv1d_fn

    def conv1d_fn_interpreted(*args: Any, metadata: Any, **kwargs: Any) -> torch.Tensor:
        md = conv1d_metadata(metadata.nums_dict, metadata.batch_ptr, metadata.token_chunk_offset_ptr)
        return conv1d_fn(*args, metadata=md, **kwargs)  # type: ignore[no-any-return]

    ops.conv1d_fn = conv1d_fn_interpreted
    with int1_comparisons(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(vllm_mamba, "load_ops", lambda root=None: types.SimpleNamespace(**vars(ops)))
        yield


@pytest.fixture(scope="module")
def model() -> Any:
    return make_model(tiny_hybrid_config())


@pytest.mark.parametrize("workload", ["hybrid", "hybrid-align"])
def test_hybrid_engine_with_vllm_kernels_equals_generate(model: Any, workload: str) -> None:
    """Both Mamba cache modes; "align" adds prefix-cache hits on Mamba states, the state moves between
    blocks and the prefill checkpoints (``store_prefill_checkpoint``)."""
    st, cmp, forced = run_workload(model, "torch-paged", workload, mamba_kernels="vllm")
    print(f"\nHYBRID {workload}, vLLM kernels, interpreter, float32: requests {cmp.requests} tokens {cmp.tokens} "
          f"mismatches {cmp.mismatches} | teacher-forced {forced.tokens} tokens, {forced.mismatches} mismatches | "
          f"steps {st.steps}, partial prefills {st.partial_prefills}, preemptions {st.preemptions}, padded "
          f"{st.padded_steps}, Mamba cache hits {st.mamba_cache_hits}, checkpoints {st.mamba_checkpoints}, "
          f"state moves {st.mamba_state_copies}")
    assert cmp.mismatches == cmp.near_ties == 0 and cmp.tokens == cmp.generated == st.sampled > 150, cmp
    assert forced.mismatches == forced.near_ties == 0, forced
    assert st.partial_prefills > 0 and st.preemptions > 0 and st.padded_steps > 0
    assert st.metadata_copies == st.steps
    if workload == "hybrid-align":
        assert st.mamba_cache_hits > 0 and st.mamba_checkpoints > 0 and st.mamba_state_copies > 0


@pytest.mark.parametrize(("workload", "broken"), [("hybrid", "lost initial states"),
                                                  ("hybrid-align", "no checkpoints")])
def test_vllm_kernels_with_broken_metadata_fail(model: Any, monkeypatch: pytest.MonkeyPatch, workload: str,
                                                broken: str) -> None:
    """The check can fail: vLLM's kernels told that no prefill row continues its state, or given no
    prefill checkpoints (a later hit resumes from a block that holds no state), change the tokens."""
    from examples.engine import hybrid

    real = vllm_mamba.vllm_mamba2_mixer

    def damaged(ops: Any, mixer: Any, x: torch.Tensor, meta: Any, state: Any) -> torch.Tensor:
        if broken == "no checkpoints":
            meta = dataclasses.replace(meta, checkpoint_meta=None, checkpoint_chunk_idx=None)
        elif meta.has_initial_states_p is not None:
            meta = dataclasses.replace(meta, has_initial_states_p=torch.zeros_like(meta.has_initial_states_p),
                                       has_initial_states_p_cpu=np.zeros_like(meta.has_initial_states_p_cpu),
                                       prep_initial_states=False)
        return real(ops, mixer, x, meta, state)

    monkeypatch.setattr(hybrid, "vllm_mamba2_mixer", damaged)
    _, _, forced = run_workload(model, "torch-paged", workload, mamba_kernels="vllm")
    assert forced.mismatches > 0, forced

