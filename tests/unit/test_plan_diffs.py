"""Requests cross to the runner whole once, then as diffs: the runner's copy never drifts.

The scheduler sends a request's block tables in NewRequestData when it (re)joins the runner,
and afterwards only BlockTableDiffs (types/block_tables.py). Random traffic with prefix hits,
a sliding-window group (leading entries nulled), a small pool (preemption, readmission),
speculative drafts with random acceptance (tails cut) and aborts: after every schedule(), the
runner's tables, rebuilt from the plans alone (worker/request_states.update_states), equal the
scheduler's own, which is what the full-state plan used to copy into every chunk.
"""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer.config import SchedulerConfig, SpeculativeConfig
from deepinfer.engine.scheduler import Scheduler
from deepinfer.kv_cache.block_pool import NULL_BLOCK_ID
from deepinfer.kv_cache.manager import KVCacheManager
from deepinfer.kv_cache.specs import FullAttentionSpec, SlidingWindowSpec, group_layers
from deepinfer.sampling_params import SamplingParams
from deepinfer.spec_decode import SpeculativeDecoder
from deepinfer.spec_decode.cost_model import StepCostModel
from deepinfer.types.block_tables import RunnerBlockTables, apply_block_table_diffs
from deepinfer.types.drafter import Draft, Drafter
from deepinfer.types.plan import CachedRequestData, NewRequestData, RunnerResult
from deepinfer.types.request import Request
from deepinfer.worker.request_states import RunnerRequestState, step_chunks, update_states

BS = 4
CPU = torch.device("cpu")
SPECS = [FullAttentionSpec(1, 4, torch.float32), SlidingWindowSpec(1, 4, torch.float32, sliding_window=6)]


class RandomDrafter(Drafter):
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def propose(self, requests):
        return {r.request_id: Draft([7] * r.max_drafts, [0.9] * r.max_drafts)
                for r in requests if self.rng.random() < 0.7}


def make_scheduler(rng: random.Random, speculative: bool) -> Scheduler:
    manager = KVCacheManager(group_layers(SPECS), rng.randint(19, 30), BS)
    spec = None
    if speculative:
        spec = SpeculativeDecoder(SpeculativeConfig("ngram", 3, verification="fixed"), RandomDrafter(rng),
                                  max_model_len=64, cost_model=StepCostModel({1: [(0.0, 1.0), (3.0, 1.1)]}))
    config = SchedulerConfig(max_num_batched_tokens=rng.choice([4, 8, 64]), max_num_seqs=4)
    return Scheduler(config, manager, max_model_len=64, spec=spec)


def check_runner_copy(scheduler: Scheduler, plan, states: dict[str, RunnerRequestState]) -> None:
    """Right after a schedule: the runner holds exactly the running requests, and the tables of
    those scheduled equal the scheduler's. (A running request left out of this step may hold an
    older table: its diff comes with its next chunk, the first step to read the table.)"""
    assert set(states) == {r.request_id for r in scheduler.running}
    for chunk in plan.chunks:
        assert states[chunk.request_id].block_ids == scheduler.requests[chunk.request_id].block_ids


def fake_result(plan, rng: random.Random) -> RunnerResult:
    sampled = {}
    for chunk in plan.chunks:
        if chunk.sample:
            accepted = rng.randint(0, len(chunk.spec_token_ids))
            sampled[chunk.request_id] = list(chunk.spec_token_ids[:accepted]) + [rng.choice([5, 7, 9])]
    return RunnerResult(sampled)


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculative"])
@pytest.mark.parametrize("seed", range(12))
def test_runner_tables_rebuilt_from_diffs_equal_the_schedulers(seed, speculative):
    rng = random.Random(seed)
    scheduler = make_scheduler(rng, speculative)
    states: dict[str, RunnerRequestState] = {}
    num_added = num_cached = num_chunks = 0

    def step() -> None:
        nonlocal num_cached, num_chunks
        plan = scheduler.schedule()
        update_states(states, plan, CPU)
        check_runner_copy(scheduler, plan, states)
        # Every diff rides with its request's chunk; the chunks' tables are the runner's own.
        assert {c.request_id for c in plan.cached_requests} <= {c.request_id for c in plan.chunks}
        for chunk, step_chunk in zip(plan.chunks, step_chunks(states, plan.chunks)):
            assert step_chunk.block_ids is states[chunk.request_id].block_ids
        num_cached += len(plan.cached_requests)
        num_chunks += len(plan.chunks)
        scheduler.update(plan, fake_result(plan, rng))

    for _ in range(60):
        action = rng.random()
        if action < 0.25:
            # Three shared prefixes (prefix-cache hits), prompts of 1..14 tokens after them.
            prompt = [100 + rng.randint(0, 2)] * 5 + list(range(1, rng.randint(2, 15)))
            max_tokens = rng.randint(1, 12)
            scheduler.add_request(Request(f"r{num_added}", prompt, SamplingParams(max_tokens=max_tokens),
                                          frozenset({0}), max_tokens, block_size=BS))
            num_added += 1
        elif action < 0.32 and num_added:
            scheduler.abort([f"r{rng.randrange(num_added)}"])
        else:
            step()
    for _ in range(400):
        if not scheduler.has_unfinished():
            break
        step()
    assert not scheduler.has_unfinished()
    # The last plan told the runner to drop the last finished requests.
    update_states(states, scheduler.schedule(), CPU)
    assert states == {}
    assert num_cached < num_chunks   # most decode steps send nothing but their chunk


def test_a_decode_sends_its_tables_only_when_they_grow():
    manager = KVCacheManager(group_layers(SPECS[:1]), 64, BS)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4), manager, max_model_len=64)
    for i in range(3):
        scheduler.add_request(Request(f"r{i}", [1, 2, 3, 4], SamplingParams(max_tokens=9), frozenset({0}), 9,
                                      block_size=BS))
    plan = scheduler.schedule()
    assert [n.block_ids for n in plan.new_requests] == [[[1]], [[2]], [[3]]] and not plan.cached_requests
    scheduler.update(plan, RunnerResult({c.request_id: [5] for c in plan.chunks}))
    sent = []
    for _ in range(8):   # positions 4..11: a new block at 4 and at 8
        plan = scheduler.schedule()
        sent.append([(c.request_id, [d.new_block_ids for d in c.block_table_diffs]) for c in plan.cached_requests])
        scheduler.update(plan, RunnerResult({c.request_id: [5] for c in plan.chunks}))
    grew = [("r0", [[4]]), ("r1", [[5]]), ("r2", [[6]])]
    assert sent == [grew, [], [], [], [("r0", [[7]]), ("r1", [[8]]), ("r2", [[9]])], [], [], []]


def test_diffs_cover_appends_nulls_and_cuts():
    tables = RunnerBlockTables()
    ours = [[3, 4], [5, 6]]
    theirs = tables.new_request("r", ours)
    assert theirs == ours and theirs[0] is not ours[0]   # the runner gets its own copy
    assert tables.diff("r", ours) is None
    ours[0] += [7, 8]
    ours[1][0] = NULL_BLOCK_ID          # a sliding window freed block 5
    ours[1] += [9]
    apply_block_table_diffs(theirs, tables.diff("r", ours))
    assert theirs == ours
    del ours[0][3:]                      # rejected drafts: the tail goes back to the pool
    tables.cut("r", ours)
    apply_block_table_diffs(theirs, tables.diff("r", ours))
    assert theirs == ours and tables.diff("r", ours) is None
    del ours[0][2:]                      # again, ...
    tables.cut("r", ours)
    ours[0] += [10, 11]                  # ... and grows back to the old length with new blocks
    ours[1][1] = NULL_BLOCK_ID
    apply_block_table_diffs(theirs, tables.diff("r", ours))
    assert theirs == ours == [[3, 4, 10, 11], [NULL_BLOCK_ID, NULL_BLOCK_ID, 9]]
    assert tables.forget("r") and not tables.forget("r") and "r" not in tables


def test_token_diff_replaces_the_runners_own_drafts():
    """A draft model's runner holds the drafts it sampled; the target accepted other tokens."""
    new = NewRequestData("r", [1, 2, 3], [], SamplingParams(temperature=0), frozenset({0}), [[1]])
    state = RunnerRequestState.from_new(new, CPU)
    state.token_ids += [7, 8, 9]             # what its sampling appended: drafts 7, 8, 9
    state.output_token_ids += [7, 8, 9]
    state.apply(CachedRequestData("r", None, new_token_ids=[4, 5], num_dropped_tokens=2))   # kept 7
    assert state.token_ids == [1, 2, 3, 7, 4, 5] and state.output_token_ids == [7, 4, 5]
    assert state.prompt_token_ids == [1, 2, 3] and state.block_ids == [[1]]
