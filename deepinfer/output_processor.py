"""Front-end side of a request: engine outputs -> RequestOutput (text, logprobs, finish), or an
EmbeddingRequestOutput for a pooling request (one core request, one output: its vector).

One `RequestState` per user request; it fans out to n child sequences in the engine core
(each its own core request, `{id}-{index}` when n > 1). Detokenization and stop strings happen
here, not in the core: a stop string found here ends the child, and the caller must abort it
in the core (returned in `ProcessedOutputs.abort_ids`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deepinfer_recipe.output.detokenize import IncrementalDetokenizer

from deepinfer.engine.admission import child_request_ids  # the n fan-out rule: admission's
from deepinfer.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PromptLogprobs,
    RequestOutput,
)
from deepinfer.sampling_params import RequestOutputKind, SamplingParams
from deepinfer.tokenizer import Tokenizer
from deepinfer.types.lora import LoRARequest
from deepinfer.types.plan import EngineCoreOutput


@dataclass
class SequenceState:
    index: int
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None  # the core failed this sequence (finish_reason "abort")
    sent_tokens: int = 0      # for DELTA outputs
    sent_logprobs: int = 0


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    sequences: dict[str, SequenceState]       # core request id -> sequence
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0
    num_unfinished: int = 0   # sequences without a finish reason (kept, not recounted per step)
    lora_request: LoRARequest | None = None   # the LoRA adapter it ran under, named in its outputs

    @property
    def finished(self) -> bool:
        return self.num_unfinished == 0


@dataclass
class ProcessedOutputs:
    request_outputs: list[RequestOutput | EmbeddingRequestOutput]
    abort_ids: list[str]       # core requests ended by a stop string: abort them in the core


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}
        self._parent_of: dict[str, str] = {}
        self._pooling: dict[str, tuple[str | None, list[int]]] = {}   # pooling requests: (prompt, ids)

    def add_pooling_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int]) -> list[str]:
        """Register a pooling (embedding) request; returns its one core request id."""
        self._pooling[request_id] = (prompt, prompt_token_ids)
        return [request_id]

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, lora_request: LoRARequest | None = None) -> list[str]:
        """Register a request; returns the core request ids of its n sequences."""
        child_ids = child_request_ids(request_id, params.n)
        sequences = {}
        for index, child_id in enumerate(child_ids):
            # No tokenizer (skip_tokenizer_init): no text, as with detokenize=False.
            detok = (_detokenizer(self.tokenizer, prompt_token_ids, params)
                     if params.detokenize and self.tokenizer is not None else None)
            sequences[child_id] = SequenceState(index, detok, logprobs=[] if params.logprobs is not None else None,
                                                cumulative_logprob=0.0 if params.logprobs is not None else None)
            self._parent_of[child_id] = request_id
        self.requests[request_id] = RequestState(request_id, prompt, prompt_token_ids, params, sequences,
                                                 num_unfinished=len(sequences), lora_request=lora_request)
        return child_ids

    def has_unfinished(self) -> bool:
        return bool(self.requests or self._pooling)

    def process(self, outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        touched: dict[str, RequestState] = {}
        abort_ids: list[str] = []
        results: list[RequestOutput | EmbeddingRequestOutput] = []
        for out in outputs:
            pooling = self._pooling.pop(out.request_id, None) if out.finished else None
            if pooling is not None:
                vector = EmbeddingOutput(out.pooled) if out.pooled is not None else None
                results.append(EmbeddingRequestOutput(out.request_id, *pooling, vector, True, out.num_cached_tokens,
                                                      out.error or (None if vector else "the request was aborted")))
                continue
            parent_id = self._parent_of.get(out.request_id)
            if parent_id is None:
                continue
            state = self.requests[parent_id]
            seq = state.sequences[out.request_id]
            if seq.finish_reason is not None:
                continue
            if out.prompt_logprobs:
                state.prompt_logprobs = (state.prompt_logprobs or []) + [
                    self._decode_logprobs(p) if p else None for p in out.prompt_logprobs]
            state.num_cached_tokens = max(state.num_cached_tokens, out.num_cached_tokens)
            self._apply(seq, out)
            if seq.finish_reason is not None:
                state.num_unfinished -= 1
            if seq.finish_reason == "stop" and out.finish_reason is None:
                abort_ids.append(out.request_id)   # a stop string ended it, the core doesn't know
            touched[parent_id] = state
        for parent_id, state in touched.items():
            result = self._make_output(state)
            if result is not None:
                results.append(result)
            if state.finished:
                del self.requests[parent_id]
                for child_id in state.sequences:
                    self._parent_of.pop(child_id, None)
        return ProcessedOutputs(results, abort_ids)

    def abort(self, request_id: str) -> list[str]:
        """Forget a request; returns its core request ids (to abort in the core)."""
        if self._pooling.pop(request_id, None) is not None:
            return [request_id]
        state = self.requests.pop(request_id, None)
        if state is None:
            return []
        for child_id in state.sequences:
            self._parent_of.pop(child_id, None)
        return list(state.sequences)

    # ---------------------------------------------------------------------------- internals
    def _apply(self, seq: SequenceState, out: EngineCoreOutput) -> None:
        new_ids = out.new_token_ids
        if seq.detokenizer is not None:
            # EOS or a stop token id ended it: that token's text is not part of the output.
            stop_string = seq.detokenizer.update(new_ids, stop_terminated=out.finish_reason == "stop")
            if stop_string is not None:
                # The tokens after the one that completed the stop string are dropped.
                new_ids = new_ids[:len(seq.detokenizer.token_ids) - len(seq.token_ids)]
                seq.finish_reason, seq.stop_reason = "stop", stop_string
        seq.token_ids.extend(new_ids)
        if seq.logprobs is not None and out.new_logprobs:
            for entry in out.new_logprobs[:len(new_ids)]:
                decoded = self._decode_logprobs(entry)
                seq.logprobs.append(decoded)
                seq.cumulative_logprob += next(iter(decoded.values())).logprob
        if seq.finish_reason is None and out.finish_reason is not None:
            seq.finish_reason, seq.stop_reason = out.finish_reason, out.stop_reason
            seq.error = out.error

    def _decode_logprobs(self, entry: dict) -> dict:
        for token_id, lp in entry.items():
            if lp.decoded_token is None and self.tokenizer is not None:
                lp.decoded_token = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return entry

    def _make_output(self, state: RequestState) -> RequestOutput | None:
        kind = state.params.output_kind
        finished = state.finished
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = kind is RequestOutputKind.DELTA
        completions = []
        sequences = state.sequences.values()
        if len(state.sequences) > 1:
            sequences = sorted(sequences, key=lambda s: s.index)
        for seq in sequences:
            done = seq.finish_reason is not None
            text = seq.detokenizer.get_next_output_text(done, delta) if seq.detokenizer else ""
            token_ids, logprobs = seq.token_ids, seq.logprobs
            if delta:
                token_ids = seq.token_ids[seq.sent_tokens:]
                logprobs = seq.logprobs[seq.sent_logprobs:] if seq.logprobs is not None else None
                seq.sent_tokens, seq.sent_logprobs = len(seq.token_ids), len(seq.logprobs or ())
            completions.append(CompletionOutput(seq.index, text, list(token_ids), seq.cumulative_logprob,
                                                logprobs, seq.finish_reason, seq.stop_reason))
        error = next((s.error for s in state.sequences.values() if s.error), None)
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, state.prompt_logprobs,
                             completions, finished, num_cached_tokens=state.num_cached_tokens, error=error,
                             lora_request=state.lora_request)


def _detokenizer(tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> IncrementalDetokenizer:
    """One sequence's detokenizer (the one the chat routes' parser uses too), with the request's
    text options."""
    return IncrementalDetokenizer(tokenizer, prompt_token_ids,
                                  skip_special_tokens=params.skip_special_tokens,
                                  stop=params.stop,
                                  include_stop_str_in_output=params.include_stop_str_in_output,
                                  min_tokens=params.min_tokens)
