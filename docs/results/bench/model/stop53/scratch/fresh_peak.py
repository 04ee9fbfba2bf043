"""Stop 53: goal 6 at 1k in fresh processes, the peak of the first prompt alone: each point its own process that
builds the model, resets VmHWM (clear_refs 5) and prefills N seeded random tokens into a fresh KernelCache
(fp32; the original with the same heap release before its output layer as the converted models, the control of
benchmarks/prefill_peak.py), then reads VmHWM. Rounds alternate the models.

    python docs/results/bench/model/stop53/scratch/fresh_peak.py 1024 3 > fresh_peak_1k.jsonl
"""

import json
import subprocess
import sys


def point(model_name: str, n: int) -> dict:
    import torch

    from oal.bench.devices import get_device
    from oal.models import KernelCache
    from oal.models.prefill import heap_released_before_output

    sys.path.insert(0, "benchmarks")
    from prefill_peak import build

    torch.set_num_threads(2)
    model = build(model_name, "fp32")
    ids = torch.randint(model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
    with open("/proc/self/status") as f:
        loaded = next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024
    reset = get_device("cpu").reset_peak()
    control = heap_released_before_output(model) if model_name == "original" else None
    with torch.no_grad():
        if control is not None:
            with control:
                model(ids, cache=KernelCache(model), logits_to_keep=1)
        else:
            model(ids, cache=KernelCache(model), logits_to_keep=1)
    with open("/proc/self/status") as f:
        peak = next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024
    return {"model": model_name, "n": n, "load_peak_mb": round(loaded, 1), "reset": reset, "prefill_peak_mb": round(peak, 1)}


def main() -> None:
    if sys.argv[1] == "--point":
        print(json.dumps(point(sys.argv[2], int(sys.argv[3]))))
        return
    n, rounds = int(sys.argv[1]), int(sys.argv[2])
    for r in range(rounds):
        for name in ("original", "plain", "recipe"):
            out = subprocess.run(
                [sys.executable, __file__, "--point", name, str(n)], capture_output=True, text=True, check=True
            ).stdout.strip().splitlines()[-1]
            print(json.dumps({"round": r, **json.loads(out)}), flush=True)


if __name__ == "__main__":
    main()
