"""The built-in demo batch and its printed metadata (``python -m attnmeta demo``)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from attnmeta.bench._display import format_metadata
from attnmeta.spec import BatchSpec

__all__ = ["demo_lines", "demo_spec", "run_demo"]


def demo_spec() -> BatchSpec:
    """A small mixed batch: 2 decodes, 1 chunked prefill with unaligned context, 1 fresh prefill,
    padded to 6 rows and 96 tokens (block size 16).

    ====  ========  =========  ======  ==========================================
    row   computed  scheduled  prompt  what
    ====  ========  =========  ======  ==========================================
    0     37        1          20      decode
    1     130       1          100     decode
    2     77        40         300     chunked prefill, context not chunk-aligned
    3     0         33         33      fresh prefill
    4-5   -         -          -       CUDA-graph padding rows
    ====  ========  =========  ======  ==========================================
    """
    c = np.array([37, 130, 77, 0], np.int32)
    q = np.array([1, 1, 40, 33], np.int32)
    width = 16
    table = (np.arange(4, dtype=np.int32)[:, None] * 100 + np.arange(width, dtype=np.int32)[None, :]).astype(np.int32)
    return BatchSpec(
        num_computed_tokens=c,
        num_scheduled_tokens=q,
        num_prompt_tokens=np.array([20, 100, 300, 33], np.int32),
        block_table=table,
        block_size=16,
        num_reqs_padded=6,
        num_tokens_padded=96,
    )


def run_demo(device: str, *, limit: int = 16) -> str:
    """Build the common metadata and every registered builder's (with its lab defaults,
    :meth:`attnmeta.testing.lab.Lab.defaults`) for :func:`demo_spec` on ``device``, all in ONE step,
    and return the printout (:func:`demo_lines`, joined)."""
    return "\n".join(demo_lines(device, limit=limit))


def demo_lines(device: str, *, limit: int = 16) -> Iterator[str]:
    """The demo's printout, line by line: the title first, before anything is built (a first run then
    compiles the kernels, which takes a while), then the batch and its metadata."""
    yield "attnmeta demo: one step of a mixed batch, built on the host and staged in ONE copy"
    from attnmeta.builder import CommonNeeds, registry
    from attnmeta.common import stage_common
    from attnmeta.staging import Stager
    from attnmeta.testing.lab import lab

    spec = demo_spec()
    yield ""
    yield repr(spec)
    yield ""
    yield "Rows: 0-1 decodes (37 and 130 cached tokens), 2 chunked prefill (77 cached, 40 new: not"
    yield "chunk-aligned), 3 fresh prefill (33 tokens), 4-5 CUDA-graph padding. Block size 16; request r's"
    yield "blocks are r*100 + [0, 1, 2, ...]."
    yield ""
    stager = Stager(device)
    builders = sorted(registry().items())
    chosen = [(name, b, *lab(b).defaults(spec)) for name, b in builders]
    needs = CommonNeeds(token_arrays=True)
    for _name, b, options, _inputs in chosen:
        needs = needs.merge(b.needs(spec.shape, b.options(options)))
    with stager.step() as step:
        common = stage_common(spec, step, token_arrays=needs.token_arrays, paged_kv=needs.paged_kv,
                              block_table_columns=needs.block_table_columns)
        staged = [(name, options, b.stage(common, step, options, inputs)) for name, b, options, inputs in chosen]
    yield format_metadata(common.result(), limit=limit)
    for name, options, result in staged:
        meta = result.result()
        yield ""
        yield format_metadata(meta, limit=limit, title=f"{type(meta).__name__} (builder {name!r})")
        yield f"options: {options}"
    st = step.stats
    yield ""
    yield (f"Staging: {st.copies} host->device copy of {st.bytes} bytes for the whole step "
           f"(slot {st.slot}, waits {st.waits}), {len(staged)} builders; device fields are views into that one upload.")
    yield "Device tensors above print their host twin's values: the demo never reads device memory."
