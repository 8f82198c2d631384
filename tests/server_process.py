"""`m3sdk serve` in a process of its own, reached over real HTTP (the server tests' and the disagg tests')."""

import os
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, *args: str, env: dict[str, str] | None = None):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
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
