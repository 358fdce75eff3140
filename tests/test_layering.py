"""The package's layers, read from the source with ast (every import, function-level ones too).

jax_dflash/*.py (the op) <- jax_dflash/interop/ (and jax_dflash/onnx.py, its ONNX module under
a short name) <- jax_dflash/cli/ (and __main__.py, the ``python -m jax_dflash`` entry): imports point down only, no cycle among the package's modules,
nothing imports bench/ or tests/, and no application code (argparse, plotting) outside cli/.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGE = "jax_dflash"
# Compiled modules: built by CMake, never in the source tree.
EXTENSIONS = {"jax_dflash._dflash_cpu", "jax_dflash._dflash_cuda"}
APP_ONLY = {"argparse", "matplotlib"}  # command-line and plotting code belongs in cli/ or bench/
LAYERS = {"op": 0, "interop": 1, "cli": 2}
# Top-level names of interop modules (the module object itself under a short name): they are in
# the interop layer, and nothing in the op layer may import them either.
INTEROP_ALIASES = {f"{PACKAGE}.onnx"}


@dataclasses.dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the imported module (a package's name stands for its __init__)
    line: int
    lazy: bool  # inside a function
    name: str | None = None  # `from target import name`, when name is not a module


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_modules(root: Path, package: str = PACKAGE) -> dict[str, Path]:
    return {module_name(p, root): p for p in sorted((root / package).rglob("*.py"))}


def _is_package(name: str, modules: dict[str, Path]) -> bool:
    return name in modules and modules[name].name == "__init__.py"


def _function_lines(tree: ast.AST) -> set[int]:
    """Lines inside function bodies (an import there runs when the function is called)."""
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            for inner in ast.walk(node):
                if hasattr(inner, "lineno"):
                    lines.add(inner.lineno)
    return lines


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> list[Import]:
    tree = ast.parse(path.read_text(), filename=str(path))
    lazy_lines = _function_lines(tree)
    package = name if _is_package(name, modules) else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                # `from pkg import sub` imports the submodule; `from mod import name`, mod.
                is_module = candidate in modules or candidate in EXTENSIONS
                targets.append((candidate, None) if is_module else (base, alias.name))
        for target in targets:
            target, attr = target if isinstance(target, tuple) else (target, None)
            found.append(Import(name, target, node.lineno, node.lineno in lazy_lines, attr))
    return found


def bound_names(path: Path) -> set[str] | None:
    """The names a module binds at its top level (also in top-level if/try/with blocks); None
    when it can hand out others (a module ``__getattr__`` or a star import)."""
    names: set[str] = set()
    pending = list(ast.parse(path.read_text()).body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            if node.name == "__getattr__":
                return None
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if alias.name == "*":
                    return None
                names.add(alias.asname or alias.name.split(".")[0])
            continue
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Name) and isinstance(child.ctx, ast.Store):
                names.add(child.id)
            elif isinstance(child, (ast.stmt, ast.excepthandler, ast.expr)):
                pending.append(child)
    return names


def layer_of(name: str) -> str:
    parts = name.split(".")
    if len(parts) > 1 and parts[1] in ("interop", "cli"):
        return parts[1]
    if name == f"{PACKAGE}.__main__":
        return "cli"
    if name in INTEROP_ALIASES:
        return "interop"
    return "op"


def _local_top_names(root: Path) -> set[str]:
    """Module names that only exist because bench/ or tests/ are on sys.path in a checkout."""
    names = {"bench", "tests", "conftest"}
    for folder in ("bench", "tests"):
        names |= {p.stem for p in (root / folder).rglob("*.py")}
        names |= {p.name for p in (root / folder).iterdir() if p.is_dir()}
    return names


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (a list of modules, first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def violations(root: Path, package: str = PACKAGE) -> list[str]:
    modules = package_modules(root, package)
    local = _local_top_names(root)
    problems = []
    edges: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        where = path.relative_to(root)
        for imp in imports_of(name, path, modules):
            at = f"{where}:{imp.line}{' (function-level)' if imp.lazy else ''}"
            top = imp.target.split(".")[0]
            if top == package:
                if imp.target not in modules and imp.target not in EXTENSIONS:
                    problems.append(f"{at}: imports {imp.target}, which is no module of {package}")
                    continue
                if imp.name is not None and imp.target in modules:
                    names = bound_names(modules[imp.target])
                    if names is not None and imp.name not in names:
                        problems.append(
                            f"{at}: imports {imp.name} from {imp.target}, which neither is a "
                            f"module nor defines it"
                        )
                if LAYERS[layer_of(imp.target)] > LAYERS[layer_of(name)]:
                    problems.append(
                        f"{at}: the {layer_of(name)} layer imports {imp.target} "
                        f"(the {layer_of(imp.target)} layer above it)"
                    )
                # A function-level import of the top package runs after the package finished
                # importing, so it cannot close a cycle; every other edge can.
                if not (imp.lazy and imp.target == package) and imp.target in modules:
                    edges[name].add(imp.target)
            elif top in local:
                problems.append(f"{at}: imports {imp.target} from the checkout's bench/ or tests/")
            elif top in APP_ONLY and layer_of(name) != "cli":
                problems.append(
                    f"{at}: imports {top}: application code belongs in {package}.cli or bench/"
                )
    cycle = find_cycle({k: v - {k} for k, v in edges.items()})
    if cycle:
        problems.append("import cycle: " + " -> ".join(cycle))
    return problems


def test_the_package_is_layered():
    modules = package_modules(REPO)
    assert f"{PACKAGE}.ops" in modules and f"{PACKAGE}.cli.main" in modules, sorted(modules)
    problems = violations(REPO)
    assert not problems, "\n".join(problems)


def test_no_benchmark_module_in_the_package():
    names = [n for n in package_modules(REPO) if "bench" in n.rsplit(".", 1)[-1]]
    assert not names, f"benchmark modules belong in bench/, found {names}"


# ---- the checker itself finds what it should (a synthetic tree per case) ----------------------


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in {"bench/bench_x.py": "", "tests/test_x.py": "", **files}.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for pkg in ("jax_dflash", "jax_dflash/interop", "jax_dflash/cli"):
        init = tmp_path / pkg / "__init__.py"
        if not init.exists():
            init.parent.mkdir(parents=True, exist_ok=True)
            init.write_text("")
    return tmp_path


@pytest.mark.parametrize(
    "files, expected",
    [
        (
            {
                "jax_dflash/ops.py": "def f():\n    from jax_dflash.interop import onnx\n",
                "jax_dflash/interop/onnx.py": "",
            },
            "the op layer imports jax_dflash.interop.onnx",
        ),
        (
            {
                "jax_dflash/ops.py": "from jax_dflash import onnx\n",
                "jax_dflash/onnx.py": "from jax_dflash.interop import onnx\n",
                "jax_dflash/interop/onnx.py": "",
            },
            "the op layer imports jax_dflash.onnx (the interop layer above it)",
        ),
        (
            {
                "jax_dflash/interop/onnx.py": "from ..cli import main\n",
                "jax_dflash/cli/main.py": "",
            },
            "the interop layer imports jax_dflash.cli.main",
        ),
        (
            {
                "jax_dflash/ops.py": "import jax_dflash.reference\n",
                "jax_dflash/reference.py": "def f():\n    from jax_dflash import ops\n",
            },
            "import cycle: jax_dflash.ops -> jax_dflash.reference -> jax_dflash.ops",
        ),
        ({"jax_dflash/paged.py": "import bench_x\n"}, "imports bench_x from the checkout"),
        ({"jax_dflash/rope.py": "def main():\n    import argparse\n"}, "imports argparse"),
        (
            {"jax_dflash/ops.py": "from jax_dflash import onnx\n"},
            "imports onnx from jax_dflash, which neither is a module nor defines it",
        ),
        (
            {"jax_dflash/ops.py": "import jax_dflash.onnx\n"},
            "imports jax_dflash.onnx, which is no module",
        ),
        (
            {
                "jax_dflash/ops.py": "def f():\n    from jax_dflash._ext import gone\n",
                "jax_dflash/_ext.py": "try:\n    import jax\nexcept ImportError:\n    here = 1\n",
            },
            "imports gone from jax_dflash._ext",
        ),
    ],
)
def test_the_checker_finds(tmp_path, files, expected):
    problems = violations(_tree(tmp_path, files))
    assert any(expected in p for p in problems), problems


def test_the_checker_passes_a_layered_tree(tmp_path):
    files = {
        "jax_dflash/__init__.py": "from jax_dflash.ops import f\n",
        "jax_dflash/ops.py": "import numpy\nfrom . import _ext\ndef f():\n    import jax_dflash\n",
        "jax_dflash/_ext.py": "if True:\n    X = 1\ndef g():\n    import jax_dflash._dflash_cpu\n",
        "jax_dflash/sharding.py": "from jax_dflash._ext import X, g\nfrom jax_dflash.ops import _ext\n",
        "jax_dflash/interop/onnx.py": "from jax_dflash import ops\nfrom jax_dflash.ops import f\n",
        "jax_dflash/cli/main.py": "import argparse\nfrom jax_dflash.interop import onnx\ndef main():\n    pass\n",
        "jax_dflash/__main__.py": "from jax_dflash.cli.main import main\n",
    }
    assert violations(_tree(tmp_path, files)) == []
