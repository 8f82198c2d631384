"""An engine-ready checkpoint: the tiny random oracle model (tests/oracle.py, where MSA drops blocks past
position 24) plus a real byte-level tokenizer (its 256 tokens are the model's vocabulary) and a chat template."""

import json
import shutil

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers

CHAT_TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def _byte_alphabet() -> list[str]:
    """GPT-2's byte -> printable character map, so token id b is byte b."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def write_byte_tokenizer(directory) -> None:
    vocab = {c: i for i, c in enumerate(_byte_alphabet())}
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))


@pytest.fixture(scope="session")
def engine_checkpoint(oracle_checkpoint, tmp_path_factory):
    directory = tmp_path_factory.mktemp("engine_ckpt")
    shutil.copytree(oracle_checkpoint, directory, dirs_exist_ok=True)
    write_byte_tokenizer(directory)
    return directory

