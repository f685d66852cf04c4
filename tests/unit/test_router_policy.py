"""The router's pure parts on fake replica states: policies, admission, the metrics parser, the
KV index and the block-hash chain (equal to the engine's own)."""

from __future__ import annotations

from deepinfer.kv_cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, external_hash
from deepinfer.router.admission import admissible
from deepinfer.router.kv_index import KVIndex, prompt_block_hashes
from deepinfer.router.options import RouterOptions
from deepinfer.router.policy import CacheAware, Cost, LeastLoad, RoundRobin
from deepinfer.router.replica import Replica, Scraped, parse_metrics
from deepinfer.types.block_hashes import extend_block_hashes, extra_key, hash_root


def fleet(*loads, usage=0.0, blocks=100) -> list[Replica]:
    out = []
    for i, load in enumerate(loads):
        r = Replica(f"http://r{i}", i, healthy=True)
        r.scraped = Scraped(running=load, waiting=0, kv_usage=usage, num_blocks=blocks, block_size=16)
        out.append(r)
    return out


def stored(index: KVIndex, replica: int, hashes, medium="GPU") -> None:
    index.apply(replica, KVEventBatch(0.0, [BlockStored(list(hashes), None, [], 16, None, medium)]))


def test_round_robin_turns_over_the_healthy():
    rr, reps = RoundRobin(), fleet(0, 0, 0)
    assert [rr.choose(reps, None).order[0].index for _ in range(4)] == [0, 1, 2, 0]


def test_least_load_takes_the_larger_of_router_and_scrape():
    reps = fleet(3, 1, 2)
    assert LeastLoad().choose(reps, None).order[0].index == 1
    reps[1].in_flight = 5   # the router's own count is fresher than the scrape
    assert [r.index for r in LeastLoad().choose(reps, None).order] == [2, 0, 1]


def test_cache_aware_prefers_the_longest_prefix_unless_imbalanced():
    index = KVIndex(3)
    reps = fleet(2, 0, 1)
    stored(index, 0, [1, 2, 3])
    stored(index, 2, [1, 2])
    policy = CacheAware(index, balance_abs_threshold=4, cache_threshold=0.0)
    choice = policy.choose(reps, [1, 2, 3, 4])
    assert choice.order[0].index == 0 and choice.matched_blocks == 3 and choice.reason == "prefix"
    assert [r.index for r in choice.order[1:]] == [1, 2]        # retries by load
    assert policy.choose(reps, [9, 1]).order[0].index == 1       # no match: by load
    reps[0].in_flight = 10                                       # 10 - 0 > 4: go by load
    assert policy.choose(reps, [1, 2, 3]).reason == "imbalanced"
    assert policy.choose(reps, [1, 2, 3]).order[0].index == 1
    strict = CacheAware(index, balance_abs_threshold=100, cache_threshold=0.9)
    assert strict.choose(fleet(2, 0, 1), [1, 2, 3, 4]).reason == "miss"   # 3/4 < 0.9


def test_cost_weighs_prefill_store_and_decode():
    index = KVIndex(2)
    reps = fleet(0, 0)
    stored(index, 0, [1, 2, 3, 4])
    policy = Cost(index, store_hit_weight=0.5, decode_weight=1.0)
    assert policy.choose(reps, [1, 2, 3, 4, 5, 6]).order[0].index == 0   # 2 vs 6 blocks to prefill
    reps[0].scraped.kv_usage = 0.1                                       # 10 active blocks: 12 vs 6
    assert policy.choose(reps, [1, 2, 3, 4, 5, 6]).order[0].index == 1
    stored(index, 1, [1, 2, 3, 4, 5, 6], medium="DISK")                  # store hits: 6 - 0.5*6 = 3
    costs = policy.costs(reps, [1, 2, 3, 4, 5, 6])
    assert costs[1] == (3.0, 0) and costs[0] == (6 - 4 - 0.5 * 2 + 10, 4)
    reps[1].in_flight_blocks = 50                                        # the router's own count
    assert policy.choose(reps, [1, 2, 3, 4, 5, 6]).order[0].index == 0


def test_kv_index_removal_and_clear():
    index = KVIndex(1)
    index.apply(0, KVEventBatch(0.0, [BlockStored([1, 2], None, [], 16, None, "GPU", group_idx=0),
                                      BlockStored([1, 2], None, [], 16, None, "GPU", group_idx=1),
                                      BlockRemoved([2], "GPU", group_idx=1)]))
    assert index.device_match(0, [1, 2, 3]) == 2                      # group 0 still holds 2
    index.apply(0, KVEventBatch(0.0, [BlockRemoved([1], "GPU", group_idx=0), BlockRemoved([1], "GPU", 1)]))
    assert index.device_match(0, [1, 2]) == 0
    index.apply(0, KVEventBatch(0.0, [AllBlocksCleared()]))
    assert index.device[0] == {}


def test_prompt_hashes_equal_the_engines():
    ids = list(range(40))
    chain: list[bytes] = []
    extend_block_hashes(chain, ids, 16, extra_key("m", "salt"), hash_root("m", None, 16, "auto"))
    assert prompt_block_hashes(ids, model_name="m", model_id="m", block_size=16, kv_cache_dtype="auto",
                               cache_salt="salt") == [external_hash(h) for h in chain]
    assert len(chain) == 2


def _engine_hashes(ids, lora=None) -> list[int]:
    """The published hashes of the engine's own Request for `ids` (admission -> Request), the
    hash root as the engine core sets it (model "m", block size 16)."""
    from deepinfer.engine.admission import EngineFacts, child_requests, to_request
    from deepinfer.sampling_params import SamplingParams

    message = child_requests("r", ids, SamplingParams(max_tokens=1), EngineFacts("m", 1024, frozenset({0})),
                             lora=lora)[0]
    request = to_request(message, 16)
    request.hash_root = hash_root("m", None, 16, "auto")
    return [external_hash(h) for h in request.block_hashes]


def test_adapter_hashes_equal_the_engines_and_differ_from_the_base():
    from deepinfer.types.lora import LoRARequest

    ids = list(range(40))
    sql = LoRARequest("sql", 2, "/adapters/sql")
    facts = dict(model_name="m", model_id="m", block_size=16, kv_cache_dtype="auto")
    assert prompt_block_hashes(ids, **facts) == _engine_hashes(ids)
    assert prompt_block_hashes(ids, lora=("sql", 2), **facts) == _engine_hashes(ids, sql)
    assert prompt_block_hashes(ids, lora=("sql", 2), **facts) != prompt_block_hashes(ids, **facts)


def test_the_index_learns_adapter_ids_per_replica_and_matches_per_adapter():
    """Two replicas hold the same prompt's blocks under the same adapter "a", which each numbers
    its own way: id 1 on replica 0, id 2 on replica 1 (so a single name -> id map over the fleet
    would hash one of them wrongly); replica 1 also holds the base model's. A request naming "a"
    matches each replica by that replica's own chain, and only by it; the base model matches
    replica 1 only; an adapter no replica published matches nothing, also not the base model's
    blocks of the same prompt."""
    from deepinfer.types.lora import LoRARequest

    ids = list(range(40))
    facts = dict(model_name="m", model_id="m", block_size=16, kv_cache_dtype="auto")
    index = KVIndex(2)

    def publish(replica: int, lora: LoRARequest | None) -> None:
        event = BlockStored(_engine_hashes(ids, lora), None, [], 16, lora and lora.lora_int_id, "GPU",
                            lora and lora.lora_name)
        index.apply(replica, KVEventBatch(0.0, [event]))

    publish(0, LoRARequest("a", 1, "/a"))
    publish(1, LoRARequest("a", 2, "/a"))
    publish(1, None)
    assert index.adapters == [{"a": 1}, {"a": 2}]
    hashes = index.prompt_hashes(ids, [0, 1], adapter="a", **facts)
    assert hashes.blocks == 2 and hashes.for_replica(0) != hashes.for_replica(1)
    for replica, other in ((0, 1), (1, 0)):   # its own chain matches all, the other replica's none
        assert index.device_match(replica, hashes.for_replica(replica)) == 2
        assert index.device_match(replica, hashes.for_replica(other)) == 0
    policy = CacheAware(index, balance_abs_threshold=4, cache_threshold=0.0)
    for loads, home in (((1, 0), 1), ((0, 1), 0)):   # both hold "a": the less loaded one, by prefix
        choice = policy.choose(fleet(*loads), hashes)
        assert (choice.order[0].index, choice.matched_blocks, choice.reason) == (home, 2, "prefix"), loads
    base = index.prompt_hashes(ids, [0, 1], adapter=None, **facts)
    choice = policy.choose(fleet(0, 1), base)   # against the load
    assert (choice.order[0].index, choice.matched_blocks, choice.reason) == (1, 2, "prefix")
    unknown = index.prompt_hashes(ids, [0, 1], adapter="c", **facts)
    assert policy.choose(fleet(0, 0), unknown).reason == "miss"
    assert Cost(index, store_hit_weight=0.5, decode_weight=0.0).costs(fleet(0, 0), unknown) == {0: (2, 0), 1: (2, 0)}
    # The shared store's events name no adapter: its entries of "a" are under some writer's id
    # (here replica 1's, id 2), and the store chain is the one of the ids seen that matches.
    for lora in (LoRARequest("a", 1, "/a"), LoRARequest("a", 2, "/a")):
        chain = _engine_hashes(ids, lora)
        assert index.store_match(index.prompt_hashes(ids, [0, 1], adapter="a", **facts).for_store()) == 0
        index.apply(1, KVEventBatch(0.0, [BlockStored(chain, None, [], 16, None, "DISK", None)]))
        assert index.prompt_hashes(ids, [0, 1], adapter="a", **facts).for_store() == chain
        index.apply(1, KVEventBatch(0.0, [BlockRemoved(chain, "DISK")]))
    index.forget(0)   # a restarted replica numbers its adapters anew
    assert index.adapters[0] == {} and index.adapters[1] == {"a": 2}


def test_admission_checks_and_reasons():
    reps = fleet(1, 1, usage=0.5)
    opts = RouterOptions(backends=("a", "b"), max_kv_usage=0.4)
    ok, reasons = admissible(reps, opts)
    assert ok == [] and "KV usage" in reasons[0]
    reps[1].scraped.kv_usage = 0.3
    assert admissible(reps, opts)[0] == [reps[1]]
    opts = RouterOptions(backends=("a",), min_free_kv_blocks=40)
    assert admissible(reps, opts, prompt_blocks=20)[0] == [reps[1]]   # 50 free < 60; 70 free >= 60
    opts = RouterOptions(backends=("a",), max_waiting_requests=2)
    reps[0].in_flight = 5                                             # 5 in flight, 1 running: 4 waiting
    assert admissible(reps, opts)[0] == [reps[1]]
    opts = RouterOptions(backends=("a",), max_queue_delay_s=1.0)
    reps[1].service_s, reps[1].scraped.waiting = 2.0, 1               # 1 waiting * 2 s / 1 running
    assert admissible(reps, opts)[0] == [reps[0]]   # reps[0] not timed yet: no estimate
    assert admissible(reps, RouterOptions(backends=("a",)))[0] == reps
    opts = RouterOptions(backends=("a",), max_requests_per_replica=3)
    reps[1].scraped.running, reps[1].scraped.waiting = 2, 1           # load 3: full; reps[0]: 5 in flight
    ok, reasons = admissible(reps, opts)
    assert ok == [] and "requests >= 3" in reasons[1]
    reps[1].scraped.waiting = 0
    assert admissible(reps, opts)[0] == [reps[1]]


def test_parse_metrics_sums_engines():
    text = """# HELP x
deepinfer:num_requests_running{engine="0",model_name="m"} 2.0
deepinfer:num_requests_running{engine="1",model_name="m"} 1.0
deepinfer:num_requests_waiting{engine="0",model_name="m"} 3.0
deepinfer:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
deepinfer:kv_cache_usage_perc{engine="1",model_name="m"} 0.75
deepinfer:cache_config_info{block_size="16",cache_dtype="auto",engine="0",num_gpu_blocks="100"} 1.0
deepinfer:cache_config_info{block_size="16",cache_dtype="auto",engine="1",num_gpu_blocks="50"} 1.0
vllm:num_requests_waiting{engine="0",model_name="a,b"} 1.0
"""
    s = parse_metrics(text)
    assert (s.running, s.waiting, s.kv_usage, s.num_blocks, s.block_size, s.kv_cache_dtype) == \
        (3.0, 4.0, 0.5, 150, 16, "auto")
