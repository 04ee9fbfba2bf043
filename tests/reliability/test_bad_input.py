"""Every CLI command against bad input: a missing model, a wrong data path, an empty or non-UTF-8 data file, layers
out of range, an unsupported architecture (GPT-2: no RoPE, no ``self_attn.q_proj``), a group file of another
model, zero or negative sizes. Each must end in ONE ``Error:`` line that names the option or argument (no
traceback), a non-zero exit, and leave what ``--out`` already holds untouched.

Cells left out on purpose: ``generate`` and ``eval`` accept any causal LM (GPT-2 included: nothing is
converted), so an "unsupported architecture" is not bad input for them; ``generate``, ``bench op`` and ``group``
read no text data; ``bench op`` loads no model. ``reproduce`` handles its errors itself: its messages name the
preset field or argument rather than the option; it checks the data folder before it writes ``run.json``.
"""

from __future__ import annotations

import hashlib
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from reliability_world import CALIBRATE_FAST, OAL, N, subprocess_env
from typer.testing import CliRunner

from oal.cli import app

W = dict[str, Path]


def calibrate(w: W, out: Path) -> list:
    return ["calibrate", "--kernel", "oal", "--groups", w["groups"], "--model", w["model"], "--seq-len", N,
            "--layers", "1", "--data", w["data"], "--cache", w["root"] / "qkv", "--out", out,
            *CALIBRATE_FAST]  # fmt: skip


def fidelity(w: W, out: Path) -> list:
    return ["fidelity", "-m", "softmax", "-m", "performer", "--model", w["model"], "--seq-len", N, "--layers", "1",
            "--blocks", "0-1", "--data", w["data"], "--cache", w["root"] / "qkv", "--out", out,
            "--calibrated", w["root"] / "no-calibrations"]  # fmt: skip


def intervene(w: W, out: Path) -> list:
    return ["intervene", "--groups", w["groups"], "-m", "performer", "--model", w["model"], "--seq-len", N,
            "--layers", "1", "--blocks", "0-1", "--data", w["data"], "--cache", w["root"] / "qkv", "--out", out,
            "--controls", "2", "--no-gaussian", "--positions", "4", "--seeds", "0"]  # fmt: skip


def finetune(w: W, out: Path) -> list:
    return ["finetune", "--model", w["model"], "--preset", "smoke", "--out", out, "--updates", "2",
            "--block-len", "32", "--threads", "1", "--data-dir", w["data"]]  # fmt: skip


def finetune_oal(w: W, out: Path) -> list:
    return [*finetune(w, out), "--kernel", "oal", "--groups", w["groups"], "--layers", "1"]


def analyze(w: W, out: Path) -> list:
    return ["analyze", "--model", w["model"], "--data", w["data"], "--out", out, "--prompts", "4",
            "--prompt-len", "8", "--long-len", N, "--layer", "1"]  # fmt: skip


def group(w: W, out: Path) -> list:
    return ["group", "--chi", w["chi"], "--out", out, "--n-boot", "5", "--layer", "1"]


def convert(w: W, out: Path) -> list:
    return ["convert", "--model", w["model"], "--out", out, "--overwrite", "--kernel", "oal", "--groups", w["groups"],
            "--layers", "1"]  # fmt: skip


def generate(w: W, out: Path) -> list:
    return ["generate", "--model", w["model"], "--prompt", "the river", "--max-new-tokens", "3"]


def evaluate(w: W, out: Path) -> list:
    return ["eval", "--model", w["model"], "--tasks", "wikitext", "--block-len", N, "--max-blocks", "2",
            "--data", w["data"], "--out", out / "eval.json", "--device", "cpu", "--no-progress"]  # fmt: skip


def bench_op(w: W, out: Path) -> list:
    return ["bench", "op", "--out", out, "--sizes", "64", "--dtypes", "fp32", "--methods", "oal", "--heads-q", "2",
            "--heads-kv", "1", "--head-dim", "8", "--min-repeats", "1", "--max-repeats", "1",
            "--budget", "0.1"]  # fmt: skip


def bench_decode(w: W, out: Path) -> list:
    return ["bench", "decode", "--out", out, "--model", w["model"], "--layers", "1", "--sizes", "32", "--steps", "1",
            "--warmup", "0"]  # fmt: skip


def demo(w: W, out: Path) -> list:
    return ["demo", "--out", out, "--original", w["model"], "--converted", w["model"], "--data-dir", w["data"],
            "--trials", "1", "--threads", "1"]  # fmt: skip


def reproduce(w: W, out: Path) -> list:
    return ["reproduce", "--preset", "demo", "--out", out, "--model", w["model"], "--data", w["data"],
            "--cache", w["root"] / "qkv", "--layers", "1", "--fidelity-layers", "1", "--analyze-layer", "1",
            "--no-progress", "--threads", "1"]  # fmt: skip


def with_(base: Callable[[W, Path], list], *extra: str | Callable[[W], object]):
    """``base``'s arguments followed by ``extra`` (callables get the world: ``lambda w: w["gpt2"]``); later
    options override earlier ones."""
    return lambda w, out: [*base(w, out), *(x(w) if callable(x) else x for x in extra)]


MISSING_MODEL = ("--model", lambda w: w["missing"])
GPT2 = ("--model", lambda w: w["gpt2"])
GROUPS_OTHER = ("--groups", lambda w: w["groups_other"])
GROUPS_EMPTY = ("--groups", lambda w: w["empty_file"])
GROUPS_BINARY = ("--groups", lambda w: w["binary_file"])


def data(option: str, key: str):
    return (option, lambda w: w[key])


# (id, argv, text(s) the single error line must contain)
CASES = [
    # demo (its --converted must be a converted directory; the base line's plain model fails last)
    ("demo-missing-model", with_(demo, "--original", lambda w: w["missing"]), "--original"),
    ("demo-not-converted", demo, ("--converted", "converted model directory")),
    ("demo-wrong-data", with_(demo, "--data-dir", lambda w: w["missing"]), "--data-dir"),
    ("demo-zero-trials", with_(demo, "--trials", "0"), "--trials"),
    ("demo-zero-rounds", with_(demo, "--speed-rounds", "0"), "--speed-rounds"),
    ("demo-zero-prefill-tokens", with_(demo, "--prefill-tokens", "0"), "--prefill-tokens"),
    ("demo-bad-lengths", with_(demo, "--decode-lengths", "8,x"), "--decode-lengths"),
    ("demo-short-lengths", with_(demo, "--passkey-lengths", "8"), "--passkey-lengths"),
    # analyze
    ("analyze-missing-model", with_(analyze, *MISSING_MODEL), "--model"),
    ("analyze-wrong-data", with_(analyze, *data("--data", "missing")), "--data"),
    ("analyze-empty-data", with_(analyze, *data("--data", "empty_data")), ("--data", "is empty")),
    ("analyze-binary-data", with_(analyze, *data("--data", "binary_data")), ("--data", "not valid UTF-8")),
    ("analyze-layer-out-of-range", with_(analyze, "--layer", "7"), "--layer"),
    ("analyze-gpt2", with_(analyze, *GPT2), "Llama/Qwen2/Mistral"),
    ("analyze-zero-prompts", with_(analyze, "--prompts", "0"), "--prompts"),
    ("analyze-negative-long-len", with_(analyze, "--long-len", "-3"), "--long-len"),
    # group
    ("group-missing-chi", with_(group, "--chi", lambda w: w["missing"]), "--chi"),
    ("group-empty-chi", with_(group, "--chi", lambda w: w["empty_file"]), "chi:"),
    ("group-binary-chi", with_(group, "--chi", lambda w: w["binary_file"]), "chi:"),
    ("group-layer-out-of-range", with_(group, "--layer", "7"), "--layer"),
    ("group-zero-n-boot", with_(group, "--n-boot", "0"), "--n-boot"),
    ("group-negative-tau", with_(group, "--tau", "-1"), "--tau"),
    # convert
    ("convert-missing-model", with_(convert, *MISSING_MODEL), "--model"),
    ("convert-layers-out-of-range", with_(convert, "--layers", "7"), "--layers"),
    ("convert-gpt2", with_(convert, *GPT2), "--model"),
    ("convert-groups-other-model", with_(convert, *GROUPS_OTHER), "--groups"),
    ("convert-groups-empty", with_(convert, *GROUPS_EMPTY), "--groups"),
    ("convert-groups-binary", with_(convert, *GROUPS_BINARY), "--groups"),
    ("convert-calibrated-empty", with_(convert, "--calibrated", lambda w: w["empty_file"]), "--calibrated"),
    ("convert-calibrated-missing", with_(convert, "--calibrated", lambda w: w["missing"]), "--calibrated"),
    # generate
    ("generate-missing-model", with_(generate, *MISSING_MODEL), "--model"),
    ("generate-zero-tokens", with_(generate, "--max-new-tokens", "0"), "--max-new-tokens"),
    ("generate-negative-threads", with_(generate, "--threads", "-1"), "--threads"),
    # eval
    ("eval-missing-model", with_(evaluate, *MISSING_MODEL), "--model"),
    ("eval-wrong-data", with_(evaluate, *data("--data", "missing")), "--data"),
    ("eval-empty-data", with_(evaluate, *data("--data", "empty_data")), ("--data", "is empty")),
    ("eval-binary-data", with_(evaluate, *data("--data", "binary_data")), ("--data", "not valid UTF-8")),
    ("eval-zero-block-len", with_(evaluate, "--block-len", "0"), "--block-len"),
    ("eval-zero-batch", with_(evaluate, "--batch-size", "0"), "--batch-size"),
    ("eval-negative-max-blocks", with_(evaluate, "--max-blocks", "-1"), "--max-blocks"),
    ("eval-zero-limit", with_(evaluate, "--limit", "0"), "--limit"),
    # calibrate
    ("calibrate-missing-model", with_(calibrate, *MISSING_MODEL), "--model"),
    ("calibrate-wrong-data", with_(calibrate, *data("--data", "missing")), "--data"),
    ("calibrate-empty-data", with_(calibrate, *data("--data", "empty_data")), ("--data", "is empty")),
    ("calibrate-binary-data", with_(calibrate, *data("--data", "binary_data")), ("--data", "not valid UTF-8")),
    ("calibrate-layers-out-of-range", with_(calibrate, "--layers", "2-7"), "--layers"),
    ("calibrate-gpt2", with_(calibrate, *GPT2), "Llama/Qwen2/Mistral"),
    ("calibrate-groups-other-model", with_(calibrate, *GROUPS_OTHER), "--groups"),
    ("calibrate-groups-empty", with_(calibrate, *GROUPS_EMPTY), "--groups"),
    ("calibrate-groups-binary", with_(calibrate, *GROUPS_BINARY), "--groups"),
    ("calibrate-zero-seq-len", with_(calibrate, "--seq-len", "0"), "--seq-len"),
    ("calibrate-negative-seq-len", with_(calibrate, "--seq-len", "-5"), "--seq-len"),
    ("calibrate-zero-updates", with_(calibrate, "--max-updates", "0"), "--max-updates"),
    ("calibrate-blocks-out-of-range", with_(calibrate, "--val-blocks", "24-99"), "blocks"),
    # fidelity
    ("fidelity-missing-model", with_(fidelity, *MISSING_MODEL), "--model"),
    ("fidelity-wrong-data", with_(fidelity, *data("--data", "missing")), "--data"),
    ("fidelity-empty-data", with_(fidelity, *data("--data", "empty_data")), ("--data", "is empty")),
    ("fidelity-binary-data", with_(fidelity, *data("--data", "binary_data")), ("--data", "not valid UTF-8")),
    ("fidelity-layers-out-of-range", with_(fidelity, "--layers", "7"), "--layers"),
    ("fidelity-gpt2", with_(fidelity, *GPT2), "Llama/Qwen2/Mistral"),
    ("fidelity-groups-other-model", with_(fidelity, "-m", "oal=init", *GROUPS_OTHER), "--groups"),
    ("fidelity-zero-seq-len", with_(fidelity, "--seq-len", "0"), "--seq-len"),
    # intervene
    ("intervene-missing-model", with_(intervene, *MISSING_MODEL), "--model"),
    ("intervene-wrong-data", with_(intervene, *data("--data", "missing")), "--data"),
    ("intervene-empty-data", with_(intervene, *data("--data", "empty_data")), ("--data", "is empty")),
    ("intervene-binary-data", with_(intervene, *data("--data", "binary_data")), ("--data", "not valid UTF-8")),
    ("intervene-layers-out-of-range", with_(intervene, "--layers", "7"), "--layers"),
    ("intervene-gpt2", with_(intervene, *GPT2), "Llama/Qwen2/Mistral"),
    ("intervene-groups-other-model", with_(intervene, *GROUPS_OTHER), "--groups"),
    ("intervene-groups-empty", with_(intervene, *GROUPS_EMPTY), "--groups"),
    ("intervene-groups-binary", with_(intervene, *GROUPS_BINARY), "--groups"),
    ("intervene-zero-positions", with_(intervene, "--positions", "0"), "--positions"),
    ("intervene-negative-controls", with_(intervene, "--controls", "-1"), "--controls"),
    ("intervene-zero-seq-len", with_(intervene, "--seq-len", "0"), "--seq-len"),
    # finetune
    ("finetune-missing-model", with_(finetune, *MISSING_MODEL), "--model"),
    ("finetune-wrong-data", with_(finetune, *data("--data-dir", "missing")), "--data-dir"),
    ("finetune-empty-data", with_(finetune, *data("--data-dir", "empty_data")), ("--data-dir", "is empty")),
    ("finetune-binary-data", with_(finetune, *data("--data-dir", "binary_data")), ("--data-dir", "not valid UTF-8")),
    ("finetune-layers-out-of-range", with_(finetune_oal, "--layers", "7"), "--layers"),
    ("finetune-gpt2", with_(finetune, *GPT2), "Llama/Qwen2/Mistral"),
    ("finetune-groups-other-model", with_(finetune_oal, *GROUPS_OTHER), "--groups"),
    ("finetune-groups-empty", with_(finetune_oal, *GROUPS_EMPTY), "--groups"),
    ("finetune-groups-binary", with_(finetune_oal, *GROUPS_BINARY), "--groups"),
    ("finetune-zero-updates", with_(finetune, "--updates", "0"), "--updates"),
    ("finetune-negative-block-len", with_(finetune, "--block-len", "-1"), "--block-len"),
    ("finetune-zero-grad-accum", with_(finetune, "--grad-accum", "0"), "--grad-accum"),
    # bench op
    ("bench-op-zero-size", with_(bench_op, "--sizes", "0"), "sizes"),
    ("bench-op-negative-size", with_(bench_op, "--sizes", "-64"), "sizes"),
    ("bench-op-zero-heads", with_(bench_op, "--heads-q", "0"), "--heads-q"),
    ("bench-op-heads-not-divisible", with_(bench_op, "--heads-q", "3", "--heads-kv", "2"), "heads"),
    ("bench-op-zero-batch", with_(bench_op, "--batch", "0"), "--batch"),
    ("bench-op-negative-head-dim", with_(bench_op, "--head-dim", "-8"), "--head-dim"),
    ("bench-op-unknown-dtype", with_(bench_op, "--dtypes", "fp8"), "dtypes"),
    # bench decode
    ("bench-decode-missing-model", with_(bench_decode, *MISSING_MODEL), "--model"),
    ("bench-decode-gpt2", with_(bench_decode, *GPT2), "--model"),
    ("bench-decode-layers-out-of-range", with_(bench_decode, "--layers", "7"), "--layers"),
    ("bench-decode-groups-other-model", with_(bench_decode, *GROUPS_OTHER), "--groups"),
    ("bench-decode-groups-empty", with_(bench_decode, *GROUPS_EMPTY), "--groups"),
    ("bench-decode-zero-size", with_(bench_decode, "--sizes", "0"), "--sizes"),
    ("bench-decode-zero-steps", with_(bench_decode, "--steps", "0"), "--steps"),
    ("bench-decode-zero-batch", with_(bench_decode, "--batch", "0"), "--batch"),
    # reproduce (its own error handling: the messages name the argument, not the option)
    ("reproduce-missing-model", with_(reproduce, *MISSING_MODEL), "name_or_path"),
    ("reproduce-wrong-data", with_(reproduce, *data("--data", "missing")), "no such data folder"),
    ("reproduce-empty-data", with_(reproduce, *data("--data", "empty_data")), "is empty"),
    ("reproduce-binary-data", with_(reproduce, *data("--data", "binary_data")), "not valid UTF-8"),
    ("reproduce-layers-out-of-range", with_(reproduce, "--layers", "7"), "layers"),
    ("reproduce-gpt2", with_(reproduce, *GPT2), "Llama/Qwen2/Mistral"),
    ("reproduce-zero-seq-len", with_(reproduce, "--calib-seq-len", "0"), "calib_seq_len"),
    ("reproduce-negative-n-boot", with_(reproduce, "--group-n-boot", "-1"), "group_n_boot"),
]


def snapshot(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()
    }


def previous_outputs(out: Path) -> dict[str, str]:
    """An --out directory holding results of an earlier run (as far as a failing command may see them)."""
    out.mkdir(parents=True)
    for name in ("summary.json", "results.json", "eval.json", "decode.json", "notes.md"):
        (out / name).write_text(f'{{"earlier": "{name}"}}\n')
    return snapshot(out)


def assert_one_error_line(result, expect: str | tuple[str, ...]) -> str:
    out = result.output
    assert result.exit_code != 0, out
    assert isinstance(result.exception, SystemExit), f"{type(result.exception).__name__}: {result.exception}"
    assert "Traceback" not in out, out
    errors = [line for line in out.splitlines() if line.startswith("Error")]
    assert len(errors) == 1, out
    assert all(e in errors[0] for e in ((expect,) if isinstance(expect, str) else expect)), errors[0]
    return errors[0]


@pytest.mark.parametrize("argv,expect", [pytest.param(a, e, id=i, marks=m) for i, a, e, *m in CASES])
def test_bad_input_gives_one_error_line(world, tmp_path, argv, expect):
    out = tmp_path / "out"
    before = previous_outputs(out)
    result = CliRunner().invoke(app, [str(a) for a in argv(world, out)])
    assert_one_error_line(result, expect)
    assert snapshot(out) == before, "the failed command changed --out"


def test_commands_all_covered():
    """Every command of `oal --help` (bench report aside: it takes only --out) has rows in the table."""
    import typer.main

    click_app = typer.main.get_command(app)
    names = {n for n in click_app.commands if n != "bench"} | {
        f"bench-{n}" for n in click_app.commands["bench"].commands
    }
    missing = [n for n in sorted(names - {"bench-report"}) if not any(c[0].startswith(n + "-") for c in CASES)]
    assert not missing


def test_valid_arguments_run(world, tmp_path):
    """The table's base command lines are valid (so each row fails for its own reason): two quick ones."""
    for argv in (generate, convert):
        result = CliRunner().invoke(app, [str(a) for a in argv(world, tmp_path / argv.__name__)])
        assert result.exit_code == 0, result.output


@pytest.mark.parametrize("argv,expect", [(with_(calibrate, *GROUPS_OTHER), "--groups")])
def test_end_to_end_process(world, tmp_path, argv, expect):
    """The same through a real `python -m oal` process: exit status 2, one error line on stderr, no traceback."""
    proc = subprocess.run(
        [*OAL, *map(str, argv(world, tmp_path / "out"))],
        env=subprocess_env(world),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    errors = [line for line in proc.stderr.splitlines() if line.startswith("Error")]
    assert len(errors) == 1 and expect in errors[0], proc.stderr
