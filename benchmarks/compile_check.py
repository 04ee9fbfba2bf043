"""Compile every Triton kernel of the quadratic operator for Hopper (sm_90) without a GPU.

    PYTHONPATH=src python benchmarks/compile_check.py [--sass]

Uses Triton's bundled ptxas/cuobjdump, so it runs on a CPU-only machine: it catches compile errors before a GPU
is spent, and reports per kernel and launch configuration the registers, spilled bytes (stack) and, for each
loop, the SASS instruction count and mix (what bounds the readout: issue slots against tensor-core time).
Argument alignment is specialised as at run time for contiguous d = dv = 64 bf16 tensors.
"""

from __future__ import annotations

import argparse
import collections
import inspect
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from oal.ops.quadratic.triton import kernels as K  # noqa: E402

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
STRIDES = {f"s_{a}{b}" for a in ("q", "k", "v", "o", "d", "g", "kg", "vg") for b in ("b", "h", "n", "t")}


def compile_kernel(fn, types: dict[str, str], constexprs: dict, num_warps: int, num_stages: int):
    names = list(inspect.signature(fn.fn).parameters)
    constexprs = {k: v for k, v in constexprs.items() if k in names}
    signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
    # pointers 16-byte aligned and strides / t0 divisible by 16, as the launcher specialises them at run time
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, n in enumerate(names)
        if n not in constexprs and (signature[n].startswith("*") or n in STRIDES or n == "t0")
    }
    src = ASTSource(fn, signature, constexprs, attrs)
    return triton.compile(
        src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": num_stages}
    )


def sass(ck) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(ck.asm["cubin"])
        f.flush()
        return subprocess.run([BIN / "cuobjdump", "--dump-sass", f.name], capture_output=True, text=True).stdout


def resources(ck) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(ck.asm["cubin"])
        f.flush()
        out = subprocess.run(
            [BIN / "cuobjdump", "--dump-resource-usage", f.name], capture_output=True, text=True
        ).stdout
    m = re.search(r"REG:(\d+).*?STACK:(\d+)", out, re.S)
    return f"regs {m.group(1)} stack {m.group(2)}" if m else out.strip()[-200:]


def loops(text: str) -> list[tuple[int, list]]:
    """(instructions, top mnemonics) of each backward-branch loop in a SASS listing."""
    ins = []
    for line in text.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,5})\*/\s+(.*?);", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2).strip()))
    out = []
    for addr, txt in ins:
        m = re.search(r"BRA (0x[0-9a-f]+)", txt)
        if m and int(m.group(1), 16) < addr:
            body = [t for a, t in ins if int(m.group(1), 16) <= a <= addr]
            ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in body)
            out.append((len(body), ops.most_common(8)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sass", action="store_true", help="print loop instruction mixes")
    args = ap.parse_args()
    d = dv = 64
    bf, f32 = "*bf16", "*fp32"
    base = dict(D_HEAD=d, DV=dv, D_FEAT=1 + d + d * (d + 1) // 2, NBLK=2 + d // 2 + 1, BK=64, BV=64, INTERP=False)
    types = dict(
        q=bf, k=bf, v=bf, o=bf, do=bf, dq=bf, dk=bf, dv=bf, h=bf, dh=bf, tab="*i32", qwb=f32, fc0=f32, fc=f32,
        fw=f32, hden=f32, dhden=f32, den=f32, den_out=f32, delta_ptr=f32, state=f32, dstate=f32, dqwb=f32,
        dfc0=f32, dfc=f32, dfw=f32, state_in=f32, state_out=f32, num=f32, floor="fp32",
    )  # fmt: skip
    bf16 = dict(DT=tl.bfloat16, ADT=tl.float32)
    jobs = []
    for BT, warps in ((64, 4), (64, 8), (128, 8)):
        for factor in (True, False):
            flags = dict(FACTOR=factor, INTRA=True, HAS_FLOOR=True, STORE_DEN=False)
            jobs.append(
                (f"fwd_o BT={BT} w={warps} factor={factor}", K.chunk_fwd_o, {**base, **bf16, **flags, "BT": BT}, warps)
            )
    for BT, BV in ((64, 32), (64, 64), (128, 32)):
        jobs.append((f"fwd_h BT={BT} BV={BV}", K.chunk_fwd_h, {**base, **bf16, "BT": BT, "BV": BV, "NV": dv // BV}, 4))
    for factor in (True, False):
        bwd = {**base, **bf16, "BT": 64, "FACTOR": factor}
        jobs.append((f"bwd_dq factor={factor}", K.chunk_bwd_dq, bwd, 8))
        jobs.append((f"bwd_dkv factor={factor}", K.chunk_bwd_dkv, bwd, 8))
    jobs.append(("bwd_dh", K.chunk_bwd_dh, {**base, **bf16, "BT": 64, "BV": 32}, 8))
    jobs.append(("fwd_o fp32", K.chunk_fwd_o, {**base, "DT": tl.float32, "ADT": tl.float32, "BT": 64, "FACTOR": True,
                                                "INTRA": True, "HAS_FLOOR": False, "STORE_DEN": True}, 8))  # fmt: skip
    jobs.append(("recurrent_step", K.recurrent_step, {**base, "ADT": tl.float32}, 2))
    jobs.append(("recurrent_finalize", K.recurrent_finalize, {**base, "HAS_FLOOR": True}, 1))
    failed = 0
    for name, fn, consts, warps in jobs:
        try:
            ck = compile_kernel(fn, types, consts, warps, 2)
            print(f"{name:40s} {resources(ck)}")
            if args.sass:
                for n, ops in loops(sass(ck)):
                    print(f"    loop {n:4d} instr: {ops}")
        except Exception as e:
            failed += 1
            print(f"{name:40s} FAILED: {type(e).__name__}: {str(e)[:400]}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
