"""The package's layers, read from its import statements: no module imports itself back through
others, the cost models sit below the strategies and the recommender above both, and neither
reaches up into the training entry (ddlx.run)."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "ddlx"


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")


def imports(path: Path, top_level_only: bool) -> set[str]:
    """The ddlx modules ``path`` imports (at its top level, or anywhere, in functions too)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else ast.walk(tree)
    out = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            names = [f"{target}.{a.name}" for a in node.names]
            out.update(n for n in [target, *names] if n in MODULES)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in MODULES)
    out.discard(name)
    return out


MODULES = {module_name(p) for p in PACKAGE.rglob("*.py")}
FILES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def test_no_module_imports_itself_back():
    graph = {m: imports(p, top_level_only=True) - {m.rsplit(".", 1)[0]} for m, p in FILES.items()}
    index, low, stack, on_stack, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
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
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, cycles


def test_cost_models_import_neither_strategies_nor_recommender_nor_the_run():
    above = ("ddlx.strategies", "ddlx.predict", "ddlx.run", "ddlx.records", "ddlx.tracking")
    reached = {(m, d) for m, p in FILES.items() if m.startswith("ddlx.costmodel")
               for d in imports(p, top_level_only=False) if d.startswith(above)}
    assert not reached


def test_the_recommender_and_the_strategies_do_not_reach_into_the_training_entry():
    reached = {(m, d) for m, p in FILES.items() if m.startswith(("ddlx.predict", "ddlx.strategies", "ddlx.costmodel"))
               for d in imports(p, top_level_only=False) if d == "ddlx.run"}
    assert not reached
