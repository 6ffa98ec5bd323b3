"""The reference engine's ``vllm`` metadata mode on a GPU: each step's metadata built by vLLM 0.33.0's own
runner buffers and builders (``examples/engine/vllm_metadata.py``), tokens equal to ``generate``'s (and
teacher-forced) as in the ``attnmeta`` mode, for the Llama (FlashInfer eager and with CUDA graphs, the
torch paged kernel) and the hybrid Bamba (vLLM's Mamba2 builder; its Mamba layers through vLLM's kernels
and through the torch mixer).

Needs vLLM's Python package: ``python tests/kernels/fetch_vllm.py`` on the dev machine, carry ``.vllm``
(and ``.whl``, ``.kernels``); ``benchmarks/gpu_all.sh OUT vllm`` unpacks it and runs this file.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # pragma: no cover - CPU CI
    pytest.skip("needs a CUDA device (run on the GPU machine)", allow_module_level=True)
pytest.importorskip("transformers", reason="the reference engine needs transformers")

from examples.engine.vllm_metadata import INSTALL  # noqa: E402

pytest.importorskip("vllm.v1.attention.backends.utils", reason=INSTALL)

from attnmeta.sync import record_device_syncs  # noqa: E402
from examples.engine import Engine, EngineConfig, make_kernel  # noqa: E402
from examples.engine.__main__ import WORKLOADS, run_workload  # noqa: E402
from examples.engine.workload import Reference, make_requests  # noqa: E402

TOLERANCE = 0.5
"""As tests/gpu/test_engine_cuda.py: bfloat16 against ``generate``."""


def _have_flashinfer() -> bool:
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return False
    return True


def _have_vllm_flashinfer() -> None:
    """Skip unless vLLM's FlashInfer backend imports: vLLM 0.33.0's needs the FlashInfer it pins,
    flashinfer-python 0.7.2.post1 (``python tests/kernels/fetch_vllm.py --flashinfer`` packs it into ``.vllm``
    for the GPU machine; ``.whl``'s 0.5.3 lacks names it imports)."""
    if not _have_flashinfer():
        pytest.skip("flashinfer is not importable (bash ../shared/tools/gpu-wheels.sh, then carry .whl)")
    try:
        import vllm.v1.attention.backends.flashinfer  # noqa: F401
    except ImportError as e:
        import flashinfer

        pytest.skip(f"vLLM 0.33.0's FlashInfer backend does not import with flashinfer {flashinfer.__version__} "
                    f"(it needs 0.7.2.post1: python tests/kernels/fetch_vllm.py --flashinfer): {e}")


@pytest.mark.parametrize("workload", ["mixed", "cascade"])
@pytest.mark.parametrize("kernel", ["torch-paged", "torch-varlen", "flashinfer", "flashinfer+graphs"])
def test_vllm_mode_tokens_equal_generate(model: Any, reference: Reference, kernel: str, workload: str) -> None:
    if kernel.startswith("flashinfer"):
        _have_vllm_flashinfer()
    st, cmp, forced = run_workload(model, kernel.removesuffix("+graphs"), workload, cuda_graphs=kernel.endswith("+graphs"),
                                   tolerance=TOLERANCE, cache=reference, metadata="vllm")
    print(f"\nVLLM-MODE {kernel} {workload}: requests {cmp.requests} tokens {cmp.tokens} mismatches {cmp.mismatches} "
          f"near ties {cmp.near_ties} steps {st.steps} graph steps {st.graph_steps} padded {st.padded_steps} "
          f"copies/step {st.metadata_copies / st.steps:.1f} | teacher-forced {forced}")
    assert cmp.mismatches == 0, cmp
    assert forced.mismatches == 0 and forced.tokens == cmp.generated, forced
    assert forced.near_ties <= 0.1 * forced.tokens, forced
    assert st.cascade_steps == 0
    if kernel.endswith("+graphs") and workload == "mixed":
        assert st.graph_steps > 0


@pytest.mark.parametrize("kernel", ["torch-varlen", "flashinfer+graphs"])
def test_vllm_mode_sync_count(model: Any, kernel: str) -> None:
    """The steady-state loop of the vllm mode under the audit in count mode: the count is reported (vLLM's
    code may sync; benchmarks/bench_engine.py reports it per step beside attnmeta's 0)."""
    if kernel.startswith("flashinfer"):
        _have_vllm_flashinfer()
    graphs = kernel.endswith("+graphs")
    cfg = EngineConfig(num_blocks=512, max_num_tokens=512, max_num_seqs=32, max_model_len=256,
                       decode_sizes=(8, 16, 32), cuda_graphs=graphs, metadata="vllm")
    engine = Engine(model, make_kernel(kernel.removesuffix("+graphs"), model, torch.device("cuda"), cascade=False), cfg)
    engine.run(make_requests(32, 2048, prompt_len=(20, 40), new_tokens=(20, 30), seed=0))
    steps = engine.stats.steps
    with record_device_syncs(allow_async_d2h=True) as found:
        st = engine.run(make_requests(32, 2048, prompt_len=(20, 40), new_tokens=(20, 30), seed=1))
    syncs = [e for e in found if e.kind == "sync"]
    print(f"\nVLLM-MODE SYNCS {kernel}: {len(syncs)} in {st.steps - steps} steps: "
          f"{sorted({str(e)[:120] for e in syncs})[:4]}")
    assert st.steps - steps > 20 and (st.graph_steps > 0) == graphs


@pytest.mark.parametrize("kernel", ["torch-paged", "torch-varlen", "flashinfer"])
@pytest.mark.parametrize("mamba", ["vllm", "torch"])
def test_vllm_mode_hybrid_tokens(hybrid_model: Any, kernel: str, mamba: str) -> None:
    """The hybrid workload with vLLM's Mamba2 builder feeding the Mamba layers."""
    if mamba == "vllm":
        from examples.engine.vllm_mamba import FETCH, KERNELS, OPS

        if not (KERNELS / "vllm" / OPS.replace(".", "/") / "ssd_combined.py").is_file():
            pytest.skip(f"vLLM's Mamba kernel files are not in .kernels/vllm: run {FETCH} and carry .kernels")
    if kernel == "flashinfer":
        _have_vllm_flashinfer()
    st, cmp, forced = run_workload(hybrid_model, kernel, "hybrid", tolerance=TOLERANCE, mamba_kernels=mamba,
                                   metadata="vllm")
    print(f"\nVLLM-MODE hybrid {kernel} mamba={mamba}: requests {cmp.requests} tokens {cmp.tokens} mismatches "
          f"{cmp.mismatches} near ties {cmp.near_ties} steps {st.steps} partial prefills {st.partial_prefills} "
          f"preemptions {st.preemptions} | teacher-forced {forced}")
    assert cmp.mismatches == 0, cmp
    assert forced.mismatches == 0 and forced.tokens == cmp.generated == st.sampled, forced
    assert st.partial_prefills > 0 and st.preemptions > 0 and st.padded_steps > 0


@pytest.mark.parametrize("case", ["flashinfer", "flashinfer+graphs", "hybrid"])
def test_attnmeta_and_vllm_modes_same_tokens(model: Any, hybrid_model: Any, case: str) -> None:
    """The same kernels fed by either side's metadata give the same tokens, bit for bit: with vLLM's
    FlashInfer (0.7.2.post1) the FlashInfer kernel plans as vLLM's builder does (``plans`` ``auto``
    resolves to ``vllm``: the decode wrapper with tensor cores for the decode rows, the ``auto`` prefill
    wrapper for the others, the model's scale), so the ``attnmeta`` and ``vllm`` metadata modes run the
    same wrappers over the same model, and every request's greedy tokens must be equal, request by
    request, over mixed steps (prefills beside decodes, a shared prefix found in the prefix cache),
    CUDA-graph decode steps, and the hybrid's Mamba2 layers through vLLM's kernels fed by each side's
    Mamba2 metadata. No cascade: the vllm mode has none."""
    _have_vllm_flashinfer()
    hybrid = case == "hybrid"
    if hybrid:
        from examples.engine.vllm_mamba import FETCH, KERNELS, OPS

        if not (KERNELS / "vllm" / OPS.replace(".", "/") / "ssd_combined.py").is_file():
            pytest.skip(f"vLLM's Mamba kernel files are not in .kernels/vllm: run {FETCH} and carry .kernels")
    m = hybrid_model if hybrid else model
    req_kw, cfg_kw = WORKLOADS["hybrid" if hybrid else "mixed"]
    tokens: dict[str, list[list[int]]] = {}
    for metadata in ("attnmeta", "vllm"):
        cfg = EngineConfig(cuda_graphs=case.endswith("+graphs"), metadata=metadata,  # type: ignore[arg-type]
                           mamba_kernels="vllm", **cfg_kw)  # type: ignore[arg-type]
        engine = Engine(m, make_kernel("flashinfer", m, torch.device("cuda"), cascade=False), cfg)
        if metadata == "attnmeta":
            assert engine.kernel.plans == "vllm"  # type: ignore[attr-defined]
        reqs = make_requests(vocab=m.config.vocab_size, **req_kw)
        st = engine.run(reqs)
        tokens[metadata] = [r.tokens for r in sorted(reqs, key=lambda r: r.rid)]
        print(f"\nSAME-TOKENS {case} {metadata}: steps {st.steps} graph steps {st.graph_steps} "
              f"partial prefills {st.partial_prefills} tokens {sum(len(t) for t in tokens[metadata])}")
        if case.endswith("+graphs"):
            assert st.graph_steps > 0
    differ = [i for i, (a, b) in enumerate(zip(tokens["attnmeta"], tokens["vllm"], strict=True)) if a != b]
    assert not differ, f"requests whose tokens differ between the two metadata modes: {differ}"
