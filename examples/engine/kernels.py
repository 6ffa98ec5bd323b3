"""Attention kernels the engine can plug in, each fed by attnmeta's metadata of the step.

A kernel names the registered builders it reads (:meth:`AttentionKernel.builders`: the engine's step
composer, :class:`attnmeta.compose.StepBuilder`, stages them over the attention group's common metadata,
so their arrays ride the step's one copy), prepares once per step after the commit from their metadata
(plans, gather indices), then attends layer by layer:

- :class:`TorchPagedKernel`: paged attention written in torch, request by request, reading K/V only
  through the common metadata's ``block_table_tensor`` and ``seq_lens``; with cascade attention it runs
  the shared prefix once for every query and each request's suffix, merged by log-sum-exp. It runs
  anywhere (the CPU engine's kernel) and is the reference the others are checked against.
- :class:`VarlenKernel` (CUDA): FlashAttention's metadata through torch's ``varlen_attn``, with each
  request's K/V gathered contiguous on the device through the block table.
- :class:`FlashInferKernel` (CUDA): FlashInfer's paged decode and prefill wrappers (and its two-level
  cascade wrapper when the step cascades), planned from attnmeta's pinned host arrays; decode steps
  can be captured in CUDA graphs (:meth:`FlashInferKernel.graph_wrapper`).

No kernel reads device data on the host: the host facts come from the metadata's host twins.
"""

from __future__ import annotations

import importlib.util
import inspect
import re
import sys
from collections.abc import Callable
from typing import Any, Protocol

import torch

from attnmeta.backends.cascade import CASCADE, CascadeInputs, CascadeOptions
from attnmeta.backends.flash_attn import FLASH_ATTN
from attnmeta.backends.flashinfer import FLASHINFER, host_tensor
from attnmeta.metadata import CommonAttentionMetadata
from attnmeta.sync import allow_device_sync


class AttentionKernel(Protocol):
    """What the engine asks of an attention kernel."""

    name: str
    transform: Callable[[Any], Any]
    """Applied to every metadata object the kernel takes from the step (the per-tensor baseline
    swaps its device fields); the identity otherwise."""

    def builders(self) -> dict[str, Any]:
        """The registered builders this kernel reads, by name (a builder, or ``(builder, options)``): one
        :class:`attnmeta.compose.Group` over the attention group's common metadata."""

    def inputs(self, num_common_prefix_blocks: int) -> dict[str, Any]:
        """This step's inputs of those builders, by name."""

    def prepare(self, cm: CommonAttentionMetadata, metadata: dict[str, Any]) -> None:
        """After the commit: plan the step from its common metadata and the builders' metadata."""

    def attend(self, layer: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """``q``: (T, Hq, D); caches: (num_blocks, block_size, Hkv, D). Returns (T, Hq, D); rows of
        padding tokens are unspecified."""


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
              scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense attention with grouped KV heads, in float32: ``q`` (n, Hq, D), ``k``/``v`` (m, Hkv, D),
    ``mask`` (n, m) bool (True = attend) or None. Returns the output (n, Hq, D) in ``q``'s dtype and
    the log-sum-exp (n, Hq) in float32."""
    n, hq, d = q.shape
    hk = k.shape[1]
    qg = q.float().view(n, hk, hq // hk, d)
    s = torch.einsum("nkgd,mkd->kgnm", qg, k.float()) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    o = torch.einsum("kgnm,mkd->nkgd", torch.exp(s - lse[..., None]), v.float())
    return o.reshape(n, hq, d).to(q.dtype), lse.permute(2, 0, 1).reshape(n, hq)


def merge(o1: torch.Tensor, l1: torch.Tensor, o2: torch.Tensor, l2: torch.Tensor) -> torch.Tensor:
    """Merge two partial attentions over disjoint key sets by their log-sum-exps."""
    lse = torch.logaddexp(l1, l2)
    return (o1.float() * torch.exp(l1 - lse)[..., None] + o2.float() * torch.exp(l2 - lse)[..., None]).to(o1.dtype)


def _causal_end_aligned(n: int, m: int, device: torch.device) -> torch.Tensor:
    """Query ``i`` of ``n`` new tokens at the end of ``m`` keys sees keys ``[0, m - n + i]``."""
    return torch.arange(m, device=device)[None, :] <= (m - n + torch.arange(n, device=device))[:, None]


def _same(meta: Any) -> Any:
    return meta


def _slots(blocks: torch.Tensor, block_size: int, length: int) -> torch.Tensor:
    """Flat KV slots of the first ``length`` tokens held by ``blocks`` (device, int64)."""
    offs = torch.arange(block_size, device=blocks.device)
    return (blocks.long()[:, None] * block_size + offs).flatten()[:length]


class TorchPagedKernel:
    """Paged attention in torch (any device), with cascade attention when the step shares a prefix.

    Parameters
    ----------
    num_heads, num_kv_heads, head_dim : int
        The model's attention shape.
    cascade_options : CascadeOptions, optional
        Enables cascade attention (the builder decides per step: at least 256 shared tokens and 8
        requests, no padding rows).
    """

    name = "torch-paged"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int,
                 cascade_options: CascadeOptions | None = None) -> None:
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5
        self.cascade_options = cascade_options
        self.transform: Callable[[Any], Any] = _same
        self.cascade_steps = 0
        self._rows: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []
        self._prefix: torch.Tensor | None = None

    def builders(self) -> dict[str, Any]:
        return {"cascade": (CASCADE, self.cascade_options)} if self.cascade_options is not None else {}

    def inputs(self, num_common_prefix_blocks: int) -> dict[str, Any]:
        if self.cascade_options is None:
            return {}
        return {"cascade": CascadeInputs(num_common_prefix_blocks=num_common_prefix_blocks)}

    def prepare(self, cm: CommonAttentionMetadata, metadata: dict[str, Any]) -> None:
        bs, dev = cm.block_size, cm.block_table_tensor.device
        qsl, seq = cm.query_start_loc_cpu, cm.seq_lens_cpu
        ca = self.transform(metadata["cascade"]) if "cascade" in metadata else None
        self._prefix = None
        table, lens = cm.block_table_tensor, seq
        if ca is not None and ca.use_cascade:
            self.cascade_steps += 1
            assert ca.shared_kv_page_indices is not None and ca.suffix_block_table is not None
            assert ca.suffix_kv_lens_cpu is not None
            self._prefix = _slots(ca.shared_kv_page_indices, bs, ca.common_prefix_len)
            table, lens = ca.suffix_block_table, ca.suffix_kv_lens_cpu
        self._rows = []
        for i in range(cm.num_real_reqs):
            a, b, m = int(qsl[i]), int(qsl[i + 1]), int(lens[i])
            slots = _slots(table[i, : -(-m // bs)], bs, m)
            # with a prefix pass, query j of the row sits at m_total - n + j; its suffix keys start at L
            mask = _causal_end_aligned(b - a, m, dev)
            self._rows.append((a, b, slots, mask))

    def attend(self, layer: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        kf = k_cache.view(-1, self.num_kv_heads, self.head_dim)
        vf = v_cache.view(-1, self.num_kv_heads, self.head_dim)
        out = torch.zeros_like(q)
        for a, b, slots, mask in self._rows:
            out[a:b], lse = attention(q[a:b], kf[slots], vf[slots], mask, self.scale)
            if self._prefix is not None:
                op, lp = attention(q[a:b], kf[self._prefix], vf[self._prefix], None, self.scale)
                out[a:b] = merge(out[a:b], lse, op, lp)
        return out


class VarlenKernel:
    """FlashAttention metadata through ``torch.nn.attention.varlen.varlen_attn`` (CUDA).

    The step's K/V are gathered into contiguous per-request runs once per step (gather indices from
    ``block_table`` and ``seq_lens`` on the device; their total from the host twin ``seq_lens_cpu``).
    """

    name = "torch-varlen"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        from torch.nn.attention import varlen

        self._varlen = varlen.varlen_attn
        params = inspect.signature(self._varlen).parameters
        self._causal: dict[str, Any] = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.transform: Callable[[Any], Any] = _same

    def builders(self) -> dict[str, Any]:
        return {"flash_attn": FLASH_ATTN}

    def inputs(self, num_common_prefix_blocks: int) -> dict[str, Any]:
        return {}

    def prepare(self, cm: CommonAttentionMetadata, metadata: dict[str, Any]) -> None:
        fa = self.transform(metadata["flash_attn"])
        n, bs, dev = cm.num_reqs, cm.block_size, fa.seq_lens.device
        total = int(fa.seq_lens_cpu[:n].sum())
        cu_k = torch.zeros(n + 1, dtype=torch.int32, device=dev)
        torch.cumsum(fa.seq_lens[:n], 0, out=cu_k[1:])
        t = torch.arange(total, device=dev)
        row = torch.searchsorted(cu_k[1:], t.to(torch.int32), right=True)
        pos = t - cu_k[row]
        self._gather = fa.block_table[row, pos // bs].long() * bs + pos % bs
        self._args = (fa.query_start_loc[: n + 1], cu_k, fa.max_query_len, max(fa.max_seq_len, 1))

    def attend(self, layer: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        group = self.num_heads // self.num_kv_heads
        k = k_cache.view(-1, self.num_kv_heads, self.head_dim)[self._gather].repeat_interleave(group, dim=1)
        v = v_cache.view(-1, self.num_kv_heads, self.head_dim)[self._gather].repeat_interleave(group, dim=1)
        out = self._varlen(q, k, v, *self._args, **self._causal)
        return out[0] if isinstance(out, tuple) else out


def _on(t: torch.Tensor, device: torch.device) -> bool:
    """Whether ``t`` lives on ``device`` (``cuda`` names the current CUDA device: ``cuda:0`` is on it).

    >>> _on(torch.empty(0, device="meta"), torch.device("meta")), _on(torch.empty(0), torch.device("meta"))
    (True, False)
    """
    return t.device.type == device.type and (device.index is None or t.device.index == device.index)


class _PlanSet:
    """The wrappers of one ring turn: two FlashInfer prefill wrappers (``fa2``: the split's decode and
    prefill parts under the ``fa2`` plans, a cascade's shared and per-request levels), under the
    ``vllm`` plans the decode wrapper and the ``auto`` prefill wrapper of the split, the CUDA-graph decode
    wrappers, and the event fencing their plans."""

    def __init__(self, lib: Any, ws: torch.Tensor, plans: str) -> None:
        # fa2: FlashInfer 0.5.3's fa3 plan() derives a cumsum of the KV lengths in pageable memory and
        # copies it with non_blocking=True (a staged copy); fa2's plan copies only what it is given
        self.a = lib.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="fa2")
        self.b = lib.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="fa2")
        self.decode, self.prefill = self.a, self.b
        if plans == "vllm":  # vLLM 0.33.0's FlashInferMetadataBuilder on Hopper (_get_decode_wrapper, _get_prefill_wrapper)
            self.decode = lib.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True, backend="auto")
            self.prefill = lib.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="auto")
        self.graph: dict[int, Any] = {}
        self.graph_planned: set[int] = set()  # (the graph wrappers' sizes planned once with plan())
        self.event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        self.planned = False


FLASHINFER_OPTIONAL = ("cudnn",)
"""Packages FlashInfer 0.7.2.post1 requires that may be missing where vLLM's Python files were packed
rather than installed (``tests/kernels/fetch_vllm.py`` leaves ``nvidia-cudnn-frontend``, the ``cudnn``
package, out of the GPU machine's carry). FlashInfer's decode ``plan()`` with ``backend="auto"``, which
vLLM's builder asks for, imports ``cudnn`` at every plan to read its version."""


def mark_absent(names: tuple[str, ...]) -> list[str]:
    """Mark each of ``names`` that no finder on ``sys.path`` can import as absent (``None`` in
    ``sys.modules``), so that importing it raises ``ModuleNotFoundError`` at once; the names marked.

    A failed import is not remembered: each one searches every ``sys.path`` entry again (about 55 us a
    search on the CPU machine), and FlashInfer's eager decode ``plan()`` imports ``cudnn`` twice a plan.
    An install has the package, whose import is a dictionary lookup; on Hopper its answer routes no plan
    to cuDNN (cuDNN takes decode plans on SM100/SM103 only), so marking it absent changes what vLLM's
    builder plans in no way, only what a missing package costs its plan time.

    >>> import sys
    >>> mark_absent(("json", "attnmeta_example_no_such_module"))
    ['attnmeta_example_no_such_module']
    >>> sys.modules.pop("attnmeta_example_no_such_module") is None
    True
    """
    marked = []
    for name in names:
        if name not in sys.modules and importlib.util.find_spec(name) is None:
            sys.modules[name] = None  # type: ignore[assignment]
            marked.append(name)
    return marked


PLANS = ("fa2", "vllm", "auto")
""":class:`FlashInferKernel`'s plan choices: ``fa2`` (FlashInfer's prefill wrapper, backend ``fa2``, for
both parts of an eager step), ``vllm`` (the wrappers and plan arguments of vLLM 0.33.0's
``FlashInferMetadataBuilder`` on Hopper, so that the ``vllm`` metadata mode and this one run the same
kernels), ``auto`` (``vllm`` with the FlashInfer vLLM 0.33.0 pins, 0.7 or later; ``fa2`` before it)."""

VLLM_PLANS_SINCE = (0, 7)
"""The first FlashInfer release whose plans take the ``vllm`` choice without a copy from pageable memory
(0.5.3's ``fa3`` prefill plan derives the KV lengths' cumsum in pageable memory and copies it
``non_blocking``; vLLM 0.33.0 pins 0.7.2.post1)."""


def resolve_plans(plans: str, version: str) -> str:
    """The plan choice :class:`FlashInferKernel` makes of ``plans`` (:data:`PLANS`) with FlashInfer
    ``version``.

    >>> resolve_plans("auto", "0.7.2.post1"), resolve_plans("auto", "0.5.3"), resolve_plans("fa2", "0.7.2")
    ('vllm', 'fa2', 'fa2')
    """
    if plans not in PLANS:
        raise ValueError(f"plans: one of {', '.join(PLANS)}, not {plans!r}")
    numbers = tuple(int(x) for x in re.findall(r"\d+", version)[:2])
    recent = numbers >= VLLM_PLANS_SINCE
    if plans == "vllm" and not recent:
        raise ValueError(f"plans='vllm' needs FlashInfer {'.'.join(map(str, VLLM_PLANS_SINCE))} or later (this is "
                         f"{version}: its fa3 prefill plan copies from pageable memory); use 'fa2' or 'auto'")
    if plans == "auto":
        return "vllm" if recent else "fa2"
    return plans


def pin_range(utils: Any, length: int) -> bool:
    """Make FlashInfer's cached host ``arange`` of ``length`` entries pinned memory; whether it is.

    FlashInfer's decode ``plan()`` outside graph mode copies its query offsets (``0, 1, ..., batch``) to
    the device ``non_blocking`` from a host ``arange`` it caches per power of two (``flashinfer.utils``'
    ``_get_range_buf``), made in pageable memory: such a copy is staged and may block the host. vLLM's
    builder pins the cache entry before each such plan; so does :class:`FlashInferKernel` under the
    ``vllm`` plans. ``utils``: the ``flashinfer.utils`` module (False, nothing done, where it lacks the
    cache)."""
    get, cache = getattr(utils, "_get_range_buf", None), getattr(utils, "_cache_buf", None)
    if get is None or cache is None:
        return False
    get(length, "cpu")  # (the entry for the power of two at or above length)
    key = (f"range_{1 << (length - 1).bit_length()}", "cpu")
    buf = cache.get(key)
    if buf is None:
        return False
    if not buf.is_pinned():
        cache[key] = buf = buf.pin_memory()
    return bool(buf.is_pinned())


class FlashInferKernel:
    """FlashInfer's paged wrappers (CUDA), planned from attnmeta's pinned host arrays.

    Eager steps run two wrappers over attnmeta's split, one over the decode rows and one over the other
    rows, which ``plans`` chooses (:data:`PLANS`; ``auto``, the default, takes ``vllm`` with FlashInfer
    0.7 or later):

    - ``vllm``: the wrappers and plan arguments of vLLM 0.33.0's ``FlashInferMetadataBuilder`` on Hopper:
      the decode rows through the decode wrapper with tensor cores (backend ``auto``), the others through
      the prefill wrapper (backend ``auto``: FlashAttention 3 on Hopper), with the model's scale
      ``head_dim ** -0.5``; the ``vllm`` metadata mode's kernel (``VllmFlashInferKernel``) runs vLLM's own
      wrappers of the same plans, so the two modes differ in their metadata only;
    - ``fa2``: FlashInfer's prefill wrapper (backend ``fa2``) for both parts, the decode rows as one-token
      queries (FlashInfer 0.5.3, whose ``fa3`` prefill plan copies from pageable memory).

    When the step cascades, two ``fa2`` prefill wrappers run over the shared prefix (non-causal, every
    query) and each request's suffix (causal), merged with FlashInfer's ``merge_state``. Replayed decode
    steps (CUDA graphs) run the decode wrapper in graph mode (tensor cores), one per padded size; made
    over the graph-mode stager's own fields (:meth:`use_graph_buffers`, as the engine does), their plans
    copy nothing of the page table, and under the ``vllm`` plans they are FlashInfer's
    ``fast_decode_plan``, as vLLM's builder plans its graph wrappers.

    What ``plan()`` gets: the query and page indptrs, last-page lengths and KV lengths as pinned host
    views of the step (:func:`attnmeta.backends.flashinfer.host_tensor`), so its host reads are free
    and its non-blocking copies are real DMA; ``paged_kv_indices`` as the device view (it only copies
    it). The KV lengths are passed so that ``plan()`` does not derive them into pageable memory.

    ``plan()`` also writes its work partition into a pinned buffer of the wrapper and copies it to the
    device without blocking: planning the same wrapper for the next step before that copy has run
    would rewrite it under the GPU, the race attnmeta's ring fences for its own slots. So the kernel
    keeps a ring of ``ring`` wrapper sets, used in turn, each fenced by an event recorded after its
    plan; a set whose last plan the GPU has not consumed is waited for and counted in
    ``plan_waits`` (0 in an engine that reads each step's tokens a step later: that read bounds how far
    the host runs ahead).
    """

    name = "flashinfer"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, cascade_options: CascadeOptions | None = None, ring: int = 3,
                 plans: str = "auto") -> None:
        import flashinfer as fi_lib

        self._lib = fi_lib
        self.plans = resolve_plans(plans, str(getattr(fi_lib, "__version__", "0")))
        """The plans the kernel makes, resolved (``vllm`` or ``fa2``)."""
        self._utils: Any = None
        self._pinned: set[int] = set()  # (the lengths whose FlashInfer range buffer is pinned: pin_range)
        if self.plans == "vllm":
            self._utils = importlib.import_module("flashinfer.utils")
            mark_absent(FLASHINFER_OPTIONAL)  # (as the vllm mode does: a missing package fails its import at once)
        self.num_heads, self.num_kv_heads, self.head_dim, self.dtype = num_heads, num_kv_heads, head_dim, dtype
        self.device = device
        self.cascade_options = cascade_options
        self.transform: Callable[[Any], Any] = _same
        self._ws = torch.empty(256 << 20, dtype=torch.uint8, device=device)
        self.ring = ring
        self._sets = [_PlanSet(fi_lib, self._ws, self.plans) for _ in range(ring)]
        self._turn = 0
        self.ring_index = 0
        """The wrapper set of the current step (a graph is captured per padded size and set)."""
        self._mode = "split"
        self._split = (0, 0, 0)  # split mode: (decode query rows, first prefill row, prefill query rows)
        self.cascade_steps = 0
        self.plan_waits = 0
        self.max_pages = 0
        """Capacity of the graph wrappers' page indices (the engine sets the profile's)."""
        self._graph_buffers: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._fast: Callable[..., None] | None = None  # (FlashInfer's fast_decode_plan, under the vllm plans)
        self.fast_plans = 0
        """Graph steps planned with FlashInfer's ``fast_decode_plan`` (:meth:`use_graph_buffers`)."""

    def _kw(self) -> dict[str, Any]:
        kw: dict[str, Any] = {"q_data_type": self.dtype, "kv_data_type": self.dtype}
        if self.plans == "vllm":  # (vLLM's builder passes its layers' scale: the engine's model uses head_dim ** -0.5)
            kw["sm_scale"] = self.head_dim ** -0.5
        return kw

    def builders(self) -> dict[str, Any]:
        out: dict[str, Any] = {"flashinfer": FLASHINFER}
        if self.cascade_options is not None:
            out["cascade"] = (CASCADE, self.cascade_options)
        return out

    def inputs(self, num_common_prefix_blocks: int) -> dict[str, Any]:
        if self.cascade_options is None:
            return {}
        return {"cascade": CascadeInputs(num_common_prefix_blocks=num_common_prefix_blocks)}

    def use_graph_buffers(self, indptr: torch.Tensor, last_page_len: torch.Tensor, indices: torch.Tensor) -> None:
        """Make the CUDA-graph decode wrappers over these device tensors instead of buffers of their own.

        ``indptr`` ``(max_reqs + 1,)``, ``last_page_len`` ``(max_reqs,)`` and ``indices``
        ``(max_pages,)``, int32 on the device: the full-capacity, fixed-address fields of a graph-mode
        stager (:meth:`attnmeta.staging.Step.device_full`) that the graph steps' FlashInfer metadata views
        (``paged_kv_indptr``, ``paged_kv_last_page_len``, ``paged_kv_indices``). The step's one copy then
        fills what the captured kernels read, and a graph step's plan copies none of them: under the
        ``vllm`` plans it is FlashInfer's ``fast_decode_plan`` after each wrapper's first ``plan()``, as
        vLLM's builder plans its graph wrappers (made over its own persistent buffers). Every graph step
        checks that its metadata views these tensors (a ``ValueError`` otherwise). Call it before the
        first graph wrapper is made."""
        if any(ps.graph for ps in self._sets):
            raise RuntimeError("use_graph_buffers(): graph wrappers exist already (call it before capturing)")
        for name, t, rows in (("indptr", indptr, None), ("last_page_len", last_page_len, None),
                              ("indices", indices, self.max_pages)):
            if t.dtype != torch.int32 or t.dim() != 1 or not _on(t, self.device) or (rows is not None and len(t) < rows):
                raise ValueError(f"use_graph_buffers(): {name} must be a 1-D int32 tensor on {self.device}"
                                 + (f" of at least {rows} rows" if rows is not None else "") + f", got {t.dtype} "
                                 f"{tuple(t.shape)} on {t.device}")
        self._graph_buffers = (indptr, last_page_len, indices)
        if self.plans == "vllm":
            self._fast = importlib.import_module("flashinfer.decode").fast_decode_plan

    def graph_wrapper(self, batch: int) -> Any:
        """The current set's CUDA-graph decode wrapper of ``batch`` rows (fixed buffers: its own, or the
        first rows of :meth:`use_graph_buffers`' tensors), made on first use."""
        ps = self._sets[self.ring_index]
        w = ps.graph.get(batch)
        if w is None:
            if self._graph_buffers is not None:
                indptr, last, indices = self._graph_buffers
                if len(indptr) <= batch or len(last) < batch:
                    raise ValueError(f"FlashInferKernel: a graph of {batch} rows needs {batch + 1} rows of indptr and "
                                     f"{batch} of last_page_len in use_graph_buffers(), got {len(indptr)} and {len(last)}")
                indptr, last = indptr[: batch + 1], last[:batch]
            else:
                indptr = torch.zeros(batch + 1, dtype=torch.int32, device=self.device)
                last = torch.zeros(batch, dtype=torch.int32, device=self.device)
                indices = torch.zeros(self.max_pages, dtype=torch.int32, device=self.device)
            w = self._lib.BatchDecodeWithPagedKVCacheWrapper(
                self._ws, "NHD", use_cuda_graph=True, use_tensor_cores=True, paged_kv_indptr_buffer=indptr,
                paged_kv_indices_buffer=indices, paged_kv_last_page_len_buffer=last)
            ps.graph[batch] = w
        return w

    def _plan_graph(self, fi: Any, batch: int, bs: int, kw: dict[str, Any]) -> None:
        """Plan the current set's graph wrapper of ``batch`` rows for the step whose FlashInfer metadata is
        ``fi``: with ``plan()``, or, once the wrapper has been planned, under the ``vllm`` plans and over
        :meth:`use_graph_buffers`' tensors, with FlashInfer's ``fast_decode_plan`` (it copies nothing into
        the buffers, which the step's copy has filled)."""
        h, hk, d = self.num_heads, self.num_kv_heads, self.head_dim
        w = self._graph = self.graph_wrapper(batch)
        indptr, last = host_tensor(fi.paged_kv_indptr_cpu[: batch + 1]), host_tensor(fi.paged_kv_last_page_len_cpu[:batch])
        bufs = self._graph_buffers
        if bufs is not None and (fi.paged_kv_indptr.data_ptr() != bufs[0].data_ptr()
                                 or fi.paged_kv_last_page_len.data_ptr() != bufs[1].data_ptr()
                                 or fi.paged_kv_indices.data_ptr() != bufs[2].data_ptr()):
            raise ValueError("FlashInferKernel: the graph step's page table is not in the tensors of "
                             "use_graph_buffers() (another stager, or its graph layout moved)")
        planned = self._set.graph_planned  # (prepare() made the current set self._set)
        if self._fast is not None and batch in planned:
            self._fast(w, indptr, fi.paged_kv_indices, last, h, hk, d, bs, pos_encoding_mode="NONE", **kw)
            self.fast_plans += 1
            return
        w.plan(indptr, fi.paged_kv_indices, last, h, hk, d, bs, **kw)
        planned.add(batch)

    def prepare(self, cm: CommonAttentionMetadata, metadata: dict[str, Any], graph_batch: int | None = None) -> None:
        fi = self.transform(metadata["flashinfer"])
        h, hk, d, bs, kw = self.num_heads, self.num_kv_heads, self.head_dim, cm.block_size, self._kw()
        ca = self.transform(metadata["cascade"]) if "cascade" in metadata else None
        self.ring_index = self._turn % len(self._sets)
        self._turn += 1
        ps = self._sets[self.ring_index]
        if ps.planned and not ps.event.query():  # type: ignore[no-untyped-call]
            self.plan_waits += 1  # the GPU has not consumed this set's last plan: never in the engine's loop
            with allow_device_sync():
                ps.event.synchronize()
        self._set = ps
        if graph_batch is not None:  # a replayed decode step: plan the graph's own wrapper
            self._mode = "graph"
            self._plan_graph(fi, graph_batch, bs, kw)
        elif ca is not None and ca.use_cascade:
            self._mode = "cascade"
            self.cascade_steps += 1
            ps.a.plan(host_tensor(ca.cu_prefix_query_lens_cpu), host_tensor(ca.shared_kv_page_indptr_cpu),
                      ca.shared_kv_page_indices, host_tensor(ca.shared_kv_last_page_len_cpu), h, hk, d, bs,
                      causal=False, seq_lens=host_tensor(ca.prefix_kv_lens_cpu), **kw)
            ps.b.plan(host_tensor(cm.query_start_loc_cpu), host_tensor(ca.suffix_paged_kv_indptr_cpu),
                      ca.suffix_paged_kv_indices, host_tensor(ca.suffix_paged_kv_last_page_len_cpu), h, hk, d, bs,
                      causal=True, seq_lens=host_tensor(ca.suffix_kv_lens_cpu), **kw)
        else:
            self._mode = "split"
            nd = fi.num_decodes
            # Each wrapper runs over the query rows its indptr covers: a padded decode step's padding rows
            # (zero-length requests) are counted in num_decode_tokens but not in the indptr, and FlashInfer
            # (0.7) refuses a query longer than the indptr's last entry; the padding rows' outputs are
            # unspecified (AttentionKernel.attend). (The indptrs are the step's pinned host views: no device read.)
            # The vllm plans' decode wrapper (one query token a row, its offsets its own) takes every decode
            # row instead, as vLLM's builder: padding rows (no KV) included, all of them run (its batch is
            # its page table's rows).
            decode_wrapper = bool(nd) and self.plans == "vllm"
            if decode_wrapper and fi.num_decode_tokens != nd:
                raise ValueError(f"FlashInferKernel(plans='vllm'): {fi.num_decode_tokens} decode tokens in {nd} "
                                 "decode rows; the decode wrapper takes one token a row")
            d_rows = nd if decode_wrapper else (int(fi.qo_indptr_decode_cpu[-1]) if nd else 0)
            self._split = (d_rows, fi.num_decode_tokens, int(fi.qo_indptr_prefill_cpu[-1]) if fi.num_prefills else 0)
            if decode_wrapper:
                if nd + 1 not in self._pinned and pin_range(self._utils, nd + 1):
                    self._pinned.add(nd + 1)
                ps.decode.plan(host_tensor(fi.paged_kv_indptr_cpu[: nd + 1]), fi.paged_kv_indices,
                               host_tensor(fi.paged_kv_last_page_len_cpu[:nd]), h, hk, d, bs, pos_encoding_mode="NONE",
                               seq_lens=host_tensor(fi.kv_lens_cpu[:nd]), **kw)
            elif nd:
                ps.decode.plan(host_tensor(fi.qo_indptr_decode_cpu), host_tensor(fi.paged_kv_indptr_cpu[: nd + 1]),
                               fi.paged_kv_indices, host_tensor(fi.paged_kv_last_page_len_cpu[:nd]), h, hk, d, bs,
                               causal=True, seq_lens=host_tensor(fi.kv_lens_cpu[:nd]), **kw)
            if fi.num_prefills:
                ps.prefill.plan(host_tensor(fi.qo_indptr_prefill_cpu), host_tensor(fi.paged_kv_indptr_cpu[nd:]),
                                fi.paged_kv_indices, host_tensor(fi.paged_kv_last_page_len_cpu[nd:]), h, hk, d, bs,
                                causal=True, seq_lens=host_tensor(fi.kv_lens_cpu[nd:]), **kw)
        ps.event.record()
        ps.planned = True

    def attend(self, layer: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        kv = (k_cache, v_cache)
        ps = self._set
        if self._mode == "graph":
            return self._graph.run(q, kv)  # type: ignore[no-any-return]
        if self._mode == "cascade":
            o_s, l_s = ps.b.run(q, kv, return_lse=True)
            o_p, l_p = ps.a.run(q, kv, return_lse=True)
            return self._lib.merge_state(o_s, l_s, o_p, l_p)[0]  # type: ignore[no-any-return]
        d_rows, p_start, p_rows = self._split
        if d_rows == q.shape[0]:  # decode rows only, none of them padding: the wrapper's output is the step's
            return ps.decode.run(q, kv)  # type: ignore[no-any-return]
        out = torch.empty_like(q)  # each wrapper writes its rows in place (no copy kernel a layer)
        if d_rows:
            ps.decode.run(q[:d_rows], kv, out=out[:d_rows])
        if p_rows:
            p = slice(p_start, p_start + p_rows)
            ps.prefill.run(q[p], kv, out=out[p])
        return out
