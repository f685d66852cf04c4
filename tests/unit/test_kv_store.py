"""The persistent KV store tier (kv_cache/store/: entry.py, dir.py, redis.py, persistent.py),
both sides of the connector driven by hand: bit-identical round trips through a directory and a
real Redis, faults detected and dropped, a store that goes down and comes back, retention per
traffic class with an injectable clock, capacity LRU, sliding-window KV never written. (Entries
of many blocks, their look-ups and partial runs: test_kv_store_runs.py.)"""

from __future__ import annotations

import os
import time

import pytest
import torch

from deepinfer.config import CacheConfig, parse_retention
from deepinfer.kv_cache.store import entry as entry_format
from deepinfer.kv_cache.store.backend import StoreUnavailable
from deepinfer.kv_cache.store.dir import DirStore
from deepinfer.kv_cache.store.entry import HEADER_SIZE, EntryError, EntryLayout
from deepinfer.kv_cache.store.factory import make_kv_connector
from deepinfer.kv_cache.store.persistent import StoreTierScheduler
from deepinfer.kv_cache.store.persistent_worker import StoreTierWorker
from tests.redis_server import redis_server  # noqa: F401  (a fixture)
from tests.unit.test_kv_host_tier import BS, block_bytes, chain, full, random_caches, sliding

RETENTION = parse_retention("chat=7d,agent=3d")
DAY = 86400.0


class Clock:
    def __init__(self, t: float = 1_700_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def connector(store, groups, device="cpu", run_blocks=None, **worker_kwargs):
    runs = {} if run_blocks is None else {"run_blocks": run_blocks}
    sched = StoreTierScheduler(groups, BS, store, backoff_s=0.2, **runs)
    worker = StoreTierWorker(store, device, backoff_s=0.2, **runs, **worker_kwargs)
    return sched, worker


def settle(sched, worker):
    worker.start_transfers(sched.build_connector_meta())
    worker.after_forward()
    worker.wait_all()
    return sched.on_transfers_finished(worker.finished_transfers(), worker.failed_transfers())


def save_all(sched, worker, caches, groups, hashes, block_ids):
    worker.register_kv_caches(caches, groups, BS)
    for g in groups:
        sched.save_blocks("writer", g.group_id, hashes, block_ids)
    settle(sched, worker)


def load_all(sched, worker, groups, hashes, block_ids, request_id="reader"):
    n = sched.get_num_new_matched_tokens(hashes, [g.group_id for g in groups], 0) // BS
    if n:
        sched.allocate_loads(request_id, hashes[:n], {g.group_id: block_ids[:n] for g in groups if g.spec.persisted})
    return n, settle(sched, worker)


def test_the_io_process_outlives_a_ctrl_c_to_the_group_and_flushes(tmp_path):
    """SIGINT to the server's process group reaches the I/O process too: it keeps going, so the
    engine's flush at shutdown writes what is pending (a killed child dropped it: a server
    stopped with Ctrl-C kept only its first writes)."""
    import signal

    groups = [full(0, (0,))]
    sched, worker = connector(DirStore(str(tmp_path), RETENTION), groups, io_process=True)
    worker.register_kv_caches(random_caches(1, torch.bfloat16), groups, BS)
    os.kill(worker._io._proc.pid, signal.SIGINT)
    os.kill(worker._io._proc.pid, signal.SIGTERM)
    sched.save_blocks("r", 0, chain(3), [1, 2, 3])
    worker.start_transfers(sched.build_connector_meta())
    worker.after_forward()
    worker.close()
    assert worker.stats().written_blocks == 3 and worker.stats().write_errors == 0


# ------------------------------------------------------------------------------------- entry
def test_entry_round_trip_and_every_fault_is_detected():
    layout = EntryLayout(2, 64, "bfloat16")
    blocks = [os.urandom(layout.payload_bytes) for _ in range(3)]   # a run of three blocks
    payload = b"".join(blocks)
    data = entry_format.encode(b"g" * 16, b"h" * 16, layout, blocks, "agent", 123.0)
    assert data == entry_format.encode(b"g" * 16, b"h" * 16, layout, payload, "agent", 123.0)
    header, out = entry_format.decode(data, b"g" * 16, b"h" * 16, layout, 3)
    assert bytes(out) == payload and header.traffic_class == "agent" and header.created == 123.0
    assert header.num_blocks == 3 and len(data) == layout.entry_bytes(3)
    flipped = bytearray(data)
    flipped[HEADER_SIZE + 5] ^= 0x10
    truncated = data[:-7]
    foreign = bytearray(data)
    foreign[4:6] = (entry_format.FORMAT_VERSION + 1).to_bytes(2, "little")
    header_flip = bytearray(data)
    header_flip[30] ^= 1
    for bad, reason in ((bytes(flipped), "corrupt"), (truncated, "truncated"), (data[:10], "truncated"),
                        (bytes(foreign), "version"), (bytes(header_flip), "corrupt")):
        with pytest.raises(EntryError) as err:
            entry_format.decode(bad, b"g" * 16, b"h" * 16, layout, 3)
        assert err.value.reason == reason
    with pytest.raises(EntryError) as err:
        entry_format.decode(data, b"g" * 16, b"x" * 16, layout, 3)
    assert err.value.reason == "mismatch"
    with pytest.raises(EntryError) as err:   # a run of another length under that name (another grid)
        entry_format.decode(data, b"g" * 16, b"h" * 16, layout, 2)
    assert err.value.reason == "mismatch"
    with pytest.raises(EntryError):
        entry_format.decode(data, b"g" * 16, b"h" * 16, EntryLayout(2, 64, "float8_e4m3fn"), 3)


def test_reads_in_place_match_whole_reads_for_any_entry_length(tmp_path):
    """DirStore.get_into (one readv into the slot) and the backends' default (get, then copy)
    fill heads and payloads alike and report the entry's true size, for whole, short (even
    shorter than the header), truncated and overlong entries and absent ones."""
    from deepinfer.kv_cache.store.backend import StoreBackend

    store = DirStore(str(tmp_path), RETENTION)
    layout = EntryLayout(2, 64, "bfloat16")
    data = entry_format.encode(b"g" * 16, b"h" * 16, layout, os.urandom(2 * layout.payload_bytes), "chat", 1.0)
    lengths = [len(data), 10, HEADER_SIZE + 5, len(data) - 3, len(data) + 9, HEADER_SIZE + layout.payload_bytes + 7]
    keys = [(b"g" * 16, bytes([i]) * 16) for i in range(len(lengths) + 1)]   # the last one absent
    for key, n in zip(keys, lengths):
        store.put([(key, (data + b"x" * 9)[:n], "chat")])
    results = []
    for read in (store.get_into, lambda *a: StoreBackend.get_into(store, *a)):
        heads = [bytearray(HEADER_SIZE) for _ in keys]
        payloads = [[memoryview(bytearray(layout.payload_bytes)) for _ in range(2)] for _ in keys]   # a slot a block
        results.append((read(keys, heads, payloads), [bytes(h) for h in heads],
                        [b"".join(bytes(p) for p in parts) for parts in payloads]))
    assert results[0] == results[1]
    sizes, heads, payloads = results[0]
    assert sizes == lengths + [None]
    assert heads[0] == data[:HEADER_SIZE] and payloads[0] == data[HEADER_SIZE:]
    entry_format.check(heads[0], payloads[0], sizes[0], b"g" * 16, b"h" * 16, layout, 2)
    with pytest.raises(EntryError, match="truncated"):
        entry_format.check(heads[3], payloads[3], sizes[3], b"g" * 16, b"h" * 16, layout, 2)
    with pytest.raises(EntryError, match="corrupt"):
        entry_format.check(heads[4], payloads[4], sizes[4], b"g" * 16, b"h" * 16, layout, 2)
    with pytest.raises(EntryError, match="truncated"):   # ends inside the second block's slot
        entry_format.check(heads[5], payloads[5], sizes[5], b"g" * 16, b"h" * 16, layout, 2)


# ------------------------------------------------------------------------------ round trips
def _round_trip(make_store, dtype, device="cpu", io_process=None):
    groups = [full(0, (0, 1), cache_dtype=dtype)]
    hashes = chain(5)
    src = random_caches(2, dtype, device)
    writer = connector(make_store(), groups, device, io_process=io_process)
    save_all(*writer, src, groups, hashes, [3, 7, 1, 12, 5])
    assert writer[1].stats().written_blocks == 5
    writer[1].close()
    # A fresh instance (both sides new) on the same store: cross-instance reuse.
    dst = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in src]
    sched, worker = connector(make_store(), groups, device, io_process=io_process)
    worker.register_kv_caches(dst, groups, BS)
    n, done = load_all(sched, worker, groups, hashes, [0, 2, 4, 6, 8])
    assert n == 5 and done.loaded == ["reader"] and not done.failed
    for a, b in zip(block_bytes(src, 2, [3, 7, 1, 12, 5]), block_bytes(dst, 2, [0, 2, 4, 6, 8])):
        assert torch.equal(a, b)
    # Saving what the store holds writes nothing (the blocks just loaded are known).
    assert sched.save_blocks("again", 0, hashes, [0, 2, 4, 6, 8]) == []
    worker.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_round_trip_is_bit_identical_through_a_directory(tmp_path, dtype):
    _round_trip(lambda: DirStore(str(tmp_path), RETENTION), dtype)


def test_round_trip_through_the_io_process_is_bit_identical(tmp_path, redis_server):  # noqa: F811
    """The data path in a process of its own (a GPU engine's default; entry_io.ProcessIO), over
    the staging buffer both map: a directory and a Redis, written by one instance, read by the next."""
    from deepinfer.kv_cache.store.redis import RedisStore

    _round_trip(lambda: DirStore(str(tmp_path), RETENTION), torch.bfloat16, io_process=True)
    _round_trip(lambda: RedisStore(redis_server.url, RETENTION), torch.float8_e4m3fn, io_process=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_round_trip_is_bit_identical_through_a_directory_on_cuda(tmp_path, dtype):
    _round_trip(lambda: DirStore(str(tmp_path), RETENTION), dtype, "cuda")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_round_trip_is_bit_identical_through_redis(redis_server, dtype):  # noqa: F811
    from deepinfer.kv_cache.store.redis import RedisStore

    _round_trip(lambda: RedisStore(redis_server.url, RETENTION), dtype)


def test_factory_picks_the_store_and_refuses_two_tiers(tmp_path):
    groups = [full(0, (0,))]
    sched, worker = make_kv_connector(CacheConfig(kv_store=f"dir://{tmp_path}"), groups, BS, torch.device("cpu"))
    assert isinstance(sched, StoreTierScheduler) and isinstance(worker, StoreTierWorker)
    worker.close()
    with pytest.raises(ValueError, match="one KV tier at a time"):
        CacheConfig(kv_store=f"dir://{tmp_path}", kv_offloading_size=1)
    with pytest.raises(ValueError, match="kv_store must be"):
        CacheConfig(kv_store="s3://bucket")
    for bad, message in (("chat=7x", "not a duration"), ("agent=3d", "name the class 'chat'"),
                         ("chat", "CLASS=DURATION"), ("chat=0s", "positive"), ("chat=1d,chat=2d", "twice")):
        with pytest.raises(ValueError, match=f"kv_retention.*{message}|{message}.*kv_retention|kv_retention"):
            CacheConfig(kv_retention=bad)
    assert parse_retention("chat=7d, agent=3d,batch=90m,x=30") == {"chat": 7 * DAY, "agent": 3 * DAY,
                                                                    "batch": 5400.0, "x": 30.0}


# ------------------------------------------------------------------------------------ faults
def _file(store: DirStore, groups, hashes, i):
    """The entry whose run ends at block i (inclusive)."""
    return store.path((StoreTierScheduler(groups, BS, store)._layouts[0][0], hashes[i]))


@pytest.mark.parametrize("fault,io_process", [("bit_flip", False), ("truncate", False), ("delete", False),
                                              ("foreign_version", False), ("delete_after_lookup", False),
                                              ("truncate_after_lookup", False), ("extend_after_lookup", False),
                                              ("bit_flip", True), ("delete_after_lookup", True),
                                              ("truncate_after_lookup", True)])
def test_a_bad_entry_is_detected_dropped_counted_and_never_loaded(tmp_path, fault, io_process):
    """Six blocks in runs of two: the middle run's entry is damaged. Found by the look-up (its
    size, or its absence) the hit stops before it; found by the load (its checks, or gone by
    then), the load fails, the entry is dropped, its blocks never reach the device, and the
    next look-up stops before it: the prefix up to it still loads."""
    groups = [full(0, (0, 1))]
    hashes = chain(6)
    src = random_caches(2, torch.bfloat16)
    store = DirStore(str(tmp_path), RETENTION)
    save_all(*connector(store, groups, run_blocks=2), src, groups, hashes, [1, 2, 3, 4, 5, 6])
    path = _file(store, groups, hashes, 3)
    if fault == "bit_flip":
        data = bytearray(open(path, "rb").read())
        data[-100] ^= 0x04
        open(path, "wb").write(bytes(data))
    elif fault == "truncate":
        os.truncate(path, os.path.getsize(path) - 10)
    elif fault == "delete":
        os.remove(path)
    elif fault == "foreign_version":
        data = bytearray(open(path, "rb").read())
        data[4:6] = (9).to_bytes(2, "little")
        open(path, "wb").write(bytes(data))
    # A half-written temp file beside it is never read either.
    open(_file(store, groups, hashes, 5) + ".tmp.1.2.dead", "wb").write(b"DIKV\x01")
    dst = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in src]
    sched, worker = connector(DirStore(str(tmp_path), RETENTION), groups, io_process=io_process, run_blocks=2)
    worker.register_kv_caches(dst, groups, BS)
    n = sched.get_num_new_matched_tokens(hashes, [0], 0) // BS
    if fault in ("truncate", "delete"):   # seen by the look-up itself: stops at the second run
        assert n == 2
        assert sched.stats().corrupt_entries == (fault == "truncate")
        assert not os.path.exists(path)
        return
    assert n == 6
    if fault == "delete_after_lookup":
        os.remove(path)
    elif fault == "truncate_after_lookup":   # read short, into a slot: its length says so
        os.truncate(path, os.path.getsize(path) - 10)
    elif fault == "extend_after_lookup":
        open(path, "ab").write(b"\0" * 7)
    sched.allocate_loads("reader", hashes, {0: [7, 8, 9, 10, 11, 12]})
    done = settle(sched, worker)
    assert done.failed == ["reader"] and done.loaded == []
    stats = worker.stats()
    assert stats.failed_loads == 1 and sched.stats().failed_loads == 6 and sched.num_pending_transfers == 0
    if fault == "bit_flip":
        assert stats.bad_entries["corrupt"] == 1
    elif fault == "foreign_version":
        assert stats.bad_entries["version"] == 1
    elif fault == "truncate_after_lookup":
        assert stats.bad_entries["truncated"] == 1
    elif fault == "extend_after_lookup":
        assert stats.bad_entries["corrupt"] == 1
    else:
        assert stats.missing_entries == 1
    assert not os.path.exists(path)                 # dropped
    # Nothing of the bad run reached its device blocks (the runs around it are read in parallel
    # and may have been copied: a failed load's blocks are freed, never read).
    assert all(not t.any() for t in block_bytes(dst, 2, [9, 10]))
    # The next look-up stops before the dropped entry, and the prefix up to it loads.
    assert sched.get_num_new_matched_tokens(hashes, [0], 0) == 2 * BS
    sched.allocate_loads("again", hashes[:2], {0: [13, 14]})
    assert settle(sched, worker).loaded == ["again"]
    for a, b in zip(block_bytes(src, 2, [1, 2]), block_bytes(dst, 2, [13, 14])):
        assert torch.equal(a, b)
    worker.close()


def test_a_load_slower_than_the_timeout_fails(tmp_path):
    groups = [full(0, (0,))]
    hashes = chain(2)
    src = random_caches(1, torch.bfloat16)
    save_all(*connector(DirStore(str(tmp_path), RETENTION), groups), src, groups, hashes, [1, 2])

    class Slow(DirStore):
        def get_into(self, keys, heads, payloads):
            time.sleep(0.5)
            return super().get_into(keys, heads, payloads)

    dst = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in src]
    sched, worker = connector(Slow(str(tmp_path), RETENTION), groups, load_timeout_s=0.1)
    worker.register_kv_caches(dst, groups, BS)
    n, done = load_all(sched, worker, groups, hashes, [3, 4])
    assert n == 2 and done.failed == ["reader"] and worker.stats().load_timeouts == 1
    time.sleep(0.6)   # the late read is dropped, never copied
    assert worker.finished_transfers() == [] and not dst[0][0].any()
    worker.close()


@pytest.mark.parametrize("io_process", [False, True])
def test_redis_down_never_stops_serving_and_is_used_again_when_back(redis_server, io_process):  # noqa: F811
    from deepinfer.kv_cache.store.redis import RedisStore

    groups = [full(0, (0,))]
    hashes = chain(3)
    src = random_caches(1, torch.bfloat16)
    sched, worker = connector(RedisStore(redis_server.url, RETENTION, connect_timeout_s=0.2), groups,
                              io_process=io_process)
    worker.register_kv_caches(src, groups, BS)
    redis_server.stop()
    assert sched.get_num_new_matched_tokens(hashes, [0], 0) == 0      # a miss, not an error
    assert sched.stats().store_errors == 1 and sched.health.down
    assert sched.save_blocks("r", 0, hashes, [1, 2, 3]) == []          # skipped while down
    assert sched.stats().dropped_saves == 3
    redis_server.start()
    time.sleep(0.25)   # the back-off
    assert sched.get_num_new_matched_tokens(hashes, [0], 0) == 0 and not sched.health.down
    sched.save_blocks("r", 0, hashes, [1, 2, 3])
    settle(sched, worker)
    assert sched.get_num_new_matched_tokens(hashes, [0], 0) == 3 * BS
    # Down in the middle of writes: the writer counts it and drops, the step goes on.
    redis_server.stop()
    sched.save_blocks("r", 0, chain(2, first=1000), [4, 5])
    settle(sched, worker)
    assert worker.stats().write_errors + worker.stats().dropped_saves >= 1
    worker.close()


def test_a_steps_saves_of_several_groups_and_classes_are_written_together(tmp_path):
    """One step's saves (three requests, two groups, chat and agent) are staged and written per
    group and class in one batch: every block bit-identical in a fresh instance, each under its
    own class (the agent entries are the ones gone after 3 days)."""
    clock = Clock()
    groups = [full(0, (0,)), full(1, (1,))]   # one pool: the groups share its slot, with their own block ids
    src = random_caches(1, torch.bfloat16)
    sched, worker = connector(DirStore(str(tmp_path), RETENTION, clock=clock), groups)
    worker.register_kv_caches(src, groups, BS)
    calls, call = [], worker._io.call
    worker._io.call = lambda op, *args: (calls.append(op), call(op, *args))[1]
    saves = {"a": (chain(3, first=0), [1, 2, 3], "chat"), "b": (chain(2, first=100), [4, 5], "agent"),
             "c": (chain(2, first=200), [6, 7], "chat")}
    for name, (hashes, ids, cls) in saves.items():
        for g in groups:   # group 1's blocks are group 0's + 8
            sched.save_blocks(name, g.group_id, hashes, [i + 8 * g.group_id for i in ids], traffic_class=cls)
    settle(sched, worker)
    assert worker.stats().written_blocks == 14
    assert calls.count("write") == 4   # (group 0, group 1) x (chat, agent), not one per save
    worker.close()

    def reload(name):
        hashes, ids, _ = saves[name]
        dst = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in src]
        sched, worker = connector(DirStore(str(tmp_path), RETENTION, clock=clock), groups)
        worker.register_kv_caches(dst, groups, BS)
        n = sched.get_num_new_matched_tokens(hashes, [0, 1], 0) // BS
        if n:
            sched.allocate_loads("reader", hashes[:n], {0: [9, 10, 11][:n], 1: [12, 13, 14][:n]})
            settle(sched, worker)
            for got, want in (([9, 10, 11][:n], ids), ([12, 13, 14][:n], [i + 8 for i in ids])):
                for a, b in zip(block_bytes(src, 1, want), block_bytes(dst, 1, got)):
                    assert torch.equal(a, b)
        worker.close()
        return n

    assert [reload(name) for name in saves] == [3, 2, 2]
    clock.t += 3 * DAY + 3600
    DirStore(str(tmp_path), RETENTION, clock=clock).gc()
    assert [reload(name) for name in saves] == [3, 0, 2]


# --------------------------------------------------------------------------------- retention
def test_dir_retention_per_class_counts_from_last_use(tmp_path):
    clock = Clock()
    store = DirStore(str(tmp_path), RETENTION, clock=clock)
    layout = EntryLayout(1, 16, "bfloat16")
    keys = {name: (b"g" * 16, bytes([i]) * 16) for i, name in enumerate(["chat", "agent", "touched"])}
    for name, key in keys.items():
        cls = "agent" if name == "agent" else "chat"
        store.put([(key, entry_format.encode(*key, layout, bytes(32), cls, clock()), cls)])
    size = [layout.entry_bytes(1)]

    def alive(name):
        return store.exists([keys[name]], size) == [1]

    clock.t += 3 * DAY + 3600
    assert store.gc() == 1 and not alive("agent") and alive("chat")
    clock.t += 3 * DAY
    store.touch([keys["touched"]], "chat")          # a hit at day 6
    clock.t += 1 * DAY + 3600                        # day 7 + 2 h
    assert store.gc() == 1 and not alive("chat") and alive("touched")
    clock.t += 5 * DAY                               # day 12 + 2 h: touched 6 d 1 h ago
    assert store.gc() == 0 and alive("touched")
    clock.t += 1 * DAY
    assert store.gc() == 1 and not alive("touched")
    assert os.listdir(store.index) == []             # buckets processed are gone


def test_dir_gc_opens_only_expired_buckets(tmp_path):
    clock = Clock()
    store = DirStore(str(tmp_path), RETENTION, clock=clock)
    layout = EntryLayout(1, 16, "bfloat16")
    for i in range(20):
        key = (b"g" * 16, i.to_bytes(16, "big"))
        store.put([(key, entry_format.encode(*key, layout, bytes(32), "chat", clock()), "chat")])
        clock.t += 3600
    opened = []
    claim = store._claim
    store._claim = lambda name: (opened.append(name), claim(name))[1]
    clock.t = 1_700_000_000.0 + 7 * DAY + 2 * 3600
    store.gc()
    assert 0 < len(opened) <= 3 and store.expired == len(opened)


def test_redis_retention_is_redis_expiry_and_a_hit_extends_it(redis_server):  # noqa: F811
    import redis

    from deepinfer.kv_cache.store.redis import RedisStore

    clock = Clock(time.time())
    store = RedisStore(redis_server.url, RETENTION, clock=clock)
    client = redis.Redis.from_url(redis_server.url)
    layout = EntryLayout(1, 16, "bfloat16")
    chat, agent = (b"g" * 16, b"c" * 16), (b"g" * 16, b"a" * 16)
    store.put([(chat, entry_format.encode(*chat, layout, bytes(32), "chat", clock()), "chat"),
               (agent, entry_format.encode(*agent, layout, bytes(32), "agent", clock()), "agent")])
    assert client.pttl(store.name(chat)) / 1000 == pytest.approx(7 * DAY, abs=5)
    assert client.pttl(store.name(agent)) / 1000 == pytest.approx(3 * DAY, abs=5)
    clock.t += 2 * DAY
    store.touch([agent], "agent")
    assert client.pttl(store.name(agent)) / 1000 == pytest.approx(5 * DAY, abs=5)   # 2 d + 3 d from now
    clock.t = time.time() - 3 * DAY + 0.3    # "last used 3 days ago, less 0.3 s": expires in 0.3 s
    store.touch([agent], "agent")
    time.sleep(0.5)
    assert client.exists(store.name(agent)) == 0 and client.exists(store.name(chat)) == 1


def test_dir_capacity_evicts_least_recently_used_first(tmp_path):
    clock = Clock()
    layout = EntryLayout(1, 512, "bfloat16")
    limit = 10 * layout.entry_bytes(1)
    store = DirStore(str(tmp_path), RETENTION, size_bytes=limit, clock=clock)
    keys = [(b"g" * 16, i.to_bytes(16, "big")) for i in range(12)]
    for key in keys[:10]:
        store.put([(key, entry_format.encode(*key, layout, bytes(1024), "chat", clock()), "chat")])
        clock.t += 400
    store.touch([keys[0]], "chat")    # the oldest, used again: now the most recent
    clock.t += 400
    for key in keys[10:]:
        store.put([(key, entry_format.encode(*key, layout, bytes(1024), "chat", clock()), "chat")])
    present = [store.exists([k], [layout.entry_bytes(1)]) == [1] for k in keys]
    assert store.usage() <= limit and store.evicted >= 2
    assert present[0] and present[10] and present[11]
    assert not present[1] and not present[2]          # least recently used went first


# ------------------------------------------------------------------------------ sliding window
def test_sliding_window_kv_is_never_written(tmp_path):
    groups = [full(0, (0,)), sliding(1, (1,))]
    hashes = chain(3)
    store = DirStore(str(tmp_path), RETENTION)
    sched, worker = connector(store, groups)
    worker.register_kv_caches(random_caches(2, torch.bfloat16), groups, BS)
    assert sched.save_blocks("r", 1, hashes, [1, 2, 3]) == []
    assert sched.stats().refused_saves == 3
    sched.save_blocks("r", 0, hashes, [1, 2, 3])
    settle(sched, worker)
    files = [f for _, _, fs in os.walk(store.blocks) for f in fs]
    full_key = sched._layouts[0][0].hex()
    assert files == [f"{hashes[2].hex()}.{full_key}.kv"]   # one run of three blocks, named by its last
    assert sched.get_num_new_matched_tokens(hashes, [0, 1], 0) == 3 * BS   # the window is replayed
    worker.close()


def test_a_store_that_is_unwritable_drops_saves_and_keeps_serving(tmp_path, monkeypatch):
    groups = [full(0, (0,))]
    store = DirStore(str(tmp_path), RETENTION)
    sched, worker = connector(store, groups)
    worker.register_kv_caches(random_caches(1, torch.bfloat16), groups, BS)

    def full_disk(items):
        raise StoreUnavailable("[Errno 28] No space left on device")
    monkeypatch.setattr(store, "put", full_disk)
    sched.save_blocks("r", 0, chain(2), [1, 2])
    done = settle(sched, worker)
    assert done.loaded == [] and sched.num_pending_transfers == 0
    assert worker.stats().write_errors == 1 and worker.stats().dropped_saves == 2
    worker.close()


def test_a_load_when_redis_died_after_the_look_up_fails_and_recomputes(redis_server):  # noqa: F811
    from deepinfer.kv_cache.store.redis import RedisStore

    groups = [full(0, (0,))]
    hashes = chain(2)
    src = random_caches(1, torch.bfloat16)
    save_all(*connector(RedisStore(redis_server.url, RETENTION), groups), src, groups, hashes, [1, 2])
    dst = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in src]
    sched, worker = connector(RedisStore(redis_server.url, RETENTION, connect_timeout_s=0.2), groups)
    worker.register_kv_caches(dst, groups, BS)
    assert sched.get_num_new_matched_tokens(hashes, [0], 0) == 2 * BS
    sched.allocate_loads("reader", hashes, {0: [3, 4]})
    redis_server.stop()
    done = settle(sched, worker)
    assert done.failed == ["reader"] and worker.stats().read_errors == 1 and not dst[0][0].any()
    worker.close()


def test_the_traffic_class_is_the_entrys_retention_class(tmp_path):
    groups = [full(0, (0,))]
    store = DirStore(str(tmp_path), RETENTION)
    sched, worker = connector(store, groups)
    worker.register_kv_caches(random_caches(1, torch.bfloat16), groups, BS)
    hashes = [chain(1)[0], chain(1, first=100)[0]]   # two prompts of one block
    sched.save_blocks("a", 0, hashes[:1], [1], traffic_class="agent", positions=[0])
    sched.save_blocks("c", 0, hashes[1:], [2], positions=[0])          # unset: "chat"
    assert sched.build_connector_meta().saves == []   # a shorter run waits for its request's end
    assert sched.request_finished("a") and sched.request_finished("c")
    settle(sched, worker)
    classes = [entry_format.decode_header(open(_file(store, groups, hashes, i), "rb").read()).traffic_class
               for i in range(2)]
    assert classes == ["agent", "chat"]
    assert sorted(name.split(".")[1] for name in os.listdir(store.index)) == ["agent", "chat"]
    with pytest.raises(ValueError, match="kv_retention"):
        sched.save_blocks("b", 0, chain(1, first=99), [3], traffic_class="batch")
    worker.close()


def test_two_instances_writing_the_same_blocks_at_once_is_safe(tmp_path):
    import threading

    layout = EntryLayout(2, 4096, "bfloat16")
    keys = [(b"g" * 16, i.to_bytes(16, "big")) for i in range(20)]
    items = [(k, entry_format.encode(*k, layout, bytes([i]) * layout.payload_bytes, "chat", 0.0), "chat")
             for i, k in enumerate(keys)]
    stores = [DirStore(str(tmp_path), RETENTION) for _ in range(4)]
    threads = [threading.Thread(target=s.put, args=(items,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for (key, data, _), raw in zip(items, stores[0].get(keys)):
        assert raw == data
        entry_format.decode(raw, *key, layout, 1)
    assert not [f for _, _, fs in os.walk(stores[0].blocks) for f in fs if ".tmp." in f]


def test_shutdown_flushes_within_a_bounded_time(tmp_path):
    groups = [full(0, (0,))]

    class Slow(DirStore):
        def put(self, items):
            time.sleep(0.3)
            super().put(items)

    store = Slow(str(tmp_path), RETENTION)
    sched, worker = connector(store, groups)
    worker.register_kv_caches(random_caches(1, torch.bfloat16), groups, BS)
    for i in range(10):   # ten steps, one save each: ten writes of 0.3 s
        sched.save_blocks(f"r{i}", 0, chain(1, first=10 * i), [i])
        worker.start_transfers(sched.build_connector_meta())
        worker.after_forward()
    start = time.monotonic()
    worker.close(timeout_s=0.5)
    assert time.monotonic() - start < 2.5
    stats = worker.stats()
    assert 1 <= stats.written_blocks < 10 and stats.written_blocks + stats.dropped_saves <= 10
