"""The step composer against the independent references, over an engine's step sequences.

tests/test_compose.py checks that a replayed step equals the same step staged through the builders'
``stage``: both go through the same stager, so a bug they share (a cached view of the wrong arena, a
field a later step overwrites while an earlier step's objects are still live) is invisible there.
Here every step a composer builds, replayed or not, is checked against the builders' lab references
(:func:`attnmeta.testing.check_metadata`: torch computations that share no code with the builders or
the stager), its common metadata against the reference common fields, device tensors and host twins
alike, and the engine's array against what the step was given.

Compositions (:class:`_Config`):

- over the attention group FlashInfer, FlashAttention (with or without per-request causal flags), both,
  or no builder;
- with or without a Mamba2 group: a state slot a request, or vLLM's align mode (a state block per KV
  block, with or without prefill checkpoints);
- with or without speculative decoding: decode rows verify their drafts, the Mamba2 group gets the
  accepted counts, and on some loops the runner's optimistic upper bounds on the lengths;
- up to two more registered builders (cascade, fast prefill, local attention, GDN, linear attention,
  Mamba1, MLA, multimodal prefix; their lab's default options and inputs), each in the attention group
  or in a group of its own;
- eager or graph mode (frozen after some step, as an engine freezes it once its layouts are known, or
  never); two or three ring slots; ``build`` or ``build_counts``; one device or (CPU) a ``MultiStager``
  over two, whose second device's replicas are checked too;
- in eager mode on one device, with or without direct builds of registered builders (random options,
  the step's batch, checked against their references) on the composer's stager between its steps: the
  other code a stager may serve, whose layouts a slot caches beside the composer's recorded ones.

The steps come from a small simulated scheduler (:class:`_Scheduler`): some requests are decoding when
the composer is made, others join with prompts chunked over several steps, decode for a while (so the
ring's slots see their layouts again and replay them) and leave; decode-only steps are padded to the
captured sizes in graph mode. In eager mode the objects of the last ``num_slots - 1`` steps are checked
again after every step: their slots are not reused yet, so nothing may have overwritten them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import numpy as np
import torch
from compose_helpers import counts_arguments
from hypothesis import given
from hypothesis import strategies as st

from attnmeta import BatchSpec, Stager, StaticProfile
from attnmeta.backends.flash_attn import FLASH_ATTN, FlashAttentionInputs
from attnmeta.backends.flashinfer import FLASHINFER, FlashInferOptions
from attnmeta.backends.mamba import CheckpointConfig
from attnmeta.backends.mamba.mamba2 import MAMBA2, Mamba2Inputs, Mamba2Options
from attnmeta.builder import get_builder, registry
from attnmeta.compose import Array, ComposedStep, Group, StepBuilder
from attnmeta.staging import CapacityError, MultiStager
from attnmeta.testing import check_builder, check_metadata
from attnmeta.testing.assertions import assert_matches_device
from attnmeta.testing.lab import lab
from attnmeta.testing.reference.layout import ref_common_fields

BS = 16  # tokens per KV block
_SAMPLE = BatchSpec(num_computed_tokens=[3], num_scheduled_tokens=[1], block_table=[[1]], block_size=BS)
WIDTH = 12  # block-table columns
ROOM = WIDTH * BS - 6 * BS  # a request leaves before its next step could reach past its table
MAX_REQS = 6
PADS = (1, 2, 4, 8)  # graph mode: decode-only steps are padded to the next of these
EXTRA_OPTIONS = {name: lab(name).defaults(_SAMPLE)[0] for name in
                 ("cascade", "fast_prefill", "local_attn", "gdn", "linear_attn", "mamba1", "mla", "mm_prefix")}
"""The further builders a composition may add, with their lab's default options (its inputs: the lab's
defaults for each step)."""
REGISTERED = sorted(registry())
"""The builders a direct build between a composer's steps may use (:attr:`_Config.interleave`)."""
EAGER_ONLY = ("mm_prefix",)
"""Builders whose graph-mode fields have a documented fixed shape the lab reference (eager shapes) does not
have (mm_prefix: ``(num_reqs, graph_max_ranges, 2)`` range tensors); their own tests check graph mode."""
PROFILE = StaticProfile(max_num_reqs=8, max_num_tokens=160, max_blocks_per_req=WIDTH, block_size=BS, chunk_size=16)


@dataclasses.dataclass(frozen=True)
class _Config:
    graph: bool
    attention: str  # "fi", "fa", "both" or "none" (a group without builders)
    threshold: int  # FlashInfer's decode threshold
    mamba: Literal["none", "align"] | None  # None: no Mamba2 group
    checkpoints: bool  # align mode: prefill checkpoints
    chunk: int  # Mamba2's chunk size (graph mode: the profile's)
    drafts: int  # speculative tokens a decode row verifies (0: no spec decode)
    slots: int
    counts: bool  # build_counts (the scheduler's arrays) rather than build (specs)
    causal_flags: bool  # FlashAttention gets per-request causal flags (a per-step input)
    extras: tuple[tuple[str, bool], ...] = ()  # more registered builders: (name, in the attention group or its own)
    freeze_at: int | None = None  # graph mode: the step after which the stager is frozen (as an engine does)
    devices: int = 1  # 2: a MultiStager over two simulated devices (CPU), each step checked on both
    upper_bounds: bool = False  # spec decode: the runner's optimistic lengths (every draft of the last step accepted)
    interleave: bool = False  # eager, one device: direct builds of registered builders on the same stager between steps

    def groups(self) -> list[dict[str, tuple[Any, Any]]]:
        first: dict[str, tuple[Any, Any]] = {}
        if self.attention in ("fi", "both"):
            first["fi"] = (FLASHINFER, FlashInferOptions(decode_threshold=self.threshold))
        if self.attention in ("fa", "both"):
            first["fa"] = (FLASH_ATTN, None)
        extra = []
        for name, shared in self.extras:
            entry = (get_builder(name), EXTRA_OPTIONS[name])
            if shared:
                first[name] = entry
            else:
                extra.append({name: entry})
        if self.mamba is None:
            return [first, *extra]
        ckpt = CheckpointConfig(hash_block_size=BS, cache_hit_alignment_tokens=BS, mamba_block_size=BS,
                                checkpoint_alignment=1) if self.checkpoints else None
        return [first, {"mamba": (MAMBA2, Mamba2Options(chunk_size=self.chunk, cache_mode=self.mamba,
                                                        num_speculative_tokens=self.drafts, checkpoint=ckpt))}, *extra]


@st.composite
def _configs(draw: st.DrawFn) -> _Config:
    graph = draw(st.booleans())
    mamba: Literal["none", "align"] | None = draw(st.sampled_from([None, "none", "align"]))
    devices = draw(st.sampled_from([1, 2]))
    return _Config(graph=graph, attention=draw(st.sampled_from(["fi", "fa", "both", "none"])),
                   threshold=draw(st.integers(1, 3)), mamba=mamba,
                   checkpoints=mamba == "align" and draw(st.booleans()),
                   chunk=16 if graph else draw(st.sampled_from([16, 64])), drafts=draw(st.integers(0, 2)),
                   slots=draw(st.sampled_from([2, 3])), counts=draw(st.booleans()), causal_flags=draw(st.booleans()),
                   extras=tuple(draw(st.lists(st.tuples(st.sampled_from([n for n in EXTRA_OPTIONS
                                                                         if not (graph and n in EAGER_ONLY)]),
                                                        st.booleans()),
                                              max_size=2, unique_by=lambda e: e[0]))),
                   freeze_at=draw(st.none() | st.integers(0, 8)) if graph else None, devices=devices,
                   upper_bounds=draw(st.booleans()), interleave=not graph and devices == 1 and draw(st.booleans()))


@dataclasses.dataclass
class _Req:
    computed: int
    prompt: int
    blocks: np.ndarray  # (WIDTH,) int32: its KV blocks
    state: int  # its Mamba state slot (the "none" mode)
    rejected: int = 0  # drafts of its last step that were not accepted (the host learns it a step late)


@dataclasses.dataclass
class _Step:
    specs: tuple[BatchSpec, ...]
    inputs: dict[str, Any]
    ids: np.ndarray
    out: ComposedStep


class _Scheduler:
    """Requests join (with prompts chunked over several steps), decode (verifying up to ``drafts`` drafts
    a step, some of them accepted) and leave; decodes first, as an engine orders its batch."""

    def __init__(self, data: st.DataObject, cfg: _Config) -> None:
        self.data, self.cfg, self.next_block = data, cfg, 1
        self.reqs: list[_Req] = []
        for _ in range(data.draw(st.integers(0, MAX_REQS), label="running")):  # decoding when the loop starts
            done = data.draw(st.integers(1, 5 * BS))
            self._add(done, done)

    def _add(self, computed: int, prompt: int) -> None:
        blocks = np.arange(self.next_block, self.next_block + WIDTH, dtype=np.int32)
        self.next_block += WIDTH
        self.reqs.append(_Req(computed, prompt, blocks, state=1 + self.next_block % 29))

    def step(self) -> tuple[BatchSpec, np.ndarray, Any] | None:
        """The next step's attention spec, the Mamba group's table and the Mamba2 inputs; None: no work."""
        data, cfg, reqs = self.data, self.cfg, self.reqs
        if reqs and data.draw(st.integers(0, 9)) == 0:  # a request finishes
            reqs.pop(data.draw(st.integers(0, len(reqs) - 1)))
        if len(reqs) < MAX_REQS and (not reqs or data.draw(st.integers(0, 5)) == 0):  # one joins
            self._add(0, data.draw(st.integers(1, 5 * BS)))
        reqs[:] = sorted((r for r in reqs if r.computed <= ROOM), key=lambda r: r.computed < r.prompt)
        if not reqs:
            return None
        chunk, k = data.draw(st.sampled_from([4, 16, 3 * BS])), cfg.drafts
        decode = np.array([r.computed >= r.prompt for r in reqs])
        c = np.array([r.computed for r in reqs], np.int32)
        prompt = np.array([r.prompt for r in reqs], np.int32)
        n = len(reqs)
        # a decode row verifies the drafts it got: k on most steps, fewer when the drafter ran short
        drafts = np.full(n, k, np.int32) if data.draw(st.integers(0, 3)) else np.array(
            [data.draw(st.integers(0, k)) for _ in range(n)], np.int32)
        drafts[~decode] = 0
        q = np.where(decode, 1 + drafts, np.minimum(prompt - c, chunk)).astype(np.int32)
        padded = next((p for p in PADS if p >= n), None) if cfg.graph and decode.all() else None
        # async spec decode: the runner's lengths assume every draft of a row's last step was accepted
        ub = (c + q + np.array([r.rejected for r in reqs], np.int32)).astype(np.int32) if k and cfg.upper_bounds else None
        spec = BatchSpec(num_computed_tokens=c, num_scheduled_tokens=q, num_prompt_tokens=prompt,
                         num_draft_tokens=drafts if k else None, seq_lens_upper_bound=ub,
                         block_table=np.stack([r.blocks for r in reqs]), block_size=BS,
                         num_reqs_padded=padded, num_tokens_padded=None if padded is None else padded * (1 + k))
        accepted = np.array([data.draw(st.integers(1, 1 + int(d))) if dec else 1 for dec, d in zip(decode, drafts)],
                            np.int32)
        for r, d, qi, a in zip(reqs, decode, q.tolist(), accepted.tolist(), strict=True):
            r.computed += a if d else qi
            r.rejected = qi - a if d else 0
        if cfg.mamba == "align":  # a state block per KV block
            states = np.stack([r.blocks for r in reqs]) + 1000
        else:  # vLLM's "none" mode: a state block a request, and one a draft (block size: the longest request)
            states = np.array([[r.state + 100 * j for j in range(1 + k)] for r in reqs], np.int32)
        return spec, states.astype(np.int32), Mamba2Inputs(num_accepted_tokens=accepted) if k else None


def _check_common(cm: Any, spec: BatchSpec, tokens: bool, where: str) -> None:
    """A group's common metadata against the reference common fields: device tensors and host twins
    (the per-token arrays only where the group stages them: ``tokens``; else they have no rows)."""
    ref = ref_common_fields(spec, cm.query_start_loc.device)
    for name in ("query_start_loc", "seq_lens", "positions", "slot_mapping"):
        dev, host = getattr(cm, name), getattr(cm, name + "_cpu")
        if not tokens and name in ("positions", "slot_mapping"):
            assert dev.shape[0] == 0 and host.shape[0] == 0, f"{where} {name}: staged for a group that reads none"
            continue
        want = ref[name].to(dev.dtype)
        assert_matches_device(dev.cpu().numpy(), want, f"{where} {name}")  # test-only read-back
        assert_matches_device(host, want, f"{where} {name}_cpu")
    n, used = spec.num_reqs, -(-spec.max_exact_seq_len // spec.block_size)
    got = cm.block_table_tensor.cpu().numpy()[:n, :used]
    assert np.array_equal(got, spec.block_table[:n, :used]), f"{where} block_table_tensor"
    assert np.array_equal(cm.block_table_cpu[:n, :used], spec.block_table[:n, :used]), f"{where} block_table_cpu"


def _check_step(s: _Step, cfg: _Config, where: str, stager: Stager) -> None:
    """The step's objects against the references: on the primary device, and with a :class:`MultiStager`
    on the second device too (its replicas: the same objects over that device's copy of the step)."""
    multi = stager if isinstance(stager, MultiStager) else None
    for d in (0, 1) if multi is not None else (0,):
        def on(obj: Any, d: int = d) -> Any:
            return obj if multi is None or d == 0 else multi.view(obj, d)

        at = where if d == 0 else f"{where} (device {d})"
        for g, (spec, builders) in enumerate(zip(s.specs, cfg.groups(), strict=True)):
            tokens = not builders or any(b.needs(spec.shape, b.options(o)).token_arrays for b, o in builders.values())
            _check_common(on(s.out.commons[g]), spec, tokens, f"{at} group {g}")
            for name, (builder, options) in builders.items():
                meta = on(s.out[name])
                if cfg.graph and getattr(meta, "batch_ptr_cpu", None) is not None and "batch_ptr_cpu" in meta._PREFIX_TWINS:
                    # graph mode stages the pointers' first tot entries (the fixed buffer holds -1 after them)
                    assert meta.batch_ptr_cpu.shape[0] == meta.conv1d_num_programs_total, f"{at} {name}"
                check_metadata(builder, meta, spec, options, s.inputs.get(name), where=f"{at} {name}")
        got = on(s.out.arrays["engine.ids"])
        assert got.cpu().tolist() == s.ids.tolist(), f"{at} engine.ids"


def _build(composer: StepBuilder, cfg: _Config, specs: tuple[BatchSpec, ...], inputs: dict[str, Any],
           arrays: dict[str, np.ndarray]) -> ComposedStep:
    """The step through ``build`` (its specs) or ``build_counts`` (the scheduler's arrays, copies of its own)."""
    if not cfg.counts:
        return composer.build(specs, inputs, arrays)
    args, kw = counts_arguments(specs)
    return composer.build_counts(*args, **kw, inputs=inputs, arrays=arrays)


@given(data=st.data(), cfg=_configs())
def test_every_step_of_a_composer_equals_the_references(device: torch.device, data: st.DataObject,
                                                        cfg: _Config) -> None:
    """Every step (composed or replayed, through ``build`` or ``build_counts``) equals the references; in
    eager mode the live earlier steps stay equal (on CUDA: each step's copy is in flight while the host
    builds the next ones)."""
    groups = cfg.groups()
    # (a "none"-mode Mamba group's width, as vLLM's MambaSpec gives it: a state block a request and one a draft)
    state_columns = 1 + cfg.drafts if cfg.mamba == "none" else None
    decl = [Group({n: (b, o) if o is not None else b for n, (b, o) in builders.items()},
                  prefix="common" if g == 0 else f"group{g}", table_column_step=1 if g else 8,
                  table_columns=state_columns if g == 1 else None)
            for g, builders in enumerate(groups)]
    profile = PROFILE if cfg.graph else None
    stager = (MultiStager([device, device], num_slots=cfg.slots, num_kv_blocks=4096, profile=profile)
              if cfg.devices == 2 and device.type == "cpu"  # (two CUDA devices: tests/gpu/test_multi_cuda.py)
              else Stager(device, num_slots=cfg.slots, num_kv_blocks=4096, profile=profile))
    composer = StepBuilder(stager, *decl,
                           arrays=[Array("engine.ids", np.int32, capacity=PROFILE.max_num_tokens if cfg.graph else None)])
    scheduler = _Scheduler(data, cfg)
    live: list[_Step] = []
    for i in range(data.draw(st.integers(4, 24), label="steps")):
        made = scheduler.step()
        if made is None:
            continue
        spec, states, mamba_inputs = made
        # (the Mamba group's blocks: the attention's in align mode; in "none" mode one block of the longest
        # request, as vLLM sizes them, which graph mode stages at that block size's width: for_block_size)
        state_block = BS if cfg.mamba == "align" else WIDTH * BS
        specs = (spec,) if cfg.mamba is None else (spec, spec.for_group(block_table=states, block_size=state_block))
        inputs: dict[str, Any] = {"mamba": mamba_inputs} if mamba_inputs is not None and cfg.mamba is not None else {}
        specs = (*specs, *(spec for _n, shared in cfg.extras if not shared))
        for name, _shared in cfg.extras:
            inputs[name] = lab(name).defaults(spec)[1]
        if cfg.causal_flags and "fa" in groups[0]:  # (on some steps every row causal: the scalar flag too)
            flags = data.draw(st.lists(st.booleans(), min_size=spec.num_reqs, max_size=spec.num_reqs))
            inputs["fa"] = FlashAttentionInputs(causal=np.array(flags))
        ids = np.arange(100 * i, 100 * i + spec.padded_num_tokens, dtype=np.int32)
        arrays = {"engine.ids": ids}
        if cfg.freeze_at is not None and i == cfg.freeze_at + 1:
            stager.freeze()
        if cfg.interleave and data.draw(st.integers(0, 2), label="a direct build first") == 0:
            name = data.draw(st.sampled_from(REGISTERED), label="its builder")
            b = get_builder(name)
            options, b_inputs = lab(name).sample(spec, np.random.default_rng(i))
            if not b.unsupported_reasons(spec, b.options(options), b.inputs(b_inputs)):
                check_builder(b, spec, device, options, b_inputs, stager=stager, strict=True)
                live = []  # (its step took a slot: the oldest live step's, maybe)
        try:
            out = _build(composer, cfg, specs, inputs, arrays)
        except CapacityError as e:  # a frozen layout refuses a field no step had staged: nothing staged
            assert cfg.freeze_at is not None and i > cfg.freeze_at and "after Stager.freeze()" in str(e), e
            continue
        step = _Step(specs, inputs, ids, out)
        _check_step(step, cfg, f"step {i}", stager)
        if not cfg.graph:  # the earlier steps whose slots are not reused yet still hold their values
            for k, old in enumerate(live):
                _check_step(old, cfg, f"step {i}: the step {len(live) - k} before", stager)
            live = [*live, step][-(cfg.slots - 1):]
