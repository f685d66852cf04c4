"""How a persistent store groups a request's blocks into entries (runs), and where a look-up
looks for them.

A request's chain of blocks is cut on a fixed grid of CHUNK_BLOCKS: run k holds blocks
[k * CHUNK_BLOCKS, (k + 1) * CHUNK_BLOCKS). Each run is one entry (entry.py) keyed by the hash of
its last block; block hashes chain the prefix, so that hash names the run and everything before
it, and any instance that computed the same prefix writes the same entry under the same name.

A prefix whose length is not a multiple of the grid ends in a shorter run: the blocks from its
last grid line to its end, one entry keyed by its own last block (LMCache's save_unfull_chunk).
It is written when its request ends (a conversation's turn: the next turn's prompt starts with
it); a later request that completes the run writes the whole run under the run's own last hash
beside it (the shorter entry then ages out by retention, never read again by a longer prompt
that finds the whole run). Runs are never cut elsewhere than the grid, so a prompt's entries and
the entries another request wrote for the same tokens have the same names.

A look-up of blocks [first, n) (look_up_ends) asks the store about each run's end from the run
holding `first`, in order, one existence check per run (a stat, or one STRLEN in a pipeline):
the last is cut at n. It stops at the first run some group lacks; that run may still have a
shorter entry (a request that ended inside it), found by checking its possible ends from the
longest down (partial_ends): at most CHUNK_BLOCKS - 1 more checks, for one run only.
"""

from __future__ import annotations

from collections.abc import Sequence

# 16 blocks (256 tokens at the usual block size of 16, LMCache's chunk_size): every per-entry
# cost (a file created, renamed and indexed on write; opened, read and closed on read; one
# existence check on a look-up) is paid once per 16 blocks rather than per block, while
# - a short prefix still spans several runs, which are read in parallel;
# - the trailing shorter run a turn leaves (rewritten whole when a later turn completes the run)
#   holds at most 15 blocks;
# - a run is what one read moves into the staging buffer at once, and two runs of the largest
#   group must fit it (staging.py), which stays far below any configured buffer;
# - a hit is loaded in whole runs: a device prefix that ends inside a run reads the run whole and
#   copies only the blocks it lacks.
# Every instance sharing a store must use the same grid: another grid's entries have other names
# and sizes (look-ups miss them; a size or num_blocks that differs is refused, never loaded).
CHUNK_BLOCKS = 16


def run_start(end: int, run: int = CHUNK_BLOCKS) -> int:
    """The first block of the run whose entry ends at `end` (exclusive, > 0)."""
    return (end - 1) // run * run


def look_up_ends(first: int, n: int, run: int = CHUNK_BLOCKS) -> list[int]:
    """The ends (exclusive) of the runs holding blocks [first, n), in order: each run's grid
    end, the last cut at n. Empty when first >= n."""
    return [end for start in range(first // run * run, n, run) if (end := min(start + run, n)) > first]


def partial_ends(end: int, first: int, run: int = CHUNK_BLOCKS) -> list[int]:
    """Shorter entries of the run whose grid end (or cut) is `end`, longest first, each adding
    blocks past `first`: the ends a request that stopped inside the run may have left."""
    return list(range(end - 1, max(run_start(end, run), first), -1))


def runs_of(first: int, end: int, run: int = CHUNK_BLOCKS) -> list[tuple[int, int]]:
    """(start, stop) of the entries that hold blocks [first, end): the runs on the grid, the
    first starting at or before `first` (its blocks before `first` are read, not used), the
    last cut at `end`."""
    return [(start, min(start + run, end)) for start in range(first // run * run, end, run)]


class OpenRuns:
    """A request's computed blocks of one layer group, gathered into runs to save: a run is
    handed out once every block of it is there, the shorter trailing runs when the request ends
    (drain). Blocks come with their position in the request's chain."""

    def __init__(self, run: int = CHUNK_BLOCKS) -> None:
        self.run = run
        self._blocks: dict[int, tuple[bytes, int]] = {}   # position -> (hash, device block id)

    def __bool__(self) -> bool:
        return bool(self._blocks)

    def add(self, positions: Sequence[int], hashes: Sequence[bytes], block_ids: Sequence[int]
            ) -> list[tuple[int, list[bytes], list[int]]]:
        """Add blocks; returns the runs they completed: (first position, hashes, device ids)."""
        for position, block_hash, block_id in zip(positions, hashes, block_ids):
            self._blocks[position] = (block_hash, block_id)
        whole = []
        for start in sorted({p - p % self.run for p in positions}):
            if all(start + j in self._blocks for j in range(self.run)):
                whole.append(self._take(start, self.run))
        return whole

    def drain(self) -> list[tuple[int, list[bytes], list[int]]]:
        """The shorter runs left: per run, its blocks from the grid line on while they follow one
        another (a run whose first block is missing cannot be an entry: entries start on the
        grid). Everything else is dropped."""
        out = []
        for start in sorted({p - p % self.run for p in self._blocks}):
            n = 0
            while start + n in self._blocks and n < self.run:
                n += 1
            if n:
                out.append(self._take(start, n))
        self._blocks.clear()
        return out

    def _take(self, start: int, n: int) -> tuple[int, list[bytes], list[int]]:
        taken = [self._blocks.pop(start + j) for j in range(n)]
        return start, [h for h, _ in taken], [b for _, b in taken]
