"""The persistent KV store's staging buffer (kv_cache/store/staging.py) through both sides of the
connector: a save or a load larger than its half of the buffer streams through it whole, run by
run (a save is finished only once its last block is off the device), a buffer smaller than two
runs is raised to that, and a save that is dropped (the store down) is counted, logged once and
exported on /metrics. Runs of two blocks here, so that a few slots hold several."""

from __future__ import annotations

import logging
import threading

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
def test_a_save_and_a_load_larger_than_the_buffer_stream_through_it_whole(tmp_path, device, io_process):
    """Six slots, three for saves and three for loads; a save of five blocks (runs of 2, 2, 1) is
    written whole, and a fresh reader with the same small buffer finds and loads all five,
    bit-identical, run by run. (Before streaming: the first three were written, the other two
    dropped; a request loaded at most three.)"""
    groups = [full(0, (0, 1))]
    hashes = chain(5)
    src = random_caches(2, torch.bfloat16, device)
    sched, worker = connector(DirStore(str(tmp_path), RETENTION), groups, device, run_blocks=2,
                              buffer_bytes=_slots_bytes(groups, 6), io_process=io_process)
    save_all(sched, worker, src, groups, hashes, [3, 7, 1, 12, 5])
    stats = worker.stats()
    assert (stats.written_blocks, stats.dropped_saves) == (5, 0)
    assert sched.stats().saved_blocks == 5
    worker.close()
    dst = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in src]
    sched, worker = connector(DirStore(str(tmp_path), RETENTION), groups, device, run_blocks=2,
                              buffer_bytes=_slots_bytes(groups, 6), io_process=io_process)
    worker.register_kv_caches(dst, groups, BS)
    n, done = load_all(sched, worker, groups, hashes, [0, 2, 4, 6, 8])
    assert n == 5 and done.loaded == ["reader"]
    for a, b in zip(block_bytes(src, 2, [3, 7, 1, 12, 5]), block_bytes(dst, 2, [0, 2, 4, 6, 8])):
        assert torch.equal(a, b)
    assert worker.stats().loaded_blocks == 5
    assert worker.staging.free_slots == worker.staging.num_slots   # every slot back
    worker.close()


def test_a_save_is_finished_only_once_its_last_block_left_the_device(tmp_path):
    """A writer held back: a save of five blocks (runs of 2, 2, 1) through three save slots
    stages its first run (the second does not fit whole); it is not reported finished (its
    device blocks stay held) until the writer frees slots and the other runs are staged at a
    later poll."""
    groups = [full(0, (0,))]
    sched, worker = connector(DirStore(str(tmp_path), RETENTION), groups, run_blocks=2,
                              buffer_bytes=_slots_bytes(groups, 6))
    worker.register_kv_caches(random_caches(1, torch.bfloat16), groups, BS)
    gate = threading.Event()
    call = worker._io.call

    def slow(op, *args):
        if op == "write":
            gate.wait(30)
        return call(op, *args)

    worker._io.call = slow
    (save,) = sched.save_blocks("r", 0, chain(5), [1, 2, 3, 4, 5])
    worker.start_transfers(sched.build_connector_meta())
    worker.after_forward()
    assert worker.staging.free_slots == 4 and len(worker._backlog) == 1
    assert worker.finished_transfers() == []
    gate.set()
    assert worker.flush(10)
    assert worker.finished_transfers() == [save.transfer_id]
    assert worker.stats().written_blocks == 5
    worker.close()


def test_a_dropped_save_is_counted_logged_once_and_on_metrics(tmp_path, caplog):
    """The store down when saves are staged: their blocks are dropped, the saves finished (the
    device blocks free), one warning for all, and kv_tier_dropped_saves carries the count."""
    from deepinfer.kv_cache.tier_metrics import tier_metrics
    from deepinfer.metrics.engine_collector import engine_counters
    from deepinfer.types.plan import EngineStats

    groups = [full(0, (0,))]
    sched, worker = connector(DirStore(str(tmp_path), RETENTION), groups)
    worker.register_kv_caches(random_caches(1, torch.bfloat16), groups, BS)
    worker.health.usable = lambda: False
    ids = []
    with caplog.at_level(logging.WARNING, logger="deepinfer.kv_cache.store.persistent_worker"):
        for start in (0, 3):
            ids += [t.transfer_id for t in sched.save_blocks("r", 0, chain(6)[start:start + 3], [1, 2, 3])]
            worker.start_transfers(sched.build_connector_meta())
            worker.after_forward()
    assert sorted(worker.finished_transfers()) == ids
    assert worker.stats().dropped_saves == 6 and worker.stats().written_blocks == 0
    warnings = [r for r in caplog.records if "not saved" in r.getMessage()]
    assert len(warnings) == 1 and "kv_tier_dropped_saves_total" in warnings[0].getMessage()
    metrics = tier_metrics("store", sched.stats(), sched.load_latency, sched.save_latency, worker.stats())
    stats = EngineStats(0, 0, 0.0, 0, [0], [0], [0], prefix_cache_replayed=[0], prefix_cache_expirations=[0],
                        kv_group_kinds=["full"], kv_tier=vars(sched.stats()), kv_tier_metrics=metrics)
    assert engine_counters(stats)[("kv_tier_dropped_saves", (("tier", "store"),))] == 6
    worker.close()


def test_a_load_while_the_store_is_down_fails_and_frees_every_slot(tmp_path):
    groups = [full(0, (0, 1))]
    hashes = chain(4)
    src = random_caches(2, torch.bfloat16)
    save_all(*connector(DirStore(str(tmp_path), RETENTION), groups, run_blocks=2), src, groups, hashes, [3, 7, 1, 12])
    store = DirStore(str(tmp_path), RETENTION)
    sched = StoreTierScheduler(groups, BS, store, backoff_s=0.2, run_blocks=2)
    worker = StoreTierWorker(store, "cpu", backoff_s=0.2, buffer_bytes=_slots_bytes(groups, 4), run_blocks=2)
    worker.register_kv_caches([(torch.zeros_like(k), torch.zeros_like(v)) for k, v in src], groups, BS)
    n = sched.get_num_new_matched_tokens(hashes, [0], 0) // BS
    sched.allocate_loads("reader", hashes[:n], {0: [0, 2, 4, 6]})
    worker.health.usable = lambda: False
    worker.start_transfers(sched.build_connector_meta())
    worker.wait_all()
    done = sched.on_transfers_finished(worker.finished_transfers(), worker.failed_transfers())
    assert n == 4 and done.failed == ["reader"] and worker.stats().failed_loads == 1
    assert worker.staging.free_slots == 4
    worker.close()


def test_a_buffer_smaller_than_two_runs_is_raised_to_them(tmp_path, caplog):
    """Each half must hold a whole run (an entry is read and written through its blocks' slots
    at once): a buffer of one block is raised to two runs, with a warning."""
    groups = [full(0, (0,))]
    with caplog.at_level(logging.WARNING, logger="deepinfer.kv_cache.store.staging"):
        sched, worker = connector(DirStore(str(tmp_path), RETENTION), groups, run_blocks=3,
                                  buffer_bytes=_slots_bytes(groups, 1))
        worker.register_kv_caches(random_caches(1, torch.bfloat16), groups, BS)
    assert worker.staging.num_slots == 6 and worker.staging.quota == {"save": 3, "load": 3}
    assert "raised to 6" in caplog.text
    worker.close()
