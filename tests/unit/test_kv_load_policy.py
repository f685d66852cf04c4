"""The persistent store's load-or-recompute policy (engine/kv_load_policy.py) with injected
timings: it loads while unmeasured, recomputes when loading measured slower and never loads such a
hit (one in EXPLORE_EVERY is probed instead), follows a store that became faster, ignores failed
loads, times prefill steps of either loop, and prices recomputation by its length and context
(fitted to synthetic prefill steps)."""

from __future__ import annotations

import logging

import pytest

from deepinfer.engine.kv_load_policy import EXPLORE_EVERY, MIN_PREFILL_TOKENS, KVLoadPolicy
from deepinfer.types.plan import ScheduledChunk, SchedulerPlan

BS = 16


def plan(prefill: int = 0, decode_rows: int = 0) -> SchedulerPlan:
    chunks = [ScheduledChunk(f"d{i}", 100, 1, True) for i in range(decode_rows)]
    if prefill:
        chunks.append(ScheduledChunk("p", 0, prefill, False))
    return SchedulerPlan([], [], chunks, [], prefill + decode_rows)


def load(policy: KVLoadPolicy, blocks: int, seconds: float, ok: bool = True, request_id: str = "r") -> None:
    policy.load_started(request_id, blocks, 100.0)
    policy.load_finished(request_id, ok, 100.0 + seconds)


def measured(load_s_per_block: float, prefill_s_per_token: float) -> KVLoadPolicy:
    policy = KVLoadPolicy(BS)
    load(policy, 10, 10 * load_s_per_block)
    policy.observe_step(plan(prefill=1000), 0.0, 1000 * prefill_s_per_token)
    return policy


def test_loads_until_both_costs_are_measured():
    policy = KVLoadPolicy(BS)
    assert policy.should_load(8)
    load(policy, 10, 100.0)                 # a very slow store, but no prefill measured yet
    assert policy.load_seconds(10) == pytest.approx(100.0) and policy.recompute_seconds(10) is None
    assert policy.should_load(8)
    policy = KVLoadPolicy(BS)
    policy.observe_step(plan(prefill=1000), 0.0, 0.001)
    assert policy.should_load(8) and policy.loaded == 1 and policy.declined == 0


def test_declines_when_loading_is_slower_and_logs_the_flip_once(caplog):
    policy = measured(load_s_per_block=0.01, prefill_s_per_token=1e-4)   # a block: 10 ms vs 1.6 ms
    with caplog.at_level(logging.INFO, logger="deepinfer.engine.kv_load_policy"):
        assert not policy.should_load(6)
        assert not policy.should_load(6)
    assert policy.declined == 2 and policy.declined_blocks == 12
    assert [r.message for r in caplog.records if "recomputing" in r.message][:1] and len(caplog.records) == 1
    fast = measured(load_s_per_block=1e-4, prefill_s_per_token=1e-4)    # 0.1 ms vs 1.6 ms a block
    assert fast.should_load(6)


def test_probes_one_hit_in_every_n_while_recomputing_and_loads_none():
    """A hit estimated slower to load is never loaded; one declined hit in EXPLORE_EVERY is
    probed (read, copied nowhere) so that the load estimate keeps being measured."""
    policy = measured(load_s_per_block=0.01, prefill_s_per_token=1e-4)
    answers, probes = [], []
    for _ in range(3 * EXPLORE_EVERY):
        answers.append(policy.should_load(4))
        probes.append(policy.take_probe())
    assert not any(answers) and policy.declined == 3 * EXPLORE_EVERY and policy.explored == 3
    assert [i for i, p in enumerate(probes) if p] == [EXPLORE_EVERY - 1, 2 * EXPLORE_EVERY - 1, 3 * EXPLORE_EVERY - 1]
    assert not policy.take_probe()   # once per probe due


def test_resumes_loading_when_the_store_gets_faster():
    policy = measured(load_s_per_block=0.01, prefill_s_per_token=1e-4)
    assert not policy.should_load(10)
    for i in range(5):   # the probes now read fast (a warm cache)
        load(policy, 10, 10 * 1e-5, request_id=f"probe{i}")
    assert policy.should_load(10)
    assert policy.load_seconds(10) < policy.recompute_seconds(10)


def test_failed_and_aborted_loads_are_not_rate_samples():
    policy = KVLoadPolicy(BS)
    load(policy, 10, 100.0, ok=False)
    policy.load_started("aborted", 10, 0.0)
    policy.load_dropped("aborted")
    policy.load_finished("aborted", True, 50.0)
    policy.load_finished("never-started", True, 50.0)
    assert policy.load_estimate() is None
    fast = measured(load_s_per_block=1e-5, prefill_s_per_token=1e-4)
    load(fast, 10, 100.0, ok=False, request_id="timed-out")
    assert fast.should_load(10)


def test_a_fixed_overhead_is_told_from_the_per_block_cost():
    policy = KVLoadPolicy(BS)
    for i, n in enumerate([4, 64, 8, 32, 16, 64, 4]):
        load(policy, n, 0.05 + n * 0.001, request_id=str(i))
    overhead, per_block = policy.load_estimate()
    assert overhead == pytest.approx(0.05) and per_block == pytest.approx(0.001)
    policy.observe_step(plan(prefill=1000), 0.0, 1000 * 1e-4)   # a block recomputes in 1.6 ms
    assert not policy.should_load(2)      # 52 ms to load vs 3.2 ms to compute
    assert policy.should_load(200)        # 250 ms vs 320 ms
    same = KVLoadPolicy(BS)               # sizes that do not spread: seconds / blocks
    for i in range(3):
        load(same, 10, 0.1, request_id=str(i))
    assert same.load_estimate() == (0.0, pytest.approx(0.01))


def test_prefill_steps_are_timed_in_either_loop_and_others_are_not():
    policy = KVLoadPolicy(BS)
    policy.observe_step(plan(decode_rows=64), 0.0, 1.0)                               # decode
    policy.observe_step(plan(prefill=MIN_PREFILL_TOKENS - 1), 1.0, 2.0)               # too small
    policy.observe_step(plan(prefill=300, decode_rows=200), 2.0, 3.0)                 # mostly decode
    assert policy.prefill_s_per_token is None
    policy.observe_step(plan(prefill=1000), 10.0, 10.5)                               # plain loop
    assert policy.prefill_s_per_token == pytest.approx(0.5 / 1000)
    # Overlapped: queued at 10.2, while the step above ran until 10.5; its result came at 11.0.
    policy.observe_step(plan(prefill=1000, decode_rows=2), 10.2, 11.0)
    assert policy.prefill_s_per_token == pytest.approx(0.5 / 1000)


def test_recompute_is_priced_by_the_prefix_length_attention_included():
    """Prefill steps of different contexts (chunks from position 0 and from deep in a prompt)
    whose time is 1 us a token + 2 ns a (query, key) pair: the fit recovers both, and a long
    prefix is priced above its length times a short one's rate, so a store that is slower than
    recomputing short prefixes still serves long ones."""
    per_token, per_pair = 1e-6, 2e-9
    policy = KVLoadPolicy(BS)
    t = 0.0
    for start, length in [(0, 512), (4096, 512), (0, 2048), (16384, 1024), (8192, 256), (0, 4096)]:
        pairs = length * (start + (length + 1) / 2)
        seconds = per_token * length + per_pair * pairs
        policy.observe_step(SchedulerPlan([], [], [ScheduledChunk("p", start, length, True)], [], length), t,
                            t + seconds)
        t += seconds + 1.0
    assert policy.prefill_estimate() == (pytest.approx(per_token), pytest.approx(per_pair))
    tokens = 2048 * BS
    assert policy.recompute_seconds(2048) == pytest.approx(per_token * tokens + per_pair * tokens * (tokens + 1) / 2)
    load(policy, 64, 64 * 1e-4)                          # 0.1 ms a block to load
    assert not policy.should_load(4)                    # 64 tokens: ~0.07 ms to compute, 0.4 ms to load
    assert policy.should_load(2048)                     # 32k tokens: 1.1 s to compute, 0.2 s to load


def test_steps_of_one_context_length_are_priced_per_token():
    """Prefills all from position 0 of one length cannot tell attention from the rest: a flat
    rate per token, the mean seen."""
    policy = KVLoadPolicy(BS)
    for i in range(3):
        policy.observe_step(plan(prefill=1000), 10.0 * i, 10.0 * i + 0.5)
    assert policy.prefill_estimate() == (pytest.approx(0.5 / 1000), 0.0)


def test_recompute_is_priced_by_the_context_it_attends():
    """A hit past a device prefix: its tokens attend the device's tokens too, so the same number
    of blocks costs more to recompute deep in a prompt than from its start; fitted from synthetic
    steps (chunks at several positions, 1 us a token + 4 ns a pair), the decision follows."""
    per_token, per_pair = 1e-6, 4e-9
    policy = KVLoadPolicy(BS)
    t = 0.0
    for start, length in [(0, 1024), (8192, 1024), (0, 4096), (24576, 2048), (2048, 512), (16384, 512)]:
        seconds = per_token * length + per_pair * length * (start + (length + 1) / 2)
        policy.observe_step(SchedulerPlan([], [], [ScheduledChunk("p", start, length, False)], [], length), t,
                            t + seconds)
        t += seconds + 1.0
    blocks, deep = 64, 1536          # 1,024 tokens, from 0 or after 24,576 tokens on the device
    tokens, context = blocks * BS, deep * BS
    assert policy.recompute_seconds(blocks) == pytest.approx(per_token * tokens + per_pair * tokens * (tokens + 1) / 2)
    assert policy.recompute_seconds(blocks, deep) == pytest.approx(
        per_token * tokens + per_pair * tokens * (context + (tokens + 1) / 2))
    load(policy, blocks, 0.05)       # 50 ms to load 64 blocks
    assert not policy.should_load(blocks)        # ~3 ms to compute from the start
    assert policy.should_load(blocks, deep)      # ~0.1 s to compute after 24k tokens of context
