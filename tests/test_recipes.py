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
