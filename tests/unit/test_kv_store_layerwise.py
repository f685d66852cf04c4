"""Layer-wise loads from the persistent KV store (kv_store_layerwise_load, kv_cache/store/layerwise.py):
a load is handed to the step once every entry of it is read and checked, and the forward that
computes the rest of the prompt waits, before each attention layer, for that layer's copies.
Greedy tokens equal the plain path's (prefix copied in whole first) and a cold run's, through a
real dir:// store; the per-layer waits are what put the prefix there (a forward without them
reads blocks not filled yet); a bad entry in the middle of the prefix fails the load before any
step computes over it, and the request recomputes identically."""

from __future__ import annotations

import os

import pytest
import torch

from deepinfer import LLM
from deepinfer.kv_cache.store.layerwise import LayerwiseCopies
from deepinfer.kv_cache.store.persistent_worker import StoreTierWorker
from tests.unit.test_kv_store_engine import (
    GREEDY,
    LONG_BS,
    LONG_FOLLOW_UP,
    compute_long,
    long_expected,  # noqa: F401  (a fixture)
    make_long,
    run_path,
    worker_of,
)


def _generate(model: str, store: str, layerwise: bool) -> tuple[list[int], LLM]:
    llm = make_long(model, store, kv_store_load_policy="always", kv_store_layerwise_load=layerwise)
    out = llm.generate([LONG_FOLLOW_UP], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 37 * LONG_BS
    return out.outputs[0].token_ids, llm


def test_layerwise_and_plain_loads_give_the_same_tokens(tiny_llama, tmp_path, long_expected):  # noqa: F811
    store = f"dir://{tmp_path}"
    compute_long(tiny_llama, store)
    plain, a = _generate(tiny_llama, store, False)
    a.engine.shutdown()
    layerwise, b = _generate(tiny_llama, store, True)
    assert plain == layerwise == long_expected
    worker = worker_of(b)
    # The copies were made by the forward's per-layer waits (every layer of the tiny model), not
    # by a fence before it; and nothing is left pending or held.
    assert worker._layerwise.layers_waited == b.engine.executor.runner.hf_config["num_hidden_layers"]
    assert not worker.has_layer_loads
    tier = b.engine.stats().kv_tier
    assert tier["loaded_blocks"] == 37 and tier["failed_loads"] == 0
    assert b.engine.kv_manager.blocks_in_use() == {}
    b.engine.shutdown()


def test_a_forward_without_the_layer_waits_reads_a_prefix_not_there_yet(tiny_llama, tmp_path, long_expected,  # noqa: F811
                                                                          monkeypatch):
    """The test above is sensitive to the waits: skipped, the copies land only after the forward."""
    store = f"dir://{tmp_path}"
    compute_long(tiny_llama, store)
    monkeypatch.setattr(StoreTierWorker, "wait_for_layer_load", lambda self, layer_id: None)
    tokens, llm = _generate(tiny_llama, store, True)
    assert tokens != long_expected
    llm.engine.shutdown()


def test_a_bad_entry_mid_load_fails_it_before_any_step_computes_over_it(tiny_llama, tmp_path,
                                                                         long_expected):  # noqa: F811
    store = f"dir://{tmp_path}"
    compute_long(tiny_llama, store)
    b = make_long(tiny_llama, store, kv_store_load_policy="always", kv_store_layerwise_load=True)
    victim = run_path(b, str(tmp_path), LONG_FOLLOW_UP, 31)   # the second of three runs, [16, 32)
    data = bytearray(open(victim, "rb").read())
    data[len(data) // 2] ^= 0x01
    open(victim, "wb").write(bytes(data))
    out = b.generate([LONG_FOLLOW_UP], GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == long_expected
    assert out.num_cached_tokens == 16 * LONG_BS   # the first run loaded (looked up again), the rest computed
    tier, stats = b.engine.stats().kv_tier, worker_of(b).stats()
    assert tier["failed_loads"] > 0 and stats.bad_entries["corrupt"] == 1
    assert worker_of(b).flush(10)
    assert os.path.exists(victim)   # dropped, then saved again by the recomputation
    assert b.engine.kv_manager.blocks_in_use() == {}
    b.engine.shutdown()


def _copies(num_layers: int = 3, num_blocks: int = 4, words: int = 2):
    """LayerwiseCopies over a [slots, layers, tensors, words] staging array and one group's pages."""
    staging = torch.arange(8 * num_layers * 2 * words, dtype=torch.int32).view(8, num_layers, 2, words)
    pages = [(torch.zeros(num_blocks, words, dtype=torch.int32), torch.zeros(num_blocks, words, dtype=torch.int32))
             for _ in range(num_layers)]
    freed: list[int] = []
    copies = LayerwiseCopies(torch.device("cpu"), None, lambda group_id, device_side: staging, freed.extend)
    copies.register({0: pages}, {0: [10 + j for j in range(num_layers)]})
    return copies, staging, pages, freed


def test_cpu_layer_waits_copy_each_layer_in_turn_and_free_the_slots_last():
    copies, staging, pages, freed = _copies()
    copies.add(0, [2, 0], [5, 6])
    copies.wait_layer(11)
    assert torch.equal(pages[1][0][2], staging[5, 1, 0]) and torch.equal(pages[1][1][0], staging[6, 1, 1])
    assert not pages[0][0].any() and not pages[2][0].any()   # the other layers are not in yet
    copies.wait_layer(99)   # a layer of no persisted group: nothing to do
    copies.wait_layer(10)
    assert freed == [] and copies
    copies.wait_layer(12)
    assert freed == [5, 6] and not copies
    assert torch.equal(pages[0][0][0], staging[6, 0, 0]) and torch.equal(pages[2][1][2], staging[5, 2, 1])


def test_cpu_pending_loads_into_one_block_end_with_the_later_one():
    copies, staging, pages, freed = _copies()
    copies.add(0, [1], [3])
    copies.add(0, [1], [4])   # the block was freed and loaded again before a forward ran
    copies.wait_layer(10)
    copies.wait_all()
    for j in range(3):
        assert torch.equal(pages[j][0][1], staging[4, j, 0])
    assert sorted(freed) == [3, 4] and not copies


@pytest.mark.gpu
def test_layerwise_loads_give_the_plain_tokens_on_cuda(tiny_llama, tmp_path):
    """On CUDA the copies run on the tier's side stream, an event per layer that the compute
    stream waits on before that layer: greedy tokens equal the plain path's and a cold run's."""
    cold = make_long(tiny_llama, None)
    expected = cold.generate([LONG_FOLLOW_UP], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    cold.engine.shutdown()
    store = f"dir://{tmp_path}"
    compute_long(tiny_llama, store)
    got = {}
    for layerwise in (False, True):
        got[layerwise], llm = _generate(tiny_llama, store, layerwise)
        if layerwise:
            assert worker_of(llm)._layerwise.layers_waited > 0
        llm.engine.shutdown()
    assert got[False] == got[True] == expected
