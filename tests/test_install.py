"""Set-up as the README gives it: `make setup` into a fresh virtualenv, then which torch build landed there.

The fresh venv sees this environment's packages (a .pth file) so that pip finds torch and the rest installed and
downloads nothing: what runs for real is the Makefile, the choice of torch's index (scripts/install_torch.py) and
the editable install of this checkout."""

from __future__ import annotations

import functools
import http.server
import shutil
import subprocess
import sys
import sysconfig
import threading
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).parents[1]
TORCH = f"torch=={torch.__version__.split('+')[0]}"


def fresh_venv(tmp_path: Path) -> Path:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next((venv / "lib").glob("python3*/site-packages"))
    paths = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    # processed after the venv's own .pth files: the editable install made in the venv comes first on sys.path
    (site / "zz_outer_env.pth").write_text("".join(f"{p}\n" for p in paths))
    return venv


def install_torch(venv: Path, index: str) -> str:
    proc = subprocess.run([str(venv / "bin" / "python"), str(ROOT / "scripts" / "install_torch.py"), TORCH,
                           "--index", index], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def cpu_only() -> bool:
    return shutil.which("nvidia-smi") is None


@pytest.mark.skipif(not cpu_only(), reason="the CPU index is the choice of a machine without an NVIDIA GPU")
def test_torch_comes_from_the_cpu_index_when_it_answers(tmp_path):
    (tmp_path / "index" / "torch").mkdir(parents=True)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path / "index"))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        index = f"http://127.0.0.1:{server.server_address[1]}/"
        out = install_torch(fresh_venv(tmp_path), index)
    finally:
        server.shutdown()
    assert f"no NVIDIA GPU: {TORCH} from {index}" in out
    assert f"--index-url {index}" in out


@pytest.mark.slow
@pytest.mark.cpu_only  # the set-up of a machine without a GPU: the CPU wheel, or the fallback to pip's index
@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_setup_in_a_fresh_venv(tmp_path):
    venv = fresh_venv(tmp_path)
    # an index nobody answers on: the set-up says so and takes torch from pip's configured index
    proc = subprocess.run(["make", "-C", str(ROOT), "setup", f"VENV={venv}", f"PY={sys.executable}",
                           "TORCH_INDEX=http://127.0.0.1:9/cpu"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "cannot reach http://127.0.0.1:9/cpu" in proc.stdout and f"pip install {TORCH}" in proc.stdout
    assert " -q " not in proc.stdout.split("install_torch.py")[1]  # the big installs show pip's progress
    python = str(venv / "bin" / "python")
    probe = subprocess.run([python, "-c", "import torch, m3sdk; print(torch.__version__); print(m3sdk.__file__)"],
                           capture_output=True, text=True, check=True)
    version, location = probe.stdout.split()
    assert f"torch {version} installed" in proc.stdout
    if cpu_only():
        assert version.endswith("+cpu"), version  # the CPU build, not CUDA's
    assert Path(location).is_relative_to(ROOT / "src")  # the editable install of this checkout
    help_ = subprocess.run([str(venv / "bin" / "m3sdk"), "--help"], capture_output=True, text=True)
    assert help_.returncode == 0 and "generate" in help_.stdout
