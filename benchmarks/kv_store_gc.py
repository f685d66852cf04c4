"""KV store retention GC: a dir:// store of up to a million entries, some of them expired by an
injected clock; how long DirStore.gc() takes, against the expired count and against the stored
count.

    python benchmarks/kv_store_gc.py [--entries 1000000] [--sizes 250000,500000,1000000]
        [--expired 10000] [--fractions 0.005,0.01,0.02] [--repeats 3] [--dir DIR]
        [--out gc.json] [--plot gc.png] [--plot-from gc.json]

How to run: the defaults take about 2 minutes on the 2-core CPU box (1:53 on 2026-12-01) and
about 5 GiB of a tmpfs (/dev/shm, when it has the room; else a temp dir on disk: every entry is a
file, a page of the file system each), one core busy. A quick check: `--entries 20000 --sizes 5000,10000,20000 --expired 1000`.

The store is written through the backend API (DirStore.put, entry.encode: a real header and
checksum around a 32-byte payload), in batches as the worker's writer writes them; the clock is
the store's injectable one (StoreBackend.clock), so entries can be last used days ago. Live
entries are spread over the last 6 days (under chat's 7-day retention: index buckets of BUCKET_S
over all of it, as a store in service has); expired ones were last used 8 days ago, spread over
an hour. Two series, each point --repeats times (each time its expired entries are written
again, then collected; the live ones stay):
  * stored fixed (the largest --sizes), expired = --fractions of it;
  * expired fixed (--expired), stored = each of --sizes (the store grows from one to the next).
gc() opens only the index buckets whose retention has passed (kv_cache/store/dir.py), so its
time should follow the expired count; reported beside it: microseconds per expired entry, and a
gc with nothing expired (listing the index alone).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import (
    add_output_args,
    machine_info,
    median,
    print_table,
    pyplot,
    replot,
    save_and_plot,
    save_figure,
)

DAY = 86400.0
NOW = 1_800_000_000.0
LIVE_SPAN_S = 6 * DAY
EXPIRED_AGE_S = 8 * DAY
BATCH = 250     # entries per put(): one save of a few requests' blocks
FILE_BYTES = 4096 + 1024   # what an entry costs a file system: a page, and its inode and name


class Clock:
    def __init__(self) -> None:
        self.t = NOW

    def __call__(self) -> float:
        return self.t


class Writer:
    """Entries with keys of their own (a hash of a running number, so they spread over the
    store's shard directories as block hashes do)."""

    def __init__(self, store, clock: Clock) -> None:
        from deepinfer.kv_cache.store.entry import EntryLayout

        self.store, self.clock = store, clock
        self.layout = EntryLayout(1, 16, "bfloat16")
        self.group = hashlib.blake2b(b"group", digest_size=16).digest()
        self.next = 0

    def write(self, n: int, start: float, span: float) -> None:
        """n entries last used from `start` over `span` seconds (clock times), in batches."""
        from deepinfer.kv_cache.store import entry

        payload = bytes(self.layout.payload_bytes)
        for done in range(0, n, BATCH):
            size = min(BATCH, n - done)
            self.clock.t = start + span * done / max(n, 1)
            items = []
            for _ in range(size):
                key = (self.group, hashlib.blake2b(self.next.to_bytes(8, "little"), digest_size=16).digest())
                self.next += 1
                items.append((key, entry.encode(*key, self.layout, payload, "chat", self.clock.t), "chat"))
            self.store.put(items)
        self.clock.t = NOW


def timed_gc(store, writer: Writer, clock: Clock, expired: int) -> dict:
    """Write `expired` entries last used 8 days ago, then time one gc at NOW."""
    writer.write(expired, NOW - EXPIRED_AGE_S, 3600.0)
    index_files = len(os.listdir(store.index))
    clock.t = NOW
    t = time.perf_counter()
    dropped = store.gc()
    seconds = time.perf_counter() - t
    if dropped != expired:
        raise RuntimeError(f"gc dropped {dropped} entries, {expired} had expired")
    return {"gc_s": seconds, "index_files": index_files}


def measure(store, writer, clock, stored: int, expired: int, repeats: int, series: str) -> dict:
    runs = [timed_gc(store, writer, clock, expired) for _ in range(repeats)]
    row = {"series": series, "stored": stored, "expired": expired, "runs": runs,
           "gc_s": median([r["gc_s"] for r in runs]), "index_files": runs[0]["index_files"]}
    row["us_per_expired"] = row["gc_s"] / expired * 1e6 if expired else None
    each = ", ".join(f"{r['gc_s'] * 1e3:.1f}" for r in runs)
    print(f"  {series}: stored {stored}, expired {expired}: gc {row['gc_s'] * 1e3:.1f} ms ({each}), "
          f"index files {row['index_files']}", flush=True)
    return row


def default_dir(entries: int) -> str:
    need = entries * FILE_BYTES * 1.3
    if os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > need:
        return tempfile.mkdtemp(prefix="kv-store-gc-", dir="/dev/shm")
    return tempfile.mkdtemp(prefix="kv-store-gc-")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--entries", type=int, default=1_000_000, help="the largest store (the fractions' size)")
    parser.add_argument("--sizes", default="250000,500000,1000000", help="stored counts of the fixed-expired series")
    parser.add_argument("--expired", type=int, default=10_000, help="expired count of the fixed-expired series")
    parser.add_argument("--fractions", default="0.005,0.01,0.02", help="expired fractions at --entries")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="an empty directory for the store (default: tmpfs if roomy)")
    add_output_args(parser)
    args = parser.parse_args()
    if replot(args, plot):
        return
    try:
        sizes = sorted(int(s) for s in args.sizes.split(","))
        fractions = [float(f) for f in args.fractions.split(",")]
    except ValueError:
        parser.error("--sizes takes whole numbers, --fractions decimals, comma-separated")
    if not sizes or sizes[0] < 1 or max(sizes) > args.entries:
        parser.error("--sizes must be >= 1 and at most --entries")
    if args.expired < 1 or args.repeats < 1 or any(not 0 < f < 1 for f in fractions):
        parser.error("--expired and --repeats must be >= 1, --fractions in (0, 1)")
    if args.dir and os.path.exists(args.dir) and os.listdir(args.dir):
        parser.error(f"--dir {args.dir} is not empty (the benchmark deletes what it writes)")

    from deepinfer.config import parse_retention
    from deepinfer.kv_cache.store.dir import BUCKET_S, DirStore

    root = args.dir or default_dir(args.entries)
    clock = Clock()
    store = DirStore(root, parse_retention("chat=7d,agent=3d"), clock=clock)
    writer = Writer(store, clock)
    result = {"benchmark": "kv_store_gc", "machine": machine_info(), "args": vars(args), "dir": root,
              "bucket_s": BUCKET_S, "entry_bytes": writer.layout.entry_bytes(1), "rows": []}
    print(f"store in {root}; entries of {writer.layout.entry_bytes(1)} bytes", flush=True)
    try:
        stored = 0
        for size in [*sizes, args.entries] if args.entries not in sizes else sizes:
            t = time.perf_counter()
            writer.write(size - stored, NOW - LIVE_SPAN_S, LIVE_SPAN_S)
            print(f"wrote {size - stored} live entries in {time.perf_counter() - t:.1f} s", flush=True)
            result.setdefault("write_s", []).append({"entries": size - stored, "s": time.perf_counter() - t})
            stored = size
            if size in sizes:
                result["rows"].append(measure(store, writer, clock, stored, args.expired, args.repeats, "fixed expired"))
        result["rows"].append(measure(store, writer, clock, stored, 0, args.repeats, "nothing expired"))
        for fraction in fractions:
            result["rows"].append(measure(store, writer, clock, stored, round(stored * fraction), args.repeats,
                                          "fixed stored"))
        entries, _ = store._walk()
        result["entries_at_end"] = entries
        if entries != stored:
            raise RuntimeError(f"the store holds {entries} entries at the end, {stored} were live")
    finally:
        t = time.perf_counter()
        shutil.rmtree(root, ignore_errors=True)
        print(f"(removed the store in {time.perf_counter() - t:.0f} s)")
    print()
    print_table([{**r, "gc_ms": r["gc_s"] * 1e3} for r in result["rows"]],
                [("series", "series", ""), ("stored", "stored", "d"), ("expired", "expired", "d"),
                 ("gc_ms", "gc ms (median)", ".1f"), ("us_per_expired", "us / expired", ".1f"),
                 ("index_files", "index files", "d")])
    save_and_plot(args, result, plot)


def plot(result: dict, path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, series, key, label in ((ax1, "fixed stored", "expired", "expired entries"),
                                   (ax2, "fixed expired", "stored", "stored entries")):
        rows = [r for r in result["rows"] if r["series"] == series]
        ax.plot([r[key] for r in rows], [r["gc_s"] * 1e3 for r in rows], "o-")
        for r in rows:
            ax.scatter([r[key]] * len(r["runs"]), [x["gc_s"] * 1e3 for x in r["runs"]], color="grey", s=8)
        ax.set_xlabel(label)
        ax.set_xlim(left=0)
        ax.set_ylim(bottom=0)
        other = rows[0]["stored"] if series == "fixed stored" else rows[0]["expired"]
        ax.set_title(f"{'stored' if series == 'fixed stored' else 'expired'} = {other:,}")
    ax1.set_ylabel("gc() ms (median, repeats in grey)")
    fig.suptitle("dir:// store retention GC: the time follows what expired, not what is stored")
    save_figure(fig, path)


if __name__ == "__main__":
    main()
