"""Prepare vLLM 0.33.0's Python package for a machine that cannot reach the network (the GPU machine), in
the ignored folder ``.vllm/`` of the checkout. Nothing written here is ever committed.

What the engine's ``vllm`` metadata mode (``examples/engine/vllm_metadata.py``) and the harness on vLLM's
builders (``tests/integrations/test_vllm_builders.py``) import there: vLLM's own runner buffers
(``vllm.v1.utils.CpuGpuBuffer``, ``vllm.v1.worker.block_table.BlockTable``), its configs and its
FlashInfer, FlashAttention, Mamba2, GDN and MLA metadata builders. None of vLLM's compiled extensions:
its Python code imports them inside ``try`` blocks and the builders never call them.

- ``.vllm/vllm-python.zip``: every ``.py`` and ``.json`` file of the vLLM wheel, and its ``dist-info``
  (about 13 MB; the wheel is 340 MB, almost all compiled kernels and CUDA headers). Unpack it on the GPU
  machine (``python -m zipfile -e .vllm/vllm-python.zip DIR``) and put DIR on ``sys.path``.
- ``.vllm/wheels/``: the packages vLLM's import chain needs that the GPU machine's image lacks
  (:data:`DEPENDENCIES`; about 15 MB), as wheels for CPython 3.12 on manylinux x86-64; install them with
  ``pip install --no-index --no-deps --target DIR .vllm/wheels/*.whl``.
- ``.vllm/cache/modelinfos/``: vLLM's model-info cache of the architectures the engine's and the harness's
  configs resolve to (:data:`ARCHITECTURES`), made here by vLLM's registry (``VLLM_CACHE_ROOT``). On a CUDA
  machine vLLM inspects an architecture by importing its model module, which calls compiled ops at import
  time; with the cache (keyed by the module file's hash) it imports nothing. Needs vLLM importable by the
  Python that runs this script (``bash tests/integrations/install_vllm.sh``), else it is left out with a
  warning.
- ``.vllm/flashinfer.zip`` (with ``--flashinfer``): the FlashInfer release vLLM 0.33.0 pins
  (``flashinfer-python==0.7.2.post1``, read from the vLLM wheel's requirements), trimmed to fit a device
  call: its Python package, its headers (``include``, CUTLASS, CCCL) and the top-level ``csrc`` sources its
  attention wrappers JIT-compile; the ``csrc`` subfolders (sampling, MoE, GDN/KDA, Blackwell-only and other
  kernels vLLM's attention backend never compiles) and CUTLASS's and CCCL's examples, tests and
  Python bindings are left out: 27 MB instead of the wheel's 62 MB. Its
  two pure-Python requirements the image lacks (:data:`FLASHINFER_DEPENDENCIES`) go into ``.vllm/wheels``.
  vLLM's FlashInfer backend does not import with an older FlashInfer (``.whl``'s 0.5.3 lacks names it
  imports), so the engine's ``vllm-graphs`` and ``vllm-eager`` modes need this.
- ``.vllm/MANIFEST.txt``: where each file came from and its sha256.

``benchmarks/gpu_all.sh`` does the unpacking and the install (its ``vllm_site`` helper) for the parts
that need vLLM: carry ``.vllm`` (and ``.whl``, with ``.kernels`` for the hybrid model) in the device call.
With ``.vllm/flashinfer.zip`` it unpacks that FlashInfer ahead of any other on ``PYTHONPATH``, and ``.vllm``
(about 58 MB) needs nothing of ``.whl``: carry ``.vllm`` and ``.kernels`` only (the call's 64 MiB limit).

Usage (from the checkout's root)::

    python tests/kernels/fetch_vllm.py                       # downloads the vLLM wheel (340 MB)
    python tests/kernels/fetch_vllm.py --vllm-wheel vllm-0.33.0-*.whl
    python tests/kernels/fetch_vllm.py --vllm-wheel vllm-0.33.0-*.whl --flashinfer   # + FlashInfer 0.7.2.post1
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

__all__ = ["ARCHITECTURES", "DEPENDENCIES", "FLASHINFER_DEPENDENCIES", "PLATFORMS", "PYTHON", "STANDINS", "VLLM_VERSION", "main"]

ROOT = Path(__file__).resolve().parents[2]
DEST = ROOT / ".vllm"
VLLM_VERSION = "0.33.0"
PYTHON = "3.12"
"""The GPU machine's Python."""
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_26_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux_2_5_x86_64", "manylinux1_x86_64")
DEPENDENCIES = (
    "annotated-types==0.8.0", "cachetools==8.0.2", "cbor2==6.3.0", "fastapi==0.165.0", "httpcore2==2.16.2",
    "httpx2==2.16.2", "jiter==0.19.0", "llguidance==1.6.1", "more-itertools==11.2.1", "msgspec==0.23.0",
    "openai==3.57.0", "openai-harmony==0.0.8", "opentelemetry-api==1.45.2", "truststore==0.10.5",
    "partial-json-parser==0.2.1.1.post7", "pybase64==1.5.1", "pydantic==2.14.4", "pydantic-core==2.50.5",
    "pyzmq==27.3.0", "sniffio==1.3.1", "starlette==1.10.0", "typing-inspection==0.4.5", "xgrammar==0.2.9",
    "compressed-tensors==0.17.0", "loguru==0.7.3",
)
"""What importing vLLM's configs and builders needs beyond the GPU machine's image (torch, transformers,
triton, numpy, aiohttp, psutil, einops, cloudpickle, pillow and the rest are there). Versions that
import together with vLLM 0.33.0 (``llguidance`` is the newest with a wheel for manylinux_2_28)."""

FLASHINFER_DEPENDENCIES = ("apache-tvm-ffi==0.1.15.post2", "nvidia-ml-py==13.615.71", "tabulate==0.10.0")
"""What importing FlashInfer 0.7.2.post1's attention wrappers needs beyond the image and :data:`DEPENDENCIES`
(TVM-FFI, its kernels' binding; ``pynvml`` and ``tabulate``, imported by its ``utils`` and ``autotuner`` at
import time; its other requirements, CuTe DSL, cuda-python, NCCL, serve kernels the attention backend
does not call). With them ``.vllm`` needs nothing of ``.whl``. One requirement left out is consulted:
``nvidia-cudnn-frontend`` (an 11.6 MB wheel, past the device call's 64 MiB carry with the rest), whose
version an eager decode ``plan()`` with ``backend="auto"`` checks to route a plan to cuDNN. The engine's
vllm mode marks it absent (``examples/engine/vllm_metadata.py``: ``mark_absent``), so the check fails at
once instead of searching ``sys.path`` twice a plan; on Hopper the routing is the same either way (cuDNN
takes plans only on SM100/SM103); docs/engine.md, "The vllm metadata mode"."""


STANDINS = {
    "vllm/_C_stable_libtorch.py": '"""Stand-in written by attnmeta\'s tests/kernels/fetch_vllm.py (not vLLM code): '
                                  "vLLM's compiled ops library, which vllm/platforms/cuda.py imports to register "
                                  "its torch ops; the metadata builders call none of them. A few are called when a "
                                  "module is imported or a class defined (quantization/utils/w8a8_utils.py asks, on "
                                  "CUDA, which CUTLASS GEMMs are compiled in; the GDN layer's and DeepSeek's import "
                                  'chains reach it): they are defined here, answering no, as without the kernels."""\n'
                                  "import torch\n\n"
                                  "_LIB = torch.library.Library(\"_C\", \"FRAGMENT\")\n"
                                  "for _name in (\"cutlass_scaled_mm_supports_fp8\", \"cutlass_scaled_mm_supports_block_fp8\",\n"
                                  "              \"cutlass_scaled_mm_supports_fp4\"):\n"
                                  "    try:\n"
                                  "        getattr(torch.ops._C, _name)\n"
                                  "    except (AttributeError, RuntimeError):\n"
                                  "        _LIB.define(_name + \"(int cuda_device_capability) -> bool\")\n"
                                  "        _LIB.impl(_name, lambda cuda_device_capability: False, \"CompositeExplicitAutograd\")\n",
    "vllm/vllm_flash_attn/__init__.py": '"""Stand-in written by attnmeta\'s tests/kernels/fetch_vllm.py (not vLLM code) for '
                                        "vLLM's, which raises without the compiled FlashAttention extensions: the same "
                                        "names from flash_attn_interface, whose availability flags say no extension is "
                                        'here (FlashAttention\'s builder then plans no ahead-of-time schedule)."""\n'
                                        "from vllm.vllm_flash_attn.flash_attn_interface import (  # noqa: F401\n"
                                        "    FA2_AVAILABLE, FA3_AVAILABLE, compile_flash_attn_varlen_func_from_specs,\n"
                                        "    fa_version_unsupported_reason, flash_attn_varlen_func, get_scheduler_metadata,\n"
                                        "    is_fa_version_supported)\n",
}
"""Stand-ins put into the zip (replacing the wheel's file of that name, if any) for what vLLM's import chain
needs of its compiled extensions: imported without a ``try``, never called by the metadata builders."""


ARCHITECTURES = ("LlamaForCausalLM", "Qwen3NextForCausalLM", "TransformersForCausalLM", "TransformersEmbeddingModel",
                 "TransformersMoEEmbeddingModel", "DeepseekV2ForCausalLM")
"""What the engine's Llama (``LlamaForCausalLM``), its Bamba and the harness's configs without an
``architectures`` entry (vLLM 0.33.0 has no Bamba class: the Transformers fallbacks), and the harness's
MLA model (``DeepseekV2ForCausalLM``) resolve to."""


def write_model_infos(manifest: list[str]) -> None:
    """vLLM's model-info cache of :data:`ARCHITECTURES` into ``.vllm/cache`` (a warning without vLLM)."""
    import importlib.util
    import os

    if importlib.util.find_spec("vllm") is None:
        print(f"warning: vLLM is not importable by {sys.executable}: no model-info cache (the vllm parts need it on "
              "a CUDA machine; bash tests/integrations/install_vllm.sh, then run this script with that Python)")
        return
    cache = DEST / "cache"
    shutil.rmtree(cache, ignore_errors=True)
    code = ("from vllm.model_executor.models.registry import ModelRegistry\n"
            f"for a in {ARCHITECTURES!r}:\n    ModelRegistry.models[a].inspect_model_cls()\n")
    subprocess.run([sys.executable, "-c", code], check=True, env=dict(os.environ, VLLM_CACHE_ROOT=str(cache)))
    for f in sorted((cache / "modelinfos").glob("*.json")):
        manifest.append(f"cache    {f.relative_to(DEST)}  {_sha256(f.read_bytes())}")
    print(f"model-info cache of {len(ARCHITECTURES)} architectures -> {cache}")


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _pip(*args: str) -> None:
    """Run ``python -m pip ARGS`` with this interpreter, failing loudly."""
    cmd = [sys.executable, "-m", "pip", *args]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def _keep(name: str) -> bool:
    """Whether a wheel entry goes into the zip: Python sources, JSON configs, the dist-info (no RECORD:
    its hashes name files left out)."""
    return name.endswith((".py", ".json", ".typed")) or (".dist-info/" in name and not name.endswith("RECORD"))


def write_python(wheel: Path, manifest: list[str]) -> None:
    """vLLM's Python files from ``wheel`` into ``.vllm/vllm-python.zip``."""
    version = wheel.name.split("-")[1]
    if version != VLLM_VERSION:
        raise SystemExit(f"{wheel.name} is vLLM {version}; the engine's vllm mode is written for {VLLM_VERSION}")
    out = DEST / "vllm-python.zip"
    kept = 0
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            if _keep(info.filename) and info.filename not in STANDINS:
                dst.writestr(info, src.read(info))
                kept += 1
        for name, text in STANDINS.items():
            dst.writestr(name, text)
            manifest.append(f"standin  {name}  {_sha256(text.encode())}")
    manifest.append(f"zip      {out.name}  {_sha256(out.read_bytes())}  {kept} files of {wheel.name}")
    print(f"{kept} files of {wheel.name} -> {out} ({out.stat().st_size / 2**20:.1f} MB)")


def _pinned_flashinfer(wheel: Path) -> str:
    """The ``flashinfer-python==VERSION`` requirement of the vLLM ``wheel``'s metadata."""
    with zipfile.ZipFile(wheel) as src:
        meta = next(n for n in src.namelist() if n.endswith(".dist-info/METADATA"))
        for line in src.read(meta).decode().splitlines():
            if line.startswith("Requires-Dist: flashinfer-python=="):
                return line.split(": ", 1)[1].split(";")[0].strip()
    raise SystemExit(f"{wheel.name} names no flashinfer-python pin")


_FLASHINFER_LEFT_OUT = ("flashinfer/data/cutlass/examples/", "flashinfer/data/cutlass/python/",
                        "flashinfer/data/cutlass/test/", "flashinfer/data/cccl/python/")
"""Folders of the bundled CUTLASS and CCCL that are no include path: examples, tests, Python bindings."""


def _flashinfer_keeps(name: str) -> bool:
    """Whether a FlashInfer wheel entry goes into ``flashinfer.zip``: all but the ``csrc`` subfolders,
    :data:`_FLASHINFER_LEFT_OUT` and the RECORD (its hashes name files left out)."""
    parts = name.split("/")
    in_csrc_subfolder = parts[:3] == ["flashinfer", "data", "csrc"] and len(parts) > 4
    return (not in_csrc_subfolder and not name.startswith(_FLASHINFER_LEFT_OUT)
            and not name.endswith(".dist-info/RECORD"))


def write_flashinfer(wheel: Path, tmp: Path, manifest: list[str]) -> None:
    """vLLM's pinned FlashInfer, trimmed, into ``.vllm/flashinfer.zip``."""
    req = _pinned_flashinfer(wheel)
    got = tmp / "flashinfer"
    _pip("download", "-q", "--no-deps", "--only-binary", ":all:", "-d", str(got), req)
    fi_wheel = next(got.glob("flashinfer_python-*.whl"))
    out = DEST / "flashinfer.zip"
    kept = 0
    with zipfile.ZipFile(fi_wheel) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as dst:
        for info in src.infolist():
            if _flashinfer_keeps(info.filename):
                dst.writestr(info, src.read(info))
                kept += 1
    manifest.append(f"zip      {out.name}  {_sha256(out.read_bytes())}  {kept} files of {fi_wheel.name}")
    print(f"{kept} files of {fi_wheel.name} -> {out} ({out.stat().st_size / 2**20:.1f} MB)")


def write_wheels(tmp: Path, manifest: list[str], flashinfer: bool) -> None:
    """The wheels of :data:`DEPENDENCIES` (and :data:`FLASHINFER_DEPENDENCIES` with ``flashinfer``) for the
    GPU machine into ``.vllm/wheels/`` (replaced whole)."""
    got = tmp / "deps"
    platforms = [a for p in PLATFORMS for a in ("--platform", p)]
    for req in DEPENDENCIES + (FLASHINFER_DEPENDENCIES if flashinfer else ()):
        _pip("download", "-q", "--no-deps", "--only-binary", ":all:", "--python-version", PYTHON,
             "--implementation", "cp", *platforms, "-d", str(got), req)
    out = DEST / "wheels"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    for w in sorted(got.glob("*.whl")):
        shutil.copy2(w, out / w.name)
        manifest.append(f"wheel    {w.name}  {_sha256(w.read_bytes())}")
    print(f"{len(list(out.glob('*.whl')))} dependency wheels -> {out}")


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--vllm-wheel", type=Path, help="a vllm 0.33.0 wheel file (default: download it)")
    ap.add_argument("--skip-wheels", action="store_true", help="leave .vllm/wheels as it is")
    ap.add_argument("--flashinfer", action="store_true",
                    help="also pack the FlashInfer vLLM pins (trimmed, 27 MB) for the vllm-graphs/vllm-eager modes")
    args = ap.parse_args(argv)
    DEST.mkdir(exist_ok=True)
    manifest_path = DEST / "MANIFEST.txt"
    old = manifest_path.read_text().splitlines() if manifest_path.exists() else []
    manifest: list[str] = []
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        wheel = args.vllm_wheel
        if wheel is None:
            _pip("download", "--no-deps", "--only-binary", ":all:", f"vllm=={VLLM_VERSION}", "-d", str(tmp))
            wheel = next(tmp.glob("vllm-*.whl"))
        write_python(Path(wheel), manifest)
        write_model_infos(manifest)
        (DEST / "flashinfer.zip").unlink(missing_ok=True)
        if args.flashinfer:
            write_flashinfer(Path(wheel), tmp, manifest)
        if not args.skip_wheels:
            write_wheels(tmp, manifest, args.flashinfer)
        else:
            manifest += [line for line in old if line.startswith("wheel")]
    manifest_path.write_text("\n".join(manifest) + "\n")
    print(f"wrote {DEST / 'MANIFEST.txt'}; carry .vllm in the device call")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
