"""What a persistent KV store backend does (dir.py, redis.py), and how a store that is down is
handled: every backend call may raise StoreUnavailable; StoreHealth turns that into "warn once,
count, treat as a miss, retry after a short back-off" so that a store that is down or full never
stops serving.

Retention: each entry belongs to a traffic class (kv_retention, e.g. "chat=7d,agent=3d"); it
expires that long after its last use (a hit touches it). Times come from an injectable clock
(unix seconds), so tests can move through days.
"""

from __future__ import annotations

import abc
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from deepinfer.kv_cache.connector import TierKey

logger = logging.getLogger(__name__)

Clock = Callable[[], float]

# exists() states
ABSENT, PRESENT, WRONG_SIZE = 0, 1, -1

# What put() takes for an entry: its bytes, or the buffers that make them up in order.
Entry = bytes | Sequence[bytes | bytearray | memoryview]


def entry_parts(entry: Entry) -> list[bytes | bytearray | memoryview]:
    return [entry] if isinstance(entry, (bytes, bytearray, memoryview)) else list(entry)


class StoreUnavailable(RuntimeError):
    """The store cannot be reached or refused the operation (down, full, permissions)."""


@dataclass
class StoreReport:
    """What a store holds (`deepinfer kv stats`): a full walk of its entries."""

    url: str
    entries: int = 0
    bytes: int = 0
    classes: dict[str, int] = field(default_factory=dict)   # entries per traffic class
    oldest: float | None = None      # unix seconds; what `basis` says
    newest: float | None = None
    basis: str = "use"               # oldest/newest and classes are of each entry's last use (or write)
    next_expiry: float | None = None     # the soonest an entry expires (unix seconds)


@dataclass
class StoreCounts:
    """A cheap view of a store for /metrics (no walk): estimates, refreshed now and then."""

    entries: int = 0
    bytes: int = 0
    evicted: int = 0       # dropped for capacity (cumulative)
    expired: int = 0       # dropped by retention (cumulative)


class StoreBackend(abc.ABC):
    """Entries are bytes (kv_cache/store/entry.py: a run of blocks each) under a TierKey.
    Thread-safe: the worker's reader and writer threads share one instance; the scheduler side
    has its own."""

    url: str
    medium: str = "STORE"   # the `medium` of its KV events (kv_cache/events.py)

    def __init__(self, retention: Mapping[str, float], clock: Clock = time.time) -> None:
        self.retention = dict(retention)
        self.clock = clock
        # Told of the entries this instance removes (expired, evicted, corrupt): KV events.
        self.on_removed: Callable[[list[TierKey]], None] | None = None
        # Existence checks made (a stat, a STRLEN) and the calls that made them (a Redis pipeline
        # is one round trip): what a look-up costs the store, for tests and benchmarks.
        self.checks = 0
        self.check_calls = 0
        self._count_lock = threading.Lock()

    def _counted(self, checks: int) -> None:
        with self._count_lock:
            self.checks += checks
            self.check_calls += 1

    def _notify_removed(self, keys: list[TierKey | None]) -> None:
        keys = [k for k in keys if k is not None]
        if keys and self.on_removed is not None:
            self.on_removed(keys)

    def retention_of(self, traffic_class: str) -> float:
        """Seconds an entry of this class lives after its last use (an unknown class, e.g. one
        removed from kv_retention since it was written, gets the longest configured)."""
        return self.retention.get(traffic_class, max(self.retention.values()))

    @abc.abstractmethod
    def exists(self, keys: Sequence[TierKey], sizes: Sequence[int]) -> list[int]:
        """Per key: PRESENT, ABSENT, or WRONG_SIZE (an entry whose byte size is not `sizes[i]`:
        truncated, foreign or of another format; the caller drops it). Stopping early is
        allowed: keys after the first non-PRESENT one may be reported ABSENT."""

    @abc.abstractmethod
    def first_present(self, keys: Sequence[TierKey], sizes: Sequence[int]) -> list[int]:
        """exists() for candidates of which the caller wants the first that is PRESENT (a run's
        shorter entries, longest first): states as exists(); stopping after the first PRESENT
        one is allowed (keys after it may be reported ABSENT)."""

    @abc.abstractmethod
    def get(self, keys: Sequence[TierKey]) -> list[bytes | None]:
        """The entries' bytes (None: absent)."""

    def get_into(self, keys: Sequence[TierKey], heads: Sequence[bytearray],
                 payloads: Sequence[Sequence[memoryview]]) -> list[int | None]:
        """Read entries in place: entry i's first bytes into heads[i] (HEADER_SIZE long), the
        bytes after them into the buffers payloads[i] in order (staging slots, one per block of
        the run: the payload the reader expects), as much of each as the entry has. Returns each
        entry's whole size in bytes (None: absent), so that the caller sees a short or an
        overlong entry. This default reads whole entries (get) and copies them; a backend that
        can read into memory directly overrides it."""
        sizes: list[int | None] = []
        for data, head, parts in zip(self.get(keys), heads, payloads):
            if data is None:
                sizes.append(None)
                continue
            data = memoryview(data)
            n = min(len(data), len(head))
            head[:n] = data[:n]
            at = len(head)
            for part in parts:
                rest = data[at:at + len(part)]
                part[:len(rest)] = rest
                at += len(part)
            sizes.append(len(data))
        return sizes

    @abc.abstractmethod
    def put(self, items: Sequence[tuple[TierKey, Entry, str]]) -> None:
        """Write (key, entry, traffic class) atomically each; last use = now. An entry is its
        bytes, or the buffers that make them up in order (the header, then the slots' payloads:
        a backend that can write them without joining them does)."""

    @abc.abstractmethod
    def touch(self, keys: Sequence[TierKey], traffic_class: str) -> None:
        """Last use = now (a hit): retention counts from here, under `traffic_class`."""

    @abc.abstractmethod
    def delete(self, keys: Sequence[TierKey]) -> None:
        """Drop entries (corrupt ones); absent keys are ignored."""

    def gc(self) -> int:
        """Drop what expired; returns how many entries. Backends whose store expires entries
        itself (Redis) do nothing."""
        return 0

    # Whether gc() does anything (False: the store expires entries itself).
    collects_garbage = True

    @abc.abstractmethod
    def report(self) -> StoreReport:
        """Walk every entry: counts, bytes, per class, oldest and newest (an operator's
        command, O(entries); never on the serving path)."""

    @abc.abstractmethod
    def clear(self) -> int:
        """Delete every entry (and the index); returns how many entries."""

    @abc.abstractmethod
    def counts(self) -> StoreCounts:
        """Entries and bytes held, without a walk (estimates), and the drops so far."""

    def close(self) -> None:
        pass

    def reopen_args(self) -> tuple[str, dict[str, float], int | None] | None:
        """(url, retention, size bytes): what opens this store again in another process
        (open_store); None when it cannot be (an injected clock stays in this process)."""
        if self.clock is not time.time:
            return None
        return self.url, self.retention, getattr(self, "size_bytes", None)


class StoreHealth:
    """Whether to use the store now: after a failure it is skipped for `backoff_s`, then tried
    again; one warning per outage, and a log line when it is back."""

    def __init__(self, url: str, backoff_s: float = 1.0, clock: Clock = time.monotonic) -> None:
        self.url = url
        self.backoff_s = backoff_s
        self.clock = clock
        self.errors = 0
        self._down_until = 0.0
        self._down = False
        self._lock = threading.Lock()

    def usable(self) -> bool:
        return self.clock() >= self._down_until

    @property
    def down(self) -> bool:
        return self._down

    def failed(self, exc: BaseException, what: str) -> None:
        with self._lock:
            self.errors += 1
            self._down_until = self.clock() + self.backoff_s
            if not self._down:
                self._down = True
                logger.warning("KV store %s unavailable (%s: %s); requests recompute until it is back",
                               self.url, what, exc)

    def succeeded(self) -> None:
        if self._down:
            with self._lock:
                if self._down:
                    self._down = False
                    logger.warning("KV store %s is back", self.url)

    def call(self, what: str, fn: Callable[[], object], default: object) -> object:
        """fn(), or `default` when the store is skipped or fails (counted, warned once)."""
        if not self.usable():
            return default
        try:
            result = fn()
        except StoreUnavailable as exc:
            self.failed(exc, what)
            return default
        self.succeeded()
        return result
