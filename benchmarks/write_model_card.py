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

import json
import shutil
import tempfile
from pathlib import Path

from oal.conversion import save_converted
from oal.conversion.card import measurements_from_results
from oal.conversion.heads import set_exact_decode_budget
from oal.conversion.recipe import RECIPES, with_recipe_fields
from oal.io import write_json
from oal.models import load_model, load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "docs/results/conversion/model"
RESULTS = ROOT / "docs/results/conversion"
DECODE = ROOT / "docs/results/bench/model/stop40/recipe_b1/decode.json"


def main() -> None:
    recipe = RECIPES["retrieval"]
    budget = {"exact_decode_budget": recipe.exact_decode_budget, "exact_decode_page": recipe.exact_decode_page}
    measured = measurements_from_results(RESULTS / "original", RESULTS / "budget", decode=DECODE)
    texts = measurements_from_results(RESULTS / "original", RESULTS / "converted")
    rows = [r for r in measured if "accuracy" in r["what"]]
    rows += [r for r in texts if "perplexity" in r["what"]]
    rows += [r for r in measured if "accuracy" not in r["what"]]
    with tempfile.TemporaryDirectory() as tmp:
        record = Path(tmp) / "recipe.json"
        shutil.copy(MODEL / "recipe.json", record)
        model, tokenizer = load_model(str(MODEL)), load_tokenizer(str(MODEL))
        set_exact_decode_budget(model, recipe.exact_decode_budget, recipe.exact_decode_page)
        info = model.config.oal_conversion
        model.config.oal_conversion = {**info, "recipe": with_recipe_fields(info["recipe"], **budget)}
        save_converted(
            model, MODEL, tokenizer=tokenizer, base_weights=info["base_weights"], overwrite=True, measurements=rows
        )
        data = json.loads(record.read_text())
        data["recipe"] = with_recipe_fields(data["recipe"], **budget)
        write_json(MODEL / "recipe.json", data)


if __name__ == "__main__":
    main()
