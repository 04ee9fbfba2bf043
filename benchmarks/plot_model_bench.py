"""Two-panel figure and ratio table of model-level `oal bench decode` runs (original against converted).

    python benchmarks/plot_model_bench.py OUT.png OUT.md RUN.json [RUN.json ...]

Each RUN.json is an `oal bench decode` result (decode.json); its label is the name of the folder holding it.
Left panel: decode ms/token against the context; right panel: cache MB; one colour per run (its original dashed,
its converted model solid). The Markdown table lists every point with
the converted/original ratios (decode speed-up = original ms / converted ms; tokens/s counts the whole batch).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load(path: Path) -> tuple[str, dict]:
    return path.parent.name, json.loads(path.read_text())


def table(runs: list[tuple[str, dict]]) -> str:
    lines = [
        "| run | batch | N | prefill s orig / conv | × | decode ms/token orig / conv | speed-up | tokens/s orig / conv"
        " | cache MB orig / conv | × | peak RSS MB orig / conv |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, doc in runs:
        batch = doc["config"].get("batch", 1)
        pts = {(p["method"], p["n"]): p for p in doc["points"]}
        for n in sorted({n for _, n in pts}):
            o, c = pts.get(("original", n)), pts.get(("converted", n))
            if o is None or c is None:
                continue
            lines.append(
                f"| {name} | {batch} | {n} | {o['prefill_s']:.2f} / {c['prefill_s']:.2f} | "
                f"{o['prefill_s'] / c['prefill_s']:.2f} | {o['ms_per_token']:.1f} / {c['ms_per_token']:.1f} | "
                f"{o['ms_per_token'] / c['ms_per_token']:.2f} | {batch * o['tokens_per_s']:.1f} / "
                f"{batch * c['tokens_per_s']:.1f} | {o['cache_mb']:.1f} / {c['cache_mb']:.1f} | "
                f"{c['cache_mb'] / o['cache_mb']:.2f} | {o['peak_rss_mb']:.0f} / {c['peak_rss_mb']:.0f} |"
            )
    return "\n".join(lines) + "\n"


def plot(runs: list[tuple[str, dict]], out: Path) -> None:
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, (name, doc) in enumerate(runs):
        batch = doc["config"].get("batch", 1)
        color = f"C{i % 10}"  # one colour per run: its original dashed, its converted model solid
        for method, style in (("original", "--"), ("converted", "-")):
            pts = sorted((p["n"], p) for p in doc["points"] if p["method"] == method)
            if not pts:
                continue
            label = f"{method} ({name}, batch {batch})"
            for ax, key in ((ax_t, "ms_per_token"), (ax_m, "cache_mb")):
                ax.plot([n for n, _ in pts], [p[key] for _, p in pts], style, color=color, marker="o", label=label)
    for ax, what in ((ax_t, "decode ms per step (whole batch)"), (ax_m, "cache MB")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context tokens")
        ax.set_ylabel(what)
        ax.grid(True, which="both", alpha=0.3)
    ax_t.legend(fontsize=7)
    fig.suptitle("SmolLM2-135M, original against converted (oal bench decode, CPU)")
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main(argv: list[str]) -> None:
    if len(argv) < 3:
        raise SystemExit(__doc__)
    png, md, *files = argv
    runs = [load(Path(f)) for f in files]
    plot(runs, Path(png))
    Path(md).write_text(table(runs))


if __name__ == "__main__":
    main(sys.argv[1:])
