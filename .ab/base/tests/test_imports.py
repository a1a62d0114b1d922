"""The import graph of maskc has no cycles, and no maskc module is imported inside a function.

A cycle means two modules cannot be read, tested or loaded one without the other; an import
inside a function hides one from this test and from the reader. Edges are read with `ast`,
without importing anything, from module-level and function-level imports alike.
"""
import ast
from pathlib import Path


PACKAGE = Path(__file__).resolve().parent.parent / "maskc"

# Lazy imports of maskc modules that stay, each for a reason other than a cycle.
LAZY_ALLOWED = {
    ("maskc.testing", "maskc.testing.strategies"):
        "strategies needs hypothesis, an optional (test-only) dependency: importing maskc.testing must not",
}



def _modules() -> dict:
    """{dotted module name: parsed tree} for every module of the package."""
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = ast.parse(path.read_text(), filename=str(path))
    return modules


MODULES = _modules()


def _is_package(name: str) -> bool:
    return any(other.startswith(name + ".") for other in MODULES)


def _targets(module: str, node) -> list:
    """The maskc modules that one import statement of `module` names.

    `from maskc.a import b` names maskc.a.b when b is a submodule and maskc.a (its __init__)
    otherwise; `import maskc.a.b` names maskc.a.b. The parent packages that Python imports on
    the way are not edges: every module would otherwise sit in a cycle through maskc/__init__.
    """
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name in MODULES]
    if node.level:  # relative: resolved against the importing module's package
        package = module if _is_package(module) else module.rpartition(".")[0]
        base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
        source = f"{base}.{node.module}" if node.module else base
    else:
        source = node.module
    if source not in MODULES:
        return []
    return [f"{source}.{alias.name}" if f"{source}.{alias.name}" in MODULES else source for alias in node.names]


def _imports(module: str, tree) -> list:
    """[(target, lineno, inside a function)] for every maskc import of `module`."""
    found = []

    def visit(node, in_function: bool):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.extend((target, node.lineno, in_function) for target in _targets(module, node))
        inner = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(tree, False)
    return [(target, line, lazy) for target, line, lazy in found if target != module]


def _graph() -> dict:
    return {module: sorted({target for target, _, _ in _imports(module, tree)}) for module, tree in MODULES.items()}


def _cycles(graph: dict) -> list:
    """One cycle, like ['a', 'b', 'a'], in each group of modules that reach one another (the
    strongly connected components of more than one module, found by Tarjan's algorithm)."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def connect(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return [_a_cycle(graph, component) for component in components]


def _a_cycle(graph: dict, component: set) -> list:
    """The shortest cycle through the first module of a strongly connected `component`."""
    start = min(component)
    paths, seen = [[start]], {start}
    while paths:
        path = paths.pop(0)
        for w in graph[path[-1]]:
            if w == start:
                return path + [start]
            if w in component and w not in seen:
                seen.add(w)
                paths.append(path + [w])
    raise AssertionError(f"{component} is not strongly connected")


def test_the_edges_follow_the_rules():
    # a submodule named in `from package import name` is an edge to it; any other name, to the package
    tree = ast.parse("from maskc.trace import dag, Traced\nimport maskc.analysis.intervals\n")
    got = [t for node in tree.body for t in _targets("maskc.codegen.spec", node)]
    assert got == ["maskc.trace.dag", "maskc.trace", "maskc.analysis.intervals"]
    relative = ast.parse("from . import dag\nfrom .symbols import SCORE\nfrom .. import errors\n")
    got = [t for node in relative.body for t in _targets("maskc.trace.canonical", node)]
    assert got == ["maskc.trace.dag", "maskc.trace.symbols", "maskc.errors"]
    assert _cycles({"a": ["b"], "b": ["c"], "c": ["a", "d"], "d": []}) == [["a", "b", "c", "a"]]


def test_no_import_cycles():
    cycles = _cycles(_graph())
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_no_maskc_import_inside_a_function():
    lazy = {(module, target): line for module, tree in MODULES.items()
            for target, line, in_function in _imports(module, tree) if in_function}
    bad = [f"{module} imports {target} inside a function (line {line})" for (module, target), line in lazy.items()
           if (module, target) not in LAZY_ALLOWED]
    assert not bad, "; ".join(bad) + "; import at the top of the module, and break any cycle that forbids it"
    stale = [pair for pair in LAZY_ALLOWED if pair not in lazy]
    assert not stale, f"allowed lazy imports that are no longer there, delete them: {stale}"
