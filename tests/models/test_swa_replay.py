"""SWA Bounded Replay end to end on a tiny random Gemma 3 (sliding and global layers), checked
against transformers, a reference no one here wrote.

The follow-up turn finds the first turn's full-attention blocks cached but its sliding-window
blocks gone (swa_retention_s=0). With replay of N tokens from position R, the engine computes
tokens [R, end) with the sliding layers attending only inside [R, ...). In "recompute" mode that
is exactly: transformers runs tokens [0, R) normally (its cache holds their exact K/V), then
tokens [R, end) and the greedy decode after them with a per-layer-type attention mask whose
sliding part hides every key below R. Greedy tokens must be identical and logprobs close.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams
from tests.models.tiny_models import build_tiny_checkpoint

BS = 4
WINDOW = 16
NEW_TOKENS = 12
FIRST_TURN = [(11 * i + 5) % 500 + 2 for i in range(64)]       # 16 full blocks
FOLLOW_UP = FIRST_TURN + [(3 * i + 7) % 500 + 2 for i in range(9)]


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("gemma3-replay"))
    model = build_tiny_checkpoint("gemma3", directory, sliding_window=WINDOW)
    return directory, model


def replay_start(num_replay: int) -> int:
    """Where the engine resumes: the full groups hold the first turn's 16 blocks; replay the
    last `num_replay` tokens of them, rounded down to a block."""
    cached = len(FIRST_TURN) // BS * BS
    return max(cached - num_replay, 0) // BS * BS


def masks(model, query_positions: list[int], num_keys: int, floor: int) -> dict[str, torch.Tensor]:
    """Additive masks [1, 1, queries, keys] per layer type: causal for global layers, the window
    cut at `floor` for sliding ones."""
    q = torch.tensor(query_positions)[:, None]
    k = torch.arange(num_keys)[None, :]
    causal = k <= q
    sliding = causal & (k > q - WINDOW) & (k >= floor)
    to_bias = lambda allowed: torch.where(allowed, 0.0, float("-inf"))[None, None]
    return {"full_attention": to_bias(causal), "sliding_attention": to_bias(sliding)}


@torch.no_grad()
def hf_replay_greedy(model, tokens: list[int], floor: int) -> tuple[list[int], list[torch.Tensor]]:
    """Tokens [0, floor) exact, then [floor, end) and the decode with sliding keys below floor hidden."""
    from transformers import DynamicCache

    # A cache without the config keeps every key in every layer (a sliding one would drop keys
    # outside the window, and the masks below address all positions).
    cache = DynamicCache()
    model(torch.tensor([tokens[:floor]]), past_key_values=cache, use_cache=True)
    segment = list(range(floor, len(tokens)))
    out = model(torch.tensor([tokens[floor:]]), past_key_values=cache, use_cache=True,
                position_ids=torch.tensor([segment]), attention_mask=masks(model, segment, len(tokens), floor))
    generated, logprobs = [], []
    for _ in range(NEW_TOKENS):
        step_logprobs = out.logits[0, -1].float().log_softmax(-1)
        token = int(step_logprobs.argmax())
        generated.append(token)
        logprobs.append(step_logprobs)
        position = len(tokens) + len(generated) - 1
        out = model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True,
                    position_ids=torch.tensor([[position]]),
                    attention_mask=masks(model, [position], position + 1, floor))
    return generated, logprobs


def engine_follow_up(directory: str, **cache) -> object:
    llm = LLM(directory, dtype="float32", block_size=BS, num_kv_blocks=1024, max_model_len=256, swa_retention_s=0, **cache)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5)
    llm.generate([list(FIRST_TURN)], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    return llm, llm.generate([list(FOLLOW_UP)], params, use_tqdm=False)[0]


@pytest.mark.parametrize("num_replay", [8, 16])
def test_replay_matches_transformers_with_the_truncated_window(gemma, num_replay):
    directory, model = gemma
    floor = replay_start(num_replay)
    ref_tokens, ref_logprobs = hf_replay_greedy(model, FOLLOW_UP, floor)
    llm, out = engine_follow_up(directory, swa_replay_tokens=num_replay, swa_replay_full_kv="recompute")
    assert out.num_cached_tokens == floor       # replayed tokens are computed, not cached
    completion = out.outputs[0]
    assert completion.token_ids == ref_tokens
    for ours, ref in zip(completion.logprobs, ref_logprobs):
        for token_id in ref.topk(5).indices.tolist():
            assert ours[token_id].logprob == pytest.approx(ref[token_id].item(), abs=2e-4)
    stats = llm.engine.stats()
    sliding = [g for g, kind in enumerate(stats.kv_group_kinds) if kind == "sliding_window"]
    assert all(stats.prefix_cache_expirations[g] > 0 for g in sliding)


def test_exact_mode_recomputes_and_matches_plain_transformers(gemma):
    directory, model = gemma
    _, out = engine_follow_up(directory, swa_replay_tokens=0)
    assert out.num_cached_tokens == 0
    reference = model.generate(torch.tensor([FOLLOW_UP]), max_new_tokens=NEW_TOKENS, do_sample=False,
                               pad_token_id=0, eos_token_id=None)
    assert out.outputs[0].token_ids == reference[0, len(FOLLOW_UP):].tolist()


def test_keep_mode_keeps_exact_full_rows_and_stays_close(gemma):
    directory, _ = gemma
    _, keep = engine_follow_up(directory, swa_replay_tokens=WINDOW, swa_replay_full_kv="keep")
    _, recompute = engine_follow_up(directory, swa_replay_tokens=WINDOW, swa_replay_full_kv="recompute")
    assert keep.num_cached_tokens == recompute.num_cached_tokens == replay_start(WINDOW)
    # Both are approximations of one exact answer; on this tiny model they agree on the first token.
    assert keep.outputs[0].token_ids[0] == recompute.outputs[0].token_ids[0]


def test_a_third_turn_after_a_replay_hits_the_rebuilt_kv(gemma):
    directory, _ = gemma
    llm = LLM(directory, dtype="float32", block_size=BS, num_kv_blocks=1024, max_model_len=256, swa_retention_s=0,
              swa_replay_tokens=WINDOW)
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate([list(FIRST_TURN)], greedy, use_tqdm=False)
    second = llm.generate([list(FOLLOW_UP)], greedy, use_tqdm=False)[0]
    third_prompt = FOLLOW_UP + second.outputs[0].token_ids + [9, 9, 9]
    third = llm.generate([third_prompt], greedy, use_tqdm=False)[0]
    # The second turn's blocks (replayed and new) are cached in the full groups: the third
    # turn resumes further along than the second did.
    assert third.num_cached_tokens > second.num_cached_tokens
    assert llm.engine.kv_manager.blocks_in_use() == {}
