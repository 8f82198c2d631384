"""Latency curves over concurrency: one `m3sdk bench` sweep (one loaded engine, a fixed concurrency per point),
its TTFT / TPOT / ITL medians and p99s printed as a table, and a PNG of them beside the JSON.

    PYTHONPATH=src python benchmarks/curves.py [--model DIR] [--concurrency 1,2,4,8,16,32,64] [--input-len 1024]
        [--output-len 128] [--prompts-per-stream 4] [--out DIR] [-- extra `m3sdk bench` options]

Each point runs max(8, prompts-per-stream x concurrency) requests of random token ids (EOS ignored, greedy), so
every point holds its concurrency for several waves, after a warm-up of 2 x the largest concurrency at once.
Writes OUT/curves.json (the bench's records), OUT/curves.md (the table) and OUT/curves.png (needs matplotlib:
`pip install m3sdk[bench]`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from m3sdk.bench_plot import curve_rows, format_table, plot_curves


def parse_args() -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="m3-tiny")
    p.add_argument("--concurrency", default="1,2,4,8,16,32,64")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--prompts-per-stream", type=int, default=4)
    p.add_argument("--out", type=Path, default=Path("."))
    args, extra = p.parse_known_args()
    return args, [a for a in extra if a != "--"]


def main() -> None:
    args, extra = parse_args()
    conc = [int(c) for c in args.concurrency.split(",")]
    counts = [max(8, args.prompts_per_stream * c) for c in conc]
    args.out.mkdir(parents=True, exist_ok=True)
    records_path = args.out / "curves.json"
    argv = [sys.executable, "-m", "m3sdk.cli", "bench", "--model", args.model, "--input-len", str(args.input_len),
            "--output-len", str(args.output_len), "--max-concurrency", ",".join(map(str, conc)),
            "--num-prompts", ",".join(map(str, counts)), "--max-num-seqs", str(max(conc)),
            "--metric-percentiles", "50,99", "--num-warmups", str(2 * max(conc)), "--json", str(records_path),
            *extra]
    print("$ m3sdk", " ".join(argv[3:]), flush=True)
    subprocess.run(argv, check=True)
    records = json.loads(records_path.read_text())
    rows = curve_rows(records if isinstance(records, list) else [records])
    table = format_table(rows)
    title = f"{Path(args.model).name}: {args.input_len} in / {args.output_len} out"
    (args.out / "curves.md").write_text(f"{title}\n\n{table}\n")
    print(f"\n{title}\n{table}")
    print("plot:", plot_curves(rows, args.out / "curves.png", title))


if __name__ == "__main__":
    main()
