"""Eval reports: the DESIGN.md JSON shape plus a markdown table next to it (OUT with .md)."""

from __future__ import annotations

import json
import math
from pathlib import Path

MIB = 2**20


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:.0f}"
    return str(value)


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    """rows of dicts -> a GitHub markdown table with the given columns (missing keys shown as -)."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_cell(row.get(c)) for c in columns) + " |")
    return "\n".join(lines) + "\n"


def result_rows(results: dict, metric: str, reference: str | None = None) -> list[dict]:
    """One table row per policy: metric, KV bytes in MiB, ratio to ``reference``'s peak bytes."""
    rows = []
    ref = results.get(reference, {}).get("peak_kv_bytes") if reference else None
    for spec, r in results.items():
        row = {"policy": spec, metric: r.get(metric)}
        row["resolved"] = r.get("resolved_policy", spec)
        row["peak KV MiB"] = r["peak_kv_bytes"] / MIB
        row["mean KV MiB"] = r["mean_kv_bytes"] / MIB
        if ref:
            row[f"x less than {reference}"] = ref / max(r["peak_kv_bytes"], 1)
        rows.append(row)
    return rows


def write_report(out: str | Path, payload: dict, markdown: str) -> tuple[Path, Path]:
    """Write ``payload`` as JSON to ``out`` and ``markdown`` to ``out`` with suffix .md."""
    out = Path(out)
    if out.parent and not out.parent.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=1) + "\n")
    md = out.with_suffix(".md")
    md.write_text(markdown)
    return out, md


def header(title: str, command: str | None, payload: dict) -> str:
    """Markdown preamble: title, the command that produced it, model and token count."""
    lines = [f"# {title}", ""]
    if command:
        lines += ["```", command, "```", ""]
    lines.append(f"model: `{payload.get('model')}`, tokens: {payload.get('tokens')}")
    return "\n".join(lines) + "\n\n"
