"""Several ranks: the host work of a step derived once and copied to every rank, against every rank
deriving it itself, in the same run.

The step is the steady-state decode step of ``bench_decode.py`` (common + FlashAttention +
FlashInfer metadata through :class:`attnmeta.backends.fused.FusedStepBuilder`; batch 1, 64, 256 and
1024, contexts growing one token a step, 64 successive steps cycled), or with ``--scenario mixed``
the composable builders (``stage_common`` + ``flash_attn.stage`` + ``flashinfer.stage``) on mixed
steps of 64 prefills and 192 decodes. For ``N`` ranks (``--ranks 2,4,8``) it times three paths:

- ``independent``: every rank has its own stager and builder and builds every step: ``N``
  derivations and ``N`` copies a step (what tensor-parallel engines do today);
- ``one-process``: one :class:`attnmeta.staging.MultiStager` over the ``N`` devices derives the step
  once, copies it once to each device, and builds the other ``N - 1`` devices' metadata with
  ``view()``: one thread does all of it;
- ``ring``: one process per rank: a :class:`attnmeta.staging.shared.RingWriter` (rank 0) derives and
  publishes each step into a shared segment, each of ``N - 1`` :class:`~attnmeta.staging.shared.RingReader`
  receives it (its one copy) and builds its metadata objects (``result()``).

Every rank runs here, in this process, the way it would run in its own: in blocks of ``--block``
consecutive steps per rank (the writer publishes a block, then each reader receives it; readers hold
one step, ``RingReader(hold=1)``, so the writer may run a block ahead), each rank's loop hot, rounds of
the paths alternating. Per step it reports the host microseconds summed over the ranks (``total``:
the CPU time all ranks spend together, what competes for the host's cores), that total's ratio to
``independent`` (``saved x``), and the busiest rank's microseconds (``rank``: independent and ring,
one rank's loop; one-process, the one thread's). Medians over rounds; garbage collection off.

On a CPU "device" (``--device cpu``: ``N`` CPU arenas stand for ``N`` devices) each copy is a
``memcpy`` of the step's staged bytes, which a GPU's DMA engine does instead; the ``copies`` row
(CPU only) times ``N`` such copies alone, the part of every path's total that is the simulated
devices' own.
With ``--device cuda`` the ranks are ``cuda:0`` .. ``cuda:N-1`` (``N`` at most the device count).

Run: ``python benchmarks/bench_multi_rank.py [--device cpu|cuda] [--ranks 2,4,8] [--batches 1,64,256,1024]
[--scenario decode|mixed] [--rounds 7] [--blocks 6] [--block 8]``.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

if importlib.util.find_spec("attnmeta") is None:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _args import device_arg  # benchmarks/_args.py

from attnmeta import BatchSpec, Stager, stage_common
from attnmeta.backends import flash_attn, flashinfer
from attnmeta.backends.fused import FusedStepBuilder
from attnmeta.bench.scenarios import decode_walks
from attnmeta.staging import MultiStager
from attnmeta.staging.shared import RingReader, RingWriter, SharedRing
from attnmeta.testing.workloads import mixed_spec

Build = Callable[[Stager, BatchSpec], Any]


def _fused() -> Build:
    builders: dict[int, FusedStepBuilder] = {}

    def build(stager: Stager, spec: BatchSpec) -> Any:
        b = builders.get(id(stager))
        if b is None:
            b = builders[id(stager)] = FusedStepBuilder(stager)
        return b.build(spec)

    return build


def _composable(stager: Stager, spec: BatchSpec) -> Any:
    with stager.step() as step:
        common = stage_common(spec, step, paged_kv=True)
        fa = flash_attn.stage(common, step)
        fi = flashinfer.stage(common, step)
    return common.result(), fa.result(), fi.result()


class _Paths:
    """The three paths for ``n`` ranks over ``specs``; each ``run_<path>(block)`` times one block."""

    def __init__(self, n: int, specs: list[BatchSpec], devices: list[str], build: Build, block: int,
                 slot_bytes: int) -> None:
        self.n, self.specs, self.block, self.build = n, specs, block, build
        self.at = 0
        self.singles = [Stager(d) for d in devices]
        self.multi = MultiStager(devices)
        self.ring = SharedRing.create(num_readers=n - 1, num_slots=block + 1, slot_bytes=slot_bytes,
                                      meta_bytes=1 << 18)
        self.writer = RingWriter(self.ring, devices[0], timeout=600)
        self.readers = [RingReader(SharedRing.attach(self.ring.name), r, devices[r + 1], hold=1)
                        for r in range(n - 1)]
        self.nbytes = 0

    def close(self) -> None:
        for rd in self.readers:
            rd.close()
        self.writer.close()
        self.ring.unlink()

    def _specs(self) -> list[BatchSpec]:
        i = self.at
        self.at += self.block
        return [self.specs[(i + j) % len(self.specs)] for j in range(self.block)]

    def independent(self) -> tuple[float, float]:
        specs = self._specs()
        per = []
        for st in self.singles:  # each rank's loop in turn, as in a process of its own
            t0 = time.perf_counter_ns()
            for spec in specs:
                self.build(st, spec)
            per.append(time.perf_counter_ns() - t0)
        return sum(per), max(per)

    def one_process(self) -> tuple[float, float]:
        specs = self._specs()
        multi, n = self.multi, self.n
        t0 = time.perf_counter_ns()
        for spec in specs:
            out = self.build(multi, spec)
            for k in range(1, n):
                multi.view(out, k)
        t = time.perf_counter_ns() - t0
        return t, t

    def ring_path(self) -> tuple[float, float]:
        specs = self._specs()
        w = self.writer
        t0 = time.perf_counter_ns()
        for spec in specs:
            w.publish({"step": self.build(w, spec)})
        per = [time.perf_counter_ns() - t0]
        for rd in self.readers:
            t0 = time.perf_counter_ns()
            for _ in specs:
                got = rd.receive()
                assert got is not None
                got.result("step")
            per.append(time.perf_counter_ns() - t0)
        return sum(per), max(per)

    def copies(self) -> tuple[float, float]:
        """``n`` plain copies of the step's staged bytes per step (a ring of buffers per rank)."""
        if not self.nbytes:
            st = self.singles[0].stats
            self.nbytes = max(1, st.bytes // max(1, st.steps))
            self._src = torch.randint(0, 255, (self.nbytes,), dtype=torch.uint8)
            self._dst = [[torch.empty_like(self._src) for _ in range(3)] for _ in range(self.n)]
        t0 = time.perf_counter_ns()
        for j in range(self.block):
            for r in range(self.n):
                self._dst[r][j % 3].copy_(self._src)
        t = time.perf_counter_ns() - t0
        return t, t / self.n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", type=device_arg, default="cpu", help="cpu (simulated devices) or cuda (cuda:0 .. cuda:N-1)")
    ap.add_argument("--ranks", default="2,4,8", help="comma-separated rank counts")
    ap.add_argument("--batches", default="1,64,256,1024", help="decode batch sizes (decode scenario)")
    ap.add_argument("--scenario", choices=("decode", "mixed"), default="decode")
    ap.add_argument("--rounds", type=int, default=7, help="rounds per path (alternating)")
    ap.add_argument("--blocks", type=int, default=6, help="blocks per round")
    ap.add_argument("--block", type=int, default=8, help="consecutive steps per rank in a block")
    ap.add_argument("--warm", type=int, default=12, help="untimed blocks of every path first")
    args = ap.parse_args()
    torch.set_num_threads(1)
    ranks = [int(r) for r in args.ranks.split(",") if r]
    if args.device.startswith("cuda"):
        most = torch.cuda.device_count()
        if any(n > most for n in ranks):
            print(f"# --ranks {args.ranks}: this machine has {most} CUDA device(s); using ranks <= {most}")
            ranks = [n for n in ranks if n <= most]
    if args.scenario == "decode":
        walks = dict(decode_walks(False))
        cases = [(b, walks[b]) for b in (int(x) for x in args.batches.split(",") if x)]
        build: Build = _fused()
    else:
        rng = np.random.default_rng(1)
        cases = [(256, [mixed_spec(rng) for _ in range(16)])]
        build = _composable
    print(f"# {platform.node()} {platform.processor() or platform.machine()}, torch {torch.__version__}, device "
          f"{args.device}, scenario {args.scenario}, {args.rounds} rounds x {args.blocks} blocks x {args.block} steps, "
          f"{time.strftime('%Y-%m-%d')}")
    print(f"{'batch':>6} {'ranks':>5} {'path':<12} {'total us':>9} {'saved x':>8} {'rank us':>8}")
    for batch, specs in cases:
        for n in ranks:
            devices = [f"cuda:{r}" for r in range(n)] if args.device.startswith("cuda") else ["cpu"] * n
            paths = _Paths(n, specs, devices, build, args.block, slot_bytes=8 << 20)
            fns = {"independent": paths.independent, "one-process": paths.one_process, "ring": paths.ring_path}
            if not args.device.startswith("cuda"):  # (a GPU's copies are DMA, not host work)
                fns["copies"] = paths.copies
            for _ in range(args.warm):
                for fn in fns.values():
                    fn()
            totals: dict[str, list[float]] = {p: [] for p in fns}
            busiest: dict[str, list[float]] = {p: [] for p in fns}
            gc.disable()
            try:
                for _ in range(args.rounds):
                    for p, fn in fns.items():
                        tot = rk = 0.0
                        for _ in range(args.blocks):
                            a, b = fn()
                            tot, rk = tot + a, rk + b
                        if args.device.startswith("cuda"):
                            for d in devices:
                                torch.cuda.synchronize(d)  # harness only, between rounds
                        steps = args.blocks * args.block
                        totals[p].append(tot / steps / 1e3)
                        busiest[p].append(rk / steps / 1e3)
            finally:
                gc.enable()
            paths.close()
            base = float(np.median(totals["independent"]))
            for p in fns:
                t = float(np.median(totals[p]))
                saved = f"{base / t:.2f}" if p != "copies" else "-"
                print(f"{batch:>6} {n:>5} {p:<12} {t:>9.1f} {saved:>8} {float(np.median(busiest[p])):>8.1f}")


if __name__ == "__main__":
    main()
