"""Images in chat messages (OpenAI, vLLM and transformers content parts) on m3-tiny-vl: the same greedy tokens as
the equivalent placeholder prompt, whatever form the image takes; remote URLs, bad images and misplaced parts
refused before queueing; and the vision encoder's work counted in each step's token budget."""

import base64
import threading

import pytest
from oracle import make_vl_checkpoint
from test_engine_vision import IMG, engine, png

from m3sdk.config import EngineConfig
from m3sdk.core import build_core
from m3sdk.errors import InvalidRequestError
from m3sdk.params import SamplingParams

Image = pytest.importorskip("PIL.Image")
GREEDY = dict(max_tokens=8, temperature=0, ignore_eos=True)
A, B = png(100, 150, 0), png(60, 90, 1)


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    return make_vl_checkpoint(tmp_path_factory.mktemp("vl"))


def ask(*parts) -> list[dict]:
    return [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "What is "}, *parts,
                                         {"type": "text", "text": " here?"}]}]


def url_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


async def test_chat_image_equals_generate_with_the_placeholder(vl):
    async with engine(vl, enable_prefix_caching=False) as e:
        tok = e.tokenizer
        done = await e.chat(ask(url_part(data_url(A))), **GREEDY)
        tokens = [t.token_id async for c in e.chat_stream(ask(url_part(data_url(A))), logprobs=0, **GREEDY)
                  for t in c.logprobs or []]
        # the byte-level test template renders "<role>content\n": the image part sits where its placeholder is
        ids = (tok.encode("<system>Be brief.\n<user>What is ", add_special_tokens=False) + [IMG]
               + tok.encode(" here?\n<assistant>", add_special_tokens=False))
        ref = await e.generate({"prompt_token_ids": ids, "images": [A]}, **GREEDY)
        two = await e.chat(ask(url_part(data_url(A)), {"type": "text", "text": " and "}, url_part(data_url(B))),
                           **GREEDY)
        ids2 = (tok.encode("<system>Be brief.\n<user>What is ", add_special_tokens=False) + [IMG]
                + tok.encode(" and ", add_special_tokens=False) + [IMG]
                + tok.encode(" here?\n<assistant>", add_special_tokens=False))
        ref2 = await e.generate({"prompt_token_ids": ids2, "images": [A, B]}, **GREEDY)
    assert done.usage.prompt_tokens == ref.usage.prompt_tokens == len(ids) - 1 + 20
    assert tokens == ref.token_ids and done.text == ref.text and done.usage.completion_tokens == 8
    assert two.text == ref2.text and two.usage.prompt_tokens == ref2.usage.prompt_tokens
    assert two.text != done.text


async def test_every_image_form_gives_the_same_reply(vl, tmp_path):
    path = tmp_path / "a.png"
    path.write_bytes(A)
    pil = Image.open(path)
    parts = [url_part(data_url(A)), url_part(str(path)), url_part(f"file://{path}"),
             {"type": "image_url", "image_url": data_url(A)}, {"type": "image_pil", "image_pil": pil},
             {"type": "image", "image": pil}, {"type": "image", "image": A}, {"type": "image", "path": str(path)},
             {"type": "image", "url": data_url(A)}]
    async with engine(vl) as e:
        texts = [(await e.chat(ask(part), **GREEDY)).text for part in parts]
        streamed = [c async for c in e.chat_stream(ask(parts[0]), **GREEDY)]
    assert len(set(texts)) == 1, texts
    assert streamed[-1].usage.completion_tokens == 8 and streamed[-1].finish_reason == "length"


async def test_remote_urls_need_a_fetcher(vl):
    url = "https://example.com/a.png"
    async with engine(vl) as e:
        with pytest.raises(InvalidRequestError, match="remote image URLs are refused"):
            await e.chat(ask(url_part(url)), max_tokens=2)
        local = await e.chat(ask(url_part(data_url(A))), **GREEDY)
    fetched = []
    async with engine(vl, image_fetcher=lambda u: fetched.append(u) or A) as e:
        remote = await e.chat(ask(url_part(url)), **GREEDY)
    assert fetched == [url] and remote.text == local.text


async def test_bad_image_parts_are_refused_before_queueing(vl, tmp_path):
    cases = [
        (ask(url_part(data_url(b"not a png"))), "could not be decoded"),
        (ask(url_part("data:image/png;base64,@@@")), "base64"),
        (ask(url_part(str(tmp_path / "missing.png"))), "cannot be read"),
        (ask(url_part(data_url(png(4, 1000, 5)))), "aspect ratio"),
        (ask({"type": "image_url", "image_url": {}}), "image_url part"),
        (ask({"type": "image", "image": A, "url": "x"}), "holds one of"),
        (ask(*[url_part(data_url(A))] * 3), "at most 2"),
        (ask(url_part(data_url(A)), {"type": "text", "text": "]<]image[>["}), "2 image placeholders"),
        ([{"role": "assistant", "content": [url_part(data_url(A))]}], "belong in user messages"),
    ]
    async with engine(vl, limit_images=2) as e:
        for messages, match in cases:
            with pytest.raises(InvalidRequestError, match=match):
                e.chat_stream(messages, max_tokens=2)
        assert e.stats()["waiting"] == e.stats()["running"] == 0
        assert (await e.chat(ask(url_part(data_url(B))), **GREEDY)).usage.completion_tokens == 8


async def test_a_text_only_engine_refuses_image_parts(vl):
    async with engine(vl, limit_images=0) as e:
        with pytest.raises(InvalidRequestError, match="takes no images"):
            await e.chat(ask(url_part(data_url(A))), max_tokens=2)
        text = await e.chat([{"role": "user", "content": [{"type": "text", "text": "hi"}]}], **GREEDY)
    assert text.usage.completion_tokens == 8


# -- the encoder's work in the step budget -----------------------------------------------------------------------

class StepLog:
    """Each step's scheduled tokens and the encoder tokens (patches) run in it: the encoder's counter read at the
    next step's start (on a CPU a step's forward, encoder included, ends before the next is scheduled)."""

    def __init__(self) -> None:
        self.images = None
        self.steps: list[list[int]] = []  # [tokens, encoder tokens at the step's start]

    def on_step(self, plan):
        self.steps.append([plan.num_tokens, self.images.num_encoder_tokens])

    def per_step(self) -> list[tuple[int, int]]:
        marks = [s[1] for s in self.steps] + [self.images.num_encoder_tokens]
        return [(s[0], marks[i + 1] - marks[i]) for i, s in enumerate(self.steps)]


def run_core(checkpoint, prompts: list[tuple[list[int], list[bytes]]], budget: int) -> tuple[list, StepLog]:
    """Greedy tokens of each image prompt through an engine core of this step budget, and its steps' log."""
    log = StepLog()
    config = EngineConfig(model=str(checkpoint), device="cpu", dtype="float32", max_model_len=128, max_num_seqs=4,
                          max_num_batched_tokens=budget, kv_cache_memory=1 << 22, enable_prefix_caching=False)
    core = build_core(config, observers=[log])
    log.images = core.images
    outs: dict[str, list[int]] = {}
    done = threading.Event()

    def emit(chunks):
        for c in chunks:
            outs.setdefault(c.request_id, []).extend(c.token_ids)
        if sum(len(o) for o in outs.values()) == 8 * len(prompts):
            done.set()

    for i, (ids, images) in enumerate(prompts):  # all queued before the loop starts: they arrive together
        full, spans = core.images.prepare(ids, images)
        core.submit(core.new_request(str(i), full, SamplingParams(**GREEDY), len(full) + 8, images=spans))
    core.start(emit, print)
    try:
        assert done.wait(120)
    finally:
        core.stop()
        core.join()
    return [outs[str(i)] for i in range(len(prompts))], log


X, Y, Z = png(56, 84, 3), png(84, 84, 4), png(112, 112, 5)  # 24, 36 and 64 patches (6, 9 and 16 tokens)


def test_encoder_tokens_count_against_the_step_budget(vl):
    prompts = [(list(range(3, 13)) + [IMG] + [20] * 5, [X]), ([30, 31, 32, IMG, 33, 34, 35], [Y]),
               (list(range(40, 70)), [])]
    outs, log = run_core(vl, prompts, budget=48)
    steps = log.per_step()
    assert all(tokens + patches <= 48 for tokens, patches in steps), steps
    assert sum(p for _, p in steps) == 24 + 36  # each image encoded once, in some step
    assert steps[0] == (24, 24)  # the first prompt whole with its image; the second stops before its image
    reference, _ = run_core(vl, prompts, budget=512)
    assert outs == reference


def test_an_image_larger_than_the_budget_is_encoded_alone(vl):
    prompts = [([5, 6, IMG, 7], [Z]), ([8, IMG, 9], [X])]
    outs, log = run_core(vl, prompts, budget=48)
    steps = log.per_step()
    assert sum(p for _, p in steps) == 64 + 24
    assert 64 in [p for _, p in steps]  # Z's step encodes Z alone (over the budget: no step has room for it)
    assert all(t + p <= 48 for t, p in steps if p != 64), steps
    reference, _ = run_core(vl, prompts, budget=512)
    assert outs == reference
