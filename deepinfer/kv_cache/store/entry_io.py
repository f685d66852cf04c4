"""The store tier's data path: entries read into and written from staging slots (staging.py),
either on threads of the engine's process (ThreadIO) or in a process of their own (ProcessIO).

Why a process: on a GPU the engine's step is host-bound Python, and the I/O threads need the
interpreter between every checksum and system call. Measured on the GPU (Llama-3-8B shape, a
store that never hits, every block written through): with eight I/O threads in the engine's
process the offline throughput fell to under half of the store off, and a fresh server took
several times as long to load a 32k-token prefix as it takes to compute it
(docs/benchmarks/design-measurements.md#kv-store-io-in-its-own-process). In a process of its own
the I/O shares nothing with the step but the staging buffer, a memfd both map
(platforms/host_memory.SharedHostBuffer), and short messages over a socket pair: (op, keys, slots)
out, counts back. A CPU engine's step runs in torch's kernels, which release the interpreter, so
there the threads stay in process.

Both run the same EntryOps over their own backend instance (a store's URL, retention and
capacity rebuild it in the child). An entry is a run of blocks (runs.py), read with one readv
straight into its blocks' staging slots and written with one writev from them. A write spreads
its runs one per task over a thread pool; a load's reader hands each run over as a call of its
own (submit), several in flight, and gets each back as it lands, to copy it to the device while
the others are read. Checksums (xxhash) and file I/O release the interpreter, so the runs are
read and checked in parallel. An op's result carries what the worker counts (written, skipped,
missing, bad, errors) and the keys the backend removed on the way (capacity, corrupt entries,
gc) for KV events.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

import numpy as np

from deepinfer import envs
from deepinfer.kv_cache.connector import TierKey
from deepinfer.kv_cache.store import entry as entry_format
from deepinfer.kv_cache.store.backend import PRESENT, StoreBackend, StoreCounts, StoreUnavailable
from deepinfer.kv_cache.store.entry import EntryError, EntryLayout
from deepinfer.kv_cache.store.locations import open_store

logger = logging.getLogger(__name__)

CHILD_START_TIMEOUT_S = 60.0


@dataclass
class OpResult:
    """What one read or write did (merged over its tasks). Entries are runs of blocks: the
    counts that feed the tier's block counters are in blocks, the faults in entries."""

    error: str | None = None            # reads: the load fails (first reason); writes: unused
    unavailable: str | None = None      # the store could not be reached (the caller's health)
    written: list[TierKey] = field(default_factory=list)   # entries
    written_blocks: int = 0
    skipped: int = 0                    # blocks present already (touched instead)
    dropped: int = 0                    # blocks not written: the store was unavailable
    missing: int = 0                    # entries
    bad: dict[str, int] = field(default_factory=dict)   # entry_format.REASONS -> entries
    read_errors: int = 0
    write_errors: int = 0
    removed: list[TierKey] = field(default_factory=list)

    def merge(self, other: OpResult) -> OpResult:
        self.error = self.error or other.error
        self.unavailable = self.unavailable or other.unavailable
        self.written += other.written
        self.removed += other.removed
        for name in ("written_blocks", "skipped", "dropped", "missing", "read_errors", "write_errors"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for reason, n in other.bad.items():
            self.bad[reason] = self.bad.get(reason, 0) + n
        return self


class EntryOps:
    """Reads and writes of entries between a backend and staging slots (`host`: a numpy uint8
    [slots, slot bytes] view of the staging buffer). An entry is a run of blocks: keys[i] goes
    with slots[i], the slots of its blocks in order."""

    def __init__(self, backend: StoreBackend, host: np.ndarray, threads: int) -> None:
        self.backend = backend
        self.host = host
        self._removed: list[TierKey] = []
        self._removed_lock = threading.Lock()
        backend.on_removed = self._collect_removed
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kv-store-io")

    def _collect_removed(self, keys: list[TierKey]) -> None:
        with self._removed_lock:
            self._removed.extend(keys)

    def _take_removed(self) -> list[TierKey]:
        with self._removed_lock:
            removed, self._removed = self._removed, []
        return removed

    def _payloads(self, slots: list[int], nbytes: int) -> list[memoryview]:
        """A run's payload: each block's bytes in its slot, in order."""
        return [memoryview(self.host[slot, :nbytes]) for slot in slots]

    def _map(self, fn, n: int) -> OpResult:
        """fn over each entry (a run: enough bytes for a task of its own), over the I/O threads;
        a single entry runs on the calling thread (a load's reader hands runs over one by one,
        each call on a thread of its own already)."""
        if n == 1:
            out = fn(range(1))
        else:
            out = OpResult()
            for result in self._pool.map(fn, [range(j, j + 1) for j in range(n)]):
                out.merge(result)
        out.removed += self._take_removed()
        return out

    # ---------------------------------------------------------------------------------- read
    def read(self, keys: list[TierKey], slots: list[list[int]], layout: EntryLayout, traffic_class: str) -> OpResult:
        """Entries -> their slots (keys[i] -> slots[i]), checked; then touched (a use)."""
        out = self._map(lambda part: self._read_part(keys, slots, part, layout), len(keys))
        if out.error is None:
            try:
                self.backend.touch(keys, traffic_class)
            except StoreUnavailable as exc:
                out.unavailable = str(exc)
        return out

    def _read_part(self, keys, slots, part: range, layout: EntryLayout) -> OpResult:
        """Entries straight into their slots (backend.get_into: one readv a run), then checked
        there: a bad entry's bytes stay in slots of a load that fails, and never reach a forward."""
        out = OpResult()
        heads = [bytearray(entry_format.HEADER_SIZE) for _ in part]
        payloads = [self._payloads(slots[i], layout.payload_bytes) for i in part]
        try:
            sizes = self.backend.get_into([keys[i] for i in part], heads, payloads)
        except StoreUnavailable as exc:
            out.read_errors, out.error, out.unavailable = 1, str(exc), str(exc)
            return out
        bad = []
        for i, head, payload, size in zip(part, heads, payloads, sizes):
            if size is None:
                out.missing += 1
                out.error = out.error or "entry gone"
                continue
            try:
                entry_format.check(memoryview(head)[:size], payload, size, keys[i][0], keys[i][1], layout,
                                   len(slots[i]))
            except EntryError as exc:
                out.bad[exc.reason] = out.bad.get(exc.reason, 0) + 1
                logger.warning("KV store %s: dropping a bad entry (%s)", self.backend.url, exc)
                bad.append(keys[i])
                out.error = out.error or str(exc)
        if bad:
            try:
                self.backend.delete(bad)
            except StoreUnavailable:
                pass
        return out

    # --------------------------------------------------------------------------------- write
    def write(self, keys: list[TierKey], slots: list[list[int]], layout: EntryLayout, traffic_class: str) -> OpResult:
        """Slots -> entries, skipping (touching) those the store has."""
        return self._map(lambda part: self._write_part(keys, slots, part, layout, traffic_class), len(keys))

    def _write_part(self, keys, slots, part: range, layout: EntryLayout, traffic_class: str) -> OpResult:
        out = OpResult()
        mine = [keys[i] for i in part]
        try:
            states = self.backend.exists(mine, [layout.entry_bytes(len(slots[i])) for i in part])
            present = [key for key, state in zip(mine, states) if state == PRESENT]
            if present:   # the store has them: this save is a use, under this request's class
                self.backend.touch(present, traffic_class)
            now = self.backend.clock()
            items = []
            for i, state in zip(part, states):
                if state == PRESENT:
                    out.skipped += len(slots[i])
                    continue
                payload = self._payloads(slots[i], layout.payload_bytes)
                head = entry_format.header(keys[i][0], keys[i][1], layout, payload, traffic_class, now)
                items.append((keys[i], [head, *payload], traffic_class))
                out.written_blocks += len(slots[i])
            self.backend.put(items)
        except StoreUnavailable as exc:
            out.write_errors, out.unavailable = 1, str(exc)
            out.dropped, out.skipped, out.written_blocks = sum(len(slots[i]) for i in part), 0, 0
            return out
        out.written = [key for key, _, _ in items]
        return out

    # ------------------------------------------------------------------------------- upkeep
    def gc(self) -> tuple[int, list[TierKey]]:
        expired = self.backend.gc()
        return expired, self._take_removed()

    def counts(self) -> StoreCounts:
        return self.backend.counts()

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        self.backend.close()


class ThreadIO:
    """EntryOps on threads of this process (the CPU engine's choice)."""

    def __init__(self, backend: StoreBackend, host: np.ndarray, threads: int) -> None:
        self.ops = EntryOps(backend, host, threads)
        # submit()'s calls: a load's runs are handed over one call each, `threads` at a time.
        self._calls = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kv-store-call")

    def call(self, op: str, *args):
        """Run an op (read, write, gc, counts) and return its result; blocks the calling thread."""
        return getattr(self.ops, op)(*args)

    def submit(self, op: str, *args) -> Future:
        """Start an op; its result (or StoreUnavailable) comes in the future."""
        return self._calls.submit(self.call, op, *args)

    def close(self) -> None:
        self._calls.shutdown(wait=False)   # a read stuck on a dead mount must not hang shutdown
        self.ops.close()


class ProcessIO:
    """EntryOps in a child process (`python -m deepinfer.kv_cache.store.entry_io`), over the
    staging buffer both map and a socket pair. Calls from several threads run concurrently there;
    each blocks its caller until its reply. If the child dies, every call raises StoreUnavailable
    (the loads fail and recompute, the saves are dropped: counted, as for a store that is down)."""

    def __init__(self, store_args: tuple, staging_fd: int, staging_shape: tuple[int, int], threads: int) -> None:
        parent, child = socket.socketpair()
        self._conn = Connection(parent.detach())
        child_fd = child.detach()
        env = envs.child_env(python_path=sys.path)   # this process's deepinfer
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "deepinfer.kv_cache.store.entry_io", str(child_fd), str(staging_fd)],
            pass_fds=(child_fd, staging_fd), env=env, stdin=subprocess.DEVNULL)
        os.close(child_fd)
        self._send_lock = threading.Lock()
        self._futures: dict[int, Future] = {}
        self._next = 0
        self._lock = threading.Lock()
        self._dead: str | None = None
        self._send(("start", store_args, staging_shape, threads))
        if not self._conn.poll(CHILD_START_TIMEOUT_S):
            self.close()
            raise RuntimeError(f"the KV store's I/O process did not start within {CHILD_START_TIMEOUT_S:.0f} s")
        status, detail = pickle.loads(self._conn.recv_bytes())
        if status != "ready":
            self.close()
            raise RuntimeError(f"the KV store's I/O process failed to start: {detail}")
        self._receiver = threading.Thread(target=self._receive, name="kv-store-io-replies", daemon=True)
        self._receiver.start()

    def _send(self, message) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            self._conn.send_bytes(data)

    def call(self, op: str, *args):
        return self.submit(op, *args).result()

    def submit(self, op: str, *args) -> Future:
        """Send an op; its result (or StoreUnavailable) comes in the future, set by the receiver
        thread. Calls in flight run concurrently in the child."""
        future: Future = Future()
        with self._lock:
            if self._dead is not None:
                future.set_exception(StoreUnavailable(self._dead))
                return future
            call_id, self._next = self._next, self._next + 1
            self._futures[call_id] = future
        try:
            self._send(("call", call_id, op, args))
        except OSError as exc:
            self._fail(f"the KV store's I/O process is gone ({exc})")
        return future

    def _receive(self) -> None:
        while True:
            try:
                call_id, ok, value = pickle.loads(self._conn.recv_bytes())
            except Exception as exc:   # noqa: BLE001  (EOF, a reset: the child is gone; never hang a caller)
                self._fail(f"the KV store's I/O process is gone ({type(exc).__name__})")
                return
            with self._lock:
                future = self._futures.pop(call_id, None)
            if future is None:
                continue
            if ok:
                future.set_result(value)
            else:
                future.set_exception(StoreUnavailable(value))

    def _fail(self, why: str) -> None:
        with self._lock:
            self._dead = self._dead or why
            futures, self._futures = list(self._futures.values()), {}
        for future in futures:
            if not future.done():
                future.set_exception(StoreUnavailable(why))

    def close(self, timeout_s: float = 5.0) -> None:
        try:
            self._send(("stop",))
        except OSError:
            pass
        try:
            self._proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._conn.close()


# ------------------------------------------------------------------------------------ child
def _serve_child(conn_fd: int, staging_fd: int) -> None:
    from deepinfer.platforms.host_memory import map_shared

    conn = Connection(conn_fd)
    _, store_args, (slot_bytes, num_slots), threads = pickle.loads(conn.recv_bytes())
    try:
        url, retention, size_bytes = store_args
        backend = open_store(url, retention, size_bytes=size_bytes)
        host = map_shared(staging_fd, slot_bytes * num_slots).view(num_slots, slot_bytes).numpy()
        ops = EntryOps(backend, host, threads)
    except Exception as exc:   # noqa: BLE001  (reported to the engine, which raises it)
        conn.send_bytes(pickle.dumps(("failed", f"{type(exc).__name__}: {exc}")))
        return
    conn.send_bytes(pickle.dumps(("ready", None)))
    send_lock = threading.Lock()
    # Reads and writes arrive from two threads of the engine and must not wait for each other; a
    # load's runs arrive as one call each, `threads` of them in flight (each reads on the thread
    # that runs its call), so there is room for those and for the writer's.
    calls = ThreadPoolExecutor(max_workers=threads + 4, thread_name_prefix="kv-store-call")

    def run(call_id: int, op: str, args) -> None:
        try:
            reply = (call_id, True, getattr(ops, op)(*args))
        except Exception as exc:   # noqa: BLE001  (the engine counts it as the store failing)
            reply = (call_id, False, f"{type(exc).__name__}: {exc}")
        data = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
        with send_lock:
            conn.send_bytes(data)

    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):   # the engine is gone
            break
        if message[0] == "stop":
            break
        _, call_id, op, args = message
        calls.submit(run, call_id, op, args)
    calls.shutdown(wait=True)
    ops.close()


if __name__ == "__main__":
    # Ctrl-C (or a supervisor's SIGINT / SIGTERM to the process group) reaches this process as
    # well as the engine's; the engine then flushes its pending writes through this process and
    # sends "stop", so it must outlive the signal. If the engine dies instead, the socket's EOF
    # ends this loop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=envs.child_log_level(),
                        format="%(asctime)s kv-store-io %(levelname)s %(name)s: %(message)s")
    # Through the module's own name, not __main__: the results pickle as entry_io's classes.
    from deepinfer.kv_cache.store import entry_io

    entry_io._serve_child(int(sys.argv[1]), int(sys.argv[2]))
