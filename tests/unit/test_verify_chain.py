"""Verify chains (worker/spec/verify_chain.py) without a GPU: the device-side verdict and drafts
against the host's rules, the verdicts taken at collect, and the scheduler's side (KV allocated
ahead for the whole chain, given back after it, nothing leaking) under simulated chains."""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer.config import SchedulerConfig, SpeculativeConfig
from deepinfer.engine.scheduler import Scheduler
from deepinfer.kv_cache.manager import KVCacheManager
from deepinfer.kv_cache.specs import FullAttentionSpec, group_layers
from deepinfer.sampling_params import SamplingParams
from deepinfer.spec_decode import SpeculativeDecoder
from deepinfer.spec_decode.ngram import NgramDrafter
from deepinfer.spec_decode.replay import Recording, ReplayDrafter
from deepinfer.spec_decode.verifier import greedy_verdict
from deepinfer.types.drafter import Draft, DraftRequest
from deepinfer.types.plan import RunnerResult
from deepinfer.types.request import Request
from deepinfer.worker.request_states import RunnerRequestState, StepChunk
from deepinfer.worker.spec.chain_drafters import NgramChainDrafter, ReplayChainDrafter
from deepinfer.worker.spec.verify_chain import ChainVerdicts, accepted_drafts
from tests.unit.test_scheduler_fuzz import check_references
from tests.unit.test_spec_decode import RandomDrafter  # drafts 7s for 80 % of the requests


def test_accepted_drafts_is_the_host_greedy_rule():
    gen = torch.Generator().manual_seed(0)
    k, rows = 5, 200
    argmax = torch.randint(0, 3, (rows, k + 1), generator=gen)
    drafts = torch.where(torch.rand(rows, k, generator=gen) < 0.7, argmax[:, :k], torch.randint(0, 3, (rows, k), generator=gen))
    valid = torch.randint(0, k + 1, (rows,), generator=gen)
    got = accepted_drafts(argmax, drafts, valid).tolist()
    for row in range(rows):
        n = int(valid[row])
        assert got[row] == greedy_verdict(drafts[row, :n].tolist(), argmax[row].tolist()).num_accepted


def state_of(prompt: list[int], outputs: list[int]) -> RunnerRequestState:
    return RunnerRequestState(prompt + outputs, list(prompt), list(outputs), SamplingParams(temperature=0),
                              frozenset(), None, [[]])


def chunk_of(request_id: str) -> StepChunk:
    return StepChunk(request_id, 0, 1, [[]], True)


def emit(rng: random.Random, drafts: list[int], valid: int, truth: list[int], k: int) -> tuple[list[int], int]:
    """A step's argmax rows for a request whose true continuation is `truth`: row j is the token
    after the drafts before it, i.e. truth[j] while those drafts were right (garbage after)."""
    rows, accepted = [], 0
    while accepted < valid and drafts[accepted] == truth[accepted]:
        accepted += 1
    for j in range(k + 1):
        rows.append(truth[j] if j <= accepted else rng.randrange(50))
    return rows, accepted


@pytest.mark.parametrize("seed", range(4))
def test_replay_drafts_on_the_device_are_the_host_drafters(seed):
    """Step by step, the chain's replay drafts equal what the scheduler's ReplayDrafter proposes
    for the same tokens, including after a request leaves its recording (no drafts from then)."""
    rng = random.Random(seed)
    k, vocab = 4, 50
    recordings = [Recording([1, 2, 3], [rng.randrange(vocab) for _ in range(40)], 0.6),
                  Recording([4, 5], [rng.randrange(vocab) for _ in range(40)], 0.8)]
    host = ReplayDrafter(recordings, vocab, seed=3)
    chain = ReplayChainDrafter(k, ReplayDrafter(recordings, vocab, seed=3))
    # Request b follows recording b; request 1 leaves it after its 10th output token.
    truths = [list(recordings[0].output_token_ids), list(recordings[1].output_token_ids)]
    truths[1][10] = (truths[1][10] + 1) % vocab
    states = {"a": state_of([1, 2, 3], truths[0][:2]), "b": state_of([4, 5], truths[1][:1])}
    chunks = [chunk_of("a"), chunk_of("b")]
    device_state = chain.begin(chunks, states, extra=200, device=torch.device("cpu"))
    drafts = [host.propose([DraftRequest(r, states[r].token_ids, k)]).get(r, Draft()).token_ids for r in "ab"]
    valid = [len(d) for d in drafts]
    for _ in range(8):
        emitted, accepted = [], []
        for row, r in enumerate("ab"):
            done = len(states[r].output_token_ids)
            rows, a = emit(rng, drafts[row] + [0] * (k - len(drafts[row])), valid[row], truths[row][done:], k)
            emitted.append(rows)
            accepted.append(a)
            states[r].token_ids.extend(rows[:a + 1])
            states[r].output_token_ids.extend(rows[:a + 1])
        got, got_valid = chain.propose(device_state, torch.tensor(emitted), torch.tensor(accepted))
        for row, r in enumerate("ab"):
            expected = host.propose([DraftRequest(r, states[r].token_ids, k)]).get(r, Draft()).token_ids
            assert got[row, :int(got_valid[row])].tolist() == expected
        drafts, valid = [d[:v] for d, v in zip(got.tolist(), got_valid.tolist())], got_valid.tolist()
    assert host.num_diverged == 1


def test_ngram_drafts_on_the_device_are_the_host_drafters():
    rng = random.Random(1)
    k = 3
    host = NgramDrafter(k, 1, 3)
    chain = NgramChainDrafter(k, 1, 3)
    prompts = {r: [rng.randrange(6) for _ in range(rng.randint(2, 30))] for r in "abc"}
    states = {r: state_of(p, []) for r, p in prompts.items()}
    chunks = [chunk_of(r) for r in "abc"]
    device_state = chain.begin(chunks, states, extra=12 * (k + 1), device=torch.device("cpu"))
    for _ in range(12):
        emitted = [[rng.randrange(6) for _ in range(k + 1)] for _ in "abc"]
        accepted = [rng.randint(0, k) for _ in "abc"]
        for row, r in enumerate("abc"):
            states[r].token_ids.extend(emitted[row][:accepted[row] + 1])
        got, got_valid = chain.propose(device_state, torch.tensor(emitted), torch.tensor(accepted))
        for row, r in enumerate("abc"):
            assert got[row, :int(got_valid[row])].tolist() == host.lookup(states[r].token_ids, k).token_ids


def test_chain_verdicts_join_every_steps_tokens():
    # Two steps, two requests, k = 2: request x keeps 1 then 2 drafts; y keeps 0 (of 1 real), then none real.
    argmax = torch.tensor([[[7, 8, 9], [5, 6, 1]], [[10, 11, 12], [2, 3, 4]]])
    drafts = torch.tensor([[[7, 0], [9, 0]], [[10, 11], [0, 0]]])
    valid = torch.tensor([[2, 1], [2, 0]])
    states = {"x": state_of([1], [7]), "y": state_of([1], [5])}
    result = RunnerResult({})
    ChainVerdicts(["x", "y"], argmax, drafts, valid).finish(states, result)
    assert result.sampled_token_ids == {"x": [7, 8, 10, 11, 12], "y": [5, 2]}
    assert result.verify_steps == {"x": [(2, 1), (2, 2)], "y": [(1, 0), (0, 0)]}
    assert result.num_verify_steps == 2
    assert states["x"].output_token_ids == [7, 7, 8, 10, 11, 12]


@pytest.mark.parametrize("seed", range(6))
def test_chained_plans_hold_kv_for_the_whole_chain_and_give_it_back(seed):
    """A simulated runner runs each chained plan's steps (random verdicts, a device drafter that
    sometimes finds fewer drafts): every chunk of a chained plan holds blocks for chain * (k + 1)
    tokens from its start, its computed tokens count every emitted token but the last, and after
    the run nothing is held."""
    rng = random.Random(seed)
    bs, k = 4, 3
    manager = KVCacheManager(group_layers([FullAttentionSpec(1, 4, torch.float32)]), 80, bs)
    config = SpeculativeConfig("ngram", k, verification="fixed", verify_chain=rng.choice([2, 3, 4]))
    spec = SpeculativeDecoder(config, RandomDrafter(rng), max_model_len=96)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4), manager, max_model_len=96, spec=spec)
    for i in range(8):
        params = SamplingParams(temperature=0 if i % 4 else 1.0, max_tokens=rng.randint(1, 40), ignore_eos=True)
        scheduler.add_request(Request(f"r{i}", [100 + i] * rng.randint(2, 20), params, frozenset({0}),
                                      params.max_tokens, block_size=bs))
    chained = 0
    for _ in range(500):
        if not scheduler.has_unfinished():
            break
        plan = scheduler.schedule()
        sampled, steps_by_request = {}, {}
        for c in plan.chunks:
            if plan.verify_chain > 1:
                request = scheduler.requests[c.request_id]
                assert len(request.block_ids[0]) * bs >= c.start + plan.verify_chain * (k + 1)
                assert request.sampling_params.temperature == 0
            if not c.sample:
                continue
            tokens, steps = [], []
            for step in range(plan.verify_chain):
                n = len(c.spec_token_ids) if step == 0 else rng.randint(0, k)
                accepted = rng.randint(0, n)
                tokens += [7] * accepted + [5]
                steps.append((n, accepted))
            sampled[c.request_id] = tokens
            if plan.verify_chain > 1:
                steps_by_request[c.request_id] = steps
        chained += plan.verify_chain > 1
        result = RunnerResult(sampled, verify_steps=steps_by_request, num_verify_steps=plan.verify_chain)
        scheduler.update(plan, result)
        check_references(scheduler)
        for request in scheduler.running:
            if request.num_tokens - request.num_computed_tokens == 1:
                assert len(request.block_ids[0]) <= -(-request.num_tokens // bs)
    assert not scheduler.has_unfinished()
    assert chained > 0
    assert manager.pool.blocks_in_use() == {}


@pytest.mark.parametrize("value", [0, 17, True, 2.0])
def test_bad_verify_chain_names_the_field(value):
    with pytest.raises(ValueError, match="verify_chain"):
        SpeculativeConfig("ngram", 3, verify_chain=value)


def test_verify_chain_needs_a_device_drafter():
    with pytest.raises(ValueError, match="verify_chain.*ngram, replay"):
        SpeculativeConfig("draft_model", 3, model="/x", verify_chain=2)


def test_a_chain_pads_every_request_to_the_most_drafts_and_refuses_what_it_cannot_run():
    from types import SimpleNamespace

    from deepinfer.worker.spec.verify_chain import VerifyChain

    chain = VerifyChain(NgramChainDrafter(5), SimpleNamespace(max_batch=16), k=5, device=torch.device("cpu"))
    states = {r: state_of([1, 2], [3]) for r in "abc"}
    chunks = [StepChunk(r, 2, 1 + n, [[]], True, spec_token_ids=[9] * n) for r, n in zip("abc", [2, 0, 1])]
    padded, start = chain.prepare(4, chunks, states)
    assert (start.steps, start.valid, start.num_drafts) == (4, [2, 0, 1], 2)
    assert [c.spec_token_ids for c in padded] == [[9, 9], [0, 0], [9, 0]] and all(c.num_tokens == 3 for c in padded)
    assert chain.prepare(1, chunks, states) == (chunks, None)                     # the plan does not chain
    assert chain.prepare(4, chunks * 6, {**states})[1] is None                      # 18 x 3 rows > 16
    states["b"].params = SamplingParams(temperature=0.7)
    assert chain.prepare(4, chunks, states) == (chunks, None)                     # not plain greedy


def test_a_chain_is_no_longer_than_the_remaining_tokens_take():
    """Steps past a request's max_tokens are computed for nothing: with 6 tokens left and 3
    emitted a verify step so far, a chain of 8 asked for runs 2 steps; with 1 left, none."""
    k = 3
    manager = KVCacheManager(group_layers([FullAttentionSpec(1, 4, torch.float32)]), 80, 4)
    spec = SpeculativeDecoder(SpeculativeConfig("ngram", k, verification="fixed", verify_chain=8),
                              RandomDrafter(random.Random(0)), max_model_len=96)
    spec.stats.record(3, 2)   # one verify step so far, 3 tokens emitted
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4), manager, max_model_len=96, spec=spec)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    request = Request("r", [5] * 8, params, frozenset({0}), 10, block_size=4)
    for _ in range(4):   # 6 tokens left
        request.append_output_token(7)
    request.num_computed_tokens = request.num_tokens - 1
    assert scheduler._chain_steps(request, 1, 8) == 2
    for _ in range(5):   # 1 left
        request.append_output_token(7)
    request.num_computed_tokens = request.num_tokens - 1
    assert scheduler._chain_steps(request, 1, 8) == 1


def test_ngram_history_kept_on_the_device_across_chains_is_the_runners():
    """The n-gram chain keeps each request's tokens on the device between chains and uploads only
    what was added since; across chains that join, leave and come back (a finished request's row
    reused by a new one), every chain drafts what the host drafter does."""
    rng = random.Random(2)
    k = 3
    host = NgramDrafter(k, 1, 3)
    chain = NgramChainDrafter(k, 1, 3)
    states = {r: state_of([rng.randrange(5) for _ in range(rng.randint(2, 12))], []) for r in "abcd"}
    for members in ("ab", "abc", "bc", "cd", "bcd"):
        live = {r: states[r] for r in members}
        device_state = chain.begin([chunk_of(r) for r in members], live, extra=4 * (k + 1), device=torch.device("cpu"))
        for _ in range(4):
            emitted = [[rng.randrange(5) for _ in range(k + 1)] for _ in members]
            accepted = [rng.randint(0, k) for _ in members]
            for row, r in enumerate(members):
                states[r].token_ids.extend(emitted[row][:accepted[row] + 1])
            got, got_valid = chain.propose(device_state, torch.tensor(emitted), torch.tensor(accepted))
            for row, r in enumerate(members):
                assert got[row, :int(got_valid[row])].tolist() == host.lookup(states[r].token_ids, k).token_ids
    assert len(chain.history.rows) == 3 and chain.history.table.shape[0] <= 4   # "a" left, its row reused
