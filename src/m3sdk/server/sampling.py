"""An OpenAI request's sampling fields -> SamplingParams, one per choice.

n choices are n engine requests; with a seed, choice i samples with seed + i, so each choice is reproducible and
the choices differ. logit_bias keys are token ids as JSON strings (OpenAI's shape); a key that is not an integer is
a 400 naming it.
"""

from __future__ import annotations

from typing import Any

from m3sdk.params import SamplingParams
from m3sdk.server.errors import bad_request, not_supported
from m3sdk.server.protocol import SamplingFields


def sampling_params(req: SamplingFields, *, max_tokens: int | None, logprobs: int | None,
                    constraint: dict[str, Any] | None = None) -> list[SamplingParams]:
    """One SamplingParams per choice (InvalidRequestError for values out of range, with the field's name)."""
    fields: dict[str, Any] = {"presence_penalty": req.presence_penalty, "frequency_penalty": req.frequency_penalty,
                              "ignore_eos": req.ignore_eos, "min_tokens": req.min_tokens}
    if req.logit_bias:
        fields["logit_bias"] = _logit_bias(req.logit_bias)
    optional = {"temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k, "min_p": req.min_p,
                "repetition_penalty": req.repetition_penalty, "stop": req.stop, "stop_token_ids": req.stop_token_ids,
                "max_tokens": max_tokens, "logprobs": logprobs, "structured_output": constraint}
    fields.update({k: v for k, v in optional.items() if v is not None})
    if fields.get("top_k") == 0:  # OpenAI-style clients send 0 for "off"; the engine spells it -1
        fields["top_k"] = -1
    base = SamplingParams(**fields)
    if req.seed is None:
        return [base] * req.n
    return [base.replace(seed=req.seed + i) for i in range(req.n)]


def _logit_bias(bias: dict[str, float]) -> dict[int, float]:
    try:
        return {int(token): value for token, value in bias.items()}
    except ValueError:
        bad = next(k for k in bias if not k.strip().lstrip("-").isdigit())
        raise bad_request(f"logit_bias keys must be token ids, got {bad[:40]!r}", "logit_bias") from None


_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def structured_output(req: SamplingFields) -> dict[str, Any] | None:
    """vLLM's structured-output fields as one SamplingParams.structured_output (at most one may be given):
    guided_json / guided_regex / guided_choice / guided_grammar, or structured_outputs {json | regex | choice |
    grammar | json_object}."""
    given = {kind: getattr(req, name) for name, kind in _GUIDED.items() if getattr(req, name) is not None}
    if req.structured_outputs is not None:
        fields = {k: v for k, v in req.structured_outputs.items() if v is not None and v is not False}
        if fields.pop("json_object", None) is True:
            fields["json"] = {"type": "object"}
        unknown = sorted(fields.keys() - {"json", "regex", "choice", "grammar"})
        if unknown:
            raise not_supported(f"structured_outputs.{unknown[0]}")
        given.update(fields)
    if len(given) > 1:
        raise bad_request(f"give one structured-output constraint, got {sorted(given)}", "structured_outputs")
    return given or None


def choose_max_tokens(*values: int | None) -> int | None:
    """The first limit given (max_completion_tokens before the older max_tokens), checked >= 1."""
    for value in values:
        if value is not None:
            if value < 1:
                raise bad_request(f"max_tokens must be >= 1, got {value}", "max_tokens")
            return value
    return None
