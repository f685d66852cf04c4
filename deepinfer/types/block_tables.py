"""Block tables as the runner holds them: the sender's record and the runner's update, side by side.

The scheduler (and a draft model's drafter, for its own runner) sends a request's block tables
whole once, in NewRequestData, then only their changes (BlockTableDiff, types/plan.py). To
know what changed without keeping a copy of every table, `RunnerBlockTables` remembers per
request and layer group two numbers: how many entries the runner holds, and how many of them
are the null block. That is enough because of how the KV manager changes a table:

  - it appends blocks at the end (allocate);
  - it replaces leading entries by the null block (sliding window), and the null entries
    are always a prefix of the table (a prefix-cache hit also starts with them);
  - it cuts the tail (speculative decoding frees the blocks of rejected drafts): the sender
    calls `cut` right after, since a cut table looks unchanged by its length alone (the
    runner's copy is longer, or the table grew back to the old length with other blocks).

`apply_block_table_diffs` is the runner's half; tests/unit/test_plan_diffs.py checks that the
runner's tables equal the scheduler's after every step of random traffic.
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer.types.plan import BlockTableDiff

# Block 0 of every pool: no request owns it; a table entry that points at it holds nothing (a
# sliding window's freed blocks, a block not allocated yet).
NULL_BLOCK_ID = 0


@dataclass
class _Held:
    num_blocks: list[int]   # per group: leading entries the runner holds as the sender has them
    num_null: list[int]     # per group: of those, the leading null entries
    cut: bool = False       # a tail was cut since the last send: the runner holds stale entries


class RunnerBlockTables:
    """The sender's record of the block tables its runner holds, per request."""

    def __init__(self) -> None:
        self._held: dict[str, _Held] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._held

    def new_request(self, request_id: str, block_ids: list[list[int]]) -> list[list[int]]:
        """Record that the runner gets these tables whole; returns the copy to send (the
        sender keeps changing its own lists in place)."""
        self._held[request_id] = _Held([len(ids) for ids in block_ids], [_leading_nulls(ids, 0) for ids in block_ids])
        return [list(ids) for ids in block_ids]

    def diff(self, request_id: str, block_ids: list[list[int]]) -> list[BlockTableDiff] | None:
        """What changed since the last send (recorded as sent now), or None when nothing did."""
        held = self._held[request_id]
        for ids, num_blocks, num_null in zip(block_ids, held.num_blocks, held.num_null):
            if len(ids) != num_blocks or (num_null < len(ids) and ids[num_null] == NULL_BLOCK_ID):
                break
        else:
            if not held.cut:
                return None   # the common case: a decode inside its last block
        held.cut = False
        diffs = []
        for g, ids in enumerate(block_ids):
            start = held.num_blocks[g]
            num_null = _leading_nulls(ids, held.num_null[g])
            diffs.append(BlockTableDiff(num_null, start, ids[start:]))
            held.num_blocks[g], held.num_null[g] = len(ids), num_null
        return diffs

    def cut(self, request_id: str, block_ids: list[list[int]]) -> None:
        """The tables' tails were just cut: the runner's entries past the new ends are stale."""
        held = self._held.get(request_id)
        if held is None:
            return
        for g, ids in enumerate(block_ids):
            held.num_blocks[g] = min(held.num_blocks[g], len(ids))
            held.num_null[g] = min(held.num_null[g], len(ids))
        held.cut = True

    def forget(self, request_id: str) -> bool:
        """The runner is told to drop the request; returns whether it held it."""
        return self._held.pop(request_id, None) is not None


def _leading_nulls(ids: list[int], known: int) -> int:
    """Leading null entries of `ids`, the first `known` of which are null already."""
    n = known
    while n < len(ids) and ids[n] == NULL_BLOCK_ID:
        n += 1
    return n


def apply_block_table_diffs(tables: list[list[int]], diffs: list[BlockTableDiff]) -> None:
    """The runner's half: bring its tables (one per layer group) up to date in place."""
    for table, d in zip(tables, diffs, strict=True):
        del table[d.start:]
        table.extend(d.new_block_ids)
        # Walk back from the end of the null prefix: the entries before the first one already
        # null were nulled by an earlier diff.
        i = d.num_null - 1
        while i >= 0 and table[i] != NULL_BLOCK_ID:
            table[i] = NULL_BLOCK_ID
            i -= 1
