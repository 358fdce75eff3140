"""The code in README.md and BUILD.md runs as written, and what they say about the build holds.

Every fenced block of both files is collected, in order. What runs, on CPU, each in a fresh
process whose working directory is a scratch folder per document (shared by that document's
blocks, so a later block can read a file an earlier one wrote; ``bench/``, ``examples/`` and
``tools/`` are linked into it, and nothing else of the checkout is, so ``jax_dflash`` is the
installed package):

- ```` ```python ```` blocks, as a script;
- ```` ```sh ```` / ```` ```bash ```` blocks, line by line (``\\`` continuations joined, comments
  dropped): lines that start with ``jax-dflash`` or ``python`` (after ``VAR=value`` prefixes) run
  with bash; every other line is skipped, with the reason (``make``, ``pip``, ``trtexec``,
  ``pytest`` lines and the rest each have one).

The fence's info string may carry options after the language, in braces, separated by ``;``:

- ``{skip: REASON}``: the block does not run here; REASON is printed as the skip reason
  (a GPU, TensorRT, a download, minutes of work);
- ``{devices: N}``: runs with ``XLA_FLAGS=--xla_force_host_platform_device_count=N``;
- ``{needs: MODULE ...}``: skipped, saying so, unless each module imports (optional extras).

A python block also needs the optional modules it imports (onnx, jax2onnx, tensorrt, ...)
without saying so. Each block or line is one test item, so every skip shows with its reason.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = ("README.md", "BUILD.md")
LINKED = ("bench", "examples", "tools")
TIMEOUT_S = 300
FENCE = re.compile(r"^(?P<indent> *)```(?P<info>[^`]*)$")
# Optional modules, and what imports them (a block importing the key needs each value).
OPTIONAL_IMPORTS = {
    "onnx": ("onnx",),
    "onnx_ir": ("onnx_ir",),
    "jax2onnx": ("jax2onnx",),
    "tensorrt": ("tensorrt",),
    "matplotlib": ("matplotlib",),
    "jax_dflash.interop.onnx": ("onnx",),
    "jax_dflash.interop.onnx_reference": ("onnx",),
    "jax_dflash.interop.export": ("onnx", "onnx_ir", "jax2onnx"),
    "jax_dflash.interop.trt": ("tensorrt",),
}
# Names of the old layout: a document that uses one is out of date.
STALE = (
    "jax-dflash bench",
    "jax_dflash.onnx.",
    "jax_dflash.onnx_reference",
    "jax_dflash.export",
    "jax_dflash.trt.",
    "from jax_dflash import trt",
    "from jax_dflash.onnx import",
    "--python-version 3.12",
)


@dataclasses.dataclass(frozen=True)
class Block:
    doc: str
    line: int  # of the opening fence, 1-based
    language: str
    options: dict
    code: str


def parse_options(info: str) -> tuple[str, dict]:
    """``'sh {skip: needs trtexec}'`` -> ``('sh', {'skip': 'needs trtexec'})``."""
    language, _, rest = info.strip().partition(" ")
    options = {}
    rest = rest.strip()
    if rest:
        if not (rest.startswith("{") and rest.endswith("}")):
            raise ValueError(f"fence options: expected '{{key: value; ...}}', got {rest!r}")
        for item in rest[1:-1].split(";"):
            key, sep, value = item.partition(":")
            if not sep or key.strip() not in ("skip", "devices", "needs"):
                raise ValueError(f"fence option: expected skip, devices or needs, got {item!r}")
            options[key.strip()] = value.strip()
    return language, options


def blocks_of(doc: str) -> list[Block]:
    lines = (REPO / doc).read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent = len(opening["indent"])
        language, options = parse_options(opening["info"])
        body, j = [], i + 1
        while j < len(lines) and lines[j].strip() != "```":
            body.append(lines[j][indent:] if lines[j][:indent].strip() == "" else lines[j])
            j += 1
        if j == len(lines):
            raise ValueError(f"{doc}:{i + 1}: the fence is never closed")
        found.append(Block(doc, i + 1, language, options, "\n".join(body) + "\n"))
        i = j + 1
    return found


def _complete(command: str) -> bool:
    try:
        shlex.split(command, comments=True)
    except ValueError:  # an open quote: the command goes on on the next line
        return False
    return True


def shell_lines(block: Block) -> list[tuple[int, str]]:
    """``(line number, command)`` for each command of a shell block."""
    commands, pending, start = [], "", None
    for offset, raw in enumerate(block.code.splitlines()):
        text = raw.rstrip()
        if start is None:
            if not text.strip() or text.lstrip().startswith("#"):
                continue
            start = block.line + 1 + offset
        if text.endswith("\\"):
            pending += text[:-1] + " "
            continue
        pending += text
        if not _complete(pending):
            pending += "\n"
            continue
        commands.append((start, pending.strip()))
        pending, start = "", None
    if pending:
        raise ValueError(f"{block.doc}:{start}: unterminated command {pending!r}")
    return commands


def why_not_run(command: str) -> str | None:
    """None when the suite runs this shell line, else the reason it does not."""
    words = shlex.split(command, comments=True)
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
        words = words[1:]  # VAR=value prefixes
    text = " ".join(words)
    if not words:
        return "sets a shell variable for the lines after it"
    if words[0] == "make":
        return "make rebuilds and reinstalls the package; the suite itself runs under `make test`"
    if re.search(r"\bpip\b.*\b(install|wheel|download)\b", text):
        return "installs, builds or downloads packages (network, minutes)"
    if "trtexec" in text:
        return "needs trtexec (TensorRT) and a GPU"
    if "pytest" in text:
        return "runs the test suite itself"
    if "fetch_trt_headers" in text:
        return "downloads from the package index"
    if words[0] in ("jax-dflash", "python", "python3"):
        return None
    return f"only jax-dflash and python lines run here, not {words[0]!r}"


def _imported_modules(code: str) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def missing_modules(block: Block) -> list[str]:
    needed = set(block.options.get("needs", "").split())
    if block.language == "python":
        for name in _imported_modules(block.code):
            needed |= set(OPTIONAL_IMPORTS.get(name, ()))
    return sorted(m for m in needed if importlib.util.find_spec(m) is None)


def _items():
    items = []
    for doc in DOCS:
        for block in blocks_of(doc):
            where = f"{doc}:{block.line}"
            if block.language == "python":
                items.append(pytest.param(block, block.line, None, id=f"{where}-python"))
            elif block.language in ("sh", "bash"):
                for line, command in shell_lines(block):
                    items.append(
                        pytest.param(block, line, command, id=f"{doc}:{line}-{command[:40]}")
                    )
    return items


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    folders = {}
    for doc in DOCS:
        folder = tmp_path_factory.mktemp(doc.replace(".", "_"))
        for name in LINKED:
            (folder / name).symlink_to(REPO / name, target_is_directory=True)
        folders[doc] = folder
    return folders


def _is_checkout(entry: str) -> bool:
    return Path(entry).resolve() == REPO


def _env(block: Block) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    # `python` and `jax-dflash` of the environment running the suite.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    # Extra paths (e.g. optional packages installed with --target) stay; the checkout does not.
    kept = [e for e in env.get("PYTHONPATH", "").split(os.pathsep) if e and not _is_checkout(e)]
    env["PYTHONPATH"] = os.pathsep.join(kept)
    if "devices" in block.options:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={int(block.options['devices'])}"
    return env


def _run(cmd: list[str], block: Block, cwd: Path, what: str) -> None:
    try:
        result = subprocess.run(
            cmd, cwd=cwd, env=_env(block), capture_output=True, text=True, timeout=TIMEOUT_S
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{what} ran past {TIMEOUT_S} s; output so far:\n{e.output}")
    if result.returncode != 0:
        output = (result.stdout + result.stderr)[-6000:]
        pytest.fail(f"{what} exited {result.returncode}:\n{output}")


@pytest.mark.parametrize("block, line, command", _items())
def test_doc_code_runs(block, line, command, scratch):
    where = f"{block.doc}:{line}"
    if "skip" in block.options:
        pytest.skip(f"{where}: {block.options['skip']}")
    missing = missing_modules(block)
    if missing:
        pytest.skip(f"{where}: needs {', '.join(missing)}, not installed here")
    cwd = scratch[block.doc]
    if command is None:
        script = cwd / f"block_{block.line}.py"
        script.write_text(block.code)
        _run([sys.executable, str(script)], block, cwd, f"the python block at {where}")
        return
    reason = why_not_run(command)
    if reason:
        pytest.skip(f"{where}: `{command[:60]}`: {reason}")
    _run(["bash", "-c", "set -eo pipefail\n" + command], block, cwd, f"`{command}` ({where})")


@pytest.mark.parametrize("doc", DOCS)
def test_doc_names_no_removed_api(doc):
    text = (REPO / doc).read_text()
    stale = [name for name in STALE if name in text]
    assert not stale, f"{doc} still names {stale}"


def test_quick_start_is_two_commands():
    lines = (REPO / "README.md").read_text().splitlines()
    heading = lines.index("## Quick start") + 1
    first = next(b for b in blocks_of("README.md") if b.line > heading)
    commands = [shlex.split(c, comments=True) for _, c in shell_lines(first)]
    assert commands == [["make", "demo"], ["make", "test"]], commands


# ---- the harness itself -------------------------------------------------------------------------


def test_fence_options_are_parsed():
    assert parse_options("sh {skip: needs trtexec, a GPU}") == (
        "sh",
        {"skip": "needs trtexec, a GPU"},
    )
    assert parse_options("python {devices: 4; needs: onnx jax2onnx}") == (
        "python",
        {"devices": "4", "needs": "onnx jax2onnx"},
    )
    assert parse_options("python") == ("python", {})
    with pytest.raises(ValueError, match="expected skip, devices or needs"):
        parse_options("sh {skpi: typo}")


def test_shell_lines_are_split_and_classified(tmp_path):
    block = Block(
        "X.md",
        10,
        "sh",
        {},
        "# a comment\nmake test   # builds\n\njax-dflash run \\\n"
        "  --preset tiny\nA=1 python -c 'print(1)\nprint(2)'\ntrtexec --onnx=m.onnx\n"
        "cd /tmp\n",
    )
    lines = shell_lines(block)
    assert [n for n, _ in lines] == [12, 14, 16, 18, 19]
    assert lines[2][1] == "A=1 python -c 'print(1)\nprint(2)'"
    reasons = [why_not_run(c) for _, c in lines]
    assert reasons[1] is None and reasons[2] is None, reasons
    assert "make" in reasons[0] and "trtexec" in reasons[3] and "'cd'" in reasons[4], reasons


def test_changelog_has_a_section_for_the_version():
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    headings = re.findall(r"^## (\S+)", (REPO / "CHANGELOG.md").read_text(), re.M)
    assert headings and headings[0] == "Unreleased", headings
    assert version in headings, f"CHANGELOG.md has no '## {version}' section: {headings}"


def _build_info() -> tuple[Path, dict]:
    import json

    import jax_dflash

    found = [p for d in jax_dflash.__path__ for p in Path(d).glob("build_info.json")]
    if not found:
        pytest.skip(
            "no jax_dflash/build_info.json in this install: it was built before "
            "cmake/BuildSummary.cmake was included from CMakeLists.txt"
        )
    return found[0], json.loads(found[0].read_text())


def test_build_info_says_what_was_built():
    """BUILD.md: build_info.json names each part, built or not, and that is what imports."""
    import importlib

    from jax_dflash import _ext

    path, info = _build_info()
    assert set(info) == {"cpu_extension", "cuda_extension", "trt_plugin", "ffi_record_stage"}, info
    for part, entry in info.items():
        assert isinstance(entry["built"], bool) and entry["reason"], (path, part, entry)

    def importable(module):
        try:
            importlib.import_module(module)
            return True
        except ImportError:
            return False

    def plugin_present():
        try:
            return Path(_ext.trt_plugin_library_path()).is_file()
        except FileNotFoundError:
            return False

    assert info["cpu_extension"]["built"] and importable("jax_dflash._dflash_cpu"), info
    assert info["cuda_extension"]["built"] == importable("jax_dflash._dflash_cuda"), info
    if info["cuda_extension"]["built"]:
        cuda = importlib.import_module("jax_dflash._dflash_cuda")
        assert info["ffi_record_stage"]["built"] == cuda.ffi_record_stage(), info
    if not os.environ.get("DFLASH_TRT_PLUGIN_LIBRARY"):
        assert info["trt_plugin"]["built"] == plugin_present(), info


def test_pytest_in_a_checkout_never_built_says_to_build_first(tmp_path):
    """A copy of the checkout's sources, no extension built, and site-packages without its
    ``.pth`` files (so no editable install of jax_dflash): pytest stops before collecting, with
    the Quick start's way to build."""
    import shutil
    import sysconfig

    shutil.copytree(
        REPO / "jax_dflash",
        tmp_path / "jax_dflash",
        ignore=shutil.ignore_patterns("*.so", "__pycache__"),
    )
    (tmp_path / "tests").mkdir()
    for name in ("_install_check.py", "conftest.py"):
        shutil.copy(REPO / "tests" / name, tmp_path / "tests" / name)
    (tmp_path / "tests" / "test_op.py").write_text("def test_op():\n    pass\n")
    env = dict(os.environ, PYTHONPATH=sysconfig.get_paths()["purelib"], JAX_PLATFORMS="cpu")
    done = subprocess.run(
        [sys.executable, "-S", "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert done.returncode == pytest.ExitCode.USAGE_ERROR, done.stdout + done.stderr
    assert "has no compiled CPU extension" in done.stdout + done.stderr
    assert (
        "`make test`" in done.stdout + done.stderr
        and 'pip install -e ".[test]"' in done.stdout + done.stderr
    )
    assert "passed" not in done.stdout


# ---- what the README's first screen says --------------------------------------------------------


def _summary_of_benchmarks() -> str:
    text = (REPO / "BENCHMARKS.md").read_text()
    return text[: text.index("\n## ")]


def test_readme_speed_numbers_come_from_the_benchmarks_summary():
    readme = (REPO / "README.md").read_text()
    speed = readme[readme.index("**Speed**") : readme.index("**Runs on**")]
    summary = _summary_of_benchmarks()
    numbers = re.findall(r"(?<![\w.=])\d+\.\d+x?(?![\w.])", speed)
    assert len(numbers) >= 12, numbers
    missing = [n for n in numbers if n not in summary]
    assert not missing, f"README.md's speed numbers not in BENCHMARKS.md's summary: {missing}"


def _resolve(dotted: str):
    """The object a dotted ``jax_dflash...`` name stands for (modules imported as needed)."""
    import importlib

    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError as e:
            if e.name and e.name.split(".")[0] != "jax_dflash":
                pytest.skip(f"{dotted}: needs {e.name}, not installed here")
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise AssertionError(f"{dotted}: no module of it imports")


def test_every_jax_dflash_name_the_readme_gives_exists():
    text = (REPO / "README.md").read_text()
    names = sorted(set(re.findall(r"`(jax_dflash(?:\.\w+)+)", text)))
    assert "jax_dflash.target_kv_cache_update_slots" in names, names
    for name in names:
        assert _resolve(name) is not None, name


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=60)


def _needs_git():
    try:
        inside = _git("rev-parse", "--is-inside-work-tree").stdout.strip() == "true"
    except (OSError, subprocess.TimeoutExpired):
        inside = False
    if not inside:
        pytest.skip("not a git checkout (or no git): .gitignore is not in force")


# Paths the documented commands write into the checkout: wheels, the lean TensorRT runtime, the
# benchmark's --out folder, exported graphs and engines, run's --json summary.
WRITTEN = (
    "dist/jax_dflash-0.1.0-cp311-cp311-linux_x86_64.whl",
    "trt-lean/tensorrt_lean/__init__.py",
    "trt-lean-wheels/tensorrt_lean.whl",
    "results/kv_update_cpu.json",
    "update.onnx",
    "draft_paged.onnx",
    "update.plan",
    "summary.json",
)


def test_gitignore_covers_what_documented_commands_write():
    _needs_git()
    ignored = _git("check-ignore", "--no-index", *WRITTEN).stdout.split()
    assert sorted(ignored) == sorted(WRITTEN), sorted(set(WRITTEN) - set(ignored))
    tracked_but_ignored = _git("ls-files", "-ci", "--exclude-standard").stdout.split()
    assert not tracked_but_ignored, tracked_but_ignored


def test_py_typed_and_the_presets_configs_ship():
    """scikit-build-core's wheel takes the package folder's files that git does not ignore."""
    import importlib.resources

    package = importlib.resources.files("jax_dflash")
    shipped = ["py.typed"] + [
        f"cli/configs/{e.name}" for e in package.joinpath("cli", "configs").iterdir()
    ]
    assert len(shipped) > 2 and all(package.joinpath(*f.split("/")).is_file() for f in shipped)
    _needs_git()
    sources = [f"jax_dflash/{f}" for f in shipped]
    assert not _git("check-ignore", "--no-index", *sources).stdout.split()
