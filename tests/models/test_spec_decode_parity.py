"""Speculative decoding is lossless end to end: greedy tokens (and logprobs) identical with and
without it, for the n-gram and draft-model drafters, fixed and adaptive verification, on tiny
parity models (full attention, sliding window, Gemma 3's two layer groups) and on the default
SmolLM2 model; and the run must actually have accepted and rejected drafts."""

from __future__ import annotations

import pytest

from deepinfer import LLM, SamplingParams
from tests.models.tiny_models import build_tiny_checkpoint

NEW_TOKENS = 40
# Repeated spans (n-gram hits) beside plain ones; one longer than a 16-token block.
PROMPTS = [[(7 * i + 3) % 60 + 2 for i in range(24)] * 2, [5, 6, 7, 8] * 4 + [9, 10], [11, 12, 13],
           [(11 * i) % 300 + 2 for i in range(40)]]


def greedy(logprobs: int | None = 3) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=logprobs)


def assert_same(reference, outputs) -> None:
    for ref, out in zip(reference, outputs):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        for ours, theirs in zip(out.outputs[0].logprobs, ref.outputs[0].logprobs):
            for token_id, lp in theirs.items():
                assert ours[token_id].logprob == pytest.approx(lp.logprob, abs=1e-4)


@pytest.fixture(scope="module", params=["llama", "mistral", "gemma3"])
def tiny(request, tmp_path_factory):
    directory = str(tmp_path_factory.mktemp(request.param))
    build_tiny_checkpoint(request.param, directory)
    other = str(tmp_path_factory.mktemp(request.param + "-draft"))
    build_tiny_checkpoint(request.param, other, seed=1)     # same tokenizer, other weights
    base = LLM(directory, dtype="float32", num_kv_blocks=256, block_size=4, max_model_len=128)
    return directory, other, base.generate(PROMPTS, greedy(), use_tqdm=False), request.param


@pytest.mark.parametrize("spec, budget", [
    ({"method": "ngram", "verification": "fixed"}, 2048),
    ({"method": "ngram", "verification": "adaptive", "num_speculative_tokens": 3}, 16),
    ({"method": "draft_model", "verification": "fixed", "model": "other", "num_speculative_tokens": 2}, 16),
    ({"method": "draft_model", "verification": "adaptive", "model": "self"}, 2048),
], ids=["ngram-fixed", "ngram-adaptive-chunked", "draft-other-fixed-chunked", "draft-self-adaptive"])
def test_greedy_is_identical_with_speculation(tiny, spec, budget):
    directory, other, reference, _ = tiny
    spec = dict(spec)
    if "model" in spec:
        spec["model"] = {"self": directory, "other": other}[spec["model"]]
    # Speculating at every step (no overlapped steps between, which the loop chooser would pick
    # where they are faster): this test checks verification and rollback.
    llm = LLM(directory, dtype="float32", num_kv_blocks=256, block_size=4, max_model_len=128, max_num_batched_tokens=budget,
              speculative_config=spec, async_scheduling=False)
    assert_same(reference, llm.generate(PROMPTS, greedy(), use_tqdm=False))
    stats = llm.spec_decode_stats
    assert stats.num_draft_tokens > 0
    draft_runner = getattr(getattr(llm.engine.spec.drafter, "executor", None), "runner", None)
    if draft_runner is not None and draft_runner.decode_graphs is not None:
        # On CUDA the draft model's decode steps (its catch-up on accepted tokens included) replay graphs.
        assert draft_runner.decode_graphs.num_replays > 0
    # A random draft model of other weights is (almost) never right: that run checks rollback.
    # The target as its own draft is never wrong; n-gram drafts are both right and wrong.
    if spec.get("model") != other:
        assert stats.num_accepted_tokens > 0
    if spec.get("model") != directory:
        assert stats.num_draft_tokens > stats.num_accepted_tokens
    assert llm.engine.kv_manager.pool.blocks_in_use() == {}


@pytest.mark.parametrize("verification", ["fixed", "adaptive"])
def test_replayed_drafts_at_a_set_acceptance_are_verified_losslessly(tiny, tmp_path, verification):
    """The replay drafter proposes the recorded greedy continuation, each draft kept with
    probability 0.6: every kept one must be accepted, every changed one rejected, and the output
    stays the reference's. Its acceptance per position is then about 0.6 (the only drafter whose
    acceptance is known in advance, which is what the GPU benchmark measures verification at)."""
    import json

    directory, _, reference, _ = tiny
    path = tmp_path / "replay.jsonl"
    with open(path, "w") as f:
        for prompt, out in zip(PROMPTS, reference):
            f.write(json.dumps({"prompt_token_ids": prompt, "output_token_ids": out.outputs[0].token_ids,
                                "acceptance": 0.6}) + "\n")
    llm = LLM(directory, dtype="float32", num_kv_blocks=256, block_size=4, max_model_len=128,
              speculative_config={"method": "replay", "replay_path": str(path), "verification": verification,
                                  "num_speculative_tokens": 4})
    assert_same(reference, llm.generate(PROMPTS, greedy(), use_tqdm=False))
    stats = llm.spec_decode_stats
    assert llm.engine.spec.drafter.num_diverged == 0
    assert 0.35 < stats.acceptance_rate_per_pos[0] < 0.85   # 0.6 over ~50-100 first drafts
    assert llm.engine.kv_manager.pool.blocks_in_use() == {}


@pytest.mark.parametrize("spec", [{"method": "ngram"}, {"method": "draft_model", "model": "self"},
                                  {"method": "ngram", "verification": "fixed"}], ids=["ngram", "draft", "fixed"])
def test_speculation_beside_overlapped_steps_is_identical(tiny, spec):
    """async_scheduling with adaptive verification: steps with drafts run synchronously after
    collecting the step in flight, steps without overlap; here the loop chooser's picks are
    forced to alternate (one speculative step, two overlapped), and greedy output stays the
    reference's. Fixed verification speculates at every step."""
    import itertools

    directory, _, reference, _ = tiny
    spec = dict(spec, model=directory) if "model" in spec else spec
    # Exact KV (swa_replay_tokens=0): the second generate below finds the prompts cached.
    llm = LLM(directory, dtype="float32", num_kv_blocks=256, block_size=4, max_model_len=128,
              async_scheduling=True, swa_replay_tokens=0, speculative_config=spec)
    chooser = llm.engine.loop.loop_chooser
    if spec.get("verification") == "fixed":
        assert chooser is None
    else:
        picks = itertools.cycle([True, False, False])
        chooser.choose = lambda batch: next(picks)
    assert_same(reference, llm.generate(PROMPTS, greedy(), use_tqdm=False))
    # Without logprobs greedy verdicts are taken when the step is collected, after the core
    # has handed the step's outputs over (worker/spec/draft_verification.py): the same tokens.
    without_logprobs = llm.generate(PROMPTS, greedy(logprobs=None), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in without_logprobs] == [o.outputs[0].token_ids for o in reference]
    assert llm.spec_decode_stats.num_accepted_tokens > 0
    assert llm.engine.kv_manager.pool.blocks_in_use() == {}


def test_seeded_sampling_with_speculation_is_the_same_overlapped(tiny):
    """Seeded draws come from (seed, position): the overlapped loop, whose verify steps stay in
    flight while the caller works, samples what the plain loop does."""
    directory = tiny[0]
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=5, max_tokens=NEW_TOKENS, ignore_eos=True)
    runs = []
    for overlapped in (False, True):
        llm = LLM(directory, dtype="float32", num_kv_blocks=256, block_size=4, max_model_len=128,
                  async_scheduling=overlapped, speculative_config={"method": "ngram", "verification": "fixed"})
        runs.append([o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)])
        assert llm.spec_decode_stats.num_drafts > 0
    assert runs[0] == runs[1]


def test_preemption_with_speculation_gives_identical_output(tiny):
    directory, _, reference, arch = tiny
    if arch != "llama":
        pytest.skip("sliding-window models free blocks as they go; the pool below does not force preemption")
    # 35 blocks of 4 tokens cannot hold the four requests at once (~60 blocks): preemption.
    tight = LLM(directory, dtype="float32", num_kv_blocks=36, block_size=4, max_model_len=96,
                max_num_batched_tokens=16, speculative_config={"method": "ngram", "verification": "fixed"})
    assert_same(reference, tight.generate(PROMPTS, greedy(), use_tqdm=False))
    assert tight.engine.stats().num_preemptions > 0
    assert tight.engine.kv_manager.pool.blocks_in_use() == {}


def test_seeded_sampling_with_speculation_is_reproducible(tiny):
    directory = tiny[0]
    # Exact KV (swa_replay_tokens=0): the second pass finds the full-attention blocks cached but
    # some sliding-window ones evicted, and SWA Bounded Replay, an approximation, would change
    # what it samples. Reproducibility is asked of the exact engine.
    llm = LLM(directory, dtype="float32", num_kv_blocks=256, block_size=4, max_model_len=128, swa_replay_tokens=0,
              speculative_config={"method": "ngram", "verification": "fixed"})
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=NEW_TOKENS, ignore_eos=True)
    first = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    again = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert first == again and all(len(t) == NEW_TOKENS for t in first)
    assert llm.spec_decode_stats.num_drafts > 0


def test_mtp_is_refused_for_a_model_without_an_mtp_head(tiny):
    with pytest.raises(ValueError, match="'mtp' is not available for this model"):
        LLM(tiny[0], dtype="float32", num_kv_blocks=256, max_model_len=128, speculative_config={"method": "mtp"})


def test_draft_model_must_share_the_tokenizer(tiny, tmp_path):
    import json
    import os

    other = str(tmp_path / "other-vocab")
    build_tiny_checkpoint("llama", other)
    with open(os.path.join(other, "tokenizer.json")) as f:
        tok = json.load(f)
    tok["model"]["vocab"] = {f"x{i}": i for i in range(len(tok["model"]["vocab"]))}
    tok["model"]["unk_token"] = "x0"
    with open(os.path.join(other, "tokenizer.json"), "w") as f:
        json.dump(tok, f)
    with pytest.raises(ValueError, match="does not share the target's tokenizer"):
        LLM(tiny[0], dtype="float32", num_kv_blocks=256, max_model_len=128,
            speculative_config={"method": "draft_model", "model": other})


# async_scheduling=False: every step speculates (the tests below count accepted drafts; the loop
# chooser would take overlapped steps instead where they are faster, as on a GPU at this size).
DEFAULT_KWARGS = {"dtype": "float32", "max_model_len": 512, "num_kv_blocks": 160, "max_num_seqs": 4,
                  "async_scheduling": False}


@pytest.fixture(scope="module")
def default_pair():
    """The default model without and with n-gram speculation (adaptive)."""
    return LLM(**DEFAULT_KWARGS), LLM(**DEFAULT_KWARGS, speculative_config={"method": "ngram"})


def test_default_model_greedy_is_identical_with_speculation(default_pair):
    base, ngram = default_pair
    texts = ["Repeat this sentence exactly: The quick brown fox jumps over the lazy dog near the river bank.",
             "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
             "Once upon a time, in a small village by the sea, there lived"]
    prompts = [base.tokenizer.encode(t) for t in texts]
    params = greedy(logprobs=None)
    reference = [o.outputs[0].token_ids for o in base.generate(prompts, params, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in ngram.generate(prompts, params, use_tqdm=False)] == reference
    assert ngram.spec_decode_stats.num_accepted_tokens > 0
    draft = LLM(**DEFAULT_KWARGS, speculative_config={"method": "draft_model", "model": "default",
                                                      "verification": "fixed", "num_speculative_tokens": 3})
    assert [o.outputs[0].token_ids for o in draft.generate(prompts, params, use_tqdm=False)] == reference
    assert draft.spec_decode_stats.num_accepted_tokens > 0


def test_structured_output_with_speculation_is_identical_and_valid(default_pair):
    import json
    import re

    from deepinfer.sampling_params import StructuredOutputsParams

    base, ngram = default_pair
    schema = {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "string"},
                                                         "minItems": 3}}, "required": ["items"]}
    chats = [[{"role": "user", "content": 'Answer in JSON: {"items": ["apple", "apple", "apple"]}'}],
             [{"role": "user", "content": "Write abababababab"}]]
    params = [SamplingParams(temperature=0, max_tokens=48, structured_outputs=StructuredOutputsParams(json=schema)),
              SamplingParams(temperature=0, max_tokens=30, structured_outputs=StructuredOutputsParams(regex=r"(ab){3,12}"))]
    before = ngram.spec_decode_stats.num_accepted_tokens
    expected = base.chat(chats, params, use_tqdm=False)
    got = ngram.chat(chats, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    assert re.fullmatch(r"(ab){3,12}", got[1].outputs[0].text)
    if got[0].outputs[0].finish_reason == "stop":
        assert len(json.loads(got[0].outputs[0].text)["items"]) >= 3
    assert ngram.spec_decode_stats.num_accepted_tokens > before   # drafts ran under the grammar


@pytest.mark.parametrize("verification", ["fixed", "adaptive"])
@pytest.mark.parametrize("method", ["ngram", "replay"])
def test_verify_chains_are_identical(tiny, tmp_path, method, verification):
    """verify_chain=4 (worker/spec/verify_chain.py): on CUDA, for the full-attention model, plans of
    greedy requests run up to 4 verify steps back to back on the device, drafting on the device
    from the tokens each step accepted; the output stays the reference's. Elsewhere (the CPU,
    sliding-window models) every plan runs one step, while the scheduler still allocates KV for
    the chain and gives it back: nothing may leak either way."""
    import json

    import torch

    directory, _, reference, arch = tiny
    spec = {"method": method, "verification": verification, "verify_chain": 4, "num_speculative_tokens": 3}
    if method == "replay":
        path = tmp_path / "replay.jsonl"
        with open(path, "w") as f:
            for prompt, out in zip(PROMPTS, reference):
                f.write(json.dumps({"prompt_token_ids": prompt, "output_token_ids": out.outputs[0].token_ids,
                                    "acceptance": 0.7}) + "\n")
        spec["replay_path"] = str(path)
    llm = LLM(directory, dtype="float32", num_kv_blocks=256, block_size=4, max_model_len=128, speculative_config=spec)
    outputs = llm.generate(PROMPTS, greedy(logprobs=None), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in reference]
    chain = llm.engine.executor.runner.verify_chain
    if torch.cuda.is_available() and arch == "llama" and verification == "fixed":
        assert chain is not None and chain.num_chains > 0 and chain.num_steps > chain.num_chains
    stats = llm.spec_decode_stats
    assert stats.num_accepted_tokens > 0
    if method == "replay":
        assert llm.engine.spec.drafter.num_diverged == 0
    assert llm.engine.kv_manager.pool.blocks_in_use() == {}
