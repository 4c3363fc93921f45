"""``deft serve``'s K/V sizing flags, checked without serving (the server itself:
tests/test_serve.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
from deft.cli import main  # noqa: E402
from deft.cli.common import PAGE_SIZE  # noqa: E402
from deft.cache.pool import page_bytes  # noqa: E402
from test_fuzz_loaders import write_tiny_gguf  # noqa: E402


class Built(Exception):
    """Raised by the stand-in engine: the command got as far as building it."""


def test_kv_memory_sizes_the_server_pool(tmp_path, monkeypatch, capsys):
    from deft.model import load_model

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    m, _ = load_model(str(path))
    per_page = page_bytes(m.config.num_layers, PAGE_SIZE, m.config.num_kv_heads, m.config.head_dim, m.dtype)
    seen = []

    def engine(model, tok, config, *args, **kwargs):  # noqa: ANN001, ANN202
        seen.append(config.num_pages)
        raise Built

    import deft.engine

    monkeypatch.setattr(deft.engine, "TreeEngine", engine)
    with pytest.raises(Built):
        main(["serve", "--model", str(path), "--kv-memory", "1MiB"])
    assert seen == [(1 << 20) // per_page]
    with pytest.raises(Built):
        main(["serve", "--model", str(path), "--num-pages", "7"])
    assert seen[-1] == 7
    capsys.readouterr()  # the loads' "model on ..." lines
    assert main(["serve", "--model", str(path), "--num-pages", "7", "--kv-memory", "1MiB"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "deft serve: error: --kv-memory: give either --kv-memory or --num-pages, not both"]
