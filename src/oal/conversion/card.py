"""The model card (README.md) of a saved converted model, and the folder upload that shares it.

The card is generated from the conversion record in ``config.json`` (base model, converted layers and kernel kinds,
exact heads, recipe) plus the measured figures a caller passes (quality and speed against the original, each with
the command that produced it); nothing in it is typed by hand. :func:`push_converted` uploads a saved directory
as it is — the same files a user would copy — after checking it holds only safetensors weights.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path

from ..io import read_json
from ..models.converted import CONFIG_KEY, KERNELS_FILE

__all__ = [
    "CARD_FILE",
    "check_shareable",
    "measurements_from_results",
    "model_card",
    "push_converted",
    "write_model_card",
]

CARD_FILE = "README.md"
#: weight formats that execute code when loaded; a shared converted folder never holds them
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")


def _layer_ranges(layers: Sequence[int]) -> str:
    out, start = [], None
    for i, x in enumerate(layers):
        if start is None:
            start = x
        if i + 1 == len(layers) or layers[i + 1] != x + 1:
            out.append(str(start) if start == x else f"{start}–{x}")
            start = None
    return ", ".join(out)


def _kind(config: Mapping) -> str:
    """A kernel config's display name; exact heads read as ``<inner>+exact`` like the kernel's own name."""
    name = config.get("name", "?")
    if name == "exact-heads" and isinstance(config.get("inner"), Mapping):
        return f"{config['inner'].get('name', '?')}+exact"
    return name


def model_card(config: Mapping, *, measurements: Sequence[Mapping[str, str]] = (), command: str | None = None) -> str:
    """Markdown model card of a converted model from its saved ``config`` (config.json as a dict).

    ``measurements``: rows ``{"what", "original", "converted", "command"}`` of measured figures (strings, as
    measured); ``command``: the command that produced the model (default: the recipe's, if recorded)."""
    info = config.get(CONFIG_KEY)
    if not isinstance(info, Mapping):
        raise ValueError(f"config: expected a converted model's config with {CONFIG_KEY!r}, got none")
    layers = list(info.get("layers", []))
    kinds = Counter(_kind(c) for c in info.get("kernel_configs", {}).values())
    exact = {int(k): v for k, v in (info.get("exact_heads") or {}).items()}
    base = info.get("base_weights") or info.get("base_model") or "?"
    n_layers = config.get("num_hidden_layers", "?")
    n_kv = config.get("num_key_value_heads", "?")
    recipe = info.get("recipe") or {}
    if command is None and recipe.get("name"):
        command = f"oal convert --recipe {recipe['name']} --out DIR"
    lines = [
        "---",
        "library_name: transformers",
        "tags: [oal, linear-attention, converted]",
        "---",
        "",
        f"# {config.get('model_type', 'oal')} — converted by oal",
        "",
        "The attention of a pretrained causal LM replaced by Outlier-Aware Attention Linearization (OAL) kernels:",
        "a positive grouped quadratic kernel evaluated in time linear in the context length.",
        "",
        "```python",
        "import oal  # registers the converted model types with transformers",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "model = AutoModelForCausalLM.from_pretrained(DIR)  # or trust_remote_code=True without `import oal`",
        "```",
        "",
        "| | |",
        "|---|---|",
        f"| base model | `{base}` |",
        f"| converted layers | {len(layers)} of {n_layers}: {_layer_ranges(layers)} |",
        f"| kernel kinds | {', '.join(f'`{k}` × {n}' for k, n in sorted(kinds.items()))} |",
    ]
    if exact:
        total = sum(len(v) for v in exact.values())
        where = " · ".join(f"{i}: {', '.join(map(str, sorted(v)))}" for i, v in sorted(exact.items()))
        lines.append(f"| exact softmax KV heads | {total} of {len(layers)} × {n_kv} (layer: heads) {where} |")
    if "base_weights" in info:
        lines.append(f"| weights | kernels only (`{KERNELS_FILE}`); the unchanged base weights load from `{base}` |")
    if recipe:
        shown = {k: v for k, v in recipe.items() if not isinstance(v, (dict, list))}
        lines.append(f"| recipe | {', '.join(f'{k}={v}' for k, v in shown.items())} |")
    if command:
        lines.append(f"| command | `{command}` |")
    lines.append(f"| oal version | {info.get('oal_version', '?')} |")
    if measurements:
        lines += ["", "## Measured against the original", "", "| what | original | converted | command |"]
        lines.append("|---|---:|---:|---|")
        for row in measurements:
            lines.append(f"| {row['what']} | {row['original']} | {row['converted']} | `{row['command']}` |")
    else:
        lines += ["", "No measurements were recorded with this model."]
    return "\n".join(lines) + "\n"


def _results(path: Path) -> dict:
    return read_json(path, what="evaluation results")["results"]


def measurements_from_results(
    original: str | os.PathLike, converted: str | os.PathLike, *, decode: str | os.PathLike | None = None
) -> list[dict[str, str]]:
    """Card rows from ``oal eval`` results of the original and the converted model — the JSON files of the same
    name in two directories (``passkey.json``, ``multikey.json``, ``ppl_<N>.json``, whichever exist in both) —
    and optionally an ``oal bench decode`` JSON (decode ms/token, prefill s and cache MB per context)."""
    original, converted = Path(original), Path(converted)
    rows: list[dict[str, str]] = []
    for name in sorted(p.name for p in original.glob("*.json") if (converted / p.name).is_file()):
        ours = read_json(converted / name, what="evaluation results")
        a, b = _results(original / name), ours["results"]
        command = ours.get("config", {}).get("command") or f"oal eval ({name})"
        stem = name.removesuffix(".json")
        for task in sorted(set(a) & set(b)):
            for key in sorted(a[task]):
                if key.startswith("acc@") and key in b[task]:
                    n = key[4:].split(",")[0]
                    what = f"{task} accuracy, {n} tokens"
                    pair = (f"{100 * a[task][key]:.0f} %", f"{100 * b[task][key]:.0f} %")
                elif key == "perplexity,none" and stem.startswith("ppl_"):
                    what = f"{task} perplexity, N = {stem[4:]}"
                    pair = (f"{a[task][key]:.3f}", f"{b[task][key]:.3f}")
                else:
                    continue
                rows.append({"what": what, "original": pair[0], "converted": pair[1], "command": command})
    if decode is not None:
        doc = read_json(Path(decode), what="decode benchmark")
        points = {(p["method"], p["n"]): p for p in doc["points"]}
        cfg = doc.get("config", {})
        bench_command = doc.get("provenance", {}).get("command") or "oal bench decode"
        tag = f"batch {cfg.get('batch', 1)}, {cfg.get('threads', '?')} threads, {cfg.get('dtype', 'fp32')}"
        for n in sorted({n for _, n in points}):
            pair = points.get(("original", n)), points.get(("converted", n))
            if None in pair:
                continue
            for field, label, fmt in (
                ("ms_per_token", "decode ms/token", "{:.1f}"),
                ("prefill_s", "prefill s", "{:.2f}"),
                ("cache_mb", "cache MB", "{:.1f}"),
            ):
                rows.append(
                    {
                        "what": f"{label} at {n} tokens ({tag})",
                        "original": fmt.format(pair[0][field]),
                        "converted": fmt.format(pair[1][field]),
                        "command": bench_command,
                    }
                )
    return rows


def write_model_card(
    directory: str | os.PathLike, *, measurements: Sequence[Mapping[str, str]] = (), command: str | None = None
) -> Path:
    """Write :data:`CARD_FILE` into a saved converted ``directory`` from its config.json."""
    directory = Path(directory)
    config = read_json(directory / "config.json", what="model config")
    path = directory / CARD_FILE
    path.write_text(model_card(config, measurements=measurements, command=command), encoding="utf-8")
    return path


def check_shareable(directory: str | os.PathLike) -> list[str]:
    """The files of a saved converted ``directory`` (relative, sorted) after checking that it is complete and
    safe to share: config.json with a conversion record, a model card, safetensors weights and no pickled ones."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ValueError(f"directory: expected a saved converted model directory, got {directory}")
    files = sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())
    config = read_json(directory / "config.json", what="model config")
    if CONFIG_KEY not in config:
        raise ValueError(f"directory: {directory}/config.json has no conversion record ({CONFIG_KEY})")
    pickled = [f for f in files if f.endswith(_PICKLE_SUFFIXES)]
    if pickled:
        raise ValueError(f"directory: {directory} holds pickled weights {pickled}; only safetensors are shared")
    if not any(f.endswith(".safetensors") for f in files):
        raise ValueError(f"directory: {directory} holds no safetensors weights")
    if CARD_FILE not in files:
        raise ValueError(f"directory: {directory} has no model card ({CARD_FILE}); see write_model_card")
    return files


def push_converted(directory: str | os.PathLike, repo_id: str, *, private: bool = False, token: str | None = None):
    """Upload a saved converted ``directory`` to the Hub repository ``repo_id`` exactly as it is (after
    :func:`check_shareable`); returns huggingface_hub's commit info."""
    from huggingface_hub import HfApi

    check_shareable(directory)
    api = HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True)
    return api.upload_folder(folder_path=str(directory), repo_id=repo_id, commit_message="Upload converted model (oal)")
