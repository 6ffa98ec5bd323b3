"""Deployment: a read-only install imports and caches elsewhere; warmup covers what engines hit; the
pytest plugin is light; the distribution installs the plugin module.

The read-only install is tested for real: a copy of the package in a directory the test process
cannot write, a home it cannot write, run by a user without write access to either (this user when
it is not root; as root, ``nobody`` through ``setpriv`` when it can run this interpreter, else root
without the capabilities that bypass file permissions). Timings are never asserted.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOBODY = 65534
_DROP_CAPS = ["--bounding-set=-dac_override,-dac_read_search,-fowner", "--inh-caps=-all"]
_WARNING = "RuntimeWarning: attnmeta: numba cannot cache compiled kernels"


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("NUMBA_", "XDG_", "PYTHON", "ATTNMETA_")) and k not in ("HOME", "TMPDIR")}
    env.update(extra)
    return env


def _runner(probe_dir: Path) -> tuple[list[str], int]:
    """A command prefix that runs Python without write access to read-only files and directories
    (checked on ``probe_dir``), and the uid it runs as; skips when there is none."""
    if os.geteuid() != 0:
        return [], os.getuid()
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without setpriv (util-linux): no way to run Python without write access")
    check = [sys.executable, "-c", "import numba, torch, numpy; open(__import__('sys').argv[1] + '/x', 'w')",
             str(probe_dir)]
    as_nobody = [setpriv, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    refused = f"PermissionError: [Errno 13] Permission denied: '{probe_dir / 'x'}'"
    tried = subprocess.run([*as_nobody, *check], capture_output=True, text=True, env=_clean_env(), timeout=120)
    if tried.returncode != 0 and refused in tried.stderr:
        return as_nobody, NOBODY  # nobody runs this interpreter and cannot write the probe directory
    why_nobody = (tried.stderr.strip().splitlines() or ["wrote the probe"])[-1]
    dropped = [setpriv, *_DROP_CAPS]
    tried = subprocess.run([*dropped, *check], capture_output=True, text=True, env=_clean_env(), timeout=120)
    if tried.returncode != 0 and refused in tried.stderr:
        return dropped, 0
    why_caps = (tried.stderr.strip().splitlines() or ["wrote the probe"])[-1]
    pytest.skip(f"cannot run {sys.executable} without write access: as uid {NOBODY}: {why_nobody}; "
                f"as root without CAP_DAC_OVERRIDE: {why_caps}")


def _read_only(path: Path) -> None:
    for p in [path, *path.rglob("*")]:
        p.chmod(0o555 if p.is_dir() else 0o444)


@pytest.fixture
def read_only_install() -> Iterator[dict[str, Path]]:
    """A copy of attnmeta (no caches) and a home directory, both read-only, in a directory every user
    can traverse; ``tmp`` is writable by the user the runner runs as."""
    top = Path(tempfile.mkdtemp(prefix="attnmeta-ro-"))
    try:
        top.chmod(0o755)
        site, home, tmp, probe = top / "site", top / "home", top / "tmp", top / "probe"
        shutil.copytree(ROOT / "attnmeta", site / "attnmeta", ignore=shutil.ignore_patterns("__pycache__", "*.nb[ic]"))
        for d in (home, tmp, probe):
            d.mkdir()
        _read_only(site)
        _read_only(home)
        _read_only(probe)
        yield {"site": site, "home": home, "tmp": tmp, "probe": probe}
    finally:
        for p in [top, *top.rglob("*")]:
            if p.is_dir() and not p.is_symlink():
                p.chmod(stat.S_IRWXU)
        shutil.rmtree(top, ignore_errors=True)


CHILD = r"""
import json, os, sys
pkg, home = sys.argv[1], sys.argv[2]
for d in (pkg, home):  # the premise: this process can write neither
    try:
        open(os.path.join(d, "probe"), "w").close()
    except OSError:
        pass
    else:
        sys.exit(f"premise broken: {d} is writable")
import attnmeta
from attnmeta import _numba
from attnmeta._intdiv import pow2_shift
assert pow2_shift(16) == 4
stats = pow2_shift.stats
info = _numba.cache_info()
print(json.dumps({"file": attnmeta.__file__, "fallback": info.fallback, "directory": info.directory,
                  "hits": sum(stats.cache_hits.values()), "misses": sum(stats.cache_misses.values())}))
"""


def _import_read_only(prefix: list[str], dirs: dict[str, Path], tmp: Path) -> tuple[dict[str, object], str]:
    site = dirs["site"]
    env = _clean_env(HOME=str(dirs["home"]), TMPDIR=str(tmp), PYTHONPATH=str(site))
    done = subprocess.run([*prefix, sys.executable, "-c", CHILD, str(site / "attnmeta"), str(dirs["home"])],
                          capture_output=True, text=True, env=env, cwd=str(dirs["home"]), timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert str(out["file"]).startswith(str(site)), out  # the read-only copy, not the checkout
    return out, done.stderr


def test_a_read_only_install_imports_and_caches_in_a_private_temporary_folder(
        read_only_install: dict[str, Path]) -> None:
    """Package and home not writable: ``import attnmeta`` works, says once where the cache went, the
    kernels are cached there, and the next process loads them."""
    prefix, uid = _runner(read_only_install["probe"])
    tmp = read_only_install["tmp"]
    os.chown(tmp, uid, -1)
    first, err = _import_read_only(prefix, read_only_install, tmp)
    assert err.count(_WARNING) == 1, err
    assert first["fallback"] is True and first["misses"] == 1 and first["hits"] == 0
    folder = Path(str(first["directory"]))
    assert folder.parent == tmp and folder.name.startswith("attnmeta-numba-cache-"), folder
    assert f"caches them in {folder} instead" in err and "NUMBA_CACHE_DIR" in err, err
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert list(folder.rglob("_intdiv.pow2_shift-*.nbi")), sorted(folder.rglob("*"))
    again, err = _import_read_only(prefix, read_only_install, tmp)
    assert err.count(_WARNING) == 1, err
    assert again["hits"] == 1 and again["misses"] == 0  # loaded from the fallback cache


def test_without_a_usable_fallback_the_kernels_are_not_cached_and_it_says_so(
        read_only_install: dict[str, Path]) -> None:
    """The fallback folder's name taken by a file (or by another user's folder): no on-disk cache."""
    prefix, uid = _runner(read_only_install["probe"])
    tmp = read_only_install["tmp"]
    os.chown(tmp, uid, -1)
    taken = tmp / f"attnmeta-numba-cache-{uid}"
    taken.write_text("not a directory")
    out, err = _import_read_only(prefix, read_only_install, tmp)
    assert err.count(_WARNING) == 1, err
    assert f"The fallback {taken} cannot be used either" in err, err
    assert "not cached on disk" in err and "NUMBA_CACHE_DIR" in err, err
    assert out["fallback"] is True and out["directory"] is None and out["misses"] == 1


def test_a_fallback_folder_that_is_not_private_is_refused(tmp_path: Path) -> None:
    """The cache is pickled code: a folder in the shared temporary directory is used only if it is a
    real directory of this user's that no one else may write."""
    from attnmeta import _numba

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    assert _numba._private_dir(str(shared)) == "another user owns it or may write to it"
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    assert _numba._private_dir(str(link)) == "it is not a directory"
    fresh = tmp_path / "fresh"
    assert _numba._private_dir(str(fresh)) is None
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o700


# ------------------------------------------------------------------------------------------- warmup
WORKLOAD = r"""
import dataclasses, sys
import numpy as np
import attnmeta
from attnmeta import Stager, StaticProfile, _numba
from attnmeta.backends.fused import FusedStepBuilder
from attnmeta.testing.lab import lab
from attnmeta.testing.workloads import KINDS, random_spec

report = attnmeta.warmup(progress=False)
assert report.compiled + report.loaded > 0, report  # a fresh process has no kernel in memory
again = attnmeta.warmup(progress=False, builders=["flash_attn"], parallel=False)
assert (again.compiled, again.loaded) == (0, 0), again  # ... and now has every one it needs
before = {id(k): set(k.overloads) for k in _numba.kernels()}
profile = StaticProfile(max_num_reqs=32, max_num_tokens=32768, max_blocks_per_req=512, block_size=16)
eager = Stager("cpu")
for seed in range(int(sys.argv[1])):
    rng = np.random.default_rng(1000 + seed)
    for name, builder in sorted(attnmeta.registry().items()):
        for kind in KINDS:
            spec = random_spec(rng, kind)
            options, inputs = lab(builder).sample(spec, rng)
            if builder.unsupported_reasons(spec, builder.options(options), builder.inputs(inputs)):
                continue
            graph = Stager("cpu", profile=dataclasses.replace(
                profile, chunk_size=getattr(options, "chunk_size", profile.chunk_size)))
            for stager in (eager, graph):
                builder.build(spec, stager, options, inputs)
    fused = FusedStepBuilder(eager)
    for kind in KINDS:
        spec = random_spec(rng, kind)
        for _ in range(eager.num_slots + 1):
            fused.build(spec)
new = sorted(f"{k.py_func.__module__}.{k.__name__}{sorted(map(str, set(k.overloads) - before[id(k)]))}"
             for k in _numba.kernels() if set(k.overloads) - before[id(k)])
print("\n".join(new) or "none")
"""


def test_after_warmup_random_workloads_need_no_new_kernel() -> None:
    """In a fresh process: after ``warmup()`` every builder over random batches of every kind (with its
    own random options, eager and in graph mode) and the fused step builder use only kernel
    specializations that warmup already compiled or loaded."""
    done = subprocess.run([sys.executable, "-c", WORKLOAD, "4"], capture_output=True, text=True, cwd=ROOT,
                          timeout=600, env=_clean_env(PYTHONPATH=str(ROOT)))
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip().splitlines()[-1] == "none", "specializations warmup missed:\n" + done.stdout


def test_warmup_reports_every_stage_in_order() -> None:
    import attnmeta

    lines: list[str] = []
    report = attnmeta.warmup(progress=lines.append, builders=["flash_attn", "cascade"], parallel=False)
    names = [s.name for s in report.stages]
    assert names == ["BatchSpec", "common", "flash_attn", "cascade", "fused"]
    assert report.builders == ("flash_attn", "cascade")
    assert all(s.builds > 0 for s in report.stages), report.stages
    assert [line.split(" (")[0] for line in lines[:-1]] == [f"warmup: {n}" for n in names]
    assert lines[0].startswith("warmup: BatchSpec (1/5) ") and lines[-2].startswith("warmup: fused (5/5) ")
    assert lines[-1] == report.summary() and "kernel specializations compiled" in lines[-1]
    assert report.compiled == sum(s.compiled for s in report.stages)
    assert report.loaded == sum(s.loaded for s in report.stages)
    with pytest.raises(KeyError, match="no builder named 'nope'"):
        attnmeta.warmup(progress=False, builders=["nope"])


# ------------------------------------------------------------------------------------------- the pytest plugin
def test_the_pytest_plugin_imports_neither_torch_nor_numba() -> None:
    code = ("import sys, attnmeta_pytest_plugin\n"
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numba', 'numpy', 'attnmeta'))\n"
            "assert not heavy, heavy\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env=_clean_env(PYTHONPATH=str(ROOT)))
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_distribution_installs_the_light_plugin_as_the_entry_point(tmp_path: Path) -> None:
    """The wheel holds the top-level plugin module and points the ``pytest11`` entry point at it; the
    installed module imports without torch or numba."""
    for mod in ("setuptools", "wheel"):
        pytest.importorskip(mod, reason=f"{mod} is needed to build the wheel (pip install {mod})")
    src = tmp_path / "src"
    shutil.copytree(ROOT / "attnmeta", src / "attnmeta", ignore=shutil.ignore_patterns("__pycache__", "*.nb[ic]"))
    for name in ("pyproject.toml", "README.md", "LICENSE", "attnmeta_pytest_plugin.py"):
        shutil.copy(ROOT / name, src / name)
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                           str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("attnmeta-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        assert "attnmeta_sync = attnmeta_pytest_plugin" in z.read(entry_points).decode()
        assert "attnmeta_pytest_plugin.py" in names and "attnmeta/testing/pytest_plugin.py" in names
        # the license travels with the wheel; the metadata names it, with classifiers; no test-only extra
        assert any(n.endswith(".dist-info/licenses/LICENSE") or n.endswith(".dist-info/LICENSE") for n in names), names
        (meta,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        metadata = z.read(meta).decode()
        assert "Apache" in metadata and "Classifier: License :: OSI Approved :: Apache Software License" in metadata
        assert "Provides-Extra: vllm-test" not in metadata
        z.extractall(tmp_path / "site")
    code = ("import sys, attnmeta_pytest_plugin as p\n"
            f"assert p.__file__.startswith({str(tmp_path / 'site')!r}), p.__file__\n"
            "assert 'torch' not in sys.modules and 'numba' not in sys.modules\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120,
                          env=_clean_env(PYTHONPATH=str(tmp_path / "site")))
    assert done.returncode == 0, done.stderr[-3000:]
