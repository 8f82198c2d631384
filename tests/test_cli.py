"""The `m3sdk` command in real processes, on the bundled m3-tiny: text out, one-line errors, chat over stdin."""

import subprocess
import sys

import pytest


def m3sdk(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "m3sdk.cli", *args], capture_output=True, text=True, input=stdin,
                          timeout=300)


def test_generate_prints_text():
    proc = m3sdk("generate", "Once upon a time", "--max-tokens", "12", "--temperature", "0.7", "--seed", "1")
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.split()) >= 3
    assert proc.stderr == ""


def test_streamed_generation_equals_the_plain_one():
    args = ("generate", "The ball", "--max-tokens", "10", "--temperature", "0")
    assert m3sdk(*args).stdout == m3sdk(*args, "--stream").stdout


@pytest.mark.parametrize("args, message", [
    (("generate", "hi", "--model", "/nonexistent/ckpt"), "no config.json"),
    (("generate", "hi", "--temperature", "-1"), "temperature"),
    (("generate", "", "--max-tokens", "4"), "empty"),
    (("generate", "hi", "--max-tokens", "100000"), "max_model_len"),
])
def test_errors_are_one_line_and_nonzero(args, message):
    proc = m3sdk(*args)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("m3sdk: error:") and message in lines[0], proc.stderr


def test_info_names_backend_and_cache():
    proc = m3sdk("info")
    assert proc.returncode == 0, proc.stderr
    assert "backend     torch" in proc.stdout and "kv cache" in proc.stdout and "MSA" in proc.stdout


def test_chat_answers_over_stdin():
    proc = m3sdk("chat", "--max-tokens", "8", "--seed", "0", stdin="Hello there.\n\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("assistant>") == 1
