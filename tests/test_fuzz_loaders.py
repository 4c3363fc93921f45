"""Corrupt model files: random truncations and bit flips of a small GGUF file and of a small
Hugging Face directory (config.json, safetensors shards, tokenizer files) either load or
raise a ``ValueError``/``FileNotFoundError`` naming the file, within a few seconds; never
another exception, never a hang.

``write_tiny_gguf`` is the small model file the CLI tests run too.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import signal
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deft.model import LlamaConfig, load_model
from deft.model.gguf_file import GGUFFile
from deft.model.gguf_tokenizer import tokenizer_from_gguf
from test_model import TINY, TINY_CONFIG, tiny_weights, write_gguf, write_hf_dir

gguf = pytest.importorskip("gguf")  # the ``model`` extra's

CASE_SECONDS = 20  # a case that takes longer is a hang
FUZZ = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def write_tiny_gguf(path: Path, **changes: object) -> LlamaConfig:
    """The tiny test model (test_model's, with ``changes`` to its config) as a GGUF file."""
    config = dataclasses.replace(TINY_CONFIG, **changes)
    weights, blocks = tiny_weights(config)
    write_gguf(path, config, weights, blocks)
    return config


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> tuple[bytes, Path]:
    """(the tiny GGUF file's bytes, a tiny Hugging Face directory)."""
    root = tmp_path_factory.mktemp("fuzz")
    write_tiny_gguf(root / "tiny.gguf")
    weights, _ = tiny_weights(TINY_CONFIG)
    write_hf_dir(root / "hf", {**TINY, "vocab_size": TINY_CONFIG.vocab_size}, weights)
    return (root / "tiny.gguf").read_bytes(), root / "hf"


@contextmanager
def time_limit(seconds: int) -> Iterator[None]:
    """Fail the test with ``TimeoutError`` if the block runs longer than ``seconds``."""
    def expire(*_: object) -> None:
        raise TimeoutError(f"loading took longer than {seconds} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def load_or_clear_error(path: Path, names: str) -> None:
    """Load ``path``: success, or a ``ValueError``/``FileNotFoundError`` naming ``names``."""
    try:
        with time_limit(CASE_SECONDS):
            load_model(path)
    except (ValueError, FileNotFoundError) as exc:
        assert names in str(exc), f"the error does not name {names}: {exc}"


def damage(data: bytes, cut: int | None, flips: list[tuple[int, int]]) -> bytes:
    """``data`` cut to ``cut`` bytes (``None``: whole) with ``(byte, bit)`` flips."""
    out = bytearray(data[:cut])
    for pos, bit in flips:
        if out:
            out[pos % len(out)] ^= 1 << bit
    return bytes(out)


def damaged(data: bytes, draw: st.DataObject) -> bytes:
    """``data`` truncated (a third of the time) and with up to 4 bit flips, most of them in
    the first 8 KiB (headers, metadata, JSON) where the parsing happens."""
    cut = draw.draw(st.integers(0, len(data) - 1), label="cut") if draw.draw(st.integers(0, 2)) == 0 else None
    where = st.one_of(st.integers(0, 8191), st.integers(0, 1 << 30))
    return damage(data, cut, draw.draw(st.lists(st.tuples(where, st.integers(0, 7)), max_size=4), label="flips"))


@FUZZ
@given(draw=st.data())
def test_damaged_gguf(files, tmp_path, draw):
    path = tmp_path / "damaged.gguf"
    path.write_bytes(damaged(files[0], draw))
    load_or_clear_error(path, str(path))


HF_FILES = ["config.json", "model.safetensors.index.json", "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors", "tokenizer.json", "tokenizer_config.json"]


def hf_copy(files: tuple[bytes, Path], tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("hf")
    shutil.copytree(files[1], folder, dirs_exist_ok=True)
    return folder


@FUZZ
@given(name=st.sampled_from(HF_FILES), draw=st.data())
def test_damaged_hf_dir(files, tmp_path_factory, name, draw):
    folder = hf_copy(files, tmp_path_factory)
    (folder / name).write_bytes(damaged((folder / name).read_bytes(), draw))
    load_or_clear_error(folder, str(folder))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=5)
CONFIG_KEYS = [("config.json", k) for k in [*TINY, "sliding_window", "head_dim", "eos_token_id"]] + [
    (f, k) for f in ("tokenizer_config.json", "generation_config.json")
    for k in ("eos_token", "bos_token", "chat_template", "eos_token_id")]


@FUZZ
@given(where=st.sampled_from(CONFIG_KEYS), value=json_values)
def test_config_values_of_any_json_type(files, tmp_path_factory, where, value):
    """A JSON config field holding any JSON value: loads or a ``ValueError`` naming the file."""
    folder = hf_copy(files, tmp_path_factory)
    name, key = where
    path = folder / name
    config = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**config, key: value}))
    load_or_clear_error(folder, str(folder))


# ------------------------------------------------ what the fuzzers found, as fixed cases


def test_tensor_dims_whose_product_wraps_around(tmp_path):
    """2**58 x 64 elements is 0 in int64: the size check must use exact integers."""
    path = tmp_path / "wrap.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor_info("t", (1 << 58, 64), np.dtype(np.float32), 4 * 64, raw_dtype=gguf.GGMLQuantizationType.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.fout[0].write(bytes(4 * 64))
    w.close()
    with pytest.raises(ValueError, match=re.escape(f"{path}: corrupt GGUF file (tensor 't' runs past")):
        GGUFFile(path)


@pytest.mark.parametrize("key, value, message", [
    ("tokenizer.ggml.merges", ["he", "l l"], "tokenizer.ggml.merges: expected a list of 'left right' strings"),
    ("tokenizer.ggml.tokens", np.arange(3), "tokenizer.ggml.tokens: expected a list of strings"),
    ("tokenizer.ggml.eos_token_id", "2", "tokenizer.ggml.eos_token_id: expected an integer, got '2'"),
    ("tokenizer.chat_template", 7, "tokenizer.chat_template: expected a string, got 7"),
])
def test_gguf_tokenizer_metadata_of_the_wrong_type(files, tmp_path, key, value, message):
    path = tmp_path / "tiny.gguf"
    path.write_bytes(files[0])
    meta = {**GGUFFile(path).metadata, key: value}
    with pytest.raises(ValueError, match=re.escape(f"x.gguf: {message}")):
        tokenizer_from_gguf(meta, "x.gguf")


@pytest.mark.parametrize("key, value, message", [
    ("llama.embedding_length", "64", "llama.embedding_length: expected an integer, got '64'"),
    ("llama.attention.head_count", 0, "llama.attention.head_count: expected a positive integer, got 0"),
    ("llama.rope.freq_base", [1.0], "llama.rope.freq_base: expected a number, got [1.0]"),
    ("general.architecture", np.arange(2), "general.architecture: expected a name, got array"),
])
def test_gguf_config_metadata_of_the_wrong_type(files, tmp_path, key, value, message):
    path = tmp_path / "tiny.gguf"
    path.write_bytes(files[0])
    with pytest.raises(ValueError, match=re.escape(message)):
        LlamaConfig.from_gguf_metadata({**GGUFFile(path).metadata, key: value})


@pytest.mark.parametrize("name, key, value", [
    ("config.json", "eos_token_id", {}), ("generation_config.json", "eos_token_id", [None]),
    ("tokenizer_config.json", "eos_token", ["<|im_end|>"]), ("tokenizer_config.json", "chat_template", 0.0),
])
def test_hf_token_fields_of_the_wrong_type(files, tmp_path_factory, name, key, value):
    folder = hf_copy(files, tmp_path_factory)
    path = folder / name
    config = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**config, key: value}))
    with pytest.raises(ValueError, match=re.escape(f"{path}: {key}: expected ")):
        load_model(folder)
