"""Re-save the committed converted model (docs/results/conversion/model) in the current format with its model card,
the card's figures read from the committed measurements (nothing typed by hand).

    OAL_DATA_DIR=../shared/data python benchmarks/write_model_card.py

Reads docs/results/conversion/{original,converted}/*.json (oal eval) and
docs/results/bench/model/stop33/recipe_b1/decode.json (oal bench decode); keeps recipe.json; the kernels are rewritten
from the loaded model (byte-identical tensors).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from oal.conversion import save_converted
from oal.conversion.card import measurements_from_results
from oal.models import load_model, load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "docs/results/conversion/model"
RESULTS = ROOT / "docs/results/conversion"
DECODE = ROOT / "docs/results/bench/model/stop33/recipe_b1/decode.json"


def main() -> None:
    rows = measurements_from_results(RESULTS / "original", RESULTS / "converted", decode=DECODE)
    with tempfile.TemporaryDirectory() as tmp:
        recipe = Path(tmp) / "recipe.json"
        shutil.copy(MODEL / "recipe.json", recipe)
        model, tokenizer = load_model(str(MODEL)), load_tokenizer(str(MODEL))
        base = model.config.oal_conversion["base_weights"]
        save_converted(model, MODEL, tokenizer=tokenizer, base_weights=base, overwrite=True, measurements=rows)
        shutil.copy(recipe, MODEL / "recipe.json")


if __name__ == "__main__":
    main()
