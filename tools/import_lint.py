"""Fail on import cycles and on imports of another module's private names.

Why: the five distributions are meant to change independently (see
``docs/architecture.md``). Two kinds of coupling make that hard and neither is
caught by ruff or by the tests:

* **Import cycles** between the project's modules. A cycle that only works
  because one side imports lazily (inside a function) still ties the modules
  together and breaks as soon as someone hoists the import, so lazy imports
  count. Imports under ``if TYPE_CHECKING:`` never run and do not count.
* **Private names used across modules**: ``from x.y import _name`` or
  ``x.y._name`` on a module imported from the project, where ``_name`` is a
  ``_``-prefixed name (dunders such as ``__version__`` excepted). A helper that
  another module needs is public; make it so, or move it where it belongs. The
  names the architecture spec itself spells with an underscore are allowed
  (``ALLOWED_PRIVATE_NAMES`` below). Importing a private *module*
  (``spyre_inference.models._token_type``) from outside its own package is refused too.

The project's modules are the ``spyre_inference.*`` files under
``packages/*/src/`` and ``src/``. Standard library only: it parses the sources
with ``ast`` and imports nothing of the project. ``from pkg import name``
where ``pkg.name`` is a submodule is an import of that submodule; an import of
``a.b.c`` is an edge to ``a.b.c`` only (not to the packages above it, which
would make every ``__init__`` that imports its own submodules a cycle).

Usage: ``python tools/import_lint.py [REPO_ROOT]``; exits 1 on any finding, 0
otherwise, printing one summary line. ``nox -s lint`` runs it.
"""

from __future__ import annotations

import ast
import dataclasses
import sys
from collections import deque
from pathlib import Path

TOP_PACKAGE = "spyre_inference"

#: ``_``-prefixed names another module may import: those the architecture spec
#: (``shared/spec/plugin-architecture.txt``) spells with an underscore as the
#: name of a cross-module seam. Only those the code imports across modules are
#: listed; the spec's other underscored names (``_apply``, ``_rotate_neox_2x2``,
#: ``_compile_for_spyre``, ``_spyre_device``, ``_compute_slot_mapping``, ...)
#: are methods or stay inside their own module.
ALLOWED_PRIVATE_NAMES: dict[str, str] = {
    # The spec's model wrapper between the runner and the model ("_SpyreModelWrapper
    # sits between the model runner and the model"); the runner builds it.
    "_SpyreModelWrapper": "spyre_inference.platform.model_wrapper",
}


@dataclasses.dataclass(frozen=True)
class Edge:
    """One import of module ``dst`` by module ``src`` at ``path:line``."""

    src: str
    dst: str
    path: Path
    line: int
    lazy: bool


@dataclasses.dataclass(frozen=True)
class Finding:
    path: Path
    line: int
    message: str


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


class _ImportCollector(ast.NodeVisitor):
    """Every import statement of a file, with whether it is lazy (inside a
    function) and whether it is under ``if TYPE_CHECKING:``."""

    def __init__(self) -> None:
        self.found: list[tuple[ast.Import | ast.ImportFrom, bool, bool]] = []
        self._depth = 0
        self._type_checking = False

    def _function(self, node: ast.AST) -> None:
        self._depth += 1
        self.generic_visit(node)
        self._depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_If(self, node: ast.If) -> None:
        if not _is_type_checking(node.test):
            self.generic_visit(node)
            return
        outer, self._type_checking = self._type_checking, True
        for stmt in node.body:
            self.visit(stmt)
        self._type_checking = outer
        for stmt in node.orelse:
            self.visit(stmt)

    def _import(self, node: ast.Import | ast.ImportFrom) -> None:
        self.found.append((node, self._depth > 0, self._type_checking))

    visit_Import = visit_ImportFrom = _import


class Project:
    """The project's modules (name -> file) and the checks over them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.files: dict[str, Path] = {}
        self.packages: set[str] = {TOP_PACKAGE}  # the PEP 420 namespace has no file
        for src in [root / "src", *sorted(root.glob("packages/*/src"))]:
            for path in sorted((src / TOP_PACKAGE).rglob("*.py")):
                parts = list(path.relative_to(src).with_suffix("").parts)
                if parts[-1] == "__init__":
                    parts.pop()
                    self.packages.add(".".join(parts))
                self.files[".".join(parts)] = path
        self._trees: dict[str, ast.Module] = {}
        self.edges: list[Edge] = []
        self.findings: list[Finding] = []

    def is_module(self, name: str) -> bool:
        return name in self.files or name in self.packages

    def tree(self, module: str) -> ast.Module:
        if module not in self._trees:
            path = self.files[module]
            self._trees[module] = ast.parse(path.read_text(encoding="utf-8"), str(path))
        return self._trees[module]

    def rel(self, path: Path) -> str:
        return str(path.relative_to(self.root))

    # -- where a name is defined -------------------------------------------
    def defined_in(self, module: str, name: str, seen: frozenset[str] = frozenset()) -> str:
        """The module that defines ``name`` as seen from ``module`` (following
        re-exports); ``module`` itself if it is not found."""
        if module not in self.files or module in seen:
            return module
        body = list(self.tree(module).body)
        while body:
            stmt = body.pop()
            if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                if stmt.name == name:
                    return module
            elif isinstance(stmt, ast.ImportFrom):
                for alias in stmt.names:
                    if (alias.asname or alias.name) == name:
                        src = self._resolve_from(module, stmt)
                        if src is not None and not self.is_module(f"{src}.{alias.name}"):
                            return self.defined_in(src, alias.name, seen | {module})
            elif isinstance(stmt, ast.Assign | ast.AnnAssign | ast.AugAssign):
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                for target in targets:
                    if any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(target)):
                        return module
            elif isinstance(stmt, ast.If | ast.Try | ast.With):
                for field in ("body", "orelse", "finalbody", "handlers"):
                    body.extend(getattr(stmt, field, []))
            elif isinstance(stmt, ast.ExceptHandler):
                body.extend(stmt.body)
        return module

    # -- imports ------------------------------------------------------------
    def _resolve_from(self, module: str, node: ast.ImportFrom) -> str | None:
        """The absolute module ``from X import ...`` names, or None if not ours."""
        if node.level == 0:
            base = node.module or ""
        else:
            package = module if module in self.packages else module.rpartition(".")[0]
            parts = package.split(".")
            if node.level - 1 > len(parts):
                return None
            package = ".".join(parts[: len(parts) - (node.level - 1)])
            base = f"{package}.{node.module}" if node.module else package
        return base if self.is_module(base) else None

    def _private_module(self, src: str, dst: str, path: Path, line: int) -> None:
        """Refuse ``dst`` if it has a private component whose package ``src`` is outside."""
        parts = dst.split(".")
        for i, part in enumerate(parts):
            owner = ".".join(parts[:i])
            if _is_private(part) and src != owner and not src.startswith(owner + "."):
                self.findings.append(
                    Finding(path, line, f"private module {dst} imported from outside {owner}")
                )
                return

    def _private_name(self, src: str, module: str, name: str, path: Path, line: int) -> None:
        where = self.defined_in(module, name)
        if where == src or ALLOWED_PRIVATE_NAMES.get(name) == where:
            return
        shown = f"{module} (defined in {where})" if where != module else module
        self.findings.append(Finding(path, line, f"private name {name} of {shown}"))

    def _edge(self, src: str, dst: str, path: Path, line: int, lazy: bool, tc: bool) -> None:
        if dst in self.files and not tc and dst != src:
            self.edges.append(Edge(src, dst, path, line, lazy))
        self._private_module(src, dst, path, line)

    def scan(self) -> None:
        for src, path in self.files.items():
            collector = _ImportCollector()
            collector.visit(self.tree(src))
            bound: dict[str, str] = {}  # local name -> project module it is bound to
            for node, lazy, tc in collector.found:
                if isinstance(node, ast.Import):
                    for alias in node.names:
                        if not self.is_module(alias.name):
                            continue
                        self._edge(src, alias.name, path, node.lineno, lazy, tc)
                        if alias.asname:
                            bound[alias.asname] = alias.name
                        else:
                            bound[alias.name.partition(".")[0]] = alias.name.partition(".")[0]
                    continue
                base = self._resolve_from(src, node)
                if base is None:
                    continue
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    if self.is_module(sub):
                        self._edge(src, sub, path, node.lineno, lazy, tc)
                        bound[alias.asname or alias.name] = sub
                    else:
                        self._edge(src, base, path, node.lineno, lazy, tc)
                        if _is_private(alias.name):
                            self._private_name(src, base, alias.name, path, node.lineno)
            self._attributes(src, path, bound)

    def _attributes(self, src: str, path: Path, bound: dict[str, str]) -> None:
        """``mod._name`` and ``pkg._mod`` on names bound to the project's modules."""
        tree = self.tree(src)
        inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or id(node) in inner:
                continue
            chain: list[str] = []
            value: ast.expr = node
            while isinstance(value, ast.Attribute):
                chain.append(value.attr)
                value = value.value
            if not isinstance(value, ast.Name) or value.id not in bound:
                continue
            module = bound[value.id]
            for attr in reversed(chain):
                if self.is_module(f"{module}.{attr}"):
                    module = f"{module}.{attr}"
                    self._private_module(src, module, path, node.lineno)
                    continue
                if _is_private(attr):
                    self._private_name(src, module, attr, path, node.lineno)
                break

    # -- cycles ---------------------------------------------------------------
    def cycles(self) -> list[list[Edge]]:
        """One shortest cycle through each module that is on a cycle, without
        repeating a cycle already reported from another of its modules."""
        by_src: dict[str, list[Edge]] = {}
        for edge in sorted(self.edges, key=lambda e: (e.lazy, e.line)):
            by_src.setdefault(edge.src, []).append(edge)  # module-level imports first
        out: dict[str, list[Edge]] = {}
        for start in self.files:
            cycle = _shortest_cycle(by_src, start)
            if cycle:
                key = min(tuple(e.src for e in cycle[i:] + cycle[:i]) for i in range(len(cycle)))
                out.setdefault(" ".join(key), cycle)
        return list(out.values())


def _shortest_cycle(by_src: dict[str, list[Edge]], start: str) -> list[Edge] | None:
    """A shortest path of imports from ``start`` back to itself (breadth first)."""
    came: dict[str, Edge] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for edge in by_src.get(node, []):
            if edge.dst == start:
                path = [edge]
                while path[0].src != start:
                    path.insert(0, came[path[0].src])
                return path
            if edge.dst not in came:
                came[edge.dst] = edge
                queue.append(edge.dst)
    return None


def lint(root: Path) -> tuple[list[list[Edge]], list[Finding], Project]:
    """Scan the project under ``root``: its import cycles and private imports."""
    project = Project(root)
    project.scan()
    findings = sorted(set(project.findings), key=lambda f: (str(f.path), f.line, f.message))
    return project.cycles(), findings, project


def main(argv: list[str]) -> int:
    root = Path(argv[0]).resolve() if argv else Path(__file__).resolve().parent.parent
    cycles, findings, project = lint(root)
    for cycle in cycles:
        print("import cycle: " + " -> ".join([e.src for e in cycle] + [cycle[0].src]))
        for e in cycle:
            lazy = " (lazy)" if e.lazy else ""
            print(f"  {project.rel(e.path)}:{e.line}: {e.src} imports {e.dst}{lazy}")
    for f in findings:
        print(f"{project.rel(f.path)}:{f.line}: {f.message}")
    verdict = "FAILED" if cycles or findings else "ok"
    print(
        f"import_lint: {len(project.files)} modules, {len(project.edges)} imports: "
        f"{len(cycles)} cycles, {len(findings)} private imports: {verdict}"
    )
    return 1 if cycles or findings else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
