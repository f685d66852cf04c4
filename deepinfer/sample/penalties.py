"""Logit processors that depend on a request's history or its explicit token lists.

Every function here edits a float32 `logits` tensor in place, touching only the rows it is
given (`row_ids` index into the batch), so the sampler can skip rows that need nothing.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from deepinfer.platforms.transfer import to_device


def _flat_index(row_ids: Sequence[int], token_lists: Sequence[Sequence[int]], vocab_size: int,
                device: torch.device) -> torch.Tensor:
    """Indices into logits.view(-1) of every (row, token) pair: row * vocab_size + token."""
    # Built on the CPU with one list->tensor conversion (prompts can be long; a Python loop
    # per token would dominate the step), then moved to the device in one copy.
    tokens = torch.tensor(list(itertools.chain.from_iterable(token_lists)), dtype=torch.long)
    lengths = torch.tensor([len(t) for t in token_lists], dtype=torch.long)
    rows = torch.repeat_interleave(torch.tensor(list(row_ids), dtype=torch.long), lengths)
    return to_device(rows * vocab_size + tokens, device)


def apply_allowed_token_ids(logits: torch.Tensor, row_ids: Sequence[int],
                            allowed: Sequence[Sequence[int]]) -> None:
    """Mask every token outside each row's allowed list."""
    vocab_size = logits.shape[-1]
    keep = torch.zeros(logits.numel(), dtype=torch.bool, device=logits.device)
    keep[_flat_index(row_ids, allowed, vocab_size, logits.device)] = True
    keep = keep.view_as(logits)
    rows = to_device(list(row_ids), logits.device, torch.long)
    # Only the listed rows are restricted; the others keep their whole vocabulary.
    restricted = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
    restricted[rows] = True
    logits.masked_fill_(restricted[:, None] & ~keep, float("-inf"))


def apply_logit_bias(logits: torch.Tensor, row_ids: Sequence[int],
                     biases: Sequence[dict[int, float]]) -> None:
    """Add each row's {token_id: bias} to its logits."""
    vocab_size = logits.shape[-1]
    index = _flat_index(row_ids, [list(b) for b in biases], vocab_size, logits.device)
    values = to_device([v for b in biases for v in b.values()], logits.device, logits.dtype)
    logits.view(-1).index_add_(0, index, values)


def mask_tokens(logits: torch.Tensor, row_ids: Sequence[int],
                token_lists: Sequence[Sequence[int]]) -> None:
    """Set the listed tokens of each listed row to -inf (min_tokens, bad_words)."""
    index = _flat_index(row_ids, token_lists, logits.shape[-1], logits.device)
    logits.view(-1)[index] = float("-inf")


def bad_word_tokens(bad_words: Sequence[Sequence[int]], output_token_ids: Sequence[int]) -> list[int]:
    """The tokens `bad_words` (token sequences) forbid next: each sequence's last token, where the
    output so far ends with the rest of it (vLLM's bad_words; a one-token word always)."""
    banned = []
    for word in bad_words:
        prefix = len(word) - 1
        if prefix > len(output_token_ids):
            continue
        if prefix == 0 or list(output_token_ids[len(output_token_ids) - prefix:]) == list(word[:-1]):
            banned.append(word[-1])
    return banned


def apply_penalties(logits: torch.Tensor, row_ids: Sequence[int],
                    prompt_token_ids: Sequence[Sequence[int]],
                    output_token_ids: Sequence[Sequence[int]],
                    presence: Sequence[float], frequency: Sequence[float],
                    repetition: Sequence[float]) -> None:
    """Repetition, then frequency and presence penalties, on the listed rows.

    repetition (HF / CTRL, arXiv:1909.05858): every token seen in the prompt or the output has
        its logit divided by the penalty when positive and multiplied by it when negative, so
        a penalty > 1 always makes the token less likely.
    frequency and presence (OpenAI): over output tokens only,
        logit -= frequency * count(token) + presence * (count(token) > 0).
    """
    device = logits.device
    vocab_size = logits.shape[-1]
    num = len(row_ids)
    local = list(range(num))
    rows = to_device(list(row_ids), device, torch.long)
    sub = logits[rows]  # a copy of just these rows; written back at the end

    # counts[i, t] = how often row i generated token t.
    counts = torch.zeros(num * vocab_size, dtype=torch.float32, device=device)
    out_index = _flat_index(local, output_token_ids, vocab_size, device)
    counts.index_add_(0, out_index, torch.ones_like(out_index, dtype=torch.float32))
    counts = counts.view(num, vocab_size)
    generated = counts > 0

    rep = to_device(list(repetition), device, torch.float32)[:, None]
    if any(r != 1 for r in repetition):   # decided on the host: no wait for the device
        seen = torch.zeros(num * vocab_size, dtype=torch.bool, device=device)
        seen[_flat_index(local, prompt_token_ids, vocab_size, device)] = True
        seen = seen.view(num, vocab_size) | generated
        penalized = torch.where(sub > 0, sub / rep, sub * rep)
        sub = torch.where(seen, penalized, sub)

    freq = to_device(list(frequency), device, torch.float32)[:, None]
    pres = to_device(list(presence), device, torch.float32)[:, None]
    sub = sub - freq * counts - pres * generated.to(torch.float32)
    logits[rows] = sub
