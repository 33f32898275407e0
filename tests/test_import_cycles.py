"""No import circle among the modules of one folder, anywhere in the tree.

The graph is static: every ``import`` and ``from … import`` in every module of every package (at
the top, inside functions and under ``TYPE_CHECKING`` alike, since a circle a lazy import hides
is still a circle a reader has to untangle), resolved to the package's own modules. A circle is a
strongly connected component of more than one module of the same folder (a package's
``__init__`` counts as a module of its folder).

``KNOWN_CYCLES`` names the circles still there, each with who is untangling it; the test fails
on any other, and on an entry that is no longer a circle (so the list only shrinks).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE_ROOTS = ("cli", "operator", "frontend", "engine_image", "protocol", "devcluster", "sidecar")

#: Folder -> the modules of its circle, for circles being removed on other branches of issue 24.
KNOWN_CYCLES: dict[str, frozenset[str]] = {
    # the sidecar's errors and fleet reader (issue 24, the control API's part)
    "sidecar/drs_sidecar": frozenset({"drs_sidecar.errors", "drs_sidecar.fleet"}),
}


@dataclass(frozen=True)
class Module:
    name: str  #: dotted, e.g. ``drs_frontend.upstream.base``
    path: Path
    is_package: bool  #: an ``__init__.py``

    @property
    def folder(self) -> str:
        return self.path.parent.relative_to(ROOT).as_posix()


def modules() -> dict[str, Module]:
    """Every module of every package under the source roots, by dotted name."""
    found: dict[str, Module] = {}
    for source_root in SOURCE_ROOTS:
        for path in sorted((ROOT / source_root).rglob("*.py")):
            parts = list(path.relative_to(ROOT / source_root).with_suffix("").parts)
            if not parts[0].startswith("drs_"):
                continue
            is_package = parts[-1] == "__init__"
            name = ".".join(parts[:-1] if is_package else parts)
            found[name] = Module(name, path, is_package)
    return found


def imported(module: Module, known: Mapping[str, Module]) -> set[str]:
    """The modules of ``known`` that ``module`` imports anywhere in its body."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(module.path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.name.split(".")
                if not module.is_package:
                    package = package[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join([*package, *([node.module] if node.module else [])])
            candidates = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            continue
        for name in candidates:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module.name:
                out.add(name)
    return out


def strongly_connected(nodes: Sequence[str], edges: Mapping[str, set[str]]) -> Iterator[set[str]]:
    """Tarjan's components of the graph (iterative, so deep graphs cannot overflow the stack)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    for start in nodes:
        if start in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component: set[str] = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                yield component


def cycles() -> dict[str, list[frozenset[str]]]:
    """Folder -> the import circles among its modules."""
    known = modules()
    graph = {name: imported(module, known) for name, module in known.items()}
    by_folder: dict[str, list[str]] = {}
    for name, module in known.items():
        by_folder.setdefault(module.folder, []).append(name)
    found: dict[str, list[frozenset[str]]] = {}
    for folder, names in sorted(by_folder.items()):
        inside = set(names)
        edges = {name: graph[name] & inside for name in names}
        for component in strongly_connected(sorted(names), edges):
            if len(component) > 1:
                found.setdefault(folder, []).append(frozenset(component))
    return found


def test_no_import_circle_inside_a_folder_but_the_known_ones() -> None:
    found = cycles()
    new = [
        f"{folder}: {' <-> '.join(sorted(c))}"
        for folder, circles in found.items()
        for c in circles
        if KNOWN_CYCLES.get(folder) != c
    ]
    assert not new, "untangle these (move what both need into a third module):\n" + "\n".join(new)
    gone = [folder for folder, c in KNOWN_CYCLES.items() if c not in found.get(folder, [])]
    assert not gone, f"no longer a circle: remove from KNOWN_CYCLES: {gone}"


def test_the_check_finds_a_circle() -> None:
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    components = list(strongly_connected(sorted(edges), edges))
    assert {"a", "b", "c"} in components and {"d"} in components


def test_the_graph_sees_lazy_and_relative_imports() -> None:
    known = modules()
    assert "drs_devcluster.runner_daemon" in imported(known["drs_devcluster.runner"], known)  # relative
    assert "drs_frontend.upstream.raw_client" in imported(known["drs_frontend.upstream.factory"], known)  # lazy
