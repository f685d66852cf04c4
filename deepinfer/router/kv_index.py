"""Which KV blocks each replica holds, learned from its KV events, and a prompt's block hashes.

Every replica started with `--kv-events-endpoint` publishes vLLM-shaped event batches
(kv_cache/events.py): BlockStored / BlockRemoved / AllBlocksCleared, each block named by the first
8 bytes of the engine's chained 16-byte hash. The router subscribes (ZMQ SUB, one socket per
replica) and keeps, per replica, the set of hashes on its device ("GPU" medium), plus one set of
hashes in the shared store (any other medium: "DISK", "REDIS"), which every replica can load.

To match a prompt, the router computes the same chain the engine computes
(types/block_hashes.py): root = hash_root(model name, revision, block_size, kv dtype, tp rank 0),
block i = H(block i-1, its token ids, extra_key(model id, cache_salt[, adapter key])). The facts
come from the replica: model id from /v1/models 'root', block size and KV dtype from
cache_config_info on /metrics. Because the chain is prefix-closed, a replica's match is the
longest run of leading hashes it holds.

A request whose `model` names a LoRA adapter (anything but the replica's served names, which
/v1/models lists with no `parent`) runs under that adapter, and the engine keys its blocks by the
adapter's name and id (LoRARequest.cache_key). The id is the replica's own (its registry numbers
adapters in the order they were added, so replicas may differ), and it is learned here from the
replica's BlockStored events, which carry lora_name and lora_id: the chain is built per replica
(PromptHashes), and a replica that never published a block of the adapter matches nothing, which
is exactly what it holds of it. So two requests with the same prompt and different adapters, or an
adapter's and the base model's, never look like one prefix to the router.

The index is approximate by design: batches lost to a slow subscriber, or a replica restarted
between events, leave stale entries that cost at most one mis-routed (still correct) request; a
replica that dies is forgotten at once, and one that restarts publishes anew.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec

from deepinfer.kv_cache.events import MEDIUM_DEVICE, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from deepinfer.types.block_hashes import extend_block_hashes, extra_key, hash_root
from deepinfer.types.lora import lora_cache_key

logger = logging.getLogger(__name__)


def prompt_block_hashes(token_ids: Sequence[int], *, model_name: str, model_id: str, block_size: int,
                        kv_cache_dtype: str, cache_salt: str | None = None,
                        lora: tuple[str, int] | None = None) -> list[int]:
    """The engine's published (64-bit) hashes of the prompt's full blocks; `lora`: the adapter's
    (lora_name, lora_int_id) the request runs under, None: the base model."""
    chain: list[bytes] = []
    root = hash_root(model_name, None, block_size, kv_cache_dtype, tp_rank=0)
    key = extra_key(model_id, cache_salt, lora_cache_key(*lora) if lora is not None else None)
    extend_block_hashes(chain, list(token_ids), block_size, key, root)
    return [int.from_bytes(h[:8], "big") for h in chain]


@dataclass
class PromptHashes:
    """A prompt's block hashes as each replica computes them: one chain for the base model; per
    replica for an adapter (its id is the replica's). A replica (or the store) without a chain
    holds none of the prompt's blocks."""

    blocks: int                                   # the prompt's full blocks
    shared: list[int] | None = None               # the chain every replica and the store use
    by_replica: dict[int, list[int]] = field(default_factory=dict)
    store: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, hashes: PromptHashes | Sequence[int] | None) -> PromptHashes | None:
        """A plain chain (one for every replica) as PromptHashes; None and empty stay None."""
        if hashes is None or isinstance(hashes, PromptHashes):
            return hashes if hashes is None or hashes.blocks else None
        return cls(len(hashes), list(hashes)) if len(hashes) else None

    def for_replica(self, replica: int) -> list[int]:
        return self.shared if self.shared is not None else self.by_replica.get(replica, [])

    def for_store(self) -> list[int]:
        return self.shared if self.shared is not None else self.store


class KVIndex:
    """Per replica: device block hash -> the layer groups holding it; shared: store hashes."""

    def __init__(self, num_replicas: int) -> None:
        self.device: list[dict[int, set[int]]] = [{} for _ in range(num_replicas)]
        self.store: set[int] = set()
        self.events_seen = [0] * num_replicas
        # Per replica: LoRA adapter name -> the lora_id its blocks were hashed with (the latest
        # seen: an adapter loaded again under its name gets a new id, and the old blocks are
        # nothing a new request can hit). `store_adapters`: every id any replica used for the
        # adapter, for the shared store, whose writers are the replicas (its events carry no
        # adapter: an entry may be under any writer's id, so each id's chain is tried).
        self.adapters: list[dict[str, int]] = [{} for _ in range(num_replicas)]
        self.store_adapters: dict[str, set[int]] = {}

    def apply(self, replica: int, batch: KVEventBatch) -> None:
        held = self.device[replica]
        for ev in batch.events:
            self.events_seen[replica] += 1
            if isinstance(ev, BlockStored):
                if ev.lora_name is not None and ev.lora_id is not None:
                    self.adapters[replica][ev.lora_name] = ev.lora_id
                    self.store_adapters.setdefault(ev.lora_name, set()).add(ev.lora_id)
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

    def prompt_hashes(self, token_ids: Sequence[int], replicas: Sequence[int], *, adapter: str | None,
                      **facts) -> PromptHashes:
        """The prompt's PromptHashes over `replicas` (indices). `adapter`: the LoRA adapter the
        request names (None: the base model); `facts`: prompt_block_hashes' keywords."""
        if adapter is None:
            chain = prompt_block_hashes(token_ids, **facts)
            return PromptHashes(len(chain), chain)
        by_id: dict[int, list[int]] = {}   # replicas that agree on the id share one chain

        def chain_of(lora_id: int | None) -> list[int]:
            if lora_id is None:
                return []
            if lora_id not in by_id:
                by_id[lora_id] = prompt_block_hashes(token_ids, lora=(adapter, lora_id), **facts)
            return by_id[lora_id]

        store_chains = [chain_of(lora_id) for lora_id in sorted(self.store_adapters.get(adapter, ()))]
        return PromptHashes(len(token_ids) // facts["block_size"], None,
                            {r: chain_of(self.adapters[r].get(adapter)) for r in replicas},
                            max(store_chains, key=self.store_match, default=[]))

    def forget(self, replica: int) -> None:
        """The replica died: its device cache died with it, and its adapters' ids (a restarted
        replica numbers them anew)."""
        self.device[replica].clear()
        self.adapters[replica].clear()

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
