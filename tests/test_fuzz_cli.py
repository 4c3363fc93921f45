"""The commands under random input: any bytes as a prompt, any combination of each command's
real flags with valid and invalid values. Every run exits 0 or 2 (a one-line ``error:``
message), never with a traceback. In-process (``deft.cli.main``) on a tiny GGUF model.
"""

from __future__ import annotations

import argparse
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deft.cli import build_parser, main
from strategies_on_device import write_trace
from test_fuzz_loaders import write_tiny_gguf

FUZZ = settings(max_examples=20, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
PROMPT_COMMANDS = {"generate": [], "sample": ["-n", "2"], "beam": ["-k", "2"], "speculate": []}
FUZZED_COMMANDS = [*PROMPT_COMMANDS, "replay"]  # demo, bench and serve run for minutes or serve


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    """The files the flags point at: the tiny model (64-token context, so that any
    --max-new-tokens ends soon), a trace, a draft-tree file, junk and a missing path."""
    root = tmp_path_factory.mktemp("cli")
    write_tiny_gguf(root / "tiny.gguf", max_position_embeddings=64)
    write_trace(root / "trace.json")
    (root / "tree.json").write_text('{"Tree_Structure": [[0], [1], [0, 0]]}')
    (root / "junk.json").write_bytes(b"\xff{not json")
    return {"model": str(root / "tiny.gguf"), "trace": str(root / "trace.json"), "tree": str(root / "tree.json"),
            "junk": str(root / "junk.json"), "missing": str(root / "missing.gguf"), "dir": str(root)}


def run(argv: list[str], capsys) -> None:
    """``deft argv`` exits 0, or 2 with one ``error:`` line, never with another exception."""
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse
        code = exc.code
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    assert code in (0, 2), (argv, code, err)
    if code == 2:
        errors = [line for line in err.splitlines() if ": error: " in line]
        assert len(errors) == 1 and err.rstrip().endswith(errors[0]), (argv, err)


def as_argv(raw: bytes) -> str:
    """Bytes as Python puts them in ``sys.argv`` (undecodable bytes as surrogate escapes)."""
    return os.fsdecode(raw.replace(b"\0", b""))  # a NUL cannot be in an argument


@FUZZ
@given(command=st.sampled_from(sorted(PROMPT_COMMANDS)), prompts=st.lists(st.binary(max_size=40), min_size=1,
                                                                          max_size=3), chat=st.booleans())
def test_any_bytes_as_prompts(paths, capsys, command, prompts, chat):
    argv = [command, *map(as_argv, prompts), *PROMPT_COMMANDS[command], "--max-new-tokens", "2",
            "--model", paths["model"]]
    run(argv + ["--chat"] * chat, capsys)


def test_an_undecodable_argument_taken_for_a_flag_is_one_error_line(paths, capsys):
    """A prompt after the first that starts with ``-`` is an unknown flag to argparse: the
    error names it with its undecodable byte escaped, on a stream (pytest's) that escapes
    nothing itself."""
    run(["beam", "", as_argv(b"-\x80"), "-k", "2", "--model", paths["model"]], capsys)


def options(command: str) -> dict[str, argparse.Action]:
    """``command``'s flags (long names) and their actions, read from the real parser."""
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {max(a.option_strings, key=len): a for a in sub.choices[command]._actions
            if a.option_strings and not isinstance(a, argparse._HelpAction)}


NUMBERS = ["-1", "0", "1", "2", "3", "0.5", "1e309", "nan", "-inf", str(2**64), "x", ""]


def values(flag: str, action: argparse.Action, paths: dict[str, str]) -> st.SearchStrategy[str]:
    """Values for ``flag``: its choices and paths where it takes them, numbers and junk otherwise."""
    if action.choices:
        return st.sampled_from([*map(str, action.choices), "nope"])
    if flag in ("--model", "--draft-model", "--tree", "--workloads"):
        return st.sampled_from([paths["model"], paths["tree"], paths["junk"], paths["missing"], paths["dir"]])
    if flag == "--kv-memory":
        return st.sampled_from(["1", "100KB", "2MiB", "64MiB", "1 GiB", "0", "lots"])
    return st.sampled_from(NUMBERS)


@FUZZ
@given(command=st.sampled_from(FUZZED_COMMANDS), data=st.data())
def test_random_flag_combinations(paths, capsys, command, data):
    flags = options(command)
    chosen = data.draw(st.lists(st.sampled_from(sorted(flags)), max_size=5, unique=True), label="flags")
    argv = [command]
    if command == "replay":
        argv.append(data.draw(st.sampled_from([paths["trace"], paths["junk"], "keywordToT", "nope"])))
    else:
        argv += [data.draw(st.sampled_from(["The capital of France is", "", "\udcff"]))]
    for flag, default in (("--model", paths["model"]), ("--max-new-tokens", "2")):
        if flag in flags and flag not in chosen:
            argv += [flag, default]
    if command == "sample" and "-n" not in chosen:
        argv += ["-n", "2"]
    if command == "beam" and "-k" not in chosen:
        argv += ["-k", "2"]
    for flag in chosen:
        argv.append(flag)
        if flags[flag].nargs != 0:
            argv.append(data.draw(values(flag, flags[flag], paths), label=flag))
    run(argv, capsys)


def test_trace_deeper_than_the_context(paths, tmp_path, capsys):
    """Found by the fuzzer: the recorded trace outgrows the model's context (a one-line error)."""
    short = tmp_path / "short.gguf"
    write_tiny_gguf(short, max_position_embeddings=16)
    assert main(["replay", paths["trace"], "--model", str(short)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("  ... ")]
    assert len(err) == 1 and err[0].startswith("deft replay: error: TRACE trace.json: ") and "context of 16" in err[0]
