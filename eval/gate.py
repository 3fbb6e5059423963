"""The regression gate: PASS/FAIL per configuration against thresholds, and ``--compare`` with an older report.

Thresholds (``--max-ppl-delta``, ``--max-kl``) apply to the point estimates of
the perplexity delta (percent) and the mean per-token KL. ``--compare OLD.json``
takes the same configurations (matched by label) from an earlier report of the
same model and report version and flags every metric whose new value lies
beyond the old value's interval on the worse side:

* accuracy (ppl, ppl delta, KL mean, KL p99, top-1 agreement): the old bootstrap 95% CI;
* memory (KV bytes per token, max concurrent sequences): exact, any change for the worse;
* latency (ratios to the baseline): the old min..max of per-repeat ratios.

Accuracy and memory flags fail the gate; latency flags only warn unless
``gate_latency`` is set, because CPU timings of a shared machine are noisy.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["REPORT_KIND", "REPORT_VERSION", "verdicts", "load_compare", "compare", "CompareError"]

REPORT_KIND = "qkv-eval-report"
REPORT_VERSION = 1


class CompareError(ValueError):
    """The ``--compare`` file cannot be compared with this run."""


def verdicts(accuracy: dict, baseline: str, max_ppl_delta: float | None, max_kl: float | None) -> dict:
    out = {}
    for label, a in accuracy.items():
        if label == baseline:
            out[label] = {"verdict": "BASELINE", "reasons": []}
            continue
        reasons = []
        if max_ppl_delta is not None and not a["ppl_delta_pct"] <= max_ppl_delta:
            reasons.append(f"ppl delta {a['ppl_delta_pct']:+.3f}% > {max_ppl_delta:g}%")
        if max_kl is not None and not a["kl_mean"] <= max_kl:
            reasons.append(f"mean KL {a['kl_mean']:.5f} > {max_kl:g}")
        checked = [n for n, v in (("ppl delta", max_ppl_delta), ("KL", max_kl)) if v is not None]
        out[label] = {"verdict": "FAIL" if reasons else "PASS", "reasons": reasons, "checked": checked}
    return out


def load_compare(path: str | Path, model: dict) -> dict:
    """Read an older report and refuse it unless it is a qkv eval report of this version and model."""
    path = Path(path)
    if path.is_dir():
        path = path / "report.json"
    if not path.is_file():
        raise CompareError(f"--compare {path}: no such report file")
    try:
        old = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CompareError(f"--compare {path}: not a JSON report ({e})") from None
    if not isinstance(old, dict) or old.get("kind") != REPORT_KIND:
        kind = old.get("kind") if isinstance(old, dict) else None
        raise CompareError(f"--compare {path}: not a qkv eval report (kind {kind!r})")
    if old.get("report_version") != REPORT_VERSION:
        raise CompareError(
            f"--compare {path}: report version {old.get('report_version')!r}, this qkv writes "
            f"version {REPORT_VERSION}; rerun the old configuration with this version"
        )
    old_model = old.get("model", {})
    if old_model.get("fingerprint") != model["fingerprint"]:
        raise CompareError(
            f"--compare {path}: that report is of model {old_model.get('name')!r} "
            f"(fingerprint {str(old_model.get('fingerprint'))[:12]}), this run is of "
            f"{model['name']!r} (fingerprint {model['fingerprint'][:12]}): refusing to compare"
        )
    return old


def _flag(flags, config, metric, old, new, interval, worse, kind):
    # a percentile bootstrap interval is computed apart from its point estimate and can miss it by an ulp (windows
    # that all score alike give a one-point interval one rounding away): a rerun that reproduces the old value bit
    # for bit is not worse, so the interval is widened to hold the old value itself
    lo, hi = min(interval[0], old), max(interval[1], old)
    bad = new > hi if worse == "higher" else new < lo
    if bad:
        flags.append(
            {"config": config, "metric": metric, "old": old, "new": new, "old_interval": [lo, hi], "kind": kind}
        )


def compare(new: dict, old: dict, gate_latency: bool = False) -> dict:
    """Flags of metrics that got worse beyond the old interval; ``failed`` when any gating flag is set."""
    flags: list[dict] = []
    common = [k for k in new["accuracy"] if k in old.get("accuracy", {})]
    setup_new = {k: new["setup"][k] for k in ("dataset_sha256", "num_windows", "window")}
    setup_old = {k: old.get("setup", {}).get(k) for k in setup_new}
    for label in common:
        a, o = new["accuracy"][label], old["accuracy"][label]
        for m, worse in (
            ("ppl", "higher"),
            ("ppl_delta_pct", "higher"),
            ("kl_mean", "higher"),
            ("kl_p99", "higher"),
            ("top1_agreement", "lower"),
        ):
            if m in o and f"{m}_ci95" in o:
                _flag(flags, label, m, o[m], a[m], o[f"{m}_ci95"], worse, "accuracy")
        mn, mo = new["memory"].get(label), old.get("memory", {}).get(label)
        if mn and mo:
            _flag(
                flags,
                label,
                "kv_bytes_per_token",
                mo["kv_bytes_per_token"],
                mn["kv_bytes_per_token"],
                (mo["kv_bytes_per_token"],) * 2,
                "higher",
                "memory",
            )
            if (mn["kv_budget_bytes"], mn["memory_len"]) == (mo["kv_budget_bytes"], mo["memory_len"]):
                _flag(
                    flags,
                    label,
                    "max_concurrent_seqs",
                    mo["max_concurrent_seqs"],
                    mn["max_concurrent_seqs"],
                    (mo["max_concurrent_seqs"],) * 2,
                    "lower",
                    "memory",
                )
        ln, lo_ = (new.get("latency") or {}).get(label), (old.get("latency") or {}).get(label)
        if ln and lo_:
            for L, t in ln["ttft"].items():
                for mode in ("cold", "prefix_hit"):
                    o_ = lo_["ttft"].get(L, {}).get(mode, {})
                    if "ratio" in t[mode] and "ratio_range" in o_:
                        _flag(
                            flags,
                            label,
                            f"ttft_{mode}_{L}_ratio",
                            o_["ratio"],
                            t[mode]["ratio"],
                            o_["ratio_range"],
                            "higher",
                            "latency",
                        )
            for b, d in ln["decode_per_token"].items():
                o_ = lo_["decode_per_token"].get(b, {})
                if "ratio" in d and "ratio_range" in o_:
                    _flag(
                        flags,
                        label,
                        f"decode_b{b}_ratio",
                        o_["ratio"],
                        d["ratio"],
                        o_["ratio_range"],
                        "higher",
                        "latency",
                    )
    gating = [f for f in flags if f["kind"] != "latency" or gate_latency]
    return {
        "against": old.get("created"),
        "configs_compared": common,
        "configs_missing": [k for k in old.get("accuracy", {}) if k not in new["accuracy"]],
        "same_setup": setup_new == setup_old,
        "setup_old": setup_old,
        "flags": flags,
        "failed": bool(gating),
    }
