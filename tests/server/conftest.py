"""One `m3sdk serve` process on the bundled m3-tiny for the module's tests, reached over real HTTP."""

import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

API_KEY = "test-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, *args: str):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "m3sdk.cli", "serve", "--port", str(self.port),
                                      "--log-level", "warning", *args], env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"m3sdk serve exited {self.proc.returncode}: {self.proc.stdout.read()}")
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.3)
        self.stop()
        raise RuntimeError("m3sdk serve did not come up in 240 s")

    def metrics(self) -> dict[str, float]:
        """The scraped Prometheus samples, name{labels} -> value."""
        text = httpx.get(self.base + "/metrics", timeout=10).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def stop(self) -> str:
        self.proc.terminate()
        try:
            out, _ = self.proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
        return out


@pytest.fixture(scope="package")
def server():
    """max_num_seqs 4 + max_waiting_requests 2: the seventh live request is refused (503)."""
    srv = Server("--api-key", API_KEY, "--max-num-seqs", "4", "--engine-arg", "max_waiting_requests=2",
                 "--served-model-name", "m3-tiny", "minimax-m3-tiny")
    yield srv
    out = srv.stop()
    assert "Traceback" not in out, out
