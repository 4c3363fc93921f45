"""Strategy code never mixes devices: with the default device set to ``meta``, every strategy
on a CPU engine gives the results it gives otherwise. A tensor made without a device (such
as beam scores built on the CPU while logits are on a GPU) lands on ``meta`` and fails."""

import torch

from deft.engine import TreeEngine
from strategies_on_device import PROMPT, model, run_strategies, tokenizer, write_trace


def test_every_strategy_keeps_to_the_engine_device(tmp_path):
    trace = tmp_path / "trace.json"
    write_trace(trace)
    engine = TreeEngine(model("cpu", torch.float32, layers=2), tokenizer(), num_pages=256)
    draft = TreeEngine(model("cpu", torch.float32, seed=1, layers=1), tokenizer(), num_pages=256)
    want = run_strategies(engine, draft, PROMPT[:60], trace)
    with torch.device("meta"):
        got = run_strategies(engine, draft, PROMPT[:60], trace)
    assert got == want
