"""DeepSeek-V4's MTP drafter on the device rings (mtp_ring.py, mtp_drafter.propose) against the MTP
layer's reference (mtp.py on a LayerState, its window rebuilt from the same main streams): the
same drafts and probabilities, for a batch of requests of different lengths, at a first proposal
(the window built over the positions before n - 1) and at the next (only the positions accepted
since computed, the rest carried in the ring). Float32, tiny random weights; the streams are
random too (the drafter reads whatever the main model kept)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
from test_deepseek_v4_layers import make_config, randomize  # noqa: E402

from deepinfer.models.deepseek_v4.engine import DeepseekV4ForCausalLM  # noqa: E402
from deepinfer.models.deepseek_v4.mtp_drafter import propose  # noqa: E402
from deepinfer.models.deepseek_v4.state import LayerState  # noqa: E402
from deepinfer.types.drafter import DraftRequest  # noqa: E402

K = 3


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = make_config("r4_16")
    ours = DeepseekV4ForCausalLM({**cfg.to_dict(), "architectures": ["DeepseekV4ForCausalLM"]})
    randomize(ours, 3, cfg)
    ours.rings.allocate(4, 1 + K, torch.device("cpu"), torch.float32)
    return ours.eval()


@torch.no_grad()
def reference_drafts(model, streams: torch.Tensor, token_ids: list[int], n: int, k: int):
    """The MTP layer over positions [max(0, n - W), n) from scratch, then k - 1 draft steps."""
    layer, window = model.mtp[0], model.cfg.sliding_window
    start = max(0, n - window)
    state = LayerState()
    logits, out = layer(streams[start:n][None], torch.tensor([token_ids[start + 1:n + 1]]), torch.arange(start, n),
                        state, model.model.embed_tokens, model.head_logits)
    tokens, probs = [], []
    for step in range(k):
        p = torch.softmax(logits[0, -1].float(), dim=-1)
        tokens.append(int(p.argmax()))
        probs.append(float(p.max()))
        if step + 1 < k:
            logits, out = layer(out[:, -1:], torch.tensor([[tokens[-1]]]), torch.tensor([n + step]), state,
                                model.model.embed_tokens, model.head_logits)
    return tokens, probs


@torch.no_grad()
def test_ring_drafts_match_the_layer_reference(model):
    cfg = model.cfg
    lengths = {"a": 9, "b": cfg.sliding_window + 7, "c": 3}      # one past the window, one short
    g = torch.Generator().manual_seed(1)
    streams = {r: torch.randn(n + K + 2, cfg.hc_mult, cfg.hidden_size, generator=g) for r, n in lengths.items()}
    tokens = {r: torch.randint(0, cfg.vocab_size, (n + K + 2,), generator=g).tolist() for r, n in lengths.items()}
    states = {r: {} for r in lengths}
    for r, n in lengths.items():   # what the main model's forwards kept: streams of positions < n + 2
        slot = model.rings.slot(states[r], 0)
        slot.end = n + 2
        positions = torch.arange(n + 2)
        model.rings.write_streams(torch.full_like(positions, slot.index), positions,
                                  torch.ones_like(positions, dtype=torch.bool), streams[r][:n + 2])
    for accepted in (0, 2):        # a first proposal at n, then the next after two more tokens
        requests = [DraftRequest(r, tokens[r][:n + accepted + 1], K) for r, n in lengths.items()]
        drafts = propose(model, requests, states)
        for r, n in lengths.items():
            want_tokens, want_probs = reference_drafts(model, streams[r], tokens[r], n + accepted, K)
            assert drafts[r].token_ids == want_tokens, (r, accepted)
            assert drafts[r].confidences == pytest.approx(want_probs, abs=1e-5), (r, accepted)
