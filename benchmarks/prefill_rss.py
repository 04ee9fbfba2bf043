"""Resident memory through one prefill of N random tokens: VmRSS after every third decoder layer and the peak
(VmHWM) at the end, for the original, the committed converted model and plain OAL (layers 3–26, synthetic groups),
each in a fresh process. ``--trim`` calls glibc's ``malloc_trim(0)`` after every decoder layer (a diagnosis, not
what the models do): it shows how much of the peak is freed heap that glibc keeps (fragmentation), not data.
``--mappings``: the resident memory after the load and at the end split by what maps it (``/proc/self/smaps``):
libtorch's code, the oal kernel libraries, other files, the brk heap and anonymous memory (large tensors, other
arenas) — what a converted model carries beyond the original's. ``--dtype bf16``: the models in bf16 (the peak then
includes the load's cast of the weights).

    python benchmarks/prefill_rss.py --n 1024 --repeats 2
    python benchmarks/prefill_rss.py --n 1024 --repeats 2 --trim
    python benchmarks/prefill_rss.py --n 1024 --repeats 3 --dtype bf16 --mappings --models original,recipe
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import sys

import torch


def status() -> dict[str, float]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS", "VmHWM")):
                key, value = line.split(":")
                out[key] = int(value.split()[0]) / 1024
    return out


def mappings() -> dict[str, float]:
    """Resident MB by what maps it: ``libtorch`` (libtorch_cpu), ``oal_kernels`` (the fused kernels' libraries),
    ``files`` (every other file), ``heap`` (brk), ``anonymous`` (no file: mmapped tensors, malloc's other arenas)
    and ``other`` (stack, vdso, …)."""
    out = dict.fromkeys(("libtorch", "oal_kernels", "files", "heap", "anonymous", "other"), 0.0)
    kind = "other"
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if not fields[0].endswith(":"):  # a mapping's header: address range, perms, offset, dev, inode[, path]
                path = fields[5] if len(fields) > 5 else ""
                name = path.rsplit("/", 1)[-1]
                if name.startswith("libtorch_cpu"):
                    kind = "libtorch"
                elif name.startswith("oal_"):
                    kind = "oal_kernels"
                elif path.startswith("/"):
                    kind = "files"
                elif path == "[heap]":
                    kind = "heap"
                elif not path or path.startswith("[anon"):
                    kind = "anonymous"
                else:
                    kind = "other"
            elif fields[0] == "Rss:":
                out[kind] += int(fields[1]) / 1024
    return {k: round(v, 1) for k, v in out.items()}


def point(model_name: str, n: int, trim: bool, dtype: str = "fp32", split: bool = False) -> dict[str, object]:
    from oal.bench.decode import DecodeConfig, build_model
    from oal.models import KernelCache, get_decoder_layers

    torch.set_num_threads(2)
    malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim if trim else None
    config = DecodeConfig(converted="docs/results/conversion/model" if model_name == "recipe" else None, dtype=dtype)
    model = build_model("original" if model_name == "original" else "converted", config)
    loaded = status()["VmRSS"]
    loaded_split = mappings() if split else None
    trace: list[float] = []
    for layer in get_decoder_layers(model):
        layer.register_forward_hook(lambda *_: (malloc_trim and malloc_trim(0), trace.append(status()["VmRSS"]))[1])
    ids = torch.randint(model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids, cache=KernelCache(model), logits_to_keep=1)
    end = status()
    out = {
        "model": model_name,
        "n": n,
        "dtype": dtype,
        "trim": trim,
        "loaded_mb": round(loaded),
        "every_third_layer_mb": [round(x) for x in trace[::3]],
        "end_mb": round(end["VmRSS"]),
        "peak_mb": round(end["VmHWM"]),
    }
    if split:
        out |= {"loaded_split_mb": loaded_split, "end_split_mb": mappings()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--trim", action="store_true")
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--mappings", action="store_true", help="resident memory split by mapping (see the docstring)")
    ap.add_argument("--models", default="original,recipe,plain")
    ap.add_argument("--point", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.point:
        print(json.dumps(point(args.point, args.n, args.trim, args.dtype, args.mappings)))
        return
    names = args.models.split(",")
    unknown = sorted(set(names) - {"original", "recipe", "plain"})
    if unknown:
        raise SystemExit(f"--models: expected names from original, recipe, plain; got {', '.join(unknown)}")
    for _ in range(args.repeats):
        for name in names:
            cmd = [sys.executable, __file__, "--point", name, "--n", str(args.n), "--dtype", args.dtype]
            cmd += ["--trim"] if args.trim else []
            cmd += ["--mappings"] if args.mappings else []
            proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
            print(proc.stdout.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
