"""build_core: an EngineCore wired from an EngineConfig. Load the model (or launch the tensor-parallel ranks) and
the tokenizer, size the KV cache from the memory left, pick the scheduler, drafter, graphs and executor; on a GPU
warm it up."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from m3sdk.cache import CACHE_MANAGERS
from m3sdk.cache.kv_pool import KVCacheSpec
from m3sdk.cache.manager import CacheManager, cache_budget_bytes, num_pages_for_budget
from m3sdk.cache.page_pool import PAGE_SIZE, pages_for
from m3sdk.config import BUNDLED_MODELS, EngineConfig
from m3sdk.core.engine_core import EngineCore
from m3sdk.core.executor import Executor, OverlappedExecutor, SpeculativeExecutor
from m3sdk.core.hooks import StepObserver
from m3sdk.core.overlap import OverlapChoice
from m3sdk.core.resolved import ResolvedConfig, resolve
from m3sdk.core.warmup import warm_up
from m3sdk.graphs import DecodeGraphs, batch_buckets
from m3sdk.images import ImagePrompts
from m3sdk.model.config import ModelConfig
from m3sdk.model.dummy import dummy_model
from m3sdk.model.image_processor import ImageProcessor
from m3sdk.model.loader import load_model
from m3sdk.model.minimax_m3 import MiniMaxM3ForCausalLM
from m3sdk.model.vision_loader import load_vision_encoder, vision_config
from m3sdk.observability import get_logger
from m3sdk.runner import ModelRunner
from m3sdk.sampler import Sampler
from m3sdk.scheduler import SCHEDULERS
from m3sdk.speculative.base import SpeculativeDecoder, TargetInfo, build_drafter
from m3sdk.speculative.decoding import Speculation
from m3sdk.speculative.depth import DraftDepth
from m3sdk.tokenizer import Tokenizer
from m3sdk_kernels.arch import fp8_dtype

if TYPE_CHECKING:
    from m3sdk.parallel import TensorParallel

log = get_logger("m3sdk.core")

# a speculating engine captures graphs of these query lengths for steps where requests join (a prefix-cache hit's
# last page, a short prompt) when their logits take at most this much each (m3-tiny at 64 sequences: 8 and 32 MiB;
# a 200K vocabulary: 0.8 GiB and more, left out)
JOIN_QUERY_LENS = (PAGE_SIZE, 4 * PAGE_SIZE)
JOIN_GRAPH_LOGITS_BYTES = 256 << 20


def build_core(config: EngineConfig, observers: Sequence[StepObserver] = ()) -> EngineCore:
    """The engine core of `config`; `observers` see every step (the warm-up's too)."""
    rc = resolve(config)
    tp = None
    if config.tensor_parallel_size > 1:  # ranks 1.. run in worker processes that mirror every forward
        from m3sdk.parallel import TensorParallel

        if config.speculative is not None and config.speculative.method != "ngram":
            raise ValueError("tensor_parallel_size > 1 supports speculative='ngram' only (drafters read the "
                             "target's weights, which are sharded)")
        tp = TensorParallel.launch(rc.model_path, config.tensor_parallel_size, rc.device, rc.dtype,
                                   rc.attention_backend, config.expert_parallel, config.load_format, config.seed,
                                   config.quantization)
        model = tp.model
    elif config.load_format == "dummy":
        model = dummy_model(ModelConfig.from_pretrained(rc.model_path), rc.device, rc.dtype, rc.attention_backend,
                            quantization=config.quantization, seed=config.seed)
    else:
        model = load_model(rc.model_path, rc.device, rc.dtype, rc.attention_backend,
                           quantization=config.quantization, progress=config.show_progress)
    try:
        core = _assemble(rc, model, tp, observers)
    except BaseException:
        if tp is not None:  # else the workers outlive the error and the process group blocks the next engine
            tp.shutdown()
        raise
    if rc.device.type == "cuda":
        warm_up(core)
    return core


def _assemble(rc: ResolvedConfig, model: MiniMaxM3ForCausalLM, tp: TensorParallel | None,
              observers: Sequence[StepObserver]) -> EngineCore:
    config = rc.engine
    tokenizer = Tokenizer.from_pretrained(tokenizer_path(rc))
    cache, max_model_len = _cache(rc, model)
    rc = dataclasses.replace(rc, max_model_len=max_model_len)
    factory = config.scheduler
    if isinstance(factory, str):
        factory = SCHEDULERS.get(factory)
    images = _images(rc, tokenizer)
    scheduler = factory(cache, config, images)
    log.info("engine built", model=str(rc.model_path), device=str(rc.device), dtype=str(rc.dtype),
             pages=cache.num_pages, max_model_len=max_model_len)
    drafter = None
    if config.speculative is not None:
        drafter = build_drafter(config.speculative, TargetInfo(
            config=model.config, embed_tokens=model.embed_tokens, lm_head=model.lm_head,
            checkpoint=str(rc.model_path), device=rc.device, dtype=rc.dtype, model=model, kv_spec=cache.kv.spec,
            num_cache_pages=cache.num_pages, max_num_seqs=config.max_num_seqs, max_model_len=max_model_len))
    runner = ModelRunner(model, cache, rc.device, _graphs(rc, model, cache, tp, drafter), mirror=tp,
                         images=images)
    sampler = Sampler()
    if drafter is not None:
        buckets = batch_buckets(config.max_num_seqs)
        depth = DraftDepth(drafter.num_speculative_tokens, buckets, config.speculative.adaptive)
        # depth-0 steps as a plain engine's (overlapped or read first, measured), unless overlap is switched off
        plain = None
        if config.speculative.adaptive and config.overlap_scheduling is not False:
            plain = OverlappedExecutor(runner, scheduler, sampler,
                                       OverlapChoice(buckets) if config.overlap_scheduling is None else None,
                                       tuple(drafter.aux_layers))
        executor: Executor = SpeculativeExecutor(runner, scheduler, sampler,
                                                 Speculation(drafter, cache, sampler, depth), plain)
    elif rc.overlap:  # by default each step overlaps or reads first, whichever measured faster (core/overlap.py)
        choice = OverlapChoice(batch_buckets(config.max_num_seqs)) if config.overlap_scheduling is None else None
        executor = OverlappedExecutor(runner, scheduler, sampler, choice)
    else:
        executor = Executor(runner, scheduler, sampler)
    return EngineCore(rc, runner, scheduler, cache, tokenizer, executor, observers,
                      on_stop=[tp.shutdown] if tp is not None else [], tensor_parallel=tp)


def tokenizer_path(rc: ResolvedConfig) -> Path:
    """The checkpoint's tokenizer; a config-only folder served with dummy weights borrows the bundled m3-tiny's
    (its ids are valid inputs of any MiniMax-M3; generated ids past its vocabulary decode to no text)."""
    if rc.engine.load_format == "dummy" and not (rc.model_path / "tokenizer.json").is_file():
        log.info("no tokenizer.json beside the config: using the bundled m3-tiny tokenizer", model=str(rc.model_path))
        return BUNDLED_MODELS["m3-tiny"]
    return rc.model_path


def _images(rc: ResolvedConfig, tokenizer: Tokenizer) -> ImagePrompts | None:
    """Image prompts, when the checkpoint has a vision encoder and images are asked for (limit_images > 0). Under
    tensor parallel the encoder runs on rank 0's device alone, whole, and each image step's embeddings reach the
    other ranks with the step (TensorParallel.mirror). A decode engine with prefill_nodes and prefill_fallback
    "error" loads no encoder: its prefill nodes compute every image token."""
    if rc.engine.limit_images == 0:
        return None
    config = rc.engine
    encoder = None
    if config.prefill_nodes and config.prefill_fallback == "error":
        # a decode engine whose image prompts only prefill nodes compute: they encode the images, it needs no encoder
        vision = vision_config(rc.model_path)
        if vision is None:
            return None
        token = vision.image_token_id
    else:
        encoder = load_vision_encoder(rc.model_path, rc.device, rc.dtype, config.vision_encoder_quantization())
        if encoder is None:
            return None
        token = encoder.config.image_token_id
    return ImagePrompts(ImageProcessor.from_pretrained(rc.model_path), encoder, tokenizer, config.limit_images,
                        rc.device, token, config.image_fetcher, keep_files=bool(config.prefill_nodes))


def _cache(rc: ResolvedConfig, model: MiniMaxM3ForCausalLM) -> tuple[CacheManager, int]:
    """The KV cache as large as the budget allows (and useful), and the max_model_len it holds."""
    config, mc = rc.engine, model.config
    if config.max_model_len is not None and config.max_model_len > mc.max_position_embeddings:
        raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's "
                         f"max_position_embeddings {mc.max_position_embeddings}")
    max_model_len = config.max_model_len or mc.max_position_embeddings
    spec = KVCacheSpec.for_model(mc, 1, kv_dtype=rc.kv_cache_dtype, layout=rc.kv_cache_layout,
                                 index_dtype=rc.index_cache_dtype, fp8_dtype=fp8_dtype(rc.device),
                                 model_dtype=rc.dtype, device=rc.device)
    budget = cache_budget_bytes(config.kv_cache_memory, config.gpu_memory_fraction, rc.device)
    # one spare page per sequence: a sequence's pages round up
    useful = config.max_num_seqs * (pages_for(max_model_len) + 1)
    num_pages = num_pages_for_budget(spec.bytes_per_page, budget, useful)
    if num_pages < pages_for(max_model_len):
        if config.max_model_len is not None or num_pages < 1:
            raise ValueError(f"the KV cache budget ({budget} bytes, {num_pages} pages of {spec.bytes_per_page} "
                             f"bytes) cannot hold one sequence of max_model_len {max_model_len}: raise "
                             "kv_cache_memory or lower max_model_len")
        max_model_len = num_pages * PAGE_SIZE
        log.warning("max_model_len lowered to fit the KV cache", max_model_len=max_model_len)
    cache = CACHE_MANAGERS.get(config.cache_manager)(
        dataclasses.replace(spec, num_pages=num_pages), config.enable_prefix_caching)
    return cache, max_model_len


def _graphs(rc: ResolvedConfig, model: MiniMaxM3ForCausalLM, cache: CacheManager, tp: TensorParallel | None,
            drafter: SpeculativeDecoder | None) -> DecodeGraphs | None:
    """Captured decode (1 token) and, with a drafter, verify steps that return the aux states the drafter reads:
    1 + k tokens for every depth k an adaptive engine may choose (1 + k_max alone for a fixed one), and one and four
    pages' worth (a joining request's prefix-cache tail or short prompt: a step where one joins stays a graph
    step); the drafter's own steps too. Under tensor parallel the workers capture and replay the same graphs in lockstep
    (parallel/graphs.py)."""
    if not (rc.cuda_graphs and DecodeGraphs.supported(model)):
        return None
    query_lens: tuple[int, ...] = (1,)
    if drafter is not None:
        k = drafter.num_speculative_tokens
        query_lens = (*range(1, k + 2),) if rc.engine.speculative.adaptive else (1, 1 + k)
        # joins: a prefix-cache tail (one page) or a short prompt (up to four) with the running rows, where the
        # graph's float32 logits stay small
        query_lens += tuple(q for q in JOIN_QUERY_LENS if q > 1 + k and
                            rc.engine.max_num_seqs * q * model.config.vocab_size * 4 <= JOIN_GRAPH_LOGITS_BYTES)
    args = (model, cache.kv, rc.engine.max_num_seqs, rc.max_model_len, rc.device)
    kwargs = dict(query_lens=query_lens, aux_layers=drafter.aux_layers if drafter else ())
    if tp is None:
        graphs = DecodeGraphs(*args, **kwargs)
    else:
        from m3sdk.parallel import MirroredGraphs

        graphs = MirroredGraphs(tp, *args, **kwargs)
    if drafter is not None:
        drafter.capture_graphs(rc.engine.max_num_seqs)
    return graphs

