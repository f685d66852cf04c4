"""One admission rule for the offline LLM, the server's engine client and the core process."""

from __future__ import annotations

import msgspec

from deepinfer import LLM, SamplingParams
from deepinfer.engine.admission import AddRequest, EngineFacts, child_request_ids, child_requests, to_request
from deepinfer.output_processor import child_request_ids as output_processor_child_ids
from deepinfer.types.block_hashes import extra_key

FACTS = EngineFacts("model-x", max_model_len=32, eos_token_ids=frozenset({2, 0}))
PROMPT = list(range(3, 13))   # 10 tokens: 22 left before max_model_len


def test_n_fans_out_into_children_with_their_own_seeds():
    params = SamplingParams(n=3, seed=7, temperature=0.8, max_tokens=5)
    children = child_requests("req", PROMPT, params, FACTS)
    assert [c.request_id for c in children] == ["req-0", "req-1", "req-2"] == child_request_ids("req", 3)
    assert [(c.sampling_params.n, c.sampling_params.seed) for c in children] == [(1, 7), (1, 8), (1, 9)]
    assert all(c.sampling_params.temperature == 0.8 and c.prompt_token_ids == PROMPT for c in children)
    single = SamplingParams(seed=7)
    (only,) = child_requests("req", PROMPT, single, FACTS)
    assert only.request_id == "req" and only.sampling_params is single
    # The front end gathers the children back by the same ids.
    assert output_processor_child_ids is child_request_ids


def test_max_tokens_never_runs_past_max_model_len():
    room = FACTS.max_model_len - len(PROMPT)
    for asked, resolved in ((None, room), (100, room), (5, 5), (room, room)):
        (child,) = child_requests("r", PROMPT, SamplingParams(max_tokens=asked), FACTS)
        assert child.max_tokens == resolved, asked


def test_cache_salt_goes_into_every_block_hash_key():
    salted = child_requests("a", PROMPT, SamplingParams(n=2), FACTS, cache_salt="tenant-1", priority=3)
    other, = child_requests("b", PROMPT, SamplingParams(), FACTS, cache_salt="tenant-2")
    plain, = child_requests("c", PROMPT, SamplingParams(), FACTS)
    assert {c.extra_key for c in salted} == {extra_key("model-x", "tenant-1")}
    assert len({salted[0].extra_key, other.extra_key, plain.extra_key}) == 3
    assert plain.extra_key == extra_key("model-x", None) and plain.cache_salt is None
    assert all(c.cache_salt == "tenant-1" and c.priority == 3 for c in salted)


def test_prompt_logprobs_skip_the_prefix_cache():
    (wants,) = child_requests("r", PROMPT, SamplingParams(prompt_logprobs=1), FACTS)
    (plain,) = child_requests("r", PROMPT, SamplingParams(), FACTS)
    assert wants.skip_prefix_cache and not plain.skip_prefix_cache


def test_a_message_crosses_to_the_core_and_becomes_its_request():
    (message,) = child_requests("r", PROMPT, SamplingParams(seed=1, max_tokens=4), FACTS, cache_salt="s", priority=2)
    assert message.eos_token_ids == [0, 2]
    decoded = msgspec.msgpack.Decoder(AddRequest).decode(msgspec.msgpack.encode(message))
    assert decoded == message
    request = to_request(decoded, block_size=8)
    assert (request.request_id, request.prompt_token_ids, request.max_tokens, request.priority) == ("r", PROMPT, 4, 2)
    assert request.eos_token_ids == frozenset({0, 2}) and request.block_size == 8
    assert request.cache_salt == "s" and request.extra_key == extra_key("model-x", "s")
    assert request.sampling_params.seed == 1 and not request.skip_prefix_cache


def test_llm_admits_through_it(tiny_llama):
    """The offline path: the core's requests are the ones admission builds."""
    llm = LLM(tiny_llama, dtype="float32", num_kv_blocks=64, block_size=4, max_model_len=32)
    params = SamplingParams(n=2, seed=3, max_tokens=1000)
    request_id = llm._add_request(None, PROMPT, params, 1, "salt")
    requests = llm.engine.scheduler.requests
    expected = child_requests(request_id, PROMPT, params, EngineFacts(llm.model_id, 32, llm.eos_token_ids),
                              priority=1, cache_salt="salt")
    assert sorted(requests) == [e.request_id for e in expected]
    for message in expected:
        request = requests[message.request_id]
        assert (request.max_tokens, request.sampling_params, request.extra_key, request.priority) == (
            message.max_tokens, message.sampling_params, message.extra_key, 1)
    llm.engine.abort(llm.output_processor.abort(request_id))
