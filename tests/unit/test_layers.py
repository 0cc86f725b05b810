"""The import graph of ``ftkit``: which layer may import which.

Every module under ``ftkit/`` is parsed (``ast``), and every import in it is collected, those
inside functions and under ``if TYPE_CHECKING:`` included. The rules:

* ftkit never imports the CLI (``cli`` / ``ftkit_cli``): the front end sits on top of it;
* only ``ftkit.vllm`` imports vLLM (``vllm``, ``vllm_ascend``);
* ``ftkit.backends`` never imports ``ftkit.recovery`` (recovery uses the backends' protocol,
  not the other way round);
* ``ftkit.recovery`` and ``ftkit.inject`` (the two halves) never import each other: both
  depend on ``ftkit.contracts`` only;
* ``ftkit.contracts`` imports neither ``ftkit.recovery``, ``ftkit.inject``, ``ftkit.backends``
  nor ``ftkit.vllm`` (nor vLLM);
* no module imports the root package ``ftkit`` for a name (its public surface re-exports from
  the modules, so such an import would be a cycle through ``ftkit/__init__.py``);
* no import cycle between ftkit's parts (its subpackages and top-level modules), except the
  ones listed in ``ALLOWED_CYCLES`` with their reason. Imports under ``if TYPE_CHECKING:`` do
  not count for cycles (they never run), but do for the rules above.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "ftkit"

#: Part-level cycles that are allowed, each with its reason. Empty: there are none.
ALLOWED_CYCLES: dict[frozenset[str], str] = {}
#: Packages whose modules count as parts of their own, each with its reason. Their
#: ``__init__`` must import none of ftkit (checked below), so that importing one module of
#: theirs runs no other.
SPLIT_PACKAGES: dict[str, str] = {
    "ftkit.contracts": "independent records, one module per contract: the fault plan is made "
                       "of the scenario's FaultSpec (contracts.plan -> scenario -> kinds), "
                       "while a kind's injector reads request ids (kinds -> "
                       "contracts.requests), which import nothing of ftkit",
}

#: Modules that count as parts of their own inside a package that does not split, each with
#: its reason. Each imports nothing of ftkit (checked below), so no cycle can run through it.
LEAF_MODULES: dict[str, str] = {
    "ftkit.vllm.sampling": "vLLM's judgement of a request's sampling fields, asked by the "
                           "scenario rules at validation (scenario -> vllm.sampling), while the "
                           "rest of ftkit.vllm builds engines from the scenario's EngineSpec",
    "ftkit.serve.state": "the state a server's workers publish for its API server: written by "
                         "the workers (vllm.worker -> serve.state) and read by the server's "
                         "routes, while ftkit.serve's launcher builds on ftkit.vllm",
}


@dataclass(frozen=True)
class Import:
    importer: str  # the importing module, dotted
    target: str  # the imported module, dotted (resolved, relative imports included)
    line: int
    type_only: bool  # under ``if TYPE_CHECKING:``


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_module(dotted: str) -> bool:
    path = ROOT.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(path: Path, source: str | None = None) -> list[Import]:
    """Every import in the module at ``path`` (``source`` stands in for its text)."""
    importer = module_name(path)
    package = importer if path.name == "__init__.py" else importer.rpartition(".")[0]
    tree = ast.parse(source if source is not None else path.read_text(encoding="utf-8"))
    found: list[Import] = []

    def visit(node: ast.AST, type_only: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, True)
            for child in node.orelse:
                visit(child, type_only)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append(Import(importer, alias.name, node.lineno, type_only))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for alias in node.names:
                # ``from ftkit.recovery import monitor`` imports a module; ``from
                # ftkit.recovery import assemble`` imports the package.
                sub = f"{module}.{alias.name}"
                target = sub if module.startswith("ftkit") and is_module(sub) else module
                found.append(Import(importer, target, node.lineno, type_only))
        for child in ast.iter_child_nodes(node):
            visit(child, type_only)

    visit(tree, False)
    return found


def all_imports() -> list[Import]:
    return [i for path in sorted(PACKAGE.rglob("*.py")) for i in imports_of(path)]


def part_of(dotted: str) -> str:
    """The part of ftkit a module belongs to: ``ftkit.<subpackage or top-level module>``,
    or ``ftkit.<package>.<module>`` in the ``SPLIT_PACKAGES``, or one of the ``LEAF_MODULES``."""
    if dotted in LEAF_MODULES:
        return dotted
    depth = 3 if ".".join(dotted.split(".")[:2]) in SPLIT_PACKAGES else 2
    return ".".join(dotted.split(".")[:depth])


def within(dotted: str, prefix: str) -> bool:
    return dotted == prefix or dotted.startswith(prefix + ".")


# --- the rules ------------------------------------------------------------------------------

def forbidden(imp: Import) -> str | None:
    """Why ``imp`` breaks a layering rule, or ``None``."""
    top = imp.target.split(".")[0]
    if top in ("cli", "ftkit_cli"):
        return "ftkit imports the CLI"
    if top in ("vllm", "vllm_ascend") and not within(imp.importer, "ftkit.vllm"):
        return "only ftkit.vllm imports vLLM"
    if within(imp.importer, "ftkit.backends") and within(imp.target, "ftkit.recovery"):
        return "ftkit.backends imports ftkit.recovery"
    for a, b in (("ftkit.recovery", "ftkit.inject"), ("ftkit.inject", "ftkit.recovery")):
        if within(imp.importer, a) and within(imp.target, b):
            return f"{a} imports {b}: the two halves meet in ftkit.contracts only"
    if within(imp.importer, "ftkit.contracts"):
        for upper in ("ftkit.recovery", "ftkit.inject", "ftkit.backends", "ftkit.vllm", "vllm"):
            if within(imp.target, upper):
                return f"ftkit.contracts imports {upper}"
    if imp.target == "ftkit" and imp.importer != "ftkit":
        return "a module imports the public surface ftkit for a name"
    return None


def violations(imports: list[Import]) -> list[str]:
    return [f"{i.importer}:{i.line} imports {i.target}: {why}"
            for i in imports if (why := forbidden(i)) is not None]


def part_graph(imports: list[Import]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for i in imports:
        if i.type_only or not within(i.target, "ftkit") or i.target == "ftkit":
            continue
        a, b = part_of(i.importer), part_of(i.target)
        if a != b and a != "ftkit":
            graph.setdefault(a, set()).add(b)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected parts of ``graph`` with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(set(graph) | {w for ws in graph.values() for w in ws}):
        if v not in index:
            connect(v)
    return found


def unexplained_cycles(imports: list[Import]) -> list[list[str]]:
    return [c for c in cycles(part_graph(imports)) if frozenset(c) not in ALLOWED_CYCLES]


# --- the tree as it is ----------------------------------------------------------------------

def test_the_parser_sees_the_modules_it_should():
    imports = all_imports()
    importers = {i.importer for i in imports}
    assert {"ftkit.vllm.worker", "ftkit.recovery.assembly", "ftkit.backends.cpu"} <= importers
    # Function-level imports count: the worker imports torch.distributed inside a method.
    assert any(i.importer == "ftkit.vllm.worker" and i.target == "torch.distributed"
               for i in imports)


def test_ftkit_keeps_its_layers():
    assert violations(all_imports()) == []


def test_ftkit_has_no_import_cycle_between_its_parts():
    assert unexplained_cycles(all_imports()) == []


@pytest.mark.parametrize("package", sorted(SPLIT_PACKAGES))
def test_a_split_package_imports_none_of_its_modules(package):
    init = ROOT.joinpath(*package.split(".")) / "__init__.py"
    assert [i.target for i in imports_of(init) if within(i.target, "ftkit")] == []


@pytest.mark.parametrize("module", sorted(LEAF_MODULES))
def test_a_leaf_module_imports_none_of_ftkit(module):
    path = ROOT.joinpath(*module.split(".")).with_suffix(".py")
    assert [i.target for i in imports_of(path) if within(i.target, "ftkit")] == []


# --- the checks catch what they should (a module given a forbidden import) ----------------

def with_extra(module: str, statement: str) -> list[Import]:
    """The tree's imports with ``statement`` added inside a function of ``module``."""
    path = ROOT.joinpath(*module.split("."))
    path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    source = path.read_text(encoding="utf-8") + f"\n\ndef _added():\n    {statement}\n"
    return [i for i in all_imports() if i.importer != module] + imports_of(path, source)


@pytest.mark.parametrize("module, statement", [
    ("ftkit.runner", "import ftkit_cli.main"),
    ("ftkit.recovery.monitor", "from vllm.platforms import current_platform"),
    ("ftkit.backends.cpu", "from ftkit.recovery.coordinator import Decision"),
    ("ftkit.backends.base", "from ..recovery import assemble"),
    ("ftkit.recovery.step_wrapper", "from ftkit.inject import Injector"),
    ("ftkit.inject", "import ftkit.recovery.coordinator"),
    ("ftkit.contracts.eventlog", "from ftkit.backends.base import Backend"),
    ("ftkit.contracts.step", "from ftkit.vllm import worker"),
    ("ftkit.recovery.assembly", "from ftkit import errors as e, __version__"),
])
def test_a_forbidden_import_is_caught(module, statement):
    assert violations(with_extra(module, statement)), statement


def test_a_new_cycle_is_caught():
    # ftkit.config imports ftkit.bounds; the reverse closes a cycle between the two parts.
    assert unexplained_cycles(with_extra("ftkit.bounds", "from ftkit.config import CONFIG_KEY"))


def test_a_cycle_through_a_module_of_a_split_package_is_caught():
    # contracts.plan -> scenario -> kinds -> contracts.requests: closed by requests -> scenario.
    extra = "from ftkit.scenario.model import FaultSpec"
    assert unexplained_cycles(with_extra("ftkit.contracts.requests", extra))


def test_a_type_only_import_counts_for_the_rules_but_not_for_cycles():
    extra = "if TYPE_CHECKING:\n        from ftkit.recovery import Decision"
    imports = with_extra("ftkit.backends.base", extra)
    assert violations(imports)
    extra = "if TYPE_CHECKING:\n        from ftkit.config import CONFIG_KEY"
    assert not unexplained_cycles(with_extra("ftkit.bounds", extra))
