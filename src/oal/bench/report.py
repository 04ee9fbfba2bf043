"""Report of an `oal bench op` result: Markdown table with ratios to SDPA and target checks, and a log-log plot."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .methods import METHODS
from .op import is_measured, write_atomic

REFERENCE = "sdpa"
SUBJECT = "oal"
#: (N, least SDPA/OAL time ratio) of the foundation issue; N = 4096 is parity.
SPEEDUP_TARGETS = ((4096, 1.0), (8192, 2.0), (16384, 4.0), (32768, 6.0))
#: OAL's time may grow at most this much from the first to the second N (linear would be 4×).
GROWTH_TARGET = (8192, 32768, 4.4)


@dataclass(frozen=True)
class Check:
    dtype: str
    status: str  # "PASS", "MISS" or "n/a"
    text: str

    def line(self) -> str:
        return f"- **{self.status}** {self.dtype}: {self.text}"


def _label(method: str) -> str:
    return METHODS[method].label if method in METHODS else method


def _by_method(doc: dict, dtype: str) -> dict[str, dict[int, dict]]:
    """``{method: {n: point}}`` for one dtype, all points (measured or not)."""
    table: dict[str, dict[int, dict]] = {}
    for p in doc["points"]:
        if p["dtype"] == dtype:
            table.setdefault(p["method"], {})[int(p["n"])] = p
    return table


def _dtypes(doc: dict) -> list[str]:
    order = {"fp32": 0, "bf16": 1, "fp16": 2}
    return sorted({p["dtype"] for p in doc["points"]}, key=lambda d: (order.get(d, 9), d))


def _ms(table: dict[str, dict[int, dict]], method: str, n: int) -> float | None:
    p = table.get(method, {}).get(n)
    return p["ms"] if p is not None and is_measured(p) else None


def target_checks(doc: dict) -> list[Check]:
    """PASS/MISS per target of the foundation issue, per dtype; ``n/a`` where a needed point is missing."""
    checks = []
    for dtype in _dtypes(doc):
        table = _by_method(doc, dtype)
        for n, least in SPEEDUP_TARGETS:
            ref, sub = _ms(table, REFERENCE, n), _ms(table, SUBJECT, n)
            goal = f"SDPA/OAL time at N={n} ≥ {least:g}" + (" (parity)" if least == 1.0 else "")
            if ref is None or sub is None:
                checks.append(Check(dtype, "n/a", f"{goal}: not measured"))
            else:
                ratio = ref / sub
                checks.append(Check(dtype, "PASS" if ratio >= least else "MISS", f"{goal}: {ratio:.2f}"))
        lo, hi, most = GROWTH_TARGET
        t_lo, t_hi = _ms(table, SUBJECT, lo), _ms(table, SUBJECT, hi)
        goal = f"OAL time growth N={lo}→{hi} ≤ {most:g}×"
        if t_lo is None or t_hi is None:
            checks.append(Check(dtype, "n/a", f"{goal}: not measured"))
        else:
            growth = t_hi / t_lo
            checks.append(Check(dtype, "PASS" if growth <= most else "MISS", f"{goal}: {growth:.2f}×"))
        pairs = [
            (n, table[REFERENCE][n], p)
            for n, p in sorted(table.get(SUBJECT, {}).items())
            if is_measured(p) and n in table.get(REFERENCE, {}) and is_measured(table[REFERENCE][n])
        ]
        goal = "OAL peak memory ≤ SDPA's at every measured N"
        if not pairs:
            checks.append(Check(dtype, "n/a", f"{goal}: not measured"))
        else:
            over = [
                f"N={n}: {p['peak_mb']:.1f} > {r['peak_mb']:.1f} MB" for n, r, p in pairs if p["peak_mb"] > r["peak_mb"]
            ]
            text = f"{goal}: " + ("; ".join(over) if over else f"holds at all {len(pairs)} N")
            checks.append(Check(dtype, "MISS" if over else "PASS", text))
    return checks


def _fmt(x: float | None, digits: int = 1) -> str:
    return "–" if x is None else f"{x:,.{digits}f}"


def _machine_lines(doc: dict) -> list[str]:
    m = doc["machine"] or {}
    dev = m.get("device", {})
    cfg = doc["config"]
    matmul = ", ".join(f"{d} {v['gflop_s']:.1f} GFLOP/s ({v['size']}³)" for d, v in sorted(m.get("matmul", {}).items()))
    cores = f", {dev.get('usable_cpus')} usable cores" if "usable_cpus" in dev else ""
    return [
        f"- Machine: {dev.get('name', '?')} ({dev.get('kind', cfg['device'])}{cores}), host `{m.get('host', '?')}`, "
        f"torch {m.get('torch', '?')} (BLAS {m.get('blas', '?')}), {cfg['threads']} threads",
        f"- Measured matmul: {matmul or '–'}; copy bandwidth {_fmt(m.get('copy_gb_s'))} GB/s",
        f"- Shape: B={cfg['batch']}, Hq={cfg['heads_q']}, Hkv={cfg['heads_kv']}, d={cfg['head_dim']}, "
        f"dv={cfg['value_dim']}; causal, forward only, torch.no_grad()",
        f"- Timing: median of {cfg['min_repeats']}–{cfg['max_repeats']} timed calls (≈{cfg['budget_s']:g} s per "
        f"point) after a cold call and {cfg['warmup']} warm-up call(s); each point in a fresh process",
        f"- Peak memory: {doc['definitions']['peak_mb']}",
    ]


def markdown(doc: dict) -> str:
    """The Markdown report: header (command, date, machine), target checks, and per dtype a summary
    (SDPA vs OAL) and a table of all methods with time ratios to SDPA, GFLOP/s and peak memory."""
    runs = doc["runs"]
    last = runs[-1] if runs else {"command": "", "date": ""}
    lines = [
        "# `oal bench op`: causal attention forward, runtime and peak memory",
        "",
        f"- Command: `{last['command']}`",
        f"- Date: {last['date']}" + (f" (results accumulated over {len(runs)} runs)" if len(runs) > 1 else ""),
        *_machine_lines(doc),
        "",
        "## Targets (OAL G=5 vs SDPA flash; reported, not asserted)",
        "",
        *(c.line() for c in target_checks(doc)),
    ]
    matmul = (doc["machine"] or {}).get("matmul", {})
    for dtype in _dtypes(doc):
        table = _by_method(doc, dtype)
        sizes = sorted({n for per in table.values() for n in per})
        peak = matmul.get(dtype, {}).get("gflop_s")
        lines += ["", f"## {dtype}", ""]
        if REFERENCE in table and SUBJECT in table:
            lines += [
                "| N | SDPA ms | OAL ms | SDPA/OAL | SDPA peak MB | OAL peak MB |",
                "|---:|---:|---:|---:|---:|---:|",
            ]
            for n in sizes:
                ref, sub = table[REFERENCE].get(n), table[SUBJECT].get(n)
                r_ms, s_ms = _ms(table, REFERENCE, n), _ms(table, SUBJECT, n)
                ratio = r_ms / s_ms if r_ms and s_ms else None
                r_mb = ref["peak_mb"] if ref and is_measured(ref) else None
                s_mb = sub["peak_mb"] if sub and is_measured(sub) else None
                lines.append(f"| {n} | {_fmt(r_ms)} | {_fmt(s_ms)} | {_fmt(ratio, 2)} | {_fmt(r_mb)} | {_fmt(s_mb)} |")
            lines.append("")
        pct = f" (% of the {peak:.1f} GFLOP/s {dtype} matmul)" if peak else ""
        lines += [
            f"All methods; ×SDPA is SDPA's time over the method's (> 1: faster than SDPA); GFLOP/s{pct}.",
            "",
            "| N | method | ms | ×SDPA | GFLOP/s | peak MB | inputs MB | note |",
            "|---:|---|---:|---:|---:|---:|---:|---|",
        ]
        for n in sizes:
            for method in sorted(table, key=lambda m: (m != REFERENCE, m != SUBJECT, m)):
                p = table[method].get(n)
                if p is None:
                    continue
                if not is_measured(p):
                    note = p.get("skipped") or f"error: {p.get('error')}"
                    lines.append(f"| {n} | {_label(method)} | – | – | – | – | – | {note} |")
                    continue
                r_ms = _ms(table, REFERENCE, n)
                gf = p.get("gflop_s")
                gf_txt = _fmt(gf) + (f" ({100 * gf / peak:.0f}%)" if gf is not None and peak else "")
                note = f"{p['repeats']} timed" + (
                    f"; memory blind below {p['blind_mb']:.1f} MB" if p.get("blind_mb") else ""
                )
                lines.append(
                    f"| {n} | {_label(method)} | {_fmt(p['ms'])} | {_fmt(r_ms / p['ms'] if r_ms else None, 2)} | "
                    f"{gf_txt} | {_fmt(p['peak_mb'])} | {_fmt(p['inputs_mb'])} | {note} |"
                )
    lines += ["", "FLOP counts: " + doc["definitions"]["gflop"] + ".", ""]
    return "\n".join(lines)


def plot(doc: dict, path: Path) -> None:
    """Two log-log panels against N: median runtime, and peak memory including the inputs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 4.6), constrained_layout=True)
    styles = {"fp32": ("-", "o"), "bf16": ("--", "s"), "fp16": (":", "^")}
    methods = sorted({p["method"] for p in doc["points"]}, key=lambda m: (m != REFERENCE, m != SUBJECT, m))
    colors = {m: f"C{i}" for i, m in enumerate(methods)}
    skipped = []
    for dtype in _dtypes(doc):
        table = _by_method(doc, dtype)
        line, marker = styles.get(dtype, ("-.", "x"))
        for method in methods:
            pts = [table[method][n] for n in sorted(table.get(method, {}))]
            good = [p for p in pts if is_measured(p)]
            skipped += [f"{method} {dtype} N={p['n']}" for p in pts if not is_measured(p)]
            if not good:
                continue
            kw = {"color": colors[method], "linestyle": line, "marker": marker, "label": f"{_label(method)} {dtype}"}
            ax_t.plot([p["n"] for p in good], [p["ms"] for p in good], **kw)
            ax_m.plot([p["n"] for p in good], [p["peak_total_mb"] for p in good], **kw)
    for ax, ylabel in ((ax_t, "median runtime (ms)"), (ax_m, "peak memory incl. inputs (MB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length N")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    cfg = doc["config"]
    dev = (doc["machine"] or {}).get("device", {}).get("name", cfg["device"])
    ax_t.set_title(f"forward, B={cfg['batch']} Hq={cfg['heads_q']} Hkv={cfg['heads_kv']} d={cfg['head_dim']}")
    ax_m.set_title(f"{dev}, {cfg['threads']} threads")
    ax_m.legend(fontsize=8, loc="upper left")
    if skipped:
        fig.text(0.01, 0.005, "not measured: " + ", ".join(skipped), fontsize=7, alpha=0.8)
    write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=130, format="png"))
    plt.close(fig)


def write_report(doc: dict, out_dir: Path) -> tuple[Path, Path]:
    """Write ``op.md`` and ``op.png`` beside ``op.json``; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    md, png = out_dir / "op.md", out_dir / "op.png"
    text = markdown(doc)
    write_atomic(md, lambda tmp: Path(tmp).write_text(text))
    plot(doc, png)
    return md, png
