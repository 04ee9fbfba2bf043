"""Model-level evaluation per App. F.3: WikiText block perplexity and zero-shot PIQA / HellaSwag / ARC-Easy.

Works on any Hugging Face causal LM and tokenizer. :mod:`oal.evaluation.harness` (imported on demand, needs
lm-eval) registers the same models with lm-evaluation-harness as ``--model oal``.
"""

from .loading import load_model_and_tokenizer
from .multiple_choice import (
    ItemScores,
    LogLikelihood,
    accuracy_metrics,
    encode_pair,
    loglikelihoods,
    score_items,
)
from .perplexity import block_nll, perplexity
from .runner import ALL_TASKS, PAPER_BLOCK_LEN, evaluate
from .tasks import (
    TASKS,
    MultipleChoiceItem,
    TaskData,
    TaskSpec,
    hellaswag_preprocess,
    load_task,
    parse_arc,
    parse_hellaswag_text,
    parse_piqa,
)
from .utils import mean_stderr, write_json_atomic

__all__ = [
    "ALL_TASKS",
    "PAPER_BLOCK_LEN",
    "TASKS",
    "ItemScores",
    "LogLikelihood",
    "MultipleChoiceItem",
    "TaskData",
    "TaskSpec",
    "accuracy_metrics",
    "block_nll",
    "encode_pair",
    "evaluate",
    "hellaswag_preprocess",
    "load_model_and_tokenizer",
    "load_task",
    "loglikelihoods",
    "mean_stderr",
    "parse_arc",
    "parse_hellaswag_text",
    "parse_piqa",
    "perplexity",
    "score_items",
    "write_json_atomic",
]
