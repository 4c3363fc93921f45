"""Every ``deft`` command's ``--help`` renders (argparse formats help strings with ``%``), and
every script in ``tools/`` answers ``--help``."""

from __future__ import annotations

import argparse
import ast
import runpy
import sys
from pathlib import Path

import pytest

from deft.cli import build_parser, main


def _commands(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    found = [prefix]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += _commands(sub, prefix + (name,))
    return found


COMMANDS = _commands(build_parser())


def test_every_command_is_listed():
    assert {("generate",), ("bench", "e2e"), ("bench", "serve"), ("serve",)} <= set(COMMANDS)


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_help_renders(command, capsys):
    with pytest.raises(SystemExit) as exc:
        main([*command, "--help"])
    assert exc.value.code == 0
    assert "usage: deft" in capsys.readouterr().out


TOOLS = Path(__file__).resolve().parent.parent / "tools"
PLAIN_TOOLS = sorted(p.name for p in TOOLS.glob("*.py")
                     if "from _usage import args" in p.read_text())


def test_every_tool_takes_help():
    """Each script in ``tools/`` parses its command line with argparse or ``_usage.args``,
    so that ``--help`` says how to run it instead of running it."""
    scripts = [p for p in TOOLS.glob("*.py") if not p.name.startswith("_")]
    assert len(PLAIN_TOOLS) >= 12
    assert [p.name for p in scripts
            if "argparse" not in p.read_text() and p.name not in PLAIN_TOOLS] == []


@pytest.mark.parametrize("tool", PLAIN_TOOLS)
def test_plain_tool_help_prints_its_docstring(tool, monkeypatch, capsys):
    """``python tools/TOOL.py --help`` prints the docstring and exits 0 before it needs a GPU
    (these tools read plain positional arguments)."""
    path = TOOLS / tool
    monkeypatch.syspath_prepend(str(TOOLS))
    monkeypatch.setattr(sys, "argv", [str(path), "--help"])
    with pytest.raises(SystemExit) as exc:
        runpy.run_path(str(path), run_name="__main__")
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == ast.get_docstring(ast.parse(path.read_text()))
