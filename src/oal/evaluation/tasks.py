"""Evaluation data for App. F.3: PIQA, HellaSwag, ARC-Easy (multiple choice) and the WikiText test text.

Each task loads from local files under a data folder (``data_dir`` argument, else ``$OAL_DATA_DIR``; layout as
in the project's shared data, see its SOURCES.md) or, when online, from the Hugging Face datasets F.3 names.
``source="auto"`` prefers local files and falls back to the Hub; when both fail the error names the missing path
and the Hub error.

Prompts (F.3): PIQA and ARC-E contexts are ``"Question: {question}\\nAnswer:"``; HellaSwag's is
``"{activity_label}: {ctx_a} {ctx_b.capitalize()}"`` with lm-eval's clean-up (title markers to periods, bracketed
artifacts removed), also applied to the endings. Choices are stored without the leading space the scorer adds.

The local HellaSwag file is a pre-processed text form (6 lines per item: context line, gold label, 4 endings)
in which ``ctx_a``/``ctx_b`` are already joined, so ``ctx_b`` keeps its original lower-case first letter. The
same clean-up is applied to its lines (it changes 2 contexts and 12 endings, which still hold bracketed
artifacts). Scores from it are reported with that source named and are not exactly the Hub version's.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from .utils import check_limit, resolve_data_dir

logger = logging.getLogger(__name__)

Source = Literal["auto", "local", "hf"]
SOURCES = ("auto", "local", "hf")


@dataclass(frozen=True)
class MultipleChoiceItem:
    """One question: ``context`` (the prompt), ``choices`` (option texts, no leading space), ``gold`` index."""

    context: str
    choices: tuple[str, ...]
    gold: int
    id: str = ""

    def __post_init__(self) -> None:
        if len(self.choices) < 2:
            raise ValueError(f"choices: expected at least 2 options for item {self.id!r}, got {len(self.choices)}")
        if not 0 <= self.gold < len(self.choices):
            raise ValueError(f"gold: expected an index in [0, {len(self.choices)}) for {self.id!r}, got {self.gold}")


@dataclass(frozen=True)
class TaskSpec:
    """A zero-shot task: ``norm`` is F.3's length normalisation (``"tokens"``: candidate token count,
    ``"chars"``: option-text character count), ``size`` the F.3 split's example count, ``local_files`` the
    files under the data folder."""

    name: str
    norm: Literal["tokens", "chars"]
    size: int
    local_files: tuple[str, ...]


TASKS: dict[str, TaskSpec] = {
    "piqa": TaskSpec("piqa", "tokens", 1838, ("piqa/valid.jsonl", "piqa/valid-labels.lst")),
    "hellaswag": TaskSpec("hellaswag", "tokens", 10042, ("hellaswag/hellaswag_val_full.txt",)),
    "arc_easy": TaskSpec("arc_easy", "chars", 2376, ("arc-easy/ARC-Easy-Test.jsonl",)),
}


@dataclass(frozen=True)
class TaskData:
    """Loaded items with where they came from (``source``, e.g. ``"local:/data/piqa/valid.jsonl"``) and the
    number of examples before ``limit`` (``n_original``)."""

    name: str
    items: list[MultipleChoiceItem]
    source: str
    n_original: int


def question_prompt(question: str) -> str:
    """F.3 prompt for PIQA and ARC-E."""
    return f"Question: {question}\nAnswer:"


def hellaswag_preprocess(text: str) -> str:
    """lm-eval's HellaSwag clean-up: strip, ``" [title]"`` to ``". "``, drop ``[...]``, fold double spaces once."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


# --------------------------------------------------------------------------------------------------------------
# Row converters shared by the local parsers and the Hub loaders


def piqa_item(goal: str, sol1: str, sol2: str, label: int, id: str = "") -> MultipleChoiceItem:
    return MultipleChoiceItem(question_prompt(goal), (sol1, sol2), int(label), id)


def arc_item(question: str, texts: list[str], labels: list[str], answer_key: str, id: str = "") -> MultipleChoiceItem:
    """ARC labels mix ``A``-``E`` and ``1``-``4``; gold is the answer key's position among the item's labels."""
    if len(texts) != len(labels):
        raise ValueError(f"choices: item {id!r} has {len(texts)} texts but {len(labels)} labels")
    if answer_key not in labels:
        raise ValueError(f"answerKey: item {id!r} has answer key {answer_key!r}, not one of its labels {labels}")
    return MultipleChoiceItem(question_prompt(question), tuple(texts), labels.index(answer_key), id)


def hellaswag_item(
    activity_label: str, ctx_a: str, ctx_b: str, endings: list[str], label: int | str, id: str = ""
) -> MultipleChoiceItem:
    context = hellaswag_preprocess(f"{activity_label}: {ctx_a} {ctx_b.capitalize()}")
    return MultipleChoiceItem(context, tuple(hellaswag_preprocess(e) for e in endings), int(label), id)


# --------------------------------------------------------------------------------------------------------------
# Local files


def _require_file(path: Path, task: str) -> Path:
    if not path.is_file():
        raise FileNotFoundError(f"{task}: data file not found: {path}")
    return path


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not a JSON line ({e})") from e
    return rows


def parse_piqa(questions: str | os.PathLike, labels: str | os.PathLike) -> list[MultipleChoiceItem]:
    """PIQA from the authors' ``valid.jsonl`` (goal, sol1, sol2) and ``valid-labels.lst`` (one 0/1 per line)."""
    questions, labels = _require_file(Path(questions), "piqa"), _require_file(Path(labels), "piqa")
    rows = _read_jsonl(questions)
    golds = [line.strip() for line in labels.read_text(encoding="utf-8").splitlines() if line.strip()]
    if len(rows) != len(golds):
        raise ValueError(f"piqa: {questions} has {len(rows)} questions but {labels} has {len(golds)} labels")
    items = []
    for i, (row, gold) in enumerate(zip(rows, golds, strict=True)):
        if gold not in ("0", "1"):
            raise ValueError(f"{labels}:{i + 1}: expected label 0 or 1, got {gold!r}")
        try:
            items.append(piqa_item(row["goal"], row["sol1"], row["sol2"], int(gold), str(i)))
        except KeyError as e:
            raise ValueError(f"{questions}:{i + 1}: missing field {e}") from e
    return items


def parse_arc(path: str | os.PathLike) -> list[MultipleChoiceItem]:
    """ARC from AI2's jsonl (``question.stem``, ``question.choices[].text/label``, ``answerKey``)."""
    path = _require_file(Path(path), "arc_easy")
    items = []
    for i, row in enumerate(_read_jsonl(path)):
        try:
            q = row["question"]
            texts = [c["text"] for c in q["choices"]]
            labels = [c["label"] for c in q["choices"]]
            items.append(arc_item(q["stem"], texts, labels, row["answerKey"], row.get("id", str(i))))
        except KeyError as e:
            raise ValueError(f"{path}: example {i} is missing field {e}") from e
    return items


def parse_hellaswag_text(path: str | os.PathLike) -> list[MultipleChoiceItem]:
    """HellaSwag from the pre-processed text form: per item the line ``activity_label: ctx``, the gold label
    (0-3) and the 4 endings (see the module docstring for how this differs from the Hub version)."""
    path = _require_file(Path(path), "hellaswag")
    lines = path.read_text(encoding="utf-8").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    if len(lines) % 6:
        raise ValueError(f"{path}: expected 6 lines per item, got {len(lines)} lines (not a multiple of 6)")
    items = []
    for start in range(0, len(lines), 6):
        gold = lines[start + 1].strip()
        if gold not in ("0", "1", "2", "3"):
            raise ValueError(f"{path}:{start + 2}: expected a gold label 0-3, got {gold!r}")
        context = hellaswag_preprocess(lines[start])
        endings = tuple(hellaswag_preprocess(e) for e in lines[start + 2 : start + 6])
        items.append(MultipleChoiceItem(context, endings, int(gold), str(start // 6)))
    return items


def _parse_local(name: str, data_dir: Path) -> tuple[list[MultipleChoiceItem], str]:
    files = [data_dir / f for f in TASKS[name].local_files]
    for f in files:
        _require_file(f, name)
    parser: Callable[..., list[MultipleChoiceItem]] = {
        "piqa": parse_piqa,
        "hellaswag": parse_hellaswag_text,
        "arc_easy": parse_arc,
    }[name]
    return parser(*files), "local:" + ",".join(str(f) for f in files)


# --------------------------------------------------------------------------------------------------------------
# Hugging Face Hub


def _load_hf(path: str, name: str | None, split: str) -> Iterable[dict]:
    try:
        import datasets
    except ImportError as e:
        raise RuntimeError("the Hugging Face loaders need the `datasets` package: pip install datasets") from e
    try:
        return datasets.load_dataset(path, name, split=split)
    except Exception as e:  # any failure (offline, missing repo, schema) is reported with the dataset's name
        raise RuntimeError(f"could not load {path}{f' ({name})' if name else ''} [{split}] from the Hub: {e}") from e


def _parse_hf(name: str) -> tuple[list[MultipleChoiceItem], str]:
    if name == "piqa":
        rows = _load_hf("lighteval/piqa", None, "validation")
        items = [piqa_item(r["goal"], r["sol1"], r["sol2"], r["label"], str(i)) for i, r in enumerate(rows)]
        return items, "hf:lighteval/piqa[validation]"
    if name == "hellaswag":
        rows = _load_hf("Rowan/hellaswag", None, "validation")
        items = [
            hellaswag_item(r["activity_label"], r["ctx_a"], r["ctx_b"], r["endings"], r["label"], str(r["ind"]))
            for r in rows
        ]
        return items, "hf:Rowan/hellaswag[validation]"
    rows = _load_hf("allenai/ai2_arc", "ARC-Easy", "test")
    items = [
        arc_item(r["question"], r["choices"]["text"], r["choices"]["label"], r["answerKey"], r["id"]) for r in rows
    ]
    return items, "hf:allenai/ai2_arc/ARC-Easy[test]"


def _check_source(source: str) -> None:
    if source not in SOURCES:
        raise ValueError(f"source: expected one of {SOURCES}, got {source!r}")


def load_task(
    name: str,
    *,
    data_dir: str | os.PathLike | None = None,
    source: Source = "auto",
    limit: int | None = None,
) -> TaskData:
    """Load task ``name`` (``piqa``, ``hellaswag``, ``arc_easy``); ``limit`` keeps the first ``limit`` items."""
    if name not in TASKS:
        raise ValueError(f"name: expected one of {sorted(TASKS)}, got {name!r}")
    _check_source(source)
    check_limit(limit)
    folder = resolve_data_dir(data_dir)
    if source == "local":
        if folder is None:
            raise FileNotFoundError(f"{name}: source='local' needs data_dir or $OAL_DATA_DIR")
        items, where = _parse_local(name, folder)
    elif source == "hf":
        items, where = _parse_hf(name)
    else:
        missing = [folder / f for f in TASKS[name].local_files if not (folder / f).is_file()] if folder else []
        if folder is not None and not missing:
            items, where = _parse_local(name, folder)
        else:
            try:
                items, where = _parse_hf(name)
            except RuntimeError as e:
                local = f"local file not found: {missing[0]}" if missing else "no data folder given ($OAL_DATA_DIR)"
                raise FileNotFoundError(f"{name}: {local}, and the Hub fallback failed: {e}") from e
    if len(items) != TASKS[name].size:
        logger.warning("%s: %s holds %d examples, not the %d of F.3's split", name, where, len(items), TASKS[name].size)
    return TaskData(name, items[:limit] if limit is not None else items, where, len(items))
