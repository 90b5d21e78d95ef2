"""The import graph of ``shared/`` has no cycle, ``shared/`` never imports ``services/`` nor a service's own
libraries (Redis, metrics, an HTTP server: ``services/metadata.py``, ``telemetry.py``, ``http_server.py``), and
``shared.errors`` sits below every other module (it imports none of them). An import counts wherever it is
written (a function's lazy import too: it still runs), except under ``if TYPE_CHECKING:`` (annotations only);
importing ``a.b.c`` also imports the packages ``a.b`` and ``a`` (their ``__init__``)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imported_names(source: str) -> set[str]:
    """Every dotted name ``source`` imports at run time (a ``from a import b`` gives ``a`` and ``a.b``)."""
    names: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child):
                for other in child.orelse:
                    visit(other)
                continue
            if isinstance(child, ast.Import):
                names.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and not child.level:
                names.add(child.module)
                names.update(f"{child.module}.{a.name}" for a in child.names)
            visit(child)

    visit(ast.parse(source))
    return names


def graph(package: str = "shared") -> dict[str, set[str]]:
    """Module -> the modules of the project it imports (packages' ``__init__`` included)."""
    files = {module_name(p): p for d in ("shared", "services") for p in (ROOT / d).rglob("*.py")}
    out = {}
    for name, path in files.items():
        if not name.startswith(package):
            continue
        deps = set()
        for imported in imported_names(path.read_text()):
            parts = imported.split(".")
            deps.update(".".join(parts[:i]) for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in files)
        out[name] = deps - {name} - {p for p in deps if name.startswith(p + ".")}  # a module's own packages
    return out


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return found


def test_shared_has_no_import_cycle():
    assert cycles(graph()) == []


def test_shared_never_imports_the_services():
    into_services = {m: sorted(d for d in deps if d.startswith("services")) for m, deps in graph().items()}
    assert {m: d for m, d in into_services.items() if d} == {}


SERVICE_LIBRARIES = ("redis", "prometheus_client", "http.server", "socketserver")


def test_shared_holds_no_service_module():
    found = {}
    for path in (ROOT / "shared").rglob("*.py"):
        used = [n for n in imported_names(path.read_text()) if any(n == s or n.startswith(s + ".")
                                                                   for s in SERVICE_LIBRARIES)]
        if used:
            found[module_name(path)] = sorted(used)
    assert found == {}


def test_the_errors_module_sits_below_everything():
    assert graph()["shared.errors"] == set()


def test_the_checker_finds_a_cycle_through_a_lazy_import_and_ignores_type_checking_ones():
    lazy = "def f():\n    from shared.b import x\n"
    annotation = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from shared.a import y\n"
    assert "shared.b" in imported_names(lazy) and "shared.a" not in imported_names(annotation)
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
