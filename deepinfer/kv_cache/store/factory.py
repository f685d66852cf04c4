"""The KV tiers the config asks for, each side built where it runs: the scheduler side in the
engine core (make_kv_connector_scheduler), the worker side in the model runner
(make_kv_connector_worker). The seam itself (the two roles' interfaces) is kv_cache/connector.py;
the tiers are host.py (host memory, `kv_offloading_size`) and persistent.py / persistent_worker.py
(a directory or Redis, `kv_store`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from deepinfer.config import CacheConfig, EngineConfig
    from deepinfer.kv_cache.connector import KVConnectorScheduler, KVConnectorWorker
    from deepinfer.kv_cache.specs import KVCacheGroup
    from deepinfer.kv_cache.store.backend import StoreBackend

GIB = 1 << 30


def offloading_bytes(config: EngineConfig | CacheConfig) -> int | None:
    """kv_offloading_size in bytes; None when no host tier is configured (unset or 0)."""
    cache = getattr(config, "cache", config)
    return int(cache.kv_offloading_size * GIB) if cache.kv_offloading_size else None


def open_kv_store(config: EngineConfig | CacheConfig, clock=None) -> StoreBackend | None:
    """The persistent store `kv_store` names (None: unset), with its retention and capacity."""
    cache = getattr(config, "cache", config)
    if not cache.kv_store:
        return None
    import time

    from deepinfer.config import parse_retention
    from deepinfer.kv_cache.store.locations import open_store

    size = int(cache.kv_store_size * GIB) if cache.kv_store_size else None
    return open_store(cache.kv_store, parse_retention(cache.kv_retention), size_bytes=size,
                      clock=clock or time.time)


def make_kv_connector_scheduler(config: EngineConfig | CacheConfig, groups: Sequence[KVCacheGroup],
                                block_size: int) -> KVConnectorScheduler | None:
    """The scheduler side the config asks for (None: no tier, or no kind a tier may hold).
    `kv_store` (a directory or Redis) and `kv_offloading_size` (host memory) are exclusive
    (CacheConfig refuses both)."""
    if not any(g.spec.persisted for g in groups):
        return None
    store = open_kv_store(config)
    if store is not None:
        from deepinfer.kv_cache.store.persistent import StoreTierScheduler

        return StoreTierScheduler(groups, block_size, store)
    size = offloading_bytes(config)
    if size is None:
        return None
    from deepinfer.kv_cache.store.host import HostTierScheduler

    return HostTierScheduler(groups, block_size, size)


def make_kv_connector_worker(config: EngineConfig | CacheConfig, groups: Sequence[KVCacheGroup],
                             block_size: int, device: torch.device) -> KVConnectorWorker | None:
    """The worker side the config asks for, not registered yet (None: as for the scheduler side)."""
    if not any(g.spec.persisted for g in groups):
        return None
    store = open_kv_store(config)
    if store is not None:
        from deepinfer.kv_cache.store.persistent_worker import StoreTierWorker

        cache = getattr(config, "cache", config)
        return StoreTierWorker(store, device, load_timeout_s=cache.kv_store_load_timeout_s,
                               buffer_bytes=int(cache.kv_store_buffer_size * 2**30),
                               durable_saves=cache.kv_role == "prefill", layerwise=cache.kv_store_layerwise_load)
    size = offloading_bytes(config)
    if size is None:
        return None
    from deepinfer.kv_cache.store.host import HostTierWorker

    return HostTierWorker(size, device)


def make_kv_connector(config: EngineConfig | CacheConfig, groups: Sequence[KVCacheGroup], block_size: int,
                      device: torch.device) -> tuple[KVConnectorScheduler, KVConnectorWorker] | None:
    """Both sides (one process), or None when no tier is configured (`kv_store` and
    `kv_offloading_size` unset) or no group's kind may be persisted. The worker side is not
    registered yet: register_kv_caches once the KV tensors exist. In the engine each side is
    built where it runs (the two functions above)."""
    scheduler = make_kv_connector_scheduler(config, groups, block_size)
    if scheduler is None:
        return None
    worker = make_kv_connector_worker(config, groups, block_size, device)
    assert worker is not None
    return scheduler, worker
