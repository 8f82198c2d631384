"""How long the `m3sdk` command takes to answer without loading a model: --help, a subcommand's --help, and an
argument error, each in a fresh process (as a shell runs it), against `import torch` alone for scale.

    .venv/bin/python benchmarks/cli_startup.py [--repeats 5]

Prints a table of wall-clock times (min and median over the repeats) and whether torch was imported. The goal:
well under a second for all three, with no torch.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

# main() in a child that reports whether torch was imported once parsing ended
_PROBE = """
import sys
from m3sdk.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
print("torch" in sys.modules, file=sys.stderr)
"""

CASES = [
    ("m3sdk --help", ["-c", _PROBE, "--help"]),
    ("m3sdk bench --help", ["-c", _PROBE, "bench", "--help"]),
    ("m3sdk generate hi --top-p 2", ["-c", _PROBE, "generate", "hi", "--top-p", "2"]),
    ("python -c 'import torch' (scale)", ["-c", "import sys, torch; print(True, file=sys.stderr)"]),
]


def run(args: list[str]) -> tuple[float, bool]:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    return elapsed, proc.stderr.strip().splitlines()[-1] == "True"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="runs of each case (default: %(default)s)")
    args = parser.parse_args()
    print(f"{'command':<36} {'min s':>7} {'median s':>9}  torch imported")
    for name, argv in CASES:
        times, torch_loaded = [], False
        for _ in range(args.repeats):
            elapsed, torch_loaded = run(argv)
            times.append(elapsed)
        print(f"{name:<36} {min(times):>7.3f} {statistics.median(times):>9.3f}  {'yes' if torch_loaded else 'no'}")


if __name__ == "__main__":
    main()
