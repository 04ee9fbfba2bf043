"""lm-evaluation-harness integration: the ``oal`` model (``--model oal``). Needs ``pip install lm-eval``.

Importing this module registers the model with lm-eval; nothing else in :mod:`oal.evaluation` imports it, so
lm-eval stays optional. From Python::

    import lm_eval
    import oal.evaluation.harness  # registers "oal"
    lm_eval.simple_evaluate(model="oal", model_args="pretrained=smollm2-135m,dtype=float32", tasks=["piqa"])

From the shell, ``python -m oal.evaluation.harness`` is lm-eval's own command line with ``oal`` registered::

    python -m oal.evaluation.harness run --model oal --model_args pretrained=<converted model dir> --tasks piqa

``OALLM`` is lm-eval's ``HFLM`` handed an already loaded model: ``pretrained`` (a model directory, a Hub id or
``smollm2-135m``) goes through a loader, by default :func:`oal.evaluation.loading.load_model_and_tokenizer`
(``oal.models.load_model`` when available), and lm-eval's request batching and scoring do the rest. F.3 adds
no BOS, so ``add_bos_token`` defaults to False here. lm-eval's task definitions are its own (Hub datasets,
its prompts, ``acc_norm`` per character everywhere); ``oal eval`` is the F.3 protocol on the local files.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import lm_eval.models  # noqa: F401  (registers lm-eval's lazy model names; get_model only does so when none exist)
import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .loading import load_model_and_tokenizer

Loader = Callable[..., tuple[PreTrainedModel, PreTrainedTokenizerBase]]


@register_model("oal")
class OALLM(HFLM):
    """lm-eval model wrapping a (converted) causal LM loaded by ``loader(pretrained, dtype=, device=)``."""

    def __init__(
        self,
        pretrained: str | os.PathLike = "smollm2-135m",
        dtype: str | torch.dtype = "float32",
        device: str | None = None,
        batch_size: int | str = 1,
        add_bos_token: bool = False,
        loader: Loader | None = None,
        **kwargs,
    ) -> None:
        model, tokenizer = (loader or load_model_and_tokenizer)(pretrained, dtype=dtype, device=device)
        super().__init__(
            pretrained=model, tokenizer=tokenizer, batch_size=batch_size, add_bos_token=add_bos_token, **kwargs
        )
        self.model_name = os.fspath(pretrained)

    def get_model_info(self) -> dict:
        # HFLM's version asks the Hub for a commit of `pretrained`, which is meaningless for a local model
        return {
            "model_name": self.model_name,
            "model_num_parameters": sum(p.numel() for p in self.model.parameters()),
            "model_dtype": str(self.model.dtype),
        }


def main() -> None:
    """lm-eval's command line, with ``oal`` registered."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
