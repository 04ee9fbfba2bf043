"""Plot the dev frontier of the conversion recipe search (docs/results/conversion/frontier_dev.json): cache at 8k
against dev perplexity, each point labelled with its exact KV heads and its dev passkey accuracy.

    python benchmarks/plot_conversion_frontier.py docs/results/conversion/frontier_dev.json \
        docs/results/conversion/frontier_dev.png
"""

from __future__ import annotations

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

MIB = 2**20
N, LAYERS, HKV, D = 8192, 30, 3, 64
STATE = (1 + D + D * (D + 1) // 2) * (D + 1) * 4  # packed fp32 OAL state of one KV head


def cache_8k_mib(row: dict) -> float:
    """fp32 cache of one sequence at 8k tokens: exact KV heads keep 2·N·d numbers, kernel heads a state plus
    their sinks and window."""
    first, last = (int(x) for x in row["layers"].split("-"))
    converted = last - first + 1
    exact_kv = N * 2 * D * 4
    kernel_kv = STATE + (4 + row["window"]) * 2 * D * 4
    soft = (LAYERS - converted) * HKV * exact_kv
    return (soft + row["K"] * exact_kv + (converted * HKV - row["K"]) * kernel_kv) / MIB


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json")
    ap.add_argument("png")
    args = ap.parse_args()
    with open(args.json, encoding="utf-8") as fh:
        data = json.load(fh)
    fig, ax = plt.subplots(figsize=(8, 5))
    for row in data["rows"]:
        if row.get("heads") or row["beta_offset"] not in (0, -5):
            continue
        x, y = cache_8k_mib(row), row["ppl_valid4"]
        colour = {64: "tab:blue", 128: "tab:orange", 256: "tab:green"}[row["window"]]
        marker = "o" if row["layers"] == "0-29" else "s"
        ax.scatter(x, y, c=colour, marker=marker)
        pk = ", ".join(f"{v:.0%}" for v in row["passkey_2k"].values())
        ax.annotate(
            f"K={row['K']} β{row['beta_offset']:+g} pk {pk}",
            (x, y),
            fontsize=7,
            xytext=(3, 3),
            textcoords="offset points",
        )
    orig = data["original"]
    ax.scatter(orig["cache_8k_mib"], orig["ppl_valid4"], c="black", marker="*", s=120)
    ax.annotate("original", (orig["cache_8k_mib"], orig["ppl_valid4"]), xytext=(3, 3), textcoords="offset points")
    ax.axvline(0.35 * orig["cache_8k_mib"], ls="--", c="grey", lw=0.8)
    ax.set_xlabel("cache of one sequence at 8k tokens (MiB, fp32)")
    ax.set_ylabel("dev perplexity (WikiText-2 valid blocks 0-3, N = 1024)")
    ax.set_title("Recipe search (dev): blue w=64, orange w=128, green w=256; squares layers 3-26, dots 0-29")
    fig.tight_layout()
    fig.savefig(args.png, dpi=120)


if __name__ == "__main__":
    main()
