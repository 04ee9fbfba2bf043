"""Plot the evaluated recipes' quality/cost frontier from their committed `oal eval` records
(docs/results/conversion/{original,copy20,recipe40,converted}): passkey accuracy over 1k-8k (80 prompts) and
WikiText-2 test perplexity (N = 1024) against the cache after an 8k prompt.

    python benchmarks/plot_recipes.py docs/results/conversion docs/results/conversion/recipes.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

RECIPES = {
    "original": "original (softmax)",
    "copy20": "20 copy heads, fp32 (stops 19-21)",
    "recipe40": "20 copy + 20 error heads, bf16",
    "converted": "20 copy + 28 error heads, bf16 (default)",
}


def point(root: Path, name: str) -> dict:
    """Cache MiB at 8k, passkey accuracy over every length, WikiText-2 perplexity (N = 1024) of one record folder."""
    pk = json.loads((root / name / "passkey.json").read_text())["results"]["passkey"]
    ppl = json.loads((root / name / "ppl_1024.json").read_text())["results"]["wikitext"]["perplexity,none"]
    return {"cache": pk["cache_mib@8192,none"], "passkey": pk["acc,none"], "ppl": ppl}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("root", type=Path)
    ap.add_argument("out", type=Path)
    args = ap.parse_args()
    pts = {name: point(args.root, name) for name in RECIPES}
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in ((axes[0], "passkey", "passkey accuracy, 1k-8k (80 prompts)"),
                           (axes[1], "ppl", "WikiText-2 test perplexity (16 × 1024)")):  # fmt: skip
        for name, p in pts.items():
            ax.scatter(p["cache"], p[key], s=40)
            ax.annotate(RECIPES[name], (p["cache"], p[key]), fontsize=7, xytext=(4, 4), textcoords="offset points")
        ax.set_xlabel("cache after an 8k prompt (MiB)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)


if __name__ == "__main__":
    main()
