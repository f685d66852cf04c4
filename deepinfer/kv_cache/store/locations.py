"""A `kv_store` URL -> the store backend it names: dir://PATH (dir.py) or redis://HOST:PORT/DB
(redis.py). Its own module because both the connector factories (factory.py) and the store's
I/O process (entry_io.py, which re-opens the store it is handed by URL) need it, and the
factories import the worker side that imports entry_io."""

from __future__ import annotations

import time
from collections.abc import Mapping

from deepinfer.kv_cache.store.backend import Clock, StoreBackend


def open_store(url: str, retention: Mapping[str, float], *, size_bytes: int | None = None,
               clock: Clock = time.time) -> StoreBackend:
    """The backend a kv_store URL names: dir://PATH or redis://HOST:PORT/DB."""
    if url.startswith("dir://"):
        from deepinfer.kv_cache.store.dir import DirStore

        return DirStore(url.removeprefix("dir://"), retention, size_bytes=size_bytes, clock=clock)
    if url.startswith(("redis://", "rediss://", "unix://")):
        from deepinfer.kv_cache.store.redis import RedisStore

        return RedisStore(url, retention, clock=clock)
    raise ValueError(f"kv_store must be dir://PATH or redis://HOST:PORT/DB, got {url!r}")
