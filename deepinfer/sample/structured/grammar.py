"""One request's grammar: a pending compile, then a matcher that follows the accepted tokens.

Life of a `RequestGrammar` (it sits in `Request.grammar`):
  1. created when the request arrives, holding the compile's Future (manager.py);
  2. the scheduler keeps the request in WAITING_FOR_GRAMMAR until `poll()` says READY (or FAILED:
     the compile raised or ran past its deadline, and the request fails alone);
  3. each step it fills its row of the token bitmask (`fill_bitmask`) from the matcher's state;
  4. the scheduler advances it with every accepted token (`accept`); speculative decoding rolls
     back tokens the verifier rejected (`rollback`) after checking drafts (`count_valid_prefix`).

Invariant: the matcher has consumed exactly the request's output tokens (minus any rolled back),
so the mask it produces is the set of tokens that keep the output inside the language.
"""

from __future__ import annotations

import enum
import time
from concurrent.futures import Future

import torch
import xgrammar as xgr


class GrammarState(enum.Enum):
    COMPILING = "compiling"
    READY = "ready"
    FAILED = "failed"


class RequestGrammar:
    def __init__(self, compiled: Future, deadline: float, timeout_s: float) -> None:
        self._compiled = compiled
        self._deadline = deadline          # time.monotonic() after which the compile has failed
        self._timeout_s = timeout_s
        self.state = GrammarState.COMPILING
        self.error: str | None = None
        self.matcher: xgr.GrammarMatcher | None = None

    # ----------------------------------------------------------------------------- compile
    def poll(self, now: float | None = None) -> GrammarState:
        """Move COMPILING to READY or FAILED when the compile finished or its deadline passed."""
        if self.state is not GrammarState.COMPILING:
            return self.state
        if self._compiled.done():
            error = self._compiled.exception()
            if error is None:
                # xgrammar 0.2 keeps the whole history, so rollback can undo any number of tokens.
                self.matcher = xgr.GrammarMatcher(self._compiled.result())
                self.state = GrammarState.READY
            else:
                self._fail(f"grammar compilation failed: {error}")
        elif (time.monotonic() if now is None else now) >= self._deadline:
            # The worker thread cannot be interrupted; it finishes in the background and its
            # result still lands in the cache for later requests. This request stops waiting.
            self._fail(f"grammar compilation timed out after {self._timeout_s:g} s "
                       "(raise structured_outputs_compile_timeout_s or simplify the constraint)")
        return self.state

    def wait(self, timeout_s: float) -> None:
        """Block up to timeout_s for the compile (an idle engine has nothing better to do)."""
        if self.state is GrammarState.COMPILING:
            remaining = max(0.0, min(timeout_s, self._deadline - time.monotonic()))
            try:
                self._compiled.exception(timeout=remaining)
            except TimeoutError:
                pass

    def _fail(self, message: str) -> None:
        self.state, self.error = GrammarState.FAILED, message

    # ---------------------------------------------------------------------------- matching
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advance on a sampled token; False if the grammar rejects it (it then stays put).

        A finished grammar (its stop token accepted) accepts nothing more; the request ends on
        that stop token, so nothing follows in practice.
        """
        if self.matcher.is_terminated():
            return False
        return self.matcher.accept_token(token_id)

    @staticmethod
    def accept_batch(grammars: list[RequestGrammar], token_ids: list[int]) -> None:
        """`accept` for many grammars, one token each, in one call: xgrammar's batch matcher
        advances them in its own threads with the GIL released, where single accepts, a step's
        worth of them, would each hold the engine loop
        (docs/benchmarks/design-measurements.md#grammar-batch-accept)."""
        live = [i for i, g in enumerate(grammars) if not g.matcher.is_terminated()]
        if live:
            _ACCEPT_MATCHER.batch_accept_token([grammars[i].matcher for i in live], [token_ids[i] for i in live])

    def count_valid_prefix(self, token_ids: list[int]) -> int:
        """How many leading draft tokens the grammar allows; the matcher is left unchanged."""
        accepted = 0
        for token_id in token_ids:
            if not self.accept(token_id):
                break
            accepted += 1
        self.rollback(accepted)
        return accepted

    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens accepted tokens (speculative tokens the verifier rejected)."""
        if num_tokens:
            self.matcher.rollback(num_tokens)

    @property
    def is_terminated(self) -> bool:
        return self.matcher is not None and self.matcher.is_terminated()


# Used by the engine loop only (accept_batch); the bitmask worker has its own (manager.py).
_ACCEPT_MATCHER = xgr.BatchGrammarMatcher()
