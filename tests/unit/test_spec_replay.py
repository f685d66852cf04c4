"""The replay drafter (a recorded continuation at a set acceptance rate) and the decode-row layout
of verifications that CUDA graphs replay, checked on the CPU."""

from __future__ import annotations

import json
import random

import pytest
import torch

from deepinfer.config import EngineConfig
from deepinfer.kv_cache.specs import FullAttentionSpec, SlidingWindowSpec, group_layers
from deepinfer.layers.attention import Attention, forward_context
from deepinfer.spec_decode.replay import Recording, ReplayDrafter
from deepinfer.types.drafter import DraftRequest
from deepinfer.worker.input_batch import build_step_inputs, num_decode_rows
from deepinfer.worker.request_states import StepChunk

PROMPT = [5, 6, 7, 8]
OUTPUT = list(range(100, 164))


def test_replay_keeps_each_draft_with_the_recorded_acceptance_and_the_same_one_every_time():
    recordings = [Recording([1, i], OUTPUT[:20], 0.7) for i in range(200)]
    drafter = ReplayDrafter(recordings, vocab_size=1000, seed=3)
    kept = total = 0
    for i in range(200):
        for done in (1, 6, 11, 16):
            draft = drafter.propose([DraftRequest(f"r{i}", [1, i] + OUTPUT[:done], 5)])[f"r{i}"]
            truth = OUTPUT[done:min(done + 5, 20)]
            assert len(draft.token_ids) == len(truth) and draft.confidences == [0.7] * len(truth)
            assert all(0 <= d < 1000 for d in draft.token_ids)
            kept += sum(d == t for d, t in zip(draft.token_ids, truth))
            total += len(truth)
    assert abs(kept / total - 0.7) < 0.03
    # Which positions are changed is drawn once: another drafter over the same file (another
    # engine, verification mode or batch size) proposes the same drafts.
    again = ReplayDrafter(recordings, vocab_size=1000, seed=3)
    request = [DraftRequest("x", [1, 7] + OUTPUT[:3], 5)]
    assert again.propose(request)["x"].token_ids == drafter.propose(request)["x"].token_ids


def test_replay_stops_at_the_recording_end_and_when_a_request_leaves_it():
    drafter = ReplayDrafter([Recording(PROMPT, OUTPUT[:8], 1.0), Recording([1, 2], [3, 4, 5], 1.0)], 1000)
    assert drafter.propose([DraftRequest("a", PROMPT + OUTPUT[:6], 5)])["a"].token_ids == OUTPUT[6:8]
    assert drafter.propose([DraftRequest("a", PROMPT + OUTPUT[:8], 5)]) == {}   # nothing recorded past the end
    assert drafter.propose([DraftRequest("b", [1, 2, 3], 5)])["b"].token_ids == [4, 5]   # the other prompt
    # A request whose output differs from the recording gets no drafts from then on.
    assert drafter.propose([DraftRequest("c", PROMPT + [OUTPUT[0], 999], 5)]) == {}
    assert drafter.propose([DraftRequest("c", PROMPT + [OUTPUT[0], 999, OUTPUT[2]], 5)]) == {}
    assert drafter.num_diverged == 1
    assert drafter.propose([DraftRequest("d", [9, 9, 9], 5)]) == {}   # no recording for this prompt
    drafter.release({"b"})
    assert set(drafter._follows) == {"b"}


def test_replay_config_and_file_errors_name_the_field(tmp_path):
    with pytest.raises(ValueError, match="replay_path"):
        EngineConfig.from_kwargs(speculative_config={"method": "replay"})
    with pytest.raises(ValueError, match="replay_path"):
        EngineConfig.from_kwargs(speculative_config={"method": "ngram", "replay_path": "x"})
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt_token_ids": [1], "output_token_ids": [2], "acceptance": 1.5}) + "\n")
    with pytest.raises(ValueError, match="line 1: .*acceptance"):
        ReplayDrafter.load(str(bad), 10)
    with pytest.raises(ValueError, match="cannot be read"):
        ReplayDrafter.load(str(tmp_path / "absent.jsonl"), 10)


@pytest.mark.parametrize("window", [None, 24])
def test_verifications_laid_out_as_decode_rows_attend_like_prefill_chunks(window):
    """What a CUDA graph replays for a verify step (one decode row per query, each attending up to
    its own position) gives the same attention as the prefill layout the eager path uses; the
    step's chunks stay the scheduled ones, each verifying chunk's last row at last_token_index.
    A short continuation of known tokens (a draft model catching up) is laid out the same way."""
    torch.manual_seed(0)
    rng = random.Random(0)
    bs, num_blocks, kv_heads, head_dim = 8, 64, 2, 16
    spec = (SlidingWindowSpec(kv_heads, head_dim, torch.float32, sliding_window=window) if window
            else FullAttentionSpec(kv_heads, head_dim, torch.float32))
    groups = group_layers([spec])
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    chunks = []
    token_ids = {}
    # (drafts, known tokens) a chunk; plain decodes first: both layouts order rows alike.
    for i, (drafts, known) in enumerate([(0, 1), (0, 1), (3, 1), (5, 1), (1, 1), (0, 4)]):
        context = rng.randint(1, 60)
        blocks = [free.pop() for _ in range(-(-(context + known + drafts) // bs))]
        chunks.append(StepChunk(f"r{i}", context, known + drafts, [blocks], True, spec_token_ids=[7] * drafts))
        token_ids[f"r{i}"] = list(range(context + known))
    assert num_decode_rows(chunks, window or 0) == 2 + 4 + 6 + 2 + 4
    cache = (torch.randn(num_blocks * bs, kv_heads, head_dim), torch.randn(num_blocks * bs, kv_heads, head_dim))
    layer = Attention(0, 4, kv_heads, head_dim, scale=head_dim ** -0.5, sliding_window=window)
    q, k, v = (torch.randn(18, n, head_dim) for n in (4, kv_heads, kv_heads))
    outs, layouts = [], []
    for as_decodes in (False, True):
        caches = [(cache[0].clone(), cache[1].clone())]
        inputs = build_step_inputs(chunks, token_ids, groups, bs, [0], [0], caches, torch.device("cpu"),
                                   backend="reference", rows_as_decodes=as_decodes)
        with forward_context(inputs.attention):
            outs.append(layer(q, k, v))
        layouts.append(inputs)
    plain, rows = layouts
    assert rows.attention.num_decode_tokens == 18 and plain.attention.num_decode_tokens == 2
    assert [c.request_id for c in rows.chunks] == [c.request_id for c in plain.chunks]
    assert rows.last_token_index == plain.last_token_index == [0, 1, 5, 11, 13, 17]
    assert torch.equal(rows.input_ids, plain.input_ids) and torch.equal(rows.positions, plain.positions)
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)


def test_only_short_continuations_become_decode_rows():
    """A prompt from its start, a continuation longer than MAX_CONTINUATION_ROWS, or one asking
    for prompt logprobs takes the prefill path (no CUDA graph replays its step)."""
    from deepinfer.worker.input_batch import MAX_CONTINUATION_ROWS

    assert num_decode_rows([StepChunk("r", 8, MAX_CONTINUATION_ROWS, [[1, 2, 3]], True)], 0) == MAX_CONTINUATION_ROWS
    assert num_decode_rows([StepChunk("r", 0, 3, [[1]], True)], 0) is None
    assert num_decode_rows([StepChunk("r", 8, MAX_CONTINUATION_ROWS + 1, [[1, 2, 3]], True)], 0) is None
    assert num_decode_rows([StepChunk("r", 8, 3, [[1, 2]], True, prompt_logprobs=True)], 0) is None


def test_a_verification_under_a_live_window_floor_stays_a_prefill_chunk():
    chunk = StepChunk("r", 10, 3, [[1, 2]], True, spec_token_ids=[7, 7], window_floor=4)
    assert num_decode_rows([chunk], 8) is None     # position 10's window reaches below the floor
    assert num_decode_rows([chunk], 4) == 3        # a narrower window no longer does
