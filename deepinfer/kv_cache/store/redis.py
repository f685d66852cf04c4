"""`kv_store="redis://HOST:PORT/DB"`: KV entries as Redis strings, through redis-py.

Key: "deepinfer:kv:<group key hex>:<block hash hex>", value: the entry's bytes (entry.py).
Retention is Redis's own expiry: a write is SET ... PXAT (last use + the class's retention, from
the injectable clock), and a hit sets PEXPIREAT again (the touch), so nothing here scans for
what expired. Capacity is Redis's business (maxmemory with an LRU policy); kv_store_size applies
to the dir backend only. Look-ups are one pipelined STRLEN per batch (0: absent), which also
catches a truncated value without reading it.

Every call has short socket timeouts: a Redis that is down costs the scheduler a refused
connection, then StoreHealth (backend.py) skips it for a back-off.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import redis

from deepinfer.kv_cache.connector import TierKey
from deepinfer.kv_cache.store.backend import (
    ABSENT,
    PRESENT,
    WRONG_SIZE,
    Clock,
    StoreBackend,
    StoreUnavailable,
)

PREFIX = "deepinfer:kv:"
_ERRORS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, redis.exceptions.ResponseError,
           redis.exceptions.BusyLoadingError, OSError)


class RedisStore(StoreBackend):
    def __init__(self, url: str, retention: Mapping[str, float], *, clock: Clock = time.time,
                 socket_timeout_s: float = 2.0, connect_timeout_s: float = 0.5) -> None:
        super().__init__(retention, clock)
        self.url = url
        try:
            self.client = redis.Redis.from_url(url, socket_timeout=socket_timeout_s,
                                               socket_connect_timeout=connect_timeout_s)
        except ValueError as exc:
            raise ValueError(f"kv_store {url!r}: {exc}") from exc

    @staticmethod
    def name(key: TierKey) -> str:
        return f"{PREFIX}{key[0].hex()}:{key[1].hex()}"

    def _expire_at_ms(self, traffic_class: str) -> int:
        return int((self.clock() + self.retention_of(traffic_class)) * 1000)

    def _run(self, fn):
        try:
            return fn()
        except _ERRORS as exc:   # down, restarting, out of memory (OOM is a ResponseError)
            raise StoreUnavailable(f"{type(exc).__name__}: {exc}") from exc

    def exists(self, keys: Sequence[TierKey], sizes: Sequence[int]) -> list[int]:
        def run():
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.strlen(self.name(key))
            return pipe.execute()
        lengths = self._run(run) if keys else []
        out = []
        for length, size in zip(lengths, sizes):
            out.append(ABSENT if length == 0 else PRESENT if length == size else WRONG_SIZE)
        return out

    def get(self, keys: Sequence[TierKey]) -> list[bytes | None]:
        if not keys:
            return []
        return self._run(lambda: self.client.mget([self.name(k) for k in keys]))

    def put(self, items: Sequence[tuple[TierKey, bytes, str]]) -> None:
        def run():
            pipe = self.client.pipeline(transaction=False)
            for key, data, traffic_class in items:
                pipe.set(self.name(key), data, pxat=self._expire_at_ms(traffic_class))
            pipe.execute()
        if items:
            self._run(run)

    def touch(self, keys: Sequence[TierKey], traffic_class: str) -> None:
        at = self._expire_at_ms(traffic_class)

        def run():
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.pexpireat(self.name(key), at)
            pipe.execute()
        if keys:
            self._run(run)

    def delete(self, keys: Sequence[TierKey]) -> None:
        if keys:
            self._run(lambda: self.client.delete(*[self.name(k) for k in keys]))

    def close(self) -> None:
        self.client.close()
