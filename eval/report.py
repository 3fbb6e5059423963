"""``report.json``, ``report.md`` and a self-contained ``report.html`` (figures inlined as base64 PNG).

All three open with one verdict line per configuration. The files are written
to a temporary directory beside the target and moved into place only once all
three exist, so an interrupted or failed run never leaves a report behind that
claims success.
"""

from __future__ import annotations

import base64
import html
import json
import os
import shutil
import tempfile
from pathlib import Path

from . import figures

__all__ = ["tables", "render_markdown", "render_html", "write_report"]


def _f(x, fmt="{:.4g}"):
    return "-" if x is None else fmt.format(x)


def _ci(ci, fmt="{:+.2f}"):
    return f"[{fmt.format(ci[0])}, {fmt.format(ci[1])}]"


def verdict_lines(r: dict) -> list[str]:
    out = []
    for label, v in r["verdicts"].items():
        a = r["accuracy"][label]
        if v["verdict"] == "BASELINE":
            out.append(f"BASELINE {label}: ppl {a['ppl']:.4f}")
            continue
        why = (
            "; ".join(v["reasons"])
            if v["reasons"]
            else ("within " + " and ".join(v["checked"]) + " thresholds" if v["checked"] else "no thresholds set")
        )
        out.append(
            f"{v['verdict']} {label}: ppl {a['ppl_delta_pct']:+.3f}% {_ci(a['ppl_delta_pct_ci95'])}, "
            f"KL {a['kl_mean']:.5f} ({why})"
        )
    if r.get("compare"):
        c = r["compare"]
        out.append(
            ("FAIL" if c["failed"] else "PASS") + f" compare: {len(c['flags'])} metric(s) worse "
            f"than the old report beyond its interval"
        )
    return out


def tables(r: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, header, rows) of every table, shared by the Markdown and HTML renderers."""
    base = r["baseline"]
    out = []
    rows = []
    for label, a in r["accuracy"].items():
        rows.append(
            [
                label,
                f"{a['ppl']:.4f}",
                f"{a['ppl_delta_pct']:+.3f}",
                _ci(a["ppl_delta_pct_ci95"], "{:+.3f}"),
                f"{a['kl_mean']:.5f}",
                f"{a['kl_p99']:.5f}",
                f"{100 * a['top1_agreement']:.2f}",
                r["verdicts"][label]["verdict"],
            ]
        )
    out.append(
        (
            f"Accuracy ({r['setup']['num_windows']} windows x {r['setup']['window']} tokens, "
            f"{r['setup']['dataset']}; KL and top-1 against {base})",
            ["config", "ppl", "Δppl %", "95% CI", "KL mean", "KL p99", "top-1 %", "verdict"],
            rows,
        )
    )
    rows = [
        [c["label"], c.get("cache", ""), " ".join(map(str, c.get("unquantized_layers", []))) or "-"]
        for c in r["configs"]
    ]
    out.append(
        (
            "KV cache per configuration (layers kept in the model dtype: skip flags or a checkpoint's auto-skip)",
            ["config", "cache layers", "unquantized layers"],
            rows,
        )
    )
    if base not in r["memory"]:  # the baseline is a server: no cache of its own to report
        return out  # (and servers are not timed)
    rows = []
    for label, m in r["memory"].items():
        b = r["memory"][base]
        rows.append(
            [
                label,
                str(m["kv_bytes_per_token"]),
                f"{m['kv_bytes_per_token'] / b['kv_bytes_per_token']:.3f}",
                str(m["max_concurrent_seqs"]),
                f"{m['max_concurrent_seqs'] / max(b['max_concurrent_seqs'], 1):.2f}",
            ]
        )
    m0 = r["memory"][base]
    out.append(
        (
            f"KV memory (budget {m0['kv_budget_bytes'] / 2**20:,.0f} MiB, sequences of {m0['memory_len']} tokens)",
            ["config", "KV bytes/token", "ratio", "max concurrent seqs", "ratio"],
            rows,
        )
    )
    if r.get("latency"):
        lat = r["latency"]
        lengths = list(lat[base]["ttft"])
        batches = list(lat[base]["decode_per_token"])
        header = (
            ["config"]
            + [f"TTFT {L} cold ms (×)" for L in lengths]
            + [f"TTFT {L} hit ms (×)" for L in lengths]
            + [f"decode b{b} ms/tok (×)" for b in batches]
        )
        rows = []
        for label, t in lat.items():

            def cell(d):
                return f"{d['median_ms']:.1f}" + (f" ({d['ratio']:.2f}×)" if "ratio" in d else "")

            rows.append(
                [label]
                + [cell(t["ttft"][L]["cold"]) for L in lengths]
                + [cell(t["ttft"][L]["prefix_hit"]) for L in lengths]
                + [cell(t["decode_per_token"][b]) for b in batches]
            )
        s = r["setup"]
        out.append(
            (
                f"Latency (median of {s['repeats']} interleaved repeats; × = ratio to {base}; decode: "
                f"{s['decode_prompt_len']}-token prompts, {s['decode_tokens']} tokens)",
                header,
                rows,
            )
        )
    if r.get("compare"):
        c = r["compare"]
        rows = [
            [
                f["config"],
                f["metric"],
                f["kind"],
                _f(f["old"]),
                _f(f["new"]),
                f"[{_f(f['old_interval'][0])}, {_f(f['old_interval'][1])}]",
            ]
            for f in c["flags"]
        ]
        out.append(
            (
                f"Compared with {c['source']} (same setup: {c['same_setup']}): metrics worse beyond the old interval",
                ["config", "metric", "kind", "old", "new", "old interval"],
                rows or [["-"] * 6],
            )
        )
    env = r["environment"]
    out.append(
        (
            "Environment",
            ["key", "value"],
            [[k, str(v)] for k, v in env.items()]
            + [
                ["model", f"{r['model']['name']} ({r['model']['path']}, sha256 {r['model']['fingerprint'][:16]})"],
                ["dataset", f"{r['setup']['dataset_source']} (text sha256 {r['setup']['dataset_sha256'][:16]})"],
            ],
        )
    )
    return out


def render_markdown(r: dict) -> str:
    lines = [f"# qkv eval: {r['model']['name']}", ""]
    lines += [f"- **{v}**" if v.startswith("FAIL") else f"- {v}" for v in verdict_lines(r)]
    lines += ["", f"Command: `{r['command']}`", ""]
    for title, header, rows in tables(r):
        lines += [f"## {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
        lines.append("")
    lines.append("Figures (perplexity delta, TTFT, per-layer K/V ranges) are in report.html.")
    return "\n".join(lines) + "\n"


_CSS = """body{font-family:system-ui,sans-serif;margin:24px;max-width:1300px;color:#222}
table{border-collapse:collapse;margin:8px 0 20px}td,th{border:1px solid #ccc;padding:4px 8px;font-size:14px}
th{background:#f0f0f0}td{text-align:right}td:first-child{text-align:left}
.PASS{color:#137333;font-weight:600}.FAIL{color:#c5221f;font-weight:700}.BASELINE{color:#555;font-weight:600}
img{max-width:100%;border:1px solid #ddd;margin:6px 0 18px}code{background:#f5f5f5;padding:2px 4px}
.kv td{text-align:left}"""


def render_html(r: dict, pngs: dict[str, bytes]) -> str:
    e = html.escape
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>qkv eval {e(r['model']['name'])}</title>",
        f"<style>{_CSS}</style></head><body><h1>qkv eval: {e(r['model']['name'])}</h1><ul>",
    ]
    for v in verdict_lines(r):
        word, _, rest = v.partition(" ")
        parts.append(f"<li><span class='{word}'>{e(word)}</span> {e(rest)}</li>")
    parts.append(f"</ul><p>Command: <code>{e(r['command'])}</code></p>")
    for title, header, rows in tables(r):
        cls = " class='kv'" if title == "Environment" else ""
        parts.append(f"<h2>{e(title)}</h2><table{cls}><tr>" + "".join(f"<th>{e(h)}</th>" for h in header) + "</tr>")
        for row in rows:
            parts.append(
                "<tr>"
                + "".join(
                    f"<td class='{c}'>{e(c)}</td>" if c in ("PASS", "FAIL", "BASELINE") else f"<td>{e(c)}</td>"
                    for c in row
                )
                + "</tr>"
            )
        parts.append("</table>")
        if title.startswith("Accuracy"):
            parts.append(_img(pngs["ppl_delta"], "perplexity delta per configuration"))
        if title.startswith("KV memory"):
            parts.append(
                "<h2>Per-layer K/V ranges (amax = scale × qmax)</h2>" + _img(pngs["scales"], "per-layer K and V amax")
            )
        if title.startswith("Latency"):
            parts.append(_img(pngs["ttft"], "TTFT vs prompt length"))
    if not r.get("latency"):
        parts.append("<h2>Latency</h2>" + _img(pngs["ttft"], "TTFT vs prompt length"))
    parts.append("</body></html>")
    return "\n".join(parts)


def _img(png: bytes, alt: str) -> str:
    return f"<div><img alt='{html.escape(alt)}' src='data:image/png;base64,{base64.b64encode(png).decode()}'></div>"


def write_report(r: dict, out_dir: str | Path) -> Path:
    """Render all three files in a temporary directory, then move each into ``out_dir`` (JSON last)."""
    out_dir = Path(out_dir)
    pngs = {
        "ppl_delta": figures.ppl_delta_figure(r["accuracy"], r["baseline"], r["gate"]["max_ppl_delta"]),
        "ttft": figures.ttft_figure(r.get("latency")),
        "scales": figures.scales_figure(r.get("scales") or {}),
    }
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        (tmp / "report.json").write_text(json.dumps(r, indent=1, allow_nan=False) + "\n")
        (tmp / "report.md").write_text(render_markdown(r))
        (tmp / "report.html").write_text(render_html(r, pngs))
        out_dir.mkdir(parents=True, exist_ok=True)
        for name in ("report.md", "report.html", "report.json"):  # the JSON, which tools read, last
            os.replace(tmp / name, out_dir / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
