"""House rules checked on every CI run: lint, types, numba config, host purity, docstrings."""

from __future__ import annotations

import ast
import importlib
import inspect
import itertools
import pkgutil
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import attnmeta

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "attnmeta"


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(shutil.which("ruff") is None and not Path(sys.executable).with_name("ruff").exists(),
                    reason="ruff not installed (pip install -e '.[dev]')")
def test_ruff_clean() -> None:
    ruff = str(Path(sys.executable).with_name("ruff")) if Path(sys.executable).with_name("ruff").exists() else "ruff"
    r = _run(ruff, "check", "attnmeta", "tests", "benchmarks", "examples")
    assert r.returncode == 0, r.stdout + r.stderr


def test_mypy_clean() -> None:
    """mypy as configured (pyproject.toml: strict, over the package and the reference engine,
    examples/engine, in one run: the engine's check reads the package's analysis instead of redoing it)."""
    pytest.importorskip("mypy", reason="mypy not installed (pip install -e '.[dev]')")
    config = (ROOT / "pyproject.toml").read_text().split("[tool.mypy]")[1].split("\n[")[0]
    assert re.search(r'^files = \["attnmeta", "examples/engine"\]', config, re.M) and "\nstrict = true" in config, config
    r = _run(sys.executable, "-m", "mypy")
    assert r.returncode == 0, r.stdout + r.stderr


def test_no_raw_numba_njit_outside_the_config_module() -> None:
    bad = []
    for f in PKG.rglob("*.py"):
        if f.name == "_numba.py":
            continue
        text = f.read_text()
        if re.search(r"numba\.(njit|jit)\s*\(|from numba import .*\b(njit|jit)\b|@numba\.", text):
            bad.append(str(f.relative_to(ROOT)))
    assert not bad, f"use attnmeta._numba.njit, not numba directly: {bad}"


def test_host_package_never_imports_torch() -> None:
    offenders = []
    for f in (PKG / "host").rglob("*.py"):
        tree = ast.parse(f.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            if any(n == "torch" or n.startswith("torch.") for n in names):
                offenders.append(f"{f.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, f"attnmeta/host must be torch-free: {offenders}"


def _public_modules() -> list[str]:
    mods = []
    for m in pkgutil.walk_packages(attnmeta.__path__, "attnmeta."):
        if any(part.startswith("_") for part in m.name.split(".")[1:]) or m.name.endswith("__main__"):
            continue
        mods.append(m.name)
    return mods


def _numpydoc_params(doc: str) -> list[str] | None:
    m = re.search(r"\n\s*Parameters\n\s*-+\n(.*?)(\n\s*\n\s*[A-Z][a-z]+\n\s*-+\n|\Z)", doc, re.S)
    if not m:
        return None
    names = []
    for line in m.group(1).splitlines():
        # parameter lines are not indented; ``**inputs`` may stand without a type
        mm = re.match(r"^([A-Za-z_*][\w*, ]*?)\s*(?::|$)", line)
        if mm:
            names += [n.strip().lstrip("*") for n in mm.group(1).split(",")]
    return names


@pytest.mark.parametrize("modname", _public_modules())
def test_public_api_documented(modname: str) -> None:
    """Every public module has __all__; every public function/class a docstring; numpydoc
    ``Parameters`` sections name exactly the signature's parameters."""
    mod = importlib.import_module(modname)
    assert mod.__doc__, f"{modname}: module docstring missing"
    assert hasattr(mod, "__all__"), f"{modname}: __all__ missing"
    for name in mod.__all__:
        obj = getattr(mod, name, None)
        if obj is None:  # a submodule listed in a package's __all__
            importlib.import_module(f"{modname}.{name}")
            continue
        if not (inspect.isfunction(obj) or inspect.isclass(obj)) or getattr(obj, "__module__", modname) != modname:
            continue
        doc = inspect.getdoc(obj)
        assert doc, f"{modname}.{name}: docstring missing"
        if inspect.isfunction(obj):
            documented = _numpydoc_params("\n" + doc)
            if documented is None:
                continue
            sig = [p for p in inspect.signature(obj).parameters if p not in ("self", "cls")]
            assert sorted(documented) == sorted(sig), (
                f"{modname}.{name}: documented parameters {documented} != signature {sig}"
            )


# --------------------------------------------------------------------------------------------------
# the builder layer's house rules (a private name stays in its package; no import circle; modules
# short or saying why they are long)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _package_of(path: Path) -> str:
    name = _module_name(path)
    return name if path.name == "__init__.py" else name.rsplit(".", 1)[0]


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _defined_private_names(tree: ast.AST) -> set[str]:
    """Private names a module defines: functions, classes, assignment targets (module level and
    ``self._x =``), ``__slots__`` entries, parameters."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            found.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            found.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            found.add(node.id)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            found.add(node.target.id)
        elif (isinstance(node, ast.Assign) and isinstance(node.value, ast.Tuple | ast.List)
              and any(isinstance(t, ast.Name) and t.id == "__slots__" for t in node.targets)):
            found |= {e.value for e in node.value.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
    return {n for n in found if _private(n)}


def test_private_names_stay_in_their_package() -> None:
    """No module uses a ``_``-prefixed name (an import, or an attribute of another object) that only
    another attnmeta package defines, and no module imports another package's private module.

    A package is the unit of privacy: the host kernels of ``attnmeta.host`` compose each other's
    private kernels, but a backend, the staging layer or the testing toolkit reaches another
    package only through public names. Attributes of other libraries (``torch._C``, guarded where
    used) are not this rule's business: a name no attnmeta package defines is skipped.
    """
    files = sorted(PKG.rglob("*.py"))
    trees = {f: ast.parse(f.read_text()) for f in files}
    owners: dict[str, set[str]] = {}
    for f, tree in trees.items():
        for name in _defined_private_names(tree):
            owners.setdefault(name, set()).add(_package_of(f))
    bad = []
    for f, tree in trees.items():
        pkg = _package_of(f)
        here = f"{f.relative_to(ROOT)}"

        def foreign(name: str, pkg: str = pkg) -> bool:
            packages = owners.get(name)
            return bool(packages) and pkg not in packages  # defined in attnmeta, only elsewhere

        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                parts = node.module.split(".")
                if parts[0] == "attnmeta":
                    for i, part in enumerate(parts):
                        parent = ".".join(parts[:i])
                        if _private(part) and not (pkg == parent or pkg.startswith(parent + ".")):
                            bad.append(f"{here}:{node.lineno}: imports {node.module}, private to {parent}")
                    for alias in node.names:
                        if _private(alias.name) and foreign(alias.name):
                            bad.append(f"{here}:{node.lineno}: imports {alias.name} from {node.module}")
            elif (isinstance(node, ast.Attribute) and _private(node.attr) and foreign(node.attr)
                  and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
                bad.append(f"{here}:{node.lineno}: uses {ast.unparse(node)}")
    assert not bad, "private names used outside their package:\n" + "\n".join(bad)


def _module_imports(tree: ast.Module, name: str, modules: set[str]) -> dict[str, int]:
    """Every attnmeta module ``name`` imports, wherever the import stands (module level, inside a
    function, under ``TYPE_CHECKING``, or a call of ``importlib.import_module`` / ``__import__`` with
    the module's name), with the line of its first import. ``from pkg import name``
    imports the module ``pkg.name`` when there is one, else ``pkg``. A relative import is resolved
    against ``name``'s package."""
    out: dict[str, int] = {}
    is_pkg = name in _PACKAGES
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".")
                up = parts if is_pkg else parts[:-1]
                up = up[: len(up) - (node.level - 1)]
                base = ".".join([*up, *([base] if base else [])])
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules]
            targets = subs
            if len(subs) < len(node.names):  # names of the module itself
                targets.append(base)
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and ((isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                   or (isinstance(node.func, ast.Name) and node.func.id in ("import_module", "__import__")))):
            targets = [node.args[0].value]  # importlib.import_module("attnmeta.x"): an import all the same
        for t in targets:
            if t in modules and t != name:
                out.setdefault(t, node.lineno)
    return out


def _import_graph() -> dict[str, dict[str, int]]:
    """attnmeta module -> {imported attnmeta module: line}, every import included."""
    files = {_module_name(f): f for f in PKG.rglob("*.py")}
    modules = set(files)
    return {m: _module_imports(ast.parse(f.read_text()), m, modules) for m, f in files.items()}


_PACKAGES = {_module_name(f) for f in PKG.rglob("__init__.py")}


def test_no_import_circle() -> None:
    """The graph of every import between attnmeta modules has no cycle: module level, inside functions
    and under ``TYPE_CHECKING`` alike (a function-level import that closes a circle still ties the two
    modules together; DESIGN.md, "Imports run one way"). A package's ``__init__`` that imports its
    children closes a circle as soon as a child imports names from that ``__init__``."""
    graph = _import_graph()
    cycles: list[list[str]] = []
    state: dict[str, int] = {}
    path: list[str] = []

    def walk(m: str) -> None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.append([*path[path.index(n):], n])
            elif n not in state:
                walk(n)
        path.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            walk(m)
    shown = [" -> ".join(f"{a} (line {graph[a][b]})" for a, b in itertools.pairwise(c)) for c in cycles]
    assert not cycles, "import circles:\n" + "\n".join(shown)


_PRODUCTION = ("attnmeta.backends", "attnmeta.host", "attnmeta.staging", "attnmeta.sync", "attnmeta.integrations")


def _is_production(module: str) -> bool:
    """The serving library: its builders, kernels, staging, the sync audit's mechanism, the adapters, and
    the package's top-level modules (``attnmeta.spec``, ``attnmeta.common``, ``attnmeta/__init__``, ...)."""
    top_level = module.count(".") == 1 and module.split(".")[1] not in ("testing", "bench")
    return module == "attnmeta" or top_level or module in _PRODUCTION or module.startswith(
        tuple(p + "." for p in _PRODUCTION))


def test_production_never_imports_the_lab() -> None:
    """Nothing in attnmeta.backends, .host, .staging, .sync, .integrations or the package's top-level
    modules imports attnmeta.testing, anywhere in the module (DESIGN.md, "The builder layer": the lab is
    a separate contract); and none of them but the command line (``__main__``) and the package's
    ``attnmeta.warmup`` attribute imports attnmeta.bench (the library never imports its benchmarks; the
    lab's commands live in the lab)."""
    face = {"attnmeta", "attnmeta.__main__"}
    bad = [f"{m} imports {n} (line {line})" for m, imports in sorted(_import_graph().items()) if _is_production(m)
           for n, line in sorted(imports.items())
           if n.startswith("attnmeta.testing") or (n.startswith("attnmeta.bench") and m not in face)]
    assert not bad, "production code imports the lab:\n" + "\n".join(bad)


def test_references_share_no_code_with_what_they_check() -> None:
    """The references and lab entries (attnmeta.testing.reference, attnmeta.testing.labs) import nothing
    from attnmeta.host or the builder modules but the builders' options and inputs types (and the
    ``*Config`` types inside options): an oracle that shares a helper with the code under test cannot
    catch that helper's bugs."""
    bad = []
    for f in sorted([*(PKG / "testing" / "reference").rglob("*.py"), *(PKG / "testing" / "labs").rglob("*.py")]):
        m = _module_name(f)
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(("attnmeta.host", "attnmeta.backends")):
                names = [a.name for a in node.names]
                if not all(n.endswith(("Options", "Inputs", "Config")) for n in names):
                    bad.append(f"{m}:{node.lineno}: from {node.module} import {', '.join(names)}")
    assert not bad, "references that share code with the builders they check:\n" + "\n".join(bad)


def test_long_modules_say_why() -> None:
    """A module over 800 lines says at its top why it is one module (a ``Why one module`` paragraph in
    its docstring); the rest stay short enough to read in one sitting."""
    long = []
    for f in PKG.rglob("*.py"):
        text = f.read_text()
        if text.count("\n") > 800:
            doc = ast.get_docstring(ast.parse(text)) or ""
            if "Why one module" not in doc:
                long.append(f"{f.relative_to(ROOT)} ({text.count(chr(10))} lines)")
    assert not long, "modules over 800 lines without a 'Why one module' paragraph: " + ", ".join(long)


def test_benchmarks_use_the_public_api_only() -> None:
    """attnmeta.bench and benchmarks/ never import attnmeta.host, anywhere in a module: a benchmark
    times what a user can call (the builders, the stager, the step composer), so it measures the
    library as shipped rather than a kernel with the layers around it taken away."""
    bad = []
    for f in sorted([*(PKG / "bench").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")]):
        for node in ast.walk(ast.parse(f.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if isinstance(node, ast.ImportFrom) and node.module == "attnmeta":
                names = [f"attnmeta.{a.name}" for a in node.names]
            bad += [f"{f.relative_to(ROOT)}:{node.lineno}: {n}" for n in names
                    if n == "attnmeta.host" or n.startswith("attnmeta.host.")]
    assert not bad, "benchmarks that import attnmeta.host:\n" + "\n".join(bad)


MAX_MODULE_LINES = 1100


def test_no_module_over_the_line_limit() -> None:
    """No module in attnmeta/ is over 1,100 lines: a module that outgrows that is split along its seams."""
    long = [f"{f.relative_to(ROOT)} ({n} lines)" for f in sorted(PKG.rglob("*.py"))
            if (n := f.read_text().count("\n")) > MAX_MODULE_LINES]
    assert not long, f"modules over {MAX_MODULE_LINES} lines: " + ", ".join(long)


def _pinned_example_counts(tree: ast.AST) -> list[int]:
    """The lines of ``settings(max_examples=<a bare number>)`` calls in a parsed module."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "settings":
            lines += [node.lineno for k in node.keywords
                      if k.arg == "max_examples" and isinstance(k.value, ast.Constant)]
    return lines


def test_properties_scale_with_the_profile() -> None:
    """No property in the suite pins its example count to a bare number: a count of its own goes through
    ``profile_helpers.scaled_examples``, so a deeper profile (``thorough``) runs it deeper too."""
    bad = [f"{f.relative_to(ROOT)}:{line}" for f in sorted((ROOT / "tests").rglob("*.py"))
           for line in _pinned_example_counts(ast.parse(f.read_text()))]
    assert not bad, "properties with a bare max_examples (use profile_helpers.scaled_examples(N)):\n" + "\n".join(bad)


def test_pinned_example_counts_are_found() -> None:
    """The rule above finds a bare count, in a decorator and a call, and passes a computed one."""
    tree = ast.parse("@settings(max_examples=40, deadline=None)\ndef f(): pass\n"
                     "g = settings(max_examples=scaled_examples(40))(f)\nh = settings(max_examples=7)(f)\n")
    assert sorted(_pinned_example_counts(tree)) == [1, 4]
