"""One request's outputs on their way from the engine to its HTTP handler, coalesced.

The engine produces one delta per request per step (a token; at full batch on a GPU, hundreds of
deltas many times a second: docs/benchmarks/design-measurements.md#output-stream-coalescing); a handler
that writes each one to its client costs the front end a task switch, a JSON
encoding and a socket write per token. When the handler is slower than the engine, the deltas
that arrive before it runs again are merged here into one, so the front end's work per step
shrinks exactly when it falls behind, and the client still gets every token (in fewer events).
"""

from __future__ import annotations

import asyncio

from deepinfer.outputs import CompletionOutput, RequestOutput


class OutputStream:
    """A one-slot mailbox of DELTA RequestOutputs: `put` merges into the pending one, `get`
    takes it (waiting if there is none). An exception put here is raised by the next `get`."""

    __slots__ = ("_pending", "_error", "_ready")

    def __init__(self) -> None:
        self._pending: RequestOutput | None = None
        self._error: BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, output: RequestOutput) -> None:
        if self._pending is None:
            self._pending = output
        else:
            merge_delta(self._pending, output)
        self._ready.set()

    def fail(self, error: BaseException) -> None:
        """End the stream with `error` (pending outputs are dropped: the request failed)."""
        if self._error is None:
            self._error = error
        self._ready.set()

    async def get(self) -> RequestOutput:
        if self._pending is None and self._error is None:
            await self._ready.wait()
        if self._error is not None:
            raise self._error
        output, self._pending = self._pending, None
        self._ready.clear()
        return output


def merge_delta(into: RequestOutput, new: RequestOutput) -> None:
    """Append the DELTA `new` to the DELTA `into` (same request): text, tokens and logprobs
    concatenate; finish state, cumulative logprob and cache counts are the newest."""
    by_index = {c.index: c for c in into.outputs}
    for completion in new.outputs:
        old = by_index.get(completion.index)
        if old is None:
            into.outputs.append(completion)
            continue
        _merge_completion(old, completion)
    into.outputs.sort(key=lambda c: c.index)
    into.finished = new.finished
    into.num_cached_tokens = max(into.num_cached_tokens, new.num_cached_tokens)
    if into.prompt_logprobs is None:
        into.prompt_logprobs = new.prompt_logprobs
    into.error = into.error or new.error


def _merge_completion(old: CompletionOutput, new: CompletionOutput) -> None:
    old.text += new.text
    old.token_ids = old.token_ids + new.token_ids
    if new.logprobs is not None:
        old.logprobs = (old.logprobs or []) + new.logprobs
    old.cumulative_logprob = new.cumulative_logprob
    old.finish_reason = new.finish_reason
    old.stop_reason = new.stop_reason
