"""Prepare the third-party Mamba kernels that ``tests/kernels/test_mamba_kernels.py`` runs, in the
ignored folder ``.kernels/`` of the checkout. Nothing written here is ever committed.

- ``.kernels/vllm/``: vLLM 0.33.0's Mamba kernel files (:data:`VLLM_FILES`, from
  ``vllm/model_executor/layers/mamba/ops/``), copied byte for byte from an installed vLLM
  (``--vllm-dir``), a wheel (``--vllm-wheel``) or, by default, a wheel this script downloads
  (``pip download --no-deps vllm==0.33.0``, about 340 MB), plus tiny stand-ins, written by this
  script, for the few vLLM modules those files import (:data:`STANDINS`: ``vllm.triton_utils``,
  ``vllm.platforms``, ``vllm.envs``, ``vllm.logger``, ``vllm._custom_ops``,
  ``vllm.utils.platform_utils``, two constants of ``vllm.v1.attention.backends.utils`` and the
  checkpoint metadata type of ``vllm.model_executor.layers.mamba.checkpoint``), and the tuned launch
  configs of ``selective_state_update`` (:data:`VLLM_CONFIGS`). The test imports
  them under their own names and removes them from ``sys.modules`` afterwards, so they never shadow
  a real vLLM.
- ``.kernels/site/``: upstream ``mamba_ssm`` (:data:`MAMBA_SSM`), built as a pure-Python wheel from
  its source release with the CUDA extension skipped (``MAMBA_SKIP_CUDA_BUILD=TRUE
  MAMBA_FORCE_BUILD=TRUE pip wheel --no-deps --no-build-isolation``; torch must be importable by the
  Python that runs this script), and ``einops``, which its Triton modules import; both unpacked.
- ``.kernels/MANIFEST.txt``: where each file came from and its sha256.

The folder is self-contained: carry it to the GPU machine (a device call's ``carry`` option takes
ignored folders) and ``benchmarks/gpu_all.sh OUT mamba-kernels`` runs the test there.

Usage (from the checkout's root, with a Python whose torch imports)::

    python tests/kernels/fetch_kernels.py --vllm-dir /path/to/site-packages/vllm
    python tests/kernels/fetch_kernels.py --vllm-wheel vllm-0.33.0-*.whl
    python tests/kernels/fetch_kernels.py                  # downloads the vLLM wheel
    python tests/kernels/fetch_kernels.py --skip-mamba-ssm  # vLLM only
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

__all__ = ["MAMBA_SSM", "OPS", "STANDINS", "VLLM_CONFIGS", "VLLM_FILES", "VLLM_VERSION", "main"]

ROOT = Path(__file__).resolve().parents[2]
DEST = ROOT / ".kernels"
VLLM_VERSION = "0.33.0"
MAMBA_SSM = "mamba-ssm==2.3.2.post1"
EINOPS = "einops==0.8.2"
OPS = "vllm/model_executor/layers/mamba/ops"
VLLM_FILES = (
    "ssd_combined.py", "ssd_chunk_scan.py", "ssd_chunk_state.py", "ssd_state_passing.py", "ssd_bmm.py",
    "triton_helpers.py", "causal_conv1d.py", "mamba_ssm.py", "ssd_checkpoint.py",
)
"""The kernel files taken from vLLM: the varlen SSD scan, causal conv1d (prefill and update), the
decode state update ``selective_state_update`` (``mamba_ssm.py``) and the prefill-checkpoint store."""
VLLM_CONFIGS = "configs/selective_state_update"
"""The folder (under :data:`OPS`) of vLLM's tuned launch configs for ``selective_state_update``, one JSON
file per head size, state size, device and state dtype (H100's and H200's among them). ``mamba_ssm.py``
reads the one for its device beside itself, and without it launches with a fallback it warns is
sub-optimal; all its files are taken (about 140 KB), so the kernel launches as vLLM's does on any GPU."""

_HEADER = '"""Stand-in written by attnmeta\'s tests/kernels/fetch_kernels.py (not vLLM code): {what}."""\n'
STANDINS: dict[str, str] = {
    "vllm/__init__.py": _HEADER.format(what="the vllm package, holding only its Mamba kernel files"),
    "vllm/model_executor/__init__.py": _HEADER.format(what="package marker"),
    "vllm/model_executor/layers/__init__.py": _HEADER.format(what="package marker"),
    "vllm/model_executor/layers/mamba/__init__.py": _HEADER.format(what="package marker"),
    f"{OPS}/__init__.py": _HEADER.format(what="package marker"),
    "vllm/v1/__init__.py": _HEADER.format(what="package marker"),
    "vllm/v1/attention/__init__.py": _HEADER.format(what="package marker"),
    "vllm/v1/attention/backends/__init__.py": _HEADER.format(what="package marker"),
    "vllm/utils/__init__.py": _HEADER.format(what="package marker"),
    "vllm/triton_utils/__init__.py": _HEADER.format(what="triton and tl")
    + "import triton\nimport triton.language as tl\n\nHAS_TRITON = True\n",
    "vllm/v1/attention/backends/utils.py": _HEADER.format(what="the two slot constants the kernels read")
    + "PAD_SLOT_ID = -1\nNULL_BLOCK_ID = 0\n",
    "vllm/envs.py": _HEADER.format(what="the one setting mamba_ssm.py reads")
    + "VLLM_TUNED_CONFIG_FOLDER = None\n",
    "vllm/_custom_ops.py": _HEADER.format(what="vLLM's compiled ops, used only by selective_scan_fn (not run)"),
    "vllm/logger.py": _HEADER.format(what="init_logger with the *_once methods")
    + "import logging\n\n\nclass _Logger(logging.LoggerAdapter):\n"
    "    def info_once(self, msg, *args, **kwargs):\n"
    "        kwargs.pop('scope', None)\n        self.info(msg, *args, **kwargs)\n\n"
    "    def warning_once(self, msg, *args, **kwargs):\n"
    "        kwargs.pop('scope', None)\n        self.warning(msg, *args, **kwargs)\n\n\n"
    "def init_logger(name):\n    return _Logger(logging.getLogger(name), {})\n",
    "vllm/utils/platform_utils.py": _HEADER.format(what="the device name used to find tuned configs")
    + "import re\n\nfrom vllm.platforms import current_platform\n\n\n"
    "def get_device_name_as_file_name(device_id=0):\n"
    "    return re.sub(r'[\\s/]+', '_', current_platform.get_device_name(device_id))\n",
    "vllm/platforms/__init__.py": _HEADER.format(what="current_platform: CUDA when torch sees a device "
                                                 "and Triton's interpreter is off, never vLLM's CPU ops")
    + "import os\n\nimport torch\n\n\nclass _Platform:\n"
    "    @staticmethod\n    def is_cuda():\n"
    "        return torch.cuda.is_available() and os.environ.get('TRITON_INTERPRET', '0') != '1'\n\n"
    "    @staticmethod\n    def is_cpu():\n        return False\n\n"
    "    @staticmethod\n    def is_xpu():\n        return False\n\n"
    "    @classmethod\n    def is_device_capability(cls, capability, device_id=0):\n"
    "        if not cls.is_cuda():\n            return False\n"
    "        major, minor = torch.cuda.get_device_capability(device_id)\n"
    "        if isinstance(capability, tuple):\n            return (major, minor) == capability\n"
    "        return major * 10 + minor == capability\n\n"
    "    @classmethod\n    def is_arch_support_pdl(cls):\n"
    "        return cls.is_cuda() and torch.cuda.get_device_capability()[0] >= 9\n\n"
    "    @classmethod\n    def get_device_name(cls, device_id=0):\n"
    "        return torch.cuda.get_device_name(device_id) if cls.is_cuda() else 'cpu'\n\n\n"
    "current_platform = _Platform()\n",
    "vllm/model_executor/layers/mamba/checkpoint.py": _HEADER.format(
        what="the prefill-checkpoint metadata type that ssd_checkpoint.py names")
    + "import dataclasses\n\nimport torch\n\n\n@dataclasses.dataclass\nclass MambaPrefillCheckpointMetadata:\n"
    "    checkpoint_offsets: torch.Tensor\n    state_indices: torch.Tensor\n",
}
"""Stand-in modules (path under ``.kernels/vllm/`` -> source), written by this script."""


def _sha256(data: bytes) -> str:
    """Hex sha256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


def _pip(*args: str, env: dict[str, str] | None = None) -> None:
    """Run ``python -m pip ARGS`` with this interpreter, failing loudly."""
    cmd = [sys.executable, "-m", "pip", *args]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env=env)


def _vllm_sources(args: argparse.Namespace, tmp: Path) -> tuple[dict[str, bytes], str]:
    """The kernel files' bytes by name (and :data:`VLLM_CONFIGS`' files, by their path under :data:`OPS`),
    and a description of where they came from.

    Raises
    ------
    SystemExit
        The source is not vLLM :data:`VLLM_VERSION` (without ``--any-version``) or lacks a file.
    """
    if args.vllm_dir is None and args.vllm_wheel is None:
        spec = importlib.util.find_spec("vllm")  # a top-level find_spec imports nothing
        if spec is not None and spec.submodule_search_locations:
            args.vllm_dir = Path(next(iter(spec.submodule_search_locations)))
        else:
            _pip("download", "--no-deps", "--only-binary", ":all:", f"vllm=={VLLM_VERSION}", "-d", str(tmp))
            args.vllm_wheel = next(tmp.glob("vllm-*.whl"))
    if args.vllm_wheel is not None:
        wheel = Path(args.vllm_wheel)
        version = wheel.name.split("-")[1]
        with zipfile.ZipFile(wheel) as z:
            names = set(z.namelist())
            missing = [f for f in VLLM_FILES if f"{OPS}/{f}" not in names]
            if missing:
                raise SystemExit(f"{wheel}: no {', '.join(missing)} under {OPS}")
            files = {f: z.read(f"{OPS}/{f}") for f in VLLM_FILES}
            configs = sorted(n for n in names if n.startswith(f"{OPS}/{VLLM_CONFIGS}/") and n.endswith(".json"))
            files.update({n.removeprefix(f"{OPS}/"): z.read(n) for n in configs})
        where = f"wheel {wheel.name}"
    else:
        pkg = Path(args.vllm_dir).resolve()
        infos = sorted(pkg.parent.glob("vllm-*.dist-info"))
        version = infos[0].name.removesuffix(".dist-info").split("-")[1] if infos else "unknown"
        ops = pkg / OPS.removeprefix("vllm/")
        missing = [f for f in VLLM_FILES if not (ops / f).is_file()]
        if missing:
            raise SystemExit(f"{ops}: no {', '.join(missing)} (is {pkg} a vllm package folder?)")
        files = {f: (ops / f).read_bytes() for f in VLLM_FILES}
        files.update({f"{VLLM_CONFIGS}/{c.name}": c.read_bytes() for c in sorted((ops / VLLM_CONFIGS).glob("*.json"))})
        where = f"installed package {pkg} ({infos[0].name if infos else 'no dist-info'})"
    if version != VLLM_VERSION and not args.any_version:
        raise SystemExit(f"{where} is vLLM {version}, the test is written for {VLLM_VERSION} "
                         "(pass --any-version to use it anyway)")
    return files, where


def write_vllm(args: argparse.Namespace, tmp: Path, manifest: list[str]) -> None:
    """Copy vLLM's kernel files and write the stand-ins into ``.kernels/vllm/`` (replaced whole)."""
    files, where = _vllm_sources(args, tmp)
    out = DEST / "vllm"
    shutil.rmtree(out, ignore_errors=True)
    for rel, text in STANDINS.items():
        p = out / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
        manifest.append(f"standin  {rel}  {_sha256(text.encode())}")
    for name, data in files.items():
        (out / OPS / name).parent.mkdir(parents=True, exist_ok=True)
        (out / OPS / name).write_bytes(data)
        manifest.append(f"vllm     {OPS}/{name}  {_sha256(data)}  from {where}")
    print(f"vLLM {VLLM_VERSION} kernels from {where} -> {out}")


def write_mamba_ssm(args: argparse.Namespace, tmp: Path, manifest: list[str]) -> None:
    """Build the ``mamba_ssm`` wheel from its sdist (or take ``--mamba-wheel``), fetch ``einops``,
    and unpack both into ``.kernels/site/`` (replaced whole).

    Raises
    ------
    SystemExit
        torch does not import in this Python (``mamba_ssm``'s build needs it).
    """
    wheels: list[Path] = []
    if args.mamba_wheel is not None:
        wheels.append(Path(args.mamba_wheel))
    else:
        if importlib.util.find_spec("torch") is None:
            raise SystemExit(f"building {MAMBA_SSM} needs torch importable by {sys.executable}")
        env = dict(os.environ, MAMBA_SKIP_CUDA_BUILD="TRUE", MAMBA_FORCE_BUILD="TRUE")
        _pip("download", "--no-deps", "--no-build-isolation", "--no-binary", ":all:", MAMBA_SSM, "-d", str(tmp),
             env=env)
        sdist = next(tmp.glob("mamba_ssm-*.tar.gz"))
        _pip("wheel", "--no-deps", "--no-build-isolation", str(sdist), "-w", str(tmp), env=env)
        wheels.append(next(tmp.glob("mamba_ssm-*.whl")))
    _pip("download", "--no-deps", "--only-binary", ":all:", EINOPS, "-d", str(tmp))
    wheels.append(next(tmp.glob("einops-*.whl")))
    site = DEST / "site"
    shutil.rmtree(site, ignore_errors=True)
    site.mkdir(parents=True)
    for w in wheels:
        with zipfile.ZipFile(w) as z:
            z.extractall(site)
        manifest.append(f"wheel    {w.name}  {_sha256(w.read_bytes())}  unpacked into site/")
        print(f"{w.name} -> {site}")


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--vllm-dir", type=Path, help="an installed vllm package folder (.../site-packages/vllm)")
    ap.add_argument("--vllm-wheel", type=Path, help="a vllm wheel file")
    ap.add_argument("--any-version", action="store_true", help=f"accept a vLLM other than {VLLM_VERSION}")
    ap.add_argument("--mamba-wheel", type=Path, help="a mamba_ssm wheel built before (skips the build)")
    ap.add_argument("--skip-vllm", action="store_true", help="leave .kernels/vllm as it is")
    ap.add_argument("--skip-mamba-ssm", action="store_true", help="leave .kernels/site as it is")
    args = ap.parse_args(argv)
    DEST.mkdir(exist_ok=True)
    manifest_path = DEST / "MANIFEST.txt"
    old = manifest_path.read_text().splitlines() if manifest_path.exists() else []
    manifest: list[str] = []
    with tempfile.TemporaryDirectory() as t:
        if not args.skip_vllm:
            write_vllm(args, Path(t), manifest)
        else:
            manifest += [line for line in old if line.startswith(("standin", "vllm"))]
        if not args.skip_mamba_ssm:
            write_mamba_ssm(args, Path(t), manifest)
        else:
            manifest += [line for line in old if line.startswith("wheel")]
    manifest_path.write_text("\n".join(manifest) + "\n")
    print(f"wrote {manifest_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
