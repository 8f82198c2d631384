"""The `m3sdk` command: generate, chat, info, prefill-node.

Errors are one clear line on stderr and a non-zero exit, never a traceback (set M3SDK_DEBUG=1 for one)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import platform
import sys
from typing import Any

from .errors import M3Error


def _engine_overrides(args: argparse.Namespace) -> dict[str, Any]:
    overrides: dict[str, Any] = {"show_progress": sys.stderr.isatty()}
    for name in ("model", "device", "dtype", "max_model_len", "attention_backend", "kv_cache_dtype", "speculative",
                 "quantization"):
        value = getattr(args, name, None)
        if value is not None:
            overrides[name] = value
    return overrides


def _sampling_overrides(args: argparse.Namespace) -> dict[str, Any]:
    params: dict[str, Any] = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    if args.seed is not None:
        params["seed"] = args.seed
    if args.top_p is not None:
        params["top_p"] = args.top_p
    if args.top_k is not None:
        params["top_k"] = args.top_k
    return params


async def _generate(args: argparse.Namespace) -> None:
    from . import Engine

    async with Engine(**_engine_overrides(args)) as engine:
        if args.stream:
            async for chunk in engine.stream(args.prompt, **_sampling_overrides(args)):
                print(chunk.text, end="", flush=True)
            print()
        else:
            done = await engine.generate(args.prompt, **_sampling_overrides(args))
            print(done.text)


async def _chat(args: argparse.Namespace) -> None:
    from . import Engine

    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    async with Engine(**_engine_overrides(args)) as engine:
        print("m3sdk chat: an empty line or Ctrl-D ends the conversation.")
        while True:
            try:
                line = await asyncio.to_thread(input, "you> ")
            except EOFError:
                break
            if not line.strip():
                break
            messages.append({"role": "user", "content": line})
            print("assistant> ", end="", flush=True)
            reply = []
            async for chunk in engine.stream(list(messages), **_sampling_overrides(args)):
                print(chunk.text, end="", flush=True)
                reply.append(chunk.text)
            print()
            messages.append({"role": "assistant", "content": "".join(reply)})


async def _info(args: argparse.Namespace) -> None:
    import torch
    import triton

    from . import Engine

    print(f"python      {platform.python_version()} on {platform.machine()} ({platform.system()})")
    print(f"torch       {torch.__version__}   triton {triton.__version__}")
    if torch.cuda.is_available():
        kind = "HIP" if torch.version.hip else "CUDA"
        print(f"accelerator {torch.cuda.get_device_name(0)} x{torch.cuda.device_count()} ({kind})")
    else:
        print("accelerator none (CPU: torch reference kernels)")
    async with Engine(**_engine_overrides(args)) as engine:
        for key, value in engine.describe().items():
            print(f"{key:<11} {value}")


def _bench_module():
    from . import bench

    return bench


def _serve_prefill_node(args: argparse.Namespace) -> None:
    from .node import run_prefill_node

    logging.getLogger("m3sdk").setLevel(logging.INFO)  # a daemon says where it serves and why it stops
    run_prefill_node(args, _engine_overrides(args))


class _StderrHandler(logging.StreamHandler):
    """The command's log handler (a class of its own: main() adds it once however often it runs)."""


def _log_to_stderr() -> None:
    """The command's warnings (and a daemon's notices) on stderr: the library alone only has a NullHandler."""
    logger = logging.getLogger("m3sdk")
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        handler = _StderrHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("m3sdk: %(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.WARNING)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="m3sdk", description="Serve MiniMax-M3 models in-process.")
    sub = parser.add_subparsers(dest="command", required=True)

    def engine_options(p: argparse.ArgumentParser) -> None:
        p.add_argument("--model", help="checkpoint folder (default: the bundled m3-tiny)")
        p.add_argument("--device", choices=["auto", "cpu", "cuda"])
        p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"])
        p.add_argument("--max-model-len", type=int)
        p.add_argument("--attention-backend", choices=["auto", "torch", "triton"])
        p.add_argument("--kv-cache-dtype", choices=["auto", "bf16", "fp8"])
        p.add_argument("--quantization", choices=["none", "fp8", "mxfp4"],
                       help="quantize weights at load: fp8 attention/MLPs, mxfp4 also the experts")
        p.add_argument("--speculative", help='e.g. "ngram", "eagle3" or "eagle3:/path/to/head"')

    def sampling_options(p: argparse.ArgumentParser) -> None:
        p.add_argument("--max-tokens", type=int, default=64)
        p.add_argument("--temperature", type=float, default=0.0)
        p.add_argument("--top-p", type=float)
        p.add_argument("--top-k", type=int)
        p.add_argument("--seed", type=int)

    gen = sub.add_parser("generate", help="complete one prompt")
    gen.add_argument("prompt")
    gen.add_argument("--stream", action="store_true", help="print text as it is generated")
    engine_options(gen)
    sampling_options(gen)

    chat = sub.add_parser("chat", help="an interactive chat using the checkpoint's chat template")
    chat.add_argument("--system", help="a system message")
    engine_options(chat)
    sampling_options(chat)
    chat.set_defaults(temperature=0.7, max_tokens=256)

    info = sub.add_parser("info", help="platform, kernel backend, model summary, cache budget")
    engine_options(info)

    bench = sub.add_parser("bench", help="throughput and serving latency (TTFT, TPOT, ITL) of the embedded engine")
    engine_options(bench)
    _bench_module().add_arguments(bench)

    node = sub.add_parser("prefill-node", help="run a remote prefill node daemon")
    node.add_argument("--listen", default="127.0.0.1:50051", help="HOST:PORT of the gRPC service")
    node.add_argument("--tls-cert", help="PEM certificate chain: serve gRPC over TLS (with --tls-key)")
    node.add_argument("--tls-key", help="PEM private key of --tls-cert")
    node.add_argument("--insecure", action="store_true",
                      help="serve beyond loopback with neither a token ($M3SDK_PREFILL_TOKEN) nor TLS")
    # default None: messages.Limits' defaults (131072 tokens, 32 prefills, 120 s, 2 GiB, 10 s)
    node.add_argument("--max-prompt-tokens", type=int, help="longest prompt taken (lowered to what the KV cache holds)")
    node.add_argument("--max-in-flight", type=int, help="prefills held at once")
    node.add_argument("--max-deadline", type=float, help="seconds: a caller's later deadline is cut to this")
    node.add_argument("--max-message-bytes", type=int, help="largest KV data message")
    node.add_argument("--receiver-timeout", type=float,
                      help="seconds the decode side has to take the pages once the first token is computed")
    engine_options(node)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _log_to_stderr()
    try:
        if args.command == "generate":
            asyncio.run(_generate(args))
        elif args.command == "chat":
            asyncio.run(_chat(args))
        elif args.command == "info":
            asyncio.run(_info(args))
        elif args.command == "bench":
            asyncio.run(_bench_module().main_async(args, _engine_overrides(args)))
        else:
            _serve_prefill_node(args)
    except KeyboardInterrupt:
        return 130
    except (M3Error, OSError, ValueError, TypeError) as exc:
        if os.environ.get("M3SDK_DEBUG"):
            raise
        print(f"m3sdk: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
