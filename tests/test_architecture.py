"""The project's shape, checked: no import cycle, layers importing only downwards, one
place that runs commands, no CLI verb used as a server, no hand-written module over 500
lines. Pure reads of the checkout (docs/architecture.md explains the rooms)."""

from __future__ import annotations

import ast
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOTS = {"sandbox": REPO / "sandbox", "hwplugins": REPO / "plugins" / "hwplugins"}
GENERATED = re.compile(r"_pb2(_grpc)?\.pyi?$")
MAX_LINES = 500


def _modules() -> dict[str, Path]:
    """Every module of ours by dotted name (a package by its __init__)."""
    found: dict[str, Path] = {}
    for top, root in ROOTS.items():
        for path in root.rglob("*.py"):
            if GENERATED.search(path.name):
                continue
            parts = [top, *path.relative_to(root).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _imports(name: str, path: Path, known: dict[str, Path]) -> Iterator[str]:
    """The modules of ours that ``name`` imports, at any depth of its code (a function's
    lazy import is an edge too: it hides a cycle, it does not remove it; an import only
    for type checkers is not)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                   and ast.unparse(block.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
                   for stmt in block.body for n in ast.walk(stmt)}
    for node in ast.walk(tree):
        if id(node) in typing_only:  # never runs: no cycle through it
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                       for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import a.b.c` of a name inside c
                target = target.rpartition(".")[0]
            if target and target != name:
                yield target


def _graph() -> dict[str, set[str]]:
    known = _modules()
    return {name: set(_imports(name, path, known)) for name, path in known.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle() -> None:
    assert _cycles(_graph()) == []


def test_the_layers_import_downwards() -> None:
    graph = _graph()
    # what each room may not import (docs/architecture.md's table, top to bottom)
    forbidden = {
        "hwplugins": ("sandbox",),
        "sandbox.profile": ("sandbox.fakehw", "sandbox.runtimes", "sandbox.cli",
                            "sandbox.agent", "sandbox.kubelet", "sandbox.images"),
        "sandbox.fakehw": ("sandbox.runtimes", "sandbox.cli", "sandbox.images"),
        "sandbox.runtimes": ("sandbox.cli",),
        "sandbox.images": ("sandbox.cli", "sandbox.runtimes"),
    }
    wrong = sorted(f"{name} imports {target}"
                   for name, targets in graph.items() for target in targets
                   for room, banned in forbidden.items()
                   if (name == room or name.startswith(room + "."))
                   and any(target == b or target.startswith(b + ".") for b in banned))
    assert wrong == []


def _git_grep(*args: str) -> list[str]:
    # an unpacked `git archive` (as the unprivileged run uses) has no .git: its files, then
    no_index = [] if (REPO / ".git").exists() else ["--no-index", "-I"]
    done = subprocess.run(["git", "grep", "-n", *no_index, *args], cwd=REPO,
                          capture_output=True, text=True, check=False)
    assert done.returncode in (0, 1), done.stderr
    return done.stdout.splitlines()


def test_commands_run_in_one_place() -> None:
    hits = _git_grep(r"subprocess\.\(run\|Popen\|check_output\|check_call\|call\)\b",
                     "--", "sandbox", "plugins")
    places = {line.split(":", 1)[0] for line in hits}
    assert places <= {"sandbox/supervisor.py", "sandbox/commands.py"}, sorted(places)


def test_no_cli_verb_serves() -> None:
    """Runtimes start servers by their modules (python -m sandbox.agent / sandbox.kubelet),
    never by a CLI verb."""
    assert _git_grep(r'"-m", "sandbox", \|"kubelet", "serve"\|"sandbox", "mount"',
                     "--", "sandbox/runtimes", "sandbox/images") == []


def _hand_written() -> Iterator[Path]:
    for top in ("sandbox", "plugins", "tests", "benchmarks"):
        for path in (REPO / top).rglob("*"):
            if path.suffix in (".py", ".c", ".h") and not GENERATED.search(path.name):
                yield path


def test_no_module_over_500_lines() -> None:
    long = sorted(f"{path.relative_to(REPO)}: {n} lines" for path in _hand_written()
                  if (n := len(path.read_text().splitlines())) > MAX_LINES)
    assert long == []
