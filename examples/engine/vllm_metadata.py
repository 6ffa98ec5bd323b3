"""The engine's ``vllm`` metadata mode: each step's metadata built by vLLM 0.33.0's own code.

The baseline a serving framework runs today, in the same loop, with the same model and kernels as the
``attnmeta`` mode, so that the two can be compared step for step (``benchmarks/bench_engine.py --modes``
``vllm-graphs``, ``vllm-eager``).

What runs each step, in the order of vLLM's ``GPUModelRunner`` (``_prepare_inputs``, ``_get_slot_mappings``
and ``_build_attention_metadata`` of ``vllm/v1/worker/gpu_model_runner.py``):

- the runner's persistent buffers, made with vLLM's own classes: ``CpuGpuBuffer`` (query start offsets,
  request indices, query positions, scheduled counts, input ids) and one ``BlockTable`` per KV-cache group
  (the attention group's, and a hybrid model's Mamba group with ``SlotMappingMode.NONE``);
- its copies: the block tables' ``commit_block_table``, ``query_start_loc``, the computed counts
  (``non_blocking``), ``req_indices``, ``query_pos``, ``num_scheduled_tokens`` and the input ids, each its
  own H2D copy; the positions and sequence lengths computed on the device from them, the slot mapping by
  vLLM's Triton kernel (``BlockTable.compute_slot_mapping``; on a machine without CUDA the same rule in
  torch), the padding fills of the slot mapping and the block table;
- vLLM's ``CommonAttentionMetadata`` of those buffers, then vLLM's own metadata builders on it:
  ``FlashInferMetadataBuilder`` (it also plans FlashInfer's wrappers, as in vLLM) for the ``flashinfer``
  kernel, ``FlashAttentionMetadataBuilder`` for ``torch-paged``, and ``Mamba2AttentionMetadataBuilder`` for
  a hybrid model's Mamba group.

The builders get the smallest real configs: a ``VllmConfig`` whose ``ModelConfig`` reads the engine's own
Hugging Face config from a temporary folder, the ``CacheConfig`` of the engine's block size, a
``CompilationConfig`` with full CUDA graphs of decode steps at the engine's sizes in graphs mode, and real
``Attention`` layers of vLLM (FlashInfer's builder reads its scale from the layers of the forward context).

The engine's own per-step arrays (its input ids and the rows of tokens still on the device) ride vLLM's
input-ids path: one ``CpuGpuBuffer`` each. The kernels are the ``attnmeta`` mode's: FlashInfer's wrappers
as vLLM plans and runs them (:class:`VllmFlashInferKernel`), or the torch paged kernel over vLLM's
FlashAttention metadata (:class:`VllmPagedKernel`). Not covered: cascade attention (vLLM's common prefix
length is 0 here; the ``attnmeta`` mode's eager steps may cascade), the ``align`` Mamba cache mode, and
spec decode.

vLLM's Python package is needed, none of its compiled extensions: on a machine with pip and the network,
``bash tests/integrations/install_vllm.sh``; for the GPU machine, ``python tests/kernels/fetch_vllm.py``
makes ``.vllm/`` and ``benchmarks/gpu_all.sh`` unpacks it there.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import importlib.util
import sys
import tempfile
import time
from typing import Any

import numpy as np
import torch

from .kernels import FLASHINFER_OPTIONAL, TorchPagedKernel, VarlenKernel, mark_absent

__all__ = ["INSTALL", "KERNELS", "VLLM_VERSION", "VllmFlashInferKernel", "VllmMetadata", "VllmPagedKernel", "VllmStep",
           "VllmVarlenKernel", "no_pinning", "set_kv_cache_layout"]

VLLM_VERSION = "0.33.0"
KERNELS = ("flashinfer", "torch-paged", "torch-varlen")
"""The engine's kernels the vllm mode feeds: FlashInfer's through vLLM's FlashInfer builder, the two torch
kernels through vLLM's FlashAttention builder."""
INSTALL = (f"the engine's vllm metadata mode needs vLLM {VLLM_VERSION}'s Python package: bash "
           "tests/integrations/install_vllm.sh ENV (a machine with the network), or python "
           "tests/kernels/fetch_vllm.py and benchmarks/gpu_all.sh's vllm parts (the GPU machine)")


def _import_vllm() -> Any:
    """vLLM's package, checked for :data:`VLLM_VERSION`.

    Raises
    ------
    ImportError
        vLLM is not importable, or is another version; the message says how to install it.
    """
    try:
        vllm = importlib.import_module("vllm")
    except ImportError as e:
        raise ImportError(f"{INSTALL} ({e})") from None
    version = getattr(vllm, "__version__", "unknown")
    if not str(version).startswith(VLLM_VERSION):
        raise ImportError(f"vLLM {version} is importable, the vllm mode is written for {VLLM_VERSION}: {INSTALL}")
    return vllm


def no_pinning() -> None:
    """Tell vLLM's imported modules not to pin memory (their ``PIN_MEMORY`` flag): without CUDA nothing can
    be pinned, while vLLM's platform may still say it can."""
    for mod in list(sys.modules.values()):
        if getattr(mod, "__name__", "").startswith("vllm") and hasattr(mod, "PIN_MEMORY"):
            mod.PIN_MEMORY = False  # type: ignore[attr-defined]


@dataclasses.dataclass
class VllmStep:
    """One step's metadata as vLLM builds it. Every tensor lives on the engine's device unless named
    ``*_cpu``; the full-size buffers keep their addresses from step to step (CUDA graphs read them)."""

    common: Any
    """vLLM's ``CommonAttentionMetadata`` of the attention group (padded rows included)."""
    attention: Any
    """The attention builder's metadata (``FlashInferMetadata`` or ``FlashAttentionMetadata``)."""
    mamba: Any | None
    """A hybrid model's ``Mamba2AttentionMetadata``, else None."""
    input_ids: torch.Tensor
    """(max_num_tokens,) int32: the engine's known input ids."""
    prev_rows: torch.Tensor
    """(max_num_tokens,) int32: for a token still on the device, its row in the previous step's tokens; -1."""
    positions: torch.Tensor
    """(max_num_tokens,) int64."""
    slot_mapping: torch.Tensor
    """(max_num_tokens,) int64, -1 past the step's tokens."""
    query_start_loc: torch.Tensor
    """(max_num_seqs + 1,) int32, padding rows repeating the last offset."""
    plan_seconds: float
    """Host time in FlashInfer's ``plan()`` inside the builder's ``build()`` (0 for other builders)."""
    copies: int
    """The runner's H2D copies of the step (``copy_to_gpu`` and ``non_blocking`` copies; FlashInfer's
    ``plan()`` copies not counted)."""


_PLAN_SECONDS = [0.0]
"""Host seconds in FlashInfer ``plan()`` calls made by vLLM's FlashInfer builders, process-wide (vLLM's
``fast_plan_decode`` is a module function, shared by every builder): a build reads the difference."""


def _timed(call: Any) -> Any:
    """``call`` with its host time added to :data:`_PLAN_SECONDS` (marked, so it is wrapped once)."""
    if getattr(call, "_attnmeta_timed", False):
        return call

    def timed(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            _PLAN_SECONDS[0] += time.perf_counter() - t

    timed._attnmeta_timed = True  # type: ignore[attr-defined]
    return timed


def _time_plans(module: Any, builder: Any) -> None:
    """Time the ``plan()`` calls vLLM's FlashInfer ``builder`` makes: its module's ``fast_plan_decode`` (the
    decode wrappers) and each prefill wrapper's ``plan``, through wrappers of the same calls."""
    module.fast_plan_decode = _timed(module.fast_plan_decode)
    get_prefill = builder._get_prefill_wrapper

    def timed_prefill_wrapper(*args: Any, **kwargs: Any) -> Any:
        wrapper = get_prefill(*args, **kwargs)
        wrapper.plan = _timed(wrapper.plan)
        return wrapper

    builder._get_prefill_wrapper = timed_prefill_wrapper


def set_kv_cache_layout(config: Any, backend: Any, spec: Any) -> None:
    """Resolve and record the KV cache layout the way vLLM's engine core does before its workers build
    (``resolve_kv_cache_layout`` over the attention backend's supported layouts, then
    ``record_kv_cache_layout`` on the config, as the worker's ``set_kv_cache_layout`` does), for every
    backend: FlashInfer's builder plans with it. The engine's caches hold each layer's blocks with tokens,
    then heads (vLLM's ``LBNHC``, FlashInfer's NHD); another resolution (TRT-LLM's head-major one on
    Blackwell) is an error here."""
    from vllm.v1.attention.backends.utils import (
        get_supported_kv_cache_layouts,
        record_kv_cache_layout,
        resolve_kv_cache_layout,
    )

    supported = [layout.name for layout in get_supported_kv_cache_layouts([backend])]
    layout = resolve_kv_cache_layout(config, [supported], [spec])
    if layout.name != "LBNHC":
        raise NotImplementedError(f"vLLM resolved the KV cache layout {layout.name} on this GPU; the engine's "
                                  "caches are LBNHC (FlashInfer's NHD)")
    record_kv_cache_layout(config.cache_config, layout.name)


class VllmMetadata:
    """vLLM 0.33.0's runner buffers and metadata builders for one engine (module docstring).

    Parameters
    ----------
    hf_config : transformers.PretrainedConfig
        The engine model's config (a Llama or a Bamba); written to a temporary folder that vLLM's
        ``ModelConfig`` reads.
    kernel : str
        ``"flashinfer"`` (vLLM's FlashInfer builder; CUDA) or ``"torch-paged"`` (vLLM's FlashAttention
        builder).
    device : torch.device
    dtype : torch.dtype
        The model's dtype (the KV cache's and the queries').
    block_size, max_num_seqs, max_num_tokens, max_model_len : int
        The engine's sizes (``EngineConfig``).
    decode_sizes : tuple of int
        With ``graphs``, the padded decode sizes captured as CUDA graphs (vLLM's capture sizes).
    graphs : bool
        Full CUDA graphs of decode steps (``CUDAGraphMode.FULL_DECODE_ONLY``).
    hybrid : bool
        A Bamba: a second KV-cache group for its Mamba layers (one state slot a request).

    Raises
    ------
    ImportError
        vLLM :data:`VLLM_VERSION` is not importable (the message says how to install it).
    ValueError
        An unknown kernel, or ``flashinfer`` without CUDA.
    """

    def __init__(self, hf_config: Any, kernel: str, device: torch.device, dtype: torch.dtype, *, block_size: int,
                 max_num_seqs: int, max_num_tokens: int, max_model_len: int, decode_sizes: tuple[int, ...],
                 graphs: bool, hybrid: bool) -> None:
        if kernel not in KERNELS:
            raise ValueError(f"the vllm metadata mode runs kernels {', '.join(KERNELS)}, not {kernel!r}")
        if kernel != "torch-paged" and device.type != "cuda":
            raise ValueError(f"the vllm metadata mode's {kernel} kernel needs CUDA")
        _import_vllm()
        from vllm.config import (
            CacheConfig,
            CompilationConfig,
            DeviceConfig,
            ModelConfig,
            SchedulerConfig,
            VllmConfig,
        )
        from vllm.config.compilation import CUDAGraphMode
        from vllm.v1.utils import CpuGpuBuffer
        from vllm.v1.worker.block_table import BlockTable, SlotMappingMode

        self.device, self.kernel, self.hybrid, self.block_size = device, kernel, hybrid, block_size
        self.cuda = device.type == "cuda"
        self.max_num_seqs, self.max_num_tokens = max_num_seqs, max_num_tokens
        self._folder = tempfile.TemporaryDirectory(prefix="attnmeta-vllm-config-")
        saved = copy.deepcopy(hf_config)
        if getattr(saved, "model_type", "") == "llama":  # the engine serves the causal LM (vLLM's own class)
            saved.architectures = ["LlamaForCausalLM"]
        saved.save_pretrained(self._folder.name)
        dtype_name = str(dtype).removeprefix("torch.")
        model = ModelConfig(model=self._folder.name, skip_tokenizer_init=True, dtype=dtype_name,
                            max_model_len=max_model_len)
        sizes = sorted(s for s in decode_sizes if s <= max_num_seqs)
        # (graph mode without sizes captures nothing, as the engine does: every step then runs eager)
        compilation = (CompilationConfig(cudagraph_mode=CUDAGraphMode.FULL_DECODE_ONLY, cudagraph_capture_sizes=sizes,
                                         max_cudagraph_capture_size=max(sizes))
                       if graphs and sizes else CompilationConfig(cudagraph_mode=CUDAGraphMode.NONE))
        # the runner's sizes: vLLM's builders size their persistent buffers (FlashInfer's page-table arrays,
        # its CUDA-graph decode wrappers) from the scheduler's max_num_seqs and max_num_batched_tokens
        scheduler = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_tokens,
                                    max_model_len=max_model_len, is_encoder_decoder=False)
        self.config = VllmConfig(model_config=model, cache_config=CacheConfig(block_size=block_size),
                                 scheduler_config=scheduler,
                                 device_config=DeviceConfig(device=device.type), compilation_config=compilation)
        if not self.cuda:
            no_pinning()
        from vllm.config import set_current_vllm_config

        # vLLM's worker makes its layers and builders inside set_current_vllm_config (WorkerWrapperBase's
        # initialize_from_config): FlashInfer's builder asks the current config whether to force TRT-LLM's
        # kernels, FlashAttention's which version to use. vLLM builds each step outside it, as this class does.
        with set_current_vllm_config(self.config):
            self._make_builders(kernel, hybrid, hf_config, dtype, device, block_size, max_model_len)

        # the runner's persistent buffers (GPUModelRunner.__init__ and InputBatch), vLLM's own classes
        pin = self.cuda

        def buffer(*size: int, dtype: torch.dtype) -> Any:
            return CpuGpuBuffer(*size, dtype=dtype, device=device, pin_memory=pin)

        self.query_start_loc = buffer(max_num_seqs + 1, dtype=torch.int32)
        self.req_indices = buffer(max_num_tokens, dtype=torch.int64)
        self.query_pos = buffer(max_num_tokens, dtype=torch.int64)
        self.num_scheduled_tokens = buffer(max_num_seqs, dtype=torch.int32)
        self.input_ids = buffer(max_num_tokens, dtype=torch.int32)
        self.prev_rows = buffer(max_num_tokens, dtype=torch.int32)
        self.positions = torch.zeros(max_num_tokens, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(max_num_seqs, dtype=torch.int32, device=device)
        self.num_computed_tokens = torch.zeros(max_num_seqs, dtype=torch.int32, device=device)
        self.num_computed_tokens_cpu = torch.zeros(max_num_seqs, dtype=torch.int32, pin_memory=pin)
        self.num_prompt_tokens_cpu = torch.zeros(max_num_seqs, dtype=torch.int32)
        self.optimistic_seq_lens_cpu = torch.zeros(max_num_seqs, dtype=torch.int32)
        self.arange = np.arange(max(max_num_seqs, max_num_tokens) + 1, dtype=np.int64)
        width = -(-max_model_len // block_size)
        self.tables = [BlockTable(block_size, max_num_seqs, width, max_num_tokens, pin, device, 1)]
        if hybrid:
            self.tables.append(BlockTable(max_model_len, max_num_seqs, 1, max_num_tokens, pin, device, 1,
                                          slot_mapping_mode=SlotMappingMode.NONE))
        self._common_cls = importlib.import_module("vllm.v1.attention.backends.utils").CommonAttentionMetadata

    def _make_builders(self, kernel: str, hybrid: bool, text: Any, dtype: torch.dtype, device: torch.device,
                       block_size: int, max_model_len: int) -> None:
        """vLLM's builders (and for FlashInfer the ``Attention`` layers its builder reads its scale from),
        made under the caller's ``set_current_vllm_config``."""
        from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

        h, hk = int(text.num_attention_heads), int(text.num_key_value_heads)
        d = int(getattr(text, "head_dim", None) or text.hidden_size // h)
        layers = [i for i in range(int(text.num_hidden_layers))
                  if not hybrid or i in set(getattr(text, "attn_layer_indices", None) or ())]
        names = [f"model.layers.{i}.self_attn.attn" for i in layers]
        spec = FullAttentionSpec(block_size=block_size, num_kv_heads=hk, head_size=d, dtype=dtype)
        if kernel == "flashinfer":
            mark_absent(FLASHINFER_OPTIONAL)
            from vllm.model_executor.layers.attention.attention import Attention
            from vllm.v1.attention.backends import flashinfer as fi_module

            set_kv_cache_layout(self.config, fi_module.FlashInferBackend, spec)
            default = torch.get_default_dtype()
            torch.set_default_dtype(dtype)
            try:
                self._layers = [Attention(h, d, d ** -0.5, num_kv_heads=hk, cache_config=self.config.cache_config,
                                          prefix=name, attn_backend=fi_module.FlashInferBackend) for name in names]
            finally:
                torch.set_default_dtype(default)
            self.attention_builder = fi_module.FlashInferMetadataBuilder(spec, names, self.config, device)
            _time_plans(fi_module, self.attention_builder)
        else:
            from vllm.v1.attention.backends.flash_attn import (
                FlashAttentionBackend,
                FlashAttentionMetadataBuilder,
            )

            set_kv_cache_layout(self.config, FlashAttentionBackend, spec)
            self.attention_builder = FlashAttentionMetadataBuilder(spec, names, self.config, device)
        self.mamba_builder = None
        if hybrid:
            from vllm.v1.attention.backends.mamba2_attn import Mamba2AttentionMetadataBuilder

            heads, head_dim = int(text.mamba_n_heads), int(text.mamba_d_head)
            inner, groups, state = heads * head_dim, int(text.mamba_n_groups), int(text.mamba_d_state)
            conv = int(text.mamba_d_conv)
            mamba = MambaSpec(block_size=max_model_len,
                              shapes=((conv - 1, inner + 2 * groups * state), (heads, head_dim, state)),
                              dtypes=(dtype, dtype))
            mamba_layers = [f"model.layers.{i}.mamba" for i in range(int(text.num_hidden_layers)) if i not in layers]
            self.mamba_builder = Mamba2AttentionMetadataBuilder(mamba, mamba_layers, self.config, device)

    # ------------------------------------------------------------------ one step
    def set_batch(self, computed: np.ndarray, prompt_lens: np.ndarray, table: np.ndarray,
                  state_table: np.ndarray | None = None) -> None:
        """The input batch's rows before a step: what vLLM's ``InputBatch`` keeps persistent and edits as
        requests come and go (the engine's bookkeeping, not timed as metadata work, as the ``attnmeta``
        mode's block table rows are not).

        Parameters
        ----------
        computed, prompt_lens : np.ndarray
            (n,) int32, host: each row's computed tokens and its prompt's length.
        table : np.ndarray
            (n, width) int32, host: the attention group's block table rows.
        state_table : np.ndarray, optional
            (n, 1) int32, host: a hybrid model's state slot of each row.
        """
        n = len(computed)
        self.num_computed_tokens_cpu.numpy()[:n] = computed
        self.num_prompt_tokens_cpu.numpy()[:n] = prompt_lens
        self.tables[0].block_table.np[:n, : table.shape[1]] = table
        if self.hybrid:
            assert state_table is not None
            self.tables[1].block_table.np[:n, :1] = state_table

    def build(self, scheduled: np.ndarray, ids: np.ndarray, prev_rows: np.ndarray, *,
              padded: int | None) -> VllmStep:
        """One step's metadata, as vLLM's runner and builders make it, over the rows :meth:`set_batch` wrote.

        Parameters
        ----------
        scheduled : np.ndarray
            (n,) int32, host: each row's tokens this step.
        ids, prev_rows : np.ndarray
            (T,) int32, host: the engine's input ids and device-token rows (T: the step's tokens, padded).
        padded : int, optional
            A decode step padded to this many rows (and tokens).
        """
        n, total = len(scheduled), int(scheduled.sum())
        B, T = (padded, padded) if padded is not None else (n, total)
        # _prepare_inputs
        for bt in self.tables:
            bt.commit_block_table(n)
        req_indices = np.repeat(self.arange[:n], scheduled)
        cu = np.cumsum(scheduled)
        self.query_pos.np[:total] = self.arange[:total] - np.repeat(cu - scheduled, scheduled)
        self.input_ids.np[:T] = ids
        self.prev_rows.np[:T] = prev_rows
        qsl = self.query_start_loc
        qsl.np[0] = 0
        qsl.np[1 : n + 1] = cu
        qsl.np[n + 1 :].fill(cu[-1])
        qsl.copy_to_gpu()
        torch.add(self.num_computed_tokens_cpu[:n], torch.from_numpy(scheduled), out=self.optimistic_seq_lens_cpu[:n])
        self.optimistic_seq_lens_cpu[n:].fill_(0)
        self.num_computed_tokens[:n].copy_(self.num_computed_tokens_cpu[:n], non_blocking=True)
        self.req_indices.np[:total] = req_indices
        self.req_indices.copy_to_gpu(total)
        self.query_pos.copy_to_gpu(total)
        self.num_scheduled_tokens.np[:n] = scheduled
        self.num_scheduled_tokens.copy_to_gpu(n)
        self.positions[:total] = (self.num_computed_tokens[self.req_indices.gpu[:total]].to(torch.int64)
                                  + self.query_pos.gpu[:total])
        self.seq_lens[:n] = self.num_computed_tokens[:n] + self.num_scheduled_tokens.gpu[:n]
        self.seq_lens[n:].fill_(0)
        self._slot_mapping(n, total)
        self.input_ids.copy_to_gpu(T)  # _prepare_input_ids; the engine's device-token rows the same way
        self.prev_rows.copy_to_gpu(T)
        # _get_slot_mappings
        slot_mappings = []
        for bt in self.tables:
            sm = bt.slot_mapping.gpu[:T]
            sm[total:T].fill_(-1)
            slot_mappings.append(sm)
        # _build_attention_metadata
        max_seq_len = int(self.optimistic_seq_lens_cpu.numpy()[:n].max())
        is_prefilling = self.num_computed_tokens_cpu[:B] < self.num_prompt_tokens_cpu[:B]
        is_prefilling[n:] = False
        tables = []
        for bt in self.tables:
            t = bt.get_device_tensor(B)
            t[n:B].fill_(0)  # NULL_BLOCK_ID
            tables.append(t)
        common = self._common_cls(
            query_start_loc=qsl.gpu[: B + 1], query_start_loc_cpu=qsl.cpu[: B + 1], seq_lens=self.seq_lens[:B],
            seq_lens_cpu_upper_bound=self.optimistic_seq_lens_cpu[:B], num_reqs=B, num_actual_tokens=T,
            max_query_len=int(scheduled.max()), max_seq_len=max_seq_len, block_table_tensor=tables[0],
            slot_mapping=slot_mappings[0], causal=True, is_prefilling=is_prefilling, positions=self.positions[:T])
        before = _PLAN_SECONDS[0]
        attention = self.attention_builder.build(common_prefix_len=0, common_attn_metadata=common)
        mamba = None
        if self.mamba_builder is not None:
            group = copy.copy(common)
            group.block_table_tensor, group.slot_mapping = tables[1], slot_mappings[1]
            mamba = self.mamba_builder.build(common_prefix_len=0, common_attn_metadata=group)
        if mamba is not None and mamba.num_prefills:  # the torch mixer's host offsets of the prefill rows
            qsl_cpu = qsl.cpu[mamba.num_decodes : B + 1]
            mamba = _HostOffsets(mamba, qsl_cpu - qsl_cpu[0])
        plan = _PLAN_SECONDS[0] - before
        return VllmStep(common=common, attention=attention, mamba=mamba, input_ids=self.input_ids.gpu,
                        prev_rows=self.prev_rows.gpu, positions=self.positions,
                        slot_mapping=self.tables[0].slot_mapping.gpu, query_start_loc=qsl.gpu, plan_seconds=plan,
                        copies=len(self.tables) + 7)

    def _slot_mapping(self, n: int, total: int) -> None:
        """The attention group's slot mapping: vLLM's Triton kernel on CUDA; without CUDA, its rule in
        torch (block ``pos // block_size`` of the row's table, offset ``pos % block_size``)."""
        bt = self.tables[0]
        if self.cuda:
            bt.compute_slot_mapping(n, self.query_start_loc.gpu[: n + 1], self.positions[:total])
            return
        rows, pos = self.req_indices.gpu[:total], self.positions[:total]
        blocks = bt.block_table.gpu[rows, pos // self.block_size].to(torch.int64)
        bt.slot_mapping.gpu[:total] = blocks * self.block_size + pos % self.block_size


class VllmPagedKernel(TorchPagedKernel):
    """The torch paged kernel over vLLM's ``FlashAttentionMetadata``: the block table, the query offsets'
    host copy and the host sequence lengths (vLLM's ``seq_lens_cpu_upper_bound``, exact without spec
    decode) of the step. No cascade attention."""

    name = "torch-paged"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, None)

    def prepare_vllm(self, step: VllmStep, num_reqs: int, block_size: int) -> None:
        """Plan the step's per-request gathers from vLLM's metadata (``num_reqs``: the real rows)."""
        fa, cm = step.attention, step.common
        view = _PagedView(block_size=block_size, block_table_tensor=fa.block_table,
                          query_start_loc_cpu=cm.query_start_loc_cpu, seq_lens_cpu=cm.seq_lens_cpu_upper_bound,
                          num_real_reqs=num_reqs)
        self.prepare(view, {})  # type: ignore[arg-type]


class _HostOffsets:
    """vLLM's ``Mamba2AttentionMetadata`` with the host copy of its prefill rows' query offsets, which
    the engine's torch Mamba mixer reads (taken from the runner's ``query_start_loc`` host buffer, as
    vLLM's own builders take theirs; vLLM's kernels read only the device fields)."""

    def __init__(self, meta: Any, query_start_loc_p_cpu: torch.Tensor) -> None:
        self._meta = meta
        self.query_start_loc_p_cpu = query_start_loc_p_cpu

    def __getattr__(self, name: str) -> Any:
        return getattr(self._meta, name)


@dataclasses.dataclass
class _PagedView:
    """What :meth:`TorchPagedKernel.prepare` reads of a step's common metadata."""

    block_size: int
    block_table_tensor: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens_cpu: torch.Tensor
    num_real_reqs: int


class VllmVarlenKernel(VarlenKernel):
    """FlashAttention's varlen kernel (torch's ``varlen_attn``, CUDA) over vLLM's ``FlashAttentionMetadata``:
    its query offsets, sequence lengths, block table and maxima, with the host total of the sequence
    lengths from vLLM's ``seq_lens_cpu_upper_bound`` (exact without spec decode)."""

    def prepare_vllm(self, step: VllmStep, num_reqs: int, block_size: int) -> None:
        """Plan the step's K/V gathers from vLLM's metadata (``num_reqs``: the real rows)."""
        fa, cm = step.attention, step.common
        view = _VarlenView(seq_lens=fa.seq_lens, seq_lens_cpu=cm.seq_lens_cpu_upper_bound,
                           block_table=fa.block_table, query_start_loc=fa.query_start_loc,
                           max_query_len=fa.max_query_len, max_seq_len=fa.max_seq_len)
        self.prepare(_Rows(num_reqs=num_reqs, block_size=block_size), {"flash_attn": view})  # type: ignore[arg-type]


@dataclasses.dataclass
class _VarlenView:
    """What :meth:`VarlenKernel.prepare` reads of FlashAttention metadata."""

    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    block_table: torch.Tensor
    query_start_loc: torch.Tensor
    max_query_len: int
    max_seq_len: int


@dataclasses.dataclass
class _Rows:
    """What :meth:`VarlenKernel.prepare` reads of the common metadata."""

    num_reqs: int
    block_size: int


class VllmFlashInferKernel:
    """FlashInfer's wrappers as vLLM's FlashInfer builder planned them, run as vLLM's ``FlashInferImpl``
    runs them: the decode rows (the first ``num_decode_tokens`` tokens) through the decode wrapper, the
    rest through the prefill wrapper. A replayed decode step (CUDA graphs) runs vLLM's graph decode
    wrapper of its padded size."""

    name = "flashinfer"
    ring = 1
    ring_index = 0
    cascade_steps = 0

    def __init__(self) -> None:
        self._meta: Any = None

    def prepare_vllm(self, step: VllmStep, num_reqs: int, block_size: int) -> None:
        """Take the step's ``FlashInferMetadata`` (already planned by vLLM's builder)."""
        self._meta = step.attention

    def attend(self, layer: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """``q``: (T, Hq, D); caches: (num_blocks, block_size, Hkv, D). Returns (T, Hq, D)."""
        m, kv = self._meta, (k_cache, v_cache)
        nd, np_ = m.num_decode_tokens, m.num_prefill_tokens
        if m.prefill is None and m.decode is not None and nd == q.shape[0]:
            return m.decode.wrapper.run(q, kv)  # type: ignore[no-any-return]
        out = torch.empty_like(q)
        if m.decode is not None:
            out[:nd] = m.decode.wrapper.run(q[:nd], kv)
        if m.prefill is not None:
            out[nd : nd + np_] = m.prefill.wrapper.run(q[nd : nd + np_], kv)
        return out
