"""docs/extending.md's builder, registered as a built-in one of a copy of the package, passes every
repository rule (tests/test_repo_rules.py: lint, types, documented public API, private names, no import
circle, production apart from the lab, references apart from what they check): the guide describes a
builder the repository would accept, not one its own rules would turn away."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def _module_blocks() -> tuple[str, str]:
    """The guide's builder module and its lab module: the two blocks that are whole modules (they open
    with a docstring)."""
    blocks = [b for b in _BLOCK.findall((ROOT / "docs" / "extending.md").read_text()) if b.startswith('"""')]
    assert len(blocks) == 2, "docs/extending.md: expected the builder module and the lab module as whole blocks"
    return blocks[0], blocks[1]


def test_the_guides_builder_as_a_builtin_passes_every_repo_rule(tmp_path: Path) -> None:
    pytest.importorskip("mypy", reason="mypy not installed (pip install -e '.[dev]')")
    builder, labs = _module_blocks()
    ignore = shutil.ignore_patterns("__pycache__", "*.nbi", "*.nbc")
    for part in ("attnmeta", "examples", "benchmarks", ".mypy_cache"):
        if (ROOT / part).exists():
            shutil.copytree(ROOT / part, tmp_path / part, ignore=ignore)
    (tmp_path / "tests").mkdir()
    shutil.copy2(ROOT / "tests" / "test_repo_rules.py", tmp_path / "tests")
    shutil.copy2(ROOT / "pyproject.toml", tmp_path)
    pkg = tmp_path / "attnmeta"
    (pkg / "backends" / "query_lens.py").write_text(builder)
    init = pkg / "backends" / "__init__.py"
    text = init.read_text()
    text = text.replace("local_attn, mamba, mla, mm_prefix\n", "local_attn, mamba, mla, mm_prefix, query_lens\n")
    text = text.replace('"mla", "mm_prefix"]', '"mla", "mm_prefix", "query_lens"]')
    assert "query_lens" in text.split("__all__")[1], "attnmeta/backends/__init__.py changed shape: update this test"
    init.write_text(text)
    (pkg / "testing" / "labs" / "query_lens.py").write_text(labs)
    labs_init = pkg / "testing" / "labs" / "__init__.py"
    text = labs_init.read_text()
    text = text.replace("from attnmeta.testing.labs.mm_prefix import ENTRIES as _MM_PREFIX",
                        "from attnmeta.testing.labs.mm_prefix import ENTRIES as _MM_PREFIX\n"
                        "from attnmeta.testing.labs.query_lens import ENTRIES as _QUERY_LENS")
    text = text.replace("**_MM_PREFIX}", "**_MM_PREFIX, **_QUERY_LENS}")
    assert "_QUERY_LENS}" in text, "attnmeta/testing/labs/__init__.py changed shape: update this test"
    labs_init.write_text(text)
    ruff = Path(sys.executable).with_name("ruff")
    if ruff.exists():  # (the two import lines this test added, formatted as a developer's editor would)
        subprocess.run([str(ruff), "check", "--fix", "-q", "--select", "I", str(init), str(labs_init)], check=False)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    check = subprocess.run([sys.executable, "-c", "import attnmeta; from attnmeta.testing.lab import lab; "
                            "print(attnmeta.get_builder('query_lens').name, lab('query_lens').has_reference)"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert check.stdout.split() == ["query_lens", "True"], check.stderr  # the copy, registered as built in
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_repo_rules.py"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
