"""Write m3-tiny-vl: a tiny random-weight MiniMax-M3 vision-language checkpoint for tests, examples and docs.

    python scripts/make_m3_tiny_vl.py OUT_DIR [--seed N]

The text model is the test oracle's (4 layers, hidden 64, vocab 256, MSA on layers 1-2), the vision tower is 2
layers of width 40 (heads of 20 dims: the 3D RoPE rotates 18 of them) with 14x14 patches and 2x2 merging, and the
image token is 250. Weights are random: the checkpoint exercises every code path, its outputs mean nothing. It is
written by transformers' MiniMaxM3SparseForConditionalGeneration.save_pretrained (the published MiniMax names),
with the byte-level tokenizer of the tests beside it. Needs the `oracle` extra (transformers).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from oracle import make_vl_checkpoint  # noqa: E402  (the tests' oracle builds it: one definition of the model)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(make_vl_checkpoint(args.out, args.seed))


if __name__ == "__main__":
    main()
