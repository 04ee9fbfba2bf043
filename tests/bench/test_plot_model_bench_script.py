"""benchmarks/plot_model_bench.py: the ratio table pairs each run's original and converted points, and the figure
gives each run one colour (its original dashed, its converted model solid)."""

from __future__ import annotations

import json

import matplotlib

matplotlib.use("Agg")


def _record(batch: int, points: list[tuple[str, int, float, float]]) -> dict:
    return {
        "config": {"batch": batch},
        "points": [
            {
                "method": m,
                "n": n,
                "prefill_s": 2.0,
                "ms_per_token": ms,
                "tokens_per_s": 1000 / ms,
                "cache_mb": mb,
                "peak_rss_mb": 900.0,
            }  # fmt: skip
            for m, n, ms, mb in points
        ],
    }


def test_table_pairs_points_and_plot_colours_runs(load_benchmark, tmp_path, monkeypatch):
    bench = load_benchmark("plot_model_bench")
    a = _record(1, [("original", 1024, 40.0, 45.0), ("converted", 1024, 20.0, 15.0), ("original", 2048, 80.0, 90.0)])
    b = _record(8, [("original", 1024, 100.0, 360.0), ("converted", 1024, 50.0, 120.0)])
    for name, doc in (("run_a", a), ("run_b", b)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "decode.json").write_text(json.dumps(doc))
    lines, draw = [], bench.plt.Axes.plot

    def spy(self, *args, **kw):
        lines.append((args[2], kw))
        return draw(self, *args, **kw)

    monkeypatch.setattr(bench.plt.Axes, "plot", spy)
    png, md = tmp_path / "m.png", tmp_path / "m.md"
    bench.main([str(png), str(md), str(tmp_path / "run_a" / "decode.json"), str(tmp_path / "run_b" / "decode.json")])
    rows = md.read_text().splitlines()[2:]
    assert len(rows) == 2  # 2048 has no converted point: no row
    assert rows[0].startswith("| run_a | 1 | 1024 | 2.00 / 2.00 | 1.00 | 40.0 / 20.0 | 2.00 | 25.0 / 50.0 |")
    assert "| 45.0 / 15.0 | 0.33 |" in rows[0]
    assert rows[1].startswith("| run_b | 8 | 1024 |") and "| 80.0 / 160.0 |" in rows[1]  # tokens/s of the batch
    styles = {(kw["label"], style, kw["color"]) for style, kw in lines}
    assert ("original (run_a, batch 1)", "--", "C0") in styles and ("converted (run_a, batch 1)", "-", "C0") in styles
    assert ("original (run_b, batch 8)", "--", "C1") in styles and ("converted (run_b, batch 8)", "-", "C1") in styles
    assert png.is_file()
