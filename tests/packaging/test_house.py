"""The house stays walkable: the map in CONTRIBUTING.md matches the tree, no module of the four
wheels imports in a circle (lazy and type-checking imports included), every module imports alone,
and no module runs past 600 lines.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted(ROOT.glob("packages/*/src/*"))
MAX_LINES = 600
# Needs habana_frameworks, which only a Gaudi has (it is executed over the stand-in elsewhere).
GAUDI_BACKEND = "vllm_gaudi_platform.seam.gaudi"


def modules() -> dict[str, Path]:
    """Dotted name -> file of every module of the four wheels."""
    found = {}
    for src in SOURCES:
        for path in sorted(src.rglob("*.py")):
            parts = list(path.relative_to(src.parent).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    # Every import statement anywhere: at module level, inside functions (lazy), and under
    # `if TYPE_CHECKING:`. A circle through any of them is still a circle a reader must untangle.
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node


def import_graph() -> dict[str, set[str]]:
    """Which of our modules each of our modules imports (submodules resolved, packages as such)."""
    mods = modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in _imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names if a.name in mods)
                continue
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in mods:
                    targets.add(sub)
                elif base in mods:
                    targets.add(base)
        targets.discard(name)
        graph[name] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_module_of_the_four_wheels_imports_in_a_circle():
    assert cycles(import_graph()) == []


def test_the_cycle_check_finds_a_circle():
    # The check itself can fail: a two-module circle and a three-module one are both reported.
    graph = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c"}, "f": set()}
    assert cycles(graph) == [["a", "b"], ["c", "d", "e"]]


def test_no_source_module_runs_past_600_lines():
    long = {
        str(path.relative_to(ROOT)): n
        for path in modules().values()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}


# One interpreter imports the heavy third-party packages once, then forks a child per module:
# each child starts with none of our modules imported and imports exactly one. Two children run
# at a time (the machines have two cores); each reports through its own pipe (a short traceback,
# well inside a pipe's buffer, so a child never blocks on it).
IMPORT_ALONE = r"""
import json, os, sys, traceback
import torch, vllm, transformers  # noqa: F401  (third-party, shared by the children)
results, running = {}, {}
def reap():
    pid, _ = os.wait()
    name, read = running.pop(pid)
    chunks = []
    while chunk := os.read(read, 65536):
        chunks.append(chunk)
    os.close(read)
    results[name] = b"".join(chunks).decode()
for name in json.loads(NAMES):
    if len(running) >= 2:
        reap()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            __import__(name)
            message = ""
        except BaseException:
            message = traceback.format_exc(limit=-4)
        os.write(write, message.encode())
        os._exit(0)
    os.close(write)
    running[pid] = (name, read)
while running:
    reap()
print("ALONE " + json.dumps(results))
"""


@pytest.mark.process
def test_every_module_imports_alone_in_a_fresh_interpreter(run_python):
    names = sorted(
        name
        for name in modules()
        if name != GAUDI_BACKEND and not name.startswith(f"{GAUDI_BACKEND}.")
    )
    code = f"NAMES = {json.dumps(names)!r}\n{IMPORT_ALONE}"
    # Fresh: each module imports with nothing but the interpreter before it.
    proc = run_python(code, {"VLLM_HPU_EMULATION": "cpu"}, timeout=900, fresh=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("ALONE ")]
    assert lines, proc.stderr[-4000:]
    failures = {name: error for name, error in json.loads(lines[-1][6:]).items() if error}
    assert failures == {}


MAP_BLOCK = re.compile(r"<!-- house-map -->\s*```\n(.*?)```\s*<!-- /house-map -->", re.S)


def house_map() -> dict[str, set[str]]:
    """Package root (as written) -> the entries the map lists under it."""
    text = (ROOT / "CONTRIBUTING.md").read_text()
    found = MAP_BLOCK.search(text)
    assert found, "CONTRIBUTING.md has no house map between <!-- house-map --> markers"
    listed: dict[str, set[str]] = {}
    root: str | None = None
    # The folder each indent level's entries belong to ("" at the top of a wheel's package):
    # an entry at depth 2k is a child of the folder last listed at depth 2(k-1).
    folders: dict[int, str | None] = {}
    for line in found.group(1).splitlines():
        if not line.strip():
            continue
        depth = len(line) - len(line.lstrip(" "))
        head = line.strip().split("  ")[0].strip()
        if depth == 0:
            root = line.split()[0]
            listed[root] = set()
            folders = {0: ""}
            continue
        parent = folders.get(depth - 2)
        if root is None or parent is None or depth % 2:
            continue  # a wrapped description line, or a folder's explanation
        listed[root].update(parent + entry.strip() for entry in head.split(", "))
        folders[depth] = parent + head if head.endswith("/") else None
        for deeper in [d for d in folders if d > depth]:
            del folders[deeper]
    return listed


def test_the_house_map_lists_every_package_folder_and_module_at_every_level():
    listed = house_map()
    missing = []
    for src in SOURCES:
        package = src.relative_to(ROOT).as_posix() + "/"
        assert package in listed, f"the map has no section for {package}"
        for child in sorted(src.rglob("*")):
            rel = child.relative_to(src).as_posix()
            hidden = any(part.startswith(("_", ".")) for part in rel.split("/"))
            if hidden and (child.name != "__init__.py" or "/" in rel):
                continue  # a sub-package's __init__ is its folder's entry
            if child.is_dir() and (child / "__init__.py").exists():
                entry = f"{rel}/"
            elif child.suffix == ".py":
                entry = rel
            else:
                continue
            if entry not in listed[package]:
                missing.append(f"{package}{entry}")
    assert missing == []


def test_everything_the_house_map_lists_exists():
    gone = [
        f"{root}{entry}"
        for root, entries in house_map().items()
        for entry in entries
        if not (ROOT / root / entry.rstrip("/")).exists()
    ]
    gone += [root for root in house_map() if not (ROOT / root).exists()]
    assert gone == []


def _imported_names(path: Path) -> Iterator[str]:
    """Every absolute module name a file imports (relative imports stay inside its wheel)."""
    for node in _imports(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif not node.level and node.module:
            yield node.module


def test_no_module_of_the_four_wheels_imports_the_test_kit():
    # gaudi_testkit (testkit/, never published) serves the tests and benchmarks only; a wheel that
    # imported it would fail wherever it is installed without the dev venv.
    offenders = {
        name: sorted(n for n in _imported_names(path) if n.split(".")[0] == "gaudi_testkit")
        for name, path in modules().items()
    }
    assert {n: t for n, t in offenders.items() if t} == {}
