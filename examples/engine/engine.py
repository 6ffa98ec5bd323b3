"""The engine loop: schedule, build the step's metadata with attnmeta, run the model, sample.

One step:

1. the scheduler picks the batch (decodes first);
2. the host hands the scheduler's arrays (computed and scheduled tokens, each group's block table) to
   the step composer (:meth:`attnmeta.compose.StepBuilder.build_counts`, one call: the step a
   :class:`attnmeta.BatchSpec` of them describes), which stages the common metadata, the kernel's builders,
   for a hybrid model the Mamba group, and the engine's own per-token arrays (input ids known on the
   host, and for each token whose id is still on the device, its row in the previous step's sampled
   tokens): **one** H2D copy per step. A step whose layout its ring slot held before (every steady
   decode step) is replayed: the composer rewrites the recorded fields instead of staging them anew;
3. the kernel plans from the host twins; the model runs; the step's greedy tokens are written into a
   device buffer and copied, non-blocking, into a pinned host ring;
4. with async scheduling the host reads step N's tokens only after it has queued step N + 1, so the
   device always has the next step queued when the host waits for the previous one's tokens; that
   wait on the copy's event is the loop's one deliberate wait, counted in ``stats.token_waits``. Without
   async scheduling the host reads each step's tokens right after queueing it.

Decode steps are padded to the next of ``cfg.decode_sizes`` (CUDA-graph sizes). With
``cfg.cuda_graphs`` (CUDA and the FlashInfer kernel) the stager runs in graph mode
(:class:`attnmeta.StaticProfile`: every field at a fixed address) and each padded decode size is
captured once as a CUDA graph of the whole forward, then replayed: a replayed step is attnmeta's one
copy, FlashInfer's ``plan()`` and ``graph.replay()``.

``cfg.uploads = "per-tensor"`` is the baseline of the benchmark: the same host derivation (attnmeta on
a CPU stager), then every device field uploaded on its own from freshly pinned memory, the pattern of
vLLM's ``async_tensor_h2d`` (eager steps only).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from attnmeta import BatchSpec, Stager, StaticProfile
from attnmeta.backends.mamba import CheckpointConfig
from attnmeta.backends.mamba.mamba2 import MAMBA2, Mamba2Metadata, Mamba2Options
from attnmeta.builder import get_builder
from attnmeta.compose import Array, ComposedStep, Group, StepBuilder
from attnmeta.metadata import CommonAttentionMetadata
from attnmeta.staging import STAGEABLE_DTYPES
from attnmeta.sync import allow_device_sync

from .hybrid import PagedBamba
from .kernels import AttentionKernel, FlashInferKernel, TorchPagedKernel
from .kv_cache import BlockPool
from .model import PagedLlama
from .scheduler import Request, Scheduler, SchedulerOutput

if TYPE_CHECKING:
    from .vllm_metadata import VllmMetadata, VllmStep


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Sizes and modes of an engine."""

    block_size: int = 16
    num_blocks: int = 256
    """KV blocks, the null block 0 included."""
    max_num_tokens: int = 256
    """Token budget of a step (chunked prefill splits longer prompts)."""
    max_num_seqs: int = 32
    max_model_len: int = 1024
    async_scheduling: bool = True
    decode_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    """Decode-only steps are padded to the next of these sizes (none larger: not padded)."""
    cuda_graphs: bool = False
    uploads: Literal["one-copy", "per-tensor"] = "one-copy"
    mamba_cache_mode: Literal["none", "align"] = "none"
    """A hybrid model's Mamba state cache: ``"none"`` (one state slot a request, no prefix caching) or
    vLLM's ``"align"`` (a state block per KV block, block-aligned prompt chunks, prefill checkpoints,
    prefix caching of the states at prompt block ends)."""
    metadata: Literal["attnmeta", "vllm"] = "attnmeta"
    """Who builds each step's metadata: attnmeta (one copy a step), or vLLM 0.33.0's runner buffers and
    metadata builders (:mod:`.vllm_metadata`: the baseline of the headline benchmark; kernels
    ``flashinfer``, ``torch-paged`` and ``torch-varlen``, one-copy uploads, the ``"none"`` Mamba cache mode)."""
    mamba_kernels: Literal["torch", "vllm"] = "torch"
    """A hybrid model's Mamba2 layers: the torch reference mixer, or vLLM 0.33.0's Triton kernels (GPU;
    the files ``tests/kernels/fetch_kernels.py`` puts into ``.kernels/``)."""
    fixed_mixed_layout: bool = True
    """An engine without CUDA graphs builds its mixed steps (prompt chunks beside running decodes, whose
    counts change from step to step; never padded) through a second step composer over a graph-mode
    stager (:attr:`Engine.mixed_composer`): there one recorded layout serves such steps of any counts
    (:meth:`attnmeta.builder.Builder.any_rows_key`), so they replay instead of composing a layout per
    count. Only where every builder of the step gives such a key (FlashInfer, Mamba2; a group of common
    metadata alone), with one-copy uploads and attnmeta's metadata. Decode steps, padded or not, keep the
    ring stager's exact layouts, the cheaper replay for them. False: one composer for every step."""
    inference_mode: bool = True
    """Run the loop (:meth:`Engine.run`, :meth:`Engine.capture_graphs`) inside ``torch.inference_mode()``, as
    vLLM's ``GPUModelRunner.execute_model`` and its graph capture run; False runs it with autograd's
    dispatch (``bench_engine.py``'s ``+grad`` modes: what that costs each metadata mode)."""

    @property
    def max_blocks_per_req(self) -> int:
        return -(-self.max_model_len // self.block_size)


@dataclasses.dataclass
class EngineStats:
    """Counters of a run; times in seconds."""

    steps: int = 0
    decode_steps: int = 0
    padded_steps: int = 0
    graph_steps: int = 0
    tokens: int = 0
    sampled: int = 0
    partial_prefills: int = 0
    """Rows whose chunk stopped short of the prompt's end (chunked prefill)."""
    preemptions: int = 0
    prefix_cache_hits: int = 0
    mamba_cache_hits: int = 0
    """Hybrid models in align mode: Mamba states taken from the prefix cache (one per hit)."""
    mamba_checkpoints: int = 0
    """Align mode: prefill checkpoints written (a state at a block end inside a prompt chunk)."""
    mamba_state_copies: int = 0
    """Align mode: rows whose running state moved to the block of their last token before a step."""
    """Blocks reused from the prefix cache."""
    cascade_steps: int = 0
    metadata_copies: int = 0
    """attnmeta's H2D copies (the stager's), or the per-tensor uploads in the baseline."""
    token_waits: int = 0
    """Times the host had to wait for a step's sampled-token copy."""
    metadata_s: float = 0.0
    """Host time in attnmeta: the step composer's call on the scheduler's arrays
    (:meth:`~attnmeta.compose.StepBuilder.build_counts`: common metadata, the kernel's builders, the
    Mamba group, the engine's two arrays, the commit, the results; in the per-tensor baseline, its
    uploads too). The engine's own preparation of the call's arguments (the scheduler, the block table
    rows and their views, the kernel's inputs) is not in it, as the vllm mode's ``set_batch`` is not in
    vLLM's."""
    plan_s: float = 0.0
    """Host time in the kernel's per-step preparation (FlashInfer's ``plan()``)."""
    step_times: list[float] = dataclasses.field(default_factory=list)
    """Per step: one iteration of the loop (schedule, build, plan, launch, and read the previous
    step's tokens)."""
    step_kinds: list[str] = dataclasses.field(default_factory=list)
    """Per step: ``"decode"`` (every row one token) or ``"mixed"``."""
    step_metadata: list[float] = dataclasses.field(default_factory=list)
    """Per step: attnmeta's host time (as ``metadata_s``)."""
    step_slots: list[int] = dataclasses.field(default_factory=list)
    """Per step: the stager's ring slot (a slot's first step of a new layout builds that layout)."""
    step_replayed: list[bool] = dataclasses.field(default_factory=list)
    """Per step: whether the composer replayed the slot's recorded layout."""
    step_fence: list[float] = dataclasses.field(default_factory=list)
    """Per step: the part of ``step_metadata`` the stager spent waiting for its ring slot's last copy
    (0 unless the host runs ``num_slots - 1`` steps ahead of the GPU)."""
    step_launch: list[float] = dataclasses.field(default_factory=list)
    """Per step: host time from the end of the kernel's preparation to the step's last launch (the
    step's bookkeeping, the model's forward or its graph's replay, and the sampled tokens' copy): the
    host's launch work, or, when the GPU bounds the loop, the GPU's time too (``step_gpu_behind``)."""
    step_wait: list[float] = dataclasses.field(default_factory=list)
    """Per step (as ``step_times``): time the loop's iteration spent blocked on the GPU, waiting for a
    step's sampled tokens."""
    step_gpu_behind: list[bool] = dataclasses.field(default_factory=list)
    """Per step: whether the GPU was still running the previous step when this step's launches began
    (a non-blocking query of its event). A loop bound by the host finds the GPU done each time; one bound
    by the GPU finds it behind, and its host then blocks inside the launches (CUDA's launch queue is
    full), not in ``step_wait``: ``step_launch`` holds the GPU's time too."""


class Engine:
    """Serves :class:`Request` s with a Hugging Face Llama model over a paged KV cache.

    Parameters
    ----------
    model : transformers.LlamaForCausalLM or transformers.BambaForCausalLM
        Weights and dtype; on the device the engine runs on. A Bamba (hybrid) model adds the Mamba
        state group (:mod:`.hybrid`): eager steps, one-copy uploads, prefix caching only in the
        ``"align"`` Mamba cache mode (``EngineConfig.mamba_cache_mode``).
    kernel : AttentionKernel
        Attention (see :mod:`.kernels`).
    cfg : EngineConfig
        Sizes and modes.
    """

    def __init__(self, model: Any, kernel: AttentionKernel, cfg: EngineConfig) -> None:
        self.cfg = cfg
        # a hybrid model (Bamba: attention and Mamba2 layers) has a second KV-cache group, read through
        # attnmeta's mamba2 metadata: a state slot a request, or in align mode a state block per KV block
        self.hybrid = getattr(model.config, "model_type", "") == "bamba"
        if cfg.mamba_cache_mode not in ("none", "align"):
            raise ValueError(f"Engine: mamba_cache_mode is 'none' or 'align', not {cfg.mamba_cache_mode!r}")
        self.align = self.hybrid and cfg.mamba_cache_mode == "align"
        slots = (cfg.num_blocks if self.align else cfg.max_num_seqs + 1) if self.hybrid else 0
        if self.hybrid and cfg.uploads != "one-copy":
            raise ValueError("Engine: a hybrid model runs with uploads='one-copy' only")
        if cfg.mamba_kernels not in ("torch", "vllm"):
            raise ValueError(f"Engine: mamba_kernels is 'torch' or 'vllm', not {cfg.mamba_kernels!r}")
        ops = None
        if self.hybrid and cfg.mamba_kernels == "vllm":
            from .vllm_mamba import load_ops

            ops = load_ops()
        self.model: PagedLlama | PagedBamba = (PagedBamba(model, cfg.num_blocks, cfg.block_size, slots, ops)
                                               if self.hybrid else PagedLlama(model, cfg.num_blocks, cfg.block_size))
        chunk = int(getattr(model.config, "mamba_chunk_size", 256))
        bs = cfg.block_size
        self.mamba_options = (Mamba2Options(chunk_size=chunk, cache_mode="align", mamba_block_size=bs,
                                            checkpoint=CheckpointConfig(hash_block_size=bs, cache_hit_alignment_tokens=bs,
                                                                        mamba_block_size=bs, checkpoint_alignment=1))
                              if self.align else Mamba2Options(chunk_size=chunk))
        self.state_table = np.zeros((cfg.max_num_seqs, cfg.max_blocks_per_req if self.align else 1), np.int32)
        self._mamba: Mamba2Metadata | None = None
        self.device = self.model.device
        self.kernel: Any = kernel
        """An :class:`AttentionKernel`; in the vllm metadata mode, a kernel over vLLM's metadata
        (:mod:`.vllm_metadata`)."""
        self.pool = BlockPool(cfg.num_blocks, cfg.block_size)
        self.mamba_pool = BlockPool(cfg.num_blocks, cfg.block_size) if self.align else None
        self.scheduler = Scheduler(self.pool, cfg.max_num_tokens, cfg.max_num_seqs, cfg.max_blocks_per_req,
                                   num_state_slots=0 if self.align else slots,
                                   prefix_caching=not self.hybrid or self.align, mamba_pool=self.mamba_pool)
        cuda = self.device.type == "cuda"
        self.graphs = (cfg.cuda_graphs and cuda and kernel.name == "flashinfer" and cfg.uploads == "one-copy"
                       and not self.hybrid)
        self.vllm: VllmMetadata | None = None
        if cfg.metadata == "vllm":
            self.vllm, self.kernel = self._vllm_mode(model, kernel)
        elif cfg.metadata != "attnmeta":
            raise ValueError(f"Engine: metadata is 'attnmeta' or 'vllm', not {cfg.metadata!r}")
        self.profile = StaticProfile(max_num_reqs=cfg.max_num_seqs, max_num_tokens=cfg.max_num_tokens,
                                     max_blocks_per_req=cfg.max_blocks_per_req, block_size=cfg.block_size,
                                     chunk_size=self.mamba_options.chunk_size)
        stage_device = "cpu" if cfg.uploads == "per-tensor" else self.device
        self.stager = Stager(stage_device, num_slots=3, num_kv_blocks=cfg.num_blocks,
                             profile=self.profile if self.graphs else None)
        if isinstance(kernel, FlashInferKernel):
            kernel.max_pages = self.profile.max_num_pages
        cap = cfg.max_num_tokens if self.graphs else None
        groups = [Group(kernel.builders())]
        if self.hybrid:  # one state block (none mode: the state slot) a request, its own table
            groups.append(Group({"mamba": (MAMBA2, self.mamba_options)}, prefix="mamba_common", table_column_step=1))
        self.composer = StepBuilder(self.stager, *groups, arrays=_engine_arrays(cap))
        self.mixed_composer: StepBuilder | None = None
        """With :attr:`EngineConfig.fixed_mixed_layout` (where it applies): the mixed steps' composer,
        over a stager in graph mode (the engine's :class:`~attnmeta.StaticProfile`, no CUDA graph), whose
        one layout serves those steps of any counts; None: :attr:`composer` builds every step."""
        if (cfg.fixed_mixed_layout and not self.graphs and cfg.uploads == "one-copy" and cfg.metadata == "attnmeta"
                and all(_replays_any_counts(g) for g in groups)):
            fixed = Stager(self.device, num_slots=3, num_kv_blocks=cfg.num_blocks, profile=self.profile)
            self.mixed_composer = StepBuilder(fixed, *groups, arrays=_engine_arrays(cfg.max_num_tokens))
        self.table = np.zeros((cfg.max_num_seqs, cfg.max_blocks_per_req), np.int32)
        self.sampled = torch.zeros(cfg.max_num_seqs, dtype=torch.int64, device=self.device)
        host = torch.zeros((2, cfg.max_num_seqs), dtype=torch.int64, pin_memory=cuda)
        self._host_tokens, self._host_tokens_np = host, host.numpy()
        self._events = [torch.cuda.Event() if cuda else None for _ in range(2)]  # type: ignore[no-untyped-call]
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._captured = False
        self._waited = 0.0  # (the loop's current iteration: seconds blocked on the GPU for sampled tokens)
        self.stats = EngineStats()
        self.trace: list[tuple[tuple[BatchSpec, ...], dict[str, Any], dict[str, np.ndarray]]] | None = None
        """None, or a list to which every step appends what it gave the composer (its specs, with their
        own copies of the block tables, the kernel's inputs and the arrays): a benchmark replays them."""

    def _vllm_mode(self, model: Any, kernel: AttentionKernel) -> tuple[VllmMetadata, Any]:
        """vLLM's runner buffers and builders for this engine, and the kernel that reads their metadata."""
        from .kernels import VarlenKernel
        from .vllm_metadata import (
            KERNELS,
            VllmFlashInferKernel,
            VllmMetadata,
            VllmPagedKernel,
            VllmVarlenKernel,
        )

        cfg = self.cfg
        if cfg.uploads != "one-copy":
            raise ValueError("Engine: the vllm metadata mode makes vLLM's own copies (uploads='one-copy')")
        if self.align:
            raise ValueError("Engine: the vllm metadata mode runs the 'none' Mamba cache mode")
        if kernel.name not in KERNELS:
            raise ValueError(f"Engine: the vllm metadata mode runs kernels {', '.join(KERNELS)}, not {kernel.name!r}")
        meta = VllmMetadata(model.config, kernel.name, self.device, next(model.parameters()).dtype,
                            block_size=cfg.block_size, max_num_seqs=cfg.max_num_seqs,
                            max_num_tokens=cfg.max_num_tokens, max_model_len=cfg.max_model_len,
                            decode_sizes=cfg.decode_sizes, graphs=self.graphs, hybrid=self.hybrid)
        if kernel.name == "flashinfer":
            return meta, VllmFlashInferKernel()
        if isinstance(kernel, VarlenKernel):
            return meta, VllmVarlenKernel(kernel.num_heads, kernel.num_kv_heads, kernel.head_dim)
        assert isinstance(kernel, TorchPagedKernel)
        return meta, VllmPagedKernel(kernel.num_heads, kernel.num_kv_heads, kernel.head_dim)

    # ------------------------------------------------------------------ the loop
    def run(self, requests: Iterable[Request]) -> EngineStats:
        """Serve ``requests`` to completion (each is admitted at or after its ``arrival`` step).

        Inside ``torch.inference_mode()`` (:attr:`EngineConfig.inference_mode`), as vLLM's
        ``GPUModelRunner.execute_model`` builds and runs its steps: both metadata modes' torch work skips
        autograd's bookkeeping."""
        with torch.inference_mode(self.cfg.inference_mode):
            return self._run(requests)

    def _run(self, requests: Iterable[Request]) -> EngineStats:
        if self.graphs and not self._captured:
            self.capture_graphs()
        for r in requests:
            self.scheduler.add(r)
        prev: SchedulerOutput | None = None
        while self.scheduler.has_work or prev is not None:
            t0 = time.perf_counter()
            self._waited = 0.0
            out = self.scheduler.schedule() if self.scheduler.has_work else None
            ran = out is not None and bool(out.rows)
            if out is not None and out.rows:
                self._step(out)
                if not self.cfg.async_scheduling:
                    self._receive(out)
                    out = None
            else:
                out = None
            if prev is not None:
                self._receive(prev)
            prev = out
            if ran:  # one entry per step, as step_kinds and step_metadata
                self.stats.step_times.append(time.perf_counter() - t0)
                self.stats.step_wait.append(self._waited)
        st = self.stats
        st.preemptions, st.prefix_cache_hits = self.scheduler.preemptions, self.pool.hits
        st.mamba_cache_hits = self.mamba_pool.hits if self.mamba_pool is not None else 0
        st.cascade_steps = getattr(self.kernel, "cascade_steps", 0)
        return st

    def _receive(self, out: SchedulerOutput) -> None:
        slot = out.step % 2
        ev = self._events[slot]
        if ev is not None and not ev.query():  # type: ignore[no-untyped-call]
            self.stats.token_waits += 1
            t0 = time.perf_counter()
            with allow_device_sync():
                ev.synchronize()
            self._waited += time.perf_counter() - t0
        self.scheduler.receive(out, self._host_tokens_np[slot])

    # ------------------------------------------------------------------ one step
    def _step(self, out: SchedulerOutput) -> None:
        cfg, st = self.cfg, self.stats
        rows = out.rows
        n = len(rows)
        decode = all(r.num_new == 1 for r in rows)
        padded = next((s for s in cfg.decode_sizes if s >= n), None) if decode else None
        num_tokens = out.num_tokens
        total = padded if padded is not None else num_tokens
        ids = np.zeros(total, np.int32)
        prev_rows = np.full(total, -1, np.int32)
        t = 0
        for i, row in enumerate(rows):
            req = row.req
            self.table[i, : len(req.blocks)] = req.blocks
            stop = row.start + row.num_new
            known = min(stop, len(req.tokens))
            ids[t : t + known - row.start] = req.tokens[row.start : known]
            if known < stop:  # the newest token is still on the device: last step's sampled row
                pin = row.pending_in
                assert pin is not None and pin[0] == out.step - 1 and known + 1 == stop
                prev_rows[t + row.num_new - 1] = pin[1]
            t += row.num_new
        computed = np.array([r.start for r in rows], np.int32)
        scheduled = np.array([r.num_new for r in rows], np.int32)
        if self.hybrid:
            if self.align:
                for i, row in enumerate(rows):
                    self.state_table[i, : len(row.req.mamba_blocks)] = row.req.mamba_blocks
            else:
                self.state_table[:n, 0] = [r.req.state_slot for r in rows]
        if self.vllm is not None:
            self._step_vllm(out, computed, scheduled, ids, prev_rows, padded)
            return
        composer = self.composer if decode or self.mixed_composer is None else self.mixed_composer
        replays = composer.stats.replayed  # (bookkeeping: read before the timed part)
        tables = [(self.table[:n], cfg.block_size)]
        if self.hybrid:  # the Mamba group: the same step, its own table (none mode: one state slot a request)
            tables.append((self.state_table[:n], cfg.block_size if self.align else cfg.max_model_len))
        inputs = self.kernel.inputs(0 if self.graphs else out.num_common_prefix_blocks)
        arrays = {"engine.input_ids": ids, "engine.prev_rows": prev_rows}
        # attnmeta's part of the step starts here, its arguments ready (as the vllm mode's starts after
        # set_batch): the composer's call, and in the per-tensor baseline its uploads
        t_md = time.perf_counter()
        built = composer.build_counts(computed, scheduled, tables, num_reqs_padded=padded, num_tokens_padded=padded,
                                      inputs=inputs, arrays=arrays)
        cm, step = built.common, built.step
        if self.hybrid:
            self._mamba = built["mamba"]
        if cfg.uploads == "per-tensor":
            cm, dev_ids, dev_prev = self._per_tensor(cm, ids, prev_rows)
        else:
            dev_ids, dev_prev = built.arrays["engine.input_ids"], built.arrays["engine.prev_rows"]
        t_plan = time.perf_counter()
        graph = self.graphs and padded is not None
        if isinstance(self.kernel, FlashInferKernel):
            self.kernel.prepare(cm, built.metadata, graph_batch=padded if graph else None)
        else:
            self.kernel.prepare(cm, built.metadata)
        t_run = time.perf_counter()
        st.step_gpu_behind.append(self._gpu_behind(out.step))
        if cfg.uploads != "per-tensor":  # (the step's statistics: bookkeeping, after the timed parts, as in _step_vllm)
            st.metadata_copies += step.stats.copies
        st.metadata_s += t_plan - t_md
        st.plan_s += t_run - t_plan
        st.step_metadata.append(t_plan - t_md)
        st.step_kinds.append("decode" if decode else "mixed")
        st.step_slots.append(step.stats.slot)
        st.step_replayed.append(composer.stats.replayed > replays)
        st.step_fence.append(step.stats.wait_seconds)
        if self.trace is not None:  # (the specs build_counts stood for, with tables of their own)
            spec = BatchSpec(num_computed_tokens=computed, num_scheduled_tokens=scheduled, block_table=tables[0][0].copy(),
                             block_size=tables[0][1], num_reqs_padded=padded, num_tokens_padded=padded)
            self.trace.append(((spec, *(spec.for_group(block_table=t.copy(), block_size=bs) for t, bs in tables[1:])),
                               inputs, arrays))
        st.steps += 1
        st.decode_steps += decode
        st.padded_steps += padded is not None and padded > n
        st.tokens += num_tokens
        st.sampled += sum(r.samples for r in rows)
        st.partial_prefills += sum(not r.samples for r in rows)
        rows_total = padded if padded is not None else n
        if isinstance(self.model, PagedBamba):
            self._prepare_states(rows)
        if graph:
            assert padded is not None
            st.graph_steps += 1
            self._replay(self._graph_args(step, padded), padded)
        else:
            self._forward(dev_ids, dev_prev, cm.positions, cm.slot_mapping, cm.query_start_loc[1 : rows_total + 1])
        self._send_tokens(out.step, rows_total)
        st.step_launch.append(time.perf_counter() - t_run)

    def _gpu_behind(self, step: int) -> bool:
        """Whether the GPU is still running step ``step - 1`` (its sampled tokens' event not yet done: a
        non-blocking query) as step ``step``'s launches begin."""
        ev = self._events[(step - 1) % 2]
        return step > 0 and ev is not None and not ev.query()  # type: ignore[no-untyped-call]

    def _send_tokens(self, step: int, rows: int) -> None:
        """Copy the step's sampled tokens into the pinned host ring (non-blocking) and record its event."""
        slot = step % 2
        self._host_tokens[slot, :rows].copy_(self.sampled[:rows], non_blocking=True)
        ev = self._events[slot]
        if ev is not None:
            ev.record()

    def _step_vllm(self, out: SchedulerOutput, computed: np.ndarray, scheduled: np.ndarray, ids: np.ndarray,
                   prev_rows: np.ndarray, padded: int | None) -> None:
        """The step with vLLM's runner buffers and metadata builders (``cfg.metadata == "vllm"``)."""
        cfg, st, rows = self.cfg, self.stats, out.rows
        assert self.vllm is not None
        n = len(rows)
        prompts = np.array([len(r.req.prompt) for r in rows], np.int32)
        self.vllm.set_batch(computed, prompts, self.table[:n], self.state_table[:n] if self.hybrid else None)
        t_md = time.perf_counter()  # vLLM's part of the step starts here: the runner's and builders' work
        vs = self.vllm.build(scheduled, ids, prev_rows, padded=padded)
        t_plan = time.perf_counter()  # the kernel's own preparation is plan time, as in the attnmeta mode
        self.kernel.prepare_vllm(vs, n, cfg.block_size)
        t_run = time.perf_counter()
        st.step_gpu_behind.append(self._gpu_behind(out.step))
        st.metadata_s += t_plan - t_md - vs.plan_seconds
        st.plan_s += vs.plan_seconds + t_run - t_plan
        st.metadata_copies += vs.copies
        st.step_metadata.append(t_plan - t_md - vs.plan_seconds)
        decode = padded is not None or all(r.num_new == 1 for r in rows)
        st.step_kinds.append("decode" if decode else "mixed")
        st.step_slots.append(0)
        st.step_replayed.append(False)
        st.step_fence.append(0.0)
        st.steps += 1
        st.decode_steps += decode
        st.padded_steps += padded is not None and padded > n
        st.tokens += out.num_tokens
        st.sampled += sum(r.samples for r in rows)
        st.partial_prefills += sum(not r.samples for r in rows)
        self._mamba = vs.mamba
        if self.hybrid:
            self._prepare_states(rows)
        total = padded if padded is not None else out.num_tokens
        rows_total = padded if padded is not None else n
        if self.graphs and padded is not None:
            st.graph_steps += 1
            self._replay(self._vllm_graph_args(vs, padded), padded)
        else:
            self._forward(vs.input_ids[:total], vs.prev_rows[:total], vs.positions[:total],
                          vs.slot_mapping[:total], vs.query_start_loc[1 : rows_total + 1])
        self._send_tokens(out.step, rows_total)
        st.step_launch.append(time.perf_counter() - t_run)

    @staticmethod
    def _vllm_graph_args(vs: VllmStep, size: int) -> tuple[torch.Tensor, ...]:
        """A graph's inputs in vLLM's runner buffers (fixed addresses)."""
        return (vs.input_ids[:size], vs.prev_rows[:size], vs.positions[:size], vs.slot_mapping[:size],
                vs.query_start_loc[1 : size + 1])

    def _prepare_states(self, rows: list[Any]) -> None:
        """Before a hybrid step's forward: zero the states of rows that start from their first token
        (a one-token prompt takes the decode path, which has no initial-state flag); in align mode,
        move each row's running state to the block of its last token when that block is a new one
        (vLLM's align-mode state copy), and name the step's prefill checkpoints in the prefix cache."""
        assert isinstance(self.model, PagedBamba)
        if not self.align:
            self.model.reset_slots([r.req.state_slot for r in rows if r.start == 0])
            return
        bs, fresh, moves = self.cfg.block_size, [], []
        for r in rows:
            blocks = r.req.mamba_blocks
            dst = blocks[(r.start + r.num_new - 1) // bs]
            if r.start == 0:
                fresh.append(dst)
            elif blocks[(r.start - 1) // bs] != dst:
                moves.append((blocks[(r.start - 1) // bs], dst))
        self.model.reset_slots(fresh)
        self.model.copy_slots(moves)
        self.stats.mamba_state_copies += len(moves)
        meta = self._mamba
        ck = meta.checkpoint_meta if meta is not None else None
        if ck is not None:  # prefill row i is the step's row first_row + i
            for i in np.flatnonzero(ck.offsets_cpu):
                self.stats.mamba_checkpoints += 1
                self.scheduler.cache_mamba_state(rows[ck.first_row + int(i)].req, int(ck.cols_cpu[i]))

    def _forward(self, ids: torch.Tensor, prev_rows: torch.Tensor, positions: torch.Tensor,
                 slot_mapping: torch.Tensor, query_ends: torch.Tensor) -> None:
        """The model over one step's device arrays; the greedy tokens land in ``self.sampled``."""
        input_ids = torch.where(prev_rows >= 0, self.sampled[prev_rows.clamp(min=0).long()], ids.long())
        logits_index = (query_ends.long() - 1).clamp(min=0)
        if isinstance(self.model, PagedBamba):
            assert self._mamba is not None
            logits = self.model.forward(input_ids, positions, slot_mapping, logits_index, self.kernel, self._mamba)
        else:
            logits = self.model.forward(input_ids, positions, slot_mapping, logits_index, self.kernel)
        self.sampled[: logits.shape[0]] = logits.argmax(-1)

    def capture_graphs(self) -> None:
        """Capture every decode size's graph, once per FlashInfer wrapper set, on dummy steps (null-block
        rows), as an engine does at start-up: no capture (and its device synchronisation) in the loop.
        Inside ``torch.inference_mode()`` where :meth:`run` is (and vLLM's capture runs there)."""
        with torch.inference_mode(self.cfg.inference_mode):
            self._capture_graphs()

    def _capture_graphs(self) -> None:
        assert self.kernel.name == "flashinfer"
        self._captured = True
        cfg = self.cfg
        width = cfg.max_blocks_per_req
        def dummy(sizes: list[int], padded: int | None) -> ComposedStep:
            n = len(sizes)
            spec = BatchSpec(num_computed_tokens=np.zeros(n, np.int32), num_scheduled_tokens=np.array(sizes, np.int32),
                             block_table=np.zeros((n, width), np.int32), block_size=cfg.block_size,
                             num_reqs_padded=padded, num_tokens_padded=padded)
            total = padded or sum(sizes)
            return self.composer.build(spec, self.kernel.inputs(0), {"engine.input_ids": np.zeros(total, np.int32),
                                                                      "engine.prev_rows": np.full(total, -1, np.int32)})

        if self.vllm is not None:  # vLLM's builder plans its graph decode wrapper of each size
            for size in (s for s in cfg.decode_sizes if s <= cfg.max_num_seqs):
                one = np.zeros(1, np.int32)
                self.vllm.set_batch(one, one + 1, np.zeros((1, width), np.int32))
                vs = self.vllm.build(one + 1, np.zeros(size, np.int32), np.full(size, -1, np.int32), padded=size)
                self.kernel.prepare_vllm(vs, 1, cfg.block_size)
                self._replay(self._vllm_graph_args(vs, size), size)
            return
        built = dummy([2], None)  # a prefill step first: it lays out every field before freeze()
        self.kernel.prepare(built.common, built.metadata)
        # the graph wrappers read the page table where the step's one copy puts it (fixed addresses), so
        # their plans copy none of it
        assert isinstance(self.kernel, FlashInferKernel)
        self.kernel.use_graph_buffers(*(built.step.device_full(f"common.{n}") for n in
                                        ("paged_kv_indptr", "paged_kv_last_page_len", "paged_kv_indices")))
        for size in (s for s in cfg.decode_sizes if s <= cfg.max_num_seqs):
            for _ in range(self.kernel.ring):
                built = dummy([1], size)
                self.kernel.prepare(built.common, built.metadata, graph_batch=size)
                self._replay(self._graph_args(built.step, size), size)

    @staticmethod
    def _graph_args(step: Any, size: int) -> tuple[torch.Tensor, ...]:
        """A graph's inputs in the stager's fixed-address fields (graph mode)."""
        return (step.device_full("engine.input_ids")[:size], step.device_full("engine.prev_rows")[:size],
                step.device_full("common.positions")[:size], step.device_full("common.slot_mapping")[:size],
                step.device_full("common.query_start_loc")[1 : size + 1])

    def _replay(self, args: tuple[torch.Tensor, ...], size: int) -> None:
        """Replay the decode graph of ``size`` rows (captured on first use) over ``args``, the forward's inputs
        at fixed addresses."""
        key = (size, self.kernel.ring_index)  # type: ignore[attr-defined]  # one graph per size and wrapper set
        graph = self._graphs.get(key)
        if graph is None:
            if not self._graphs and self.vllm is None:
                self.stager.freeze()  # every field is laid out: nothing may move under a graph
            # Warm up (torch wants the captured code run once first): that runs this step for real, so
            # put back the previous step's tokens it overwrote; the replay below then repeats it exactly.
            prev_tokens = self.sampled.clone()
            stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._forward(*args)
            torch.cuda.current_stream().wait_stream(stream)
            self.sampled.copy_(prev_tokens)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self._forward(*args)
            self._graphs[key] = graph
        graph.replay()

    def _per_tensor(self, cm: CommonAttentionMetadata, ids: np.ndarray,
                    prev_rows: np.ndarray) -> tuple[CommonAttentionMetadata, torch.Tensor, torch.Tensor]:
        """The baseline: every device field uploaded on its own from freshly pinned memory."""
        uploaded: dict[tuple[int, tuple[int, ...]], tuple[torch.Tensor, np.ndarray]] = {}

        def up2(a: np.ndarray) -> tuple[torch.Tensor, np.ndarray]:  # one upload per distinct host array
            key = (a.__array_interface__["data"][0], a.shape)
            if key not in uploaded:
                self.stats.metadata_copies += 1
                host = torch.empty(a.shape, dtype=STAGEABLE_DTYPES[a.dtype], pin_memory=self.device.type == "cuda")
                host.numpy()[...] = a  # freshly pinned memory per field, as vLLM's async_tensor_h2d
                uploaded[key] = (host.to(self.device, non_blocking=True), host.numpy())
            return uploaded[key]

        def up(a: np.ndarray) -> torch.Tensor:
            return up2(a)[0]

        def move(meta: Any) -> Any:
            changes: dict[str, Any] = {}
            fields = {f.name for f in dataclasses.fields(meta)}
            twins = dict(meta._TWINS)
            for dev in meta._DEVICE_FIELDS:
                if dev not in fields or getattr(meta, dev) is None:  # (a view of a nested object's field)
                    continue
                host = twins.get(dev)
                h = getattr(meta, host) if host is not None else None
                # the device field, and its host twin in the pinned copy (plan() reads it); a field
                # without a twin (FlashInfer's page indices) is uploaded from the CPU stager's bytes
                changes[dev], pinned = up2(h if h is not None else getattr(meta, dev).numpy())
                if host is not None and h is not None:
                    changes[host] = pinned
            for name in ("common", "paged"):
                if getattr(meta, name, None) is not None:
                    changes[name] = move(getattr(meta, name))
            return dataclasses.replace(meta, **changes)

        self.kernel.transform = move
        return move(cm), up(ids), up(prev_rows)


def _engine_arrays(capacity: int | None) -> list[Array]:
    """The engine's own staged arrays: the step's token ids, and each token's row in the previous step's
    sampled tokens (-1: its id is in ``input_ids``); ``capacity`` in graph mode."""
    return [Array("engine.input_ids", np.int32, capacity=capacity),
            Array("engine.prev_rows", np.int32, capacity=capacity, fill=-1)]


def _replays_any_counts(group: Group) -> bool:
    """Whether a graph-mode step composer records one layout of ``group`` for its unpadded steps of any
    counts: every builder gives :meth:`attnmeta.builder.Builder.any_rows_key` (a group of common
    metadata alone does)."""
    builders = [e[0] if isinstance(e, tuple) else e for e in group.builders.values()]
    return all((get_builder(b) if isinstance(b, str) else b).gives_any_rows_key for b in builders)


def make_kernel(name: str, model: Any, device: torch.device, *, cascade: bool = True,
                plans: str = "auto") -> AttentionKernel:
    """A kernel by name: ``torch-paged``, ``torch-varlen`` or ``flashinfer``, with cascade attention
    where the kernel has it and ``cascade`` is set; ``plans``: the FlashInfer kernel's
    (:data:`~examples.engine.kernels.PLANS`)."""
    from attnmeta.backends.cascade import CascadeOptions

    from .kernels import VarlenKernel

    cfg = model.config
    h, hk = int(cfg.num_attention_heads), int(cfg.num_key_value_heads)
    d = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // h)
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    copts = CascadeOptions(num_query_heads=h, num_kv_heads=hk, num_sms=sms) if cascade else None
    if name == "torch-paged":
        return TorchPagedKernel(h, hk, d, copts)
    if name == "torch-varlen":
        return VarlenKernel(h, hk, d)
    if name == "flashinfer":
        return FlashInferKernel(h, hk, d, next(model.parameters()).dtype, device, copts, plans=plans)
    raise ValueError(f"unknown kernel {name!r}: torch-paged, torch-varlen or flashinfer")

