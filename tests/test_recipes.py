"""Every command line the README, docs/ and the examples' docstrings show is accepted as
written: each one's arguments parse with the script's own parser (the examples, fastloader-pack
and fastloader's subcommands, the benchmarks). What they do is run by the tests of each script
(tests/test_examples.py runs the examples' recipes, the DDP stop-and-resume on another world
size included; tests/test_demo.py and test_benchmarks.py the benchmarks; test_cli.py the
commands). Every ```python block of the README and docs/ is valid Python whose fastloader
names exist."""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import re
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
COMMAND = re.compile(
    r"^(?:python3? (?:-m benchmarks\S*|examples/\w+\.py)|torchrun [^#]*?examples/\w+\.py"
    r"|fastloader-pack |fastloader (?:pack|info|verify) )"
)
PLACEHOLDER = re.compile(r"\b(?:SRC|DST|PACK|DATA|DIR)\b|\[|\(|\.\.\.")


def _command_lines(text: str) -> list[str]:
    """Commands in ```bash/```text blocks and docstring-style indented lines, and inline code
    spans that run an example or the benchmarks; comments cut, placeholders left out."""
    candidates, language = [], None
    for line in text.splitlines():  # the lines of shell (or untyped) fenced blocks
        if line.lstrip().startswith("```"):
            language = None if language is not None else line.strip()[3:] or "text"
        elif language in ("bash", "sh", "text"):
            candidates.append(line)
    candidates += re.findall(r"`((?:python3? (?:examples/|-m benchmarks)|torchrun )[^`]+)`", text)
    candidates += [line for line in text.splitlines() if line.startswith("    ")]
    commands = []
    for line in candidates:
        line = line.split("  #")[0].strip()
        if COMMAND.match(line) and not PLACEHOLDER.search(line):
            commands.append(line)
    return commands


def _documented() -> list[tuple[str, str]]:
    sources = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    found = [(path, line) for path in sources for line in _command_lines(path.read_text())]
    for path in sorted(EXAMPLES.glob("[!_]*.py")):
        docstring = ast.get_docstring(ast.parse(path.read_text())) or ""
        found += [(path, line) for line in _command_lines(docstring)]
    unique = dict.fromkeys((str(path.relative_to(ROOT)), line) for path, line in found)
    return list(unique)


class _Parsed(Exception):
    pass


def _parse_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stop every script right after it parsed its arguments (nothing runs)."""
    original = argparse.ArgumentParser.parse_args

    def parse_args(self, args=None, namespace=None):
        raise _Parsed(original(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_args)


def _run_parser(words: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    if words[0] == "torchrun":
        script = next(at for at, word in enumerate(words) if word.endswith(".py"))
        words = ["python", *words[script:]]
    if words[0].startswith("python") and words[1] == "-m":
        module, argv = words[2], words[3:]
        main = importlib.import_module(module if module != "benchmarks" else "benchmarks.__main__")
        main.main(argv)
    elif words[0].startswith("python"):
        path = ROOT / words[1]
        if path.stem == "train_lightning":
            pytest.importorskip("lightning")
        monkeypatch.syspath_prepend(str(EXAMPLES))
        monkeypatch.setattr(sys, "argv", [str(path), *words[2:]])
        spec = importlib.util.spec_from_file_location(f"_recipe_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.parse_args()
    else:
        from fastloader.cli import _pack_parser_for, build_parser

        if words[0] == "fastloader-pack":
            build_parser().parse_args(words[1:])
        elif words[1] == "pack":
            build_parser("fastloader pack").parse_args(words[2:])
        else:
            _pack_parser_for(words[1]).parse_args(words[2:])


def test_the_docs_show_the_recipes_this_test_checks() -> None:
    lines = [line for _, line in _documented()]
    assert any("--stop-after 2" in line and "torchrun" in line for line in lines)
    assert any("--resume" in line and "--nproc-per-node 3" in line for line in lines)
    assert any(line.startswith("fastloader-pack train/") for line in lines)
    assert "python3 -m benchmarks --quick" in lines


@pytest.mark.parametrize(("where", "line"), _documented())
def test_a_documented_command_line_parses_as_written(where, line, monkeypatch) -> None:
    _parse_only(monkeypatch)
    try:
        _run_parser(shlex.split(line, comments=True), monkeypatch)
    except _Parsed:
        return
    except SystemExit as exit_:  # --help
        assert exit_.code == 0 and "--help" in line, f"{where}: {line!r} exited {exit_.code}"
        return
    raise AssertionError(f"{where}: {line!r} did not parse its arguments")


def _python_blocks() -> list[tuple[str, str]]:
    blocks = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for code in re.findall(r"```python\n(.*?)```", path.read_text(), re.S):
            blocks.append((str(path.relative_to(ROOT)), code))
    return blocks


@pytest.mark.parametrize(("where", "code"), _python_blocks())
def test_documented_python_compiles_and_its_fastloader_names_exist(where, code) -> None:
    """Each ```python block is valid Python, and every name it takes from fastloader (its
    ``from fastloader... import`` lines and ``fastloader.X`` attributes) exists."""
    import fastloader

    last = code.rstrip().splitlines()[-1]
    if last.split("#")[0].rstrip().endswith(":"):  # an excerpt that stops at a loop's head
        code += " " * (len(last) - len(last.lstrip()) + 4) + "...\n"
    tree = ast.parse(code, where)  # a SyntaxError names the block ("..." is Python too)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fastloader"):
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name), f"{where}: {node.module}.{alias.name}"
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "fastloader"
        ):
            assert hasattr(fastloader, node.attr), f"{where}: fastloader.{node.attr}"


# --- where each name of a snippet comes from --------------------------------------------------
#
# A ```python block runs after `from fastloader import ...` alone, or says where each other
# name comes from. Allowed without a definition: builtins, fastloader's public names (its
# `__all__`, and the module `fastloader` itself), `torch`, and the standard library's modules
# used as modules (`random.seed`). Any other name is defined or imported in the block, or
# named in a comment of the block that says whose it is: `# yours: model, train_step` or
# `# from FILE: NAME, ...`.
# README blocks are excerpts of the examples (tests/test_examples.py): there, a name may also
# be one the excerpted example defines, when the README's section names that example's file.
WHERE = re.compile(r"#\s*(?:yours|from [^:#]+):(.*)")
MARKED = re.compile(r"<!-- example: (\S+) -->\s*\n```python\n(.*?)```", re.S)


class _Names(ast.NodeVisitor):
    """The names a piece of code binds, and those it reads (with whether as a module:
    ``name.attribute``)."""

    def __init__(self) -> None:
        self.bound: set[str] = set()
        self.read: dict[str, bool] = {}  # name -> read only as `name.attr`

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Load):
            self.read.setdefault(node.id, True)
        else:
            self.bound.add(node.id)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if isinstance(node.value, ast.Name) and isinstance(node.value.ctx, ast.Load):
            self.read.setdefault(node.value.id, True)
        else:
            self.visit(node.value)

    def generic_visit(self, node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Name) and isinstance(child.ctx, ast.Load):
                self.read[child.id] = False  # read as a value, not only as `child.attr`
                continue
            self.visit(child)

    def visit_Import(self, node: ast.Import) -> None:
        self.bound.update((alias.asname or alias.name).split(".")[0] for alias in node.names)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        self.bound.update(alias.asname or alias.name for alias in node.names)

    def visit_arg(self, node: ast.arg) -> None:
        self.bound.add(node.arg)

    def _named(self, node: ast.AST) -> None:
        self.bound.add(node.name)
        self.generic_visit(node)

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _named

    def visit_ExceptHandler(self, node: ast.ExceptHandler) -> None:
        if node.name:
            self.bound.add(node.name)
        self.generic_visit(node)


def _names(code: str) -> _Names:
    names = _Names()
    names.visit(ast.parse(code))
    return names


def _as_python(code: str) -> str:
    """The block as parseable Python: an excerpt that stops at a loop's head gets a body."""
    last = code.rstrip().splitlines()[-1]
    if last.split("#")[0].rstrip().endswith(":"):
        code += " " * (len(last) - len(last.lstrip()) + 4) + "...\n"
    return code


def _unexplained(code: str) -> list[str]:
    """The names ``code`` reads that it neither binds nor may take as given (see above)."""
    import builtins

    import fastloader

    names = _names(_as_python(code))
    said = {  # "# yours: model, train (a Dataset)": model, train
        name.strip()
        for match in WHERE.finditer(code)
        for name in re.sub(r"\([^()]*\)", "", match.group(1)).split(",")
        if name.strip().isidentifier()
    }
    given = said | {"fastloader", "torch"} | set(dir(builtins))
    modules = set(sys.stdlib_module_names)
    return sorted(
        name
        for name, as_module in names.read.items()
        if name not in names.bound
        and name not in given
        and name not in fastloader.__all__
        and not (as_module and name in modules)
    )


def _section(text: str, at: int) -> str:
    """The README section (heading to heading) around position ``at``, as it reads (without
    the example markers, which a reader does not see)."""
    start = text.rfind("\n#", 0, at)
    end = text.find("\n#", at)
    return re.sub(r"<!--.*?-->", "", text[start : end if end >= 0 else len(text)])  # seen


def _readme_blocks() -> list[tuple[str, str, str]]:
    text = (ROOT / "README.md").read_text()
    return [
        (match.group(1), match.group(2), _section(text, match.start()))
        for match in MARKED.finditer(text)
    ]


_DOCS_BLOCKS = [block for block in _python_blocks() if block[0] != "README.md"]


@pytest.mark.parametrize(
    ("where", "code"),
    _DOCS_BLOCKS,
    ids=[f"{where}-{at}" for at, (where, _) in enumerate(_DOCS_BLOCKS)],
)
def test_a_docs_snippet_says_where_each_of_its_names_comes_from(where, code) -> None:
    missing = _unexplained(code)
    assert not missing, (
        f"{where}: the block reads {missing} without defining or importing them; import them, "
        f"or say whose they are in a comment (`# yours: NAME, ...`):\n{code}"
    )


@pytest.mark.parametrize(
    ("example", "code", "section"),
    _readme_blocks(),
    ids=[f"{example}-{at}" for at, (example, _, _) in enumerate(_readme_blocks())],
)
def test_a_readme_excerpt_takes_its_other_names_from_the_example_it_names(
    example, code, section
) -> None:
    missing = _unexplained(code)
    if not missing:
        return
    assert example in section, (
        f"README.md: a block uses {missing} from {example}, and its section does not name "
        f"{example}:\n{code}"
    )
    defined = _names((ROOT / example).read_text()).bound
    assert set(missing) <= defined, f"{example} does not define {set(missing) - defined}"


def test_the_name_check_catches_a_name_from_nowhere() -> None:
    assert _unexplained("loader = DataLoader(TokenWindows('a.npy'))\n") == ["TokenWindows"]
    assert _unexplained("# yours: TokenWindows\nDataLoader(TokenWindows('a.npy'))\n") == []
    assert _unexplained("import math\nx = math.pi + random.random()\n") == []
    assert _unexplained("Mix({'math': math})\n") == ["math"]  # a dataset, not the module
    assert _unexplained("for x in y:\n") == ["y"]
