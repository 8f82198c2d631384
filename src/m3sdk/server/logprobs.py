"""Sampled tokens' logprobs in OpenAI's two shapes: chat (`content: [{token, logprob, bytes, top_logprobs}]`) and
text completions (`tokens`, `token_logprobs`, `top_logprobs` as {token: logprob}, `text_offset`)."""

from __future__ import annotations

from collections.abc import Sequence

from m3sdk.sampler import SampledToken
from m3sdk.server.protocol import ChatLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob
from m3sdk.tokenizer import Tokenizer


def _piece(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def chat_logprobs(tokenizer: Tokenizer, tokens: Sequence[SampledToken]) -> ChatLogprobs:
    content = []
    for t in tokens:
        piece = _piece(tokenizer, t.token_id)
        top = [TopLogprob(token=(p := _piece(tokenizer, i)), logprob=lp, bytes=list(p.encode()))
               for i, lp in (t.top_logprobs or [])]
        content.append(TokenLogprob(token=piece, logprob=t.logprob, bytes=list(piece.encode()), top_logprobs=top))
    return ChatLogprobs(content=content)


def completion_logprobs(tokenizer: Tokenizer, tokens: Sequence[SampledToken], offset: int = 0) -> CompletionLogprobs:
    """`offset`: characters of this choice's text before these tokens (a stream's earlier deltas)."""
    out = CompletionLogprobs(top_logprobs=[])
    for t in tokens:
        piece = _piece(tokenizer, t.token_id)
        out.tokens.append(piece)
        out.token_logprobs.append(t.logprob)
        out.top_logprobs.append({_piece(tokenizer, i): lp for i, lp in (t.top_logprobs or [])})
        out.text_offset.append(offset)
        offset += len(piece)
    return out
