"""Lossless verification of draft chains from one target forward.

A request verified with drafts d_1..d_m contributes m + 1 rows of target logits: row j is the
target's distribution for the token after (context, d_1..d_j). Rows are processed exactly as the
sampler processes its one row (logit_bias, allowed ids, min_tokens, penalties with the drafts
counted as output, temperature, top-k/top-p, min-p), so "the target distribution" below is the
distribution plain sampling would draw from.

  greedy (temperature 0): accept d_j while it equals the argmax of row j-1; the first mismatch
      is replaced by that argmax; if all m match, the argmax of row m is a bonus token.
  sampling: drafts are point masses (drafter.py), so speculative sampling reduces to: accept
      d_j with probability p_j(d_j); on rejection draw from p_j with d_j removed and
      renormalised, and stop. P(emit x) = p(d)[x = d] + (1 - p(d)) p(x) / (1 - p(d)) [x != d]
      = p(x): every emitted token has the target distribution given what precedes it.

Either way a request gets between 1 and m + 1 tokens, the first `num_accepted` being drafts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from deepinfer.sample.sampler import Sampler, SamplingRow, needs_edit, sampling_probs


@dataclass
class VerifyRequest:
    drafts: list[int]
    # m + 1 rows: row j sees the drafts before it as output tokens (for penalties, min_tokens).
    rows: list[SamplingRow]
    generator: torch.Generator | None = None   # seeded request: all draws of this step come from it


@dataclass
class VerifyResult:
    token_ids: list[int]      # accepted drafts, then one target token
    num_accepted: int


def verify(logits: torch.Tensor, requests: Sequence[VerifyRequest]) -> list[VerifyResult]:
    """logits: [sum(len(r.rows)), vocab], the requests' rows back to back, in order."""
    rows = [row for r in requests for row in r.rows]
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits must be [{len(rows)}, vocab] (one row per draft + 1), got {tuple(logits.shape)}")
    for r in requests:
        if len(r.rows) != len(r.drafts) + 1:
            raise ValueError(f"a request with {len(r.drafts)} drafts needs {len(r.drafts) + 1} rows, got {len(r.rows)}")
    if all(row.params.temperature == 0 and not needs_edit(row.params, row) for row in rows):
        # Hot path: greedy without edits, one argmax over every row (no float32 copy).
        return accept_greedy(requests, logits.argmax(dim=-1).tolist())

    offsets = _offsets(requests)
    x = logits.to(torch.float32, copy=True)
    Sampler._edit_logits(x, rows)
    argmax = x.argmax(dim=-1).tolist()
    results: list[VerifyResult | None] = [None] * len(requests)
    random_ids = []
    for i, r in enumerate(requests):
        if r.rows[0].params.temperature == 0:
            results[i] = greedy_verdict(r.drafts, argmax[offsets[i]:offsets[i + 1]])
        else:
            random_ids.append(i)
    if random_ids:
        index = torch.tensor([j for i in random_ids for j in range(offsets[i], offsets[i + 1])],
                             dtype=torch.long, device=x.device)
        probs = sampling_probs(x[index], [rows[j] for j in index.tolist()])
        for i, result in zip(random_ids, _accept_random(probs, [requests[i] for i in random_ids])):
            results[i] = result
    return results  # type: ignore[return-value]


def accept_greedy(requests: Sequence[VerifyRequest], argmax: list[int]) -> list[VerifyResult]:
    """Verdicts from every row's argmax (the requests' m + 1 rows back to back; only their
    drafts are read, so a caller that knows the rows are plain greedy may leave `rows` empty:
    the runner, which takes the argmax to the host and the verdicts at collect)."""
    offsets = _offsets(requests)
    return [greedy_verdict(r.drafts, argmax[offsets[i]:offsets[i + 1]]) for i, r in enumerate(requests)]


def _offsets(requests: Sequence[VerifyRequest]) -> list[int]:
    offsets = [0]
    for r in requests:
        offsets.append(offsets[-1] + len(r.drafts) + 1)
    return offsets


def greedy_verdict(drafts: list[int], argmax: list[int]) -> VerifyResult:
    """One request's greedy verdict: the leading drafts equal to the argmax of the rows before
    them, then the argmax after the last of those (argmax: the request's m + 1 rows)."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == argmax[accepted]:
        accepted += 1
    return VerifyResult(drafts[:accepted] + [argmax[accepted]], accepted)


def _accept_random(probs: torch.Tensor, requests: Sequence[VerifyRequest]) -> list[VerifyResult]:
    """Point-mass speculative sampling; probs holds each request's m + 1 rows back to back."""
    device = probs.device
    draft_rows, draft_ids = [], []
    offset = 0
    for r in requests:
        draft_rows.extend(range(offset, offset + len(r.drafts)))
        draft_ids.extend(r.drafts)
        offset += len(r.rows)
    p_draft: list[float] = []
    if draft_rows:
        p_draft = probs[torch.tensor(draft_rows, device=device),
                        torch.tensor(draft_ids, device=device)].tolist()

    # Per request: the first rejected position (or m: all accepted), then one final row to sample.
    final_rows, masked_ids, accepted_counts = [], [], []
    offset = cursor = 0
    for r in requests:
        m = len(r.drafts)
        # NOTE: seeded requests draw their uniforms and their final noise from their own
        # generator only, so the result depends on the seed and the logits, not the batch.
        uniforms = torch.rand(m, generator=r.generator, device=device).tolist() if m else []
        accepted = 0
        while accepted < m and uniforms[accepted] < p_draft[cursor + accepted]:
            accepted += 1
        final_rows.append(offset + accepted)
        masked_ids.append(r.drafts[accepted] if accepted < m else -1)   # -1: bonus, nothing removed
        accepted_counts.append(accepted)
        offset += len(r.rows)
        cursor += m

    final = probs[torch.tensor(final_rows, device=device)]
    rejected = [row for row, token_id in enumerate(masked_ids) if token_id >= 0]
    if rejected:
        rows_t = torch.tensor(rejected, device=device)
        ids_t = torch.tensor([masked_ids[row] for row in rejected], device=device)
        final[rows_t, ids_t] = 0.0   # the rejected draft: the residual excludes it
        # An empty residual is only reachable when p(draft) rounds to 1 and the uniform still
        # exceeded it; the draft is then the only token left.
        empty = final[rows_t].sum(dim=-1) <= 0
        final[rows_t[empty], ids_t[empty]] = 1.0
    noise = torch.empty_like(final)
    for row, r in enumerate(requests):
        noise[row].exponential_(generator=r.generator)
    # Exponential race: argmax(w / E) picks token t with probability w[t] / sum(w), so the
    # residual needs no explicit renormalisation. The clamp keeps a zero draw finite.
    noise.clamp_(min=torch.finfo(torch.float32).tiny)
    sampled = (final / noise).argmax(dim=-1).tolist()
    return [VerifyResult(r.drafts[:a] + [t], a) for r, a, t in zip(requests, accepted_counts, sampled)]
