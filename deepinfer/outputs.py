"""What generation returns: `RequestOutput` holding one `CompletionOutput` per sample; what an
embedding returns: `EmbeddingRequestOutput` holding one `EmbeddingOutput`.

Shaped like vLLM's, so `outputs[0].outputs[0].text` and `outputs[0].outputs.embedding` work as
users expect. With
`RequestOutputKind.DELTA` the text, token_ids and logprobs of a `CompletionOutput` hold only
what is new since the previous output; with CUMULATIVE (the default) they hold everything.
"""

from __future__ import annotations

import sys
from array import array
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Literal

FinishReason = Literal["stop", "length", "abort"]


@dataclass
class Logprob:
    """The log-probability of one token at one position.

    rank: 1 for the most likely token under the model, 2 for the next, ... (None if unknown).
    decoded_token: the token's text, filled by the front end when it detokenizes.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated position: {token_id: Logprob}, the sampled token plus the top-k.
SampleLogprobs = list[dict[int, Logprob]]
# The same per prompt position; the first prompt token has no logprob, so its entry is None.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One generated sequence.

    finish_reason: None while generating, then "stop" (EOS, stop token or stop string),
        "length" (max_tokens or the context length) or "abort".
    stop_reason: the stop string or stop token id that ended it; None for EOS or any other
        reason.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """Everything reported about one request at one moment.

    outputs: one CompletionOutput per sample (n of them), ordered by index.
    finished: True once every sample has finished.
    metrics: timing and usage figures attached by the front end (None when not collected).
    num_cached_tokens: prompt tokens not computed: their KV came from the prefix cache (or a KV
        tier). Tokens recomputed by SWA Bounded Replay are computed, so they do not count.
    error: why the engine failed the request (its outputs then finish with "abort"), e.g. a
        structured-output grammar that did not compile in time; None otherwise.
    lora_request: the LoRA adapter it ran under (deepinfer.lora.LoRARequest), or None (vLLM's field).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: Any = None
    num_cached_tokens: int = 0
    error: str | None = None
    lora_request: Any = None


@dataclass
class EmbeddingOutput:
    """One pooled vector (vLLM's EmbeddingOutput). `data`: its float32 values, little-endian bytes
    as the engine made them (what base64 encoding sends as they are); `embedding`: as floats."""

    data: bytes

    @cached_property
    def embedding(self) -> list[float]:
        values = array("f", self.data)
        if sys.byteorder == "big":
            values.byteswap()
        return values.tolist()

    @property
    def hidden_size(self) -> int:
        return len(self.data) // 4


@dataclass
class EmbeddingRequestOutput:
    """The embedding of one input (vLLM's name). `outputs` is None only when the engine failed the
    request (`error` says why). num_cached_tokens: input tokens whose KV came from the prefix cache."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput | None
    finished: bool = True
    num_cached_tokens: int = 0
    error: str | None = None
