"""Cold start: the first build of every builder in a fresh process, without and with a warmed cache.

Every measurement runs in a fresh Python process with ``NUMBA_CACHE_DIR`` set to a directory of
this script's own (never the checkout's ``__pycache__``):

1. **cold**: an empty cache directory. The process imports attnmeta, constructs the demo batch's
   ``BatchSpec`` (``attnmeta.bench.demo.demo_spec``: decodes, a chunked prefill, a fresh prefill, prompts,
   CUDA-graph padding), then builds every registered builder once with its lab defaults, each
   through ``Builder.build`` on one eager CPU stager, in alphabetical order of their names, then the fused step builder
   (4 builds: compose, then a replay); each first build is timed. A builder's time is what it
   compiles that the builders before it did not (the common pass is compiled by the first one).
2. **warmup**: ``python -m attnmeta warmup`` on a second, empty cache directory (timed as a process).
3. **after warmup**: the measurement of 1 in a new process with the warmed cache directory.
4. **warmup again**: ``python -m attnmeta warmup`` with the warmed cache: every kernel is loaded.

The table gives the seconds of each first build, cold and after warmup, and the totals.
``--quick`` (the test suite's setting) measures ``flash_attn`` only and runs no warmup: the second
measurement reads the cache the cold run filled (which holds every kernel it builds), and the warmup
line says it did not run. A warmup on an empty cache compiles every variant whatever builders it is
given (a minute or more on a 2-core machine), and ``python -m attnmeta warmup`` has tests of its own.

Run: ``python benchmarks/bench_cold_start.py [--quick] [--keep]`` (a few minutes on a 2-core VM).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_FIND = importlib.util.find_spec("attnmeta")
# The children import the same attnmeta as this script would (a checkout without `pip install -e .`
# included).
PKG_PARENT = str(Path(_FIND.origin).resolve().parents[1]) if _FIND and _FIND.origin else str(
    Path(__file__).resolve().parents[1])

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import attnmeta
from attnmeta import Stager
from attnmeta.backends.fused import FusedStepBuilder
from attnmeta.bench.demo import demo_spec
from attnmeta.testing.lab import lab
rows = [("import attnmeta", time.perf_counter() - t0)]
only = set(sys.argv[1:])
t = time.perf_counter()
spec = demo_spec()
rows.append(("BatchSpec", time.perf_counter() - t))
stager = Stager("cpu")
for name, builder in sorted(attnmeta.registry().items()):
    if only and name not in only:
        continue
    options, inputs = lab(builder).defaults(spec)
    t = time.perf_counter()
    builder.build(spec, stager, options, inputs)
    rows.append((name, time.perf_counter() - t))
fused = FusedStepBuilder(stager)
t = time.perf_counter()
for _ in range(4):
    fused.build(spec)
rows.append(("fused (4 builds)", time.perf_counter() - t))
print(json.dumps(rows))
"""


def _env(cache: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_")}
    env["NUMBA_CACHE_DIR"] = cache
    env["PYTHONPATH"] = os.pathsep.join([PKG_PARENT, *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


def _run(args: list[str], cache: str) -> tuple[str, float]:
    """Run ``python args`` with ``cache`` as numba's cache; its standard output and wall seconds."""
    t = time.perf_counter()
    done = subprocess.run([sys.executable, *args], env=_env(cache), capture_output=True, text=True, timeout=1200)
    wall = time.perf_counter() - t
    if done.returncode:
        sys.exit(f"{' '.join(args[:2])} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout, wall


def _first_builds(cache: str, builders: list[str]) -> tuple[list[tuple[str, float]], float]:
    out, wall = _run(["-c", CHILD, *builders], cache)
    rows: list[Any] = json.loads(out.strip().splitlines()[-1])
    return [(str(n), float(s)) for n, s in rows], wall


def _warmup(cache: str, builders: list[str]) -> float:
    return _run(["-m", "attnmeta", "warmup", "--quiet", *(f"--builder={b}" for b in builders)], cache)[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="flash_attn only, and no warmup: the second measurement "
                                                             "reads the cache the cold run filled")
    parser.add_argument("--keep", action="store_true", help="keep the cache directories (printed) for inspection")
    args = parser.parse_args()
    builders = ["flash_attn"] if args.quick else []
    root = tempfile.mkdtemp(prefix="attnmeta-cold-start-")
    cold_dir, warm_dir = os.path.join(root, "cold"), os.path.join(root, "warm")
    os.makedirs(cold_dir)
    os.makedirs(warm_dir)
    try:
        cold, _ = _first_builds(cold_dir, builders)
        warm_cache = cold_dir if args.quick else warm_dir
        warmup_s = None if args.quick else _warmup(warm_cache, builders)
        warm, _ = _first_builds(warm_cache, builders)
        again_s = None if args.quick else _warmup(warm_cache, builders)
    finally:
        if args.keep:
            print(f"# cache directories kept: {cold_dir} {warm_dir}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    print(f"# {platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"python {platform.python_version()}, {time.strftime('%Y-%m-%d')}"
          f"{', --quick (flash_attn only)' if args.quick else ''}")
    print(f"{'first build (s)':<20} {'cold':>8} {'cache filled' if args.quick else 'after warmup':>13}")
    after = dict(warm)
    for name, s in cold:
        print(f"{name:<20} {s:>8.3f} {after[name]:>13.3f}")
    builds = [n for n, _ in cold if n != "import attnmeta"]
    print(f"{'all first builds':<20} {sum(dict(cold)[n] for n in builds):>8.3f} "
          f"{sum(after[n] for n in builds):>13.3f}")
    if warmup_s is None or again_s is None:
        print("python -m attnmeta warmup: not run (--quick; the second column read the cold run's cache)")
    else:
        print(f"python -m attnmeta warmup: {warmup_s:.1f} s on an empty cache, {again_s:.1f} s on the warmed one "
              f"(process wall time)")


if __name__ == "__main__":
    main()
