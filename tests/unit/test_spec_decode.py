"""Speculative decoding without a model: the verifier keeps the target distribution, the
admission rules, calibration, n-gram lookup, config errors, metrics, and KV release on rejection."""

from __future__ import annotations

import math
import random
from collections import Counter

import numpy as np
import pytest
import torch

from deepinfer.config import EngineConfig, SchedulerConfig, SpeculativeConfig
from deepinfer.engine.scheduler import Scheduler
from deepinfer.kv_cache.manager import KVCacheManager
from deepinfer.kv_cache.specs import FullAttentionSpec, SlidingWindowSpec, group_layers
from deepinfer.sample.sampler import SamplingRow, sampling_probs
from deepinfer.sampling_params import SamplingParams
from deepinfer.spec_decode import SpeculativeDecoder
from deepinfer.spec_decode.calibration import AcceptanceCalibrator
from deepinfer.spec_decode.cost_model import StepCostModel
from deepinfer.spec_decode.ngram import NgramDrafter
from deepinfer.spec_decode.policy import Candidate, admit_adaptive, admit_fixed
from deepinfer.spec_decode.verifier import VerifyRequest, verify
from deepinfer.types.drafter import Draft, Drafter
from deepinfer.types.plan import RunnerResult
from deepinfer.types.request import Request
from deepinfer.types.spec_stats import SpecDecodeStats
from tests.unit.test_scheduler_fuzz import check_references


# ------------------------------------------------------------------------------ verifier
def chi2_critical(df: int, z: float = 3.09) -> float:
    """Upper 0.1 % point of chi-square with df degrees of freedom (Wilson-Hilferty)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def chi2(observed: Counter, probs: torch.Tensor, n: int) -> tuple[float, int]:
    stat, cells = 0.0, 0
    for token, p in enumerate(probs.tolist()):
        if p > 0:
            stat += (observed.get(token, 0) - n * p) ** 2 / (n * p)
            cells += 1
        else:
            assert observed.get(token, 0) == 0, f"token {token} has probability 0 but was emitted"
    return stat, cells - 1


SAMPLING_CASES = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=0.9, top_k=6, top_p=0.9, min_p=0.05),
]


@pytest.mark.parametrize("params", SAMPLING_CASES, ids=["plain", "top-k", "top-p", "all"])
def test_rejection_sampling_keeps_the_target_distribution(params):
    """Emitted tokens follow the target's processed distribution at the first and the second
    position, whatever the drafts; the draft tokens are chosen where a broken rule would show:
    one with a middling target probability, one the target never emits."""
    gen = torch.Generator().manual_seed(0)
    vocab, n = 8, 24000
    logits = torch.randn(3, vocab, generator=gen) * 1.5     # the target's rows 0, 1, 2
    rows = [SamplingRow(params, [1], []) for _ in range(3)]
    p = sampling_probs(logits.clone(), rows)
    order = p[0].argsort(descending=True).tolist()
    d1 = order[1]                                  # likely, but far from certain
    d2 = int(p[1].argmin())                        # often impossible under top-k / top-p
    torch.manual_seed(1234)
    requests = [VerifyRequest([d1, d2], [SamplingRow(params, [1], [])] * 3) for _ in range(n)]
    results = verify(logits.repeat(n, 1), requests)

    first = Counter(r.token_ids[0] for r in results)
    stat, df = chi2(first, p[0], n)
    assert stat < chi2_critical(df), f"first token: chi2 {stat:.1f} with {df} df"
    accepted_first = sum(r.num_accepted >= 1 for r in results) / n
    assert accepted_first == pytest.approx(p[0, d1].item(), abs=0.02)
    assert 0 < accepted_first < 1   # both branches ran

    # Given the first draft was accepted, the second emitted token follows row 1.
    second = [r.token_ids[1] for r in results if r.num_accepted >= 1]
    stat, df = chi2(Counter(second), p[1], len(second))
    assert stat < chi2_critical(df), f"second token: chi2 {stat:.1f} with {df} df"


def test_rejection_sampling_test_detects_a_biased_rule():
    """The chi-square check has teeth: accepting every draft (a lossy rule) fails it."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 8, generator=gen)
    p = sampling_probs(logits.clone(), [SamplingRow(SamplingParams(temperature=1.0), [1], [])])[0]
    n, draft = 6000, int(p.argsort()[-2])
    biased = Counter({draft: n // 2})
    biased.update(torch.multinomial(p, n - n // 2, replacement=True, generator=gen).tolist())
    stat, df = chi2(biased, p, n)
    assert stat > chi2_critical(df)


def test_greedy_verification_matches_argmax_and_mixes_with_sampled_rows():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 0.0], [0.0, 0.0, 4.0],     # greedy request
                           [0.0, 9.0, 0.0], [9.0, 0.0, 0.0]])                      # sampled request
    greedy = SamplingParams(temperature=0.0, repetition_penalty=1.0)
    hot = SamplingParams(temperature=0.01)
    results = verify(logits, [
        VerifyRequest([1, 2], [SamplingRow(greedy, [0], [])] * 3),   # 1 matches, 2 does not (argmax 0)
        VerifyRequest([1], [SamplingRow(hot, [0], [])] * 2),          # near-greedy: accepted, then 0
    ])
    assert results[0].token_ids == [1, 0] and results[0].num_accepted == 1
    assert results[1].token_ids == [1, 0] and results[1].num_accepted == 1


def test_seeded_verification_is_reproducible():
    logits = torch.randn(4, 16, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(temperature=1.0, seed=5)

    def run():
        gen = torch.Generator().manual_seed(99)
        return verify(logits, [VerifyRequest([3, 4, 5], [SamplingRow(params, [0], [])] * 4, gen)])[0]

    assert run() == run()


# ------------------------------------------------------------------------------ admission
def test_fixed_admits_whole_drafts_in_order_under_the_budget():
    candidates = [Candidate(f"r{i}", [0.9, 0.5, 0.1, 0.05, 0.01]) for i in range(3)]
    assert admit_fixed(candidates, 12) == {"r0": 5, "r1": 5, "r2": 2}
    assert admit_fixed(candidates, 0) == {}


def test_adaptive_verifies_everything_when_verification_is_free():
    candidates = [Candidate("a", [0.9, 0.5, 0.1]), Candidate("b", [0.2, 0.01])]
    assert admit_adaptive(candidates, 100, 2, 2, lambda t: 1.0) == {"a": 3, "b": 2}


def test_adaptive_takes_slots_by_survival_and_stops_when_they_stop_paying():
    # Step cost: 10 ms fixed + 1 ms per token. Two generating requests, 2 base tokens (12 ms):
    # a slot pays while its q beats the running expected tokens per token-cost.
    candidates = [Candidate("a", [0.95, 0.9, 0.85, 0.3, 0.2]), Candidate("b", [0.4, 0.1])]
    admitted = admit_adaptive(candidates, 100, 2, 2, lambda t: 10.0 + t)
    assert admitted == {"a": 3, "b": 1}
    # Best prefix by brute force agrees.
    slots = sorted([q for c in candidates for q in c.survival], reverse=True)
    rates = [(2 + sum(slots[:p])) / (12 + p) for p in range(len(slots) + 1)]
    assert sum(admitted.values()) == max(range(len(rates)), key=rates.__getitem__)


def test_adaptive_never_takes_a_later_draft_without_the_earlier_ones_and_respects_budget():
    candidates = [Candidate(f"r{i}", [1.0, 1.0, 1.0, 1.0]) for i in range(4)]
    admitted = admit_adaptive(candidates, 6, 4, 4, lambda t: 1.0)
    assert sum(admitted.values()) == 6
    # Ties go to the earlier position, so equal chains share the budget breadth first.
    assert admitted == {"r0": 2, "r1": 2, "r2": 1, "r3": 1}
    falling = [Candidate("a", [0.9, 0.9, 0.9]), Candidate("b", [0.95, 0.5])]
    assert admit_adaptive(falling, 4, 2, 2, lambda t: 1.0) == {"a": 3, "b": 1}


def test_adaptive_verifies_less_per_request_at_large_batch_on_a_compute_bound_curve():
    # GPU-like: a flat step until 64 tokens, then linear.
    cost = StepCostModel({1: [(0.0, 1.0), (5.0, 1.0)], 64: [(0.0, 1.0), (2.0, 2.0), (5.0, 4.0)]})
    one = admit_adaptive([Candidate("x", [0.8, 0.6, 0.45, 0.3, 0.2])], 100, 1, 1, lambda t: cost.costs(1, t))
    many = [Candidate(f"r{i}", [0.8, 0.6, 0.45, 0.3, 0.2]) for i in range(64)]
    big = admit_adaptive(many, 10_000, 64, 64, lambda t: cost.costs(64, t))
    assert one == {"x": 5}
    assert 0 < sum(big.values()) / 64 < 5


def test_cost_model_interpolates_and_is_monotone():
    cost = StepCostModel({1: [(0.0, 1.0), (5.0, 2.0)], 4: [(0.0, 3.0), (5.0, 2.5)]})   # noisy point
    assert cost.cost(1, 1) == pytest.approx(1.0)
    assert cost.cost(1, 6) == pytest.approx(2.0)
    assert cost.cost(1, 3.5) == pytest.approx(1.5)
    assert cost.cost(4, 24) >= cost.cost(4, 4) == pytest.approx(3.0)   # never cheaper with drafts
    assert cost.cost(8, 8) == pytest.approx(6.0)                       # scaled past the largest b
    assert cost.cost(2, 2) == pytest.approx(1.0 + (3.0 - 1.0) / 3)


@pytest.mark.parametrize("num_seqs", [1, 2, 3, 4, 16, 64, 100])
def test_cost_model_costs_at_many_token_counts_equal_cost_at_each(num_seqs):
    """The vectorised costs() the adaptive policy reads: cost() at every count, inside the
    measured points, past them (extended), between and past the measured batch sizes."""
    cost = StepCostModel({1: [(0.0, 1.0), (2.0, 1.1), (5.0, 2.0)], 4: [(0.0, 3.0), (5.0, 2.5)],
                          16: [(0.0, 4.0)], 64: [(0.0, 5.0), (2.0, 6.5), (5.0, 9.0)]})
    tokens = np.arange(0, num_seqs * 9)
    assert cost.costs(num_seqs, tokens).tolist() == pytest.approx([cost.cost(num_seqs, int(t)) for t in tokens])


# ----------------------------------------------------------------------------- calibration
def test_calibration_learns_acceptance_the_confidence_understates():
    cal = AcceptanceCalibrator(num_positions=3)
    assert cal.estimate(0, 0.25) == pytest.approx(0.25)          # no evidence: the raw confidence
    rng = random.Random(0)
    for _ in range(400):
        accepted = 0
        while accepted < 3 and rng.random() < 0.9:
            accepted += 1
        cal.observe([0.25, 0.25, 0.25], accepted)
    for position in range(3):
        assert cal.estimate(position, 0.25) == pytest.approx(0.9, abs=0.05)
    assert cal.estimate(0, 0.95) == pytest.approx(0.95)         # another bucket: untouched
    assert cal.survival([0.25, 0.25])[1] == pytest.approx(0.81, abs=0.08)


def test_calibration_chains_the_prior_to_unobserved_positions():
    cal = AcceptanceCalibrator(num_positions=3)
    for _ in range(50):
        cal.observe([0.1], 1)        # position 0 always accepted; positions 1, 2 never verified
    assert cal.estimate(1, 0.1) > 0.8 and cal.estimate(2, 0.1) > 0.8


def test_calibration_estimates_equal_the_chain_walked_position_by_position():
    """estimate() reads a table rebuilt after observations; the definition walks the chain."""
    from deepinfer.spec_decode.calibration import PRIOR_WEIGHT

    cal = AcceptanceCalibrator(num_positions=4)
    rng = random.Random(3)
    for _ in range(200):
        confidences = [rng.random() for _ in range(rng.randrange(1, 5))]
        cal.observe(confidences, rng.randrange(0, len(confidences) + 1))
        for _ in range(3):
            position, confidence = rng.randrange(0, 6), rng.random()
            b, value = cal._bucket(confidence), confidence
            for p in range(min(position, 3) + 1):
                value = (cal._accepted[p][b] + PRIOR_WEIGHT * value) / (cal._trials[p][b] + PRIOR_WEIGHT)
            assert cal.estimate(position, confidence) == pytest.approx(value, rel=1e-12)


# ---------------------------------------------------------------------------------- ngram
def test_ngram_proposes_what_followed_the_latest_match_with_confidence_by_match_length():
    drafter = NgramDrafter(4, min_n=1, max_n=3)
    text = [1, 2, 3, 4, 5, 9, 9, 1, 2, 3, 7, 8, 6, 1, 2, 3]
    draft = drafter.lookup(text, 4)
    assert draft.token_ids == [7, 8, 6, 1]          # the most recent [1, 2, 3] was followed by 7 8 6 1
    long = drafter.lookup([5, 6, 7, 1, 2, 3, 4, 0, 5, 6, 7, 1, 2, 3], 2)
    assert long.token_ids == [4, 0]
    assert long.confidences[0] > draft.confidences[0]   # 6-token match beats a 3-token one
    assert drafter.lookup([1, 2, 3, 4], 4).token_ids == []
    assert drafter.lookup(text, 0).token_ids == []


# -------------------------------------------------------------------------- config, metrics
@pytest.mark.parametrize("value, field", [
    ({"method": "eagle"}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "verification": "sometimes"}, "verification"),
    ({"method": "draft_model"}, "model"),
    ({"method": "ngram", "model": "/x"}, "model"),
    ({"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_max"),
    ({"method": "ngram", "k": 3}, "unknown field"),
    ('{"method": ', "not valid JSON"),
])
def test_bad_speculative_config_names_the_field(value, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig.from_kwargs(speculative_config=value)


def test_speculative_config_from_json_and_cli():
    from argparse import ArgumentParser

    from deepinfer.cli.args import add_engine_args, engine_kwargs

    parser = ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    config = EngineConfig.from_kwargs(**{k: v for k, v in engine_kwargs(args).items() if k != "load_format"})
    assert config.speculative == SpeculativeConfig("ngram", 3)
    assert config.speculative.verification == "adaptive"


def test_prometheus_exports_spec_decode_counters():
    from deepinfer.metrics.prometheus import ServerMetrics
    from deepinfer.types.plan import EngineStats

    metrics = ServerMetrics("m", 2048)
    stats = SpecDecodeStats(3)
    stats.record(3, 2)
    stats.record(1, 0)
    metrics.record_engine_stats(EngineStats(1, 0, 0.1, 0, [0], [0], [0], stats))
    stats.record(2, 2)
    metrics.record_engine_stats(EngineStats(1, 0, 0.1, 0, [0], [0], [0], stats.copy()))
    text = metrics.render().decode()
    labels = 'engine="0",model_name="m"'
    assert f'deepinfer:spec_decode_num_drafts_total{{{labels}}} 3.0' in text
    assert f'deepinfer:spec_decode_num_draft_tokens_total{{{labels}}} 6.0' in text
    assert f'deepinfer:spec_decode_num_accepted_tokens_total{{{labels}}} 4.0' in text
    assert f'deepinfer:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="1"}} 2.0' in text
    assert stats.mean_accepted_length == pytest.approx(1 + 4 / 3)
    assert stats.acceptance_rate_per_pos == pytest.approx([2 / 3, 1.0, 0.0])


# ------------------------------------------------------------------- KV release on rejection
class RandomDrafter(Drafter):
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def propose(self, requests):
        return {r.request_id: Draft([7] * r.max_drafts, [0.9] * r.max_drafts)
                for r in requests if self.rng.random() < 0.8}


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("verification", ["fixed", "adaptive"])
def test_rejected_drafts_release_their_blocks_and_nothing_leaks(seed, verification):
    rng = random.Random(seed)
    bs = 4
    specs = [FullAttentionSpec(1, 4, torch.float32), SlidingWindowSpec(1, 4, torch.float32, sliding_window=6)]
    manager = KVCacheManager(group_layers(specs), 40, bs)
    config = SpeculativeConfig("ngram", 4, verification=verification)
    cost = StepCostModel({1: [(0.0, 1.0), (4.0, 1.2)]})
    spec = SpeculativeDecoder(config, RandomDrafter(rng), max_model_len=64, cost_model=cost)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=rng.choice([8, 16, 64]), max_num_seqs=4),
                          manager, max_model_len=64, spec=spec)
    for i in range(8):
        n = rng.randint(1, 14)
        scheduler.add_request(Request(f"r{i}", [100 + i % 2] * 5 + list(range(1, n)), SamplingParams(max_tokens=20),
                                      frozenset({0}), rng.randint(1, 20), block_size=bs))
    steps = 0
    while scheduler.has_unfinished():
        steps += 1
        assert steps < 500
        plan = scheduler.schedule()
        sampled = {}
        for c in plan.chunks:
            if c.sample:
                accepted = rng.randint(0, len(c.spec_token_ids))
                sampled[c.request_id] = list(c.spec_token_ids[:accepted]) + [5]
        if steps % 7 == 0 and scheduler.running:
            scheduler.abort([rng.choice(scheduler.running).request_id])
        scheduler.update(plan, RunnerResult(sampled))
        check_references(scheduler)
        for request in scheduler.running:
            if request.num_tokens - request.num_computed_tokens == 1:
                # Only the blocks the known tokens need: nothing held for rejected drafts.
                assert len(request.block_ids[0]) <= -(-request.num_tokens // bs)
    assert spec.stats.num_draft_tokens > spec.stats.num_accepted_tokens > 0
    assert manager.pool.blocks_in_use() == {}


class ConfidentDrafter(Drafter):
    def propose(self, requests):
        return {r.request_id: Draft([7] * r.max_drafts, [0.9, 0.6, 0.3][:r.max_drafts]) for r in requests}


def test_expected_emitted_is_a_token_a_request_plus_the_verified_drafts_survival():
    """What the loop chooser prices an adaptive speculative step by: one token per request, plus
    the survival probability of each draft the step verifies (of the drafts left in its chunks,
    which the scheduler may have cut); fixed verification estimates none."""
    from deepinfer.types.plan import ScheduledChunk

    cost = StepCostModel({1: [(0.0, 1.0), (3.0, 1.0)]})   # verifying is free: every draft admitted
    spec = SpeculativeDecoder(SpeculativeConfig("ngram", 3, verification="adaptive"), ConfidentDrafter(),
                              max_model_len=64, cost_model=cost)
    running = [Request(f"r{i}", [5, 6, 7], SamplingParams(max_tokens=20), frozenset({0}), 20, block_size=4)
               for i in range(2)]
    for r in running:
        r.num_computed_tokens = r.num_tokens - 1                # generating: the last token to compute
    drafts = spec.plan(running, budget=100, base_tokens=2)
    assert [len(d) for d in drafts.values()] == [3, 3]
    q = spec.calibrator.survival([0.9, 0.6, 0.3])
    chunks = [ScheduledChunk("r0", 2, 4, True, spec_token_ids=drafts["r0"]),
              ScheduledChunk("r1", 2, 2, True, spec_token_ids=drafts["r1"][:1])]   # cut to one draft
    assert spec.expected_emitted(chunks) == pytest.approx(2 + sum(q) + q[0])
    fixed = SpeculativeDecoder(SpeculativeConfig("ngram", 3, verification="fixed"), ConfidentDrafter(), 64)
    fixed.plan(running, budget=100, base_tokens=2)
    assert fixed.expected_emitted(chunks) is None


def test_cost_model_corrects_a_bad_profile_point_online():
    # The profile caught a stall at b=4, e=5 (10 s); the real step takes ~1 s.
    cost = StepCostModel({4: [(0.0, 0.5), (5.0, 10.0)]})
    for _ in range(200):
        cost.observe(4, 24, 1.0)
    assert cost.cost(4, 24) == pytest.approx(1.0, rel=0.05)
    assert cost.cost(4, 4) == pytest.approx(0.5)      # the point observations did not touch
    # b=5 maps to the b=4 point; the table predicted 0.625 s there (scaled by 5/4), so a 0.5 s
    # step says the point is 20 % high, and it moves by ONLINE_RATE of that.
    cost.observe(5, 5, 0.5)
    assert cost.cost(4, 4) == pytest.approx(0.5 * (0.95 + 0.05 * 0.8))


def test_spec_stats_cross_the_engine_process_boundary():
    import msgspec

    from deepinfer.engine.core_proc import OutputMessage, StepOutputs
    from deepinfer.types.plan import EngineStats

    stats = SpecDecodeStats(2)
    stats.record(2, 1)
    message = StepOutputs([], EngineStats(1, 0, 0.5, 0, [1], [0], [0], stats))
    decoded = msgspec.msgpack.Decoder(OutputMessage).decode(msgspec.msgpack.Encoder().encode(message))
    assert decoded.stats.spec_decode == stats
    assert decoded.stats.spec_decode.mean_accepted_length == 2.0
    plain = msgspec.msgpack.Decoder(OutputMessage).decode(msgspec.msgpack.Encoder().encode(
        StepOutputs([], EngineStats(1, 0, 0.5, 0, [1], [0], [0]))))
    assert plain.stats.spec_decode is None


# ---------------------------------------------------------------------------- loop chooser
def run_chooser(chooser, batch: int, steps: int, step_s: dict[bool, float], tokens: dict[bool, float],
                clock: list[float], refill_s: float = 0.0) -> list[bool]:
    """Drive a LoopChooser as the engine does: choose, run (advance the clock by that loop's
    step time; the first overlapped step after a speculative one also by `refill_s`), observe
    when its results are in."""
    picks: list[bool] = []
    for _ in range(steps):
        speculative = chooser.choose(batch)
        refill = not speculative and bool(picks) and picks[-1]
        clock[0] += step_s[speculative] + (refill_s if refill else 0.0)
        chooser.observe(clock[0], batch, speculative, tokens[speculative] * batch)
        picks.append(speculative)
    return picks


def stretches(picks: list[bool], loop: bool) -> int:
    """Runs of `loop` in picks."""
    return sum(1 for i, p in enumerate(picks) if p == loop and (i == 0 or picks[i - 1] != loop))


def test_loop_chooser_takes_the_faster_loop_per_batch_size_and_keeps_exploring():
    from deepinfer.spec_decode.overlap import EXPLORE_EVERY, LoopChooser

    chooser, clock = LoopChooser(), [0.0]
    # Batch 1: a speculative step takes 6 ms for 2.7 tokens, an overlapped one 4.1 ms for 1: the
    # overlapped loop is clearly slower, so once measured enough (every EXPLORE_EVERY steps until
    # then) its stretches are spaced by their cost: 4 x 4.1 ms x (1 - 0.54) + 6 ms of refill
    # within 1 % of the time is one every ~225 steps.
    picks = run_chooser(chooser, 1, 800, {True: 0.006, False: 0.0041}, {True: 2.7, False: 1.0}, clock)
    assert picks[0] is True                              # unmeasured: speculation first
    assert stretches(picks[:200], False) >= 3            # every EXPLORE_EVERY steps while measuring
    assert stretches(picks[300:], False) <= 3            # then one in ~225
    # Batch 64: speculating costs more than it emits beyond the overlapped loop (0.82x of it).
    picks = run_chooser(chooser, 64, 800, {True: 0.013, False: 0.0067}, {True: 1.6, False: 1.0}, clock)
    assert any(picks[50:])                               # overlapped, still exploring
    assert 1 <= stretches(picks[300:], True) <= 3
    # Batch 16, nearly a tie (speculative 2 % faster): only the refill counts against a stretch,
    # one every ~100 steps, never more often than every EXPLORE_EVERY.
    picks = run_chooser(chooser, 16, 800, {True: 0.0098, False: 0.005}, {True: 2.0, False: 1.0}, clock)
    assert 4 <= stretches(picks[200:], False) <= 600 // EXPLORE_EVERY + 1
    assert "batch<=1:" in chooser.describe() and "batch<=64:" in chooser.describe()


def test_loop_chooser_exploring_costs_about_its_budget_where_speculating_loses():
    """Batch 64 at low acceptance: speculative steps deliver 0.7x the overlapped loop's tokens a
    second and each return to overlapping costs a refill. Over a long run the engine loses about
    EXPLORE_BUDGET against overlapping always, past the first measurements."""
    from deepinfer.spec_decode.overlap import EXPLORE_BUDGET, LoopChooser

    chooser, clock = LoopChooser(), [0.0]
    step_s, tokens = {True: 0.012, False: 0.0054}, {True: 1.52, False: 1.0}
    run_chooser(chooser, 64, 300, step_s, tokens, clock, refill_s=0.0055)   # measuring
    start, steps = clock[0], 5000
    picks = run_chooser(chooser, 64, steps, step_s, tokens, clock, refill_s=0.0055)
    emitted = sum(64 * tokens[p] for p in picks)
    always_overlapped = emitted / 64 * step_s[False]
    assert (clock[0] - start) / always_overlapped - 1 < 1.5 * EXPLORE_BUDGET


def test_loop_chooser_notices_speculation_paying_after_a_workload_change():
    """Batch 64: speculating loses (0.7x) for 1000 steps, then acceptance rises and it wins
    (1.1x): the next stretch of it, however stale the estimate it found, switches the bucket."""
    from deepinfer.spec_decode.overlap import LoopChooser

    chooser, clock = LoopChooser(), [0.0]
    run_chooser(chooser, 64, 1000, {True: 0.012, False: 0.0054}, {True: 1.52, False: 1.0}, clock, 0.0055)
    picks = run_chooser(chooser, 64, 1000, {True: 0.012, False: 0.0054}, {True: 2.45, False: 1.0}, clock, 0.0055)
    first = picks.index(True)
    assert first < 500                                   # the stretch came within its period
    assert sum(picks[first:]) > 0.9 * len(picks[first:])  # and the bucket speculates from then on


def test_loop_chooser_compares_loops_per_request_as_a_batch_runs_out():
    """Overlapped steps measured at batch 64, speculative ones while a batch of 64 runs out
    (64 down to 34 requests): per request speculation is the faster loop, and is chosen."""
    from deepinfer.spec_decode.overlap import LoopChooser

    chooser, clock = LoopChooser(), 0.0
    for _ in range(12):                                  # 64 tokens in 5.4 ms
        clock += 0.0054
        chooser.observe(clock, 64, False, 64)
    for batch in range(64, 33, -2):                      # 2 tokens a request in 8 ms
        clock += 0.008
        chooser.observe(clock, batch, True, 2 * batch)
    assert chooser.choose(64)


def test_loop_chooser_charges_a_step_its_own_time():
    """Steps are charged the spacing of their results, whatever their loop: a verify chain left in
    flight (one step, 8 verify steps' tokens) is charged its own device time; the first step
    after a switch of loop (draining or refilling it) is not measured."""
    from deepinfer.spec_decode.overlap import LoopChooser

    chooser = LoopChooser()
    chooser.observe(1.000, 64, False, 64)                # the first: nothing to measure from
    chooser.observe(1.005, 64, False, 64)                # 64 tokens in 5 ms
    chooser.observe(1.085, 64, True, 780)                # the switch (and a draft model's catch-up)
    chooser.observe(1.145, 64, True, 780)                # a chain: 780 tokens in 60 ms
    chooser.observe(1.155, 64, False, 64)                # refilling
    chooser.observe(1.160, 64, False, 64)
    assert chooser.describe() == "batch<=64: speculative 203, overlapped 200 tok/s a request"


def test_loop_chooser_speculative_steps_without_drafts_back_off_and_are_not_measured():
    """A stretch without drafts mostly overlaps (a speculative step that found none is followed
    by NO_DRAFT_BACKOFF overlapped steps, twice as many after each such step in a row) and
    leaves speculation unjudged: once drafts come, speculating wins the bucket."""
    from deepinfer.spec_decode.overlap import EXPLORE_EVERY, NO_DRAFT_BACKOFF, LoopChooser

    chooser, clock = LoopChooser(), [0.0]
    for drafts in (False, True):
        picks = []
        for _ in range(300):
            speculative = chooser.choose(1)
            if speculative and not drafts:
                chooser.no_drafts(1)                     # said at launch, as the engine does
            # Without drafts a speculative step is a synchronous one: slower, one token.
            step_s, tokens = (0.005, (2.7 if drafts else 1.0)) if speculative else (0.0041, 1.0)
            clock[0] += step_s
            chooser.observe(clock[0], 1, speculative, tokens, drafted=drafts or not speculative)
            picks.append(speculative)
        if not drafts:   # back-offs of 4, 8, 16, ... steps: a handful of speculative steps
            assert sum(picks) <= math.log2(len(picks) / NO_DRAFT_BACKOFF) + 2
    assert sum(picks[2 * EXPLORE_EVERY:]) > 0.9 * len(picks[2 * EXPLORE_EVERY:])


def test_loop_chooser_ignores_idle_time_and_unshaped_steps():
    from deepinfer.spec_decode.overlap import LoopChooser

    chooser = LoopChooser()
    chooser.observe(0.0, 4, True, 8.0)
    chooser.idle()                                       # the engine idled
    chooser.observe(100.0, 4, True, 8.0)                 # so this step is not charged the idle time
    chooser.observe(100.5, 4, True, None)                # a prefill step: not measured,
    chooser.observe(100.6, 4, True, 8.0)                 # nor the step after it
    chooser.observe(100.61, 4, True, 8.0)                # 8 tokens in 10 ms: 800 tok/s, 200 a request
    assert chooser.describe() == "batch<=4: speculative 200, overlapped - tok/s a request"
