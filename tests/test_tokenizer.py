import json
import random

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from m3sdk.errors import CheckpointError, InvalidRequestError
from m3sdk.params import SamplingParams
from m3sdk.tokenizer import TextStream, Tokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog. Über naïve café crème brûlée, façade, jalapeño.",
    "東京は日本の首都です。北京是中国的首都。서울은 한국의 수도입니다.",
    "Emoji: 😀😃😄 🚀🌍 👩‍👩‍👧 🇫🇷 and ∑∫√ math, ₿ coins, «quotes» — dashes…",
    "def main():\n    print('hello, world')\n    return 0\n\n# END of file\n",
    "Stop here. STOP! Then ### more text ### after the marker <|end|> and so on.",
]
TEXT = " ".join(CORPUS)
SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]


@pytest.fixture(scope="module")
def byte_bpe() -> HFTokenizer:
    """A GPT-2-style byte-level BPE, small enough that CJK and emoji split into several byte tokens."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 3, trainer)
    return tok


@pytest.fixture(scope="module")
def tk(byte_bpe) -> Tokenizer:
    return Tokenizer(byte_bpe, special_tokens={"bos_token": "<s>", "eos_token": "</s>"})


def stream_all(tk: Tokenizer, ids, params=None, prompt=()) -> tuple[list[str], str, str | None]:
    ts = TextStream(tk, params or SamplingParams(), list(prompt))
    deltas = []
    for t in ids:
        delta, stop = ts.push(t)
        deltas.append(delta)
        if stop:
            return deltas, "", stop
    return deltas, ts.finish(), None


def test_round_trip_and_specials(tk):
    for text in CORPUS + [TEXT]:
        assert tk.decode(tk.encode(text)) == text
    ids = tk.encode("<s>hi</s>")
    assert ids[0] == tk.bos_token_id and ids[-1] in tk.eos_token_ids
    assert tk.decode(ids) == "hi" and tk.decode(ids, skip_special_tokens=False) == "<s>hi</s>"
    assert tk.vocab_size == 400 and tk.eos_token_ids == {tk.token_to_id("</s>")}


def test_the_corpus_really_splits_characters(tk):
    # otherwise the incremental tests below would not exercise partial UTF-8 at all
    pieces = [tk.decode([t]) for t in tk.encode(TEXT)]
    assert sum("\ufffd" in p for p in pieces) > 10


def test_every_prefix_streams_to_its_full_decode(tk):
    ids = tk.encode(TEXT)
    prompt = tk.encode("Q: say it")
    for k in range(len(ids) + 1):
        deltas, tail, _ = stream_all(tk, ids[:k], prompt=prompt)
        full = tk.decode(ids[:k])
        assert "".join(deltas) + tail == full, k
        # never a partial character, and every whole one as soon as its last byte is in
        assert "".join(deltas) == full.rstrip("\ufffd")


def test_random_byte_sequences_stream_like_a_full_decode(tk):
    rng = random.Random(0)
    vocab = tk.vocab_size
    for _ in range(300):
        ids = [rng.randrange(len(SPECIALS), vocab) for _ in range(rng.randrange(1, 25))]
        deltas, tail, _ = stream_all(tk, ids)
        assert "".join(deltas) + tail == tk.decode(ids)
        assert "".join(deltas) == tk.decode(ids).rstrip("\ufffd")


def test_special_tokens_in_the_output_are_skipped(tk):
    ids = tk.encode("ab") + [tk.token_to_id("<|im_end|>")] + tk.encode("cd")
    deltas, tail, _ = stream_all(tk, ids)
    assert "".join(deltas) + tail == "abcd"


def _first_completion(tk, ids, stop) -> int:
    return next(k for k in range(1, len(ids) + 1) if stop in tk.decode(ids[:k]))


@pytest.mark.parametrize("stop", ["STOP!", "###", "<|end|>", "首都", "😄 🚀", "ée, f", "\n\n#", "都。서", "x"])
def test_stop_string_across_tokens(tk, stop):
    ids = tk.encode(TEXT)
    deltas, tail, reason = stream_all(tk, ids, SamplingParams(stop=[stop]))
    assert reason == stop and tail == ""
    assert "".join(deltas) == TEXT[:TEXT.index(stop)]
    assert len(deltas) == _first_completion(tk, ids, stop)  # stopped at the token that completed it


def test_stop_strings_do_span_several_tokens(tk):
    for stop in ["STOP!", "<|end|>", "😄 🚀", "ée, f", "\n\n#", "都。서"]:
        assert not any(stop in tk.decode([t]) for t in tk.encode(TEXT))


def test_random_stop_strings_match_a_plain_search(tk):
    rng = random.Random(1)
    ids = tk.encode(TEXT)
    for _ in range(40):
        i = rng.randrange(len(TEXT) - 12)
        stops = [TEXT[i:i + rng.randrange(1, 12)], TEXT[rng.randrange(len(TEXT) - 5):][:4]]
        stops = [s for s in stops if s]
        # the reference: the stop that completes first in the text, the longest among those ending together
        ends = sorted((TEXT.index(s) + len(s), TEXT.index(s), s) for s in stops)
        _, start, first = ends[0]
        deltas, _, reason = stream_all(tk, ids, SamplingParams(stop=stops))
        assert reason == first and "".join(deltas) == TEXT[:start], stops


def test_stop_held_back_then_released(tk):
    params = SamplingParams(stop=["lazy cat", "dog!!"])
    ids = tk.encode("the lazy dog!")
    deltas, tail, reason = stream_all(tk, ids, params)
    # "lazy " is released once "d" rules out "lazy cat"; "dog!" could still become "dog!!" until the end
    assert reason is None and ("".join(deltas), tail) == ("the lazy ", "dog!")


def test_earliest_completing_stop_wins_whatever_the_order(tk):
    ids = tk.encode("xabcdy")
    for stops in (["abcd", "bc"], ["bc", "abcd"]):
        deltas, _, reason = stream_all(tk, ids, SamplingParams(stop=stops))
        assert (reason, "".join(deltas)) == ("bc", "xa")
    deltas, _, reason = stream_all(tk, ids, SamplingParams(stop=["cd", "abcd"]))
    assert (reason, "".join(deltas)) == ("abcd", "x")


def test_push_after_stop_is_an_error(tk):
    ts = TextStream(tk, SamplingParams(stop="a"), [])
    assert ts.push(tk.encode("a")[0]) == ("", "a") and ts.finish() == ""
    with pytest.raises(RuntimeError):
        ts.push(1)


def test_prompt_context_keeps_a_leading_space():
    # SentencePiece-style: the decoder strips the leading space of a sequence, so the stream must decode the
    # output as a continuation of the prompt
    tok = HFTokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>"],
                                                        show_progress=False))
    tk = Tokenizer(tok)
    prompt, out = tk.encode("The quick"), tk.encode("The quick brown fox")[len(tk.encode("The quick")):]
    assert tk.decode(out).startswith("brown")  # a plain decode loses the space
    deltas, tail, _ = stream_all(tk, out, prompt=prompt)
    assert "".join(deltas) + tail == " brown fox"


# ---- from_pretrained and the chat template ---------------------------------------------------------------

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m.role not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role ' + m.role) }}{% endif %}"
    "<|im_start|>{{ m.role }}\n{{ m.content | trim }}<|im_end|>\n"
    "{% endfor %}"
    "{% if tools %}<|im_start|>tools\n{{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _checkpoint(tmp_path, byte_bpe, config: dict, files: dict[str, str] | None = None):
    byte_bpe.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    for name, text in (files or {}).items():
        (tmp_path / name).write_text(text)
    return tmp_path


def test_from_pretrained_with_chat_template(tmp_path, byte_bpe):
    path = _checkpoint(tmp_path, byte_bpe, {
        "bos_token": {"content": "<s>", "__type": "AddedToken"}, "eos_token": "</s>", "add_bos_token": False,
        "chat_template": TEMPLATE,
    }, {"generation_config.json": json.dumps({"eos_token_id": [3]})})
    tk = Tokenizer.from_pretrained(path)
    assert tk.eos_token_ids == {tk.token_to_id("</s>"), 3} and tk.bos_token == "<s>"
    messages = [{"role": "system", "content": " Be brief. "}, {"role": "user", "content": "2+2?"}]
    tools = [{"name": "calc", "description": "<math> & café"}]
    text = tk.apply_chat_template(messages, tools=tools)
    assert text == ("<s><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
                    '<|im_start|>tools\n[{"name": "calc", "description": "<math> & café"}]<|im_end|>\n'
                    "<|im_start|>assistant\n")
    assert tk.apply_chat_template(messages, add_generation_prompt=False).endswith("2+2?<|im_end|>\n")
    ids = tk.encode(text, add_special_tokens=False)
    assert ids[:2] == [tk.bos_token_id, tk.token_to_id("<|im_start|>")]
    with pytest.raises(InvalidRequestError, match="bad role tool"):
        tk.apply_chat_template([{"role": "tool", "content": "x"}])
    for bad in ([], "hello", [{"content": "no role"}], [["user", "hi"]]):
        with pytest.raises(InvalidRequestError):
            tk.apply_chat_template(bad)


def test_chat_template_file_wins_and_named_templates(tmp_path, byte_bpe):
    path = _checkpoint(tmp_path, byte_bpe, {"chat_template": [{"name": "tool_use", "template": "T"},
                                                              {"name": "default", "template": "D{{ eos_token }}"}],
                                            "eos_token": "</s>"})
    assert Tokenizer.from_pretrained(path).apply_chat_template([{"role": "user", "content": ""}]) == "D</s>"
    (path / "chat_template.jinja").write_text("J{% for m in messages %}{{ m.content }}{% endfor %}")
    assert Tokenizer.from_pretrained(path).apply_chat_template([{"role": "user", "content": "q"}]) == "Jq"


def test_template_sandbox_and_errors(tmp_path, byte_bpe):
    path = _checkpoint(tmp_path, byte_bpe, {"chat_template": "{{ messages.__class__.__mro__ }}"})
    with pytest.raises(InvalidRequestError):  # the sandbox refuses, reported as a refused request
        Tokenizer.from_pretrained(path).apply_chat_template([{"role": "user", "content": ""}])
    path = _checkpoint(tmp_path, byte_bpe, {"chat_template": "{% for %}"})
    with pytest.raises(CheckpointError, match="chat template"):
        Tokenizer.from_pretrained(path)
    no_template = _checkpoint(tmp_path, byte_bpe, {})
    with pytest.raises(InvalidRequestError, match="no chat template"):
        Tokenizer.from_pretrained(no_template).apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path / "missing")
