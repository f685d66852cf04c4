"""Structured output in the engine core: compile in workers, cache, and fill the step bitmask.

    arrival:     request.grammar = manager.grammar_for(params)   # compile starts now, in a worker
    scheduling:  the request waits in WAITING_FOR_GRAMMAR until request.grammar.poll() is READY
    each step:   fill = manager.start_bitmask(grammars)      # filled in a worker beside the forward
                 runner.sample(forward, fill.result())       # the core waits, the runner applies it
    update:      request.grammar.accept(token) for every accepted token

Compiled grammars are cached by (tokenizer, grammar): the cache holds the compile's Future, so
a second request with the same schema that arrives while the first compile runs waits on that
same compile instead of starting another. A failed compile leaves the cache (a retry may
succeed, e.g. after a timeout); a timed-out one stays, so its result serves later requests.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import xgrammar as xgr

from deepinfer.sample.structured import backend
from deepinfer.sample.structured.bitmask import BitmaskFill, bitmask_bias
from deepinfer.sample.structured.grammar import RequestGrammar
from deepinfer.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

CACHE_ENTRIES = 1024


class StructuredOutputManager:
    def __init__(self, tokenizer, vocab_size: int, tokenizer_key: str, *, compile_timeout_s: float,
                 num_workers: int = 2, unpack_on_host: bool = True) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size   # the model's logits width
        # Bitmask rows cover the tokenizer's ids only; logit columns past them are blocked.
        self.grammar_vocab_size = backend.grammar_vocab_size(tokenizer, vocab_size)
        self.tokenizer_key = tokenizer_key
        self.compile_timeout_s = compile_timeout_s
        # xgrammar releases the GIL while compiling, so threads compile in parallel with the
        # engine loop; a process pool would only add pickling of compiled grammars.
        self._compile_pool = ThreadPoolExecutor(num_workers, thread_name_prefix="grammar-compile")
        # One thread fills bitmasks: one step's fill runs at a time, beside that step's forward.
        self._fill_pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-bitmask")
        # Rows without drafts fill in parallel, in xgrammar's own threads (the GIL released).
        self._batch_matcher = xgr.BatchGrammarMatcher()
        # On the CPU the worker also expands the bits into an additive bias, beside the forward;
        # on a GPU the packed rows (32x smaller) are copied and applied there (bitmask.apply_grammar_bitmask).
        self.unpack_on_host = unpack_on_host
        self._backend: backend.XGrammarBackend | None = None
        self._backend_lock = threading.Lock()
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        # Re-entrant: a compile that is already done runs its done-callback inside grammar_for.
        self._cache_lock = threading.RLock()
        self.num_compiles = 0          # compiles started (cache misses), for tests and stats

    # ------------------------------------------------------------------------------ compile
    def grammar_for(self, params: StructuredOutputsParams) -> RequestGrammar:
        """Start (or join) the compile of params' grammar; returns at once."""
        timeout = params.compile_timeout_s or self.compile_timeout_s
        key = (self.tokenizer_key, backend.cache_key(params))
        with self._cache_lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
            else:
                future = self._compile_pool.submit(self._compile, params)
                self.num_compiles += 1
                self._cache[key] = future
                future.add_done_callback(lambda f, key=key: self._forget_failure(key, f))
                while len(self._cache) > CACHE_ENTRIES:
                    self._cache.popitem(last=False)
        return RequestGrammar(future, time.monotonic() + timeout, timeout)

    def _compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        start = time.perf_counter()
        compiled = self._get_backend().compile(params)
        logger.debug("compiled a %s grammar in %.1f ms", params.kind, 1e3 * (time.perf_counter() - start))
        return compiled

    def _get_backend(self) -> backend.XGrammarBackend:
        # Built on first use, in a worker: reading the vocabulary takes a noticeable time, which
        # engines that never see a constrained request should not pay at start-up
        # (docs/benchmarks/design-measurements.md#grammar-backend-on-first-use).
        with self._backend_lock:
            if self._backend is None:
                info = backend.make_tokenizer_info(self.tokenizer, self.vocab_size)
                self._backend = backend.XGrammarBackend(info)
            return self._backend

    def _forget_failure(self, key: tuple, future: Future) -> None:
        if future.exception() is not None:
            with self._cache_lock:
                if self._cache.get(key) is future:
                    del self._cache[key]

    # ------------------------------------------------------------------------------ bitmask
    def start_bitmask(self, grammars: dict[str, RequestGrammar],
                      drafts: dict[str, list[int]] | None = None) -> BitmaskFill | None:
        """Start filling one bitmask row per request that samples under a grammar this step.

        A request verifying speculative drafts d_1..d_m gets m + 1 rows, keyed (request_id, j):
        row j is the mask after d_1..d_j. The fill advances the matcher through the drafts and
        rolls it back, so it ends where it started (the drafts were cut to the grammar's valid
        prefix when proposed; the scheduler accepts only what the verifier keeps).
        """
        if not grammars:
            return None
        rows: dict = {}
        items = []
        for request_id, grammar in grammars.items():
            chain = (drafts or {}).get(request_id) or []
            if chain:
                for j in range(len(chain) + 1):
                    rows[(request_id, j)] = len(rows)
            else:
                rows[request_id] = len(rows)
            items.append((grammar, chain))
        bitmask = xgr.allocate_token_bitmask(len(rows), self.grammar_vocab_size)

        def fill() -> torch.Tensor:
            row = 0
            single_rows, single_matchers = [], []
            for grammar, chain in items:
                if not chain:
                    single_rows.append(row)
                    single_matchers.append(grammar.matcher)
                    row += 1
                    continue
                grammar.fill_bitmask(bitmask, row)
                row += 1
                for token_id in chain:
                    accepted = grammar.accept(token_id)
                    assert accepted, "drafts are cut to the grammar's valid prefix when proposed"
                    grammar.fill_bitmask(bitmask, row)
                    row += 1
                grammar.rollback(len(chain))
            if single_rows:
                self._batch_matcher.batch_fill_next_token_bitmask(single_matchers, bitmask, single_rows)
            return bitmask_bias(bitmask, self.vocab_size) if self.unpack_on_host else bitmask

        return BitmaskFill(rows, bitmask, self._fill_pool.submit(fill))

    def shutdown(self) -> None:
        self._compile_pool.shutdown(wait=False, cancel_futures=True)
        self._fill_pool.shutdown(wait=False, cancel_futures=True)
