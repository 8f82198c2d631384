"""xgrammar against llguidance on a checkpoint's tokenizer: what each compiles (coverage) and what a step's token
mask costs on the host (the part of structured outputs that sits on the engine's critical path).

    pip install llguidance   # (xgrammar is the `structured` extra)
    PYTHONPATH=src python benchmarks/grammar_engines.py [--model DIR] [--steps 200]

For each constraint: compile time (first compile, no cache), then a seeded random walk of up to --steps tokens
(each step fills the mask, picks an allowed token at random, advances the matcher), reporting the mean and p99
mask time per step and one rollback of 4 tokens (what speculative decoding's draft checks need). "FAIL" means the
engine refused the constraint. Prints one table.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from importlib.metadata import version
from pathlib import Path

import llguidance
import llguidance.torch as llg_torch
import torch
import xgrammar as xgr
from llguidance.gbnf_to_lark import gbnf_to_lark

from m3sdk.config import EngineConfig
from m3sdk.tokenizer import Tokenizer

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
    "required": ["name", "age"], "additionalProperties": False}
NESTED = {"$defs": {"item": {"type": "object", "properties": {
    "sku": {"type": "string", "pattern": "^[a-z]{3}-[0-9]{3}$"},
    "qty": {"type": "integer", "minimum": 1},
    "price": {"type": "number"},
    "gift": {"anyOf": [{"type": "boolean"}, {"type": "null"}]}}, "required": ["sku", "qty"]}},
    "type": "object", "properties": {
        "order": {"type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1, "maxItems": 4},
        "when": {"type": "string", "format": "date"},
        "note": {"type": "string", "minLength": 2}},
    "required": ["order", "when"]}
GRAMMAR_GBNF = r'''root ::= greeting " " name "!"
greeting ::= "Hello" | "Dear" | "Good morning"
name ::= [A-Z] [a-z]{1,10}'''
REGEX = r"(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])( [A-Z][a-z]+){1,3}"
CHOICE = r"(Elizabeth|Darcy|Jane|Bingley|Mr\. Collins)"

CASES = [
    ("json object", "builtin_json", None),
    ("json schema: flat", "json", PERSON),
    ("json schema: $ref anyOf pattern format", "json", NESTED),
    ("regex: date + words", "regex", REGEX),
    ("choice (5)", "regex", CHOICE),
    ("grammar (EBNF)", "grammar", GRAMMAR_GBNF),
]


class XGrammar:
    name = "xgrammar " + version("xgrammar")

    def __init__(self, path: Path, tokenizer: Tokenizer, vocab_size: int):
        # as m3sdk.structured builds it
        info = xgr.TokenizerInfo(tokenizer.vocabulary_bytes(vocab_size), xgr.VocabType.RAW, vocab_size=vocab_size,
                                 stop_token_ids=sorted(tokenizer.eos_token_ids))
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.vocab_size = vocab_size

    def compile(self, kind: str, spec: object) -> object:
        if kind == "builtin_json":
            return self.compiler.compile_builtin_json_grammar()
        if kind == "json":
            return self.compiler.compile_json_schema(json.dumps(spec), any_whitespace=False)
        if kind == "regex":
            return self.compiler.compile_regex(spec)
        return self.compiler.compile_grammar(spec)

    def matcher(self, compiled: object) -> object:
        return xgr.GrammarMatcher(compiled)

    def bitmask(self) -> torch.Tensor:
        return xgr.allocate_token_bitmask(1, self.vocab_size)

    def fill(self, m: object, mask: torch.Tensor) -> None:
        m.fill_next_token_bitmask(mask, 0)

    def accept(self, m: object, token: int) -> bool:
        return m.accept_token(token)

    def done(self, m: object) -> bool:
        return m.is_terminated()

    def rollback(self, m: object, n: int) -> None:
        m.rollback(n)


class LLGuidance:
    name = "llguidance " + version("llguidance")

    def __init__(self, path: Path, tokenizer: Tokenizer, vocab_size: int):
        self.tok = llguidance.LLTokenizer((path / "tokenizer.json").read_text(), n_vocab=vocab_size,
                                          eos_token=sorted(tokenizer.eos_token_ids))
        self.vocab_size = vocab_size

    def compile(self, kind: str, spec: object) -> object:
        M = llguidance.LLMatcher
        if kind == "builtin_json":
            grammar = M.grammar_from_json_schema({"type": "object"})
        elif kind == "json":
            grammar = M.grammar_from_json_schema(spec, defaults={"whitespace_flexible": False})
        elif kind == "regex":
            grammar = M.grammar_from_regex(spec)
        else:
            grammar = M.grammar_from_lark(gbnf_to_lark(spec))
        err = M.validate_grammar(grammar, self.tok)
        if err:
            raise ValueError(err)
        return grammar

    def matcher(self, compiled: object) -> object:
        m = llguidance.LLMatcher(self.tok, compiled, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def bitmask(self) -> torch.Tensor:
        return llg_torch.allocate_token_bitmask(1, self.vocab_size)

    def fill(self, m: object, mask: torch.Tensor) -> None:
        llg_torch.fill_next_token_bitmask(m, mask, 0)

    def accept(self, m: object, token: int) -> bool:
        return m.consume_token(token)

    def done(self, m: object) -> bool:
        return m.is_stopped()

    def rollback(self, m: object, n: int) -> None:
        m.rollback(n)


def allowed(mask: torch.Tensor, vocab_size: int) -> list[int]:
    bits = (mask[0].unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.reshape(-1)[:vocab_size].nonzero().flatten().tolist()


def walk(engine: object, kind: str, spec: object, steps: int, seed: int) -> dict[str, object]:
    t0 = time.perf_counter()
    try:
        compiled = engine.compile(kind, spec)
        m = engine.matcher(compiled)
    except Exception as e:  # noqa: BLE001 - a refusal is a coverage result
        return {"error": f"{type(e).__name__}: {str(e)[:60]}"}
    compile_s = time.perf_counter() - t0
    mask = engine.bitmask()
    rng = random.Random(seed)
    times: list[float] = []
    rollback_s = None
    for _ in range(steps):
        if engine.done(m):
            break
        t = time.perf_counter()
        engine.fill(m, mask)
        times.append(time.perf_counter() - t)
        choices = allowed(mask, engine.vocab_size)
        if not choices:
            break
        assert engine.accept(m, rng.choice(choices))
    if len(times) >= 4:
        t = time.perf_counter()
        engine.rollback(m, 4)
        rollback_s = time.perf_counter() - t
    return {"compile_ms": compile_s * 1e3, "mask_us": statistics.mean(times) * 1e6,
            "p99_us": sorted(times)[int(0.99 * (len(times) - 1))] * 1e6, "steps": len(times),
            "rollback_us": None if rollback_s is None else rollback_s * 1e6}


def walk_all(engine: object, kind: str, spec: object, steps: int, seeds: int) -> dict[str, object]:
    """Several walks (the last one also times a rollback): masks are timed over all their steps."""
    runs = [walk(engine, kind, spec, steps, s) for s in range(seeds)]
    if "error" in runs[0]:
        return runs[0]
    tot = sum(r["steps"] for r in runs)
    return {"compile_ms": runs[0]["compile_ms"],
            "mask_us": sum(r["mask_us"] * r["steps"] for r in runs) / tot,
            "p99_us": max(r["p99_us"] for r in runs), "steps": tot,
            "rollback_us": next((r["rollback_us"] for r in runs if r["rollback_us"] is not None), None)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the bundled m3-tiny)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seeds", type=int, default=5)
    args = ap.parse_args()
    path = Path(args.model) if args.model else EngineConfig().model_path()
    tokenizer = Tokenizer.from_pretrained(path)
    vocab_size = json.loads((path / "config.json").read_text())["vocab_size"]
    engines = [XGrammar(path, tokenizer, vocab_size), LLGuidance(path, tokenizer, vocab_size)]
    print(f"tokenizer {path.name} ({vocab_size} tokens), {args.seeds} seeded random walks of <= {args.steps} steps")
    print(f"{'constraint':40} {'engine':18} {'compile ms':>10} {'mask us':>8} {'p99 us':>8} {'steps':>6} "
          f"{'rollback us':>11}")
    for label, kind, spec in CASES:
        for engine in engines:
            r = walk_all(engine, kind, spec, args.steps, args.seeds)
            if "error" in r:
                print(f"{label:40} {engine.name:18} FAIL {r['error']}")
                continue
            rb = "-" if r["rollback_us"] is None else f"{r['rollback_us']:.1f}"
            print(f"{label:40} {engine.name:18} {r['compile_ms']:10.2f} {r['mask_us']:8.1f} {r['p99_us']:8.1f} "
                  f"{r['steps']:6d} {rb:>11}")


if __name__ == "__main__":
    main()
