"""KV cache events: what the engine holds, published over ZMQ for routers and cache indexers
(`kv_events_endpoint`, off by default), in vLLM's event shape so that tools built for vLLM's
kv_events read them unchanged.

Wire format (vLLM's vllm/distributed/kv_events.py, the array-like msgpack layout its subscribers
decode): each ZMQ message is three frames, (topic, sequence number as 8 bytes big-endian,
payload), the payload a msgpack KVEventBatch [ts, events, data_parallel_rank], each event a
tagged array ["BlockStored", ...] of the fields below, in their order. Fields vLLM added later
sit at the end, so older decoders, which ignore trailing fields, read them too.

    BlockStored      block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
                     lora_name, extra_keys, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window
    BlockRemoved     block_hashes, medium, group_idx
    AllBlocksCleared

Block hashes are ints: the first 8 bytes (big-endian) of the engine's 16-byte chained block hash
(types/block_hashes.py), as vLLM sends 64-bit ints by default. Media: "GPU" for the engine's
own device pool (vLLM's name for it, on any accelerator), "DISK" and "REDIS" for a kv_store.

Where they come from:
  device   a block published to the prefix cache (BlockStored, with its tokens and parent: the
           scheduler's publish step), a cached block evicted or expired (BlockRemoved, the block
           pool), the prefix cache reset (AllBlocksCleared)
  store    entries this instance wrote (BlockStored, without tokens or parent: the writer thread
           knows only hashes), and those it removed: expired by its gc, dropped for capacity or
           as corrupt (BlockRemoved). Entries other instances write, and Redis's own expiry and
           evictions, are not seen here.

Events gather in a KVEventSink (thread-safe: the store's writer thread adds to it too) and go out
as one batch per engine step, or within IDLE_FLUSH_S when the engine is idle. The publisher thread
owns the sockets. Like vLLM's: an endpoint with `*` (or ipc://, inproc://) is bound, any other is
connected to; with `kv_events_replay_endpoint` a ROUTER socket answers a request (from a DEALER or
REQ socket: an empty frame, then the first wanted sequence number, 8 bytes big-endian) with the
buffered batches from it on, each (seq, payload), then (-1, b""). A full queue drops batches
(counted, warned once), never blocks a step. With data parallelism each engine core publishes on
endpoints of its own, offset by its rank as vLLM does (`rank_endpoint`), and stamps its batches
with that rank.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    from deepinfer.config import CacheConfig
    from deepinfer.kv_cache.manager import KVCacheManager
    from deepinfer.types.lora import LoRARequest
    from deepinfer.types.request import Request

logger = logging.getLogger(__name__)

MEDIUM_DEVICE = "GPU"
IDLE_FLUSH_S = 0.05
REPLAY_BUFFER = 10_000
MAX_QUEUED = 100_000
HWM = 100_000
END_SEQ = (-1).to_bytes(8, "big", signed=True)


# ------------------------------------------------------------------------------ the structs
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """The base of the three events (tagged by class name)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def external_hash(block_hash: bytes) -> int:
    """The int a block's hash is published as (vLLM's 64-bit int block hashes)."""
    return int.from_bytes(block_hash[:8], "big")


# -------------------------------------------------------------------------------- the sink
class KVEventSink:
    """Collects events from the engine's threads; flush() hands them to the publisher as one batch."""

    def __init__(self, publisher: ZmqEventPublisher, block_size: int, data_parallel_rank: int = 0) -> None:
        self.publisher = publisher
        self.block_size = block_size
        self.data_parallel_rank = data_parallel_rank
        self._pending: list[KVCacheEvent] = []
        self._lock = threading.Lock()
        publisher.on_idle = self.flush

    def add(self, event: KVCacheEvent) -> None:
        with self._lock:
            self._pending.append(event)

    def stored(self, hashes: Sequence[bytes], medium: str, group_idx: int, *, parent: bytes | None = None,
               token_ids: Sequence[int] = (), kind: str | None = None, sliding_window: int | None = None,
               lora: LoRARequest | None = None) -> None:
        """`lora`: the adapter the blocks were computed under (vLLM's lora_id and lora_name), or None."""
        if hashes:
            self.add(BlockStored([external_hash(h) for h in hashes],
                                 None if parent is None else external_hash(parent), list(token_ids),
                                 self.block_size, lora.lora_int_id if lora is not None else None, medium,
                                 lora.lora_name if lora is not None else None, None, group_idx, kind, sliding_window))

    def removed(self, hashes: Sequence[bytes], medium: str, group_idx: int | None) -> None:
        if not hashes:
            return
        with self._lock:
            last = self._pending[-1] if self._pending else None
            if isinstance(last, BlockRemoved) and (last.medium, last.group_idx) == (medium, group_idx):
                last.block_hashes.extend(external_hash(h) for h in hashes)   # one event per run of drops
            else:
                self._pending.append(BlockRemoved([external_hash(h) for h in hashes], medium, group_idx))

    def cleared(self) -> None:
        self.add(AllBlocksCleared())

    # What the block pool calls (kv_cache/block_pool.py BlockPool.events).
    def device_removed(self, group_id: int, block_hash: bytes) -> None:
        self.removed([block_hash], MEDIUM_DEVICE, group_id)

    def device_cleared(self) -> None:
        self.cleared()

    def device_published(self, request: Request, published: range, kv: KVCacheManager) -> None:
        """Blocks of `request` the scheduler just published to the prefix cache, per group, with
        their tokens and parent; a block another request had published first is not announced
        again (the pool kept that one)."""
        if not published:
            return
        from deepinfer.kv_cache.specs import sliding_window_of
        from deepinfer.types.block_tables import NULL_BLOCK_ID

        hashes = request.block_hashes
        for group, ids in zip(kv.groups, request.block_ids):
            pool, window = kv.pool_of(group), sliding_window_of(group.spec)
            run: list[int] = []   # consecutive blocks announced in one event
            for i in published:
                if ids[i] != NULL_BLOCK_ID and pool.lookup(group.group_id, hashes[i]) == ids[i]:
                    run.append(i)
                elif run:
                    self._device_run(request, group, run, window)
                    run = []
            if run:
                self._device_run(request, group, run, window)

    def _device_run(self, request: Request, group, run: list[int], window: int | None) -> None:
        bs, hashes = self.block_size, request.block_hashes
        first, last = run[0], run[-1]
        self.stored([hashes[i] for i in run], MEDIUM_DEVICE, group.group_id,
                    parent=hashes[first - 1] if first else None,
                    token_ids=request.all_token_ids[first * bs:(last + 1) * bs], kind=group.spec.kind,
                    sliding_window=window, lora=request.lora)

    def flush(self) -> None:
        """Publish what was gathered, as one batch (in order, also when two threads flush)."""
        with self._lock:
            if not self._pending:
                return
            events, self._pending = self._pending, []
            self.publisher.publish(KVEventBatch(time.time(), events, self.data_parallel_rank))

    def close(self) -> None:
        self.flush()
        self.publisher.shutdown()


# --------------------------------------------------------------------------- the publisher
def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    """PUB (and optional replay ROUTER) sockets, driven by one thread from a bounded queue."""

    SHUTDOWN_TIMEOUT_S = 1.0

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                 buffer_batches: int = REPLAY_BUFFER, max_queued: int = MAX_QUEUED) -> None:
        import zmq

        self._zmq = zmq
        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint
        self._topic = topic.encode()
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(max_queued)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._seq = 0
        self.dropped = 0
        self.on_idle = None   # called by the thread when nothing was queued for IDLE_FLUSH_S
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(HWM)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay = None
        field = "kv_events_endpoint"
        try:
            if _binds(endpoint):
                self._pub.bind(endpoint)
            else:
                self._pub.connect(endpoint)
            if replay_endpoint is not None:
                field = "kv_events_replay_endpoint"
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            address = endpoint if field == "kv_events_endpoint" else replay_endpoint
            raise ValueError(f"{field}: cannot open {address}: {exc}") from None
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kv-events-publisher", daemon=True)
        self._thread.start()

    def publish(self, batch: KVEventBatch) -> None:
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1:
                logger.warning("KV events: the publish queue is full (%d batches); dropping batches",
                               self._queue.maxsize)

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        while True:
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._serve_replay()
                except Exception:   # a bad request never stops publishing
                    logger.exception("KV events: replay request failed")
            try:
                batch = self._queue.get(timeout=IDLE_FLUSH_S)
            except queue.Empty:
                if not self._running:
                    break
                if self.on_idle is not None:
                    self.on_idle()
                continue
            if batch is None:
                break
            try:
                payload = encoder.encode(batch)
                seq = self._seq.to_bytes(8, "big")
                self._pub.send_multipart((self._topic, seq, payload))
                self._buffer.append((self._seq, payload))
                self._seq += 1
            except Exception:
                logger.exception("KV events: publishing a batch failed")
        self._close_sockets()

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("KV events: a replay request is (identity, empty, 8-byte sequence); got %d frames",
                           len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None and not sock.closed:
                sock.close(linger=0)

    def shutdown(self) -> None:
        """Publish what is queued (within SHUTDOWN_TIMEOUT_S), then close the sockets."""
        if not self._running:
            return
        self._running = False
        try:
            self._queue.put(None, timeout=self.SHUTDOWN_TIMEOUT_S)
        except queue.Full:
            pass
        self._thread.join(self.SHUTDOWN_TIMEOUT_S)


def rank_endpoint(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """The endpoint data-parallel engine core `data_parallel_rank` uses: vLLM's convention, so its
    subscribers find each rank where they look. Rank 0 uses the endpoint as given; rank r adds r
    to a tcp:// port, and appends `_dp{r}` to an ipc:// or inproc:// address. N cores cannot all
    bind one address; each batch also carries its rank (EventBatch.data_parallel_rank)."""
    if endpoint is None or data_parallel_rank == 0:
        return endpoint
    if endpoint.startswith(("ipc://", "inproc://")):
        return f"{endpoint}_dp{data_parallel_rank}"
    base, _, port = endpoint.rpartition(":")
    if not endpoint.startswith("tcp://") or not port.isdigit():
        raise ValueError(f"kv_events_endpoint {endpoint!r}: with data parallelism a tcp:// endpoint needs a port "
                         "(each rank adds its rank to it)")
    if int(port) + data_parallel_rank > 65535:
        raise ValueError(f"kv_events_endpoint {endpoint!r}: port {port} + data-parallel rank {data_parallel_rank} "
                         "is past 65535")
    return f"{base}:{int(port) + data_parallel_rank}"


def open_kv_events(cache: CacheConfig, block_size: int, data_parallel_rank: int = 0) -> KVEventSink | None:
    """The sink kv_events_endpoint asks for (None: off), on this data-parallel rank's endpoints."""
    if not cache.kv_events_endpoint:
        return None
    endpoint = rank_endpoint(cache.kv_events_endpoint, data_parallel_rank)
    replay = rank_endpoint(cache.kv_events_replay_endpoint, data_parallel_rank)
    publisher = ZmqEventPublisher(endpoint, replay, cache.kv_events_topic)
    logger.info("KV events: publishing on %s%s", endpoint, f" (replay on {replay})" if replay else "")
    return KVEventSink(publisher, block_size, data_parallel_rank)
