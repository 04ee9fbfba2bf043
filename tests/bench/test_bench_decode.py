"""`oal bench decode`: one point measured in this process on a tiny saved model, the sweep and its report."""

import json

import pytest
import torch
from tiny import tiny_causal_lm

from oal.bench.decode import DecodeConfig, markdown, round_speedups, run_point, run_sweep, synthetic_groups
from oal.ops.quadratic.cpu import PATH_FLAGS, path_flags


@pytest.fixture
def tiny_dir(tmp_path):
    model = tiny_causal_lm(
        vocab_size=64, num_heads=4, num_kv_heads=2, head_dim=8, layers=4, hidden_size=32, intermediate_size=48,
        max_position_embeddings=256,
    )  # fmt: skip
    model.save_pretrained(tmp_path / "tiny")
    return tmp_path / "tiny"


@pytest.fixture(autouse=True)
def _restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_synthetic_groups():
    g = synthetic_groups(3, 8)
    assert g.shape == (3, 8) and g[:, :6].eq(0).all() and g[:, 6:].eq(1).all()


@pytest.mark.parametrize("kernel", ["oal", "performer"])
def test_run_point_in_process(tiny_dir, kernel):
    config = DecodeConfig(model=str(tiny_dir), kernel=kernel, layers="1-2", steps=3, warmup=1)
    # 30 and 62 tokens: past the 25 tokens up to which oal keeps keys and values instead of its state (d = 8)
    small, large = run_point("converted", 30, config), run_point("converted", 62, config)
    original = run_point("original", 40, config)
    for p in (small, large, original):
        assert len(p["times_ms"]) == 3 and p["ms_per_token"] > 0 and p["peak_rss_mb"] > 0
        assert p["context_end"] == p["n"] + 4
        # glibc: freed heap kept inside the resident set, a part of it (None elsewhere)
        assert p["heap_kept_mb"] is None or 0 <= p["heap_kept_mb"] < p["peak_rss_mb"]
        assert p["run_peak_rss_mb"] >= p["peak_rss_mb"]  # over the prefill and the decode steps
        assert p["load_peak_rss_mb"] > 0 and isinstance(p["peak_from_prefill"], bool)
        assert p["first_call_s"] > 0  # the untimed 64-token first prompt
    # converted layers hold a fixed-size state; the two softmax layers grow by 32 tokens of keys and values
    kv_growth = 2 * 2 * 2 * 32 * 8 * 4  # layers × (k, v) × kv heads × tokens × head_dim × fp32 bytes
    assert large["cache_mb"] - small["cache_mb"] == pytest.approx(kv_growth / 2**20)
    assert original["cache_mb"] == pytest.approx(4 * 2 * 2 * 44 * 8 * 4 / 2**20)


def test_run_point_without_first_prompt(tiny_dir, monkeypatch):
    import oal.models

    calls = []
    real = oal.models.KernelCache

    def counted(model):  # every prompt gets a fresh cache: count the forwards through them
        calls.append(model)
        return real(model)

    monkeypatch.setattr(oal.models, "KernelCache", counted)
    config = DecodeConfig(model=str(tiny_dir), layers="1-2", steps=2, warmup=0, prompt_warmup=0)
    point = run_point("converted", 20, config)
    assert point["first_call_s"] is None and len(calls) == 1
    point = run_point("converted", 20, DecodeConfig(model=str(tiny_dir), layers="1-2", steps=2, warmup=0))
    assert point["first_call_s"] > 0 and len(calls) == 3  # the first prompt's cache, then the prefill's


def test_config_validation(tmp_path):
    with pytest.raises(ValueError, match="prompt_warmup: expected a non-negative integer"):
        DecodeConfig(prompt_warmup=-1)
    with pytest.raises(ValueError, match="steps: expected a positive integer"):
        DecodeConfig(steps=0)
    with pytest.raises(FileNotFoundError, match="groups: no such file"):
        DecodeConfig(groups=str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="device"):
        DecodeConfig(device="tpu")


def test_sweep_writes_json_and_markdown(tmp_path):
    def fake(method, n, config):
        if method == "converted" and n == 2048:
            return {"method": method, "n": n, "error": "killed by signal 9 (out of memory?)"}
        ms = 10.0 if method == "original" else 5.0
        return {"method": method, "n": n, "prefill_s": 1.5, "ms_per_token": ms, "tokens_per_s": 1000 / ms,
                "cache_mb": n / 100, "peak_rss_mb": 900.0, "decode_peak_mb": 2.0}  # fmt: skip

    seen = []
    config = DecodeConfig(prompt_warmup=0)
    doc = run_sweep(config, [2048, 1024], tmp_path, runner=fake, on_point=lambda p, i, t: seen.append((i, t)))
    assert seen == [(1, 4), (2, 4), (3, 4), (4, 4)]
    assert [(p["method"], p["n"]) for p in doc["points"]] == [
        ("original", 1024), ("converted", 1024), ("original", 2048), ("converted", 2048)
    ]  # fmt: skip
    assert json.loads((tmp_path / "decode.json").read_text()) == json.loads(json.dumps(doc))
    md = (tmp_path / "decode.md").read_text()
    assert md == markdown(doc)
    assert "after 2 warm-up steps.\n" in md and "-token first prompt" not in md  # prompt_warmup 0
    assert "| 1024 | converted | 1.50 | 5.00 | 200.0 | 10.2 | 900 | 2.0 | – | – |" in md  # no run peak, no kept heap
    assert "| 2048 | converted | failed: killed by signal 9 (out of memory?) |" in md
    with pytest.raises(ValueError, match="methods"):
        run_sweep(DecodeConfig(), [16], tmp_path, methods=("fast",), runner=fake)


def test_repeated_sweep_interleaves_rounds_and_reports_medians_and_ratios(tmp_path):
    order, ms = [], iter([10.0, 5.0, 30.0, 20.0, 4.0, 12.0, 1.0])

    def fake(method, n, config):
        order.append((method, n))
        if method == "converted" and n == 2048 and order.count(("converted", 2048)) == 1:
            return {"method": method, "n": n, "error": "killed by signal 9 (out of memory?)"}
        latency = next(ms)
        return {"method": method, "n": n, "prefill_s": latency / 10, "ms_per_token": latency,
                "tokens_per_s": 1e3 / latency, "cache_mb": 4.0 if method == "original" else 1.0,
                "peak_rss_mb": 1000.0 + latency, "decode_peak_mb": 0.0, "heap_kept_mb": latency / 2,
                "run_peak_rss_mb": 1000.0 + 2 * latency, "times_ms": [latency]}  # fmt: skip

    doc = run_sweep(DecodeConfig(), [1024, 2048], tmp_path, repeats=2, runner=fake)
    # whole sweeps one after the other, N ascending, both models of a size side by side, the second round's
    # models in reverse order
    first = [("original", 1024), ("converted", 1024), ("original", 2048), ("converted", 2048)]
    second = [("converted", 1024), ("original", 1024), ("converted", 2048), ("original", 2048)]
    assert order == first + second
    assert [r["round"] for r in doc["runs"]] == [0, 0, 0, 0, 1, 1, 1, 1]
    pts = {(p["method"], p["n"]): p for p in doc["points"]}
    # original at 1024 measured 10 then 4 (median 7); converted 5 then 20; converted 2048 failed once: 1 repeat
    assert pts[("original", 1024)]["ms_per_token"] == 7.0 and pts[("original", 1024)]["repeats"] == 2
    assert pts[("original", 1024)]["ms_per_token_range"] == [4.0, 10.0]
    assert pts[("converted", 1024)]["ms_per_token"] == 12.5 and pts[("converted", 1024)]["peak_rss_mb"] == 1012.5
    assert pts[("converted", 1024)]["heap_kept_mb"] == 6.25
    assert pts[("converted", 2048)]["ms_per_token"] == 12.0 and pts[("converted", 2048)]["repeats"] == 1
    assert pts[("original", 2048)]["ms_per_token"] == 15.5  # 30 and 1
    assert "times_ms" not in pts[("original", 1024)] and "round" not in pts[("original", 1024)]
    # each round's own ratios: 10 / 5 and 4 / 20 at 1024; at 2048 only round 1 has both (1 / 12)
    assert round_speedups(doc["runs"]) == {
        1024: {"prefill": pytest.approx([2.0, 0.2]), "decode": pytest.approx([2.0, 0.2])},
        2048: {"prefill": pytest.approx([1 / 12]), "decode": pytest.approx([1 / 12])},
    }
    md = (tmp_path / "decode.md").read_text()
    assert md == markdown(doc) and "median over 2 rounds" in md and "reversed every other round" in md
    assert "the timed prefill after an untimed 64-token first prompt." in md
    # 0.7 / 1.25 s, 7 / 12.5 ms, 1 / 4 MB, 1012.5 / 1007 MB, run peaks 1025 / 1014 MB, (1012.5 - 6.25) / (1007 - 3.5)
    # MB; the rounds' ratios beside the medians' where two rounds have both models (at 2048 one round has)
    assert "| 1024 | 0.56× (0.20–2.00) | 0.56× (0.20–2.00) | 0.25× | 1.005× | 1.011× | 1.003× |" in md
    assert "| 2048 | 1.29× | 1.29× | 0.25× | 0.997× | 0.993× | 0.998× |" in md
    with pytest.raises(ValueError, match="repeats: expected a positive integer"):
        run_sweep(DecodeConfig(), [16], tmp_path, repeats=0, runner=fake)


def test_the_report_names_the_cpu_flags_its_figures_depend_on(tmp_path):
    def fake(method, n, config):
        return {"method": method, "n": n, "prefill_s": 1.0, "ms_per_token": 2.0, "tokens_per_s": 500.0,
                "cache_mb": 1.0, "peak_rss_mb": 900.0, "decode_peak_mb": 1.0}  # fmt: skip

    doc = run_sweep(DecodeConfig(prompt_warmup=0), [64], tmp_path, runner=fake)
    assert doc["device"]["isa"] == list(path_flags())
    doc["device"].update(name="Some CPU", isa=["avx2", "fma", "amx_bf16"])
    assert "cpu (Some CPU; avx2, fma, amx_bf16), " in markdown(doc)
    doc["device"]["isa"] = []
    assert f"cpu (Some CPU; none of {', '.join(PATH_FLAGS)}), " in markdown(doc)
    del doc["device"]["isa"]  # a record from before the flags were kept
    assert "cpu (Some CPU), " in markdown(doc)
