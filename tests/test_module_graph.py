"""raytrain's import graph, read with ast: no cycles, and lower layers never import higher ones (issue 43)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "raytrain"

# (importer prefix, imported prefix, why): a module under the first may not import one under the second.
FORBIDDEN = [
    ("raytrain.ckpt", "raytrain.worker", "the worker loop uses checkpoints, not the other way round"),
]


def _module_name(path: Path, package: Path) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _targets(node: ast.AST, name: str, is_package: bool, modules: set[str]) -> set[str]:
    """The raytrain modules one import statement loads (`from pkg import mod` names mod, not pkg)."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name in modules}
    base = node.module or ""
    if node.level:  # relative: from the module's package, one level up per extra dot
        pkg = name.split(".") if is_package else name.split(".")[:-1]
        pkg = pkg[:len(pkg) - node.level + 1]
        base = ".".join(pkg + ([node.module] if node.module else []))
    return {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names
            if f"{base}.{a.name}" in modules or base in modules}


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the raytrain modules it imports, counting every import statement at any depth (in functions too)."""
    paths = {_module_name(p, package): p for p in sorted(package.rglob("*.py"))}
    modules = set(paths)
    graph = {}
    for name, path in paths.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        graph[name] = {t for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                       for t in _targets(n, name, is_package, modules)} - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle as [a, b, ..., a], or [] when the graph has none (iterative DFS: no recursion limit)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if start in state:
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return []


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def layer_violations(graph: dict[str, set[str]], rules=FORBIDDEN) -> list[str]:
    return [f"{m} imports {t} ({why})" for low, high, why in rules for m in sorted(graph) if _under(m, low)
            for t in sorted(graph[m]) if _under(t, high)]


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert not cycle, ("import cycle: " + " -> ".join(cycle) + "; move what the modules share into the lower-level "
                       "one (a function-level import still counts)")


def test_no_lower_layer_imports_a_higher_one():
    bad = layer_violations(import_graph())
    assert not bad, bad


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = tmp_path / "raytrain" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return tmp_path / "raytrain"


def test_the_checks_catch_a_function_level_cycle_and_a_forbidden_edge(tmp_path):
    pkg = _tree(tmp_path, {
        "__init__.py": "",
        "a.py": "from raytrain import b\n",
        "b.py": "def f():\n    from .c import g\n",  # relative, inside a function
        "c.py": "import raytrain.a\n",
        "ckpt/__init__.py": "",
        "ckpt/x.py": "def f():\n    from raytrain.worker import runlog\n",
        "worker/__init__.py": "",
        "worker/runlog.py": "from ..ckpt import x\n",
    })
    graph = import_graph(pkg)
    assert graph["raytrain.ckpt.x"] == {"raytrain.worker.runlog"}  # the module named, not its package
    assert graph["raytrain.worker.runlog"] == {"raytrain.ckpt.x"}
    assert find_cycle(graph) == ["raytrain.a", "raytrain.b", "raytrain.c", "raytrain.a"]
    graph["raytrain.c"] = set()
    assert find_cycle(graph) == ["raytrain.ckpt.x", "raytrain.worker.runlog", "raytrain.ckpt.x"]
    assert layer_violations(graph) == [f"raytrain.ckpt.x imports raytrain.worker.runlog ({FORBIDDEN[0][2]})"]
    assert find_cycle({"raytrain.a": {"raytrain.b"}, "raytrain.b": set()}) == []
