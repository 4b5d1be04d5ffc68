"""kvspec_core's modules import one another without cycles, and the runtime never imports the
package root.

The graph is built from the source (AST), not from ``sys.modules``: an edge ``a -> b`` for
every ``import``/``from`` statement in module ``a`` naming ``b`` (``from pkg import name``
points at the submodule ``pkg.name`` when there is one, else at ``pkg``). Imports inside
functions count: a deferred import is still a runtime dependency, and deferring one is the
usual way a cycle gets hidden rather than removed. Imports under ``if TYPE_CHECKING:`` do not
count: they never run, and annotations may name any module. Importing ``a.b`` also runs
``a/__init__.py``; that implicit step is not an edge, or every submodule would depend on its
package's re-exports.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import kvspec_core

PACKAGE_ROOT = Path(kvspec_core.__file__).parent
PACKAGE = "kvspec_core"


def module_files(root: Path = PACKAGE_ROOT, package: str = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package (``__init__`` as the
    package's own name)."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join([package, *parts])] = path
    return modules


def _is_type_checking_guard(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement that can run, at any depth, skipping ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking_guard(child):
                stack.extend(child.orelse)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child
            stack.append(child)


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (see the module docstring for the rules)."""
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in _runtime_imports(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = name.split(".")
                    anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                           for alias in node.names]
            for target in targets:
                while target and target not in modules:  # `import a.b.c` of a non-module c
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph.get(node, ())):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(cycles)


def test_kvspec_core_has_no_import_cycle() -> None:
    graph = import_graph(module_files())
    assert len(graph) > 50  # the scan sees the package
    assert import_cycles(graph) == []


def test_runtime_never_imports_the_package_root() -> None:
    graph = import_graph(module_files())
    offenders = sorted(name for name, targets in graph.items()
                       if name.startswith(f"{PACKAGE}.runtime") and PACKAGE in targets)
    assert offenders == []


def test_the_graph_sees_deferred_relative_and_guarded_imports(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("from pkg.a import thing\n")
    (package / "a.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from pkg.b import Hint\n"
        "def later():\n    from pkg.sub import c\n"
    )
    (package / "b.py").write_text("import pkg.a\n")
    (package / "sub" / "__init__.py").write_text("from . import c\n")
    (package / "sub" / "c.py").write_text("from ..b import x\n")
    graph = import_graph(module_files(package, "pkg"))
    assert graph == {"pkg": {"pkg.a"}, "pkg.a": {"pkg.sub.c"}, "pkg.b": {"pkg.a"},
                     "pkg.sub": {"pkg.sub.c"}, "pkg.sub.c": {"pkg.b"}}
    assert import_cycles(graph) == [["pkg.a", "pkg.b", "pkg.sub.c"]]
    assert import_cycles({"x": {"y"}, "y": set()}) == []
