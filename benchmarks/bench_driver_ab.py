"""The decode step with the commit's driver path on and off, in ONE process (CUDA only).

Two eager stagers on the same device, one with the driver fast path (``attnmeta.staging._driver``)
and one forced onto torch's ``copy_`` + ``Event.record``; each round runs ``--steps`` consecutive
decode steps (common + FlashAttention + FlashInfer metadata, the 64-step walk of
``bench_decode.py``) on each stager in turn, so both see the same machine state. Prints, per batch
size, the best and the median round median of the whole step and the best round median of the
commit alone (host microseconds).

Run on the GPU machine: ``python benchmarks/bench_driver_ab.py [--rounds 12] [--steps 300]``.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import sys
import time
from pathlib import Path

import numpy as np
import torch

if importlib.util.find_spec("attnmeta") is None:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attnmeta.testing.workloads import advance, decode_spec
from attnmeta.backends import flash_attn, flashinfer
from attnmeta.metadata import stage_common
from attnmeta.staging import Stager


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_driver_ab: needs a CUDA device")
    torch.set_num_threads(1)
    pc = time.perf_counter_ns
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}, "
          f"{args.rounds} rounds x {args.steps} steps per stager, host us")
    gc.disable()
    try:
        for b in (1, 64, 256, 1024):
            specs = advance(decode_spec(b, np.random.default_rng(0)), 64)
            stagers = {"driver": Stager("cuda"), "torch": Stager("cuda")}
            if stagers["driver"]._driver is None:
                sys.exit("bench_driver_ab: the driver path is unavailable here (libcuda, ATTNMETA_DRIVER_COPY)")
            stagers["torch"]._driver = None
            step_med: dict[str, list[float]] = {k: [] for k in stagers}
            commit_med: dict[str, list[float]] = {k: [] for k in stagers}
            for _ in range(args.rounds):
                for name, st in stagers.items():
                    ts, cs = [], []
                    for i in range(args.steps):
                        spec = specs[i % len(specs)]
                        t0 = pc()
                        step = st.step()
                        c = stage_common(spec, step, paged_kv=True)
                        fa, fi = flash_attn.stage(c, step), flashinfer.stage(c, step)
                        t1 = pc()
                        step.commit()
                        t2 = pc()
                        c.result(), fa.result(), fi.result()
                        ts.append((pc() - t0) / 1e3)
                        cs.append((t2 - t1) / 1e3)
                    torch.cuda.synchronize()  # harness only, between rounds
                    step_med[name].append(float(np.median(ts[args.steps // 10:])))
                    commit_med[name].append(float(np.median(cs[args.steps // 10:])))
            print(f"batch {b:>5}: " + " | ".join(
                f"{k}: step best {min(v):.1f} median {np.median(v):.1f}, commit best {min(commit_med[k]):.1f}"
                for k, v in step_med.items()), flush=True)
    finally:
        gc.enable()


if __name__ == "__main__":
    main()
