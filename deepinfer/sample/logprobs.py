"""Log-probabilities reported to the user, for generated tokens and for prompt tokens.

These are RAW model logprobs: log_softmax of the logits exactly as the model produced them,
before logit_bias, penalties, temperature or any truncation (vLLM v1's default, "raw_logprobs").
They describe the model, not the sampling procedure, so they do not change when a user tweaks
temperature, and a token the sampler could never pick still has a finite logprob.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from deepinfer.outputs import Logprob
from deepinfer.platforms.transfer import to_host_async

# Bound on the float32 scratch of one chunk of prompt positions (elements, i.e. 256 MiB), so
# prompt_logprobs over a long prompt and a large vocabulary never materialises all at once.
_CHUNK_ELEMENTS = 1 << 26


@dataclass
class TopLogprobs:
    """Logprobs at one position: the chosen token's, plus the k most likely tokens'.

    token_id / logprob / rank: the token actually at this position (sampled, or the next
        prompt token) with its rank under the model (1 = most likely).
    top_token_ids / top_logprobs: the k most likely tokens, best first (k may be 0).
    """

    token_id: int
    logprob: float
    rank: int
    top_token_ids: list[int]
    top_logprobs: list[float]

    def to_dict(self, decode: Callable[[int], str] | None = None) -> dict[int, Logprob]:
        """vLLM's per-position shape: {token_id: Logprob}, the chosen token first."""
        out = {self.token_id: Logprob(self.logprob, self.rank,
                                      decode(self.token_id) if decode else None)}
        for rank, (tid, lp) in enumerate(zip(self.top_token_ids, self.top_logprobs), start=1):
            if tid not in out:
                out[tid] = Logprob(lp, rank, decode(tid) if decode else None)
        return out


@dataclass
class LogprobTensors:
    """The tensors behind a list of TopLogprobs, before they become Python numbers.

    Kept apart so that a step can start the device-to-host copy (`to_host`) and read the
    numbers later (`tolist`), without waiting on the device in between (overlapped scheduling).
    """

    token_ids: torch.Tensor     # [rows]
    chosen: torch.Tensor        # [rows] logprob of token_ids
    ranks: torch.Tensor         # [rows]
    top_ids: torch.Tensor | None      # [rows, k_max], None when no row wants a top-k
    top_values: torch.Tensor | None
    wanted: list[int]           # per row: how many of the top entries it wants

    def to_host(self) -> LogprobTensors:
        """Copies on the host, started without waiting (pinned memory); valid once the step's
        device work is done (the runner waits on its event before `tolist`)."""
        return LogprobTensors(*(None if t is None else to_host_async(t) for t in
                                (self.token_ids, self.chosen, self.ranks, self.top_ids, self.top_values)),
                              self.wanted)

    def tolist(self) -> list[TopLogprobs]:
        if self.top_ids is not None:
            top_ids, top_values = self.top_ids.tolist(), self.top_values.tolist()
        else:
            top_ids = top_values = [[] for _ in self.wanted]
        return [
            TopLogprobs(token_id=tid, logprob=lp, rank=rank, top_token_ids=ids[:k], top_logprobs=values[:k])
            for tid, lp, rank, ids, values, k in zip(
                self.token_ids.tolist(), self.chosen.tolist(), self.ranks.tolist(), top_ids, top_values,
                self.wanted)
        ]


def top_logprob_tensors(logits: torch.Tensor, token_ids: torch.Tensor, num_top: list[int]) -> LogprobTensors:
    """Raw logprobs for each row of `logits` [rows, vocab] at `token_ids` [rows], on the device.

    num_top[i] is how many top entries row i wants (-1 = the whole vocabulary).
    """
    vocab_size = logits.shape[-1]
    logprobs = logits.to(torch.float32).log_softmax(dim=-1)
    token_ids = token_ids.view(-1).to(logprobs.device)
    chosen = logprobs.gather(1, token_ids.view(-1, 1)).squeeze(1)
    # rank = 1 + number of tokens strictly more likely; ties share the better rank.
    ranks = (logprobs > chosen[:, None]).sum(dim=-1) + 1
    wanted = [vocab_size if k == -1 else min(k, vocab_size) for k in num_top]
    k_max = max(wanted, default=0)
    top_values = top_ids = None
    if k_max > 0:
        top_values, top_ids = logprobs.topk(k_max, dim=-1)
    return LogprobTensors(token_ids, chosen, ranks, top_ids, top_values, wanted)


def top_logprobs(logits: torch.Tensor, token_ids: torch.Tensor,
                 num_top: list[int]) -> list[TopLogprobs]:
    """Raw logprobs for each row of `logits` [rows, vocab] at `token_ids` [rows], as Python objects."""
    return top_logprob_tensors(logits, token_ids, num_top).tolist()


def compute_prompt_logprobs(logits: torch.Tensor, target_ids: torch.Tensor,
                            k: int) -> list[TopLogprobs]:
    """Raw logprobs of prompt tokens: logits[i] is the model's prediction for target_ids[i].

    The caller aligns them: for prompt tokens p0..pn, logits at positions 0..n-1 predict
    p1..pn, so target_ids = prompt[1:] and the result has one entry per prompt token after
    the first (whose entry in RequestOutput.prompt_logprobs is None). k is
    params.prompt_logprobs.
    """
    if logits.shape[0] != target_ids.shape[0]:
        raise ValueError(f"prompt logprobs need one target per logits row, got "
                         f"{logits.shape[0]} rows and {target_ids.shape[0]} targets")
    chunk = max(1, _CHUNK_ELEMENTS // max(1, logits.shape[-1]))
    results: list[TopLogprobs] = []
    for start in range(0, logits.shape[0], chunk):
        end = start + chunk
        results.extend(top_logprobs(logits[start:end], target_ids[start:end],
                                    [k] * (min(end, logits.shape[0]) - start)))
    return results
