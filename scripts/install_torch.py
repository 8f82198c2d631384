"""Install torch into this interpreter's environment, the build that fits the machine (`make setup` runs it).

With an NVIDIA GPU (nvidia-smi on PATH): from pip's configured index, whose Linux torch is the CUDA build. Without
one: from --index, PyTorch's CPU wheel index by default (plain PyPI would bring the CUDA build and its CUDA
libraries, several GB, on a machine that cannot use them); point it at a mirror, or at a ROCm index on AMD. When
that index cannot be reached, torch comes from pip's configured index, and the script says which build that was.

    python scripts/install_torch.py torch==2.13.0 [--index URL]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import urllib.error
import urllib.request

CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def say(text: str) -> None:
    print(f"install_torch: {text}", flush=True)


def reachable(index: str, timeout_s: float = 10.0) -> str | None:
    """None if the index answers for torch, else why not."""
    try:
        with urllib.request.urlopen(index.rstrip("/") + "/torch/", timeout=timeout_s):
            return None
    except (urllib.error.URLError, OSError, ValueError) as e:
        return str(getattr(e, "reason", e))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("requirement", help="e.g. torch==2.13.0")
    parser.add_argument("--index", default=CPU_INDEX,
                        help="where torch comes from without an NVIDIA GPU; empty: pip's configured index "
                             f"(default: {CPU_INDEX})")
    args = parser.parse_args()
    pip = [sys.executable, "-m", "pip", "install", args.requirement]
    if shutil.which("nvidia-smi"):
        say(f"an NVIDIA GPU is present (nvidia-smi): {args.requirement} from pip's configured index, the CUDA build")
    elif not args.index:
        say(f"{args.requirement} from pip's configured index (no torch index given)")
    elif (why := reachable(args.index)) is None:
        say(f"no NVIDIA GPU: {args.requirement} from {args.index}")
        pip += ["--index-url", args.index]
    else:
        say(f"cannot reach {args.index} ({why}): {args.requirement} from pip's configured index instead. From plain "
            "PyPI on Linux that is the CUDA build (several GB); TORCH_INDEX=URL names a mirror of PyTorch's CPU "
            "wheels")
    say(" ".join(pip))
    code = subprocess.call(pip)
    if code == 0:
        landed = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__)"], capture_output=True,
                                text=True)
        say(f"torch {landed.stdout.strip() or '(cannot be imported)'} installed")
    return code


if __name__ == "__main__":
    sys.exit(main())
