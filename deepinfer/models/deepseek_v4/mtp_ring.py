"""The MTP drafter's layer over every request at once, its window in a ring on the device, so that
a proposal for a batch is one forward per draft with static shapes, which a CUDA graph replays.

The MTP layer (mtp.py) attends a sliding window over its own K=V rows. Each request keeps them
in its slot of `rings.mtp_rows` [slots, length, head_dim], position p in row p % length
(length > the window + the drafts a proposal writes). A row of position q holds the layer's K=V
of (main streams at q, token at q + 1); rows below the request's first computed position (`low`)
were never written for it and are not attended.

A proposal for requests whose rows are final below m (m: the last proposal's n) runs
  catch-up  positions m .. n - 1 (1 to C = k + 1 rows a request, padded to C): the main
            streams kept in the streams ring and the accepted tokens after them; the last row,
            n - 1 with t_n, gives draft 1;
  drafts    k - 1 single rows: position n - 1 + s on the row before's output streams and draft s.
Each row writes its K=V into the ring before the rows attend (a row sees positions in
(p - window, p], never later ones), so the catch-up rows, all final, stay for the next
proposal, and the drafts' rows (positions >= n) are overwritten by its catch-up.
"""

from __future__ import annotations

import torch

from deepinfer.models.deepseek_v4.attention import V4Attention
from deepinfer.models.deepseek_v4.norm import unit_rms
from deepinfer.models.deepseek_v4.rings import ProjectionRings, ring_rows


def ring_attend(attn: V4Attention, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                lows: torch.Tensor, keep: torch.Tensor, ring: torch.Tensor) -> torch.Tensor:
    """The sliding-window attention of rows x [N, hidden] at `positions` [N] of the requests in
    `slots` [N] (their first computed positions `lows` [N]), over the ring's rows: [N, hidden]
    (o_b_proj applied). Rows not `keep` write their K=V to the padding slot."""
    n = x.shape[0]
    q_residual = attn.q_a_norm(attn.q_a_proj(x))
    q = attn.q_b_proj(q_residual).view(1, n, attn.heads, attn.head_dim)
    q = attn.rotary.rotate(unit_rms(q, attn.eps), positions)[0]                 # [N, H, D]
    kv = attn.rotary.rotate(attn.kv_norm(attn.kv_proj(x))[None, :, None], positions)[0, :, 0]
    length = ring.shape[1]
    ring.view(-1, ring.shape[-1])[ring_rows(slots, positions, length, keep)] = kv.to(ring.dtype)
    keys = ring[slots].to(q.dtype)                                               # [N, length, D]
    # The position row r holds for a query at p: the latest p' <= p with p' = r (mod length).
    held = positions[:, None] - (positions[:, None] - torch.arange(length, device=x.device)) % length
    sees = (held > positions[:, None] - attn.window) & (held >= lows[:, None])
    logits = torch.einsum("nhd,nld->nhl", q, keys) * attn.head_dim ** -0.5
    logits = logits.masked_fill(~sees[:, None], float("-inf"))
    sink = attn.sinks.to(logits.dtype).view(1, -1, 1).expand(n, -1, 1)
    probs = torch.cat([logits, sink], dim=-1).softmax(dim=-1)[..., :-1]
    out = torch.einsum("nhl,nld->nhd", probs.to(keys.dtype), keys)
    out = attn.rotary.rotate(out[None], positions, inverse=True)[0]
    return attn.o_b_proj(attn.o_a_proj(out.reshape(n, attn.o_groups, -1)).flatten(1))


def mtp_rows(model, streams: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
             lows: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """The MTP layer over N rows (flat: streams [N, hc_mult, hidden], the rest [N]): its output
    streams [N, hc_mult, hidden], each row's K=V kept in the ring where `keep`."""
    layer, ring = model.mtp[0], model.rings.mtp_rows
    e = layer.enorm(model.model.embed_tokens(next_ids[None]))
    x = layer.e_proj(e).unsqueeze(2) + layer.h_proj(layer.hnorm(streams[None]))
    attend = lambda h: ring_attend(layer.self_attn, h[0], positions, slots, lows, keep, ring)[None]  # noqa: E731
    return layer.run(x, attend, next_ids[None])[0]


def mtp_head(model, streams: torch.Tensor) -> torch.Tensor:
    """The MTP layer's logits of output streams [N, hc_mult, hidden]: [N, vocab]."""
    layer = model.mtp[0]
    return model.head_logits(layer.norm(layer.hc_head(streams[None]))[0])


def draft_batch(model, slots: torch.Tensor, firsts: torch.Tensor, counts: torch.Tensor, next_ids: torch.Tensor,
                lows: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One proposal for R requests (module docstring): slots, firsts (m), counts (n - m, 1..C),
    lows [R] and next_ids [R, C] (the token after each catch-up position, 0-padded) -> the k
    drafts [R, k] and their probabilities [R, k]. Static shapes, no host sync."""
    rings: ProjectionRings = model.rings
    r, c = next_ids.shape
    steps = torch.arange(c, device=next_ids.device)
    positions = (firsts[:, None] + steps).flatten()
    keep = (steps < counts[:, None]).flatten()
    row_slots, row_lows = slots.repeat_interleave(c), lows.repeat_interleave(c)
    streams = rings.streams_at(row_slots, positions)
    out = mtp_rows(model, streams, next_ids.flatten(), positions, row_slots, row_lows, keep)
    last = torch.arange(r, device=out.device) * c + counts - 1
    out, position = out[last], firsts + counts - 1                     # the row of n - 1
    tokens, probs = [], []
    for step in range(k):
        p = torch.softmax(mtp_head(model, out).float(), dim=-1)
        token = p.argmax(dim=-1)
        tokens.append(token)
        probs.append(p.gather(1, token[:, None])[:, 0])
        if step + 1 == k:
            break
        position = position + 1
        out = mtp_rows(model, out, token, position, slots, lows, torch.ones_like(token, dtype=torch.bool))
    return torch.stack(tokens, dim=1), torch.stack(probs, dim=1)


class MTPDraftGraphs:
    """draft_batch as CUDA graphs, one per (bucket of requests, k), captured on first use: the
    bucket's static inputs are copied in, the graph replays, its outputs are read. Padding
    requests use the rings' padding slot."""

    def __init__(self, model) -> None:
        self.model = model
        self.graphs: dict[tuple[int, int], tuple] = {}
        self.pool = None
        self.num_replays = 0

    @staticmethod
    def bucket_for(requests: int) -> int:
        return 1 << max(requests - 1, 0).bit_length()

    def _capture(self, bucket: int, k: int, device: torch.device) -> tuple:
        c = k + 1
        inputs = dict(slots=torch.zeros(bucket, dtype=torch.long, device=device),
                      firsts=torch.zeros(bucket, dtype=torch.long, device=device),
                      counts=torch.ones(bucket, dtype=torch.long, device=device),
                      next_ids=torch.zeros(bucket, c, dtype=torch.long, device=device),
                      lows=torch.zeros(bucket, dtype=torch.long, device=device))
        torch.cuda.synchronize(device)
        draft_batch(self.model, k=k, **inputs)          # warm-up: Triton compiles outside the capture
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = draft_batch(self.model, k=k, **inputs)
        self.pool = graph.pool()
        return graph, inputs, outputs

    def run(self, slots: torch.Tensor, firsts: torch.Tensor, counts: torch.Tensor, next_ids: torch.Tensor,
            lows: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        r = slots.shape[0]
        bucket = self.bucket_for(r)
        key = (bucket, k)
        if key not in self.graphs:
            self.graphs[key] = self._capture(bucket, k, slots.device)
        graph, inputs, (tokens, probs) = self.graphs[key]
        for name, value in (("slots", slots), ("firsts", firsts), ("counts", counts), ("next_ids", next_ids),
                            ("lows", lows)):
            inputs[name][:r].copy_(value)
        inputs["slots"][r:] = 0                          # padding requests: the padding slot
        inputs["counts"][r:] = 1
        graph.replay()
        self.num_replays += 1
        return tokens[:r], probs[:r]
