"""`kv_store="redis://HOST:PORT/DB"`: KV entries as Redis strings, through redis-py.

Key: "deepinfer:kv:<group key hex>:<block hash hex>", value: the entry's bytes (entry.py: a run
of blocks, named by its last block's hash).
Retention is Redis's own expiry: a write is SET ... PXAT (last use + the class's retention, from
the injectable clock), and a hit sets PEXPIREAT again (the touch), so nothing here scans for
what expired. Capacity is Redis's business (maxmemory with an LRU policy); kv_store_size applies
to the dir backend only. Look-ups are one pipelined STRLEN per entry asked about, one round trip
per call (0: absent), which also catches a truncated value without reading it.

Every call has short socket timeouts: a Redis that is down costs the scheduler a refused
connection, then StoreHealth (backend.py) skips it for a back-off.

Operators: gc() has nothing to do (Redis expires keys itself); report() SCANs the keys of this
prefix, reading each one's length, time to live and the header's class and write time (GETRANGE,
never the payload), so its classes and oldest/newest are those of the writes; clear() SCANs and
UNLINKs them. counts(), for /metrics, is O(1): DBSIZE and the server's memory, evicted and
expired keys (INFO), so give the store a Redis database (or server) of its own.
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
    Entry,
    StoreBackend,
    StoreCounts,
    StoreReport,
    StoreUnavailable,
    entry_parts,
)
from deepinfer.kv_cache.store.entry import CLASS_CREATED_END, CLASS_CREATED_START, class_and_created

SCAN_BATCH = 1000
PREFIX = "deepinfer:kv:"
_ERRORS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, redis.exceptions.ResponseError,
           redis.exceptions.BusyLoadingError, OSError)


class RedisStore(StoreBackend):
    collects_garbage = False
    medium = "REDIS"
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
        return self._lengths(keys, sizes)

    def first_present(self, keys: Sequence[TierKey], sizes: Sequence[int]) -> list[int]:
        # All candidates in one round trip: a few STRLENs more cost the server less than a
        # round trip each.
        return self._lengths(keys, sizes)

    def _lengths(self, keys: Sequence[TierKey], sizes: Sequence[int]) -> list[int]:
        """One pipelined STRLEN per key, one round trip: its state from its length (0: absent)."""
        def run():
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.strlen(self.name(key))
            return pipe.execute()
        if not keys:
            return []
        lengths = self._run(run)
        self._counted(len(keys))
        return [ABSENT if length == 0 else PRESENT if length == size else WRONG_SIZE
                for length, size in zip(lengths, sizes)]

    def get(self, keys: Sequence[TierKey]) -> list[bytes | None]:
        if not keys:
            return []
        return self._run(lambda: self.client.mget([self.name(k) for k in keys]))

    def put(self, items: Sequence[tuple[TierKey, Entry, str]]) -> None:
        def run():
            pipe = self.client.pipeline(transaction=False)
            for key, data, traffic_class in items:
                parts = entry_parts(data)
                value = parts[0] if len(parts) == 1 else b"".join(parts)   # a SET takes one value
                pipe.set(self.name(key), value, pxat=self._expire_at_ms(traffic_class))
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
            self._notify_removed(list(keys))

    # ---------------------------------------------------------------------------- operators
    def _scan(self):
        """This store's keys, in batches of up to SCAN_BATCH."""
        batch = []
        for key in self.client.scan_iter(match=PREFIX + "*", count=SCAN_BATCH):
            batch.append(key)
            if len(batch) == SCAN_BATCH:
                yield batch
                batch = []
        if batch:
            yield batch

    def report(self) -> StoreReport:
        def run():
            report = StoreReport(self.url, basis="write")
            now = self.clock()
            for keys in self._scan():
                pipe = self.client.pipeline(transaction=False)
                for key in keys:
                    pipe.strlen(key)
                    pipe.pttl(key)
                    pipe.getrange(key, CLASS_CREATED_START, CLASS_CREATED_END - 1)
                replies = pipe.execute()
                for length, ttl_ms, head in zip(replies[0::3], replies[1::3], replies[2::3]):
                    if length == 0:   # expired or deleted since the scan saw it
                        continue
                    report.entries += 1
                    report.bytes += length
                    found = class_and_created(head)
                    traffic_class = found[0] if found else "(unreadable)"
                    report.classes[traffic_class] = report.classes.get(traffic_class, 0) + 1
                    if found:
                        created = found[1]
                        report.oldest = created if report.oldest is None else min(report.oldest, created)
                        report.newest = created if report.newest is None else max(report.newest, created)
                    if ttl_ms >= 0:
                        expiry = now + ttl_ms / 1000
                        report.next_expiry = expiry if report.next_expiry is None else min(report.next_expiry, expiry)
            return report
        return self._run(run)

    def clear(self) -> int:
        def run():
            removed = 0
            for keys in self._scan():
                removed += self.client.unlink(*keys)
            return removed
        return self._run(run)

    def counts(self) -> StoreCounts:
        def run():
            memory, stats = self.client.info("memory"), self.client.info("stats")
            return StoreCounts(self.client.dbsize(), memory.get("used_memory", 0), stats.get("evicted_keys", 0),
                               stats.get("expired_keys", 0))
        return self._run(run)

    def close(self) -> None:
        self.client.close()
