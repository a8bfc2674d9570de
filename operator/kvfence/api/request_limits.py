"""``TrustClass.spec.requestLimits``: what one request may ask of the class's engine.

The router enforces them (:mod:`kvfence.router.surface`): a request beyond any of them is refused with
a 400 that names the request field and the setting. Unset fields take the defaults of
:class:`kvfence.contract.routing.RequestLimits`; the routing table carries only what a class sets.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from kvfence.api.common import KubeModel
from kvfence.contract.routing import RequestLimits

_D = RequestLimits()


def _limit(alias: str, what: str, default: int, lo: int, hi: int) -> Any:
    return Field(None, alias=alias, ge=lo, le=hi, description=f"{what} Unset: {default}.")


class RequestLimitsSpec(KubeModel):
    """Per-request limits of this class's API surface. A sequence is one prompt times one choice
    (n); quotas count sequences."""

    max_prompts_per_request: int | None = _limit(
        "maxPromptsPerRequest",
        "Prompts in one /v1/completions request (a list of strings or of token-id lists).",
        _D.max_prompts_per_request, 1, 4096,
    )  # fmt: skip
    max_n: int | None = _limit("maxN", "Choices (n) of one request.", _D.max_n, 1, 1024)
    max_sequences_per_request: int | None = _limit(
        "maxSequencesPerRequest",
        "Sequences of one request: prompts x n.",
        _D.max_sequences_per_request, 1, 1 << 20,
    )  # fmt: skip
    max_stop_sequences: int | None = _limit(
        "maxStopSequences",
        "Entries of stop, stop_token_ids and bad_words, each.",
        _D.max_stop_sequences, 0, 4096,
    )  # fmt: skip
    max_stop_sequence_length: int | None = _limit(
        "maxStopSequenceLength",
        "Characters of one stop string or bad word.",
        _D.max_stop_sequence_length, 1, 65536,
    )  # fmt: skip
    max_logit_bias_entries: int | None = _limit(
        "maxLogitBiasEntries",
        "Entries of logit_bias and allowed_token_ids, each.",
        _D.max_logit_bias_entries, 0, 1 << 20,
    )  # fmt: skip
    max_logprobs: int | None = _limit(
        "maxLogprobs",
        "logprobs, top_logprobs and prompt_logprobs per token, and entries of logprob_token_ids.",
        _D.max_logprobs, 0, 1 << 20,
    )  # fmt: skip
    max_grammar_bytes: int | None = _limit(
        "maxGrammarBytes",
        "Bytes (as compact JSON) of a structured-output constraint: response_format, "
        "structured_outputs (JSON schema, regex, grammar, choices), repetition_detection, "
        "chat_template_kwargs, stream_options.",
        _D.max_grammar_bytes, 0, 16 << 20,
    )  # fmt: skip
    max_messages: int | None = _limit(
        "maxMessages", "Messages (and documents) of one chat request.", _D.max_messages, 1, 1 << 20
    )
    max_tools: int | None = _limit("maxTools", "Tools of one chat request.", _D.max_tools, 0, 4096)

    def route(self) -> RequestLimits | None:
        """What the routing table carries: None when the class sets nothing (the router's defaults)."""
        set_fields = self.model_dump(exclude_none=True)
        return RequestLimits.model_validate(set_fields) if set_fields else None
