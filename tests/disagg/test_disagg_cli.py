"""`m3sdk prefill-node`, the real daemon process: it serves over TLS with a shared token, a decode Engine
handshakes and prefills remotely through it, and so does `m3sdk serve --prefill-nodes` (its engine core in a process
of its own), clients without the right CA are refused, and SIGTERM drains it to a clean exit."""

from __future__ import annotations

import asyncio
import os
import selectors
import signal
import socket
import subprocess
import sys

import httpx
import pytest

pytest.importorskip("ucxx")

from server_process import Server  # noqa: E402

from m3sdk import Engine  # noqa: E402

PROMPT = [(5 * i + 2) % 251 + 1 for i in range(100)]
TOKEN = "cli-s3cret"


def self_signed(directory, name: str) -> tuple[str, str]:
    """(key, certificate) PEM paths of a fresh self-signed certificate for 127.0.0.1 (openssl CLI)."""
    key, cert = directory / f"{name}.key", directory / f"{name}.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", key, "-out", cert, "-days", "1", "-subj", f"/CN={name}",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    return str(key), str(cert)


def read_line(proc: subprocess.Popen, timeout: float) -> str:
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise TimeoutError("the prefill node printed nothing")
    return proc.stdout.readline()


def decode_engine(checkpoint, address: str | None = None, root: str | None = None) -> Engine:
    remote = dict(prefill_nodes=[address], remote_prefill_min_tokens=32, prefill_token=TOKEN,
                  prefill_tls_root_cert=root) if address else {}
    return Engine(model=str(checkpoint), device="cpu", kv_cache_memory=8 << 20, **remote)


async def generate(engine: Engine) -> list[int]:
    return (await engine.generate(PROMPT, temperature=0.0, max_tokens=8)).token_ids


def test_prefill_node_daemon_tls_token_and_sigterm_drain(engine_checkpoint, tmp_path):
    key, cert = self_signed(tmp_path, "node")
    _, other_ca = self_signed(tmp_path, "other")
    proc = subprocess.Popen(
        [sys.executable, "-m", "m3sdk.cli", "prefill-node", "--model", str(engine_checkpoint), "--device", "cpu",
         "--listen", "127.0.0.1:0", "--tls-cert", cert, "--tls-key", key],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        env={**os.environ, "M3SDK_PREFILL_TOKEN": TOKEN, "OMP_NUM_THREADS": "1"})
    try:
        line = read_line(proc, 120)
        assert "serving on 127.0.0.1:" in line, line
        address = line.split()[-1]

        async def run():
            async with decode_engine(engine_checkpoint) as engine:
                local = await generate(engine)
            async with decode_engine(engine_checkpoint, address, root=cert) as engine:
                assert await generate(engine) == local
                assert engine._admission.num_remote == 1
            # no TLS, or a CA that did not sign the node's certificate: the node is unreachable, prefill is local
            for root in (None, other_ca):
                async with decode_engine(engine_checkpoint, address, root=root) as engine:
                    assert not engine._admission.client.has_healthy_node
                    assert await generate(engine) == local
                    assert engine._admission.num_remote == 0
        asyncio.run(run())

        # the OpenAI-compatible server as the decode side, its token from the environment
        server = Server("--model", str(engine_checkpoint), "--device", "cpu", "--kv-cache-memory", str(8 << 20),
                        "--prefill-nodes", address, "--prefill-tls-root-cert", cert, "--remote-prefill-min-tokens",
                        "32", "--engine-process", env={"M3SDK_PREFILL_TOKEN": TOKEN})
        try:
            reply = httpx.post(server.base + "/v1/completions", timeout=120, json=dict(
                prompt=PROMPT, max_tokens=8, temperature=0.0)).json()

            async def local_text():
                async with decode_engine(engine_checkpoint) as engine:
                    return (await engine.generate(PROMPT, temperature=0.0, max_tokens=8)).text
            assert reply["choices"][0]["text"] == asyncio.run(local_text())
            assert server.metrics()["m3sdk:remote_prefills_total"] == 1.0
        finally:
            assert "Traceback" not in server.stop()

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_prefill_node_on_a_port_in_use_fails_at_once(engine_checkpoint):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "m3sdk.cli", "prefill-node", "--model", str(engine_checkpoint),
                               "--listen", f"127.0.0.1:{port}"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "serving" not in proc.stdout
    assert proc.stderr.strip().splitlines() == [f"m3sdk: error: cannot listen on 127.0.0.1:{port}: the port is in use"]
