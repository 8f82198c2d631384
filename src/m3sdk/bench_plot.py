"""Latency curves of a `m3sdk bench` concurrency sweep: TTFT, TPOT and ITL (median and p99) against concurrency,
as a text table and a PNG. matplotlib (the optional `bench` extra) is imported only when a plot is drawn."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

METRICS = ("ttft", "tpot", "itl")
COLUMNS = tuple(f"{stat}_{m}_ms" for m in METRICS for stat in ("median", "p99"))


def curve_rows(records: Sequence[Mapping[str, Any]]) -> list[dict[str, float]]:
    """One row per sweep point of `m3sdk bench --json` records (fixed concurrency, percentiles including 99):
    concurrency, output tok/s and the median / p99 of each latency, sorted by concurrency."""
    rows = []
    for r in records:
        if r.get("max_concurrency") is None:
            raise ValueError("a curve point needs a fixed concurrency (--max-concurrency)")
        if "p99_ttft_ms" not in r:
            raise ValueError("a curve point needs the 99th percentile (--metric-percentiles with 99)")
        rows.append({"concurrency": r["max_concurrency"], "output_throughput": r["output_throughput"],
                     **{k: r[k] for k in COLUMNS}})
    return sorted(rows, key=lambda row: row["concurrency"])


def format_table(rows: Sequence[Mapping[str, float]]) -> str:
    """The rows as a Markdown table (ms; output tok/s)."""
    head = ["concurrency", *(c.replace("_ms", " ms").replace("_", " ") for c in COLUMNS), "output tok/s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [str(row["concurrency"]), *(f"{row[c]:.2f}" for c in COLUMNS), f"{row['output_throughput']:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_curves(rows: Sequence[Mapping[str, float]], path: Path, title: str = "") -> Path:
    """A PNG of TTFT, TPOT and ITL (median solid, p99 dashed) against concurrency (log2 axis), one panel each."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display is needed or wanted
    import matplotlib.pyplot as plt

    conc = [row["concurrency"] for row in rows]
    fig, axes = plt.subplots(1, len(METRICS), figsize=(5 * len(METRICS), 4), constrained_layout=True)
    for ax, metric in zip(axes, METRICS, strict=True):
        ax.plot(conc, [row[f"median_{metric}_ms"] for row in rows], "o-", label="median")
        ax.plot(conc, [row[f"p99_{metric}_ms"] for row in rows], "s--", label="p99")
        ax.set_xscale("log", base=2)
        ax.set_xticks(conc, [str(c) for c in conc])
        ax.set_xlabel("concurrency")
        ax.set_ylabel(f"{metric.upper()} ms")
        ax.grid(True, alpha=0.3)
        ax.legend()
    if title:
        fig.suptitle(title)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
