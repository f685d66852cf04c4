"""DeepSeek-V4's MTP layer as a drafter (`speculative_config={"method": "mtp"}`).

The MTP layer at position p reads the main model's last streams at p and the token at p + 1,
and predicts the token at p + 2 (mtp.py). To draft after the last sampled token t_n (position
n, not yet run through the model), it runs at position n - 1 with t_n: draft 1, the token at
n + 1. Draft j + 1 runs the same layer at the next position, on its own output streams and
draft j (DeepSeek's recursive use of one MTP layer).

Every forward keeps each request's main streams in its ring slot (`keep_streams`, rings.py) for
the latest W + slack positions, by position (a verify step's rejected positions are cut off by
the next chunk's start, as the compressors' projections are), on the device from the step's
tensors alone, so decode steps still replay as CUDA graphs. The MTP layer's own window (its K=V
rows) is kept in the rings too: a proposal computes only the positions accepted since the last
one, then the drafts, for every request in one batch (mtp_ring.py), replayed as a CUDA graph
where the model captures them; a request's first proposal builds the window over the W
positions before n - 1 first (`_fill`). Drafts are only proposals: whatever they are,
verification keeps the output identical to decoding without them.

Under tensor parallelism every rank proposes (executor/ranked.py sends it the call): the MTP
layer's attention and MoE are split as the main layers' and meet in the same collectives, on
the same streams and tokens, so every rank runs the same number of layer calls.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deepinfer.models.deepseek_v4.mtp_ring import draft_batch, mtp_rows
from deepinfer.models.deepseek_v4.paged import chunk_rows
from deepinfer.models.deepseek_v4.rings import SLOT_KEY, ProjectionRings, RequestSlot
from deepinfer.types.drafter import Draft, DraftRequest


def keep_streams(meta, streams: torch.Tensor) -> None:
    """After a forward: each request's latest main streams [T, hc_mult, hidden] into its ring
    slot (rings.py). The Triton path's metadata has every token's slot and segment on the
    device (step_metadata.py); the reference path's chunks are written one by one."""
    rings: ProjectionRings = meta.rings
    length = rings.streams_length
    if meta.backend.kernels:
        positions = meta.tok_pos.long()
        rings.write_streams(meta.tok_slot, positions, positions >= meta.seg_end - length, streams)
        return
    for chunk, a, b in chunk_rows(meta.step):
        slot = chunk.model_state[SLOT_KEY]
        positions = torch.arange(chunk.start, chunk.start + b - a, device=streams.device)
        keep = positions >= chunk.start + b - a - length
        rings.write_streams(torch.full_like(positions, slot.index), positions, keep, streams[a:b])


MTP_KEY = "mtp_window"   # the request's (m, low) in its model_state: MTP rows final below m, none below low


@torch.no_grad()
def propose(model, requests: Sequence[DraftRequest], model_states: dict[str, dict]) -> dict[str, Draft]:
    """Drafts of every request whose main streams are known up to its last sampled token, all
    requests in one batch (mtp_ring.draft_batch; a CUDA graph where the model replays them)."""
    window = model.cfg.sliding_window
    device = model.lm_head.weight.device
    k = max((r.max_drafts for r in requests), default=0)
    ready = []   # (request, model_state, slot, n, m, low)
    for request in requests:
        model_state = model_states.get(request.request_id, {})
        slot: RequestSlot | None = model_state.get(SLOT_KEY)
        n = len(request.token_ids) - 1            # position of the last sampled token
        if slot is None or not slot.index or request.max_drafts < 1 or not slot.first < n <= slot.end:
            continue
        kept = model_state.get(MTP_KEY)
        if kept is not None and 1 <= n - kept[0] <= k + 1:
            m, low = kept
        else:   # the first proposal (or a gap): the window's rows over the W positions before n - 1
            low, m = max(slot.first, n - window), n - 1
            _fill(model, request, slot, low, m, device)
        ready.append((request, model_state, slot, n, m, low))
    if not ready:
        return {}
    c = k + 1
    ids = [list(req.token_ids[m + 1:n + 1]) for req, _, _, n, m, _ in ready]
    as_tensor = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
    args = dict(slots=as_tensor([slot.index for _, _, slot, _, _, _ in ready]),
                firsts=as_tensor([m for *_, m, _ in ready]), counts=as_tensor([len(i) for i in ids]),
                next_ids=as_tensor([i + [0] * (c - len(i)) for i in ids]), lows=as_tensor([low for *_, low in ready]))
    graphs = model.mtp_graphs
    tokens, probs = graphs.run(**args, k=k) if graphs is not None else draft_batch(model, **args, k=k)
    tokens, probs = tokens.tolist(), probs.tolist()
    drafts: dict[str, Draft] = {}
    for i, (request, model_state, _, n, _, low) in enumerate(ready):
        model_state[MTP_KEY] = (n, low)
        drafts[request.request_id] = Draft(tokens[i][:request.max_drafts], probs[i][:request.max_drafts])
    return drafts


def _fill(model, request: DraftRequest, slot: RequestSlot, low: int, end: int, device: torch.device) -> None:
    """The MTP layer's rows of positions [low, end) of one request into its ring, eagerly."""
    if end <= low:
        return
    positions = torch.arange(low, end, device=device)
    slots = torch.full_like(positions, slot.index)
    next_ids = torch.tensor(list(request.token_ids[low + 1:end + 1]), dtype=torch.long, device=device)
    mtp_rows(model, model.rings.streams_at(slots, positions), next_ids, positions, slots,
             torch.full_like(positions, low), torch.ones_like(positions, dtype=torch.bool))
