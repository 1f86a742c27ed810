"""The package's shape: formats/ is torch-free storage, no import cycles, public names reachable.

See NOTE [ Torch-free pack files ] in fastloader/formats/__init__.py and ARCHITECTURE.md.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import fastloader

PACKAGE = Path(fastloader.__file__).resolve().parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, top_level_only: bool) -> set[str]:
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found = set()
    for node in nodes:
        if isinstance(node, ast.If) and top_level_only:  # `if TYPE_CHECKING:` blocks
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.startswith("fastloader"):
                found.add(node.module)
                found.update(
                    f"{node.module}.{alias.name}"
                    for alias in node.names
                    if (PACKAGE.parent / f"{node.module}.{alias.name}".replace(".", "/"))
                    .with_suffix(".py")
                    .exists()
                )
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("fastloader"))
    return found


def _graph(top_level_only: bool) -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {
        name: {m for m in _imports(path, top_level_only) if m in modules and m != name}
        for name, path in modules.items()
    }


def test_formats_imports_nothing_from_the_rest_of_fastloader():
    graph = _graph(top_level_only=False)
    upward = {
        (name, target)
        for name, targets in graph.items()
        if name.startswith("fastloader.formats")
        for target in targets
        if not target.startswith("fastloader.formats")
    }
    assert upward == set()


def test_module_level_imports_have_no_cycle():
    graph = _graph(top_level_only=True)
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for target in sorted(graph[node]):
            if target.startswith(node + "."):
                continue  # a package importing its own submodules
            if state.get(target) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path + [target]))
            if target not in state:
                visit(target, path + [target])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def test_formats_loads_without_torch():
    code = (
        "import sys, fastloader.formats, fastloader.formats.lmdb, fastloader.formats.verify; "
        "print('torch' in sys.modules)"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "False"


def test_public_submodules_are_attributes_after_import_fastloader():
    code = (
        "import fastloader; "
        "print(fastloader.transforms.RandomResizedCrop.__name__, "
        "fastloader.formats.FORMATS, callable(fastloader.pack))"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["RandomResizedCrop", "('lmdb',", "'hdf5')", "True"]
