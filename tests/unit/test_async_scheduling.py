"""Overlapped (asynchronous) scheduling against the plain loop: identical outputs, same KV state.

The overlapped loop plans and launches step N+1 before step N's tokens reach the host (on the
CPU the launch completes at once, but the bookkeeping is the same as on a GPU: placeholders in
the runner's token lists, tokens taken from the previous step's tensor, stops found one step
late). Every case runs the same requests through both loops and compares everything returned.
"""

from __future__ import annotations

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.config import EngineConfig
from deepinfer.engine.core import resolve_async_scheduling
from deepinfer.engine.overlapped_loop import OverlappedLoop
from deepinfer.engine.plain_loop import PlainLoop
from deepinfer.platforms.cpu import CpuPlatform
from deepinfer.platforms.cuda import CudaPlatform
from deepinfer.sampling_params import StructuredOutputsParams

PROMPTS = [[(7 * i + j) % 500 + 2 for j in range(6 + 5 * i)] for i in range(5)]


@pytest.fixture(scope="module")
def engines(tiny_llama):
    make = lambda overlapped: LLM(tiny_llama, dtype="float32", num_kv_blocks=256, block_size=4,
                                  async_scheduling=overlapped)
    return make(False), make(True)


def run(llm: LLM, prompts, params) -> list[tuple]:
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert not llm.engine.has_unfinished()
    assert llm.engine.kv_manager.pool.blocks_in_use() == {}, "a KV block is still referenced"
    return [(c.token_ids, c.finish_reason, c.stop_reason, c.text,
             [{t: round(lp.logprob, 5) for t, lp in entry.items()} for entry in (c.logprobs or [])])
            for o in outputs for c in o.outputs]


def greedy_tokens(llm: LLM, prompt, n: int) -> list[int]:
    return llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids


def test_engine_resolves_the_flag():
    cpu, cuda = CpuPlatform(), object.__new__(CudaPlatform)   # the CUDA platform's answers need no GPU
    assert resolve_async_scheduling(EngineConfig.from_kwargs(), cuda) is True
    assert resolve_async_scheduling(EngineConfig.from_kwargs(), cpu) is False
    assert resolve_async_scheduling(EngineConfig.from_kwargs(async_scheduling=True), cpu) is True
    # With speculation, the overlapped loop runs the steps without drafts (engine/overlapped_loop.py).
    spec = EngineConfig.from_kwargs(speculative_config={"method": "ngram"})
    assert resolve_async_scheduling(spec, cuda) is True
    assert resolve_async_scheduling(spec, cpu) is False


def test_engine_runs_the_loop_it_resolved_and_switches_between_calls(engines):
    plain, overlapped = engines
    assert isinstance(plain.engine.loop, PlainLoop) and isinstance(overlapped.engine.loop, OverlappedLoop)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = run(plain, PROMPTS[:2], params)
    try:
        plain.engine.async_scheduling = True   # what the benchmarks do to time both loops on one engine
        assert isinstance(plain.engine.loop, OverlappedLoop) and plain.engine.async_scheduling
        assert run(plain, PROMPTS[:2], params) == want
    finally:
        plain.engine.async_scheduling = False
    assert isinstance(plain.engine.loop, PlainLoop)


def test_overlapped_loop_launches_before_collecting(engines):
    """The point of the mode: step N+1's forward is queued while step N is still uncollected."""
    _, overlapped = engines
    runner = overlapped.engine.executor.runner
    calls: list[str] = []
    forward, collect = runner.forward, runner.collect
    runner.forward = lambda plan: (calls.append("forward"), forward(plan))[1]
    runner.collect = lambda launched: (calls.append("collect"), collect(launched))[1]
    try:
        overlapped.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                            use_tqdm=False)
    finally:
        del runner.forward, runner.collect
    assert calls[:4] == ["forward", "forward", "collect", "forward"]
    assert calls.count("forward") == calls.count("collect")


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=0.8, top_k=50, seed=11, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=9, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3),
    SamplingParams(temperature=0.7, seed=2, max_tokens=10, ignore_eos=True, min_tokens=4,
                   repetition_penalty=1.3, frequency_penalty=0.4),   # penalties count the token just collected
], ids=["greedy", "seeded", "n3", "logprobs", "penalties"])
def test_same_outputs_as_plain_loop(engines, params):
    plain, overlapped = engines
    assert run(overlapped, PROMPTS, params) == run(plain, PROMPTS, params)


def test_stops_found_one_step_late_change_nothing(engines):
    """Requests stopping on a token id, an EOS-like stop, a stop string and max_tokens, in one batch."""
    plain, overlapped = engines
    params = []
    for i, prompt in enumerate(PROMPTS):
        greedy = greedy_tokens(plain, prompt, 12)
        if i % 3 == 0:
            params.append(SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[greedy[3]]))
        elif i % 3 == 1:
            text = plain.tokenizer.decode(greedy[:6])
            params.append(SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[text.split()[-1]]))
        else:
            params.append(SamplingParams(temperature=0, max_tokens=1 + i, ignore_eos=True))
    got, expected = run(overlapped, PROMPTS, params), run(plain, PROMPTS, params)
    assert got == expected
    assert {e[1] for e in expected} == {"stop", "length"}


def test_chunked_prefill_and_preemption(tiny_llama):
    """Small token budget (prompts in chunks) and a KV pool too small for the batch (preemption
    while a step of the preempted request is still in flight)."""
    params = SamplingParams(temperature=0.9, seed=3, max_tokens=20, ignore_eos=True)
    results = []
    for overlapped in (False, True):
        llm = LLM(tiny_llama, dtype="float32", num_kv_blocks=16, block_size=4, max_model_len=48,
                  max_num_batched_tokens=8, async_scheduling=overlapped)
        results.append(run(llm, PROMPTS[:4], params))
        assert llm.engine.stats().num_preemptions > 0
    assert results[0] == results[1]


def test_structured_output_beside_free_requests(engines):
    """A grammar's mask needs the matcher advanced by the previous token: such steps wait for it,
    free requests in the same batch keep their outputs."""
    plain, overlapped = engines
    constrained = SamplingParams(temperature=0, max_tokens=12,
                                 structured_outputs=StructuredOutputsParams(regex="(w5w7|w12){1,3}"))
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    params = [constrained, free, free, constrained, free]
    got, expected = run(overlapped, PROMPTS, params), run(plain, PROMPTS, params)
    assert got == expected
    for (_, _, _, text, _), p in zip(got, params):
        if p is constrained:
            joined = text.replace(" ", "")   # the word-level test tokenizer decodes with spaces
            assert joined.replace("w5w7", "").replace("w12", "") == "" and joined


def abort_and_finish(llm: LLM, request_id: str) -> dict:
    """Abort one request, step until the engine is idle; the finished outputs by request id."""
    core = llm.engine
    core.abort(llm.output_processor.abort(request_id))
    finished = {}
    while core.has_unfinished():
        for out in llm._step():
            if out.finished:
                finished[out.request_id] = out
    return finished


def test_abort_with_a_step_in_flight(engines):
    """Aborting a request whose next step is already launched frees its blocks; the others finish."""
    _, overlapped = engines
    core = overlapped.engine
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ids = [overlapped._add_request(None, p, params, 0, None) for p in PROMPTS[:3]]
    for _ in range(4):
        overlapped._step()
    assert core.loop._in_flight is not None
    finished = abort_and_finish(overlapped, ids[1])
    assert set(finished) == {ids[0], ids[2]}
    assert all(len(o.outputs[0].token_ids) == 16 for o in finished.values())
    assert core.kv_manager.pool.blocks_in_use() == {}


def test_abort_with_a_grammar_step_deferred(engines):
    """A step with grammar rows returns with its sampling not yet queued (the masks fill while
    the caller processes outputs); aborting a request then frees its blocks and the other
    requests, constrained or not, finish with the outputs of the plain loop."""
    plain, overlapped = engines
    core = overlapped.engine
    constrained = SamplingParams(temperature=0, max_tokens=10,
                                 structured_outputs=StructuredOutputsParams(regex="(w5w7|w12){1,5}"))
    free = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    params = [constrained, free, constrained]
    expected = run(plain, [PROMPTS[0], PROMPTS[2]], [constrained, constrained])
    ids = [overlapped._add_request(None, p, sp, 0, None) for p, sp in zip(PROMPTS[:3], params)]
    while core.loop._deferred_sample is None:
        overlapped._step()
    finished = abort_and_finish(overlapped, ids[1])
    assert set(finished) == {ids[0], ids[2]}
    assert [finished[i].outputs[0].token_ids for i in (ids[0], ids[2])] == [e[0] for e in expected]
    assert core.kv_manager.pool.blocks_in_use() == {}
