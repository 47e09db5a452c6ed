"""rlmegatron's import graph, read from the source: no cycle between packages (nor among the controller's modules),
counting the imports inside functions; and an import inside a function only where it keeps something heavy lazy.

Every `import` / `from ... import` that runs counts, at the top of a module or inside a function (those under
`if TYPE_CHECKING:` never run and do not). Importing a.b.c runs the packages a and a.b too. A package is
rlmegatron.X (a sub-package or a top-level module).

The rule for an import of an rlmegatron module inside a function: it must keep a heavy dependency (HEAVY) out of the
importing module. The test proves it: the imported module's own top-level imports, followed through, reach a package
of HEAVY that the importing module's do not (e.g. `rlm validate` stays free of torch because cli.py imports the job
runner inside `train`). An import that keeps nothing heavy away belongs at the top of the module. Where another
reason applies, the import says it in a comment on its line or the line above: `# lazy: <reason>`. Third-party
imports inside functions are not checked: they are the heavy and optional packages themselves.
"""
from __future__ import annotations

import ast
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "rlmegatron"
# Slow to import or pulling a framework; pydantic and yaml too, so that `rlm`'s parser starts without them
# (tests/entry/test_cli.py) and only the command that runs pays for what it needs.
HEAVY = {"torch", "megatron", "transformers", "ray", "mlflow", "sglang", "sglang_router", "transformer_engine", "apex",
         "safetensors", "huggingface_hub", "tokenizers", "pyarrow", "numpy", "pydantic", "yaml"}
MARKER = "# lazy:"


@dataclass(frozen=True)
class Import:
    module: str
    """The importing module."""
    target: str
    """The module imported (rlmegatron's) or the top-level package (a third party's)."""
    line: int
    lazy: bool
    """Inside a function."""
    marked: bool
    """Carries `# lazy: <reason>`."""

    @property
    def where(self) -> str:
        return f"{self.module}:{self.line}"


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = modules()


def _type_checking(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    name = getattr(test, "id", getattr(test, "attr", None))
    return isinstance(test, (ast.Name, ast.Attribute)) and name == "TYPE_CHECKING"


def imports_of(module: str) -> list[Import]:
    path = MODULES[module]
    source = path.read_text()
    lines = source.splitlines()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[Import] = []

    def marked(node: ast.stmt) -> bool:
        around = lines[max(node.lineno - 2, 0) : node.end_lineno]
        return any(MARKER in line for line in around)

    def targets(node: ast.stmt) -> list[str]:
        if isinstance(node, ast.Import):
            return [alias.name for alias in node.names]
        base = node.module or ""
        if node.level:
            base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
        # `from a import b`: the module a.b where b is one, else a.
        return [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]

    def visit(node: ast.AST, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if _type_checking(child):
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                for target in dict.fromkeys(targets(child)):
                    if not target.startswith("rlmegatron"):
                        target = target.split(".")[0]
                    found.append(Import(module, target, child.lineno, lazy, marked(child)))
            visit(child, lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(source), False)
    return found


IMPORTS = [found for module in sorted(MODULES) for found in imports_of(module)]


def run_by(target: str) -> list[str]:
    """The rlmegatron modules that importing `target` runs: it and its packages."""
    parts = target.split(".")
    return [name for name in (".".join(parts[:i]) for i in range(2, len(parts) + 1)) if name in MODULES]


def package_of(module: str) -> str:
    return ".".join(module.split(".")[:2])


def eager_closure(module: str) -> set[str]:
    """Everything importing `module` runs at import time: rlmegatron modules and third-party top-level packages."""
    top_level = defaultdict(list)
    for found in IMPORTS:
        if not found.lazy:
            top_level[found.module].append(found.target)
    seen: set[str] = set()
    stack = run_by(module)
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        for target in top_level.get(name, ()):
            stack.extend(run_by(target) if target.startswith("rlmegatron") else [target])
    return seen


def heavy(module: str) -> set[str]:
    return eager_closure(module) & HEAVY


def cycles(edges: dict[str, dict[str, list[str]]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each a list of nodes."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in edges.get(node, {}):
            if other not in index:
                connect(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            connect(node)
    return found


def describe(component: list[str], edges: dict[str, dict[str, list[str]]]) -> str:
    """A shortest cycle through the component's first node, each step with the imports that make it."""
    start, members = component[0], set(component)
    came_from: dict[str, str] = {}
    frontier = [start]
    while start not in came_from:
        reached = []
        for node in frontier:
            for other in sorted(edges[node]):
                if other in members and other not in came_from:
                    came_from[other] = node
                    reached.append(other)
        frontier = reached
    path = [start]
    while len(path) == 1 or path[-1] != start:
        path.append(came_from[path[-1]])
    path.reverse()
    return "cycle: " + " -> ".join(f"{a} ({', '.join(edges[a][b][:2])})" for a, b in zip(path, path[1:])) + \
        f" -> {start}"


def graph(node_of, within=lambda module: True) -> dict[str, dict[str, list[str]]]:
    """node -> node -> the imports (module:line) that make the edge, over the rlmegatron imports of modules `within`."""
    edges: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for found in IMPORTS:
        if not found.target.startswith("rlmegatron") or not within(found.module):
            continue
        for target in run_by(found.target):
            a, b = node_of(found.module), node_of(target)
            where = found.where + (" (in a function)" if found.lazy else "")
            if a != b and within(target) and where not in edges[a][b]:
                edges[a][b].append(where)
    return edges


def test_the_graph_is_read():
    # Facts that fail if the walk stops finding imports or following them, not counts to keep up to date.
    cli = {(found.target, found.lazy) for found in IMPORTS if found.module == "rlmegatron.entry.cli"}
    assert ("argparse", False) in cli and ("rlmegatron.driver.job", True) in cli
    assert "torch" in heavy("rlmegatron.driver.trainer") and "torch" not in heavy("rlmegatron.config")
    assert cycles({"a": {"b": ["a:1"]}, "b": {"c": ["b:1"]}, "c": {"a": ["c:1"]}, "d": {"a": ["d:1"]}}) == [
        ["a", "b", "c"]]


def test_no_cycle_between_packages():
    edges = graph(package_of)
    if cycles(edges):
        pytest.fail("\n".join(describe(component, edges) for component in cycles(edges)))


def test_no_cycle_among_the_drivers_modules():
    edges = graph(lambda module: module, within=lambda module: module.startswith("rlmegatron.driver."))
    if cycles(edges):
        pytest.fail("\n".join(describe(component, edges) for component in cycles(edges)))


def test_an_import_inside_a_function_keeps_something_heavy_out_or_says_why():
    needless = []
    for found in IMPORTS:
        if found.lazy and found.target.startswith("rlmegatron") and not found.marked:
            target = run_by(found.target)[-1]
            if not heavy(target) - heavy(found.module):
                needless.append(f"{found.where}: imports {target} inside a function, but it brings nothing heavy "
                                f"that {found.module} lacks; import it at the top (or say why: `{MARKER} <reason>`)")
    if needless:
        pytest.fail("\n".join(needless))


# Each process has its package; the driver reaches the others only through the transport. A library package (config,
# models, rollout, ...) runs in whichever process imports it, so it imports none of the four.
PROCESS_LAYERS = {"rlmegatron.driver": 0, "rlmegatron.transport": 1, "rlmegatron.rank": 2, "rlmegatron.pool": 2}
ENTRY_POINTS = {"rlmegatron.entry", "rlmegatron.__main__"}
"""The commands: each is the top of its process (`rlm train` the driver's, `rlm convert` the converter's ranks')."""


def test_imports_go_from_the_driver_to_the_transport_to_the_ranks_and_pool_never_back():
    backwards = []
    for found in IMPORTS:
        if not found.target.startswith("rlmegatron"):
            continue
        source, target = package_of(found.module), package_of(found.target)
        if source == target or target not in PROCESS_LAYERS or source in ENTRY_POINTS:
            continue
        if source not in PROCESS_LAYERS or PROCESS_LAYERS[target] <= PROCESS_LAYERS[source]:
            backwards.append(f"{found.where}: {source} imports {found.target}"
                             + (" (in a function)" if found.lazy else ""))
    if backwards:
        pytest.fail("\n".join(backwards))


def test_the_driver_does_not_import_megatron_core():
    """The driver builds no Megatron model: importing Megatron-Core there would cost seconds of every `rlm train`'s
    start-up and print its notices on a run's stderr, where a user's mistake must be one line."""
    assert "megatron" not in heavy("rlmegatron.driver.job")
