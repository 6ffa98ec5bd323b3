"""The reference engine's ``vllm`` metadata mode on the CPU (marker ``vllm``): each step's metadata built by
vLLM 0.33.0's own runner buffers (``CpuGpuBuffer``, ``BlockTable``) and builders (FlashAttention's, and
Mamba2's for the hybrid model), the torch kernels reading it; tokens equal to ``generate``'s and
teacher-forced, as in the ``attnmeta`` mode. On a machine without vLLM the module skips with the
command that installs it; tests/gpu/test_engine_vllm_cuda.py runs FlashInfer's builder on the GPU."""

from __future__ import annotations

from typing import Any

import pytest

from examples.engine.vllm_metadata import INSTALL

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm.v1.attention.backends.flash_attn", reason=INSTALL)
pytest.importorskip("transformers", reason="the reference engine needs transformers")

from examples.engine.__main__ import run_workload  # noqa: E402
from examples.engine.workload import make_model, tiny_config, tiny_hybrid_config  # noqa: E402


@pytest.mark.parametrize("workload", ["mixed", "cascade"])
def test_vllm_mode_llama_tokens_equal_generate(workload: str) -> None:
    st, cmp, forced = run_workload(make_model(tiny_config()), "torch-paged", workload, metadata="vllm")
    assert cmp.mismatches == 0 and forced.mismatches == 0, (cmp, forced)
    assert forced.tokens == cmp.generated == st.sampled > 0
    assert st.metadata_copies == 8 * st.steps  # the runner's copies: block table, 5 inputs, 2 engine arrays
    assert st.cascade_steps == 0  # vLLM's common prefix length is 0 in this mode


def test_vllm_mode_hybrid_tokens_equal_generate() -> None:
    st, cmp, forced = run_workload(make_model(tiny_hybrid_config()), "torch-paged", "hybrid", metadata="vllm")
    assert cmp.mismatches == 0 and forced.mismatches == 0, (cmp, forced)
    assert st.partial_prefills > 0 and st.preemptions > 0 and st.padded_steps > 0
    assert st.metadata_copies == 9 * st.steps  # and the Mamba group's block table


def test_vllm_mode_builds_each_step_inside_inference_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's runner prepares its inputs and runs its builders inside ``torch.inference_mode()``
    (``GPUModelRunner.execute_model``): so does the engine's vllm mode, or its torch work would pay
    autograd's bookkeeping that vLLM's does not."""
    import torch

    from examples.engine.vllm_metadata import VllmMetadata

    build, modes = VllmMetadata.build, []

    def recording(self: Any, *a: Any, **kw: Any) -> Any:
        modes.append(torch.is_inference_mode_enabled())
        return build(self, *a, **kw)

    monkeypatch.setattr(VllmMetadata, "build", recording)
    st, cmp, _forced = run_workload(make_model(tiny_config()), "torch-paged", "mixed", metadata="vllm")
    assert cmp.mismatches == 0 and st.steps > 5 and modes == [True] * st.steps


def test_vllm_mode_sizes_vllms_builders_to_the_engine() -> None:
    """vLLM's builders size their persistent buffers from the scheduler config (FlashInfer's page-table
    arrays failed at 256 requests against vLLM's default of 128 rows): the mode's config carries the
    engine's batch sizes."""
    import torch

    from examples.engine.vllm_metadata import VllmMetadata

    meta = VllmMetadata(tiny_config(), "torch-paged", torch.device("cpu"), torch.float32, block_size=16,
                        max_num_seqs=300, max_num_tokens=4096, max_model_len=512, decode_sizes=(1, 300),
                        graphs=False, hybrid=False)
    sched = meta.config.scheduler_config
    assert (sched.max_num_seqs, sched.max_num_batched_tokens) == (300, 4096)
    assert meta.query_start_loc.cpu.shape == (301,)
    assert meta.config.cache_config.kv_cache_layout == "LBNHC"  # resolved as vLLM's engine core does


def test_vllm_mode_without_capture_sizes_runs_no_graphs() -> None:
    """A graph-mode engine with no decode sizes captures no graphs (the cascade workload's steps stay
    unpadded): vLLM's config then has no CUDA-graph mode, rather than a failing ``max()`` of no sizes
    (found on the H200 by test_engine_vllm_cuda.py's ``flashinfer+graphs-cascade``)."""
    import torch

    from examples.engine.vllm_metadata import VllmMetadata

    meta = VllmMetadata(tiny_config(), "torch-paged", torch.device("cpu"), torch.float32, block_size=16,
                        max_num_seqs=16, max_num_tokens=512, max_model_len=512, decode_sizes=(), graphs=True,
                        hybrid=False)
    assert meta.config.compilation_config.cudagraph_mode.name == "NONE"


def test_bench_engine_compares_the_pair_on_the_cpu(capsys: pytest.CaptureFixture[str], tmp_path: Any) -> None:
    """benchmarks/bench_engine.py's headline comparison end to end on the CPU (torch's paged kernel): both
    modes serve the same workload, the pair's line reports the ratios, the same greedy tokens, no syncs."""
    import json
    import statistics
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root / "benchmarks"))
    try:
        import bench_engine
    finally:
        sys.path.remove(str(root / "benchmarks"))
    out = tmp_path / "bench.json"
    assert bench_engine.main(["--device", "cpu", "--model", "tiny", "--modes", "paged,vllm-paged", "--concurrency",
                              "1,3", "--prompt", "8", "--new", "8", "--rounds", "2", "--no-cold",
                              "--json", str(out)]) == 0
    lines = [line.split() for line in capsys.readouterr().out.splitlines() if line.lstrip().startswith("paged / ")]
    assert [int(f[3]) for f in lines] == [1, 3]
    assert all(f[-4:-2] == ["0", "of"] for f in lines), lines  # tokens differ: 0 of n (then launch x)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["mode"], r["concurrency"], r["rounds"]) for r in rows] == [
        ("paged", 1, 2), ("vllm-paged", 1, 2), ("paged", 3, 2), ("vllm-paged", 3, 2)]
    assert all(r["syncs_per_step"] == 0 for r in rows)
    assert [r["copies_per_step"] for r in rows] == [1.0, 8.0, 1.0, 8.0]
    for r, v in zip(rows[::2], rows[1::2], strict=True):  # the paired ratios: medians of the rounds' ratios
        got = r["paired_against"]["vllm-paged"]
        want = [statistics.median(b / a for a, b in zip(r[k], v[k], strict=True))
                for k in ("step_ms_rounds", "metadata_ms_rounds")]
        assert [got["tokens_per_s_x"], got["metadata_faster_x"]] == pytest.approx(want)
        assert got["launch_x"] == pytest.approx(r["launch_ms"] / v["launch_ms"])
        assert r["wait_ms"] == v["wait_ms"] == 0 == r["gpu_behind"] == v["gpu_behind"]  # (the CPU: no events)
