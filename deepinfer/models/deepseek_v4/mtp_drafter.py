"""DeepSeek-V4's MTP layer as a drafter (`speculative_config={"method": "mtp"}`), reference path.

The MTP layer at position p reads the main model's last streams at p and the token at p + 1,
and predicts the token at p + 2 (mtp.py). To draft after the last sampled token t_n (position
n, not yet run through the model), it runs at position n - 1 with t_n: draft 1, the token at
n + 1. Draft j + 1 runs the same layer at the next position, on its own output streams and
draft j (DeepSeek's recursive use of one MTP layer). The layer's attention is a sliding window
over its own rows. A proposal carries that window on from the last one (rows of positions whose
main streams and next token are final: the few accepted since, then n - 1 with t_n), or, the
first time, builds it over the W positions before n - 1; either way from the main model's
streams, which every forward keeps in the request's ring slot
(`keep_streams`, rings.py) for the latest W + slack positions, by position (a verify step's
rejected positions are cut off by the next chunk's start, as the compressors' projections are).
Kept on the device from the step's tensors alone, they do not stop decode steps from replaying
as CUDA graphs. Drafts are only proposals: whatever they
are, verification keeps the output identical to decoding without them.

Under tensor parallelism every rank proposes (executor/ranked.py sends it the call): the MTP
layer's attention and MoE are split as the main layers' and meet in the same collectives, on
the same streams and tokens, so every rank runs the same number of layer calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from deepinfer.models.deepseek_v4.paged import chunk_rows
from deepinfer.models.deepseek_v4.rings import SLOT_KEY, ProjectionRings, RequestSlot
from deepinfer.models.deepseek_v4.state import LayerState
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


MTP_KEY = "mtp_window"   # the request's _MTPWindow in its model_state


@dataclass
class _MTPWindow:
    """The MTP layer's own window over positions before `end`: rows of main streams and sampled
    tokens only (never of drafts), so they stay right whatever later verification rejects."""

    end: int
    state: LayerState


@torch.no_grad()
def propose(model, requests: Sequence[DraftRequest], model_states: dict[str, dict]) -> dict[str, Draft]:
    """Drafts of every request whose main streams are known up to its last sampled token."""
    layer = model.mtp[0]
    # A sliding-window layer's state is its window alone, which a proposal can carry on from;
    # another kind (not in the release) has compressor state and is rebuilt at every proposal.
    incremental = layer.self_attn.compressor is None
    window = model.cfg.sliding_window
    device = model.lm_head.weight.device
    drafts: dict[str, Draft] = {}
    for request in requests:
        model_state = model_states.get(request.request_id, {})
        slot: RequestSlot | None = model_state.get(SLOT_KEY)
        n = len(request.token_ids) - 1            # position of the last sampled token
        if slot is None or not slot.index or request.max_drafts < 1 or not slot.first < n <= slot.end:
            continue
        # The layer's rows of positions [start, n - 1) from the main streams and the tokens after
        # them, then n - 1 with t_n: carried on from the window kept by the last proposal, or
        # rebuilt over the W positions before n - 1.
        kept: _MTPWindow | None = model_state.get(MTP_KEY) if incremental else None
        if kept is not None and kept.end <= n and n - kept.end <= model.rings.streams_length:
            start, state = kept.end, LayerState(window=kept.state.window)
        else:
            start, state = max(slot.first, n - window), LayerState()
        streams = model.rings.read_streams(slot, start, n)[None]                    # [1, L, N, hidden]
        next_ids = torch.tensor([list(request.token_ids[start + 1:n + 1])], device=device)
        positions = torch.arange(start, n, device=device)
        logits, out = layer(streams, next_ids, positions, state, model.model.embed_tokens, model.head_logits)
        if incremental:   # the drafts below replace state.window with new tensors: this one stays
            model_state[MTP_KEY] = _MTPWindow(n, LayerState(window=state.window))
        tokens, confidences = [], []
        for step in range(request.max_drafts):
            probs = torch.softmax(logits[0, -1].float(), dim=-1)
            token = int(probs.argmax())
            tokens.append(token)
            confidences.append(float(probs[token]))
            if step + 1 == request.max_drafts:
                break
            position = torch.tensor([n + step], device=device)
            logits, out = layer(out[:, -1:], torch.tensor([[token]], device=device), position, state,
                                model.model.embed_tokens, model.head_logits)
        drafts[request.request_id] = Draft(tokens, confidences)
    return drafts
