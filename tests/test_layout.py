"""The package's shape: subpackages by idea, imports pointing down, no circles, facts reachable.

Every import in the package is read, function-level and ``TYPE_CHECKING`` ones included (a
function-level import is still a dependency: it only moves the failure to run time). See
docs/layout.md for the layers and NOTE [ Torch-free pack files ] in fastloader/formats/__init__.py.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import fastloader

PACKAGE = Path(fastloader.__file__).resolve().parent
REPO = PACKAGE.parent

# The layers, lowest first: a unit may import units of lower layers only (and itself). A unit
# is a subpackage or a top-level module. Peers in one layer do not import each other.
LAYERS = [
    {"formats", "parent_death"},
    {"device", "shards"},
    {"vision"},
    {"datasets", "packing", "sampling"},
    {"stats"},
    {"loader"},
    {"cli", "lightning"},
    {"__main__", "fastloader"},  # the root package re-exports the public API
]
RANK = {unit: rank for rank, units in enumerate(LAYERS) for unit in units}
MAX_LINES = 500


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "fastloader"


def _imports(path: Path) -> set[str]:
    """Every fastloader module ``path`` imports, anywhere in the file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if not node.module.startswith("fastloader"):
                continue
            if node.module == "fastloader" and all(a.name.startswith("__") for a in node.names):
                continue  # `from fastloader import __version__`: the package's identity
            found.add(node.module)
            found.update(
                f"{node.module}.{a.name}"
                for a in node.names
                if f"{node.module}.{a.name}" in MODULES
            )
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("fastloader"))
        elif isinstance(node, ast.ImportFrom) and node.level > 0:
            raise AssertionError(f"{path}: relative import (use absolute ones)")
    return {m for m in found if m in MODULES}


GRAPH = {name: _imports(path) - {name} for name, path in MODULES.items()}


def test_every_module_belongs_to_a_layer():
    assert {_unit(m) for m in MODULES} <= set(RANK)


def test_imports_point_down_the_layers():
    upward = sorted(
        f"{name} imports {target}"
        for name, targets in GRAPH.items()
        for target in targets
        if _unit(target) != _unit(name) and RANK[_unit(target)] >= RANK[_unit(name)]
    )
    assert upward == []


def test_no_import_cycle_function_level_imports_included():
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for target in sorted(GRAPH[node]):
            if target.startswith(node + "."):
                continue  # a package importing its own submodules
            if state.get(target) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path + [target]))
            if target not in state:
                visit(target, path + [target])
        state[node] = 2

    for module in sorted(GRAPH):
        if module not in state:
            visit(module, [module])


def test_no_module_is_longer_than_the_limit():
    long = {
        name: n for name, p in MODULES.items() if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}


def test_each_subpackage_says_its_idea_and_what_it_may_import():
    for init in PACKAGE.glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "May import" in doc or "imports nothing" in doc, init


def test_formats_loads_without_torch():
    code = (
        "import sys, fastloader.formats, fastloader.formats.lmdb, fastloader.formats.verify; "
        "print('torch' in sys.modules)"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "False"


def _run(code: str) -> str:
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return run.stdout


def test_every_public_name_is_an_attribute_right_after_import():
    names = _run("import fastloader; print(' '.join(fastloader.__all__))").split()
    code = "import fastloader\n" + "".join(f"fastloader.{n}\n" for n in names) + "print('ok')"
    assert _run(code).strip() == "ok"
    # the documented collate_fn, first thing after the import (docs/any-sample.md)
    assert "ragged_as_lists" in _run("import fastloader; print(fastloader.collate.ragged_as_lists)")


def test_documented_module_paths_import_as_the_module_that_holds_them():
    # one fresh interpreter per path would cost a torch import each: one for all, in order
    checks = "".join(
        f"import fastloader.{name} as alias\n"
        f"from fastloader import {name} as attribute\n"
        f"import {real} as real\n"
        f"print({name!r}, alias is real, attribute is real, real.__spec__.name)\n"
        for name, real in sorted(fastloader.PUBLIC_MODULES.items())
    )
    lines = _run("import fastloader\n" + checks).splitlines()
    expected = [f"{n} True True {r}" for n, r in sorted(fastloader.PUBLIC_MODULES.items())]
    assert lines == expected


def test_public_classes_keep_one_identity_through_both_paths():
    from fastloader.samplers import BlockShuffleSampler
    from fastloader.sampling.samplers import BlockShuffleSampler as Real
    from fastloader.transforms import RandomResizedCrop
    from fastloader.vision.transforms import RandomResizedCrop as RealCrop

    assert BlockShuffleSampler is Real and RandomResizedCrop is RealCrop


# module paths as docs cite them: fastloader/x/y.py, fastloader/x/ or dotted fastloader.x.y
_CITED_PATH = re.compile(r"\bfastloader/[\w/]+(?:\.py|/)")


def _cited_texts() -> list[Path]:
    texts = [REPO / "pyproject.toml", REPO / "ARCHITECTURE.md", REPO / "README.md"]
    texts += sorted((REPO / "docs").glob("*.md"))
    texts += sorted(PACKAGE.rglob("*.py"))
    return [t for t in texts if t.exists()]


def test_every_module_path_cited_in_docs_and_code_exists():
    missing = set()
    for text in _cited_texts():
        for cited in _CITED_PATH.findall(text.read_text()):
            if not (REPO / cited).exists():
                missing.add(f"{text.relative_to(REPO)}: {cited}")
    assert sorted(missing) == []


_CITED_NAME = re.compile(r"`(fastloader(?:\.\w+)+)")


def test_every_dotted_name_cited_in_the_docs_exists():
    import importlib

    missing = set()
    for text in _cited_texts():
        if text.suffix != ".md":
            continue
        for cited in _CITED_NAME.findall(text.read_text()):
            parts = cited.split(".")
            for cut in range(len(parts), 0, -1):
                try:
                    value = importlib.import_module(".".join(parts[:cut]))
                except ImportError:
                    continue
                try:
                    for name in parts[cut:]:
                        value = getattr(value, name)
                except AttributeError:
                    missing.add(f"{text.relative_to(REPO)}: {cited}")
                break
    assert sorted(missing) == []
