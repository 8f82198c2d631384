"""The `m3sdk` command: generate, chat, info, bench, serve, prefill-node.

Parsing imports neither torch nor the engine (each command imports them when it runs), so `--help` and a bad
argument answer at once. Arguments are checked in two passes before any model loads: ranges by argparse
(m3sdk/argtypes.py), then the sampling parameters and the engine configuration as the SDK itself checks them.
Exit codes: 0 done, 1 a failure while running, 2 a bad argument, 130 interrupted. Every error is one line on
stderr, never a traceback (set M3SDK_DEBUG=1 for one).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import platform
import sys
from typing import Any, NoReturn

from .argtypes import NON_NEGATIVE_INT, POSITIVE_INT, number
from .config import CACHE_DTYPES, DTYPES, LOAD_FORMATS, QUANTIZATIONS, VISION_QUANTIZATIONS, EngineConfig
from .errors import InvalidRequestError, M3Error
from .params import SamplingParams


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (its default adds the usage block)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _engine_overrides(args: argparse.Namespace) -> dict[str, Any]:
    overrides: dict[str, Any] = {"show_progress": sys.stderr.isatty()}
    for name in ("model", "device", "dtype", "max_model_len", "attention_backend", "kv_cache_dtype", "speculative",
                 "quantization", "vision_quantization", "load_format", "tensor_parallel_size", "expert_parallel"):
        value = getattr(args, name, None)
        if value is not None:
            overrides[name] = value
    return overrides


def _sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed)


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    if args.command == "serve":
        return _server_core(args, _bench_module().engine_config(args, _engine_overrides(args)))
    if args.command == "bench":
        return _bench_module().engine_config(args, _engine_overrides(args))
    return EngineConfig(**_engine_overrides(args))


def _server_core(args: argparse.Namespace, config: EngineConfig) -> EngineConfig:
    """`m3sdk serve` runs the engine core in a process of its own (its HTTP loop and the engine's steps then never
    take turns on one interpreter lock) unless told otherwise, by the flag or an --engine-arg, or the engine spans
    several GPUs, which that process does not run."""
    if args.engine_process is not None:
        return config.replace(engine_process=args.engine_process)
    if any(item.partition("=")[0] == "engine_process" for item in args.engine_arg):
        return config
    return config.replace(engine_process=config.tensor_parallel_size == 1)


async def _generate(args: argparse.Namespace, config: EngineConfig, params: SamplingParams) -> None:
    from .engine import Engine

    async with Engine(config) as engine:
        if args.echo:
            print(args.prompt, end="", flush=True)
        if args.stream:
            async for chunk in engine.stream(args.prompt, params):
                print(chunk.text, end="", flush=True)
            print()
        else:
            done = await engine.generate(args.prompt, params)
            print(done.text)


async def _chat(args: argparse.Namespace, config: EngineConfig, params: SamplingParams) -> None:
    from .engine import Engine
    from .tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(config.model_path())

    def prompt_tokens(messages: list[dict[str, str]]) -> int:  # as the engine counts a chat prompt
        return len(tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False))

    system = [{"role": "system", "content": args.system}] if args.system else []
    turns: list[dict[str, str]] = []  # user, assistant, user, ...: the oldest pair leaves first
    async with Engine(config) as engine:
        room = engine.max_model_len - params.max_tokens  # the reply needs its max_tokens inside the context
        print("m3sdk chat: an empty line or Ctrl-D ends the conversation.")
        while True:
            try:
                line = await asyncio.to_thread(input, "you> ")
            except EOFError:
                break
            if not line.strip():
                break
            turns.append({"role": "user", "content": line})
            dropped = 0
            while len(turns) > 1 and prompt_tokens(system + turns) > room:
                del turns[:2]
                dropped += 2
            if dropped:
                print(f"m3sdk chat: dropped the oldest {dropped} messages: the conversation outgrew the context "
                      f"({engine.max_model_len} tokens, {params.max_tokens} kept for the reply)", file=sys.stderr)
            try:
                chunks = engine.stream(system + turns, params)
            except InvalidRequestError as exc:  # this message alone is too long: the conversation goes on
                print(f"m3sdk chat: error: {exc}", file=sys.stderr)
                turns.pop()
                continue
            print("assistant> ", end="", flush=True)
            reply = []
            async for chunk in chunks:
                print(chunk.text, end="", flush=True)
                reply.append(chunk.text)
            print()
            turns.append({"role": "assistant", "content": "".join(reply)})


async def _info(args: argparse.Namespace, config: EngineConfig) -> None:
    import torch
    import triton

    from .engine import Engine

    rows = [("python", f"{platform.python_version()} on {platform.machine()} ({platform.system()})"),
            ("torch", f"{torch.__version__}   triton {triton.__version__}")]
    if torch.cuda.is_available():
        kind = "HIP" if torch.version.hip else "CUDA"
        rows.append(("accelerator", f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()} ({kind})"))
    else:
        rows.append(("accelerator", "none (CPU: torch reference kernels)"))
    rows += _plan_rows(args, config)
    if not args.plan_only:
        async with Engine(config) as engine:
            rows += list(engine.describe().items())
    width = max(len(key) for key, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")


def _plan_rows(args: argparse.Namespace, config: EngineConfig) -> list[tuple[str, str]]:
    """The memory plan of the model from its config.json alone, per GPU (m3sdk/model/memory.py)."""
    import torch

    from .model.config import ModelConfig
    from .model.memory import plan_memory

    gpu = args.gpu_memory * 10**9 if args.gpu_memory else (
        torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None)
    plan = plan_memory(
        ModelConfig.from_pretrained(config.model_path()), tensor_parallel_size=config.tensor_parallel_size,
        expert_parallel=config.expert_parallel, quantization=config.quantization,
        dtype=torch.float32 if config.dtype == "float32" else torch.bfloat16,
        kv_cache_dtype=config.kv_cache_dtype if config.kv_cache_dtype != "auto" else "bf16",
        index_cache_dtype=None if config.index_cache_dtype == "auto" else config.index_cache_dtype,
        device_memory=gpu, gpu_memory_fraction=config.gpu_memory_fraction)
    return [(f"plan: {key}", value) for key, value in plan.rows()]


def _bench_module():
    from . import bench

    return bench


def _serve(args: argparse.Namespace, config: EngineConfig) -> None:
    try:
        from .server.serve import event_loop_factory, serve
    except ImportError as e:
        raise ValueError(f"m3sdk serve needs the server extra: pip install 'm3sdk[server]' ({e})") from e
    api_key = args.api_key or os.environ.get("M3SDK_API_KEY") or None
    media = args.allowed_local_media_path
    if media is not None and not os.path.isdir(media):
        raise ValueError(f"--allowed-local-media-path {media!r} is not a folder")
    if config.engine_process:  # the reader thread that hands each step's chunks to the HTTP loop needs the lock
        from .core.process import SWITCH_INTERVAL_S

        sys.setswitchinterval(SWITCH_INTERVAL_S)
    if args.allow_image_urls:
        from .image_fetcher import HttpImageFetcher

        config = config.replace(image_fetcher=HttpImageFetcher(
            max_bytes=args.image_url_max_bytes, allowed_domains=args.allowed_media_domains))
    elif args.allowed_media_domains:
        raise ValueError("--allowed-media-domains applies with --allow-image-urls")
    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
        runner.run(serve(config, host=args.host, port=args.port, api_key=api_key,
                         model_names=args.served_model_name, log_level=args.log_level,
                         allowed_local_media_path=media))


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
    parser = _Parser(prog="m3sdk", description="Serve MiniMax-M3 models in-process.")
    sub = parser.add_subparsers(dest="command", required=True)

    def engine_options(p: argparse.ArgumentParser) -> None:
        g = p.add_argument_group("model and engine")
        g.add_argument("--model", help="checkpoint folder, or a bundled model's name (default: m3-tiny, bundled)")
        g.add_argument("--device", default="auto", metavar="{auto,cpu,cuda,cuda:N}",
                       help="where the model runs (default: auto = cuda when there is a GPU, else cpu)")
        g.add_argument("--dtype", choices=["auto", *DTYPES], default="auto",
                       help="weights and activations (default: auto = bfloat16 on a GPU, float32 on a CPU)")
        g.add_argument("--max-model-len", type=POSITIVE_INT, metavar="N",
                       help="context limit, prompt + reply (default: the checkpoint's, shrunk to fit the KV cache)")
        g.add_argument("--attention-backend", choices=["auto", "torch", "triton"], default="auto",
                       help="attention kernels (default: auto = triton on a GPU, torch on a CPU)")
        g.add_argument("--kv-cache-dtype", choices=CACHE_DTYPES, default="auto",
                       help="KV cache element type (default: auto = the model dtype)")
        g.add_argument("--quantization", choices=QUANTIZATIONS, default="none",
                       help="quantize weights at load: fp8 attention and MLPs, fp8_experts also the experts "
                            "in fp8, mxfp4 the experts in mxfp4 (default: none)")
        g.add_argument("--vision-quantization", choices=VISION_QUANTIZATIONS, default="auto",
                       help="the vision encoder's linears: auto and none = in the model dtype, fp8 = FP8 W8A8 "
                            "(default: auto)")
        g.add_argument("--load-format", choices=LOAD_FORMATS, default="auto",
                       help="dummy: random weights for the model's config.json alone, made on the device (for "
                            "memory and speed runs without a checkpoint; default: auto = the checkpoint's)")
        g.add_argument("--speculative", metavar="METHOD",
                       help='speculative decoding: "ngram", "mtp", "eagle3" or "eagle3:/path/to/head" (default: off)')

    def sampling_options(p: argparse.ArgumentParser) -> None:
        g = p.add_argument_group("sampling")
        g.add_argument("--max-tokens", type=POSITIVE_INT, default=64, metavar="N",
                       help="tokens to generate at most (default: %(default)s)")
        g.add_argument("--temperature", type=number(float, 0), default=0.0, metavar="T",
                       help="0 = greedy; higher = more random (default: %(default)s)")
        g.add_argument("--top-p", type=number(float, 0, 1, low_open=True), default=1.0, metavar="P",
                       help="nucleus sampling: keep the most likely tokens up to this probability mass "
                            "(default: %(default)s = off)")
        g.add_argument("--top-k", type=int, default=-1, metavar="K",
                       help="keep the K most likely tokens, -1 = off (default: %(default)s)")
        g.add_argument("--seed", type=NON_NEGATIVE_INT, metavar="S",
                       help="makes sampling reproducible (default: a fresh random seed)")

    gen = sub.add_parser("generate", help="complete one prompt", description="Complete one prompt.")
    gen.add_argument("prompt", help="the text to continue")
    gen.add_argument("--stream", action="store_true", help="print text as it is generated")
    gen.add_argument("--echo", action="store_true", help="print the prompt before its continuation")
    sampling_options(gen)
    engine_options(gen)

    chat = sub.add_parser("chat", help="an interactive chat using the checkpoint's chat template",
                          description="An interactive chat using the checkpoint's chat template. When the "
                                      "conversation outgrows the context, the oldest turns are dropped.")
    chat.add_argument("--system", help="a system message (default: none)")
    sampling_options(chat)
    engine_options(chat)
    chat.set_defaults(temperature=0.7, max_tokens=256)

    info = sub.add_parser("info", help="platform, kernel backend, model summary, memory plan, cache budget",
                          description="Platform, kernel backend, the memory plan per GPU (weights per rank, KV "
                                      "bytes, pages and 32K-token sequences that fit: from config.json alone, "
                                      "before loading), then the loaded engine's model summary and cache budget.")
    engine_options(info)
    p = info.add_argument_group("memory plan")
    p.add_argument("--tensor-parallel-size", "--tp", type=POSITIVE_INT, metavar="N",
                   help="plan (and load) over N GPUs (default: 1)")
    p.add_argument("--expert-parallel", action="store_true", default=None,
                   help="whole experts per rank instead of 1/N of every expert (default: off)")
    p.add_argument("--gpu-memory", type=number(float, 0, low_open=True), metavar="GB",
                   help="plan for GPUs of this many GB (default: this machine's GPU; none: no fit computed)")
    p.add_argument("--plan-only", action="store_true",
                   help="print the plan without loading the model (for configs too large for this machine)")

    bench = sub.add_parser("bench", help="throughput and serving latency (TTFT, TPOT, ITL) of the embedded engine",
                           description=_bench_module().__doc__.split("\n\n")[0])
    engine_options(bench)
    _bench_module().add_arguments(bench)

    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (needs the server extra)",
                           description="An OpenAI-compatible HTTP server over the engine (docs/server.md).")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s, loopback only)")
    serve.add_argument("--port", type=POSITIVE_INT, default=8000, help="TCP port to listen on (default: %(default)s)")
    serve.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 (default: $M3SDK_API_KEY, "
                       "else none)")
    serve.add_argument("--served-model-name", nargs="+", metavar="NAME",
                       help="names clients give as 'model' (default: the checkpoint folder's name)")
    serve.add_argument("--allowed-local-media-path", metavar="DIR",
                       help="let clients name image files under DIR in image parts (default: none; data URLs only)")
    serve.add_argument("--allow-image-urls", action="store_true",
                       help="fetch the http(s) image URLs clients send (default: refused; data URLs always work)")
    serve.add_argument("--allowed-media-domains", nargs="+", metavar="DOMAIN",
                       help="with --allow-image-urls: only these hosts and their subdomains (default: any)")
    serve.add_argument("--image-url-max-bytes", type=POSITIVE_INT, default=20 << 20,
                       help="with --allow-image-urls: the largest image fetched, in bytes (default: %(default)s)")
    serve.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                       help="the server's log verbosity on stderr (default: %(default)s)")
    serve.add_argument("--engine-process", action=argparse.BooleanOptionalAction,
                       help="run the engine core in a process of its own, so the HTTP loop and the engine's steps "
                       "do not share one interpreter lock (EngineConfig.engine_process; prefill nodes are reached "
                       "from that process; default: on, except with --tp > 1: the core then runs in the server's "
                       "process)")
    engine_options(serve)
    _bench_module().add_engine_arguments(serve)

    node = sub.add_parser("prefill-node", help="run a remote prefill node daemon",
                          description="A remote prefill node: prefills prompts for decode engines that list it in "
                                      "prefill_nodes. The shared token comes from $M3SDK_PREFILL_TOKEN.")
    node.add_argument("--listen", default="127.0.0.1:50051", metavar="HOST:PORT",
                      help="address of the gRPC service; a port in use is an error (default: %(default)s)")
    node.add_argument("--tls-cert", metavar="PEM", help="certificate chain: serve gRPC over TLS, with --tls-key "
                      "(default: plain gRPC)")
    node.add_argument("--tls-key", metavar="PEM", help="private key of --tls-cert (default: none)")
    node.add_argument("--insecure", action="store_true",
                      help="serve beyond loopback with neither a token ($M3SDK_PREFILL_TOKEN) nor TLS")
    # default None: messages.Limits' own defaults, named in the help
    node.add_argument("--max-prompt-tokens", type=int, metavar="N",
                      help="longest prompt taken, lowered to what the KV cache holds (default: 131072)")
    node.add_argument("--max-in-flight", type=int, metavar="N", help="prefills held at once (default: 32)")
    node.add_argument("--max-deadline", type=float, metavar="S",
                      help="seconds: a caller's later deadline is cut to this (default: 120)")
    node.add_argument("--max-message-bytes", type=int, metavar="B", help="largest KV data message (default: 2 GiB)")
    node.add_argument("--receiver-timeout", type=float, metavar="S",
                      help="seconds the decode side has to take the pages once the first token is computed "
                           "(default: 10)")
    node.add_argument("--max-image-bytes", type=int, metavar="B",
                      help="image file bytes one prefill may carry; 0 refuses images (default: 64 MiB; 0 without a "
                           "vision encoder)")
    engine_options(node)
    return parser


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    if isinstance(exc, M3Error | OSError | ValueError | TypeError) and text:
        return text
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _log_to_stderr()
    try:
        params = _sampling_params(args) if args.command in ("generate", "chat") else None
        config = _engine_config(args)
    except (M3Error, ValueError, TypeError) as exc:  # a bad argument, found before anything loads
        if os.environ.get("M3SDK_DEBUG"):
            raise
        parser.exit(2, f"m3sdk {args.command}: error: {_one_line(exc)}\n")
    try:
        if args.command == "generate":
            asyncio.run(_generate(args, config, params))
        elif args.command == "chat":
            asyncio.run(_chat(args, config, params))
        elif args.command == "info":
            asyncio.run(_info(args, config))
        elif args.command == "serve":
            _serve(args, config)
        elif args.command == "bench":
            asyncio.run(_bench_module().main_async(args, config))
        else:
            _serve_prefill_node(args)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - the command's last word is one line, whatever failed
        if os.environ.get("M3SDK_DEBUG"):
            raise
        print(f"m3sdk: error: {_one_line(exc)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
