"""warm_up: serve a few synthetic requests through the real step loop before the engine thread starts, so that
the first users do not pay one-time costs.

On a GPU, Triton compiles a kernel variant the first time a shape class is launched (attention and indexer split
counts and integer specializations follow the batch, the query length and the context: a prompt whose prefix is
cached prefills a 16-token tail at a 512 context, a different variant from its first, whole prefill), cuBLAS picks
algorithms per shape and the pinned host pool fills. The vision encoder, where there is one, encodes three synthetic
images (its RoPE kernel compiles; with FP8 linears, `vision_quantization="fp8"`, their patch counts reach each FP8
GEMM tile table). Triton keeps what it compiled in its disk cache, so a later start on the same machine pays
milliseconds here.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from m3sdk.cache.page_pool import PAGE_SIZE, pages_for
from m3sdk.observability import get_logger
from m3sdk.params import SamplingParams

if TYPE_CHECKING:
    from m3sdk.core.engine_core import EngineCore
    from m3sdk.model.vision import VisionEncoder

log = get_logger("m3sdk.core")

# Concurrent prompts per warm-up wave: Triton specializes integer arguments (batch, token count) on divisibility by
# 16, and the attention split counts follow the batch (one prompt's 16-token tail at a 512 context splits its keys
# 2 ways on a dense layer and 16 on a sparse one on sm90; sixteen prompts' do not split), so 1, 3 and 16 differ.
WARM_UP_BATCHES = (1, 3, 16)
# Patch grids (t, h, w) of the encoder's warm-up images: 16, 256 and 1,156 patches (merge windows: 4, 64 and 289),
# so the tower's and the projector's GEMMs each meet the FP8 GEMM's decode (<= 16 rows), mid (<= 256) and prefill
# tile tables
ENCODER_WARM_UP_GRIDS = ((1, 4, 4), (1, 16, 16), (1, 34, 34))


def warm_up(core: EngineCore, prompt_len: int = 512, batches: Sequence[int] = WARM_UP_BATCHES) -> None:
    """The attention backend's compiles for long prompts (`compile_ahead`), then waves of 1, 3 and 16 concurrent
    prompts (as max_num_seqs and the cache allow), each twice: whole prompts,
    then the same prompts as prefix-cache hits, each decoding a few tokens in this engine's mode. Before the
    engine thread starts. The counters start from zero afterwards; the cache keeps the warm-up's pages as idle
    cached pages (free to take)."""
    t0 = time.perf_counter()
    if core.images is not None and core.images.encoder is not None:
        warm_up_encoder(core.images.encoder)
    model = core.runner.model
    model.attn_backend.compile_ahead(core.max_model_len, model.config.index_topk_blocks, core.runner.device)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    length = min(prompt_len, core.max_model_len - params.max_tokens) // PAGE_SIZE * PAGE_SIZE
    vocab = min(core.vocab_size, core.tokenizer.vocab_size)
    rng = random.Random(0)
    for b in sorted({min(b, core.config.engine.max_num_seqs) for b in batches}):
        if length < PAGE_SIZE or b * (pages_for(length + params.max_tokens) + 1) > core.cache.num_free_pages():
            continue
        # every other prompt a token shorter: a wave's token count is then not a multiple of 16 (another integer
        # specialization of every kernel that takes it, as most users' prompts are)
        prompts = [[rng.randrange(vocab) for _ in range(length - i % 2)] for i in range(b)]
        for again in range(2):
            requests = []
            for i, prompt in enumerate(prompts):
                request = core.new_request(f"m3sdk-warm-up-{b}-{again}-{i}", prompt, params,
                                           length + params.max_tokens)
                core.scheduler.add(request)
                requests.append(request)
            while core.executor.busy or not all(r.is_finished for r in requests):
                core.step()
    core.reset_stats()
    core.warm_up_seconds = time.perf_counter() - t0
    log.info("engine warmed up", seconds=round(core.warm_up_seconds, 2), prompt_len=length)


def warm_up_encoder(encoder: VisionEncoder) -> None:
    """One call per ENCODER_WARM_UP_GRIDS image, of random patches, on the encoder's device; nothing is kept."""
    device = encoder.embeddings.proj.weight.device
    g = torch.Generator(device=device).manual_seed(0)
    for grid in ENCODER_WARM_UP_GRIDS:
        t, h, w = grid
        encoder(torch.randn((t * h * w, encoder.config.patch_dim), generator=g, device=device, dtype=encoder.dtype),
                [grid])
