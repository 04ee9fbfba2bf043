"""The demo's report: ``report.json`` (everything measured), ``report.md`` (the side-by-side tables) and
``demo.png`` (passkey accuracy, decode latency, prefill time and cache memory against the context length)."""

from __future__ import annotations

from pathlib import Path

from ..io import atomic_write, write_json, write_text


def _ratio(a: float, b: float) -> str:
    return f"{b / a:.2f}×" if a else "–"


def rows(report: dict) -> list[tuple[str, str, str, str]]:
    """``(what, original, converted, converted/original)`` rows of the side-by-side table."""
    o, c = report["results"]["original"], report["results"]["converted"]
    cfg = report["config"]
    out = []
    for text, r in o["perplexity"].items():
        rc = c["perplexity"][text]
        what = f"perplexity, {text} ({r['n_blocks']} × {cfg['block_len']} tokens)"
        out.append((what, f"{r['ppl']:.2f}", f"{rc['ppl']:.2f}", _ratio(r["ppl"], rc["ppl"])))
    for n, r in o["passkey"]["per_length"].items():
        rc = c["passkey"]["per_length"][n]
        out.append(
            (
                f"passkey accuracy at {n} tokens ({r['n']} prompts)",
                f"{100 * r['acc']:.0f} %",
                f"{100 * rc['acc']:.0f} %",
                "",
            )
        )
    for n, point in report["speed"].items():
        r, rc, ratios = point["original"], point["converted"], point["ratios"]
        rounds, steps = len(r["prefill_rounds"]), len(r["step_ms"])
        q1, _, q3 = ratios["decode_step_quartiles"]
        out.append(
            (
                f"decode ms/token at {n} tokens (median of {steps} steps, side by side)",
                f"{r['ms_per_token']:.1f}",
                f"{rc['ms_per_token']:.1f}",
                f"{_ratio(r['ms_per_token'], rc['ms_per_token'])} (step pairs' quartiles {q1:.2f}–{q3:.2f})",
            )
        )
        lo, hi = min(ratios["prefill_rounds"]), max(ratios["prefill_rounds"])
        out.append(
            (
                f"prefill s at {n} tokens (median of {rounds} rounds, side by side)",
                f"{r['prefill_s']:.2f}",
                f"{rc['prefill_s']:.2f}",
                f"{_ratio(r['prefill_s'], rc['prefill_s'])} (rounds {lo:.2f}–{hi:.2f})",
            )
        )
        out.append(
            (
                f"cache MB at {n} tokens",
                f"{r['cache_mb']:.1f}",
                f"{rc['cache_mb']:.1f}",
                _ratio(r["cache_mb"], rc["cache_mb"]),
            )
        )
    return out


def markdown(report: dict) -> str:
    cfg, prov = report["config"], report["provenance"]
    lines = [
        "# The converted model against the original",
        "",
        f"Original `{cfg['original']}`, converted `{cfg['converted']}`; {cfg['device']}, {cfg['threads']} threads, "
        f"fp32, seed {cfg['seed']}. Command `{prov['command']}` at {prov['time_utc']} ({prov.get('machine', '')}); "
        f"stages measured in {sum(report['stage_seconds'].values()):.0f} s, this run {report['wall_s']:.0f} s.",
        "",
        "| | original | converted | converted / original |",
        "|---|---:|---:|---:|",
    ]
    lines += [f"| {w} | {a} | {b} | {r} |" for w, a, b, r in rows(report)]
    lines += ["", "## Greedy continuations", ""]
    o, c = report["results"]["original"]["continuations"], report["results"]["converted"]["continuations"]
    for prompt in o:
        lines += [f"**{prompt}**", "", f"- original: {o[prompt]!r}", f"- converted: {c[prompt]!r}", ""]
    lines += [
        "Perplexity texts: WikiText-2 test and the Python reference topics, neither read by the conversion.",
        "Passkey: a 5-digit key at a uniform depth of filler text, greedy answer, the same prompts for both models.",
        "Speed: both models in one process, seeded random prompt tokens into a fresh cache; prefill rounds take the",
        "models in turn, the order reversed every round; decode steps (from the last round's caches, after 2 untimed",
        "ones) take them in turn, the order reversed every step. A ratio below 1× is faster or smaller. A CPU's speed",
        "swings ±30 % between minutes, so only figures measured side by side compare.",
        "The continuations' prompts are shorter than a converted head's exact part (sinks and window): there the",
        "converted model differs from the original by rounding only (a recipe's exact heads may keep bf16 keys and",
        "values), which can still flip a greedy near-tie; the kernels act on the longer contexts above.",
    ]
    return "\n".join(lines) + "\n"


def figure(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(17, 3.8))
    for name, style in (("original", "--o"), ("converted", "-o")):
        r = report["results"][name]
        pk = sorted((int(n), v["acc"] * 100) for n, v in r["passkey"]["per_length"].items())
        dec = sorted((int(n), v[name]) for n, v in report["speed"].items())
        axes[0].plot([n for n, _ in pk], [a for _, a in pk], style, label=name)
        axes[1].plot([n for n, _ in dec], [v["ms_per_token"] for _, v in dec], style, label=name)
        axes[2].plot([n for n, _ in dec], [v["prefill_s"] for _, v in dec], style, label=name)
        axes[3].plot([n for n, _ in dec], [v["cache_mb"] for _, v in dec], style, label=name)
    titles = ("passkey accuracy %", "decode ms / token (side by side)", "prefill s (side by side)", "cache MB")
    for ax, title in zip(axes, titles, strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context tokens")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend()
    axes[0].set_ylim(-5, 105)
    fig.suptitle(f"{report['config']['converted']} against {report['config']['original']}")
    fig.tight_layout()
    atomic_write(path, lambda p: fig.savefig(p, dpi=110, format="png"))
    plt.close(fig)


def write_report(out: Path, report: dict) -> None:
    write_json(out / "report.json", report)
    write_text(out / "report.md", markdown(report))
    figure(report, out / "demo.png")
