"""What an admission (prefill nodes) makes an engine refuse, before anything is queued. One definition, applied by
the EngineCore that holds the admission (`new_request`) and, with the engine core in a process of its own, by
CoreProcess in the application's process, from what the engine process reported when its core was built."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from m3sdk.errors import InvalidRequestError
from m3sdk.params import SamplingParams
from m3sdk.request import Request

if TYPE_CHECKING:
    from m3sdk.images import ImagePrompts


@dataclass(frozen=True)
class AdmissionChecks:
    remote_prefill: bool = False  # an admission may prefill prompts on prefill nodes
    encodes_images: bool = True  # this engine computes image tokens itself (else only a node may)

    @classmethod
    def of(cls, remote_prefill: bool, images: ImagePrompts | None) -> AdmissionChecks:
        """The checks of an engine core with `images`, whose admission prefills remotely or not."""
        return cls(remote_prefill, images is None or images.encodes)

    def check_params(self, params: SamplingParams) -> None:
        """Refuse what no request of this engine may ask for (InvalidRequestError)."""
        if self.remote_prefill and params.structured_output is not None:
            raise InvalidRequestError("structured_output is not supported with prefill_nodes (a prefill node "
                                      "samples the first token unconstrained)")

    def check_request(self, request: Request) -> None:
        """Refuse a request (with its sampling state) whose prompt nothing could prefill (InvalidRequestError)."""
        if request.images and not self.encodes_images and not prefilled_remotely(request):
            raise InvalidRequestError("this engine has no vision encoder (its prefill nodes encode the images), and "
                                      "prefill nodes compute no prompt logprobs, logit_bias or min_tokens: an image "
                                      "prompt cannot use them here")


def prefilled_remotely(request: Request) -> bool:
    """Whether a prefill node may compute the request's prompt: it samples the first token without logit_bias or
    min_tokens and computes no prompt logprobs (such a request is prefilled here)."""
    return not (request.sampling.adjusts_logits or request.needs_prompt_logprobs)
