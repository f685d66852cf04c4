"""The four ways of choosing a replica, as pure functions over replica states.

Every policy returns the candidates in the order to try them: the choice first, then the others
by load (the retry order when a replica fails before its first byte). Only healthy replicas are
passed in; ties are broken by load, then by index, so choices are deterministic. The prompt's
hashes are a PromptHashes (kv_index.py: a LoRA adapter's chain differs per replica) or one plain
chain for all.

    round_robin   the next replica in turn.
    least_load    the smallest `Replica.load` = max(router in-flight, scraped running + waiting),
                  then the lower KV usage.
    cache_aware   the longest device prefix match of the prompt's block hashes (kv_index.py), but
                  by load when the replicas are imbalanced (max load - min load >
                  --balance-abs-threshold, SGLang's guard: affinity must not pile a hot prefix onto
                  one replica) or when the best match covers less than --cache-threshold of the
                  prompt's blocks (or no prompt hashes are known).
    cost          Dynamo-style, the lowest
                      cost(r) = prefill_blocks(r) + decode_weight * active_blocks(r)
                      prefill_blocks(r) = B - D(r) - store_hit_weight * max(0, S - D(r))
                  with B the prompt's full blocks, D(r) the blocks replica r holds on its device,
                  S the blocks the shared store holds (loading one is cheaper than computing it,
                  not free), active_blocks(r) = max(kv_usage * num_blocks, the prompt blocks + 1 of
                  the requests the router has in flight there): the KV the replica's running
                  requests hold, a proxy for its decode load. Without hashes D = S = 0 and the
                  cost is the decode term alone.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from deepinfer.router.kv_index import KVIndex, PromptHashes
from deepinfer.router.replica import Replica


@dataclass
class Choice:
    order: list[Replica]
    matched_blocks: int = 0     # device blocks the chosen replica is expected to hit
    reason: str = ""


def by_load(replicas: Sequence[Replica]) -> list[Replica]:
    return sorted(replicas, key=lambda r: (r.load, r.scraped.kv_usage, r.index))


class Policy:
    name = "base"

    def choose(self, replicas: Sequence[Replica], hashes: PromptHashes | Sequence[int] | None) -> Choice:
        raise NotImplementedError

    @property
    def needs_hashes(self) -> bool:
        return False


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, replicas, hashes):
        # Turns count over the replicas given (the healthy ones), so a dead replica's turns go to the others.
        start = next(self._counter) % len(replicas)
        first = replicas[start]
        return Choice([first] + by_load([r for r in replicas if r is not first]), reason="turn")


class LeastLoad(Policy):
    name = "least_load"

    def choose(self, replicas, hashes):
        return Choice(by_load(replicas), reason="load")


class CacheAware(Policy):
    name = "cache_aware"

    def __init__(self, index: KVIndex, balance_abs_threshold: float, cache_threshold: float) -> None:
        self.index = index
        self.balance_abs_threshold = balance_abs_threshold
        self.cache_threshold = cache_threshold

    @property
    def needs_hashes(self) -> bool:
        return True

    def choose(self, replicas, hashes):
        ordered = by_load(replicas)
        hashes = PromptHashes.of(hashes)
        if hashes is None:
            return Choice(ordered, reason="no-prefix")

        def match(r: Replica) -> int:
            return self.index.device_match(r.index, hashes.for_replica(r.index))

        loads = [r.load for r in replicas]
        if max(loads) - min(loads) > self.balance_abs_threshold:
            return Choice(ordered, match(ordered[0]), reason="imbalanced")
        matches = {r.index: match(r) for r in replicas}
        best = min(replicas, key=lambda r: (-matches[r.index], r.load, r.index))
        if matches[best.index] == 0 or matches[best.index] < self.cache_threshold * hashes.blocks:
            return Choice(ordered, matches[ordered[0].index], reason="miss")
        return Choice([best] + [r for r in ordered if r is not best], matches[best.index], reason="prefix")


class Cost(Policy):
    name = "cost"

    def __init__(self, index: KVIndex, store_hit_weight: float, decode_weight: float) -> None:
        self.index = index
        self.store_hit_weight = store_hit_weight
        self.decode_weight = decode_weight

    @property
    def needs_hashes(self) -> bool:
        return True

    def costs(self, replicas: Sequence[Replica],
              hashes: PromptHashes | Sequence[int] | None) -> dict[int, tuple[float, int]]:
        """replica index -> (cost, device blocks matched)."""
        hashes = PromptHashes.of(hashes)
        total = hashes.blocks if hashes is not None else 0
        in_store = self.index.store_match(hashes.for_store()) if hashes is not None else 0
        out = {}
        for r in replicas:
            device = self.index.device_match(r.index, hashes.for_replica(r.index)) if hashes is not None else 0
            prefill = total - device - self.store_hit_weight * max(0, in_store - device)
            out[r.index] = (prefill + self.decode_weight * r.active_blocks, device)
        return out

    def choose(self, replicas, hashes):
        costs = self.costs(replicas, hashes)
        ordered = sorted(replicas, key=lambda r: (costs[r.index][0], r.load, r.index))
        return Choice(ordered, costs[ordered[0].index][1], reason="cost")


def make_policy(name: str, index: KVIndex, options) -> Policy:
    if name == "round_robin":
        return RoundRobin()
    if name == "least_load":
        return LeastLoad()
    if name == "cache_aware":
        return CacheAware(index, options.balance_abs_threshold, options.cache_threshold)
    if name == "cost":
        return Cost(index, options.store_hit_weight, options.decode_weight)
    raise ValueError(f"unknown routing policy {name!r}")
