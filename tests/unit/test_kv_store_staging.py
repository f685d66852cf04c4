"""The persistent KV store's staging buffer (kv_cache/store/staging.py) through both sides of the
connector: a full buffer writes a save's leading blocks, a request loads at most the loads' half,
and a load that finds no room fails without damaging the buffer."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kv_cache.store.dir import DirStore
from deepinfer.kv_cache.store.persistent import StoreTierScheduler
from deepinfer.kv_cache.store.persistent_worker import StoreTierWorker
from tests.unit.test_kv_host_tier import BS, block_bytes, chain, full, random_caches
from tests.unit.test_kv_store import RETENTION, connector, load_all, save_all


def _slots_bytes(groups, n: int) -> int:
    """A staging buffer of exactly n slots for these groups."""
    from deepinfer.kv_cache.store.persistent import group_layouts
    from deepinfer.kv_cache.store.staging import staging_shape

    slot, _ = staging_shape([layout.payload_bytes for _, layout in group_layouts(groups, BS).values()], 1)
    return n * slot


@pytest.mark.parametrize("device,io_process", [("cpu", False), ("cpu", True),
                                               pytest.param("cuda", True, marks=pytest.mark.gpu)])
def test_a_full_staging_buffer_writes_a_saves_leading_blocks(tmp_path, device, io_process):
    """Six slots, three of them for saves, a save of five blocks: the first three are written (a
    prefix hit needs those first), the other two dropped and counted; a reader finds the three,
    bit-identical."""
    groups = [full(0, (0, 1))]
    hashes = chain(5)
    src = random_caches(2, torch.bfloat16, device)
    sched, worker = connector(DirStore(str(tmp_path), RETENTION), groups, device,
                              buffer_bytes=_slots_bytes(groups, 6), io_process=io_process)
    save_all(sched, worker, src, groups, hashes, [3, 7, 1, 12, 5])
    stats = worker.stats()
    assert (stats.written_blocks, stats.dropped_saves) == (3, 2)
    worker.close()
    dst = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in src]
    sched, worker = connector(DirStore(str(tmp_path), RETENTION), groups, device, io_process=io_process)
    worker.register_kv_caches(dst, groups, BS)
    n, done = load_all(sched, worker, groups, hashes, [0, 2, 4, 6, 8])
    assert n == 3 and done.loaded == ["reader"]
    for a, b in zip(block_bytes(src, 2, [3, 7, 1]), block_bytes(dst, 2, [0, 2, 4])):
        assert torch.equal(a, b)
    assert worker.staging.free_slots == worker.staging.num_slots   # every slot back
    worker.close()


def test_a_request_loads_at_most_half_the_staging_buffer(tmp_path):
    groups = [full(0, (0, 1))]
    hashes = chain(5)
    save_all(*connector(DirStore(str(tmp_path), RETENTION), groups), random_caches(2, torch.bfloat16),
             groups, hashes, [3, 7, 1, 12, 5])
    sched = StoreTierScheduler(groups, BS, DirStore(str(tmp_path), RETENTION), buffer_bytes=_slots_bytes(groups, 4))
    assert sched.max_load_blocks == 2
    assert sched.get_num_new_matched_tokens(hashes, [0], 0) == 2 * BS
    # Past the device's hit the cap counts from there.
    assert sched.get_num_new_matched_tokens(hashes, [0], 2 * BS) == 2 * BS


def test_a_load_that_finds_no_room_in_the_staging_buffer_fails_and_frees_nothing_twice(tmp_path):
    """The scheduler side allows 4 blocks, the loads' half of the worker's buffer holds 3: the
    load fails (the request recomputes), and the buffer is whole again for the next."""
    groups = [full(0, (0, 1))]
    hashes = chain(4)
    src = random_caches(2, torch.bfloat16)
    save_all(*connector(DirStore(str(tmp_path), RETENTION), groups), src, groups, hashes, [3, 7, 1, 12])
    store = DirStore(str(tmp_path), RETENTION)
    sched = StoreTierScheduler(groups, BS, store, backoff_s=0.2)
    worker = StoreTierWorker(store, "cpu", backoff_s=0.2, buffer_bytes=_slots_bytes(groups, 6))
    worker.register_kv_caches([(torch.zeros_like(k), torch.zeros_like(v)) for k, v in src], groups, BS)
    n, done = load_all(sched, worker, groups, hashes, [0, 2, 4, 6])
    assert n == 4 and done.failed == ["reader"] and worker.stats().failed_loads == 1
    assert worker.staging.free_slots == 6
    worker.close()
