"""DeepSeek-V4's MTP layer as a drafter (`speculative_config={"method": "mtp"}`), reference path.

The MTP layer at position p reads the main model's last streams at p and the token at p + 1,
and predicts the token at p + 2 (mtp.py). To draft after the last sampled token t_n (position
n, not yet run through the model), it runs at position n - 1 with t_n: draft 1, the token at
n + 1. Draft j + 1 runs the same layer at the next position, on its own output streams and
draft j (DeepSeek's recursive use of one MTP layer). The layer's attention is a sliding window
over its own rows, so each proposal first rebuilds that window over the W positions before n - 1
from the main model's streams, which every forward keeps per request (`keep_streams`) for the
latest W + slack positions, by position (a verify step's rejected positions are cut off by the
next chunk's start, as paged.py's projections are). Drafts are only proposals: whatever they
are, verification keeps the output identical to decoding without them.

Under tensor parallelism every rank proposes (executor/ranked.py sends it the call): the MTP
layer's attention and MoE are split as the main layers' and meet in the same collectives, on
the same streams and tokens, so every rank runs the same number of layer calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from deepinfer.models.deepseek_v4.paged import ROLLBACK_SLACK
from deepinfer.models.deepseek_v4.state import LayerState
from deepinfer.types.drafter import Draft, DraftRequest

STREAMS_KEY = "mtp_streams"


@dataclass
class _Streams:
    """The main model's last-layer streams of positions [start, start + n): [n, hc_mult, hidden]."""

    start: int
    streams: torch.Tensor

    @property
    def end(self) -> int:
        return self.start + self.streams.shape[0]


def keep_streams(model_state: dict, start: int, streams: torch.Tensor, window: int) -> None:
    """After a forward over positions [start, start + len(streams)): keep the latest streams."""
    old: _Streams | None = model_state.get(STREAMS_KEY)
    if old is not None and old.start <= start <= old.end:
        streams = torch.cat([old.streams[:start - old.start], streams])
        start = old.start
    keep = window + ROLLBACK_SLACK
    cut = max(streams.shape[0] - keep, 0)
    model_state[STREAMS_KEY] = _Streams(start + cut, streams[cut:].clone())


@torch.no_grad()
def propose(model, requests: Sequence[DraftRequest], model_states: dict[str, dict]) -> dict[str, Draft]:
    """Drafts of every request whose main streams are known up to its last sampled token."""
    layer = model.mtp[0]
    window = model.cfg.sliding_window
    device = model.lm_head.weight.device
    drafts: dict[str, Draft] = {}
    for request in requests:
        kept: _Streams | None = model_states.get(request.request_id, {}).get(STREAMS_KEY)
        n = len(request.token_ids) - 1            # position of the last sampled token
        if kept is None or request.max_drafts < 1 or not kept.start < n <= kept.end:
            continue
        # Rebuild the MTP layer's window: positions [first, n - 1), then run n - 1 with t_n.
        first = max(kept.start, n - window)
        streams = kept.streams[first - kept.start:n - kept.start][None]         # [1, L, N, hidden]
        next_ids = torch.tensor([list(request.token_ids[first + 1:n + 1])], device=device)
        positions = torch.arange(first, n, device=device)
        state = LayerState()
        logits, out = layer(streams, next_ids, positions, state, model.model.embed_tokens, model.head_logits)
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
