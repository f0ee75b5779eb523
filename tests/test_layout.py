"""The package's layout rules, read from its source: imports go one way (no circle, not even
through TYPE_CHECKING imports), and the pure parts stay pure (aggregators/ without Ray or
torch.distributed, the worker loop without Ray: there TYPE_CHECKING-only imports are
annotations and do not count)."""

from __future__ import annotations

import ast
from pathlib import Path

import isoloco_ray

PACKAGE = Path(isoloco_ray.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def runtime_imports(path: Path, typing_too: bool = False) -> set[str]:
    """Every module `path` imports (at its top or inside functions), less TYPE_CHECKING's
    unless `typing_too`."""
    tree = ast.parse(path.read_text())
    typing_only = set() if typing_too else {
        id(node) for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for node in ast.walk(block)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}
IMPORTS = {name: runtime_imports(path) for name, path in MODULES.items()}


def test_no_import_circle():
    """Not even through imports made for annotations only (TYPE_CHECKING): a module that
    needs another's types to describe its own work sits above it."""
    graph = {name: {other for other in runtime_imports(path, typing_too=True)
                    if other in MODULES and other != name}
             for name, path in MODULES.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    circles = []

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for other in sorted(graph[name]):
            if state.get(other) == 1:
                circles.append(path[path.index(other):] + [other])
            elif other not in state:
                visit(other, path + [other])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert circles == []


def test_the_pure_parts_import_neither_ray_nor_collectives():
    def uses(name: str, prefix: str) -> bool:
        return any(i == prefix or i.startswith(prefix + ".") for i in IMPORTS[name])

    aggregators = [name for name in MODULES if name.startswith("isoloco_ray.aggregators")]
    assert len(aggregators) > 3
    for name in aggregators:
        assert not uses(name, "ray") and not uses(name, "torch.distributed"), name
        assert not uses(name, "isoloco_ray.workers"), name
    for name in ("isoloco_ray.workers.loop", "isoloco_ray.data.stream",
                 "isoloco_ray.data.checks", "isoloco_ray.config", "isoloco_ray.metrics",
                 "isoloco_ray.run_records", "isoloco_ray.report"):
        assert not uses(name, "ray"), name


def test_the_configuration_and_the_registry_never_import_the_workers():
    """Layers point one way: config/ and strategies.py (which config reads) know nothing of
    workers/, not even for annotations; the route an outer step takes is the registry's."""
    readers = [name for name in MODULES
               if name.startswith("isoloco_ray.config") or name == "isoloco_ray.strategies"]
    assert len(readers) > 3
    for name in readers:
        imports = runtime_imports(MODULES[name], typing_too=True)
        assert not [i for i in imports if i.startswith("isoloco_ray.workers")], name


def test_no_code_but_the_registry_tests_a_strategys_name():
    """What a strategy does is read off its registry entry (strategies.py), never decided by
    comparing `outer.strategy` with a name elsewhere: a new strategy is one entry. The
    aggregators compare merge names of their own table (MERGES), which is theirs."""
    from isoloco_ray.strategies import STRATEGIES

    found = []
    for name, path in MODULES.items():
        if name == "isoloco_ray.strategies" or name.startswith("isoloco_ray.aggregators"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                names = [side.value for side in sides if isinstance(side, ast.Constant)]
                if any(isinstance(n, str) and n in STRATEGIES for n in names):
                    found.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    assert found == []
