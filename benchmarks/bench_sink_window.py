"""Extra cost of exact sinks + window over the plain OAL chunked forward, and the decode-state memory.

    PYTHONPATH=src python benchmarks/bench_sink_window.py --n 4096 --n 16384 --repeats 5

Prints the minimum wall and CPU time per configuration (fp32, no autograd, B=1, Hq=9, Hkv=3, d=dv=64 by
default).
"""

from __future__ import annotations

import argparse
import time

import torch

from oal.kernels import OALKernel, SinkWindowKernel, taylor_L


def measure(fns: dict, inputs, repeats: int) -> dict[str, tuple[float, float]]:
    """Round-robin over the configurations (so they share the machine's load swings); per configuration the
    minimum wall time and the minimum process CPU time over ``repeats`` runs."""
    for fn in fns.values():
        fn(*inputs)  # warm-up
    wall = {name: [] for name in fns}
    cpu = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t, c = time.perf_counter(), time.process_time()
            fn(*inputs)
            wall[name].append(time.perf_counter() - t)
            cpu[name].append(time.process_time() - c)
    return {name: (min(wall[name]), min(cpu[name])) for name in fns}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, action="append", help="sequence lengths (repeatable)")
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    Hq, Hkv, d = args.heads, args.kv_heads, args.head_dim
    inner = OALKernel(torch.randint(0, args.groups, (Hq, d)), Hkv, L=taylor_L(Hq, args.groups))
    configs = [(4, 64), (0, 64), (4, 0), (1, 64), (4, 128)]
    print(f"threads={torch.get_num_threads()} Hq={Hq} Hkv={Hkv} d={d} groups={args.groups} fp32 no-grad")
    for N in args.n or [4096]:
        q, k, v = torch.randn(1, Hq, N, d), torch.randn(1, Hkv, N, d), torch.randn(1, Hkv, N, d)
        fns = {"oal": inner} | {f"s={s} w={w}": SinkWindowKernel(inner, n_sink=s, window=w) for s, w in configs}
        with torch.no_grad():
            res = measure(fns, (q, k, v), args.repeats)
            _, base_state = inner(q, k, v, output_final_state=True)
        base_wall, base_cpu = res["oal"]
        for name, (t_wall, t_cpu) in res.items():
            label = name if name == "oal" else f"{fns[name].name} {name}"
            print(
                f"N={N:6d} {label:<28s} wall {t_wall:7.3f}s ({t_wall / base_wall:5.2f}x)  "
                f"cpu {t_cpu:7.3f}s ({t_cpu / base_cpu:5.2f}x)"
            )
    plain = base_state.numel() * base_state.element_size()
    print(f"state bytes per layer and sequence: oal {plain}")
    for n_sink, w in configs:
        for dtype in (torch.bfloat16, torch.float32):
            m = SinkWindowKernel(inner, n_sink=n_sink, window=w)
            x = [t[:, :, :256].to(dtype) for t in (q, k, v)]
            with torch.no_grad():
                _, st = m(*x, output_final_state=True)
            print(
                f"  {m.name} s={n_sink} w={w} caches {dtype}: {st.nbytes} (+{st.nbytes - plain}, "
                f"{100 * (st.nbytes / plain - 1):.1f} %)"
            )


if __name__ == "__main__":
    main()
