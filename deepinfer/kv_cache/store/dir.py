"""`kv_store="dir://PATH"`: KV entries as files in a directory (local SSD, or a shared mount such
as NFS or 3FS for reuse across instances).

Layout under PATH:
    blocks/<h0h1>/<h2h3>/<block hash hex>.<group key hex>.kv    one entry (entry.py: a run of
                                                                blocks, named by its last
                                                                block's hash), sharded by the
                                                                hash's prefix
    blocks/.../<name>.tmp.<pid>.<thread>.<random>               a write in progress
    index/<bucket>.<class>                                      lines "<relative path>\\n": entries
                                                                last used in that time bucket

No lock anywhere. A write goes to a temp file of its own, then os.replace puts it under the
entry's name: readers see the old entry or the new one, never part of one, and two instances
writing the same block (the same bytes) both succeed. A temp file left by a crash is never read
(sweep() removes old ones).

Last use is the file's mtime (set from the injectable clock at write and on each hit). The
index is bucketed by last use (BUCKET_S): a write or a hit that moves an entry into a new bucket
appends its path to that bucket's file (O_APPEND, one short line). Expiry (gc) opens only buckets
whose end plus their class's retention has passed, so its cost follows what expires; an entry
touched since sits in a later bucket too, and its mtime tells the expired check to leave it to
that bucket, whose class (the class of that use) decides. (Two uses under different classes
within one bucket leave the first class listed, until a use in a later bucket.)
Bucket files are claimed by renaming (one instance wins), so two instances never process one.

Capacity (kv_store_size): this instance's estimate of the bytes under PATH (a scan at start,
rescanned every RESCAN_S to see other instances' writes, plus its own writes and deletes). Past
the limit, the oldest buckets are drained, least recent mtime first, down to LOW_WATER of it.
The same estimate (entries and bytes) is what /metrics shows (counts()); without a size limit it
is scanned once, at the first call.

Operators (`deepinfer kv stats | gc | clear`): report() walks every entry and the index (an
entry's class is the one listed in the bucket of its last use); clear() removes every entry and
index file, keeping the two directories and the writes in flight (running instances go on
writing into them).
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections.abc import Mapping, Sequence

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

logger = logging.getLogger(__name__)

BUCKET_S = 300.0
RESCAN_S = 300.0
LOW_WATER = 0.9
TEMP_MAX_AGE_S = 3600.0
# At most this many buffers per readv / writev call (the kernel's IOV_MAX).
_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024


class DirStore(StoreBackend):
    medium = "DISK"

    def __init__(self, path: str, retention: Mapping[str, float], *, size_bytes: int | None = None,
                 clock: Clock = time.time, bucket_s: float = BUCKET_S) -> None:
        super().__init__(retention, clock)
        if not path:
            raise ValueError("kv_store dir:// needs a path, e.g. dir:///mnt/kv")
        self.root = os.path.abspath(path)
        self.url = f"dir://{self.root}"
        self.blocks = os.path.join(self.root, "blocks")
        self.index = os.path.join(self.root, "index")
        self.size_bytes = size_bytes
        self.bucket_s = bucket_s
        self.expired = 0        # entries dropped by retention
        self.evicted = 0        # entries dropped for capacity
        self._lock = threading.Lock()
        self._usage: int | None = None
        self._entries = 0
        self._scanned_at = 0.0
        try:
            os.makedirs(self.blocks, exist_ok=True)
            os.makedirs(self.index, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"kv_store {self.url}: cannot create the store directory: {exc}") from exc

    # --------------------------------------------------------------------------------- names
    def relpath(self, key: TierKey) -> str:
        group, block_hash = key
        h = block_hash.hex()
        return os.path.join(h[:2], h[2:4], f"{h}.{group.hex()}.kv")

    def path(self, key: TierKey) -> str:
        return os.path.join(self.blocks, self.relpath(key))

    def _bucket(self, t: float) -> int:
        return int(t // self.bucket_s)

    # ------------------------------------------------------------------------------ entries
    def exists(self, keys: Sequence[TierKey], sizes: Sequence[int]) -> list[int]:
        out = [ABSENT] * len(keys)
        asked = 0
        try:
            for i, (key, size) in enumerate(zip(keys, sizes)):
                asked += 1
                state = self._state(key, size)
                out[i] = state
                if state != PRESENT:
                    break
        except OSError as exc:
            raise StoreUnavailable(str(exc)) from exc
        finally:
            self._counted(asked)
        return out

    def first_present(self, keys: Sequence[TierKey], sizes: Sequence[int]) -> list[int]:
        out = [ABSENT] * len(keys)
        asked = 0
        try:
            for i, (key, size) in enumerate(zip(keys, sizes)):
                asked += 1
                out[i] = self._state(key, size)
                if out[i] == PRESENT:
                    break
        except OSError as exc:
            raise StoreUnavailable(str(exc)) from exc
        finally:
            self._counted(asked)
        return out

    def _state(self, key: TierKey, size: int) -> int:
        """One stat: the whole existence check of an entry."""
        try:
            st = os.stat(self.path(key))
        except FileNotFoundError:
            return ABSENT
        return PRESENT if st.st_size == size else WRONG_SIZE

    def get(self, keys: Sequence[TierKey]) -> list[bytes | None]:
        out: list[bytes | None] = []
        try:
            for key in keys:
                try:
                    with open(self.path(key), "rb") as f:
                        out.append(f.read())
                except FileNotFoundError:
                    out.append(None)
        except OSError as exc:
            raise StoreUnavailable(str(exc)) from exc
        return out

    def get_into(self, keys: Sequence[TierKey], heads: Sequence[bytearray],
                 payloads: Sequence[Sequence[memoryview]]) -> list[int | None]:
        # One readv per entry, straight into the staging slots (the header into its own small
        # buffer, each block into its slot): reading whole files into new bytes objects and
        # copying them into the slots made a load several times slower than the plain reads of
        # the same files (docs/benchmarks/design-measurements.md#kv-store-reads-in-place).
        sizes: list[int | None] = []
        try:
            for key, head, parts in zip(keys, heads, payloads):
                try:
                    fd = os.open(self.path(key), os.O_RDONLY)
                except FileNotFoundError:
                    sizes.append(None)
                    continue
                try:
                    size = os.fstat(fd).st_size
                    _read_fully(fd, [memoryview(head), *(memoryview(p) for p in parts)], size)
                finally:
                    os.close(fd)
                sizes.append(size)
        except OSError as exc:
            raise StoreUnavailable(str(exc)) from exc
        return sizes

    def put(self, items: Sequence[tuple[TierKey, Entry, str]]) -> None:
        now = self.clock()
        written = added = 0
        try:
            for key, data, traffic_class in items:
                rel = self.relpath(key)
                final = os.path.join(self.blocks, rel)
                temp = f"{final}.tmp.{os.getpid()}.{threading.get_ident()}.{secrets.token_hex(4)}"
                try:
                    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                except FileNotFoundError:
                    os.makedirs(os.path.dirname(final), exist_ok=True)
                    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                try:
                    try:
                        # The header and the slots' payloads as they are: one writev, no joined copy.
                        size = _write_fully(fd, [memoryview(p).cast("B") for p in entry_parts(data)])
                    finally:
                        os.close(fd)
                    os.utime(temp, (now, now))
                    os.replace(temp, final)
                except BaseException:
                    _remove(temp)
                    raise
                self._index_append(self._bucket(now), traffic_class, [rel])
                written += size
                added += 1
        except OSError as exc:   # ENOSPC (full), EACCES, a mount gone: never fatal
            raise StoreUnavailable(str(exc)) from exc
        finally:
            with self._lock:
                if self._usage is not None:
                    self._usage += written
                    self._entries += added
        if self.size_bytes is not None:
            self._enforce_capacity()

    def touch(self, keys: Sequence[TierKey], traffic_class: str) -> None:
        now = self.clock()
        moved = []
        try:
            for key in keys:
                path = self.path(key)
                try:
                    old = os.stat(path).st_mtime
                    os.utime(path, (now, now))
                except FileNotFoundError:
                    continue
                if self._bucket(old) != self._bucket(now):
                    moved.append(self.relpath(key))
            if moved:
                self._index_append(self._bucket(now), traffic_class, moved)
        except OSError as exc:
            raise StoreUnavailable(str(exc)) from exc

    def delete(self, keys: Sequence[TierKey]) -> None:
        self._notify_removed([key for key in keys if self._remove_entry(self.path(key))])

    @staticmethod
    def key_of(rel: str) -> TierKey | None:
        """The key an entry's path names (relpath's inverse); None for a name not of that form."""
        try:
            block_hash, group, _ = os.path.basename(rel).split(".")
            return bytes.fromhex(group), bytes.fromhex(block_hash)
        except ValueError:
            return None

    def _remove_entry(self, path: str) -> bool:
        try:
            size = os.stat(path).st_size
            os.remove(path)
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise StoreUnavailable(str(exc)) from exc
        with self._lock:
            if self._usage is not None:
                self._usage -= size
                self._entries -= 1
        return True

    # -------------------------------------------------------------------------------- index
    def _index_append(self, bucket: int, traffic_class: str, rels: list[str]) -> None:
        line = "".join(r + "\n" for r in rels).encode()
        fd = os.open(os.path.join(self.index, f"{bucket}.{traffic_class}"), os.O_WRONLY | os.O_CREAT | os.O_APPEND,
                     0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)

    def _buckets(self) -> list[tuple[int, str, str]]:
        """(bucket, class, file name) of every unclaimed bucket file, oldest first."""
        out = []
        for name in os.listdir(self.index):
            bucket, _, traffic_class = name.partition(".")
            if bucket.lstrip("-").isdigit() and traffic_class and "." not in traffic_class:
                out.append((int(bucket), traffic_class, name))
        return sorted(out)

    def _claim(self, name: str) -> list[str] | None:
        """Take a bucket file for this instance alone: its lines, or None if another took it."""
        src = os.path.join(self.index, name)
        claimed = f"{src}.claimed.{os.getpid()}.{secrets.token_hex(4)}"
        try:
            os.rename(src, claimed)
        except FileNotFoundError:
            return None
        try:
            with open(claimed) as f:
                return list(dict.fromkeys(line.strip() for line in f if line.strip()))
        finally:
            _remove(claimed)

    def gc(self) -> int:
        """Drop entries whose class's retention has passed since their last use."""
        now = self.clock()
        dropped: list[TierKey] = []
        try:
            for bucket, traffic_class, name in self._buckets():
                retention = self.retention_of(traffic_class)
                if (bucket + 1) * self.bucket_s + retention > now:
                    continue   # something in it may still be live
                for rel in self._claim(name) or []:
                    path = os.path.join(self.blocks, rel)
                    try:
                        mtime = os.stat(path).st_mtime
                    except FileNotFoundError:
                        continue
                    # Used since (a later bucket lists it, maybe under another class): that
                    # bucket decides, under the class of that use.
                    if self._bucket(mtime) <= bucket and mtime + retention <= now and self._remove_entry(path):
                        dropped.append(self.key_of(rel))
        except OSError as exc:
            raise StoreUnavailable(str(exc)) from exc
        finally:
            self.expired += len(dropped)
            self._notify_removed(dropped)
        return len(dropped)

    # ----------------------------------------------------------------------------- capacity
    def usage(self) -> int:
        """This instance's estimate of the bytes held (scanning when stale)."""
        if self._usage is None or time.monotonic() - self._scanned_at > RESCAN_S:
            self._rescan()
        return self._usage

    def _rescan(self) -> None:
        entries, total = self._walk()
        with self._lock:
            self._usage, self._entries, self._scanned_at = total, entries, time.monotonic()

    def counts(self) -> StoreCounts:
        if self._usage is None:
            self._rescan()
        return StoreCounts(self._entries, self._usage, self.evicted, self.expired)

    def sweep(self) -> int:
        """Walk the store: the bytes of its entries; temp files older than TEMP_MAX_AGE_S (left
        by a crashed writer) are removed on the way."""
        return self._walk()[1]

    def _walk(self) -> tuple[int, int]:
        """(entries, bytes) of the store, removing stale temp files on the way."""
        total = entries = 0
        now = time.time()
        for dirpath, _, files in os.walk(self.blocks):
            for name in files:
                path = os.path.join(dirpath, name)
                try:
                    st = os.stat(path)
                except FileNotFoundError:
                    continue
                if ".tmp." in name:
                    if now - st.st_mtime > TEMP_MAX_AGE_S:
                        _remove(path)
                    continue
                total += st.st_size
                entries += 1
        return entries, total

    # ---------------------------------------------------------------------------- operators
    def _entry_files(self):
        """(relative path, stat) of every entry."""
        for dirpath, _, files in os.walk(self.blocks):
            for name in files:
                if name.endswith(".kv"):
                    path = os.path.join(dirpath, name)
                    try:
                        yield os.path.relpath(path, self.blocks), os.stat(path)
                    except FileNotFoundError:
                        continue

    def report(self) -> StoreReport:
        listed: dict[tuple[str, int], list[str]] = {}   # (entry, bucket) -> classes listing it there
        try:
            for bucket, traffic_class, name in self._buckets():
                try:
                    with open(os.path.join(self.index, name)) as f:
                        for line in f:
                            if line.strip():
                                listed.setdefault((line.strip(), bucket), []).append(traffic_class)
                except FileNotFoundError:   # claimed meanwhile by an instance's gc
                    continue
            report = StoreReport(self.url)
            for rel, st in self._entry_files():
                classes = listed.get((rel, self._bucket(st.st_mtime)))
                # Listed under two classes in one bucket: the shorter retention expires it first.
                traffic_class = min(classes, key=self.retention_of) if classes else "(unindexed)"
                report.entries += 1
                report.bytes += st.st_size
                report.classes[traffic_class] = report.classes.get(traffic_class, 0) + 1
                report.oldest = st.st_mtime if report.oldest is None else min(report.oldest, st.st_mtime)
                report.newest = st.st_mtime if report.newest is None else max(report.newest, st.st_mtime)
                if classes:
                    expiry = st.st_mtime + self.retention_of(traffic_class)
                    report.next_expiry = expiry if report.next_expiry is None else min(report.next_expiry, expiry)
        except OSError as exc:
            raise StoreUnavailable(str(exc)) from exc
        return report

    def clear(self) -> int:
        removed = 0
        try:
            for rel, _ in list(self._entry_files()):   # temp files are writes in flight: left to them
                _remove(os.path.join(self.blocks, rel))
                removed += 1
            for name in os.listdir(self.index):
                _remove(os.path.join(self.index, name))
        except OSError as exc:
            raise StoreUnavailable(str(exc)) from exc
        with self._lock:
            self._usage, self._entries = 0, 0
        return removed

    def _enforce_capacity(self) -> None:
        if self.usage() <= self.size_bytes:
            return
        target = int(self.size_bytes * LOW_WATER)
        evicted: list[TierKey] = []
        try:
            self._drain(target, evicted)
        finally:
            self._notify_removed(evicted)

    def _drain(self, target: int, evicted: list[TierKey]) -> None:
        """Drop least recently used entries until the estimate is at `target` bytes."""
        for bucket, traffic_class, name in self._buckets():
            rels = self._claim(name)
            if not rels:
                continue
            candidates = []
            for rel in rels:
                try:
                    mtime = os.stat(os.path.join(self.blocks, rel)).st_mtime
                except FileNotFoundError:
                    continue
                if self._bucket(mtime) <= bucket:   # not used since: this is its newest bucket
                    candidates.append((mtime, rel))
            candidates.sort()
            kept = []
            for i, (_, rel) in enumerate(candidates):
                if self._usage <= target:
                    kept = [r for _, r in candidates[i:]]
                    break
                if self._remove_entry(os.path.join(self.blocks, rel)):
                    self.evicted += 1
                    evicted.append(self.key_of(rel))
            if kept:
                self._index_append(bucket, traffic_class, kept)
            if self._usage <= target:
                return


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def _read_fully(fd: int, buffers: list[memoryview], size: int) -> None:
    """Fill `buffers` in order from the file's start, up to `size` bytes (a regular file's read
    returns less than asked only at its end, or when a signal cut it: then read on)."""
    want = min(size, sum(len(b) for b in buffers))
    done = 0
    while done < want:
        n = os.readv(fd, _past(buffers, done))
        if n == 0:   # shorter than fstat said: truncated while we read
            return
        done += n


def _write_fully(fd: int, buffers: list[memoryview]) -> int:
    """Write `buffers` in order (a regular file's write may return short when a signal cut it:
    then write on); returns the bytes written."""
    total = sum(len(b) for b in buffers)
    done = 0
    while done < total:
        done += os.writev(fd, _past(buffers, done))
    return total


def _past(buffers: list[memoryview], done: int) -> list[memoryview]:
    """The parts of `buffers` after their first `done` bytes, at most _IOV_MAX of them (one
    readv / writev call's worth)."""
    views = []
    for b in buffers:
        if done >= len(b):
            done -= len(b)
            continue
        views.append(b[done:])
        done = 0
        if len(views) == _IOV_MAX:
            break
    return views
