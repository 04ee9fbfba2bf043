"""Resident memory that loading the fused CPU kernels adds to a process (torch, transformers and oal imported
first, as in any process running a converted model): each kernel's library as `oal.ops.quadratic.cpu.load` imports
it, and, for comparison, the import of ``torch.utils.cpp_extension`` that loading went through before (it pulls in
setuptools). Each measurement in a fresh process; the kernels must have been built once (any converted model's
first use, or the tests).

    python benchmarks/kernel_load_rss.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("/proc/self/status has no VmRSS line")


def point(what: str) -> dict[str, object]:
    import oal.kernels  # noqa: F401 - the modules a converted model's process has imported
    import oal.models  # noqa: F401
    from oal.ops.quadratic import cpu

    before = rss_mb()
    if what == "kernels":
        parts = {}
        for kind in cpu.SOURCES:
            start = rss_mb()
            if cpu.load(kind) is None:
                raise RuntimeError(f"the fused CPU kernel {kind!r} is not available (disabled or no build)")
            parts[kind] = round(rss_mb() - start, 2)
        return {"what": what, "per_kernel_mb": parts, "total_mb": round(rss_mb() - before, 2)}
    import torch.utils.cpp_extension  # noqa: F401

    return {"what": what, "total_mb": round(rss_mb() - before, 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--point", choices=("kernels", "cpp_extension"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.point:
        print(json.dumps(point(args.point)))
        return
    for _ in range(args.repeats):
        for what in ("kernels", "cpp_extension"):
            proc = subprocess.run(
                [sys.executable, __file__, "--point", what], capture_output=True, text=True, check=True
            )
            print(proc.stdout.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
