"""The official `openai` client pointed at `m3sdk serve` (pip install 'm3sdk[server]' openai).

Against a running server:   m3sdk serve --port 8000 &   M3SDK_BASE_URL=http://127.0.0.1:8000/v1 python openai_client.py
With no M3SDK_BASE_URL, this script starts `m3sdk serve` on the bundled m3-tiny itself and stops it at the end.
"""

import os
import socket
import subprocess
import sys
import time

import openai


def start_server() -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "m3sdk.cli", "serve", "--port", str(port), "--log-level", "warning"])
    return proc, f"http://127.0.0.1:{port}/v1"


def wait_ready(client: openai.OpenAI, proc: subprocess.Popen | None) -> None:
    deadline = time.monotonic() + 180
    while True:
        try:
            client.models.list()
            return
        except openai.APIConnectionError:
            if (proc is not None and proc.poll() is not None) or time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def main() -> None:
    base_url = os.environ.get("M3SDK_BASE_URL")
    proc = None
    if base_url is None:
        proc, base_url = start_server()
    client = openai.OpenAI(base_url=base_url, api_key=os.environ.get("M3SDK_API_KEY", "none"), max_retries=0)
    try:
        wait_ready(client, proc)
        model = client.models.list().data[0].id
        messages = [{"role": "user", "content": "Tell me about Mr. Darcy."}]

        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=32, temperature=0)
        print("chat:", reply.choices[0].message.content)
        print("usage:", reply.usage.prompt_tokens, "prompt +", reply.usage.completion_tokens, "completion tokens")

        print("stream: ", end="")
        for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=32, temperature=0.8,
                                                    seed=1, stream=True):
            if chunk.choices:
                print(chunk.choices[0].delta.content or "", end="", flush=True)
        print()

        text = client.completions.create(model=model, prompt="It is a truth universally", max_tokens=16)
        print("completion:", text.choices[0].text)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)


if __name__ == "__main__":
    main()
