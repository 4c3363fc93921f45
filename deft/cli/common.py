"""What the ``deft`` commands share: user errors, the parser, the shared flags (defined
once here), model loading, value checks and progress lines."""

from __future__ import annotations

import argparse
import difflib
import re
import sys
import time
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from ..checks import int_in_range

if TYPE_CHECKING:
    from ..cache import CacheFullError
    from ..engine.config import EngineConfig

__all__ = [
    "DEVICES",
    "DTYPES",
    "PAGE_SIZE",
    "SERVER_CALIBRATION",
    "CliError",
    "KVBudget",
    "Parser",
    "add_workloads_flag",
    "byte_size",
    "choose_device",
    "engine_config",
    "flag_error",
    "format_bytes",
    "in_range",
    "kv_dtype_flag",
    "load",
    "load_from",
    "model_flags",
    "pages_for",
    "printable",
    "progress",
    "prompt_flags",
    "prompt_text",
    "require_device",
    "sampling_flags",
    "workloads",
]

DEVICES = ("auto", "cpu", "cuda")  # auto: resolved by main before a command runs
DTYPES = ("auto", "bfloat16", "float16", "float32")
PAGE_SIZE = 16  # the engines the commands build use the default page size
# What a server's FP8 scales come from (deft.serve.scheduler.calibrate_kv), for --kv-dtype's help.
SERVER_CALIBRATION = "a fixed paragraph at start-up, never a request's K/V"
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*", re.IGNORECASE)


class CliError(Exception):
    """A user error: printed as one line, exit code 2."""


def printable(text: str) -> str:
    """``text`` with the surrogates that undecodable argument bytes become escaped
    (``\\udc80``), so that any stream writes it, not only one that escapes them itself."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class Parser(argparse.ArgumentParser):
    """Argument errors as one line on stderr (exit code 2), pointing to ``--help``. Options
    the command does not know are reported by the command itself, with the nearest option it
    has (``--max-tokens``: did you mean ``--max-new-tokens``?)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, printable(f"{self.prog}: error: {message} (see {self.prog} --help)\n"))

    def parse_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                   namespace: argparse.Namespace | None = None) -> argparse.Namespace:
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            command = self._command(parsed)
            known = list(command._option_string_actions)
            hints = [f"did you mean {close[0]}?" for x in extras if x.startswith("-")
                     for close in [difflib.get_close_matches(x.split("=")[0], known, 1, 0.7)]
                     if close]
            command.error("; ".join([f"unrecognized arguments: {' '.join(extras)}", *hints]))
        return parsed

    def _command(self, parsed: argparse.Namespace) -> argparse.ArgumentParser:
        """The (sub)command parser that ``parsed`` was read by: the deepest chosen one."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                chosen = action.choices.get(getattr(parsed, action.dest, None) or "")
                if isinstance(chosen, Parser):
                    return chosen._command(parsed)
        return self


# ------------------------------------------------------------------ shared flags


def model_flags(default_model: str = "SmolLM2-135M-Instruct GGUF",
                kv_calibration: str = "the first prompt chunk",
                tensor_parallel: bool = True) -> argparse.ArgumentParser:
    """``--model MODEL``, ``--device``, ``--dtype``, ``--kv-memory SIZE``, ``--kv-dtype`` and
    ``--tensor-parallel-size N`` (:mod:`.parallel`), as a parent parser; ``default_model``
    says what runs without ``--model``, ``kv_calibration`` what an FP8 cache's scales come
    from. Commands that run on one device pass ``tensor_parallel=False``: their ``--help``
    leaves the flag out, and they refuse it with a reason of their own."""
    from ..cache.pool import KV_MEMORY_FRACTION

    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--model", metavar="MODEL",
                   help="GGUF file, Hugging Face directory, or random:NAME[:layers=N] for random "
                   "weights of known shapes (NAME llama-3-8b, qwen3-8b or tiny; byte-level tokenizer) "
                   f"(default: {default_model})")
    p.add_argument("--device", choices=DEVICES, default="auto",
                   help="where the model runs (default auto: cuda when a CUDA device is available, "
                   "else cpu; said on stderr once the model is loaded)")
    p.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="the weights' dtype, GGUF weights dequantised to it (default auto: the "
                   "checkpoint's torch_dtype on cuda, bfloat16 where it states none, float32 on cpu)")
    p.add_argument("--kv-memory", type=byte_size, metavar="SIZE",
                   help="memory for the K/V cache, e.g. 2GiB, 512MB or a byte count (default: "
                   f"{KV_MEMORY_FRACTION:.0%}% of the memory free once the model is loaded, and "
                   "never more than the requests could need; deft serve: --num-pages); generate "
                   "and sample requests that do not fit wait for others to finish, others stop "
                   "with an error")
    kv_dtype_flag(p, kv_calibration)
    p.add_argument("--tensor-parallel-size", "--tp", type=int, default=1, metavar="N",
                   dest="tensor_parallel_size",
                   help="split the model over N devices (tensor parallelism); run the command "
                   "under torchrun --nproc-per-node N (default 1)" if tensor_parallel
                   else argparse.SUPPRESS)
    return p


def kv_dtype_flag(parser: argparse.ArgumentParser, calibration: str) -> None:
    """``--kv-dtype auto|fp8_e4m3``: the K/V cache's format (``EngineConfig.kv``), its FP8
    scales calibrated on ``calibration``."""
    from ..cache.pool import CALIBRATION_HEADROOM, KV_DTYPE_NAMES

    parser.add_argument("--kv-dtype", choices=KV_DTYPE_NAMES, default="auto",
                        help="K/V cache format: auto (the model's dtype) or fp8_e4m3 (float8 "
                        "e4m3, half the bytes of a 16-bit cache, with static per-layer, per-KV-head "
                        f"scales calibrated on {calibration}: its largest |K|, |V| times "
                        f"{CALIBRATION_HEADROOM:g} map to the format's largest value; queries "
                        "and activations keep the model's dtype; twice the tokens in the same "
                        "memory; on the H200 a decode step was 1.6-6.2%% slower end to end than "
                        "with a 16-bit cache, and 1.4-1.6%% faster on two reasoning trees: it "
                        "buys room, not speed; see docs/benchmarks.md) (default auto)")


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
                        help="recorded workloads directory (default: $DEFT_WORKLOADS, else "
                        "shared/workloads beside the checkout, else beside the working directory)")


# ------------------------------------------------------------------ helpers


def prompt_text(value: str) -> str:
    """A ``PROMPT`` argument as text: bytes that are not UTF-8 (which Python keeps in
    ``sys.argv`` as surrogate escapes) become U+FFFD, as a tokenizer needs valid text."""
    try:
        raw = value.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # other lone surrogates (only from a Python caller)
        raw = value.encode("utf-8", "surrogatepass")
    return raw.decode("utf-8", "replace")


def byte_size(value: str) -> int:
    """A ``--kv-memory`` size in bytes: ``2GiB``, ``512MB``, ``1.5 GB`` or a plain byte count."""
    m = _SIZE.fullmatch(value)
    unit = m and _UNITS.get(m.group(2).lower())
    size = int(Fraction(m.group(1)) * unit) if m and unit else 0
    if size < 1:
        raise argparse.ArgumentTypeError(
            f"expected a size of at least one byte such as 2GiB, 512MB or 1048576 (bytes; units B, "
            f"KB, MB, GB, TB, KiB, MiB, GiB, TiB), got {value!r}")
    return size


def format_bytes(n: int) -> str:
    """``n`` bytes for people: ``512 B``, ``1.5 MiB``, ``194.0 GiB``."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def flag_error(exc: ValueError) -> CliError:
    """A library ``ValueError`` ``"field_name: why"`` as a :class:`CliError` naming ``--field-name``."""
    field, _, why = str(exc).partition(": ")
    return CliError(f"--{field.replace('_', '-')}: {why}")


def require_device(device: str) -> None:
    """:class:`CliError` for ``--device cuda`` without a CUDA device."""
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise CliError("--device cuda: no CUDA device is available")


def choose_device(args: argparse.Namespace) -> None:
    """``args.device`` ``auto`` as ``cuda`` when a CUDA device is available, else ``cpu``
    (``args.auto_device`` says it was chosen so)."""
    args.auto_device = getattr(args, "device", None) == "auto"
    if args.auto_device:
        from ..model.loader import resolve_device

        args.device = resolve_device("auto").type


def load(args: argparse.Namespace, tp: Any = None) -> tuple[Any, Any]:
    """The model and tokenizer of ``--model`` on ``--device`` in ``--dtype`` (with ``tp``,
    a :class:`~deft.distributed.TPGroup`, this rank's shard on its device); user errors as
    :class:`CliError`. Once loaded, one line on stderr says what runs where."""
    start = time.perf_counter()
    device = args.device if tp is None else str(tp.device)
    model, tok = load_from(args.model, device, "--model", args.dtype, tp)
    chosen = " (--device auto)" if getattr(args, "auto_device", False) else ""
    rank = "" if tp is None else f" (tensor-parallel rank {tp.rank} of {tp.world_size})"
    cap = getattr(model.config, "context_cap", "")
    capped = f", context {model.config.max_position_embeddings} ({cap})" if cap else ""
    progress(f"model on {device}{chosen}{rank}, {str(model.dtype).removeprefix('torch.')}, "
             f"loaded in {time.perf_counter() - start:.1f} s{capped}")
    return model, tok


def load_from(path: str | None, device: str, flag: str, dtype: str = "auto",
              tp: Any = None) -> tuple[Any, Any]:
    """The model and tokenizer at ``path`` (of ``flag``), or of the random-model spec
    ``random:...`` (:mod:`deft.model.synthetic`), on ``device`` in ``dtype`` (a name or
    ``auto``, as :func:`deft.model.load_model` takes it); with ``tp``, this rank's shard."""
    from ..model import is_random_spec, load_model, load_random
    from ..model.sharding import shard_model

    require_device(device)
    try:
        if is_random_spec(path):
            model, tok = load_random(path, device, dtype)
            return (model if tp is None else shard_model(model, tp)), tok
        return load_model(path, device=device, dtype=dtype, tp=tp)
    except (FileNotFoundError, ImportError, ValueError) as exc:  # ImportError: a missing extra
        raise CliError(f"{flag}: {exc}") from exc


def in_range(value: int, flag: str, low: int, high: int) -> int:
    """``value`` of ``flag``, an integer in ``[low, high]``, else :class:`CliError`."""
    try:
        return int_in_range(value, flag, low, high)
    except ValueError as exc:
        raise CliError(str(exc)) from exc


def engine_config(num_pages: int, device: str | None = None, kv_dtype: str = "auto",
                  **options: Any) -> EngineConfig:
    """The configuration of a command's engine: ``num_pages`` of :data:`PAGE_SIZE` slots on
    ``device`` (the model's if ``None``), K/V in the ``--kv-dtype`` format ``kv_dtype``,
    other fields as given or the defaults."""
    from ..engine.config import EngineConfig

    return EngineConfig(num_pages=num_pages, page_size=PAGE_SIZE, device=device, kv=kv_dtype,
                        **options)


def pages_for(tokens: int) -> int:
    """Pages of :data:`PAGE_SIZE` slots that hold ``tokens`` tokens."""
    return -(-tokens // PAGE_SIZE)


@dataclass(frozen=True)
class KVBudget:
    """The bytes the commands' K/V pools may take: ``--kv-memory``, else a fraction of the
    memory free on ``--device`` when the budget is taken (after the models are loaded)."""

    bytes: int
    source: str  # how the user would name it in a message
    kv_dtype: str = "auto"  # the pools' --kv-dtype

    @classmethod
    def of(cls, args: argparse.Namespace) -> "KVBudget":
        from ..cache.pool import KV_MEMORY_FRACTION, default_kv_budget

        kv_dtype = getattr(args, "kv_dtype", "auto")
        if args.kv_memory is not None:
            return cls(args.kv_memory, "--kv-memory", kv_dtype)
        return cls(default_kv_budget(args.device),
                   f"the default, {KV_MEMORY_FRACTION:.0%} of free memory", kv_dtype)

    def pages(self, needs: Sequence[tuple[Any, int]]) -> list[int]:
        """Pages of :data:`PAGE_SIZE` for each ``(model, pages it could need at most)`` pool:
        all of them if they fit in the budget together, else each cut in the same proportion."""
        from ..cache.pool import KVSpec, page_bytes

        spec = KVSpec.named(self.kv_dtype)
        sizes = [page_bytes(m.config.num_layers, PAGE_SIZE, m.config.num_kv_heads, m.config.head_dim,
                            m.dtype if spec is None else spec.dtype) for m, _ in needs]
        total = sum(n * size for (_, n), size in zip(needs, sizes))
        if total <= self.bytes:
            return [n for _, n in needs]
        pages = [n * self.bytes // total for _, n in needs]
        if min(pages) < 1:
            hint = " (set --kv-memory)" if self.source != "--kv-memory" else ""
            raise CliError(f"--kv-memory: the K/V budget of {format_bytes(self.bytes)} ({self.source}) "
                           f"holds no {PAGE_SIZE}-token page of {format_bytes(max(sizes))}{hint}")
        return pages

    def error(self, exc: CacheFullError) -> CliError:
        """A full K/V cache (``CacheFullError``) as one line with what was needed, what is free
        and the budget to raise."""
        return CliError(f"KV cache is full: needed {exc.needed} free pages of {PAGE_SIZE} tokens, "
                        f"{exc.free} free of {exc.total} in a K/V budget of "
                        f"{format_bytes(self.bytes)} ({self.source}); raise --kv-memory, or ask for "
                        "fewer or shorter sequences")


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
