"""attnmeta's property-test harness run on code nobody here wrote: vLLM 0.33.0's own metadata builders
(marker ``vllm``; docs/testing.md, "Test your own builder").

Driven as a framework author drives their own builder: batches from :mod:`attnmeta.testing.strategies`,
vLLM's ``CommonAttentionMetadata`` built the way its runner builds it (:mod:`vllm_runner`, torch only),
the builder's ``build()`` on it, and every field compared with attnmeta's lab reference
(:func:`attnmeta.testing.harness.compare_with_reference`). The builders get the smallest real
``VllmConfig`` of a tiny model written to a temporary folder (a Llama, a Bamba, a Qwen3-Next), not a
mock. On a machine without vLLM the module skips with the command that installs it.

What the harness found is in :data:`KNOWN`: each disagreement, with who is right and why. A
disagreement not listed there fails the test.

Every build runs under attnmeta's sync audit in count mode (:func:`attnmeta.sync.record_device_syncs`: it
records, it does not raise); at the end of the module one ``HARNESS`` line per builder gives the cases run,
the disagreements (each a listed one) and the syncs per build. On the GPU machine
(``benchmarks/gpu_all.sh OUT vllm``) the builders run on CUDA, where a sync is a real one, and vLLM's
FlashInfer builder runs too (it needs the flashinfer package, and vLLM's ``Attention`` layers in the
forward context: the test makes them). vLLM's Triton-MLA builder runs with a real ``MLAAttention`` layer
of a tiny DeepSeek-V2 in the forward context (a one-process distributed group, as vLLM's worker has);
vLLM's other MLA builders (FlashMLA, FlashAttention-MLA, FlashInfer-MLA) plan with compiled kernels'
schedulers on the GPU and are not driven here.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from attnmeta import BatchSpec
from attnmeta.backends.flash_attn import FlashAttentionOptions
from attnmeta.backends.flashinfer import FlashInferOptions
from attnmeta.backends.mamba import GDNOptions, Mamba2Options
from attnmeta.sync import record_device_syncs
from attnmeta.testing.harness import compare_with_reference
from attnmeta.testing.lab import lab
from attnmeta.testing.strategies import batch_specs

pytestmark = pytest.mark.vllm

INSTALL = ("vLLM 0.33.0 is not importable here: bash tests/integrations/install_vllm.sh ENV, then "
           "ENV/bin/python -m pytest -m vllm tests/integrations (docs/testing.md, 'Test your own builder')")
pytest.importorskip("vllm.v1.attention.backends.flash_attn", reason=INSTALL)

from profile_helpers import scaled_examples  # noqa: E402
from vllm.config import CacheConfig, DeviceConfig, ModelConfig, VllmConfig  # noqa: E402
from vllm_runner import vllm_runner_common  # noqa: E402

from examples.engine.vllm_metadata import no_pinning, set_kv_cache_layout  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SPEC_TOKENS = 2  # the spec-decode runs: k draft tokens
MAMBA_BLOCK = 4096  # the Mamba group's "block": one state slot a request ("none" cache mode)

Deviation = tuple[str, Callable[[Any, dict[str, Any]], bool]]
KNOWN: dict[str, dict[str, Deviation]] = {
    "mamba2": {
        "num_accepted_tokens": (
            "spec decode with no decode row: vLLM hands on the runner's whole tensor (it trims it to the decode "
            "rows only when there are some); attnmeta gives None, which no kernel reads on the prefill path "
            "(docs/semantics-mamba.md, deviations: attnmeta's is kept)",
            lambda got, want: want["num_decodes"] == 0),
    },
}
"""Per builder, the fields on which vLLM's builder and attnmeta's reference disagree on purpose: why,
and when (a test of vLLM's metadata and the reference). Everything else must agree. What the harness
found and changed in attnmeta instead: FlashAttention's decode/prefill counts (vLLM sets them only under
DCP), and the draft counts of a spec-decode step without drafts (vLLM's runner fills them every step
of spec decode: a one-token row past its prompt is a spec row with zero drafts)."""


TALLY: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0])
"""Per builder (its test's name): cases run, disagreements (all of them listed in KNOWN), syncs, and the
most fields one case compared (those of the reference's that vLLM's metadata has)."""


@pytest.fixture(scope="module", autouse=True)
def _report() -> Iterator[None]:
    """One ``HARNESS`` line per builder at the end of the module (gpu_all.sh collects them)."""
    yield
    for name, (cases, known, syncs, fields) in sorted(TALLY.items()):
        print(f"\nHARNESS {name} device {DEVICE.type}: cases {cases}, disagreements {known} (each a listed deviation), "
              f"syncs/build {syncs / max(cases, 1):.2f}, fields compared up to {fields}")


# ---------------------------------------------------------------------------------------- configs
def _vllm_config(folder: Path, hf_config: Any, speculative: int = 0) -> VllmConfig:
    """A real ``VllmConfig`` of ``hf_config`` (saved to ``folder``, read back by vLLM's ModelConfig); with
    ``speculative`` draft tokens an n-gram speculative config (it needs no draft model)."""
    from vllm.config import SpeculativeConfig

    hf_config.save_pretrained(folder)
    model = ModelConfig(model=str(folder), skip_tokenizer_init=True, dtype="float16", max_model_len=MAMBA_BLOCK)
    spec = (SpeculativeConfig(method="ngram", num_speculative_tokens=speculative, prompt_lookup_max=3,
                              prompt_lookup_min=1) if speculative else None)
    return VllmConfig(model_config=model, cache_config=CacheConfig(block_size=16),
                      device_config=DeviceConfig(device=DEVICE.type), speculative_config=spec)


@pytest.fixture(scope="module")
def builders(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Callable[[], Any]]]:
    """vLLM's builders by attnmeta builder name, each made by a function (fresh state per example)."""
    from transformers import LlamaConfig, Qwen3NextConfig
    from vllm.v1.attention.backends.flash_attn import FlashAttentionMetadataBuilder
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder
    from vllm.v1.attention.backends.mamba2_attn import Mamba2AttentionMetadataBuilder
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    from examples.engine.workload import tiny_hybrid_config

    root = tmp_path_factory.mktemp("vllm-configs")
    llama = _vllm_config(root / "llama", LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=MAMBA_BLOCK))
    bamba = _vllm_config(root / "bamba", tiny_hybrid_config(max_position_embeddings=MAMBA_BLOCK))
    bamba_spec = _vllm_config(root / "bamba-spec", tiny_hybrid_config(max_position_embeddings=MAMBA_BLOCK),
                              speculative=SPEC_TOKENS)
    qwen_hf = Qwen3NextConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=MAMBA_BLOCK)
    qwen = _vllm_config(root / "qwen3next", qwen_hf)
    qwen_spec = _vllm_config(root / "qwen3next-spec", qwen_hf, speculative=SPEC_TOKENS)
    if not torch.cuda.is_available():
        no_pinning()
    attention = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=16, dtype=torch.float16)
    mamba = MambaSpec(block_size=MAMBA_BLOCK, shapes=((3, 256), (4, 32, 16)), dtypes=(torch.float16, torch.float16))
    mamba_spec = MambaSpec(block_size=MAMBA_BLOCK, shapes=((3, 256), (4, 32, 16)), dtypes=(torch.float16, torch.float16),
                           num_speculative_blocks=SPEC_TOKENS)
    gdn = MambaSpec(block_size=MAMBA_BLOCK, shapes=((3, 96), (4, 16, 16)), dtypes=(torch.float16, torch.float16),
                    mamba_type=MambaAttentionBackendEnum.GDN_ATTN)
    gdn_spec = MambaSpec(block_size=MAMBA_BLOCK, shapes=((3, 96), (4, 16, 16)), dtypes=(torch.float16, torch.float16),
                         mamba_type=MambaAttentionBackendEnum.GDN_ATTN, num_speculative_blocks=SPEC_TOKENS)
    yield {
        "flash_attn": lambda: FlashAttentionMetadataBuilder(attention, ["model.layers.0.self_attn"], llama, DEVICE),
        "mamba2": lambda: Mamba2AttentionMetadataBuilder(mamba, ["model.layers.0.mamba"], bamba, DEVICE),
        "mamba2+spec": lambda: Mamba2AttentionMetadataBuilder(mamba_spec, ["model.layers.0.mamba"], bamba_spec, DEVICE),
        "gdn": lambda: GDNAttentionMetadataBuilder(gdn, ["model.layers.0.linear_attn"], qwen, DEVICE),
        "gdn+spec": lambda: GDNAttentionMetadataBuilder(gdn_spec, ["model.layers.0.linear_attn"], qwen_spec, DEVICE),
    }


# ---------------------------------------------------------------------------------------- batches
def _decodes_first(spec: BatchSpec, *, block_size: int | None = None, state_columns: int = 0,
                   threshold: int = 1, padded: bool = True, exact_bound: bool = False) -> BatchSpec:
    """``spec`` with its rows in the order vLLM's runner gives a builder that splits (rows of at most
    ``threshold`` tokens past their prompt first, then the rest, each in order), optionally as a Mamba
    group's step: ``state_columns`` state slots a request (``1 + k`` under spec decode), distinct ids;
    without its CUDA-graph padding unless ``padded``; with ``exact_bound``, without an optimistic
    ``seq_lens_upper_bound`` (the runner's bound is then ``computed + scheduled``: exact, as it is
    whenever speculative decoding is off)."""
    n = spec.num_reqs
    q, c = spec.num_scheduled_tokens, spec.num_computed_tokens
    prompt = spec.num_prompt_tokens
    decode = (q <= threshold) & (np.ones(n, bool) if prompt is None else c >= prompt)
    order = np.concatenate([np.flatnonzero(decode), np.flatnonzero(~decode)])
    def pick(a: np.ndarray | None) -> np.ndarray | None:
        return None if a is None else np.ascontiguousarray(a[order])

    table = (np.arange(1, n * state_columns + 1, dtype=np.int32).reshape(n, state_columns) if state_columns
             else np.ascontiguousarray(spec.block_table[:n][order]))
    return BatchSpec(num_computed_tokens=c[order], num_scheduled_tokens=q[order], num_prompt_tokens=pick(prompt),
                     num_draft_tokens=pick(spec.num_draft_tokens),
                     seq_lens_upper_bound=None if exact_bound else pick(spec.seq_lens_upper_bound), block_table=table,
                     block_size=block_size or spec.block_size,
                     num_reqs_padded=spec.num_reqs_padded if padded else None,
                     num_tokens_padded=spec.num_tokens_padded if padded else None)


_PLAIN = dict(min_reqs=1, max_reqs=8, kinds=("decode", "prefill", "chunked_prefill"), max_context_len=300,
              with_context_parallel=st.just(False))


def _check(name: str, vllm_builder: Any, spec: BatchSpec, options: Any, inputs: Any = None, *,
           tally: str | None = None, view: Callable[[Any], Any] | None = None, **runner_inputs: Any) -> None:
    """Build ``spec``'s step with vLLM's builder (under the sync audit, count mode) and compare what it
    computes (``view`` of its metadata, default the metadata) with attnmeta's lab reference ``name``."""
    cm, _table = vllm_runner_common(spec, DEVICE)
    with record_device_syncs(allow_async_d2h=True) as found:
        got = vllm_builder.build(common_prefix_len=0, common_attn_metadata=cm, **runner_inputs)
    if view is not None:
        got = view(got)
    want = lab(name).reference(spec, options, DEVICE, inputs)
    result = compare_with_reference(got, want)
    known = KNOWN.get(name, {})
    unexpected = [d for d in result.disagreements
                  if d.field not in known or not known[d.field][1](got, want)]
    row = TALLY[tally or name]
    row[0] += 1
    row[1] += len(result.disagreements) - len(unexpected)
    row[2] += sum(e.kind == "sync" for e in found)
    row[3] = max(row[3], len(result.compared))
    assert not unexpected, f"{name}: {[str(d) for d in unexpected]} on {spec!r}"
    assert len(result.compared) >= 5, (name, result.compared)


@settings(max_examples=scaled_examples(40), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=batch_specs(**_PLAIN))
def test_vllms_flash_attention_builder(builders: dict[str, Callable[[], Any]], spec: BatchSpec) -> None:
    _check("flash_attn", builders["flash_attn"](), spec, FlashAttentionOptions())


@settings(max_examples=scaled_examples(40), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=batch_specs(**_PLAIN, with_prompts=st.just(True)))
def test_vllms_mamba2_builder(builders: dict[str, Callable[[], Any]], spec: BatchSpec) -> None:
    mamba = _decodes_first(spec, block_size=MAMBA_BLOCK, state_columns=1)
    _check("mamba2", builders["mamba2"](), mamba, Mamba2Options(chunk_size=16))


@settings(max_examples=scaled_examples(40), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=batch_specs(**_PLAIN, with_prompts=st.just(True)))
def test_vllms_gdn_builder(builders: dict[str, Callable[[], Any]], spec: BatchSpec) -> None:
    gdn = _decodes_first(spec, block_size=MAMBA_BLOCK, state_columns=1)
    builder = _gdn(builders, "gdn")
    _check("gdn", builder, gdn, GDNOptions(prefill_backend=builder.gdn_prefill_backend))


def _gdn(builders: dict[str, Callable[[], Any]], name: str) -> Any:
    """vLLM's GDN builder. Its constructor imports the GDN layer module, whose import chain asks vLLM's
    compiled ops at import time which CUTLASS kernels are compiled in (quantization/utils/w8a8_utils.py):
    fetch_vllm.py's stand-in answers those; should the chain meet another compiled op on CUDA, the test
    skips and names it (the CPU run drives the builder). The builder resolves its prefill
    backend from the platform (on Hopper FlashInfer's kernel, which needs no FLA chunk fields; on the CPU
    Triton's): attnmeta's options name the same one, as a framework configures its builders alike."""
    try:
        return builders[name]()
    except AttributeError as e:
        if DEVICE.type == "cuda" and "_OpNamespace" in str(e):
            pytest.skip(f"vLLM's GDN builder imports modules that call vLLM's compiled ops on CUDA ({e}); the CPU "
                        "run drives it")
        raise


_SPEC = batch_specs(min_reqs=1, max_reqs=8, kinds=("decode", "spec_decode", "prefill", "chunked_prefill"),
                    max_context_len=300, max_draft_tokens=SPEC_TOKENS, with_prompts=st.just(True),
                    with_context_parallel=st.just(False))


def _check_spec_decode(name: str, vllm_builder: Any, spec: BatchSpec, options: Any, inputs_type: Any,
                       seed: int) -> None:
    """Spec decode (k = 2): the runner's draft counts and accepted counts go to vLLM's builder as its
    runner passes them (gpu_model_runner.py: every step while spec decode is on); attnmeta's reference
    derives the draft rule itself and takes the accepted counts as its inputs."""
    from attnmeta.testing.reference.layout import ref_num_decode_draft_tokens

    mamba = _decodes_first(spec, block_size=MAMBA_BLOCK, state_columns=1 + SPEC_TOKENS, threshold=1 + SPEC_TOKENS)
    n = mamba.num_reqs
    drafts = mamba.num_draft_tokens if mamba.num_draft_tokens is not None else np.zeros(n, np.int32)

    def i64(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.asarray(a, np.int64))

    assert mamba.num_prompt_tokens is not None
    ddt = ref_num_decode_draft_tokens(i64(mamba.num_scheduled_tokens), i64(drafts), i64(mamba.num_computed_tokens),
                                      i64(mamba.num_prompt_tokens), mamba.num_reqs_padded).to(torch.int32)
    rng = np.random.default_rng(seed)
    accepted = np.ones(mamba.padded_num_reqs, np.int32)
    accepted[:n] = 1 + rng.integers(0, drafts + 1)  # 1 + how many of each row's drafts were accepted
    _check(name, vllm_builder, mamba, options, inputs_type(num_accepted_tokens=accepted[:n]), tally=f"{name}+spec",
           num_accepted_tokens=torch.from_numpy(accepted).to(DEVICE), num_decode_draft_tokens_cpu=ddt)


@settings(max_examples=scaled_examples(40), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=_SPEC, seed=st.integers(0, 2**31 - 1))
def test_vllms_gdn_builder_under_spec_decode(builders: dict[str, Callable[[], Any]], spec: BatchSpec,
                                             seed: int) -> None:
    from attnmeta.backends.mamba import GDNInputs

    builder = _gdn(builders, "gdn+spec")
    _check_spec_decode("gdn", builder, spec, GDNOptions(num_speculative_tokens=SPEC_TOKENS,
                                                        prefill_backend=builder.gdn_prefill_backend), GDNInputs, seed)


@settings(max_examples=scaled_examples(40), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=_SPEC, seed=st.integers(0, 2**31 - 1))
def test_vllms_mamba2_builder_under_spec_decode(builders: dict[str, Callable[[], Any]], spec: BatchSpec,
                                                seed: int) -> None:
    from attnmeta.backends.mamba import Mamba2Inputs

    _check_spec_decode("mamba2", builders["mamba2+spec"](), spec,
                       Mamba2Options(chunk_size=16, num_speculative_tokens=SPEC_TOKENS), Mamba2Inputs, seed)


# ---------------------------------------------------------------------------------------- FlashInfer (GPU)
FI_BLOCK = 16
"""The page size of vLLM's FlashInfer builder here (its KV cache spec's block size, which sets the pages it
plans: a step's block size must be that one)."""


@pytest.fixture(scope="module")
def flashinfer_builder(tmp_path_factory: pytest.TempPathFactory) -> Callable[[], Any]:
    """vLLM's FlashInfer builder of a tiny Llama, with vLLM's own ``Attention`` layers in the forward
    context (the builder reads their scale there), on CUDA."""
    if DEVICE.type != "cuda":
        pytest.skip("vLLM's FlashInfer builder plans FlashInfer's CUDA wrappers: the GPU machine runs it")
    flashinfer = pytest.importorskip("flashinfer", reason="bash ../shared/tools/gpu-wheels.sh, then carry .whl")
    try:
        import vllm.v1.attention.backends.flashinfer  # noqa: F401
    except ImportError as e:  # vLLM 0.33.0's backend needs flashinfer-python 0.7.2.post1
        pytest.skip(f"vLLM 0.33.0's FlashInfer backend does not import with flashinfer {flashinfer.__version__} "
                    f"(it needs the release it pins, 0.7.2.post1: `python tests/kernels/fetch_vllm.py --flashinfer` "
                    f"packs it for the GPU machine): {e}")
    from transformers import LlamaConfig
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.v1.attention.backends.flashinfer import FlashInferBackend, FlashInferMetadataBuilder
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    config = _vllm_config(tmp_path_factory.mktemp("vllm-flashinfer"), LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=MAMBA_BLOCK))
    name = "model.layers.0.self_attn.attn"
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float16)
    try:
        with set_current_vllm_config(config):
            layer = Attention(4, 16, 0.25, num_kv_heads=2, cache_config=config.cache_config, prefix=name,
                              attn_backend=FlashInferBackend)
    finally:
        torch.set_default_dtype(default)
    spec = FullAttentionSpec(block_size=FI_BLOCK, num_kv_heads=2, head_size=16, dtype=torch.float16)
    set_kv_cache_layout(config, FlashInferBackend, spec)  # as vLLM's engine core does before its workers build
    keep = [layer]

    def make() -> Any:
        with set_current_vllm_config(config):  # as vLLM's worker makes its builders (it asks about TRT-LLM)
            return (keep, FlashInferMetadataBuilder(spec, [name], config, DEVICE))[1]

    return make


def _flashinfer_view(builder: Any) -> Callable[[Any], Any]:
    """What vLLM's FlashInfer builder computes, by attnmeta's field names: the split from its metadata,
    the page table from the buffers it planned FlashInfer's wrappers from."""
    from types import SimpleNamespace

    def view(meta: Any) -> Any:
        rows = meta.num_decodes + meta.num_prefills
        indptr = builder.paged_kv_indptr.cpu[: rows + 1].clone()
        last = builder.paged_kv_last_page_len.cpu[:rows].clone()
        return SimpleNamespace(num_decodes=meta.num_decodes, num_prefills=meta.num_prefills,
                               num_decode_tokens=meta.num_decode_tokens, num_prefill_tokens=meta.num_prefill_tokens,
                               paged_kv_indptr=indptr, paged_kv_last_page_len=last,
                               paged_kv_indices=builder.paged_kv_indices[: int(indptr[-1])])
    return view


@settings(max_examples=scaled_examples(40), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=batch_specs(**_PLAIN))
def test_vllms_flashinfer_builder(flashinfer_builder: Callable[[], Any], spec: BatchSpec) -> None:
    builder = flashinfer_builder()
    # Its pages are its KV cache spec's: the step's block size is that one. vLLM's runner pads a step's
    # attention metadata only in FULL CUDA graphs (gpu_model_runner.py: pad_attn), which FlashInfer's
    # backend takes for uniform batches alone (get_cudagraph_support), padding requests with tokens (the
    # dispatcher's batch descriptor): of these steps, single-token decodes; every other step reaches the
    # builder unpadded. Without speculative decoding the runner's seq_lens_cpu_upper_bound is exact, and
    # vLLM's builder reads it as the sequence lengths ("No speculative token accounting, so the upper
    # bound is exact"): an optimistic bound (async spec decode) never reaches this builder.
    uniform = spec.max_query_len == 1 and spec.num_tokens_padded == spec.num_reqs_padded
    step = _decodes_first(spec, block_size=FI_BLOCK, padded=uniform, exact_bound=True)
    _check("flashinfer", builder, step, FlashInferOptions(), view=_flashinfer_view(builder))


# ---------------------------------------------------------------------------------------- MLA
MLA_MODEL_LEN = 256
"""The MLA config's ``max_model_len``: small, so that vLLM's chunked-context workspace (``8 * max_model_len``
rows, 2048) is smaller than a batch's context and the chunk plan splits it."""
_MLA = dict(min_reqs=1, max_reqs=16, kinds=("decode", "prefill", "chunked_prefill"), max_query_len=32,
            max_context_len=MLA_MODEL_LEN - 32, with_context_parallel=st.just(False))


@pytest.fixture(scope="module")
def mla_builder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[], Any]]:
    """vLLM's Triton-MLA builder (``TritonMLAMetadataBuilder``: attnmeta's ``triton_mla`` variant) for a tiny
    DeepSeek-V2 (4 heads, DeepSeek's latent sizes 512 + 64, which vLLM's MLA metadata requires), with a
    real ``MLAAttention`` layer in the forward context, made as vLLM's worker makes them: a one-process
    distributed group (gloo), inside ``set_current_vllm_config``. On the CPU the layer's own kernels are
    vLLM's CPU MLA backend and CPU SDPA prefill (the Triton impl asks the GPU's SM count); the builder reads
    only the layer's MLA dimensions and clones its prefill backend."""
    import socket

    from transformers import DeepseekV2Config
    from vllm.config import SchedulerConfig, set_current_vllm_config
    from vllm.distributed import parallel_state
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    from vllm.model_executor.layers.linear import ColumnParallelLinear
    from vllm.v1.attention.backends.mla.triton_mla import TritonMLABackend, TritonMLAMetadataBuilder
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    # DeepSeek's head dimensions (nope 128, rope 64, v 128): on CUDA vLLM picks an MLA prefill backend for
    # them (FlashAttention's takes only a few such triples) when the layer is made
    heads, nope, rope, v, latent = 4, 128, 64, 128, 512
    hf = DeepseekV2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                          num_attention_heads=heads, num_key_value_heads=heads, q_lora_rank=None, kv_lora_rank=latent,
                          qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=v, n_routed_experts=4,
                          num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
                          max_position_embeddings=MLA_MODEL_LEN, architectures=["DeepseekV2ForCausalLM"])
    folder = tmp_path_factory.mktemp("vllm-mla")
    hf.save_pretrained(folder)
    model = ModelConfig(model=str(folder), skip_tokenizer_init=True, dtype="float16", max_model_len=MLA_MODEL_LEN)
    config = VllmConfig(model_config=model, cache_config=CacheConfig(block_size=16),
                        scheduler_config=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=2048,
                                                         max_model_len=MLA_MODEL_LEN, is_encoder_decoder=False),
                        device_config=DeviceConfig(device=DEVICE.type))
    if not torch.cuda.is_available():
        no_pinning()
    name = "model.layers.0.self_attn.attn"
    owned_group = not parallel_state.model_parallel_is_initialized()
    with set_current_vllm_config(config):
        if owned_group:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            parallel_state.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                                        distributed_init_method=f"tcp://127.0.0.1:{port}")
            parallel_state.initialize_model_parallel(1, 1)
        if DEVICE.type == "cuda":
            kernels: dict[str, Any] = {"attn_backend": TritonMLABackend}
        else:
            from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend
            from vllm.v1.attention.backends.mla.prefill.cpu_sdpa import CPUSDPAMLAPrefillBackend

            kernels = {"attn_backend": CPUMLABackend, "prefill_backend_cls": CPUSDPAMLAPrefillBackend}
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.float16)
        try:
            kv_b_proj = ColumnParallelLinear(latent, heads * (nope + v), bias=False, disable_tp=True,
                                             prefix="model.layers.0.self_attn.kv_b_proj")
            layer = MLAAttention(heads, (nope + rope) ** -0.5, nope, rope, v, None, latent, kv_b_proj,
                                 cache_config=config.cache_config, prefix=name, **kernels)
        except (ImportError, RuntimeError, NotImplementedError) as e:
            if DEVICE.type != "cuda":
                raise
            failed: Exception | None = e  # on the GPU machine: vLLM's CUDA MLA kernels need its extensions
        else:
            failed = None
        finally:
            torch.set_default_dtype(default)
    if failed is not None:
        if owned_group:
            parallel_state.destroy_model_parallel()
            parallel_state.destroy_distributed_environment()
        pytest.skip(f"vLLM's MLA layer does not build on this GPU without vLLM's compiled extensions: {failed!r}")
    spec = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=latent + rope, dtype=torch.float16)

    def make() -> Any:
        with set_current_vllm_config(config):
            return (layer, TritonMLAMetadataBuilder(spec, [name], config, DEVICE))[1]

    yield make
    if owned_group:
        parallel_state.destroy_model_parallel()
        parallel_state.destroy_distributed_environment()


def _mla_view(meta: Any) -> Any:
    """What vLLM's MLA builder computes, by attnmeta's (flat) field names: the decode and prefill parts and
    the chunked context's chunks, each chunk's tensors concatenated in chunk order as attnmeta stages them
    (a part vLLM leaves out, None, gives no field: nothing to compare)."""
    from types import SimpleNamespace

    out: dict[str, Any] = {k: getattr(meta, k) for k in ("num_reqs", "num_actual_tokens", "max_query_len",
                                                          "max_seq_len", "num_decodes", "num_prefills",
                                                          "num_decode_tokens", "query_start_loc", "slot_mapping")}
    if meta.decode is not None:
        out["decode_seq_lens"] = meta.decode.seq_lens
    pre = meta.prefill
    if pre is not None:
        out.update(prefill_query_start_loc=pre.query_start_loc, prefill_max_query_len=pre.max_query_len,
                   prefill_query_lens_cpu=pre.query_lens_cpu)
        chunked = pre.chunked_context
        out["num_chunks"] = 0 if chunked is None else len(chunked.chunks)
        if chunked is not None:
            out["context_lens"] = chunked.context_lens
            for field, attr in (("chunk_starts", "starts"), ("chunk_seq_lens_cpu", "seq_lens"),
                                ("chunk_cu_seq_lens", "cu_seq_lens"), ("chunk_cu_seqlens_q", "query_start_loc"),
                                ("chunk_token_to_seq", "token_to_seq")):
                out[field] = torch.cat([getattr(c, attr).to(DEVICE) for c in chunked.chunks])
    return SimpleNamespace(**out)


def _long_contexts(decodes: int, rows: int) -> BatchSpec:
    """``decodes`` decode rows, then prefill rows continuing 180-210-token contexts, 2,400 tokens of context or
    more in all: the chunk plan splits them over several workspace-sized chunks (generated batches rarely
    reach that)."""
    c = np.array([40] * decodes + [180 + 2 * i for i in range(rows - decodes)], np.int32)
    q = np.array([1] * decodes + [8 + i for i in range(rows - decodes)], np.int32)
    table = np.arange(rows * 16, dtype=np.int32).reshape(rows, 16)
    return BatchSpec(num_computed_tokens=c, num_scheduled_tokens=q, block_table=table, block_size=16)


@settings(max_examples=scaled_examples(40), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=batch_specs(**_MLA))
@example(spec=_long_contexts(0, 16))
@example(spec=_long_contexts(3, 16))
def test_vllms_triton_mla_builder(mla_builder: Callable[[], Any], spec: BatchSpec) -> None:
    from attnmeta.backends.mla import MLAOptions

    builder = mla_builder()
    options = MLAOptions(variant="triton_mla", workspace_size=builder.chunked_prefill_workspace_size)
    _check("mla", builder, _decodes_first(spec), options, view=_mla_view, tally="mla (triton_mla)")
