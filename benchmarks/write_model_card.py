"""Re-save the committed converted model (docs/results/conversion/model) in the current format as the default recipe
gives it (its exact heads' decode budget included) with its model card, the card's figures read from the committed
measurements (nothing typed by hand).

    OAL_DATA_DIR=../shared/data python benchmarks/write_model_card.py

Reads docs/results/conversion/original/*.json and, for the converted model, budget/{passkey,multikey}.json (the
retrieval tasks, decoded with the budget; stop 40) and converted/ppl_*.json (perplexities: whole texts as prompts,
which the budget leaves unchanged), plus docs/results/bench/model/stop40/recipe_b1/decode.json (oal bench decode);
keeps recipe.json with its recipe record updated; the kernels are rewritten from the loaded model (byte-identical
tensors).
"""

from __future__ import annotations

from pathlib import Path

from oal.conversion.card import measurements_from_results
from oal.conversion.recipe import RECIPES, restore_converted

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "docs/results/conversion/model"
RESULTS = ROOT / "docs/results/conversion"
DECODE = ROOT / "docs/results/bench/model/stop40/recipe_b1/decode.json"


def main() -> None:
    recipe = RECIPES["retrieval"]
    measured = measurements_from_results(RESULTS / "original", RESULTS / "budget", decode=DECODE)
    texts = measurements_from_results(RESULTS / "original", RESULTS / "converted")
    rows = [r for r in measured if "accuracy" in r["what"]]
    rows += [r for r in texts if "perplexity" in r["what"]]
    rows += [r for r in measured if "accuracy" not in r["what"]]
    restore_converted(
        str(MODEL),
        MODEL,
        decode_budget=recipe.exact_decode_budget,
        decode_page=recipe.exact_decode_page,
        overwrite=True,
        measurements=rows,
    )


if __name__ == "__main__":
    main()
