"""Image prompts through the whole engine, held against transformers' MiniMax-M3 VL model (fp32, CPU): greedy
tokens with one image, two images of different sizes, batched with text-only requests, after a prefix-cache hit
and with chunks that cut through an image; two prompts that differ only in their image share no image page."""

import asyncio
import io

import pytest
import torch
from oracle import ORACLE_IMAGE_TOKEN, image_features, load_vl_oracle, make_vl_checkpoint

from m3sdk import Engine
from m3sdk.errors import InvalidRequestError
from m3sdk.model.image_processor import ImageProcessor

Image = pytest.importorskip("PIL.Image")
MAX_TOKENS = 8
IMG = ORACLE_IMAGE_TOKEN


@pytest.fixture(scope="module")
def vl_checkpoint(tmp_path_factory):
    return make_vl_checkpoint(tmp_path_factory.mktemp("vl"))


@pytest.fixture(scope="module")
def vl_oracle(vl_checkpoint):
    return load_vl_oracle(vl_checkpoint)


def png(h: int, w: int, seed: int) -> bytes:
    rgb = torch.randint(0, 256, (h, w, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    buf = io.BytesIO()
    Image.frombytes("RGB", (w, h), rgb.numpy().tobytes()).save(buf, format="PNG")
    return buf.getvalue()


A, B, C = png(100, 150, 0), png(60, 90, 1), png(100, 150, 2)  # 20, 6 and 20 image tokens


def engine(checkpoint, **overrides) -> Engine:
    config = dict(model=str(checkpoint), device="cpu", dtype="float32", max_model_len=128, max_num_seqs=8,
                  max_num_batched_tokens=32, kv_cache_memory=1 << 22)
    return Engine(**{**config, **overrides})


def expand(ids: list[int], images: list[bytes]) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """transformers' inputs: the placeholders expanded, pixel_values, image_grid_thw."""
    proc = ImageProcessor()
    done = [proc.process(i) for i in images]
    out, k = [], 0
    for t in ids:
        if t == IMG:
            out += [IMG] * done[k].num_tokens
            k += 1
        else:
            out.append(t)
    grids = [d.grid_thw for d in done]
    return out, proc.patches([d.pixels for d in done], grids), torch.tensor(grids)


def transformers_agrees(oracle, ids: list[int], images: list[bytes], output: list[int]) -> None:
    """Teacher-forced: transformers' argmax at every step is the engine's token. The image features go in by
    position (inputs_embeds), since the model may also generate the image token id."""
    full, pixels, grid = expand(ids, images)
    with torch.no_grad():
        embeds = oracle.get_input_embeddings()(torch.tensor([full + output]))
        features = image_features(oracle, pixels, grid)
        positions = [i for i, t in enumerate(full) if t == IMG]
        embeds[0, positions] = features
        logits = oracle(inputs_embeds=embeds).logits[0]
    assert logits[len(full) - 1:-1].argmax(-1).tolist() == output


async def greedy(e: Engine, prompt) -> list[int]:
    c = await e.generate(prompt, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    return c.token_ids


ONE = [5, 6, 7, IMG, 40, 41, 42]
TWO = [9, IMG, 10, 11, IMG, 12]


async def test_one_and_two_images_match_transformers(vl_checkpoint, vl_oracle):
    async with engine(vl_checkpoint, enable_prefix_caching=False) as e:
        one = await greedy(e, {"prompt_token_ids": ONE, "images": [A]})
        two = await greedy(e, {"prompt_token_ids": TWO, "images": [A, B]})
    transformers_agrees(vl_oracle, ONE, [A], one)
    transformers_agrees(vl_oracle, TWO, [A, B], two)


async def test_text_prompt_with_placeholder(vl_checkpoint):
    async with engine(vl_checkpoint) as e:
        by_text = await greedy(e, {"prompt": "ab]<]image[>[cd", "images": [B]})
        ids = e._running_core().tokenizer.encode("ab") + [IMG] + e._running_core().tokenizer.encode(
            "cd", add_special_tokens=False)
        by_ids = await greedy(e, {"prompt_token_ids": ids, "images": [B]})
    assert by_text == by_ids


async def test_batched_with_text_and_chunks_through_images(vl_checkpoint, vl_oracle):
    """Chunks of 8 tokens cut both 20-token images; text-only requests share the steps."""
    text = [[3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [20, 21, 22]]
    async with engine(vl_checkpoint, max_num_batched_tokens=8, enable_prefix_caching=False) as e:
        outs = await asyncio.gather(greedy(e, {"prompt_token_ids": TWO, "images": [A, B]}),
                                    greedy(e, text[0]), greedy(e, {"prompt_token_ids": ONE, "images": [C]}),
                                    greedy(e, text[1]))
    async with engine(vl_checkpoint, enable_prefix_caching=False) as e:
        alone = [await greedy(e, t) for t in text]
    transformers_agrees(vl_oracle, TWO, [A, B], outs[0])
    transformers_agrees(vl_oracle, ONE, [C], outs[2])
    assert [outs[1], outs[3]] == alone


async def test_prefix_cache_keys_pages_by_image(vl_checkpoint, vl_oracle):
    prefix = list(range(30, 50))  # 20 text tokens: page 0 holds text only, page 1 starts with text then image
    prompt = prefix + [IMG] + [60, 61, 62, 63]  # 20 + 20 + 4 = 44 tokens: 2 full pages
    async with engine(vl_checkpoint) as e:
        first = await e.generate({"prompt_token_ids": prompt, "images": [A]}, max_tokens=MAX_TOKENS,
                                 temperature=0, ignore_eos=True)
        again = await e.generate({"prompt_token_ids": prompt, "images": [A]}, max_tokens=MAX_TOKENS,
                                 temperature=0, ignore_eos=True)
        other = await e.generate({"prompt_token_ids": prompt, "images": [C]}, max_tokens=MAX_TOKENS,
                                 temperature=0, ignore_eos=True)
        # the second request recomputed image tokens past the cached pages from the encoder-output cache
        assert e._running_core().images.num_encoded == 2
    assert first.token_ids == again.token_ids
    assert again.usage.cached_prompt_tokens == 32  # both full pages, the image's included
    assert other.usage.cached_prompt_tokens == 16  # the text page only: the image page differs by content
    assert other.token_ids != first.token_ids
    transformers_agrees(vl_oracle, prompt, [A], again.token_ids)
    transformers_agrees(vl_oracle, prompt, [C], other.token_ids)


async def test_bad_image_requests_are_refused_before_queueing(vl_checkpoint, tmp_path):
    async with engine(vl_checkpoint, limit_images=2) as e:
        cases = [
            ({"prompt_token_ids": ONE, "images": [b"garbage"]}, "could not be decoded"),
            ({"prompt_token_ids": TWO, "images": [A, b"garbage"]}, "could not be decoded"),  # decoded in threads
            ({"prompt_token_ids": ONE, "images": [A, B]}, "1 image placeholders"),
            ({"prompt_token_ids": [IMG, IMG, IMG], "images": [A, A, A]}, "at most 2"),
            ({"prompt_token_ids": ONE, "images": ["http://example.com/a.png"]}, "remote image URLs"),
            ({"prompt_token_ids": [IMG] * 2 + [5], "images": [png(900, 900, 3), A]}, "context holds"),
            ({"prompt_token_ids": ONE, "images": [A], "extra": 1}, "prompt mapping"),
        ]
        for prompt, match in cases:
            with pytest.raises(InvalidRequestError, match=match):
                await e.generate(prompt, max_tokens=2)
        assert len(await greedy(e, {"prompt_token_ids": ONE, "images": [A]})) == MAX_TOKENS  # still serving


async def test_text_only_engine_refuses_images(vl_checkpoint):
    async with engine(vl_checkpoint, limit_images=0) as e:
        assert e._running_core().images is None
        with pytest.raises(InvalidRequestError, match="takes no images"):
            await e.generate({"prompt_token_ids": ONE, "images": [A]}, max_tokens=2)
        assert len(await greedy(e, [5, 6, 7])) == MAX_TOKENS


async def test_preemption_recomputes_image_tokens(vl_checkpoint):
    """Six image prompts in a cache of 8 pages: requests are preempted and their images' tokens recomputed."""
    prompts = [{"prompt_token_ids": [3 + i] + ONE, "images": [A if i % 2 else C]} for i in range(6)]
    async with engine(vl_checkpoint, enable_prefix_caching=False) as e:
        reference = [await greedy(e, p) for p in prompts]
    page_bytes = 4 * 2 * 2 * 16 * 16 * 4 + 2 * 16 * 16 * 4
    async with engine(vl_checkpoint, kv_cache_memory=8 * page_bytes, enable_prefix_caching=False) as e:
        outs = await asyncio.gather(*[greedy(e, p) for p in prompts])
        assert e.stats()["preemptions"] > 0
    assert list(outs) == reference
