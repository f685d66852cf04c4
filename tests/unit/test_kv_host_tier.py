"""The KV connector seam and its host-memory tier (kv_cache/connector.py, kv_cache/store/host.py),
driven directly: both sides by hand, then through a model runner's step."""

from __future__ import annotations

import math

import pytest
import torch

from deepinfer.config import CacheConfig
from deepinfer.kv_cache.connector import group_key
from deepinfer.kv_cache.specs import FullAttentionSpec, KVCacheGroup, SlidingWindowSpec
from deepinfer.kv_cache.store.factory import GIB, make_kv_connector, make_kv_connector_scheduler
from deepinfer.kv_cache.store.host import HostTierScheduler, plan_pools
from deepinfer.sampling_params import SamplingParams
from deepinfer.types.block_hashes import extend_block_hashes, extra_key
from deepinfer.types.plan import KVConnectorMetadata, NewRequestData, ScheduledChunk, SchedulerPlan

BS = 4
HEADS, DIM = 2, 8
NUM_BLOCKS = 16


def full(gid: int, layers: tuple[int, ...], cache_dtype=torch.bfloat16) -> KVCacheGroup:
    return KVCacheGroup(gid, FullAttentionSpec(HEADS, DIM, torch.bfloat16, cache_dtype), layers)


def sliding(gid: int, layers: tuple[int, ...]) -> KVCacheGroup:
    return KVCacheGroup(gid, SlidingWindowSpec(HEADS, DIM, torch.bfloat16, torch.bfloat16, sliding_window=8), layers)


def slot_bytes(groups: list[KVCacheGroup]) -> int:
    return sum(len(g.layer_ids) * g.spec.page_bytes(BS) for g in groups if g.spec.persisted)


def tier(groups: list[KVCacheGroup], blocks: int) -> HostTierScheduler:
    """A scheduler side holding `blocks` blocks of every persisted group."""
    return HostTierScheduler(groups, BS, blocks * slot_bytes(groups))


def chain(n_blocks: int, salt: str | None = None, first: int = 0) -> list[bytes]:
    hashes: list[bytes] = []
    extend_block_hashes(hashes, list(range(first, first + n_blocks * BS)), BS, extra_key("m", salt))
    return hashes


def random_caches(n_slots: int, dtype: torch.dtype, device="cpu") -> list[tuple[torch.Tensor, torch.Tensor]]:
    """KV tensors of random bit patterns (every byte value, so NaN and inf encodings too)."""
    def one():
        raw = torch.randint(0, 256, (NUM_BLOCKS * BS, HEADS, DIM * dtype.itemsize), dtype=torch.uint8)
        return raw.view(dtype).to(device)
    return [(one(), one()) for _ in range(n_slots)]


def block_bytes(caches, layers: int, block_ids: list[int]) -> list[torch.Tensor]:
    rows = torch.tensor([b * BS + r for b in block_ids for r in range(BS)])
    return [t.view(torch.uint8).cpu()[rows] for k, v in caches[:layers] for t in (k, v)]


def settle(sched, worker):
    """Hand the queued transfers to the worker, run them, and apply what finished."""
    worker.start_transfers(sched.build_connector_meta())
    worker.after_forward()
    worker.wait_all()
    return sched.on_transfers_finished(worker.finished_transfers())


def saved(sched, request_id: str, group_id: int, hashes: list[bytes], block_ids: list[int]) -> None:
    """Save blocks and report the saves done without a worker (index-only tests)."""
    transfers = sched.save_blocks(request_id, group_id, hashes, block_ids)
    sched.build_connector_meta()
    sched.on_transfers_finished([t.transfer_id for t in transfers])


# ------------------------------------------------------------------------------ round trip
def round_trip(dtype: torch.dtype, device: str) -> None:
    groups = [full(0, (0, 1), dtype), sliding(1, (0, 1))]
    sched, worker = make_kv_connector(CacheConfig(kv_offloading_size=8 * slot_bytes(groups) / GIB),
                                      groups, BS, torch.device(device))
    caches = random_caches(2, dtype, device)
    worker.register_kv_caches(caches, groups, BS)
    hashes = chain(3)
    original = block_bytes(caches, 2, [1, 2, 3])
    assert sched.save_blocks("a", 1, hashes, [4, 5, 6]) == []       # sliding window: refused
    [save] = sched.save_blocks("a", 0, hashes, [1, 2, 3])
    assert settle(sched, worker).loaded == []
    assert sched.get_num_new_matched_tokens(hashes, [0, 1], 0) == 3 * BS
    for k, v in caches:   # the device copies are gone (overwritten), as after an eviction
        k.view(torch.uint8).zero_()
        v.view(torch.uint8).zero_()
    [load] = sched.allocate_loads("b", hashes, {0: [9, 11, 7]})
    assert load.tier_slots == save.tier_slots
    assert settle(sched, worker).loaded == ["b"]
    for before, after in zip(original, block_bytes(caches, 2, [9, 11, 7])):
        assert torch.equal(before, after)                            # bit for bit
    assert all(not t.view(torch.uint8).any() for t in block_bytes(caches, 2, [1, 2, 3]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_offloaded_blocks_reload_bit_identical_into_other_blocks(dtype):
    round_trip(dtype, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_offloaded_blocks_reload_bit_identical_on_cuda(dtype):
    round_trip(dtype, "cuda")


@pytest.mark.gpu
def test_cuda_saves_start_behind_the_forward_and_loads_behind_queued_work():
    """A save reads what the step's forward wrote, even when the forward is still running when
    the save is handed over; a load is not overwritten by work queued before it."""
    groups = [full(0, (0,))]
    sched, worker = make_kv_connector(CacheConfig(kv_offloading_size=8 * slot_bytes(groups) / GIB),
                                      groups, BS, torch.device("cuda"))
    caches = random_caches(1, torch.bfloat16, "cuda")
    worker.register_kv_caches(caches, groups, BS)
    k, v = caches[0]
    hashes = chain(2)
    sched.save_blocks("a", 0, hashes, [1, 2])
    worker.start_transfers(sched.build_connector_meta())
    torch.cuda._sleep(50_000_000)         # a long "forward" on the compute stream, then its writes
    k[BS:3 * BS].fill_(3.0)
    v[BS:3 * BS].fill_(-3.0)
    worker.after_forward()
    worker.wait_all()
    sched.on_transfers_finished(worker.finished_transfers())
    sched.allocate_loads("b", hashes, {0: [5, 6]})
    torch.cuda._sleep(50_000_000)         # queued work that still writes the load's blocks
    k[5 * BS:7 * BS].fill_(0.0)
    worker.start_transfers(sched.build_connector_meta())
    worker.after_forward()
    worker.wait_all()
    assert sched.on_transfers_finished(worker.finished_transfers()).loaded == ["b"]
    assert bool((k[5 * BS:7 * BS] == 3.0).all()) and bool((v[5 * BS:7 * BS] == -3.0).all())


# ----------------------------------------------------------------------------- the index
def test_pending_entries_are_not_loadable_until_their_save_finished():
    sched = tier([full(0, (0,))], 4)
    hashes = chain(2)
    [save] = sched.save_blocks("a", 0, hashes, [1, 2])
    assert sched.get_num_new_matched_tokens(hashes, [0], 0) == 0
    with pytest.raises(LookupError, match="not .*loadable"):
        sched.allocate_loads("b", hashes, {0: [3, 4]})
    assert sched.build_connector_meta().saves == [save]
    assert sched.get_num_new_matched_tokens(hashes, [0], 0) == 0      # in flight: still pending
    assert sched.save_blocks("c", 0, hashes, [5, 6]) == []            # being saved: not twice
    assert sched.on_transfers_finished([save.transfer_id]).released == []
    assert sched.get_num_new_matched_tokens(hashes, [0], 0) == 2 * BS
    # Past the device hit only, whole blocks; a short device hit leaves the rest to the tier.
    assert sched.get_num_new_matched_tokens(hashes, [0], BS) == BS
    assert sched.get_num_new_matched_tokens(hashes[:1], [0], 0) == BS
    with pytest.raises(ValueError, match="whole blocks"):
        sched.get_num_new_matched_tokens(hashes, [0], 1)


def test_lru_eviction_order_and_capacity():
    groups = [full(0, (0,))]
    assert plan_pools(groups, BS, 4 * slot_bytes(groups) + 1)[0].num_slots == 4
    sched = tier(groups, 4)
    a, b, c = chain(2, first=0), chain(2, first=100), chain(2, first=200)
    saved(sched, "a", 0, a, [1, 2])
    saved(sched, "b", 0, b, [3, 4])
    [load] = sched.allocate_loads("r", a, {0: [5, 6]})   # a hit: A becomes the most recent
    sched.build_connector_meta()
    sched.on_transfers_finished([load.transfer_id])
    saved(sched, "c", 0, c, [7, 8])                       # full: B goes, the least recent
    assert sched.get_num_new_matched_tokens(a, [0], 0) == 2 * BS
    assert sched.get_num_new_matched_tokens(b, [0], 0) == 0
    assert sched.get_num_new_matched_tokens(c, [0], 0) == 2 * BS
    stats = sched.stats()
    assert (stats.stored_blocks, stats.evictions) == (4, 2)
    # Within one prefix the tail goes first: A keeps its first block when one slot is needed.
    saved(sched, "d", 0, chain(1, first=300), [9])
    assert sched.get_num_new_matched_tokens(a, [0], 0) == BS
    assert sched.get_num_new_matched_tokens(c, [0], 0) == 2 * BS


def test_entries_pinned_by_a_load_are_not_evicted():
    sched = tier([full(0, (0,))], 2)
    a, b = chain(2), chain(1, first=100)
    saved(sched, "a", 0, a, [1, 2])
    [load] = sched.allocate_loads("r", a, {0: [3, 4]})
    assert sched.save_blocks("b", 0, b, [5]) == []         # every slot is pinned: dropped
    assert sched.stats().dropped_saves == 1
    sched.build_connector_meta()
    sched.on_transfers_finished([load.transfer_id])
    assert len(sched.save_blocks("b", 0, b, [5])) == 1     # unpinned: the tail of A gives way
    assert sched.get_num_new_matched_tokens(a, [0], 0) == BS


def test_another_salt_group_or_dtype_misses():
    # Salt: a different hash chain (the chain's extra carries model id and cache_salt).
    sched = tier([full(0, (0, 1)), full(1, (2, 3))], 8)
    salted = chain(2, salt="tenant-a")
    saved(sched, "a", 0, salted, [1, 2])
    assert sched.get_num_new_matched_tokens(salted, [0], 0) == 2 * BS
    assert sched.get_num_new_matched_tokens(chain(2, salt="tenant-b"), [0], 0) == 0
    assert sched.get_num_new_matched_tokens(chain(2), [0], 0) == 0
    # Group: same spec, other layers; a hit needs every persisted group.
    assert sched.get_num_new_matched_tokens(salted, [1], 0) == 0
    assert sched.get_num_new_matched_tokens(salted, [0, 1], 0) == 0
    # Storage dtype: the same layers in fp8 are other bytes.
    bf16, fp8 = full(0, (0,)), full(1, (0,), torch.float8_e4m3fn)
    assert group_key(bf16, BS) != group_key(fp8, BS)
    assert group_key(bf16, BS) != group_key(bf16, 2 * BS)
    sched = tier([bf16, fp8], 4)
    hashes = chain(1)
    saved(sched, "a", 0, hashes, [1])
    assert sched.get_num_new_matched_tokens(hashes, [0], 0) == BS
    assert sched.get_num_new_matched_tokens(hashes, [1], 0) == 0


def test_sliding_window_groups_are_never_saved_or_loaded():
    groups = [full(0, (0,)), sliding(1, (0,))]
    assert [g.spec.persisted for g in groups] == [True, False]
    sched = tier(groups, 4)
    hashes = chain(2)
    assert sched.save_blocks("a", 1, hashes, [1, 2]) == []
    assert sched.stats().refused_saves == 2
    assert sched.build_connector_meta().is_empty
    saved(sched, "a", 0, hashes, [3, 4])
    # The hit counts the persisted groups only; the window is rebuilt, not loaded.
    assert sched.get_num_new_matched_tokens(hashes, [0, 1], 0) == 2 * BS
    assert sched.get_num_new_matched_tokens(hashes, [1], 0) == 0
    with pytest.raises(ValueError, match="not persisted"):
        sched.allocate_loads("b", hashes, {1: [5, 6]})
    # A model whose every layer is sliding-window gets no tier at all.
    assert make_kv_connector(CacheConfig(kv_offloading_size=1.0), [sliding(0, (0,))], BS,
                             torch.device("cpu")) is None


def test_abort_loads_releases_the_tiers_pins():
    sched = tier([full(0, (0,))], 2)
    a, b = chain(2), chain(2, first=100)
    saved(sched, "a", 0, a, [1, 2])
    sched.allocate_loads("r", a, {0: [3, 4]})
    assert sched.abort_loads("r") is False                 # not handed to the worker yet
    assert sched.build_connector_meta().is_empty and sched.num_pending_transfers == 0
    assert len(sched.save_blocks("x", 0, b, [5, 6])) == 1  # unpinned: evictable again
    saved_b = sched.build_connector_meta().saves
    sched.on_transfers_finished([t.transfer_id for t in saved_b])
    # A load already copying: its device blocks stay held until it is reported done.
    [load] = sched.allocate_loads("r", b, {0: [7, 8]})
    sched.build_connector_meta()
    assert sched.abort_loads("r") is True
    assert sched.request_finished("r") is True
    done = sched.on_transfers_finished([load.transfer_id])
    assert (done.loaded, done.released) == ([], ["r"])
    assert len(sched.save_blocks("y", 0, chain(2, first=200), [9, 10])) == 1   # pins gone


def test_request_finished_delays_the_free_until_its_saves_completed():
    sched = tier([full(0, (0,))], 4)
    assert sched.request_finished("idle") is False
    [save] = sched.save_blocks("a", 0, chain(2), [1, 2])
    assert sched.request_finished("a") is True             # queued save: keep the blocks
    with pytest.raises(ValueError, match="finished"):
        sched.save_blocks("a", 0, chain(1, first=50), [3])
    assert sched.build_connector_meta().saves == [save]
    assert sched.num_pending_transfers == 1
    done = sched.on_transfers_finished([save.transfer_id, 12345])   # unknown ids are ignored
    assert (done.loaded, done.released) == ([], ["a"])
    assert sched.num_pending_transfers == 0


def test_stats_count_queries_hits_transfers_and_evictions():
    sched = tier([full(0, (0,))], 2)
    hashes = chain(2)
    saved(sched, "a", 0, hashes, [1, 2])
    hit = sched.get_num_new_matched_tokens(hashes, [0], 0)
    sched.record_query(3 * BS, hit)
    [load] = sched.allocate_loads("b", hashes, {0: [3, 4]})
    sched.build_connector_meta()
    sched.on_transfers_finished([load.transfer_id])
    saved(sched, "c", 0, chain(1, first=100), [5])
    stats = sched.stats()
    assert (stats.queries, stats.hits) == (3 * BS, 2 * BS)
    assert (stats.saved_blocks, stats.loaded_blocks, stats.stored_blocks, stats.evictions) == (3, 2, 2, 1)
    stats.queries = 0
    assert sched.stats().queries == 3 * BS                  # a copy


# ------------------------------------------------------------------------------ config, CLI
def test_kv_offloading_size_is_validated_and_a_flag():
    assert CacheConfig().kv_offloading_size is None
    for bad in (-1, math.nan, math.inf, True, "4"):
        with pytest.raises(ValueError, match="kv_offloading_size"):
            CacheConfig(kv_offloading_size=bad)
    for none in (None, 0, 0.0):
        assert make_kv_connector_scheduler(CacheConfig(kv_offloading_size=none), [full(0, (0,))], BS) is None
    with pytest.raises(ValueError, match="kv_offloading_size holds no block"):
        make_kv_connector_scheduler(CacheConfig(kv_offloading_size=1e-8), [full(0, (0,))], BS)

    from deepinfer.cli.flags import parse_cli
    from deepinfer.cli.main import build_parser
    from deepinfer.cli.server_args import serve_config

    config, _ = serve_config(parse_cli(build_parser(), ["serve", "M", "--kv-offloading-size", "2.5"]))
    assert config.cache.kv_offloading_size == 2.5


# --------------------------------------------------------------------------- in the runner
def test_runner_starts_transfers_around_its_step_and_reports_them(tiny_llama):
    """A prefill step saves its blocks behind the forward; a plan without chunks but with loads
    still runs them; each result reports what finished. The reloaded blocks are the same bytes."""
    from deepinfer import LLM

    llm = LLM(tiny_llama, dtype="float32", num_kv_blocks=32, block_size=BS, max_model_len=64,
              kv_offloading_size=1e-3)
    engine = llm.engine
    runner = engine.executor.runner
    assert runner.kv_connector is not None
    sched = make_kv_connector_scheduler(engine.config, runner.groups, BS)
    groups = range(len(runner.groups))
    prompt = list(range(3, 3 + 3 * BS + 1))
    hashes = chain(3)
    for g in groups:
        sched.save_blocks("a", g, hashes, [1, 2, 3])
    new = NewRequestData("a", prompt, [], SamplingParams(max_tokens=1), frozenset(),
                         [[1, 2, 3, 4] for _ in groups])
    plan = SchedulerPlan([new], [], [ScheduledChunk("a", 0, len(prompt), True)], [], len(prompt),
                         sched.build_connector_meta())
    result = engine.executor.execute(plan)
    assert sorted(result.finished_kv_transfers) == sorted(t.transfer_id for t in plan.kv_connector_metadata.saves)
    sched.on_transfers_finished(result.finished_kv_transfers)
    layers = len(runner.groups[0].layer_ids)
    before = block_bytes(runner.kv_caches, layers, [1, 2, 3])
    assert any(t.view(torch.uint8).any() for t in before)    # the forward wrote them

    assert sched.get_num_new_matched_tokens(hashes, list(groups), 0) == 3 * BS
    sched.allocate_loads("b", hashes, {g: [9, 10, 11] for g in groups})
    loads = SchedulerPlan([], [], [], ["a"], 0, sched.build_connector_meta())
    assert loads.is_empty
    result = engine.executor.execute(loads)
    assert sched.on_transfers_finished(result.finished_kv_transfers).loaded == ["b"]
    for x, y in zip(before, block_bytes(runner.kv_caches, layers, [9, 10, 11])):
        assert torch.equal(x, y)
    # The engine core hands such a plan to the executor instead of idling.
    calls = []
    engine.scheduler.schedule = lambda **_: SchedulerPlan([], [], [], [], 0, KVConnectorMetadata(saves=[]))
    assert engine.step() == []
    engine.scheduler.schedule = lambda **_: SchedulerPlan(
        [], [], [], [], 0, KVConnectorMetadata(saves=[sched.save_blocks("c", 0, chain(1, first=90), [5])[0]]))
    execute_model = engine.executor.execute_model
    engine.executor.execute_model = lambda plan: (calls.append(plan), execute_model(plan))[1]
    engine.step()
    assert len(calls) == 1
