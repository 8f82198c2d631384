"""`m3sdk bench`: offline throughput and serving-style load against the embedded Engine, in-process, or against an
OpenAI-compatible endpoint (--base-url: `m3sdk serve`, or a peer's server) on the same workload.

Requests come from random token ids (lengths drawn around --input-len / --output-len, spread by --range-ratio) or
from a prompt file. They arrive all at once (--request-rate inf: the offline throughput run) or as a Poisson
process (a rate; --burstiness < 1 is burstier, gamma-distributed gaps as vLLM draws them), optionally capped at
--max-concurrency requests in flight (fixed concurrency: rate inf + a cap). A comma list of rates or
concurrencies runs a sweep on one loaded engine.

Metrics are measured where an application sees them: on the event loop, at each streamed chunk. Their names
are vLLM's `benchmark_serving` names, so existing plotting and comparison scripts read the JSON:
  TTFT    send -> first chunk                       TPOT  (e2e - TTFT) / (output tokens - 1), per request
  ITL     gap between consecutive chunks            E2EL  send -> last chunk
  request/output/total-token throughput over the run's duration; goodput: requests/s meeting every SLO given
  (--slo-ttft-ms, --slo-tpot-ms, --slo-e2el-ms).
A chunk may carry several tokens when the consumer falls behind the engine (the Engine merges waiting deltas);
ITL counts one gap per chunk, as vLLM does for multi-token chunks, so mean ITL can exceed TPOT under load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from m3sdk.argtypes import NON_NEGATIVE_INT, POSITIVE_INT, byte_size, comma_list, number
from m3sdk.bench_metrics import compute_metrics, failure_reasons
from m3sdk.config import PREFILL_TOKEN_ENV, EngineConfig
from m3sdk.errors import M3Error
from m3sdk.params import SamplingParams

if TYPE_CHECKING:
    from m3sdk.engine import Engine

@dataclass(frozen=True)
class BenchRequest:
    prompt: str | list[int]
    prompt_len: int  # tokens (a file prompt's count comes back in its usage; this is the estimate until then)
    output_len: int


@dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0  # seconds
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    error: str = ""


def sample_lengths(rng: random.Random, mean: int, range_ratio: float, n: int) -> list[int]:
    """n lengths uniform in [mean * (1 - r), mean * (1 + r)], at least 1."""
    lo, hi = max(1, round(mean * (1 - range_ratio))), max(1, round(mean * (1 + range_ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def random_requests(num: int, input_len: int, output_len: int, range_ratio: float, vocab_size: int,
                    seed: int) -> list[BenchRequest]:
    """Prompts of uniform random token ids: no tokenizer round trip, no accidental prefix sharing."""
    rng = random.Random(seed)
    ins = sample_lengths(rng, input_len, range_ratio, num)
    outs = sample_lengths(rng, output_len, range_ratio, num)
    return [BenchRequest([rng.randrange(vocab_size) for _ in range(n)], n, m) for n, m in zip(ins, outs, strict=True)]


def file_requests(path: Path, num: int, output_len: int, range_ratio: float, seed: int) -> list[BenchRequest]:
    """Prompts from a file: JSON lines ({"prompt": str | [ids], "output_len": int?}) or one prompt per line.
    Cycled to `num` requests; a line without output_len gets one drawn like the random prompts'."""
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"{path} holds no prompts")
    rng = random.Random(seed)
    out = []
    for i in range(num):
        line = lines[i % len(lines)]
        item: dict[str, Any] = {"prompt": line}
        if path.suffix == ".jsonl":
            item = json.loads(line)
            if "prompt" not in item:
                raise ValueError(f"{path}: line {i % len(lines) + 1} has no 'prompt'")
        prompt = item["prompt"]
        n = item.get("output_len") or sample_lengths(rng, output_len, range_ratio, 1)[0]
        # a text prompt's token count is known only once tokenized: the engine reports it in the usage
        out.append(BenchRequest(prompt, len(prompt) if isinstance(prompt, list) else 0, int(n)))
    return out


async def arrivals(requests: Sequence[BenchRequest], rate: float, burstiness: float,
                   seed: int) -> AsyncIterator[BenchRequest]:
    """Yield requests at a Poisson rate (gamma gaps of shape `burstiness`, mean 1 / rate); all at once if inf."""
    rng = random.Random(seed)
    for i, request in enumerate(requests):
        if i and math.isfinite(rate):
            await asyncio.sleep(rng.gammavariate(burstiness, 1.0 / (rate * burstiness)))
        yield request


@dataclass(frozen=True)
class Arrival:
    """What one streamed delta told the client: `tokens` generated in it (0 for a usage-only message), and the
    token counts a final usage reports (the server's word overrides the client's count)."""

    tokens: int
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


class Target(Protocol):
    """What the load is sent to: the embedded engine (EngineTarget) or an OpenAI-compatible endpoint
    (m3sdk.bench_http.HTTPTarget). `stream` raises if the request fails or is aborted."""

    def stream(self, request: BenchRequest, params: SamplingParams) -> AsyncIterator[Arrival]: ...

    async def stats(self) -> dict[str, int] | None: ...


class EngineTarget:
    def __init__(self, engine: Engine):
        self.engine = engine

    async def stream(self, request: BenchRequest, params: SamplingParams) -> AsyncIterator[Arrival]:
        async for chunk in self.engine.stream(request.prompt, params, max_tokens=request.output_len):
            if chunk.finish_reason == "abort":
                raise RuntimeError("aborted by the engine")
            usage = chunk.usage
            yield Arrival(len(chunk.token_ids), usage.prompt_tokens if usage else None)

    async def stats(self) -> dict[str, int]:
        return self.engine.stats()


async def send(target: Target, request: BenchRequest, params: SamplingParams) -> RequestResult:
    """Stream one request, timing every delta on the event loop."""
    result = RequestResult(prompt_len=request.prompt_len)
    start = last = time.perf_counter()
    try:
        async for arrival in target.stream(request, params):
            now = time.perf_counter()
            if arrival.tokens:
                if result.output_len == 0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                result.output_len += arrival.tokens
                last = now
            if arrival.prompt_tokens is not None:
                result.prompt_len = arrival.prompt_tokens
            if arrival.completion_tokens is not None:
                result.output_len = arrival.completion_tokens
        result.latency = last - start
        result.success = result.output_len > 0
    except Exception as e:  # noqa: BLE001 - a failed request is a result, the run goes on
        result.error = f"{type(e).__name__}: {e}"
    return result


async def run_load(target: Target, requests: Sequence[BenchRequest], params: SamplingParams, rate: float = math.inf,
                   burstiness: float = 1.0, max_concurrency: int | None = None, seed: int = 0,
                   on_result: Callable[[RequestResult], None] | None = None) -> tuple[list[RequestResult], float]:
    """Send `requests` as the arrival process says; -> (results in request order, duration in seconds).
    `on_result` sees each result as its request ends."""
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def limited(request: BenchRequest) -> RequestResult:
        if limit is None:
            result = await send(target, request, params)
        else:
            async with limit:
                result = await send(target, request, params)
        if on_result is not None:
            on_result(result)
        return result

    start = time.perf_counter()
    tasks = [asyncio.create_task(limited(r)) async for r in arrivals(requests, rate, burstiness, seed)]
    results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - start


class Progress:
    """Requests done so far, on stderr: one line rewritten in place on a terminal, else a line every few seconds
    (and always the last)."""

    def __init__(self, label: str, total: int, every_s: float = 5.0):
        self.label, self.total, self.every_s = label, total, every_s
        self.done = self.failed = 0
        self.tty = sys.stderr.isatty()
        self.start = self.last = time.perf_counter()

    def __call__(self, result: RequestResult) -> None:
        self.done += 1
        self.failed += not result.success
        now = time.perf_counter()
        if self.done == self.total or now - self.last >= (0.2 if self.tty else self.every_s):
            self.last = now
            end = "\n" if self.done == self.total or not self.tty else ""
            print(f"\r{self.label}: {self.done}/{self.total} requests done, {self.failed} failed, "
                  f"{now - self.start:.1f} s", end=end, file=sys.stderr, flush=True)


# -- the command ---------------------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The bench options (the engine's --model, --device, ... come from the CLI's shared engine options).
    Values are range-checked here, when the command line is parsed."""
    rate = number(float, 0, low_open=True, allow_inf=True)
    t = p.add_argument_group("target")
    t.add_argument("--base-url", metavar="URL",
                   help="drive an OpenAI-compatible endpoint (e.g. http://127.0.0.1:8000/v1) through /completions "
                        "instead of the embedded engine; --model then only names the vocabulary of random prompts "
                        "(default: the embedded engine)")
    t.add_argument("--api-key", help="bearer key of --base-url (default: $OPENAI_API_KEY)")
    t.add_argument("--served-model", metavar="NAME",
                   help="the model name sent to --base-url (default: the first of its /models)")
    g = p.add_argument_group("workload")
    g.add_argument("--num-prompts", type=comma_list(POSITIVE_INT), default="64", metavar="N[,N...]",
                   help="requests per run; a comma list gives each sweep point its own count (default: %(default)s)")
    g.add_argument("--input-len", type=POSITIVE_INT, default=256, metavar="N",
                   help="mean prompt tokens of random prompts (default: %(default)s)")
    g.add_argument("--output-len", type=POSITIVE_INT, default=64, metavar="N",
                   help="mean generated tokens, EOS ignored (default: %(default)s)")
    g.add_argument("--range-ratio", type=number(float, 0, 0.999), default=0.0, metavar="R",
                   help="lengths uniform in [len*(1-R), len*(1+R)] (default: %(default)s = fixed)")
    g.add_argument("--prompt-file", type=Path, metavar="PATH",
                   help="prompts: .jsonl with 'prompt' (+ 'output_len') or text lines (default: random token ids)")
    g.add_argument("--request-rate", type=comma_list(rate), default="inf", metavar="R[,R...]",
                   help="requests/s of a Poisson process, inf = all at once; a comma list sweeps "
                        "(default: %(default)s)")
    g.add_argument("--burstiness", type=number(float, 0, low_open=True), default=1.0, metavar="B",
                   help="gamma shape of the gaps between arrivals, 1 = Poisson (default: %(default)s)")
    g.add_argument("--max-concurrency", type=comma_list(POSITIVE_INT), default=None, metavar="N[,N...]",
                   help="cap on requests in flight; a comma list sweeps; with rate inf: fixed concurrency "
                        "(default: no cap)")
    g.add_argument("--num-warmups", type=NON_NEGATIVE_INT, default=1, metavar="N",
                   help="requests run (and not measured) before the first point (default: %(default)s)")
    g.add_argument("--temperature", type=number(float, 0), default=0.0, metavar="T",
                   help="sampling temperature, 0 = greedy (default: %(default)s)")
    g.add_argument("--seed", type=NON_NEGATIVE_INT, default=0, metavar="S",
                   help="seed of the workload and of the arrivals (default: %(default)s)")
    m = p.add_argument_group("metrics")
    m.add_argument("--metric-percentiles", type=comma_list(number(float, 0, 100, low_open=True)), default="99",
                   metavar="P[,P...]", help="percentiles reported, e.g. 50,90,99 (default: %(default)s)")
    slo = number(float, 0, low_open=True)
    m.add_argument("--slo-ttft-ms", type=slo, metavar="MS", help="goodput SLO on time to first token (default: none)")
    m.add_argument("--slo-tpot-ms", type=slo, metavar="MS",
                   help="goodput SLO on time per output token (default: none)")
    m.add_argument("--slo-e2el-ms", type=slo, metavar="MS", help="goodput SLO on end-to-end latency (default: none)")
    m.add_argument("--json", type=Path, metavar="PATH",
                   help="write the results here, one object or a list for a sweep (default: not written)")
    m.add_argument("--save-detailed", action="store_true", help="add per-request lengths, TTFTs, ITLs, errors")
    add_engine_arguments(p)


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """Engine sizing options beyond the CLI's shared ones, read back by engine_config."""
    e = p.add_argument_group("engine sizing")
    e.add_argument("--max-num-seqs", type=POSITIVE_INT, metavar="N",
                   help="requests running at once (default: the engine's, 64)")
    e.add_argument("--max-num-batched-tokens", type=POSITIVE_INT, metavar="N",
                   help="tokens per engine step (default: the engine's, 2048)")
    e.add_argument("--kv-cache-memory", type=byte_size, metavar="BYTES",
                   help="KV cache bytes, suffix K/M/G allowed (default: the engine's budget)")
    e.add_argument("--tensor-parallel-size", "--tp", type=POSITIVE_INT, metavar="N",
                   help="GPUs, one process each (default: 1)")
    e.add_argument("--engine-arg", action="append", default=[], metavar="NAME=VALUE",
                   help="any EngineConfig field; VALUE parsed as JSON when it parses (repeatable; default: none)")
    r = p.add_argument_group("remote prefill (docs/disaggregation.md; the `ucx` extra)")
    r.add_argument("--prefill-nodes", nargs="+", metavar="HOST:PORT",
                   help="prefill nodes (`m3sdk prefill-node`) that compute long prompts; their shared token comes "
                        "from $M3SDK_PREFILL_TOKEN (default: none, every prompt is prefilled here)")
    r.add_argument("--remote-prefill-min-tokens", type=POSITIVE_INT, metavar="N",
                   help="prompts with at least N tokens to compute go to a node (default: the engine's, 512)")
    r.add_argument("--prefill-fallback", choices=["local", "error"],
                   help="when no node can take a prompt: prefill it here, or fail it (default: local)")
    r.add_argument("--prefill-tls-root-cert", metavar="PEM",
                   help="the CA certificate that signed the nodes' TLS certificates (default: plaintext gRPC)")


def engine_config(args: argparse.Namespace, base: dict[str, Any]) -> EngineConfig:
    overrides = dict(base)
    for name in ("max_num_seqs", "max_num_batched_tokens", "kv_cache_memory", "tensor_parallel_size",
                 "prefill_nodes", "remote_prefill_min_tokens", "prefill_fallback", "prefill_tls_root_cert"):
        if getattr(args, name, None) is not None:
            overrides[name] = getattr(args, name)
    if overrides.get("prefill_nodes") and os.environ.get(PREFILL_TOKEN_ENV):
        overrides["prefill_token"] = os.environ[PREFILL_TOKEN_ENV]  # a secret: never a command-line argument
    for item in args.engine_arg:
        name, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--engine-arg wants NAME=VALUE, got {item!r}")
        try:
            overrides[name] = json.loads(value)
        except json.JSONDecodeError:
            overrides[name] = value
    return EngineConfig(**overrides)


def _sweep(text: str | None, parse) -> list:
    return [None] if text is None else [parse(v) for v in str(text).split(",")]


def build_requests(args: argparse.Namespace, config: EngineConfig, num: int, seed: int) -> list[BenchRequest]:
    if args.prompt_file is not None:
        return file_requests(args.prompt_file, num, args.output_len, args.range_ratio, seed)
    from m3sdk.model.config import ModelConfig

    vocab = ModelConfig.from_pretrained(config.model_path()).vocab_size
    return random_requests(num, args.input_len, args.output_len, args.range_ratio, vocab, seed)


@asynccontextmanager
async def open_target(args: argparse.Namespace, config: EngineConfig) -> AsyncIterator[Target]:
    """An endpoint when --base-url is given, else the embedded engine, loaded from `config`."""
    if args.base_url:
        from m3sdk.bench_http import HTTPTarget

        async with HTTPTarget(args.base_url, args.api_key, args.served_model) as target:
            yield target
        return
    from m3sdk import Engine

    async with Engine(config) as engine:
        yield EngineTarget(engine)


async def run_bench(args: argparse.Namespace, config: EngineConfig) -> list[dict[str, Any]]:
    """Open the target once, warm it up, run every (rate, concurrency) point; -> one result dict per point."""
    percentiles = [float(p) for p in args.metric_percentiles.split(",")]
    slo = {k: v for k, v in (("ttft", args.slo_ttft_ms), ("tpot", args.slo_tpot_ms), ("e2el", args.slo_e2el_ms))
           if v is not None}
    params = SamplingParams(temperature=args.temperature, ignore_eos=True)
    points = [(rate, conc) for rate in _sweep(args.request_rate, float)
              for conc in _sweep(args.max_concurrency, int)]
    counts = _sweep(str(args.num_prompts), int)
    if len(counts) not in (1, len(points)):
        raise ValueError(f"--num-prompts has {len(counts)} values for {len(points)} sweep points")
    counts = counts * len(points) if len(counts) == 1 else counts
    out = []
    async with open_target(args, config) as target:
        if args.num_warmups:
            warm = build_requests(args, config, args.num_warmups, args.seed + 10_000)
            warm_results, _ = await run_load(target, warm, params)
            if not any(r.success for r in warm_results):  # the run would fail the same way: say why now
                raise M3Error(f"the warm-up requests failed: {next(iter(failure_reasons(warm_results)))}")
        for i, (rate, conc) in enumerate(points):
            requests = build_requests(args, config, counts[i], args.seed + i)
            before = await target.stats()
            progress = Progress(f"rate {rate:g}, concurrency {conc or '-'}", len(requests))
            results, duration = await run_load(target, requests, params, rate, args.burstiness, conc, args.seed,
                                               on_result=progress)
            after = await target.stats()
            metrics = compute_metrics(results, duration, percentiles, slo)
            if metrics["failed"]:
                metrics["failure_reasons"] = failure_reasons(results)
            record = {
                "backend": "openai-http" if args.base_url else "m3sdk", "model": config.model,
                "date": time.strftime("%Y%m%d-%H%M%S"),
                "num_prompts": len(requests), "request_rate": rate if math.isfinite(rate) else "inf",
                "burstiness": args.burstiness, "max_concurrency": conc,
                "input_len": args.input_len if args.prompt_file is None else None, "output_len": args.output_len,
                "range_ratio": args.range_ratio, **({"slo_ms": slo} if slo else {}), **metrics,
            }
            if args.base_url:
                record["base_url"] = args.base_url
            else:
                record.update(engine_steps=after["steps"] - before["steps"],
                              engine_preemptions=after["preemptions"] - before["preemptions"],
                              engine_config=_config_summary(config))
            if args.save_detailed:
                record.update(input_lens=[r.prompt_len for r in results], output_lens=[r.output_len for r in results],
                              ttfts=[r.ttft for r in results], itls=[r.itl for r in results],
                              errors=[r.error for r in results])
            out.append(record)
            print_result(record, percentiles)
    return out


def _config_summary(config: EngineConfig) -> dict[str, Any]:
    keep = ("device", "dtype", "max_num_seqs", "max_num_batched_tokens", "kv_cache_dtype", "attention_backend",
            "tensor_parallel_size", "cuda_graphs", "enable_prefix_caching")
    return {k: getattr(config, k) for k in keep if hasattr(config, k)}


def print_result(r: dict[str, Any], percentiles: Sequence[float]) -> None:
    conc = r["max_concurrency"] if r["max_concurrency"] is not None else "-"
    print(f"{'=' * 16} m3sdk bench: rate {r['request_rate']}, concurrency {conc} {'=' * 16}")
    rows = [("Successful requests", r["completed"]), ("Failed requests", r["failed"]),
            ("Duration (s)", r["duration"]), ("Total input tokens", r["total_input_tokens"]),
            ("Total generated tokens", r["total_output_tokens"]), ("Request throughput (req/s)",
                                                                   r["request_throughput"])]
    if "request_goodput" in r:
        rows.append(("Request goodput (req/s)", r["request_goodput"]))
    rows += [("Output token throughput (tok/s)", r["output_throughput"]),
             ("Total token throughput (tok/s)", r["total_token_throughput"])]
    for name, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E latency")):
        rows += [(f"Mean {label} (ms)", r[f"mean_{name}_ms"]), (f"Median {label} (ms)", r[f"median_{name}_ms"])]
        rows += [(f"P{p:g} {label} (ms)", r[f"p{p:g}_{name}_ms"]) for p in percentiles]
    for label, value in rows:
        print(f"{label:<36}{value:>14.2f}" if isinstance(value, float) else f"{label:<36}{value:>14}")
    reasons = list(r.get("failure_reasons", {}).items())
    for reason, n in reasons[:5]:
        print(f"Failed ({n}): {reason}")
    if len(reasons) > 5:
        print(f"Failed ({sum(n for _, n in reasons[5:])}): {len(reasons) - 5} other reasons (--json has them all)")
    sys.stdout.flush()


async def main_async(args: argparse.Namespace, config: EngineConfig) -> list[dict[str, Any]]:
    """Run the bench, write --json; raises M3Error when no request of some point succeeded."""
    results = await run_bench(args, config)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results[0] if len(results) == 1 else results, indent=1))
    if failed := [r for r in results if r["completed"] == 0]:
        reason = next(iter(failed[0]["failure_reasons"]))
        where = "" if len(results) == 1 else f" of {len(failed)} of the {len(results)} sweep points"
        raise M3Error(f"every request{where} failed, e.g. {reason}")
    return results
