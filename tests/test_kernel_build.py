"""The partial kernel's sm_90 builds, compiled on this machine without a GPU
(``tools/kernel_registers.py``: Triton for sm_90, then ``ptxas -v``)."""

import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parent.parent
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


@pytest.mark.skipif(not PTXAS.exists(), reason="this Triton ships no ptxas")
def test_graph_safe_fp8_builds_compile_for_sm90_and_single_copy_keeps_wgmma_pipelined():
    """The graph-safe FP8 build (TMA, plan header, 168-register cap) compiles for sm_90 with
    the shipped loops and with one copy of each loop's code; with one copy, ptxas keeps the
    wgmma instructions asynchronous and spills less."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "kernel_registers.py"), "--rows", "0", "--kv",
         "fp8", "--launch", "graph-safe"],
        capture_output=True, text=True, timeout=300, check=True, cwd=ROOT).stdout
    rows = {}
    for line in out.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[3]] = cells[4:]
    assert set(rows) == {"shipped", "single"}, out
    for cap, registers, *_ in rows.values():
        assert cap == "168" and 0 < int(registers) <= 168, out
    shipped, single = rows["shipped"], rows["single"]
    assert single[-1] == "no", out
    assert int(single[3]) + int(single[4]) < int(shipped[3]) + int(shipped[4]), out  # spill bytes
