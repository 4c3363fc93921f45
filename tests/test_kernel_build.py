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
def test_graph_safe_builds_compile_for_sm90_within_their_register_caps():
    """The graph-safe builds (TMA, plan header) compile for sm_90: the FP8 one within its
    168-register cap, the uncapped bf16 one with its wgmma instructions asynchronous."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "kernel_registers.py"), "--rows", "0", "--launch",
         "graph-safe"],
        capture_output=True, text=True, timeout=300, check=True, cwd=ROOT).stdout
    rows = {}
    for line in out.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[1]] = cells[3:]
    assert set(rows) == {"bf16", "fp8"}, out
    cap, registers, *_ = rows["fp8"]
    assert cap == "168" and 0 < int(registers) <= 168, out
    cap, registers, *_, serialised = rows["bf16"]
    assert cap == "none" and 0 < int(registers) <= 255 and serialised == "no", out
