"""Every ``deft`` command's ``--help`` renders (argparse formats help strings with ``%``)."""

from __future__ import annotations

import argparse

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
