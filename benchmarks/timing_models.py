"""Write the timing-only conversions of SmolLM2 that `decode_growth.py` compares with the recipe (synthetic OAL
groups, as `oal bench decode --kernel oal` builds them: the speed does not depend on the groups' values, the
outputs do, so these are for timing only):

* ``plain_oal``: OAL on layers 3–26, layers 0–2 and 27–29 softmax (fp32 keys and values in the cache);
* ``plain_oal_bf16_softmax``: the same with OAL on every layer and layers 0–2 and 27–29 all exact heads
  (:func:`oal.conversion.heads.add_exact_heads` with bf16 keys, values and products, as the recipe's exact heads):
  softmax in those layers over bf16 keys and values, half the cache bytes.

    python benchmarks/timing_models.py runs
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from oal.bench.decode import synthetic_groups
from oal.conversion import convert_model
from oal.conversion.convert import save_converted
from oal.conversion.heads import add_exact_heads
from oal.models import attention_spec, load_model

SOFTMAX_LAYERS = (0, 1, 2, 27, 28, 29)


def build(bf16_softmax: bool) -> torch.nn.Module:
    model = load_model("smollm2-135m", dtype=torch.float32)
    spec = attention_spec(model)
    layers = range(spec.num_layers) if bf16_softmax else range(3, 27)
    ids = synthetic_groups(spec.num_heads, spec.head_dim)
    model = convert_model(model, "oal", layers=list(layers), groups={i: ids for i in layers})
    if bf16_softmax:
        every_head = list(range(spec.num_kv_heads))
        add_exact_heads(
            model,
            {layer: every_head for layer in SOFTMAX_LAYERS},
            kv_dtype=torch.bfloat16,
            product_dtype=torch.bfloat16,
        )
    return model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path, help="directory to write plain_oal/ and plain_oal_bf16_softmax/ into")
    args = ap.parse_args()
    for name, bf16_softmax in (("plain_oal", False), ("plain_oal_bf16_softmax", True)):
        save_converted(build(bf16_softmax), args.out / name, base_weights="smollm2-135m", overwrite=True)


if __name__ == "__main__":
    main()
