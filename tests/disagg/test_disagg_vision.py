"""Image prompts through prefill nodes running the real engine in other processes (127.0.0.1), on the tiny VL
checkpoint: the node decodes and encodes the images it is sent (the decode side's encoder never runs; with
prefill_fallback "error" it loads none) and the greedy tokens equal colocated ones; two prompts that differ only in
their image share no image page on either side; a node without a vision encoder refuses images (INVALID_ARGUMENT),
and the decode side then prefills them itself (prefill_fallback "local") or fails them with a clear error."""

from __future__ import annotations

import asyncio
import time

import pytest

pytest.importorskip("ucxx")
pytest.importorskip("PIL.Image")

import grpc  # noqa: E402
from disagg_helpers import spawn_engine_node, stop_node  # noqa: E402
from oracle import ORACLE_IMAGE_TOKEN, make_vl_checkpoint, random_png  # noqa: E402

from m3sdk import Engine, SamplingParams  # noqa: E402
from m3sdk.disagg import loop  # noqa: E402
from m3sdk.disagg._proto import m3sdk_disagg_pb2 as pb  # noqa: E402
from m3sdk.disagg.messages import pack_token_ids, sampling_to_proto  # noqa: E402
from m3sdk.errors import InvalidRequestError, PrefillNodeError  # noqa: E402

IMG = ORACLE_IMAGE_TOKEN
MAX_TOKENS = 10
A, B, C = random_png(100, 150, 0), random_png(60, 90, 1), random_png(100, 150, 2)  # 20, 6 and 20 image tokens
TEXT = [(7 * i) % 240 + 3 for i in range(20)]  # page 0: text only; page 1 starts with 4 text tokens, then the image
TAIL = [(11 * i) % 240 + 3 for i in range(30)]
ONE_A = {"prompt_token_ids": TEXT + [IMG] + TAIL, "images": [A]}  # 70 tokens
ONE_C = {"prompt_token_ids": TEXT + [IMG] + TAIL, "images": [C]}  # the same ids, another image
TWO = {"prompt_token_ids": TAIL + [IMG] + TEXT[:5] + [IMG] + TEXT, "images": [B, A]}
PLAIN = TAIL + TEXT + TAIL[:10]
SHORT = {"prompt_token_ids": [9, IMG, 10, 11], "images": [B]}  # 9 tokens: under remote_prefill_min_tokens


@pytest.fixture(scope="module")
def vl_checkpoint(tmp_path_factory):
    return make_vl_checkpoint(tmp_path_factory.mktemp("vl-disagg"))


async def generate(engine: Engine, prompt):
    return await engine.generate(prompt, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def colocated(vl_checkpoint):
    async def run():
        async with Engine(model=str(vl_checkpoint), device="cpu", kv_cache_memory=8 << 20,
                          enable_prefix_caching=False) as engine:
            return [(await generate(engine, p)).token_ids for p in (ONE_A, ONE_C, TWO, PLAIN, SHORT)]
    return asyncio.run(run())


def decode_engine(checkpoint, nodes, **kwargs) -> Engine:
    return Engine(**{**dict(model=str(checkpoint), device="cpu", kv_cache_memory=8 << 20, prefill_nodes=nodes,
                            remote_prefill_min_tokens=32), **kwargs})


async def test_image_prompts_through_a_node_match_colocated(vl_checkpoint, colocated):
    proc, address = spawn_engine_node(vl_checkpoint)
    try:
        async with decode_engine(vl_checkpoint, [address]) as engine:
            assert (await generate(engine, ONE_A)).token_ids == colocated[0]
            assert engine.stats()["remote_prefills"] == 1
            assert engine._running_core().images.num_encoded == 0  # the node encoded the image
        # with prefill_fallback "error" the decode side loads no vision encoder: the nodes compute every image
        # token, a short image prompt's too
        async with decode_engine(vl_checkpoint, [address], prefill_fallback="error") as engine:
            assert engine._running_core().images.encoder is None
            # an image that does not decode on the node as the caller says is refused before it computes
            code, details = prefill_with_image(engine._admission.client)
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "decodes here" in details, details
            free = engine.stats()["pages_free"]
            one_a = await generate(engine, ONE_A)
            one_c = await generate(engine, ONE_C)
            # a batch of image and text prompts, the images in other orders and sizes
            more = await asyncio.gather(*(generate(engine, p) for p in (TWO, PLAIN, SHORT)))
            stats = engine.stats()
            with pytest.raises(InvalidRequestError, match="no vision encoder"):
                await engine.generate(SHORT, max_tokens=2, logit_bias={5: 1.0})
            assert engine.stats()["pages_free"] == free
        assert [one_a.token_ids, one_c.token_ids, *(c.token_ids for c in more)] == colocated
        assert (stats["remote_prefills"], stats["remote_prefill_fallbacks"]) == (5, 0)
        # the same with the engine core in a process of its own: the image files travel to it, and the parent
        # refuses what its core cannot prefill with the core's own words
        async with decode_engine(vl_checkpoint, [address], prefill_fallback="error", engine_process=True) as engine:
            assert (await generate(engine, ONE_A)).token_ids == colocated[0]
            with pytest.raises(InvalidRequestError, match="no vision encoder"):
                engine.stream(SHORT, max_tokens=2, logit_bias={5: 1.0})  # validated in this call: never queued
            assert engine.stats()["remote_prefills"] == 1
        # the same ids with another image: only the text page is shared (on the node too, or its tokens would
        # be image A's)
        assert one_c.usage.cached_prompt_tokens == 16
    finally:
        stop_node(proc)


def prefill_with_image(client) -> tuple[grpc.StatusCode, str]:
    """A Prefill call carrying image A under a digest of zeros, straight to the client's first node: its status
    code and details."""
    ids = TEXT + [IMG] * 20 + TAIL
    request = pb.PrefillRequest(
        request_id="raw-image", compat_hash=client.compat.digest, token_ids=pack_token_ids(ids),
        sampling=sampling_to_proto(SamplingParams(temperature=0.0)),
        transport_port=client.transport.port, transfer_id=1, num_cached_pages=0, dst_pages=list(range(5)),
        layers_per_group=1, max_message_bytes=1 << 20, deadline_unix_s=time.time() + 30,
        images=[pb.PromptImage(offset=20, num_tokens=20, digest=bytes(16), data=A)])

    async def call():
        try:
            await client._nodes[0].stub.Prefill(request, timeout=10)
        except grpc.aio.AioRpcError as e:
            return e.code(), e.details()
        return grpc.StatusCode.OK, ""
    return loop.run(call())


async def test_a_node_without_a_vision_encoder_refuses_images(vl_checkpoint, colocated):
    proc, address = spawn_engine_node(vl_checkpoint, limit_images=0)
    try:
        async with decode_engine(vl_checkpoint, [address]) as engine:
            code, details = prefill_with_image(engine._admission.client)
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "takes no images" in details
            # prefilled here, with this side's encoder; a text prompt still goes to the node
            assert (await generate(engine, ONE_A)).token_ids == colocated[0]
            assert (await generate(engine, PLAIN)).token_ids == colocated[3]
            stats = engine.stats()
            assert (stats["remote_prefills"], stats["remote_prefill_fallbacks"]) == (1, 1)
            assert engine._running_core().images.encodes
            assert engine._running_core().images.num_encoded == 1
        async with decode_engine(vl_checkpoint, [address], prefill_fallback="error") as engine:
            free = engine.stats()["pages_free"]
            with pytest.raises(PrefillNodeError, match="no vision encoder"):
                await generate(engine, ONE_A)
            assert engine.stats()["pages_free"] == free
            assert (await generate(engine, PLAIN)).token_ids == colocated[3]
    finally:
        stop_node(proc)


async def test_without_an_encoder_image_prompts_queue_for_the_node_and_a_preempted_one_fails(vl_checkpoint,
                                                                                            colocated):
    """A decode engine without a vision encoder, two job slots (max_num_seqs) and a KV cache of 16 pages: image
    prompts wait for a slot and their pages, never prefilled here; one preempted while decoding (its recompute
    would need the encoder) ends with PrefillNodeError, and the others are unchanged. Two 70-token image prompts
    decoding 60 tokens each need 18 pages: one of them is always preempted; the last one left runs alone."""
    proc, address = spawn_engine_node(vl_checkpoint)
    try:
        async with decode_engine(vl_checkpoint, [address], prefill_fallback="error") as engine:
            page = engine._running_core().cache.kv.spec.bytes_per_page
        async with decode_engine(vl_checkpoint, [address], prefill_fallback="error", kv_cache_memory=16 * page,
                                 max_num_seqs=2, max_num_batched_tokens=64) as engine:
            assert engine.stats()["pages_total"] == 16
            prompts = [ONE_A, ONE_C, ONE_A, SHORT, ONE_C]
            done = await asyncio.gather(*(engine.generate(p, temperature=0.0, max_tokens=60, ignore_eos=True)
                                          for p in prompts), return_exceptions=True)
            failed = [d for d in done if isinstance(d, BaseException)]
            assert all(isinstance(d, PrefillNodeError) and "preempted" in str(d) for d in failed), failed
            assert 0 < len(failed) < len(prompts) and engine.stats()["preemptions"] >= len(failed)
            want = [colocated[0], colocated[1], colocated[0], colocated[4], colocated[1]]
            for d, w in zip(done, want, strict=True):
                if not isinstance(d, BaseException):
                    assert d.token_ids[:MAX_TOKENS] == w
            stats = engine.stats()
            assert stats["remote_prefills"] == len(prompts) and stats["remote_prefill_fallbacks"] == 0
            assert (await generate(engine, ONE_C)).token_ids == colocated[1]  # still serving
            assert engine.stats()["pages_free"] == 16  # no page leaked by the queue, the failures or the node
    finally:
        stop_node(proc)


def test_a_pil_image_travels_as_png_with_its_digest():
    """What a node gets for a PIL image (its RGB as PNG) decodes there to the same pixels and digest; bytes travel
    as given; without keep_file nothing is encoded."""
    import io

    from PIL import Image

    from m3sdk.model.image_processor import ImageProcessor

    proc = ImageProcessor()
    rgba = Image.open(io.BytesIO(A)).convert("RGBA")
    kept = proc.process(rgba, keep_file=True)
    assert kept.data.startswith(b"\x89PNG") and kept.digest == proc.process(rgba).digest
    there = proc.process(kept.data)
    assert (there.digest, there.num_tokens) == (kept.digest, kept.num_tokens)
    assert there.pixels.equal(kept.pixels)
    assert proc.process(A, keep_file=True).data == A and proc.process(rgba).data == b""
