"""A persistent store's entries of many blocks (kv_cache/store/runs.py), both sides of the connector
driven by hand over a real directory and a real redis-server: a prefix of 37 blocks saved as a
request's steps publish it is two whole runs of 16 and a shorter one of 5, round trips
bit-identical, and is found with one existence check per run (Redis: one round trip); a longer
prompt finds the shorter run with a few more checks; a device prefix that ends inside a run, and
a hit that stops short of an entry, read whole entries and copy only the blocks they need; an
entry of the previous format is refused (counted, never loaded); a load's runs are read in
parallel and each is copied to the device as it lands, while later ones are still being read."""

from __future__ import annotations

import struct
import threading
import time
import zlib

import pytest
import torch

from deepinfer.kv_cache.store import entry as entry_format
from deepinfer.kv_cache.store.dir import DirStore
from deepinfer.kv_cache.store.runs import CHUNK_BLOCKS, OpenRuns, look_up_ends, partial_ends, runs_of
from tests.redis_server import redis_server  # noqa: F401  (a fixture)
from tests.unit.test_kv_host_tier import BS, HEADS, block_bytes, chain, full
from tests.unit.test_kv_store import RETENTION, connector, settle

NUM_BLOCKS = 96
IDS = list(range(1, 46))        # the writer's device blocks of blocks 0..44
DST = list(range(50, 95))       # the reader's


def caches(n_layers: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    def one():
        return torch.randint(0, 256, (NUM_BLOCKS * BS, HEADS, 16), dtype=torch.uint8).view(torch.bfloat16)
    return [(one(), one()) for _ in range(n_layers)]


def zeros_like(src):
    return [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in src]


def same(src, src_ids, dst, dst_ids, layers=2) -> bool:
    return all(torch.equal(a, b) for a, b in zip(block_bytes(src, layers, src_ids), block_bytes(dst, layers, dst_ids)))


def make_store(kind: str, tmp_path, redis_server):  # noqa: F811
    if kind == "dir":
        return DirStore(str(tmp_path), RETENTION)
    from deepinfer.kv_cache.store.redis import RedisStore

    return RedisStore(redis_server.url, RETENTION)


def save_as_steps(sched, worker, hashes, groups, steps=(5, 9, 20, 37)) -> None:
    """One request publishing blocks over several steps (each save from its run's grid line on,
    as KVTierLink.save hands them), then finishing: its shorter last run is queued then."""
    done = 0
    for stop in steps:
        first = done - done % CHUNK_BLOCKS
        for g in groups:
            sched.save_blocks("writer", g.group_id, hashes[first:stop], IDS[first:stop],
                              positions=list(range(first, stop)))
        worker.start_transfers(sched.build_connector_meta())
        worker.after_forward()
        done = stop
    assert sched.request_finished("writer")   # its blocks stay until the shorter run is off the device
    settle(sched, worker)


# ---------------------------------------------------------------------------------- the grid
def test_the_run_grid():
    assert look_up_ends(0, 37) == [16, 32, 37]
    assert look_up_ends(20, 37) == [32, 37] and look_up_ends(37, 37) == []
    assert runs_of(20, 37) == [(16, 32), (32, 37)] and runs_of(0, 16) == [(0, 16)]
    assert partial_ends(45, 0) == list(range(44, 32, -1))   # the run [32, 48) cut at 45
    assert partial_ends(48, 40) == list(range(47, 40, -1))   # none at or before the device's prefix
    gathered = OpenRuns(4)
    assert gathered.add([0, 1, 2], [b"a", b"b", b"c"], [10, 11, 12]) == []
    assert gathered.add([2, 3, 4, 5], [b"c", b"d", b"e", b"f"], [12, 13, 14, 15]) == [
        (0, [b"a", b"b", b"c", b"d"], [10, 11, 12, 13])]
    assert gathered.add([9], [b"j"], [19]) == []               # a run without its first block
    assert gathered.drain() == [(4, [b"e", b"f"], [14, 15])] and not gathered


# ------------------------------------------------------------------------- 37 blocks, stored
@pytest.mark.parametrize("kind", ["dir", "redis"])
def test_a_prefix_of_37_blocks_is_three_entries_found_with_one_check_each(tmp_path, redis_server, kind):  # noqa: F811
    groups = [full(0, (0, 1))]
    hashes = chain(45)
    src = caches(2)
    sched, worker = connector(make_store(kind, tmp_path, redis_server), groups)
    worker.register_kv_caches(src, groups, BS)
    save_as_steps(sched, worker, hashes[:37], groups)
    stats = worker.stats()
    assert (stats.written_blocks, stats.written_entries, stats.dropped_saves) == (37, 3, 0)
    gk, layout = sched._layouts[0]
    store = make_store(kind, tmp_path, redis_server)
    sizes = {end: layout.entry_bytes(n) for end, n in ((16, 16), (32, 16), (37, 5))}
    assert [store.exists([(gk, hashes[end - 1])], [size]) for end, size in sizes.items()] == [[1], [1], [1]]
    worker.close()

    # A fresh instance: the 37 blocks are found with three checks, one call (a Redis round trip).
    dst = zeros_like(src)
    store = make_store(kind, tmp_path, redis_server)
    sched, worker = connector(store, groups)
    worker.register_kv_caches(dst, groups, BS)
    assert sched.get_num_new_matched_tokens(hashes[:37], [0], 0) == 37 * BS
    assert (store.checks, store.check_calls) == (3, 1)
    sched.allocate_loads("reader", hashes[:37], {0: DST[:37]})
    assert settle(sched, worker).loaded == ["reader"]
    assert same(src, IDS[:37], dst, DST[:37]) and worker.stats().loaded_blocks == 37
    # A longer prompt (the next turn): [32, 48) is not there, its shorter entry [32, 37) is,
    # found from the longest candidate down: dir stops at it (8 stats), Redis asks all 12 in
    # one more round trip. The two whole runs, seen a moment ago, are not asked again.
    assert sched.get_num_new_matched_tokens(hashes, [0], 0) == 37 * BS
    assert (store.checks - 3, store.check_calls - 1) == ((1 + 8, 2) if kind == "dir" else (1 + 12, 2))
    worker.close()


def test_every_group_is_checked_per_run(tmp_path):
    groups = [full(0, (0,)), full(1, (1,))]
    hashes = chain(37)
    src = caches(2)
    store = DirStore(str(tmp_path), RETENTION)
    sched, worker = connector(store, groups)
    worker.register_kv_caches(src, groups, BS)
    save_as_steps(sched, worker, hashes, groups)
    assert worker.stats().written_entries == 6
    worker.close()
    store = DirStore(str(tmp_path), RETENTION)
    sched, worker = connector(store, groups)
    assert sched.get_num_new_matched_tokens(hashes, [0, 1], 0) == 37 * BS
    assert store.checks == 2 * 3
    worker.close()


def test_whole_entries_are_read_and_only_the_blocks_a_hit_needs_copied(tmp_path):
    """A device prefix of 20 blocks: the run [16, 32) is read whole and its blocks 20..31
    copied. A prompt of exactly 37 blocks may hit 36 (its last token is computed): the entry
    [32, 37) is found through the request's next hash and read whole, its last block not copied."""
    groups = [full(0, (0, 1))]
    hashes = chain(37)
    src = caches(2)
    sched, worker = connector(DirStore(str(tmp_path), RETENTION), groups)
    worker.register_kv_caches(src, groups, BS)
    save_as_steps(sched, worker, hashes, groups)
    worker.close()

    dst = zeros_like(src)
    sched, worker = connector(DirStore(str(tmp_path), RETENTION), groups)
    worker.register_kv_caches(dst, groups, BS)
    assert sched.get_num_new_matched_tokens(hashes, [0], 20 * BS) == 17 * BS
    (load,) = sched.allocate_loads("mid", hashes[20:], {0: DST[20:37]}, first_block=20)
    assert load.run_lengths == [16, 5] and load.device_block_ids[:4] == [-1] * 4
    assert settle(sched, worker).loaded == ["mid"]
    assert same(src, IDS[20:37], dst, DST[20:37])
    assert not any(t.any() for t in block_bytes(dst, 2, DST[16:20]))    # read, not copied

    dst = zeros_like(src)
    sched, worker = connector(DirStore(str(tmp_path), RETENTION), groups)
    worker.register_kv_caches(dst, groups, BS)
    assert sched.get_num_new_matched_tokens(hashes[:36], [0], 0) == 32 * BS   # without the next hash
    assert sched.get_num_new_matched_tokens(hashes[:36], [0], 0, next_hash=hashes[36]) == 36 * BS
    (load,) = sched.allocate_loads("aligned", hashes, {0: DST[:36]})
    assert load.run_lengths == [16, 16, 5] and load.device_block_ids[-1] == -1
    assert settle(sched, worker).loaded == ["aligned"]
    assert same(src, IDS[:36], dst, DST[:36]) and not any(t.any() for t in block_bytes(dst, 2, DST[36:37]))
    assert worker.stats().loaded_blocks == 36
    worker.close()


def test_look_ups_ask_the_store_only_past_the_runs_seen_there(tmp_path):
    """A second look-up of a prefix (a conversation's next turn) asks the store about its new
    runs only; once the seen runs age past KNOWN_TTL_S it asks about all of them again. A seen
    run another instance dropped since fails its load (covered by the loads' own tests): the
    request recomputes from there."""
    from deepinfer.kv_cache.store import persistent_lookup

    groups = [full(0, (0,))]
    store = DirStore(str(tmp_path), RETENTION)
    sched, worker = connector(store, groups, run_blocks=2)
    hashes = chain(8)
    worker.register_kv_caches(caches(1), groups, BS)
    sched.save_blocks("writer", 0, hashes[:4], IDS[:4])   # a whole prefix, from block 0
    settle(sched, worker)
    checks = store.checks
    assert sched.get_num_new_matched_tokens(hashes, [0], 0) == 4 * BS
    # Runs [0, 2) and [2, 4) are there, [4, 6) is not: three checks; then the run's shorter
    # entry (ending at 5) is looked for: one more.
    assert store.checks - checks == 4
    checks = store.checks
    assert sched.get_num_new_matched_tokens(hashes, [0], 0) == 4 * BS
    assert store.checks - checks == 2          # the two runs it saw are not asked again
    for key in sched._known:                   # seen longer ago than KNOWN_TTL_S
        sched._known[key] -= persistent_lookup.KNOWN_TTL_S
    checks = store.checks
    assert sched.get_num_new_matched_tokens(hashes, [0], 0) == 4 * BS
    assert store.checks - checks == 4
    worker.close()


# ---------------------------------------------------------------------------- older entries
def _version_2_entry(group_key: bytes, block_hash: bytes, layout, payload: bytes) -> bytes:
    """An entry as format version 2 wrote it: one block, no num_blocks in its header."""
    fixed = struct.Struct("<4sHHIQQ16s16sd16s16s16s").pack(
        b"DIKV", 2, 120, layout.num_layers, layout.page_bytes, len(payload), layout.dtype.encode(), b"chat", 0.0,
        group_key, block_hash, entry_format.checksum(payload))
    return fixed + struct.pack("<I", zlib.crc32(fixed)) + payload


def test_an_entry_of_the_previous_format_is_refused_and_never_loaded(tmp_path):
    """Under a run's name: an entry of format 2 (one block) is seen by its size at the look-up
    and dropped; one padded to the size a run of format 3 has is read, refused by its version,
    counted, and its load fails (the request looks up again and recomputes from there)."""
    groups = [full(0, (0, 1))]
    hashes = chain(32)
    src = caches(2)
    store = DirStore(str(tmp_path), RETENTION)
    sched, worker = connector(store, groups, run_blocks=16)
    worker.register_kv_caches(src, groups, BS)
    save_as_steps(sched, worker, hashes, groups, steps=(32,))
    gk, layout = sched._layouts[0]
    old = _version_2_entry(gk, hashes[31], layout, bytes(layout.payload_bytes))
    store.put([((gk, hashes[31]), old, "chat")])                       # its own size
    worker.close()

    dst = zeros_like(src)
    sched, worker = connector(DirStore(str(tmp_path), RETENTION), groups)
    worker.register_kv_caches(dst, groups, BS)
    assert sched.get_num_new_matched_tokens(hashes, [0], 0) == 16 * BS
    assert sched.stats().corrupt_entries == 1 and not DirStore(str(tmp_path), RETENTION).exists(
        [(gk, hashes[31])], [len(old)])[0]

    padded = old + bytes(layout.entry_bytes(16) - len(old))              # a run's size, an old header
    DirStore(str(tmp_path), RETENTION).put([((gk, hashes[31]), padded, "chat")])
    sched._known.clear()
    assert sched.get_num_new_matched_tokens(hashes, [0], 0) == 32 * BS
    sched.allocate_loads("reader", hashes, {0: DST[:32]})
    assert settle(sched, worker).failed == ["reader"]
    assert worker.stats().bad_entries["version"] == 1
    assert not any(t.any() for t in block_bytes(dst, 2, DST[16:32]))    # never reached the device
    assert sched.get_num_new_matched_tokens(hashes, [0], 0) == 16 * BS   # dropped: the first run still loads
    worker.close()


# ------------------------------------------------------------------------------ overlapped reads
class _GatedDirStore(DirStore):
    """A real directory store whose reads of one entry wait for a gate, and which records how
    many reads ran at once."""

    def __init__(self, *args, held: bytes, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.held, self.gate = held, threading.Event()
        self.running = self.most = 0
        self._gauge = threading.Lock()

    def get_into(self, keys, heads, payloads):
        with self._gauge:
            self.running += 1
            self.most = max(self.most, self.running)
        try:
            time.sleep(0.05)
            if any(key[1] == self.held for key in keys):
                self.gate.wait(30)
            return super().get_into(keys, heads, payloads)
        finally:
            with self._gauge:
                self.running -= 1


def test_runs_are_read_in_parallel_and_copied_in_as_they_land(tmp_path):
    """Four runs of 4 blocks over two I/O threads: the first run is copied to the device while
    the last one's read is still held; the load is reported once every run is in."""
    groups = [full(0, (0, 1))]
    hashes = chain(16)
    src = caches(2)
    sched, worker = connector(DirStore(str(tmp_path), RETENTION), groups, run_blocks=4)
    worker.register_kv_caches(src, groups, BS)
    save_as_steps(sched, worker, hashes, groups, steps=(16,))
    worker.close()

    dst = zeros_like(src)
    store = _GatedDirStore(str(tmp_path), RETENTION, held=hashes[15])
    sched, worker = connector(store, groups, run_blocks=4, io_threads=2)
    worker.register_kv_caches(dst, groups, BS)
    assert sched.get_num_new_matched_tokens(hashes, [0], 0) == 16 * BS
    (load,) = sched.allocate_loads("reader", hashes, {0: DST[:16]})
    worker.start_transfers(sched.build_connector_meta())
    deadline = time.monotonic() + 10
    while not same(src, IDS[:4], dst, DST[:4]):     # the step polls: landed runs are copied in
        assert time.monotonic() < deadline, "the first run was not copied while a later one was read"
        assert worker.finished_transfers() == []
        time.sleep(0.01)
    assert not any(t.any() for t in block_bytes(dst, 2, DST[12:16]))   # the held run is not in
    store.gate.set()
    done = settle(sched, worker)
    assert done.loaded == ["reader"] and same(src, IDS[:16], dst, DST[:16])
    assert store.most == 2                          # two runs read at once
    assert worker.staging.free_slots == worker.staging.num_slots
    worker.close()
