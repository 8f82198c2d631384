"""The `m3sdk` command in real processes, on the bundled m3-tiny: text out, one-line errors with their exit codes,
parsing without torch, chat over stdin (also past the context), bench's progress and failures, info's table."""

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from m3sdk.cli import build_parser


def m3sdk(*args: str, stdin: str | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "m3sdk.cli", *args], capture_output=True, text=True, input=stdin,
                          timeout=300, env={**os.environ, **(env or {})})


def one_line_error(proc: subprocess.CompletedProcess, code: int, prefix: str = "m3sdk") -> str:
    assert proc.returncode == code, (proc.returncode, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(prefix) and ": error: " in lines[0], proc.stderr
    return lines[0]


# Parsing runs main() in a child that reports, as it exits, its exit code and whether torch was imported.
_PARSE_ONLY = """
import sys
from m3sdk.cli import main
try:
    main(sys.argv[1:])
except SystemExit as e:
    print("exit", e.code, "torch" in sys.modules, file=sys.stderr)
"""


def parse_only(*args: str) -> tuple[str, str, str]:
    proc = subprocess.run([sys.executable, "-c", _PARSE_ONLY, *args], capture_output=True, text=True, timeout=120)
    *lines, last = proc.stderr.strip().splitlines()
    return proc.stdout, "\n".join(lines), last


@pytest.mark.parametrize("args", [("--help",), ("generate", "--help"), ("chat", "--help"), ("info", "--help"),
                                  ("bench", "--help"), ("prefill-node", "--help")])
def test_help_imports_no_torch(args):
    out, _, last = parse_only(*args)
    assert last == "exit 0 False" and "usage: m3sdk" in out


@pytest.mark.parametrize("args, message", [
    (("generate", "hi", "--max-tokens", "-5"), "--max-tokens: want an int >= 1, got '-5'"),
    (("generate", "hi", "--top-p", "2"), "--top-p: want a number > 0 and <= 1, got '2'"),
    (("generate", "hi", "--temperature", "-1"), "--temperature"),
    (("chat", "--max-model-len", "0"), "--max-model-len"),
    (("info", "--kv-cache-dtype", "fp16"), "invalid choice"),
    (("bench", "--max-concurrency", "0"), "--max-concurrency: want an int >= 1, got '0'"),
    (("bench", "--max-concurrency", "4,0"), "--max-concurrency"),
    (("bench", "--num-prompts", "0"), "--num-prompts"),
    (("bench", "--request-rate", "-2"), "--request-rate"),
    (("bench", "--range-ratio", "1.5"), "--range-ratio"),
    (("bench", "--metric-percentiles", "50,101"), "--metric-percentiles"),
    (("bench", "--kv-cache-memory", "lots"), "--kv-cache-memory"),
    (("generate",), "prompt"),
    (("frobnicate",), "invalid choice"),
])
def test_argument_errors_are_one_line_exit_2_without_torch(args, message):
    _, err, last = parse_only(*args)
    assert last == "exit 2 False"
    assert len(err.splitlines()) == 1 and err.startswith("m3sdk") and message in err, err


@pytest.mark.parametrize("args, message", [
    (("generate", "hi", "--top-k", "0"), "top_k must be -1 (off)"),
    (("chat", "--top-k", "-2"), "top_k"),
    (("info", "--speculative", "bogus"), "speculative"),
    (("serve", "--prefill-nodes", "10.0.0.2"), "prefill_nodes must be a list of 'host:port' strings"),
])
def test_sampling_and_config_errors_come_before_the_model_loads(args, message):
    proc = m3sdk(*args)
    line = one_line_error(proc, 2, f"m3sdk {args[0]}: error:")
    assert message in line and "weights" not in proc.stdout


def _subcommand(name: str) -> argparse.ArgumentParser:
    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return subparsers.choices[name]


def test_serve_reaches_prefill_nodes_with_the_token_from_the_environment(monkeypatch):
    from m3sdk.cli import _engine_config

    args = build_parser().parse_args(["serve", "--prefill-nodes", "10.0.0.2:7000", "10.0.0.3:7000",
                                      "--remote-prefill-min-tokens", "256", "--prefill-fallback", "error"])
    monkeypatch.setenv("M3SDK_PREFILL_TOKEN", "s3cret")
    config = _engine_config(args)
    assert config.prefill_nodes == ("10.0.0.2:7000", "10.0.0.3:7000")
    assert (config.remote_prefill_min_tokens, config.prefill_fallback, config.prefill_token) == (256, "error", "s3cret")
    # without nodes the token is not taken up
    assert _engine_config(build_parser().parse_args(["serve"])).prefill_token is None


@pytest.mark.parametrize("argv, in_process", [
    ([], True), (["--no-engine-process"], False), (["--engine-process"], True), (["--tp", "2"], False),
    (["--engine-arg", "engine_process=false"], False)])
def test_serve_runs_the_core_in_a_process_of_its_own_unless_told_or_spread_over_gpus(argv, in_process):
    from m3sdk.cli import _engine_config

    config = _engine_config(build_parser().parse_args(["serve", *argv]))
    assert config.engine_process is in_process
    assert not _engine_config(build_parser().parse_args(["bench"])).engine_process  # an embedded engine: a thread


def test_serve_refuses_an_engine_process_over_several_gpus():
    from m3sdk.cli import _engine_config

    with pytest.raises(ValueError, match="engine_process does not run with tensor_parallel_size > 1"):
        _engine_config(build_parser().parse_args(["serve", "--engine-process", "--tp", "2"]))


def test_every_option_says_what_it_does_and_its_default():
    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in subparsers.choices.items():
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction) or not action.option_strings:
                continue
            assert action.help, f"m3sdk {name} {action.option_strings[0]} has no description"
            if action.nargs != 0:  # a flag's default is off
                assert "default" in action.help, f"m3sdk {name} {action.option_strings[0]} names no default"


def test_generate_prints_text():
    proc = m3sdk("generate", "Once upon a time", "--max-tokens", "12", "--temperature", "0.7", "--seed", "1")
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.split()) >= 3
    assert proc.stderr == ""


def test_streamed_and_echoed_generation_equal_the_plain_one():
    args = ("generate", "The ball", "--max-tokens", "10", "--temperature", "0")
    plain = m3sdk(*args).stdout
    assert m3sdk(*args, "--stream").stdout == plain
    assert m3sdk(*args, "--stream", "--echo").stdout == "The ball" + plain


@pytest.mark.parametrize("args, message", [
    (("generate", "hi", "--model", "/nonexistent/ckpt"), "no config.json"),
    (("generate", "", "--max-tokens", "4"), "empty"),
    (("generate", "hi", "--max-tokens", "100000"), "max_model_len"),
])
def test_failures_are_one_line_exit_1(args, message):
    assert message in one_line_error(m3sdk(*args), 1, "m3sdk: error:")


def test_debug_shows_the_traceback():
    proc = m3sdk("generate", "hi", "--model", "/nonexistent/ckpt", env={"M3SDK_DEBUG": "1"})
    assert proc.returncode == 1 and "Traceback" in proc.stderr and "no config.json" in proc.stderr


def test_info_rows_are_aligned():
    proc = m3sdk("info")
    assert proc.returncode == 0, proc.stderr
    rows = proc.stdout.splitlines()
    keys = {row.split("  ")[0] for row in rows}
    assert {"torch", "backend", "quantization", "kv cache"} <= keys
    # every value starts in one column: two spaces past the longest key
    column = max(len(k) for k in keys) + 2
    assert all(row[column - 2:column] == "  " and row[column] != " " for row in rows), proc.stdout
    assert "MSA" in proc.stdout and "max_model_len" in proc.stdout


def test_info_plans_the_full_model_without_loading_it():
    proc = m3sdk("info", "--model", "minimax-m3", "--plan-only", "--tp", "2", "--expert-parallel",
                 "--quantization", "mxfp4", "--kv-cache-dtype", "fp8", "--gpu-memory", "141")
    assert proc.returncode == 0, proc.stderr
    rows = dict(line.split("  ", 1) for line in proc.stdout.splitlines())
    assert rows["plan: parameters"].strip().startswith("426.2 B total, 23.5 B active")
    assert rows["plan: weights/rank"].strip().startswith("119.0")
    assert "concurrent sequences of 32768 tokens" in rows["plan: fits"] and "model" not in rows
    assert "no: the weights need" in m3sdk("info", "--model", "minimax-m3", "--plan-only", "--gpu-memory", "141").stdout


def test_chat_answers_over_stdin():
    proc = m3sdk("chat", "--max-tokens", "8", "--seed", "0", stdin="Hello there.\n\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("assistant>") == 1


def test_chat_drops_the_oldest_turns_past_the_context():
    line = "Tell me a story about a little fox who lived in the green forest near the river.\n"
    proc = m3sdk("chat", "--max-tokens", "8", "--seed", "0", "--max-model-len", "128", "--system", "Be brief.",
                 stdin=line * 6 + "\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("assistant>") == 6  # every turn answered
    dropped = [s for s in proc.stderr.splitlines() if "dropped the oldest" in s]
    assert dropped and all("128 tokens" in s for s in dropped), proc.stderr


def test_bench_reports_why_every_request_failed():
    proc = m3sdk("bench", "--num-prompts", "2", "--input-len", "2000", "--output-len", "4", "--num-warmups", "0")
    assert proc.returncode == 1
    progress, error = proc.stderr.strip().splitlines()
    assert "2/2 requests done, 2 failed" in progress
    assert error.startswith("m3sdk: error: every request failed, e.g. InvalidRequestError") and "max_model_len" in error
    assert "Failed (2): InvalidRequestError" in proc.stdout and "max_model_len" in proc.stdout


def test_bench_stops_when_the_warmup_fails():
    proc = m3sdk("bench", "--num-prompts", "2", "--input-len", "2000", "--output-len", "4")
    line = one_line_error(proc, 1, "m3sdk: error:")
    assert "warm-up requests failed" in line and "max_model_len" in line


def test_the_docs_and_the_command_offer_the_same_choices():
    root = Path(__file__).parents[1]
    options = {a.dest: a for a in _subcommand("generate")._actions}
    bullet = next(line for line in (root / "docs" / "engine.md").read_text().splitlines()
                  if line.startswith("- `kv_cache_dtype`"))
    assert set(re.findall(r"`(\w+)`", bullet.split("`kv_cache_layout`")[0])) - {"kv_cache_dtype"} == set(
        options["kv_cache_dtype"].choices)
    row = next(line for line in (root / "README.md").read_text().splitlines() if line.startswith("| `quantization`"))
    assert set(re.findall(r'"(\w+)"', row)) == set(options["quantization"].choices)
