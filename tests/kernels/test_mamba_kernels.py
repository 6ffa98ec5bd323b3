"""Real Mamba2 kernels fed by attnmeta's Mamba2 metadata, against a float64 per-sequence recurrence:
vLLM 0.33.0's own Triton kernels (the chunk-aligned format, the causal-conv1d programs, the decode
state indices) and upstream ``mamba_ssm``'s SSD kernel (the per-token ``seq_idx`` format).

Where it runs
-------------
- On CUDA, compiled by Triton (the GPU machine: ``bash benchmarks/gpu_all.sh OUT mamba-kernels``).
- On the CPU under Triton's interpreter: ``TRITON_INTERPRET=1 python -m pytest tests/kernels -s``
  (needs ``triton``; about a minute on two cores; run with triton 3.9 and numpy 2.3 and 2.4). The interpreter runs the kernels'
  Triton code with numpy, program by program; every autotuned kernel keeps only its first config
  there (vLLM's ``VLLM_TRITON_FORCE_FIRST_CONFIG`` does the same), as benchmarking configs would
  take minutes. On CUDA the kernels autotune as in vLLM (about 300 configs over the three chunk
  sizes), unless ``ATTNMETA_KERNELS_FIRST_CONFIG=1`` asks for the first config there too.
- Anywhere else it skips, naming the command. The kernels are third-party files that
  ``python tests/kernels/fetch_kernels.py`` puts into the ignored folder ``.kernels/`` (vLLM's kernel
  files with tiny stand-ins for the vLLM modules they import; ``mamba_ssm`` built from its source
  release without its CUDA extension); they are never committed, so CI skips this module.

What is checked
---------------
Each seed is one random batch built by :data:`attnmeta.backends.mamba.mamba2.MAMBA2`, by
``seed % 4``: (0) no spec decode: decodes, one-token prompt chunks that continue a state (a decode
for Mamba2), continued prefills whose context is a multiple of the chunk size or not, fresh
prefills; (1) spec decode (``k = 2``, accepted counts ``1 .. 3``) with prefills; (2) ``"align"``
cache mode with prefill checkpoints; (3) decodes only, spec decode or not, ``"none"`` or ``"align"``.
Chunk sizes 8, 16 and 32; 0 to 2 CUDA-graph padding rows, and padding tokens. States live in pools
indexed by state slot (block ids from 1; slot 0 is the null block, written by padding rows and never
compared). The kernels see only the metadata, the way vLLM's ``MambaMixer2.forward`` hands it over:

- prefill rows: ``causal_conv1d_fn`` with ``query_start_loc_p``, ``state_indices_tensor_p``,
  ``has_initial_states_p`` and the program arrays (``nums_dict``, ``batch_ptr``,
  ``token_chunk_offset_ptr``: the metadata object itself is passed as ``metadata=``);
  ``mamba_chunk_scan_combined_varlen`` with ``cu_chunk_seqlen_p``, ``seq_idx_p``,
  ``last_chunk_indices_p``, initial states ``where(has_initial_states_p, pool[state_indices_tensor_p],
  0)`` when ``prep_initial_states``, final states written into ``pool[state_indices_tensor_p]``; with
  checkpoints, the chunk states come back and ``store_prefill_checkpoint`` writes the state at each
  ``checkpoint_chunk_idx`` into ``checkpoint_meta.state_indices``;
- decode rows: ``causal_conv1d_update`` and ``selective_state_update`` with ``state_indices_tensor_d``
  and, under spec decode, ``num_accepted_tokens`` and ``query_start_loc_d`` (initial state from column
  ``num_accepted_tokens - 1``, the state after each token into its column);
- ``mamba_ssm``'s ``mamba_chunk_scan_combined`` on the prefill tokens with ``seq_idx =
  token_seq_idx_p`` (by row or ``consecutive_seq_ids``) and ``cu_seqlens = query_start_loc_p``
  (``return_varlen_states``). Its ``initial_states`` is one state per batch row, which reaches only
  the sequence with id 0: the reference starts the first prefill row from its pool state and every
  other row from zeros, so per-sequence initial states are checked by vLLM's kernel only. Its
  varlen final state of sequence 0 leaves out the initial state when that sequence ends inside the
  first physical chunk (it adds the state passed into the chunk of the sequence's end only when the
  sequence starts before that chunk); such a row's varlen state is compared with the recurrence from
  zeros, which it then equals.

The reference reads the spec, never the metadata: each row's tokens, its state slot (column 0 of
the block table, or in ``"align"`` mode column ``(c + q - 1) // block_size``; a spec-decode row reads
column ``+ acc - 1`` and writes column ``+ t`` after its token ``t``), whether it has a context, and
whether it decodes (known by construction). Mamba2 SSD in float64 per head ``h`` of group ``g``:
``dt = softplus(dt_raw + dt_bias)``, ``s_t = exp(dt A) s_{t-1} + dt x_t B_t^T`` (state (headdim,
dstate)), ``y_t = s_t C_t + D x_t``; the causal depthwise conv1d over ``[conv window | new tokens]``
with ``silu``, the window being the ``width - 1`` inputs before the first new token (zeros without a
context), and the state after the step the last ``width - 1`` inputs (spec decode: vLLM's sliding
window ``[window[1:] | new tokens]``). A checkpoint's expected state is the recurrence's state after
``offset`` tokens of its row, and its conv state the ``width - 1`` inputs before that position; the
test also checks that the position is block-aligned and the slot is the block-table entry of the
block it ends. Every real token's outputs and every non-null pool slot (written or not) are
compared. :func:`test_broken_metadata_is_caught` shows that the check fails when one field is off by
one in a batch that passes intact: a chunk boundary, a chunk's sequence, a last chunk, a prefill or
decode state index, an initial-state flag, a conv1d program, an accepted count, a decode query
start, the checkpoint chunk, a token's sequence id.

The worst error of each kernel is printed at the end of the module (``-s``) as ``KERNEL ...`` lines.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import math
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from audit_helpers import KernelResults, audited
from triton_interpreter import INTERPRET, cuda_device_shim, first_config_only, int1_comparisons
from triton_interpreter import conv1d_metadata as interpreter_conv1d_metadata

from attnmeta import BatchSpec, Stager
from attnmeta.backends.mamba import CheckpointConfig
from attnmeta.backends.mamba.mamba2 import Mamba2Inputs, Mamba2Metadata, Mamba2Options
from attnmeta.backends.mamba.mamba2 import build as build_mamba2
from examples.engine.vllm_mamba import FETCH, KERNELS, isolated_import, load_ops

CPU_RUN = "TRITON_INTERPRET=1 python -m pytest tests/kernels -s"

if not INTERPRET and not torch.cuda.is_available():  # pragma: no cover - CPU CI
    pytest.skip(f"needs CUDA, or Triton's interpreter on the CPU: {FETCH}, then {CPU_RUN} "
                "(on the GPU machine: bash benchmarks/gpu_all.sh OUT mamba-kernels)", allow_module_level=True)
triton = pytest.importorskip("triton", reason=f"needs triton (pip install triton), then {CPU_RUN}")

DEVICE = torch.device("cpu" if INTERPRET else "cuda")
WHERE = "Triton interpreter on the CPU" if INTERPRET else f"CUDA, {torch.cuda.get_device_name(0)}"
BLOCK = 8  # block size = mamba block size = the checkpoints' hash block and alignment
H, P, G, N = 4, 16, 2, 16  # heads, head dim, groups (2 heads a group), state size
CONV_DIM, WIDTH = 32, 4  # conv1d channels and kernel width
SPEC_K = 2
CHUNK_SIZES = (8, 16, 32)
# float32 on both paths; on CUDA, tl.dot rounds float32 inputs to TF32 (10-bit mantissa)
ATOL = RTOL = 1e-3 if INTERPRET else 2e-2
SEEDS = range(16)
MAMBA_SSM_SEEDS = [s for s in range(12) if s % 4 != 3]  # batches with prefills

# Worst absolute error and batch/row counts per kernel, and counts of notable cases, over the module's
# tests (printed at the end as KERNEL and NOTE lines).
RESULTS = KernelResults(f"atol {ATOL}, rtol {RTOL}; {WHERE}")
record, note = RESULTS.record, RESULTS.note


@pytest.fixture(scope="module", autouse=True)
def _summary() -> Iterator[None]:
    """Print each kernel's batches and worst error once the module's tests have run."""
    yield
    RESULTS.print()


# ------------------------------------------------------------------------------------------------
# loading the third-party kernels (never committed: .kernels/ is written by fetch_kernels.py)
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_ops() -> types.SimpleNamespace:
    """vLLM 0.33.0's kernel functions from ``.kernels/vllm``; skips where :data:`FETCH` has not run."""
    try:
        ops = load_ops()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    first_config_only(list(ops.modules.values()))
    return ops


@pytest.fixture(scope="module")
def mamba_ssm_scan() -> Callable[..., Any]:
    """Upstream ``mamba_ssm``'s ``mamba_chunk_scan_combined``, imported without the package's
    ``__init__`` (which loads the CUDA extension); skips where it is neither installed nor in
    ``.kernels/site``."""
    spec = importlib.util.find_spec("mamba_ssm")  # a top-level find_spec imports nothing
    site = KERNELS / "site"
    if spec is not None and spec.submodule_search_locations:
        where = list(spec.submodule_search_locations)
    elif (site / "mamba_ssm").is_dir():
        where = [str(site / "mamba_ssm")]
    else:
        pytest.skip(f"needs mamba_ssm (2.3.x, its Triton modules): run {FETCH}")
    extra = site if importlib.util.find_spec("einops") is None and (site / "einops").is_dir() else None
    if extra is None and importlib.util.find_spec("einops") is None:
        pytest.skip(f"needs einops (mamba_ssm's Triton modules import it): run {FETCH}")
    if extra is not None:
        sys.path.append(str(extra))  # for einops: mamba_ssm itself is the bare package below
    try:
        with isolated_import("mamba_ssm", None, {"mamba_ssm": where}):
            mod = importlib.import_module("mamba_ssm.ops.triton.ssd_combined")
            mods = [mod] + [importlib.import_module(f"mamba_ssm.ops.triton.{n}")
                            for n in ("ssd_chunk_scan", "ssd_chunk_state", "ssd_state_passing", "ssd_bmm")]
    finally:
        if extra is not None:
            sys.path.remove(str(extra))
    first_config_only(mods)
    fn: Callable[..., Any] = mod.mamba_chunk_scan_combined
    return fn


@pytest.fixture(scope="module", autouse=True)
def _interpreter_compare_fix() -> Iterator[None]:
    """Under Triton's interpreter, comparisons yield int1 handles (:func:`int1_comparisons`)."""
    with int1_comparisons():
        yield


# ------------------------------------------------------------------------------------------------
# batches and inputs
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Batch:
    """One random step: the spec, the options, accepted counts and which rows decode."""

    seed: int
    mode: str
    spec: BatchSpec
    options: Mamba2Options
    acc: np.ndarray | None
    """(num_reqs,) int32 accepted counts (spec decode), else None."""
    decode: np.ndarray
    """(num_reqs,) bool: the row takes the decode path (by construction: decodes come first)."""

    @property
    def k(self) -> int:
        """Speculative tokens."""
        return self.options.num_speculative_tokens

    def state_col(self, i: int) -> int:
        """Block-table column of row ``i``'s state: 0, or in ``"align"`` mode the block of its last token."""
        if self.options.cache_mode != "align":
            return 0
        s = int(self.spec.num_computed_tokens[i] + self.spec.num_scheduled_tokens[i])
        return max((s - 1) // BLOCK, 0)


def random_batch(seed: int) -> Batch:
    """``seed``'s batch (module docstring, "What is checked"); decodes first, then prefills."""
    rng = np.random.default_rng(seed)
    mode = ("plain", "spec", "align", "decodes")[seed % 4]
    C = int(CHUNK_SIZES[seed % 3])
    k = SPEC_K if mode == "spec" or (mode == "decodes" and seed // 4 % 2 == 0) else 0
    align = mode == "align" or (mode == "decodes" and seed // 8 % 2 == 1)
    rows: list[tuple[int, int, int, int, bool]] = []  # c, q, prompt, drafts, decodes
    n_dec = int(rng.integers(1 if mode == "decodes" else 0, 5))
    for _ in range(n_dec):
        c = int(rng.integers(1, 60))
        if k and rng.random() < 0.8:  # a spec-decode row: d drafts
            d = int(rng.integers(0, k + 1))
            rows.append((c, d + 1, c - int(rng.integers(0, c)), d, True))
        elif rng.random() < 0.3:  # a one-token prompt chunk that continues a state: moved to the decodes
            rows.append((c, 1, c + 1 + int(rng.integers(1, 30)), 0, True))
        else:
            rows.append((c, 1, c - int(rng.integers(0, c)), 0, True))
    if mode != "decodes":
        n_pre = int(rng.integers(1, 4))
        for j in range(n_pre):
            fresh = rng.random() < 0.4
            if mode == "align" and j == 0:  # long enough for a checkpoint (position a multiple of 8)
                c, q = BLOCK * int(rng.integers(0, 3)), int(rng.integers(2 * BLOCK + 1, 40))
            elif fresh:
                c, q = 0, int(rng.integers(1, 30))
            else:
                c = C * int(rng.integers(1, 4)) if rng.random() < 0.4 else int(rng.integers(1, 50))
                c = BLOCK * int(rng.integers(1, 5)) if mode == "align" and rng.random() < 0.5 else c
                q = int(rng.integers(2, 30))
            rows.append((c, q, c + q + int(rng.integers(0, 20)), 0, False))
    c_arr = np.array([r[0] for r in rows], np.int32)
    q_arr = np.array([r[1] for r in rows], np.int32)
    n = len(rows)
    s = c_arr + q_arr
    width = int((-(-s // BLOCK)).max()) + k + 1 + int(rng.integers(0, 2))
    table = (1 + rng.permutation(n * width)).reshape(n, width).astype(np.int32)
    pad = int(rng.integers(0, 3))
    tokens = int(q_arr.sum())
    # padding tokens; a decode-only (FULL CUDA graph) batch has them for every padding row
    extra = pad * (1 + k) if mode == "decodes" else (int(rng.integers(0, 4)) if pad else 0)
    spec = BatchSpec(num_computed_tokens=c_arr, num_scheduled_tokens=q_arr,
                     num_prompt_tokens=np.array([r[2] for r in rows], np.int32),
                     num_draft_tokens=np.array([r[3] for r in rows], np.int32) if k else None,
                     block_table=table, block_size=BLOCK, num_reqs_padded=n + pad, num_tokens_padded=tokens + extra)
    ckpt = CheckpointConfig(hash_block_size=BLOCK, cache_hit_alignment_tokens=BLOCK, mamba_block_size=BLOCK,
                            checkpoint_alignment=1) if mode == "align" else None
    opts = Mamba2Options(chunk_size=C, cache_mode="align" if align else "none", num_speculative_tokens=k,
                         checkpoint=ckpt, token_seq_idx=True, consecutive_seq_ids=bool(seed % 2))
    decode = np.array([r[4] for r in rows], bool)
    acc = np.where(decode, rng.integers(1, k + 2, n), 1).astype(np.int32) if k else None
    return Batch(seed, mode, spec, opts, acc, decode)


@dataclasses.dataclass(frozen=True)
class Inputs:
    """A step's layer inputs (token-major, the padded token count ``T``) and state pools, float32."""

    xbc: torch.Tensor
    """(T, CONV_DIM): the conv1d's input (pre-conv activations)."""
    x: torch.Tensor
    """(T, H, P): the SSD's input."""
    dt: torch.Tensor
    """(T, H): raw time steps (softplus(dt + dt_bias) is the step)."""
    B: torch.Tensor
    """(T, G, N)."""
    C: torch.Tensor
    """(T, G, N)."""
    A: torch.Tensor
    """(H,), negative."""
    D: torch.Tensor
    """(H,)."""
    dt_bias: torch.Tensor
    """(H,)."""
    weight: torch.Tensor
    """(CONV_DIM, WIDTH): the depthwise conv1d's weights."""
    bias: torch.Tensor
    """(CONV_DIM,)."""
    ssm_pool: torch.Tensor
    """(slots, H, P, N): SSM states by slot."""
    conv_pool: torch.Tensor
    """(slots, WIDTH - 1 + k, CONV_DIM): conv states by slot, vLLM's default "SD" layout."""

    def to(self, device: torch.device) -> Inputs:
        """The same inputs on ``device``."""
        return Inputs(**{f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)})


def inputs(batch: Batch) -> Inputs:
    """Random inputs of ``batch`` (seeded by its seed)."""
    g = torch.Generator().manual_seed(1000 + batch.seed)
    T = batch.spec.padded_num_tokens
    slots = int(batch.spec.block_table.max()) + 1

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return scale * torch.randn(shape, generator=g)

    return Inputs(
        xbc=rand(T, CONV_DIM), x=rand(T, H, P), dt=rand(T, H), B=rand(T, G, N, scale=N ** -0.5),
        C=rand(T, G, N, scale=N ** -0.5), A=-(0.5 + 1.5 * torch.rand(H, generator=g)), D=rand(H),
        dt_bias=rand(H, scale=0.5) - 0.5, weight=rand(CONV_DIM, WIDTH, scale=0.5), bias=rand(CONV_DIM, scale=0.1),
        ssm_pool=rand(slots, H, P, N), conv_pool=rand(slots, WIDTH - 1 + batch.k, CONV_DIM),
    )


# ------------------------------------------------------------------------------------------------
# the float64 reference (the spec, the block table and the row kinds; never the metadata)
# ------------------------------------------------------------------------------------------------


def ssd_recurrence(inp: Inputs, rows: slice, h0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba2 SSD over the tokens ``rows`` of one sequence in float64, from the state ``h0`` (H, P, N).

    Returns
    -------
    tuple
        Outputs (L, H, P) and the states after 0 .. L tokens (L + 1, H, P, N).
    """
    rep = H // G
    x, B, C = inp.x[rows].double(), inp.B[rows].double(), inp.C[rows].double()
    dt = torch.nn.functional.softplus(inp.dt[rows].double() + inp.dt_bias.double())
    A, D = inp.A.double(), inp.D.double()
    s = h0.double().clone()
    states = [s]
    ys = []
    for t in range(x.shape[0]):
        b, c = B[t].repeat_interleave(rep, 0), C[t].repeat_interleave(rep, 0)  # (H, N)
        s = torch.exp(dt[t] * A)[:, None, None] * s + (dt[t][:, None] * x[t])[:, :, None] * b[:, None, :]
        states.append(s)
        ys.append(torch.einsum("hpn,hn->hp", s, c) + D[:, None] * x[t])
    y = torch.stack(ys) if ys else torch.zeros((0, H, P), dtype=torch.float64)
    return y, torch.stack(states)


def conv_reference(inp: Inputs, rows: slice, window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv1d + silu over the tokens ``rows`` after ``window`` (WIDTH - 1, CONV_DIM).

    Returns
    -------
    tuple
        Outputs (L, CONV_DIM) and the inputs ``[window | tokens]`` (WIDTH - 1 + L, CONV_DIM), float64.
    """
    seq = torch.cat([window.double(), inp.xbc[rows].double()])
    w, b = inp.weight.double(), inp.bias.double()
    L = seq.shape[0] - (WIDTH - 1)
    out = torch.stack([(seq[t:t + WIDTH] * w.T).sum(0) + b for t in range(L)]) if L else seq[:0]
    return torch.nn.functional.silu(out), seq


@dataclasses.dataclass
class Expected:
    """What the step must produce (float64), and which kernel path wrote each pool slot."""

    y: torch.Tensor
    """(num_tokens, H, P): SSD outputs of the real tokens."""
    conv: torch.Tensor
    """(num_tokens, CONV_DIM): conv1d outputs of the real tokens."""
    ssm_pool: torch.Tensor
    conv_pool: torch.Tensor
    ssm_writer: dict[int, str]
    """Slot -> "prefill" / "decode" / "checkpoint"."""
    conv_writer: dict[int, str]
    states: dict[int, torch.Tensor]
    """Row -> its states after 0 .. q tokens (q + 1, H, P, N)."""
    starts: list[int]
    """Row -> its first token."""


def reference(batch: Batch, inp: Inputs) -> Expected:
    """Every real token's outputs and the pools after the step, row by row from the spec."""
    spec, k = batch.spec, batch.k
    ssm, conv = inp.ssm_pool.double().clone(), inp.conv_pool.double().clone()
    y = torch.zeros((spec.num_tokens, H, P), dtype=torch.float64)
    cout = torch.zeros((spec.num_tokens, CONV_DIM), dtype=torch.float64)
    ssm_w: dict[int, str] = {}
    conv_w: dict[int, str] = {}
    states: dict[int, torch.Tensor] = {}
    starts: list[int] = []
    a = 0
    for i in range(spec.num_reqs):
        q, c = int(spec.num_scheduled_tokens[i]), int(spec.num_computed_tokens[i])
        bt, col = spec.block_table[i], batch.state_col(i)
        rows = slice(a, a + q)
        kind = "decode" if batch.decode[i] else "prefill"
        if batch.decode[i] and k:  # spec decode: initial state in column acc - 1, the sliding conv window
            assert batch.acc is not None
            acc = int(batch.acc[i])
            h0 = inp.ssm_pool[int(bt[col + acc - 1])]
            window = inp.conv_pool[int(bt[col]), acc - 1:acc - 1 + WIDTH - 1]
        else:
            slot = int(bt[col])
            h0 = inp.ssm_pool[slot] if c > 0 else torch.zeros((H, P, N))
            window = inp.conv_pool[slot, :WIDTH - 1] if c > 0 else torch.zeros((WIDTH - 1, CONV_DIM))
        y[rows], st = ssd_recurrence(inp, rows, h0)
        cout[rows], seq = conv_reference(inp, rows, window)
        if batch.decode[i] and k:
            for t in range(q):
                ssm[int(bt[col + t])] = st[t + 1]
                ssm_w[int(bt[col + t])] = kind
            conv[int(bt[col]), :WIDTH - 2 + q] = seq[1:]
        else:
            ssm[int(bt[col])] = st[-1]
            ssm_w[int(bt[col])] = kind
            conv[int(bt[col]), :WIDTH - 1] = seq[-(WIDTH - 1):]
        conv_w[int(bt[col])] = kind
        states[i] = st
        starts.append(a)
        a += q
    return Expected(y, cout, ssm, conv, ssm_w, conv_w, states, starts)


def add_checkpoints(batch: Batch, m: Mamba2Metadata, inp: Inputs, ref: Expected) -> int:
    """Put the expected checkpoint states of the rows the metadata names into ``ref``; returns their count.

    Checks on the way that each checkpoint position is block-aligned and inside the row's query, and
    that its state index is the block-table entry of the block the position ends.
    """
    ck = m.checkpoint_meta
    if ck is None:
        return 0
    count = 0
    spec = batch.spec
    for j, off in enumerate(ck.offsets_cpu.tolist()):
        if off <= 0:
            continue
        i = ck.first_row + j
        c, q = int(spec.num_computed_tokens[i]), int(spec.num_scheduled_tokens[i])
        pos = c + off
        assert pos % BLOCK == 0 and c < pos < c + q, f"seed {batch.seed}: checkpoint of row {i} at {pos}"
        assert off >= WIDTH - 1, f"seed {batch.seed}: checkpoint offset {off} < conv state length"
        slot = int(spec.block_table[i, pos // BLOCK - 1])
        assert int(ck.state_indices_cpu[j]) == slot, f"seed {batch.seed}: checkpoint slot of row {i}"
        ref.ssm_pool[slot] = ref.states[i][off]
        a = ref.starts[i]
        ref.conv_pool[slot, :WIDTH - 1] = inp.xbc[a + off - (WIDTH - 1):a + off].double()
        ref.ssm_writer[slot] = ref.conv_writer[slot] = "checkpoint"
        count += 1
    return count


# ------------------------------------------------------------------------------------------------
# the kernels, driven by the metadata alone (as vLLM's MambaMixer2.forward hands it over)
# ------------------------------------------------------------------------------------------------

# The metadata fields the kernels read; a test may change them in a copy (Mamba2Metadata is frozen).
FIELDS = (
    "num_decodes", "num_prefills", "num_decode_tokens", "num_prefill_tokens", "chunk_size", "prep_initial_states",
    "query_start_loc_p", "has_initial_states_p", "state_indices_tensor_p", "state_indices_tensor_d",
    "query_start_loc_d", "num_accepted_tokens", "cu_chunk_seqlen_p", "seq_idx_p", "last_chunk_indices_p",
    "checkpoint_chunk_idx", "checkpoint_meta", "nums_dict", "batch_ptr", "token_chunk_offset_ptr", "token_seq_idx_p",
)


def view(m: Mamba2Metadata) -> types.SimpleNamespace:
    """The fields in :data:`FIELDS` of ``m``, in a namespace a test may change."""
    return types.SimpleNamespace(**{f: getattr(m, f) for f in FIELDS})


@dataclasses.dataclass
class Outputs:
    """What the kernels produced."""

    y: torch.Tensor
    conv: torch.Tensor
    ssm_pool: torch.Tensor
    conv_pool: torch.Tensor


def conv1d_metadata(v: types.SimpleNamespace) -> types.SimpleNamespace:
    """What ``causal_conv1d_fn`` reads as ``metadata=``, its program arrays taken from ``v`` (so a test's
    change reaches the kernel); see :func:`triton_interpreter.conv1d_metadata`."""
    return interpreter_conv1d_metadata(v.nums_dict, v.batch_ptr, v.token_chunk_offset_ptr)


def run_vllm(ops: types.SimpleNamespace, v: types.SimpleNamespace, inp: Inputs) -> Outputs:
    """The step's prefill and decode kernels on device inputs ``inp`` (pools copied, not changed)."""
    Dt, Pt = v.num_decode_tokens, v.num_prefill_tokens
    dev = inp.x.device
    y = torch.zeros((Dt + Pt, H, P), device=dev)
    cout = torch.zeros((Dt + Pt, CONV_DIM), device=dev)
    ssm = inp.ssm_pool.clone()
    conv_sd = inp.conv_pool.clone()
    conv = conv_sd.transpose(-1, -2)  # (slots, CONV_DIM, state_len), the layout the kernels take
    if v.num_prefills:
        p = slice(Dt, Dt + Pt)
        x_t = inp.xbc[p].transpose(0, 1)  # (CONV_DIM, Pt), channel-last
        cout[p] = ops.conv1d_fn(x_t, inp.weight, inp.bias, conv_states=conv, query_start_loc=v.query_start_loc_p,
                                cache_indices=v.state_indices_tensor_p, has_initial_state=v.has_initial_states_p,
                                activation="silu", metadata=conv1d_metadata(v)).transpose(0, 1)[:Pt]
        init = None
        if v.prep_initial_states:
            init = torch.where(v.has_initial_states_p[:, None, None, None], ssm[v.state_indices_tensor_p.long()], 0)
        has_ck = v.checkpoint_chunk_idx is not None
        chunk_states = ops.ssd_varlen(
            inp.x[p], inp.dt[p], inp.A, inp.B[p], inp.C[p], chunk_size=v.chunk_size, cu_seqlens=v.query_start_loc_p,
            cu_chunk_seqlens=v.cu_chunk_seqlen_p, last_chunk_indices=v.last_chunk_indices_p, seq_idx=v.seq_idx_p,
            out=y[p], D=inp.D, dt_bias=inp.dt_bias, initial_states=init, dt_softplus=True,
            dt_limit=(0.0, math.inf), return_intermediate_states=has_ck, state_dtype=ssm.dtype,
            final_states_out=None if has_ck else ssm, final_state_indices=None if has_ck else v.state_indices_tensor_p)
        if has_ck:
            ck = v.checkpoint_meta
            ops.store_checkpoint(ops.checkpoint_type(ck.offsets, ck.state_indices), v.checkpoint_chunk_idx, x_t,
                                 conv, chunk_states, ssm, v.query_start_loc_p, state_len=WIDTH - 1)
            ssm[v.state_indices_tensor_p.long()] = chunk_states[v.last_chunk_indices_p.long()]
    if v.num_decodes:
        d = slice(0, Dt)
        si = v.state_indices_tensor_d
        cout[d] = ops.conv1d_update(inp.xbc[d].clone(), conv, inp.weight, inp.bias, "silu", conv_state_indices=si,
                                    num_accepted_tokens=v.num_accepted_tokens, query_start_loc=v.query_start_loc_d,
                                    max_query_len=si.size(-1))
        ops.state_update(ssm, inp.x[d], inp.dt[d][:, :, None].expand(-1, -1, P),
                         inp.A[:, None, None].expand(-1, P, N), inp.B[d], inp.C[d], inp.D[:, None].expand(-1, P),
                         inp.dt_bias[:, None].expand(-1, P), dt_softplus=True, state_batch_indices=si,
                         dst_state_batch_indices=si, out=y[d], num_accepted_tokens=v.num_accepted_tokens,
                         cu_seqlens=v.query_start_loc_d)
    return Outputs(y, cout, ssm, conv_sd)


# ------------------------------------------------------------------------------------------------
# the checks
# ------------------------------------------------------------------------------------------------


def build(batch: Batch) -> Mamba2Metadata:
    """``batch``'s Mamba2 metadata on :data:`DEVICE`, built under the sync audit."""
    stager = Stager(DEVICE, num_kv_blocks=int(batch.spec.block_table.max()) + 1)
    with audited():
        m: Mamba2Metadata = build_mamba2(batch.spec, stager, batch.options, Mamba2Inputs(num_accepted_tokens=batch.acc))
    return m


def close(got: torch.Tensor, want: torch.Tensor, what: str) -> float:
    """Assert ``got`` (any device) is within tolerance of ``want`` (float64, CPU); the worst error."""
    g = got.double().cpu()
    torch.testing.assert_close(g, want, atol=ATOL, rtol=RTOL, msg=lambda s: f"{what}\n{s}")
    return float((g - want).abs().max()) if g.numel() else 0.0


def check_vllm(batch: Batch, ops: types.SimpleNamespace,
               tamper: Callable[[types.SimpleNamespace], None] | None = None) -> dict[str, tuple[float, int]]:
    """Build ``batch``'s metadata, run vLLM's kernels on it, compare with the reference.

    ``tamper`` may change the metadata view first (to show that a broken field fails the check).

    Returns
    -------
    dict
        Per kernel that ran, (worst error, rows).

    Raises
    ------
    AssertionError
        An output or a pool slot outside ``ATOL`` / ``RTOL`` of the reference, or a checkpoint that is
        not where the spec puts it.
    """
    m = build(batch)
    where = (f"seed {batch.seed} ({batch.mode}, C={batch.options.chunk_size}, k={batch.k}, "
             f"{batch.options.cache_mode}; decodes {m.num_decodes}, prefills {m.num_prefills})")
    n_dec = int(batch.decode.sum())
    pad_rows = batch.spec.padded_num_reqs - batch.spec.num_reqs
    assert m.num_decodes == n_dec + (0 if m.num_prefills else pad_rows), f"{where}: decode rows"
    inp = inputs(batch)
    ref = reference(batch, inp)
    n_ck = add_checkpoints(batch, m, inp, ref)
    if batch.mode == "align":
        assert n_ck, f"{where}: no checkpoint (the batch is built to have one)"
    v = view(m)
    if tamper is not None:
        tamper(v)
    out = run_vllm(ops, v, inp.to(DEVICE))
    T = batch.spec.num_tokens
    dec_tok = int(batch.spec.num_scheduled_tokens[batch.decode].sum())
    errs: dict[str, tuple[float, int]] = {}
    close(out.y[:T], ref.y, f"{where}: SSD outputs")
    close(out.conv[:T], ref.conv, f"{where}: conv1d outputs")
    real = torch.arange(1, ref.ssm_pool.shape[0])  # slot 0 is the null block: padding rows write there
    close(out.ssm_pool[real], ref.ssm_pool[real], f"{where}: SSM state pool")
    close(out.conv_pool[real], ref.conv_pool[real], f"{where}: conv state pool")

    def slot_err(pool_got: torch.Tensor, pool_want: torch.Tensor, writer: dict[int, str], kind: str) -> float:
        slots = [s for s, w in writer.items() if w == kind]
        if not slots:
            return 0.0
        return float((pool_got[slots].double().cpu() - pool_want[slots]).abs().max())

    def tok_err(got: torch.Tensor, want: torch.Tensor, toks: slice) -> float:
        g = got[toks].double().cpu() - want[toks]
        return float(g.abs().max()) if g.numel() else 0.0

    spec_tag = "spec decode, " if batch.k else ""
    n_pre = batch.spec.num_reqs - n_dec
    if n_pre:
        pre = slice(dec_tok, T)
        errs["vLLM mamba_chunk_scan_combined_varlen: chunk-aligned cu_chunk_seqlen_p / seq_idx_p / "
             "last_chunk_indices_p, state_indices_tensor_p, has_initial_states_p (outputs, final states)"] = (
            max(tok_err(out.y, ref.y, pre), slot_err(out.ssm_pool, ref.ssm_pool, ref.ssm_writer, "prefill")), n_pre)
        errs["vLLM causal_conv1d_fn: batch_ptr / token_chunk_offset_ptr / nums_dict, query_start_loc_p, "
             "state_indices_tensor_p, has_initial_states_p (outputs, conv states)"] = (
            max(tok_err(out.conv, ref.conv, pre), slot_err(out.conv_pool, ref.conv_pool, ref.conv_writer, "prefill")),
            n_pre)
    if n_ck:
        errs["vLLM store_prefill_checkpoint: checkpoint_meta, checkpoint_chunk_idx (align mode; SSM and conv "
             "states at the checkpoint)"] = (
            max(slot_err(out.ssm_pool, ref.ssm_pool, ref.ssm_writer, "checkpoint"),
                slot_err(out.conv_pool, ref.conv_pool, ref.conv_writer, "checkpoint")), n_ck)
    if n_dec:
        dec = slice(0, dec_tok)
        fields = "state_indices_tensor_d, query_start_loc_d, num_accepted_tokens" if batch.k else "state_indices_tensor_d"
        errs[f"vLLM selective_state_update: {spec_tag}{fields} (outputs, states)"] = (
            max(tok_err(out.y, ref.y, dec), slot_err(out.ssm_pool, ref.ssm_pool, ref.ssm_writer, "decode")), n_dec)
        errs[f"vLLM causal_conv1d_update: {spec_tag}{fields} (outputs, conv states)"] = (
            max(tok_err(out.conv, ref.conv, dec), slot_err(out.conv_pool, ref.conv_pool, ref.conv_writer, "decode")),
            n_dec)
    return errs


def count_cases(batch: Batch) -> None:
    """Count the kinds of rows of ``batch`` in :data:`RESULTS`' notes."""
    spec, C = batch.spec, batch.options.chunk_size
    for i in range(spec.num_reqs):
        c = int(spec.num_computed_tokens[i])
        prompt = int(spec.num_prompt_tokens[i]) if spec.num_prompt_tokens is not None else 0
        if batch.decode[i]:
            note("vLLM rows: one-token prompt chunk continuing a state (decode path)" if c < prompt
                 else f"vLLM rows: decode{' (spec decode)' if batch.k else ''}")
        elif c == 0:
            note("vLLM rows: fresh prefill")
        else:
            note("vLLM rows: continued prefill, context a multiple of the chunk size" if c % C == 0
                 else "vLLM rows: continued prefill, context not a multiple of the chunk size (a realigning chunk)")
    if spec.padded_num_reqs > spec.num_reqs:
        note("vLLM batches with CUDA-graph padding rows")


def test_vllm_kernels_find_their_tuned_launch_configs_on_the_gpu_machine(vllm_ops: types.SimpleNamespace) -> None:
    """``selective_state_update`` launches with vLLM's tuned configs on the GPU machine's cards, as in an
    install: fetch_kernels.py carries them beside ``mamba_ssm.py`` (``VLLM_CONFIGS``), and the file the
    kernel looks up for the engine's ~1.44B hybrid (head size 64, state size 128, float32 states) is
    there for the H100 and the H200; without it the kernel warns and launches with a fallback."""
    ssm = vllm_ops.modules["mamba_ssm"]
    for card in ("NVIDIA_H100_80GB_HBM3", "NVIDIA_H200"):
        name = ssm.get_ssm_config_file_name(64, 128, "float32", card)
        path = Path(ssm._CONFIGS_DIR) / name
        assert path.is_file(), f"{path}: run {FETCH}"
        tuned = json.loads(path.read_text())
        assert all(set(tuned[k]) == {"BLOCK_SIZE_M", "num_warps"} for k in tuned if k.isdigit()), name


@pytest.mark.parametrize("seed", SEEDS)
def test_mamba2_metadata_drives_vllm_kernels(seed: int, vllm_ops: types.SimpleNamespace) -> None:
    batch = random_batch(seed)
    for kernel, (err, rows) in check_vllm(batch, vllm_ops).items():
        record(kernel, err, rows)
    count_cases(batch)


def check_mamba_ssm(batch: Batch, scan: Callable[..., Any],
                    tamper: Callable[[types.SimpleNamespace], None] | None = None) -> tuple[float, int, list[str]]:
    """Build ``batch``'s metadata, run ``mamba_ssm``'s SSD kernel on its prefill tokens with the
    per-token ``token_seq_idx_p`` and ``query_start_loc_p``, compare with the reference.

    The first prefill row starts from its pool state when it has a context (``initial_states``, which
    reaches only sequence 0); every other row from zeros. A first row with a state that ends inside
    the first physical chunk gets a varlen state without it (module docstring): compared with the
    recurrence from zeros.

    Returns
    -------
    tuple
        The worst error, the prefill rows, and the notable cases (for :data:`RESULTS`' notes).

    Raises
    ------
    AssertionError
        An output or a varlen state outside ``ATOL`` / ``RTOL`` of the reference.
    """
    m = build(batch)
    assert m.num_prefills and m.token_seq_idx_p is not None and m.query_start_loc_p is not None
    inp = inputs(batch)
    spec, C = batch.spec, batch.options.chunk_size
    dec_tok = int(spec.num_scheduled_tokens[batch.decode].sum())
    first = int(batch.decode.sum())  # the first prefill row
    has0 = int(spec.num_computed_tokens[first]) > 0
    want_y: list[torch.Tensor] = []
    want_h: list[tuple[int, torch.Tensor]] = []
    cases = ["mamba_ssm: sequence 0 continues a state (initial_states given)"] if has0 else []
    a = dec_tok
    for i in range(first, spec.num_reqs):
        q = int(spec.num_scheduled_tokens[i])
        h0 = torch.zeros((H, P, N))
        if i == first and has0:
            h0 = inp.ssm_pool[int(spec.block_table[i, batch.state_col(i)])]
        yi, st = ssd_recurrence(inp, slice(a, a + q), h0)
        want_y.append(yi)
        if i == first and has0 and q <= C:  # mamba_ssm's varlen state leaves the initial state out here
            cases.append("mamba_ssm: sequence 0 with initial_states ends inside the first physical chunk (its "
                         "varlen state is compared with the recurrence from zeros)")
            st = ssd_recurrence(inp, slice(a, a + q), torch.zeros((H, P, N)))[1]
        want_h.append((i - first, st[-1]))
        a += q
    v = view(m)
    if tamper is not None:
        tamper(v)
    Dt, Pt = v.num_decode_tokens, v.num_prefill_tokens
    d = inp.to(DEVICE)
    p = slice(Dt, Dt + Pt)
    init = d.ssm_pool[v.state_indices_tensor_p[:1].long()] if has0 else None
    with cuda_device_shim():
        y, varlen = scan(d.x[p][None], d.dt[p][None], d.A, d.B[p][None], d.C[p][None], C, D=d.D, dt_bias=d.dt_bias,
                         initial_states=init, seq_idx=v.token_seq_idx_p[None], cu_seqlens=v.query_start_loc_p,
                         dt_softplus=True, return_varlen_states=True)
    where = (f"seed {batch.seed} (C={C}, consecutive ids {batch.options.consecutive_seq_ids}, "
             f"sequence 0 continues a state: {has0})")
    err = close(y[0, :spec.num_tokens - dec_tok], torch.cat(want_y), f"{where}: mamba_ssm outputs")
    for j, h in want_h:
        err = max(err, close(varlen[j], h, f"{where}: mamba_ssm varlen state of prefill row {j}"))
    return err, len(want_y), cases


@pytest.mark.parametrize("seed", MAMBA_SSM_SEEDS)
def test_token_seq_idx_drives_mamba_ssm_kernel(seed: int, mamba_ssm_scan: Callable[..., Any]) -> None:
    batch = random_batch(seed)
    err, rows, cases = check_mamba_ssm(batch, mamba_ssm_scan)
    for case in cases:
        note(case)
    ids = "consecutive ids" if batch.options.consecutive_seq_ids else "ids by row"
    record(f"mamba_ssm mamba_chunk_scan_combined: per-token token_seq_idx_p ({ids}), query_start_loc_p as "
           "cu_seqlens (outputs, varlen states; initial state of sequence 0 only)", err, rows)


# ------------------------------------------------------------------------------------------------
# the checks can fail: one field off by one in a batch that passes intact
# ------------------------------------------------------------------------------------------------


def _batch(name: str, c: list[int], q: list[int], prompt: list[int], *, k: int = 0, drafts: list[int] | None = None,
           acc: list[int] | None = None, checkpoint: bool = False) -> Batch:
    """A hand-made batch: rows with ``q <= 1 + k`` that are not prefilling decode, the others prefill."""
    n = len(c)
    spec = BatchSpec(num_computed_tokens=np.array(c, np.int32), num_scheduled_tokens=np.array(q, np.int32),
                     num_prompt_tokens=np.array(prompt, np.int32),
                     num_draft_tokens=None if drafts is None else np.array(drafts, np.int32),
                     block_table=np.arange(1, 1 + 6 * n, dtype=np.int32).reshape(n, 6), block_size=BLOCK)
    ckpt = CheckpointConfig(hash_block_size=BLOCK, cache_hit_alignment_tokens=BLOCK, mamba_block_size=BLOCK,
                            checkpoint_alignment=1) if checkpoint else None
    opts = Mamba2Options(chunk_size=8, num_speculative_tokens=k, cache_mode="align" if checkpoint else "none",
                         checkpoint=ckpt, token_seq_idx=True)
    decode = np.array([qi <= 1 + k and ci >= pi for ci, qi, pi in zip(c, q, prompt)])
    return Batch(seed=-1, mode=name, spec=spec, options=opts, acc=None if acc is None else np.array(acc, np.int32),
                 decode=decode)


MUTATION_BATCHES: dict[str, Callable[[], Batch]] = {
    # a decode, then two prefills that continue states (the first chunk-aligned and 20 tokens long)
    "prefills": lambda: _batch("prefills", [7, 16, 5], [1, 20, 9], [7, 60, 30]),
    # two spec-decode rows (2 and 1 drafts), then a fresh prefill
    "spec": lambda: _batch("spec", [10, 20, 0], [3, 2, 6], [10, 20, 6], k=2, drafts=[2, 1, 0], acc=[2, 3, 1]),
    # a fresh 20-token prefill in align mode: a checkpoint at position 16
    "checkpoint": lambda: _batch("checkpoint", [0, 12], [20, 5], [20, 40], checkpoint=True),
}


def _set(field: str, index: Callable[[types.SimpleNamespace], Any],
         value: Callable[[types.SimpleNamespace, Any], Any]) -> Callable[[types.SimpleNamespace], None]:
    """A mutation: ``v.field[index(v)] = value(v, old)`` on a copy of the field."""
    def mutate(v: types.SimpleNamespace) -> None:
        t = getattr(v, field).clone()
        i = index(v)
        t[i] = value(v, t[i])
        setattr(v, field, t)
    return mutate


def _first_chunk_of_row1(v: types.SimpleNamespace) -> int:
    """Index into ``cu_chunk_seqlen_p`` / ``seq_idx_p`` of prefill row 1's first chunk."""
    return int((v.seq_idx_p.cpu() >= 1).nonzero()[0, 0])


def _last_token_of_row0(v: types.SimpleNamespace) -> int:
    """Index into ``token_seq_idx_p`` of prefill row 0's last token."""
    return int(v.query_start_loc_p[1].cpu()) - 1


# name -> (batch, kernels, mutation)
MUTATIONS: dict[str, tuple[str, str, Callable[[types.SimpleNamespace], None]]] = {
    "cu_chunk_seqlen_p: row 1's first chunk starts one token late": (
        "prefills", "vllm", _set("cu_chunk_seqlen_p", _first_chunk_of_row1, lambda v, x: x + 1)),
    "seq_idx_p: row 1's first chunk labelled row 0": (
        "prefills", "vllm", _set("seq_idx_p", _first_chunk_of_row1, lambda v, x: x - 1)),
    "last_chunk_indices_p: row 0's last chunk one early": (
        "prefills", "vllm", _set("last_chunk_indices_p", lambda v: 0, lambda v, x: x - 1)),
    "state_indices_tensor_p: row 1 reads row 0's slot": (
        "prefills", "vllm", _set("state_indices_tensor_p", lambda v: 1, lambda v, x: v.state_indices_tensor_p[0])),
    "has_initial_states_p: row 0 starts from zeros": (
        "prefills", "vllm", _set("has_initial_states_p", lambda v: 0, lambda v, x: False)),
    "batch_ptr: row 1's first conv1d program does row 0": (
        "prefills", "vllm", _set("batch_ptr", lambda v: int((v.batch_ptr.cpu() == 1).nonzero()[0, 0]),
                                 lambda v, x: 0)),
    "state_indices_tensor_d: a decode row's columns off by one": (
        "prefills", "vllm", _set("state_indices_tensor_d", lambda v: (0, 0), lambda v, x: x + 1)),
    "num_accepted_tokens: row 0 accepted one token fewer": (
        "spec", "vllm", _set("num_accepted_tokens", lambda v: 0, lambda v, x: x - 1)),
    "query_start_loc_d: row 1 starts one token early": (
        "spec", "vllm", _set("query_start_loc_d", lambda v: 1, lambda v, x: x - 1)),
    "checkpoint_chunk_idx: the checkpoint one chunk early": (
        "checkpoint", "vllm", _set("checkpoint_chunk_idx", lambda v: 0, lambda v, x: x - 1)),
    "token_seq_idx_p: row 0's last token labelled row 1": (
        "prefills", "mamba_ssm", _set("token_seq_idx_p", _last_token_of_row0, lambda v, x: x + 1)),
}


@pytest.mark.parametrize("kernels", ["vllm", "mamba_ssm"])
@pytest.mark.parametrize("name", list(MUTATION_BATCHES))
def test_mutation_batches_pass_intact(name: str, kernels: str, request: pytest.FixtureRequest) -> None:
    if kernels == "vllm":
        check_vllm(MUTATION_BATCHES[name](), request.getfixturevalue("vllm_ops"))
    else:
        check_mamba_ssm(MUTATION_BATCHES[name](), request.getfixturevalue("mamba_ssm_scan"))


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_broken_metadata_is_caught(name: str, request: pytest.FixtureRequest) -> None:
    """One metadata field off by one: the check fails (so it can); the batch passes intact
    (:func:`test_mutation_batches_pass_intact`)."""
    batch_name, kernels, mutate = MUTATIONS[name]
    batch = MUTATION_BATCHES[batch_name]()
    with pytest.raises(AssertionError, match=r"outputs|pool|varlen") as caught:
        if kernels == "vllm":
            check_vllm(batch, request.getfixturevalue("vllm_ops"), mutate)
        else:
            check_mamba_ssm(batch, request.getfixturevalue("mamba_ssm_scan"), mutate)
    print(f"\nMUTATION {name}: caught ({str(caught.value).splitlines()[0]})")
