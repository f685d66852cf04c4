"""The sampler: one batched pass from logits to the next token of every sequence.

Order of processing (each step sees the output of the one before; all math in float32):

  1. allowed_token_ids mask, then logit_bias (the user's explicit edits to the model's logits)
  2. min_tokens: EOS (unless ignore_eos) and stop_token_ids -> -inf while the sequence is
     shorter than min_tokens; bad_words: the tokens that would complete one -> -inf
  3. penalties: repetition (prompt + output tokens), then frequency and presence (output only)
  -- greedy rows (temperature 0) stop here and take the argmax --
  4. temperature
  5. top-k, then top-p (on the top-k survivors, renormalised), then min-p
  6. sample with the exponential race: argmax(probs / E), E ~ Exponential(1) i.i.d. per token,
     which picks token t with probability probs[t] (it is the Gumbel-max trick in disguise).

Reported logprobs are RAW: log_softmax of the unprocessed logits (see sample/logprobs.py).

Reproducibility: a row with its own `generator` (seeded request) draws its exponential noise
from that generator alone, a full vocabulary's worth per step, so its tokens depend only on
its seed and its own logits, never on which other requests share the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from deepinfer.platforms.transfer import to_device, to_host_async
from deepinfer.sample import penalties
from deepinfer.sample.logprobs import LogprobTensors, TopLogprobs, top_logprob_tensors
from deepinfer.sampling_params import SamplingParams

ARGMAX_CHUNK = 256


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(dim=-1), on a GPU in two passes when there are few rows.

    torch reduces one long row with one block of threads, a measurable share of a Llama-3-8B
    batch-1 decode step at a 128k vocabulary (docs/benchmarks/design-measurements.md#greedy-argmax).
    Splitting the row into chunks spreads the first pass over the whole GPU (see two_pass_argmax)."""
    rows, vocab = logits.shape
    if logits.is_cuda and rows <= 8 and vocab % ARGMAX_CHUNK == 0 and vocab >= 16 * ARGMAX_CHUNK:
        return two_pass_argmax(logits)
    return logits.argmax(dim=-1)


def two_pass_argmax(logits: torch.Tensor) -> torch.Tensor:
    """The maximum of every ARGMAX_CHUNK-wide chunk, then the first chunk holding the largest.
    Both torch reductions return the first index among equal maxima, so the result is the first
    maximal index of the row, as argmax's."""
    rows = logits.shape[0]
    best, inner = logits.reshape(rows, -1, ARGMAX_CHUNK).max(dim=-1)
    chunk = best.argmax(dim=-1, keepdim=True)
    return torch.add(inner.gather(1, chunk), chunk, alpha=ARGMAX_CHUNK).squeeze(1)


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """The per-request generator of a seeded request (created once, kept for its lifetime)."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


@dataclass
class SamplingRow:
    """One row of logits to sample from, with what the sampler needs to know about it."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]        # tokens generated so far by this sequence
    generator: torch.Generator | None = None  # set when params.seed is set (make_generator)
    eos_token_ids: frozenset[int] = frozenset()


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Per row: raw logprobs of the sampled token and the top-k, when params.logprobs is set.
    logprobs: list[TopLogprobs | None]


@dataclass
class DeviceSample:
    """A sampler's result still on the device: nothing in it has waited for the device."""

    token_ids: torch.Tensor               # [rows] int64
    logprob_rows: list[int]               # the rows that asked for logprobs
    logprobs: LogprobTensors | None       # their entries, in that order

    def to_host(self) -> DeviceSample:
        """Start the device-to-host copies (see logprobs.to_host_async)."""
        return DeviceSample(to_host_async(self.token_ids), self.logprob_rows,
                            None if self.logprobs is None else self.logprobs.to_host())

    def tolist(self) -> SamplerOutput:
        """Python values (waits for the device where the tensors still live there)."""
        logprobs: list[TopLogprobs | None] = [None] * len(self.token_ids)
        if self.logprobs is not None:
            for row, entry in zip(self.logprob_rows, self.logprobs.tolist()):
                logprobs[row] = entry
        return SamplerOutput(self.token_ids.tolist(), logprobs)


def needs_edit(params: SamplingParams, row: SamplingRow) -> bool:
    """True when steps 1-3 change this row's logits."""
    return (params.logit_bias is not None or params.allowed_token_ids is not None
            or params.has_penalties or bool(params.bad_words_token_ids)
            or (params.min_tokens > 0 and len(row.output_token_ids) < params.min_tokens))


class Sampler:
    """Stateless: all per-request state arrives in the rows (and their generators)."""

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        return self.sample(logits, rows).tolist()

    def sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> DeviceSample:
        """Sample every row without waiting for the device (the runner copies the result back
        while the next step is prepared)."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [len(rows)={len(rows)}, vocab], "
                             f"got {tuple(logits.shape)}")
        fast = all(row.params.temperature == 0 and not needs_edit(row.params, row)
                   for row in rows)
        if fast:
            # Hot path: one argmax for the whole batch, in the model's dtype (upcasting to
            # float32 is exact, so it cannot change the argmax; no copy is made).
            token_ids = greedy_argmax(logits)
        else:
            token_ids = self._sample(logits, rows)
        wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
        return DeviceSample(token_ids, wanted, self._logprobs(logits, rows, token_ids, wanted))

    # ----------------------------------------------------------------------- general path
    def _sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        # Always a fresh float32 tensor: the processors below edit it in place, and the raw
        # logits must survive for the logprobs.
        x = logits.to(torch.float32, copy=True)
        self._edit_logits(x, rows)

        random_rows = [i for i, row in enumerate(rows) if row.params.temperature != 0]
        if len(random_rows) == len(rows):
            return self._sample_random(x, rows)
        token_ids = x.argmax(dim=-1)  # greedy rows: argmax of the edited logits
        if random_rows:
            index = to_device(random_rows, x.device, torch.long)
            token_ids[index] = self._sample_random(x[index], [rows[i] for i in random_rows])
        return token_ids

    @staticmethod
    def _edit_logits(x: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
        """Steps 1-3 (logit_bias, min_tokens, penalties), only on the rows that need them."""
        allowed_rows, allowed = [], []
        bias_rows, biases = [], []
        mask_rows, masked = [], []
        pen_rows: list[int] = []
        for i, row in enumerate(rows):
            params = row.params
            if params.allowed_token_ids is not None:
                allowed_rows.append(i)
                allowed.append(params.allowed_token_ids)
            if params.logit_bias:
                bias_rows.append(i)
                biases.append(params.logit_bias)
            banned: set[int] = set()
            if len(row.output_token_ids) < params.min_tokens:
                banned.update(params.stop_token_ids)
                if not params.ignore_eos:
                    banned |= row.eos_token_ids
            if params.bad_words_token_ids:
                banned.update(penalties.bad_word_tokens(params.bad_words_token_ids, row.output_token_ids))
            if banned:
                mask_rows.append(i)
                masked.append(sorted(banned))
            if params.has_penalties:
                pen_rows.append(i)

        if allowed_rows:
            penalties.apply_allowed_token_ids(x, allowed_rows, allowed)
        if bias_rows:
            penalties.apply_logit_bias(x, bias_rows, biases)
        if mask_rows:
            penalties.mask_tokens(x, mask_rows, masked)
        if pen_rows:
            penalties.apply_penalties(
                x, pen_rows,
                [rows[i].prompt_token_ids for i in pen_rows],
                [rows[i].output_token_ids for i in pen_rows],
                [rows[i].params.presence_penalty for i in pen_rows],
                [rows[i].params.frequency_penalty for i in pen_rows],
                [rows[i].params.repetition_penalty for i in pen_rows])

    @staticmethod
    def _sample_random(x: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Steps 4-6 on rows that all have temperature > 0. x is [len(rows), vocab] float32."""
        probs = sampling_probs(x, rows)
        noise = torch.empty_like(probs)
        seeded = [i for i, row in enumerate(rows) if row.generator is not None]
        if len(seeded) < len(rows):
            # Unseeded rows share the global RNG; one call fills them all (seeded rows are
            # overwritten below).
            noise.exponential_()
        for i in seeded:
            noise[i].exponential_(generator=rows[i].generator)
        # NOTE: a draw of exactly 0 would turn probs / noise into inf (or nan for a masked
        # token); the clamp keeps every masked token at 0 and every allowed one finite.
        noise.clamp_(min=torch.finfo(torch.float32).tiny)
        return (probs / noise).argmax(dim=-1)

    # --------------------------------------------------------------------------- logprobs
    @staticmethod
    def _logprobs(logits: torch.Tensor, rows: Sequence[SamplingRow], token_ids: torch.Tensor,
                  wanted: list[int]) -> LogprobTensors | None:
        if not wanted:
            return None
        index = to_device(wanted, logits.device, torch.long)
        return top_logprob_tensors(logits[index], token_ids[index], [rows[i].params.logprobs for i in wanted])


def sampling_probs(x: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Steps 4-5 on float32 logits of rows with temperature > 0: temperature, top-k / top-p,
    min-p -> the distribution a token is drawn from (each row sums to 1). Speculative decoding's
    verifier uses it too, so drafts are judged against exactly what the sampler would draw from."""
    device = x.device
    temps = [row.params.temperature for row in rows]
    if any(t != 1.0 for t in temps):
        x = x / to_device(temps, device, torch.float32)[:, None]
    top_k = [row.params.top_k for row in rows]
    top_p = [row.params.top_p for row in rows]
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        x = apply_top_k_top_p(x, top_k, top_p)
    probs = x.softmax(dim=-1)
    min_p = [row.params.min_p for row in rows]
    if any(m > 0 for m in min_p):
        threshold = to_device(min_p, device, torch.float32) * probs.max(dim=-1).values
        # Rows with min_p = 0 have threshold 0, which removes nothing.
        probs = probs.masked_fill(probs < threshold[:, None], 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def apply_top_k_top_p(logits: torch.Tensor, top_k: Sequence[int],
                      top_p: Sequence[float]) -> torch.Tensor:
    """Return logits with everything outside each row's top-k and then top-p set to -inf.

    top_k[i] = 0 means no top-k; top_p[i] = 1 means no top-p. Top-k keeps every token whose
    logit is at least the k-th largest (so ties at the boundary are all kept). Top-p keeps the
    smallest prefix of the remaining tokens, most likely first, whose probability reaches
    top_p; a token is kept iff the tokens strictly before it sum to less than top_p, so the
    most likely token always stays.
    """
    vocab_size = logits.shape[-1]
    device = logits.device
    k = to_device([vocab_size if v <= 0 else min(v, vocab_size) for v in top_k], device, torch.long)
    if all(p >= 1.0 for p in top_p):
        # Top-k only: a partial top-k is much cheaper than sorting the whole vocabulary.
        k_max = min(vocab_size, max((v for v in top_k if v > 0), default=vocab_size))
        kth = logits.topk(k_max, dim=-1).values.gather(1, (k.clamp(max=k_max) - 1)[:, None])
        # Rows without top-k keep everything.
        kth.masked_fill_((k == vocab_size)[:, None], float("-inf"))
        return logits.masked_fill(logits < kth, float("-inf"))

    sorted_logits, order = logits.sort(dim=-1, descending=True)
    kth = sorted_logits.gather(1, (k - 1)[:, None])
    sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))

    p = to_device(list(top_p), device, torch.float32)
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs
    # Rows with top_p = 1 are exempt: float rounding can push `before` past 1.0 in a long
    # tail of near-zero probabilities, and those tokens must stay sampleable.
    drop = (before >= p[:, None]) & (p < 1.0)[:, None]
    sorted_logits.masked_fill_(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
