"""Registers and spills of the partial kernel's sm_90 builds, compiled on this machine (no GPU).

Triton compiles for a target it is given; ``ptxas`` (shipped with Triton) then reports each
build's registers per thread, stack frame and spill bytes, which decide how many programs an
SM keeps and how much local-memory traffic the inner loop adds, and whether ptxas had to
serialise the ``wgmma`` instructions (each one waited for before the next is issued: its
C751x performance warnings, e.g. for want of registers). The last columns count the
instructions per iteration of each kind of K/V block loop in the build's SASS, and in
brackets the spilled registers' loads and stores among them (:func:`inner_loops`): what one
warp issues per block, a static measure, not a time. Each row
is one build of ``tree_partial_kernel`` as :func:`deft.ops.triton.launch.launch_step`
launches it for a masked step of gathered and consecutive tiles (bf16 q): eager (gathered
loads, no plan header) or graph-safe (TMA, plan header, a loop over work items), over
16-bit or FP8 K/V.

Usage: ``python tools/kernel_registers.py [--head-dim 128] [--rows 0,2048] [--kv bf16,fp8]
[--launch eager,graph-safe] [--maxnreg shipped,none,168] [--block-m shipped,few,16] [--variants
shipped,neither,aligned,ranges,both,checked,deferred,finite,lean,in-order,late,order,per-value,
sums,fma,acc] [--dump DIR]``;
``--rows`` picks the config table's row regimes (``deft.ops.triton.configs.CONFIGS``),
``--maxnreg`` the register cap (``shipped``: the config's build's for that K/V), ``--block-m``
the build: ``shipped``, ``few`` (FP8's few-row build, ``configs.few_rows_config``; skipped
where there is none) or that many rows per program (16: ``mma.sync`` dots, converted K/V in
registers). ``--variants`` the kernel's variants (``VARIANTS``, each a few ``KernelConfig``
flags): the masked tiles' ``neither``, ``aligned`` (``aligned_mask``), ``ranges``
(``ranges_first``) or ``both`` (which the sm90 configs take over 16-bit K/V), over every
K/V width; the isolation's ``checked`` (neither of the next two), ``deferred``
(``deferred_v_checks``), ``finite`` (``e4m3_finite_scores``) and ``lean`` (those two); the
graph-safe launches' ``in-order`` (``header_in_order``), every launch's ``late`` (no
``early_item_loads``, which the sm90 configs take: a work item's loads after the PDL wait)
and ``order`` (both); ``per-value`` (none of ``sum_checks``, ``inf_by_fma`` and
``acc_checks``, which the sm90 configs take: every value tested at a work item's end and
every score by a select) and each of the three alone: a work item's end checking rows by
their sums, ``sums`` (``sum_checks``, which the sm90 configs take over 16-bit K/V), a -inf
score made NaN by an FMA, ``fma`` (``inf_by_fma``), and the end's checks on the
accumulator, ``acc`` (``acc_checks``).
``--dump DIR`` also writes each build's TTGIR, PTX, cubin and SASS
(``nvdisasm``) there, to read what the compiler made of a loop.
About 10 s a build.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # compile, even when run under the CPU test suite
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from deft.ops.triton import configs, kernels  # noqa: E402

PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
KV = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
# Kernel variants: their ``KernelConfig`` changes to the shipped configs.
PER_VALUE = {"sum_checks": False, "kv8_sum_checks": False, "inf_by_fma": False,
             "acc_checks": False}
TAILS = {name: {"aligned_mask": a, "kv8_aligned_mask": a, "ranges_first": r, "kv8_ranges_first": r}
         for name, a, r in (("neither", False, False), ("aligned", True, False),
                            ("ranges", False, True), ("both", True, True))}
VARIANTS = {"shipped": {}, **TAILS,
            "checked": {"deferred_v_checks": False, "e4m3_finite_scores": False},
            "deferred": {"deferred_v_checks": True, "e4m3_finite_scores": False},
            "finite": {"deferred_v_checks": False, "e4m3_finite_scores": True},
            "lean": {"deferred_v_checks": True, "e4m3_finite_scores": True},
            "in-order": {"header_in_order": True}, "late": {"early_item_loads": False},
            "order": {"header_in_order": True, "early_item_loads": False},
            "per-value": PER_VALUE,
            "sums": {**PER_VALUE, "sum_checks": True, "kv8_sum_checks": True},
            "fma": {**PER_VALUE, "inf_by_fma": True},
            "acc": {**PER_VALUE, "acc_checks": True}}
# The inner loops' kinds, in the table's order: K/V by TMA or gathered, masked or not.
LOOPS = ("TMA", "TMA masked", "gathered", "gathered masked")
H_KV, G = 8, 4  # Llama-3-8B's heads


@dataclasses.dataclass(frozen=True)
class Usage:
    """``ptxas -v``'s figures for one build."""

    registers: int
    stack: int  # bytes, summed over the kernel and the functions it calls, like the spills
    spill_stores: int
    spill_loads: int
    serialized: str  # why ptxas serialised the wgmma instructions ("" if it did not)
    # Instructions per K/V block in each kind of inner loop (LOOPS), and of them the local
    # memory loads and stores of spilled registers.
    loops: dict[str, tuple[int, int]]


def inner_loops(sass: str) -> dict[str, tuple[int, int]]:
    """Instructions per iteration of the K/V block loops in ``sass`` (``nvdisasm -g``), and
    of them the spilled registers' local loads and stores (``LDL``, ``STL``), by kind: the
    innermost loops (a backward branch with no other loop inside) that hold a
    matrix product; masked where the visibility predicate's source lines occur in them, by
    TMA where they wait on a barrier (``SYNCS``), gathered where they copy (``LDGSTS``). The
    smallest of each kind: the kernel compiles loops more than once (a graph-safe program's
    first work item and the rest; with ``deferred_v_checks``, the checked loops that run
    only where a work item is computed again), and the smallest is what a clean step runs.
    Both sides of a branch inside a loop count."""
    ins, labels, src = [], {}, ""
    for line in sass.splitlines():
        if m := re.match(r'\s*//## File "(.*)", line \d+', line):
            src = m.group(1)
        elif m := re.match(r"^(\.L_x_\d+):", line):
            labels[m.group(1)] = len(ins)
        elif m := re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line):
            ins.append((m.group(1), src))
    loops = [(labels[m.group(1)], i) for i, (text, _) in enumerate(ins)
             if (m := re.search(r"BRA `\((\.L_x_\d+)\)", text))
             and labels.get(m.group(1), i + 1) <= i]
    sizes: dict[str, tuple[int, int]] = {}
    for lo, hi in loops:
        if any(lo <= a and b <= hi and (a, b) != (lo, hi) for a, b in loops):
            continue
        body = ins[lo:hi + 1]
        if not any(re.search(r"\bHG?MMA\.", text) for text, _ in body):
            continue
        tma = any("SYNCS" in text for text, _ in body)
        masked = any(file.endswith("visibility.py") for _, file in body)
        kind = ("TMA" if tma else "gathered") + (" masked" if masked else "")
        local = sum(bool(re.match(r"(@!?P\w+ )?(LDL|STL)\b", text)) for text, _ in body)
        sizes[kind] = min(sizes.get(kind, (len(body), local)), (len(body), local))
    return sizes


class _Sm90:
    """A stand-in for Triton's active driver: it only names the target, so Triton compiles
    for sm_90 without a GPU (the kernels are never launched)."""

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


def ptxas_usage(ptx: str, maxnreg: int | None, sass: str = "") -> Usage:
    """Assemble ``ptx`` for sm_90a and read ``ptxas -v``'s register and spill report (and
    the inner loops of ``sass``, the same build's disassembly)."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        cmd = [str(PTXAS), "-v", "--gpu-name", "sm_90a", str(src), "-o", str(Path(tmp) / "k.o")]
        if maxnreg:
            cmd += ["--maxrregcount", str(maxnreg)]
        report = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    regs = re.search(r"Used (\d+) registers", report)
    frames = re.findall(
        r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", report)
    if regs is None or not frames:
        raise RuntimeError(f"ptxas printed no register report:\n{report}")
    serialized = re.search(
        r"wgmma\.mma_async instructions are serialized due to (.+?) (?:for|in) the function",
        report)
    # A line per function ptxas compiled (the kernel, and any it calls): their sums.
    return Usage(int(regs.group(1)), *(sum(int(f[i]) for f in frames) for i in range(3)),
                 serialized.group(1) if serialized else "", inner_loops(sass))


def build_usage(cfg: configs.KernelConfig, head_dim: int, kv: torch.dtype,
                graph_safe: bool, dump: Path | None = None) -> Usage:
    """Compile one build of the partial kernel for sm_90 under ``cfg`` (as launched over
    ``kv``: ``configs.kv_config``) and report its usage (bf16 q); with ``dump``, also write
    its TTGIR, PTX, cubin and SASS there (``dump`` + ``.ttgir`` etc.). Triton must target sm_90:
    :func:`main` makes it, for the whole process."""
    h_q, d = H_KV * G, head_dim
    q = torch.empty(16, h_q, d, dtype=torch.bfloat16)
    cache = torch.empty(256, H_KV, d, dtype=kv)
    plan = torch.empty(1024, dtype=torch.int32)
    lse = torch.empty(16, h_q, dtype=torch.float32)
    scale = torch.ones(H_KV, dtype=torch.float32)
    scaled = kv.itemsize == 1
    block_d = configs.block_head_dim(d)  # TMA boxes hold whole heads: padded heads load gathered
    desc = (TensorDescriptor(cache, [256, H_KV * d], [H_KV * d, 1], [cfg.block_n, d])
            if graph_safe and d == block_d else cache)
    offsets = (0,) * 7 if graph_safe else (256, 512, 768, 768, 896, 912, 928)
    args = [q, cache, cache, desc, desc, q, lse, plan, *offsets, q, lse, plan, plan, plan,
            d**-0.5 * math.log2(math.e), h_q * d, d, H_KV * d, d, h_q * d, d, h_q, h_q * d, d,
            h_q, scale if scaled else q, scale if scaled else q, int(scaled)]
    compiled = kernels.tree_partial_kernel.warmup(
        *args, grid=(1,), G=G, D=block_d, HEAD_D=d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        USE_MASK=True, CONTIG=False, TMA=graph_safe and d == block_d, SORTED=False,
        FUSE_MERGE=cfg.fuse_merge, IEEE=False, PDL=cfg.pdl, HEADER=graph_safe, SCALED=scaled, F16_DOTS=scaled,
        ALIGN_MASK=cfg.aligned_mask, RANGES_FIRST=cfg.ranges_first,
        INF_K=cfg.inf_k(kv, torch.bfloat16), DEFER_V=cfg.deferred_v_checks,
        IN_ORDER=graph_safe and cfg.header_in_order, EARLY=cfg.early_item_loads,
        SUMS=cfg.sum_checks, ACC_CHECK=cfg.acc_checks,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, maxnreg=cfg.maxnreg,
        launch_pdl=cfg.pdl)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin" if dump is None else dump.with_suffix(".cubin")
        cubin.write_bytes(compiled.asm["cubin"])
        sass = subprocess.run([str(PTXAS.parent / "nvdisasm"), "-c", "-g", str(cubin)],
                              capture_output=True, text=True, check=True).stdout
    if dump is not None:
        dump.with_suffix(".ttgir").write_text(compiled.asm["ttgir"])
        dump.with_suffix(".ptx").write_text(compiled.asm["ptx"])
        dump.with_suffix(".sass").write_text(sass)
    return ptxas_usage(compiled.asm["ptx"], cfg.maxnreg, sass)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--rows", default="0,2048", help="row regimes of the config table")
    ap.add_argument("--kv", default="bf16,fp8", help="K/V dtypes: bf16, fp8")
    ap.add_argument("--launch", default="eager,graph-safe", help="eager, graph-safe")
    ap.add_argument("--maxnreg", default="shipped",
                    help="register caps: shipped (the config's), none, or a number")
    ap.add_argument("--block-m", default="shipped",
                    help="builds: shipped (the config's), few (FP8's few-row build) or a number "
                         "of rows per program")
    ap.add_argument("--variants", default="shipped",
                    help="kernel variants: shipped; masked tiles: neither, aligned (aligned_mask), "
                         "ranges (ranges_first), both; isolation: checked (neither of the next "
                         "two), deferred (deferred_v_checks), "
                         "finite (e4m3_finite_scores), lean (those two); in-order "
                         "(header_in_order, graph-safe), late (no early_item_loads), order "
                         "(both); end checks: per-value (none of the next three), sums "
                         "(sum_checks), fma (inf_by_fma), acc (acc_checks)")
    ap.add_argument("--dump", metavar="DIR", type=Path,
                    help="also write each build's TTGIR, PTX, cubin and SASS into DIR")
    args = ap.parse_args(argv)
    if args.dump is not None:
        args.dump.mkdir(parents=True, exist_ok=True)
    driver.set_active(_Sm90())
    print("| rows | K/V | launch | block m | cap | variant | registers | stack B | spill stores B "
          "| spill loads B | wgmma serialised | " + " | ".join(LOOPS) + " |")
    print("| --- " * (11 + len(LOOPS)) + "|")
    for rows in (int(r) for r in args.rows.split(",")):
        shipped = configs.CONFIGS["sm90", args.head_dim, rows]
        for kv, cap, launch, block_m, variant in itertools.product(
                args.kv.split(","), args.maxnreg.split(","), args.launch.split(","),
                args.block_m.split(","), args.variants.split(",")):
            if block_m == "few":
                build = configs.few_rows_config(shipped, KV[kv])
                if build is None:
                    continue
            else:
                build = shipped if block_m == "shipped" else dataclasses.replace(
                    shipped, block_m=int(block_m))
            built = configs.kv_config(build, KV[kv])
            if cap != "shipped":
                built = dataclasses.replace(built, maxnreg=None if cap == "none" else int(cap))
            built = dataclasses.replace(built, **VARIANTS[variant])
            name = (f"rows{rows}-{kv}-{launch}-m{built.block_m}-cap{built.maxnreg or 'none'}"
                    + ("" if variant == "shipped" else f"-{variant}"))
            u = build_usage(built, args.head_dim, KV[kv], launch == "graph-safe",
                            None if args.dump is None else args.dump / name)
            print(f"| {rows} | {kv} | {launch} | {built.block_m} "
                  f"| {built.maxnreg or 'none'} | {variant} | {u.registers} | {u.stack} "
                  f"| {u.spill_stores} | {u.spill_loads} | {u.serialized or 'no'} | "
                  + " | ".join(f"{u.loops[k][0]} ({u.loops[k][1]})" if k in u.loops else "–"
                               for k in LOOPS) + " |", flush=True)


if __name__ == "__main__":
    main()
