"""What the ``deft`` commands share: user errors, the parser, the shared flags (defined
once here), model loading, value checks and progress lines."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ..checks import int_in_range

__all__ = [
    "DEVICES",
    "PAGE_SIZE",
    "CliError",
    "Parser",
    "add_workloads_flag",
    "flag_error",
    "in_range",
    "load",
    "load_from",
    "model_flags",
    "pages_for",
    "progress",
    "prompt_flags",
    "prompt_text",
    "require_device",
    "sampling_flags",
    "workloads",
]

DEVICES = ("cpu", "cuda")
PAGE_SIZE = 16  # the engines the commands build use the default page size


class CliError(Exception):
    """A user error: printed as one line, exit code 2."""


class Parser(argparse.ArgumentParser):
    """Argument errors as one line on stderr (exit code 2), pointing to ``--help``."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# ------------------------------------------------------------------ shared flags


def model_flags() -> argparse.ArgumentParser:
    """``--model PATH`` and ``--device``, as a parent parser."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--model", metavar="PATH",
                   help="GGUF file or Hugging Face directory (default: SmolLM2-135M-Instruct GGUF)")
    p.add_argument("--device", choices=DEVICES, default="cpu", help="default cpu")
    return p


def prompt_flags() -> argparse.ArgumentParser:
    """``PROMPT...``, ``--max-new-tokens N`` and ``--chat``, as a parent parser."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("prompt", nargs="+", type=prompt_text, metavar="PROMPT",
                   help="prompt text (several: one batch)")
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N",
                   help="tokens to generate per sequence (default 64)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    return p


def sampling_flags(temperature: float | None, temperature_help: str) -> argparse.ArgumentParser:
    """``--temperature T`` (default ``temperature``), ``--top-k``, ``--top-p``, ``--seed``."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--temperature", type=float, default=temperature, metavar="T", help=temperature_help)
    p.add_argument("--top-k", type=int, default=0, metavar="K", help="keep the K most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="keep the smallest set of tokens with mass >= P (1 = off)")
    p.add_argument("--seed", type=int, help="random seed (reproducible sampling)")
    return p


def add_workloads_flag(parser: argparse.ArgumentParser) -> None:
    """``--workloads DIR``: where the recorded workloads are."""
    parser.add_argument("--workloads", metavar="DIR",
                        help="recorded workloads directory (default: $DEFT_WORKLOADS or ../shared/workloads)")


# ------------------------------------------------------------------ helpers


def prompt_text(value: str) -> str:
    """A ``PROMPT`` argument as text: bytes that are not UTF-8 (which Python keeps in
    ``sys.argv`` as surrogate escapes) become U+FFFD, as a tokenizer needs valid text."""
    try:
        raw = value.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # other lone surrogates (only from a Python caller)
        raw = value.encode("utf-8", "surrogatepass")
    return raw.decode("utf-8", "replace")


def flag_error(exc: ValueError) -> CliError:
    """A library ``ValueError`` ``"field_name: why"`` as a :class:`CliError` naming ``--field-name``."""
    field, _, why = str(exc).partition(": ")
    return CliError(f"--{field.replace('_', '-')}: {why}")


def require_device(device: str) -> None:
    """:class:`CliError` for ``--device cuda`` without a CUDA device."""
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise CliError("--device cuda: no CUDA device is available")


def load(args: argparse.Namespace) -> tuple[Any, Any]:
    """The model and tokenizer of ``--model`` on ``--device``; user errors as :class:`CliError`."""
    return load_from(args.model, args.device, "--model")


def load_from(path: str | None, device: str, flag: str) -> tuple[Any, Any]:
    """The model and tokenizer at ``path`` (of ``flag``) on ``device``."""
    from ..model import load_model

    require_device(device)
    try:
        return load_model(path, device=device)
    except (FileNotFoundError, ValueError) as exc:
        raise CliError(f"{flag}: {exc}") from exc


def in_range(value: int, flag: str, low: int, high: int) -> int:
    """``value`` of ``flag``, an integer in ``[low, high]``, else :class:`CliError`."""
    try:
        return int_in_range(value, flag, low, high)
    except ValueError as exc:
        raise CliError(str(exc)) from exc


def pages_for(tokens: int) -> int:
    """Pages of :data:`PAGE_SIZE` slots that hold ``tokens`` tokens."""
    return -(-tokens // PAGE_SIZE)


def workloads(path: str | None) -> Path | None:
    """The recorded-workloads directory of ``--workloads`` (``None``, with a note, if absent)."""
    from ..recorded import workloads_dir

    try:
        return workloads_dir(path)
    except FileNotFoundError as exc:
        if path is not None:
            raise CliError(str(exc)) from exc
        print(f"note: {exc}; recorded workloads are skipped", file=sys.stderr)
        return None


def progress(msg: str) -> None:
    """A progress line on stderr."""
    print(f"  ... {msg}", file=sys.stderr, flush=True)
