"""Which KV blocks each replica holds, learned from its KV events, and a prompt's block hashes.

Every replica started with `--kv-events-endpoint` publishes vLLM-shaped event batches
(kv_cache/events.py): BlockStored / BlockRemoved / AllBlocksCleared, each block named by the first
8 bytes of the engine's chained 16-byte hash. The router subscribes (ZMQ SUB, one socket per
replica) and keeps, per replica, the set of hashes on its device ("GPU" medium), plus one set of
hashes in the shared store (any other medium: "DISK", "REDIS"), which every replica can load.

To match a prompt, the router computes the same chain the engine computes
(types/block_hashes.py): root = hash_root(model name, revision, block_size, kv dtype, tp rank 0),
block i = H(block i-1, its token ids, extra_key(model id, cache_salt)). The facts come from the
replica: model id from /v1/models 'root', block size and KV dtype from cache_config_info on
/metrics. Because the chain is prefix-closed, a replica's match is the longest run of leading
hashes it holds.

The index is approximate by design: batches lost to a slow subscriber, or a replica restarted
between events, leave stale entries that cost at most one mis-routed (still correct) request; a
replica that dies is forgotten at once, and one that restarts publishes anew.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import msgspec

from deepinfer.kv_cache.events import MEDIUM_DEVICE, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from deepinfer.types.block_hashes import extend_block_hashes, extra_key, hash_root

logger = logging.getLogger(__name__)


def prompt_block_hashes(token_ids: Sequence[int], *, model_name: str, model_id: str, block_size: int,
                        kv_cache_dtype: str, cache_salt: str | None = None) -> list[int]:
    """The engine's published (64-bit) hashes of the prompt's full blocks."""
    chain: list[bytes] = []
    root = hash_root(model_name, None, block_size, kv_cache_dtype, tp_rank=0)
    extend_block_hashes(chain, list(token_ids), block_size, extra_key(model_id, cache_salt), root)
    return [int.from_bytes(h[:8], "big") for h in chain]


class KVIndex:
    """Per replica: device block hash -> the layer groups holding it; shared: store hashes."""

    def __init__(self, num_replicas: int) -> None:
        self.device: list[dict[int, set[int]]] = [{} for _ in range(num_replicas)]
        self.store: set[int] = set()
        self.events_seen = [0] * num_replicas

    def apply(self, replica: int, batch: KVEventBatch) -> None:
        held = self.device[replica]
        for ev in batch.events:
            self.events_seen[replica] += 1
            if isinstance(ev, BlockStored):
                if ev.medium in (None, MEDIUM_DEVICE):
                    group = ev.group_idx or 0
                    for h in ev.block_hashes:
                        held.setdefault(h, set()).add(group)
                else:
                    self.store.update(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                if ev.medium in (None, MEDIUM_DEVICE):
                    for h in ev.block_hashes:
                        groups = held.get(h)
                        if groups is None:
                            continue
                        # A removal without a group (older publishers) drops the block outright.
                        groups.discard(ev.group_idx or 0) if ev.group_idx is not None else groups.clear()
                        if not groups:
                            del held[h]
                else:
                    self.store.difference_update(ev.block_hashes)
            elif isinstance(ev, AllBlocksCleared):
                held.clear()

    def forget(self, replica: int) -> None:
        """The replica died: its device cache died with it."""
        self.device[replica].clear()

    def device_match(self, replica: int, hashes: Sequence[int]) -> int:
        held = self.device[replica]
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n

    def store_match(self, hashes: Sequence[int]) -> int:
        n = 0
        for h in hashes:
            if h not in self.store:
                break
            n += 1
        return n


class KVEventSubscriber:
    """One asyncio task per replica endpoint, feeding the index. ZMQ reconnects by itself when a
    replica restarts on the same endpoint."""

    def __init__(self, index: KVIndex, endpoints: Sequence[str | None], topic: str = "") -> None:
        self.index = index
        self.endpoints = list(endpoints)
        self.topic = topic.encode()
        self._tasks: list[asyncio.Task] = []
        self._ctx = None
        self._decoder = msgspec.msgpack.Decoder(KVEventBatch)

    def start(self) -> None:
        import zmq.asyncio

        self._ctx = zmq.asyncio.Context()
        for i, endpoint in enumerate(self.endpoints):
            if endpoint:
                self._tasks.append(asyncio.create_task(self._run(i, endpoint), name=f"kv-events-{i}"))

    async def _run(self, replica: int, endpoint: str) -> None:
        import zmq

        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, self.topic)
        sock.connect(endpoint)
        try:
            while True:
                frames = await sock.recv_multipart()
                if len(frames) != 3:
                    continue
                try:
                    batch = self._decoder.decode(frames[2])
                except msgspec.DecodeError:
                    logger.warning("KV events from %s: an undecodable batch, skipped", endpoint)
                    continue
                self.index.apply(replica, batch)
        except asyncio.CancelledError:
            pass
        finally:
            sock.close(linger=0)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._ctx is not None:
            self._ctx.term()
