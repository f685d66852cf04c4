"""KV store loads without an engine: how fast the store's data path (kv_cache/store/entry_io.py's
EntryOps, what the I/O process runs) looks up, reads and checks a prefix's entries into staging
slots, for entries of one block and for runs of several (kv_cache/store/runs.py), beside the plain
file reads of the same bytes.

    python benchmarks/kv_store_load_rate.py [--blocks 512] [--block-mib 2] [--run-blocks 1,16]
        [--threads 1,2,8] [--repeats 3] [--dir DIR] [--drop-caches] [--json OUT]

Writes a prefix of --blocks blocks of Llama-3-8B's block shape (2 MiB: 32 layers, K and V, 16
tokens, bf16) into a dir:// store (a temp dir unless --dir) as entries of each --run-blocks,
then per thread count: the existence checks of a look-up (one stat per entry, what the scheduler
side asks), the plain reads (open and read each file, the same thread pool), and EntryOps.read of
every entry into a staging array, the way a load's reader hands them over: one call per entry,
--threads in flight (one readv into the entry's slots, header and checksum checks, the touch of a
hit). GB/s of payload, best of --repeats. The files are in the page cache unless --drop-caches
(root: drops it before each timed pass), so by default this is the path's CPU cost, not the disk's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import best_of  # noqa: E402

from deepinfer.config import parse_retention  # noqa: E402
from deepinfer.kv_cache.store import entry as entry_format  # noqa: E402
from deepinfer.kv_cache.store.dir import DirStore  # noqa: E402
from deepinfer.kv_cache.store.entry_io import EntryOps  # noqa: E402


def drop_caches(enabled: bool) -> None:
    if enabled:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")


def measure(root: str, layout, args, run_blocks: int) -> list[dict]:
    """Write the prefix as entries of `run_blocks` blocks, then time its look-up and reads."""
    store = DirStore(root, parse_retention("chat=7d,agent=3d"))
    group = b"g" * 16
    runs = [list(range(j, min(j + run_blocks, args.blocks))) for j in range(0, args.blocks, run_blocks)]
    keys = [(group, run[-1].to_bytes(16, "little")) for run in runs]   # named by the run's last block
    payload = os.urandom(layout.payload_bytes)
    start = time.perf_counter()
    for key, run in zip(keys, runs):
        store.put([(key, entry_format.encode(*key, layout, [payload] * len(run), "chat", store.clock()), "chat")])
    write_s = time.perf_counter() - start
    host = np.zeros((args.blocks, layout.payload_bytes), dtype=np.uint8)
    total = args.blocks * layout.payload_bytes
    sizes = [layout.entry_bytes(len(run)) for run in runs]
    rows = []
    for threads in (int(t) for t in args.threads.split(",")):
        lookup_s = best_of(lambda: store.exists(keys, sizes), args.repeats, lambda: drop_caches(args.drop_caches))
        with ThreadPoolExecutor(threads) as pool:
            def plain():
                def read(key):
                    with open(store.path(key), "rb") as f:
                        return len(f.read())
                list(pool.map(read, keys))
            plain_s = best_of(plain, args.repeats, lambda: drop_caches(args.drop_caches))
            ops = EntryOps(DirStore(root, store.retention), host, threads)

            def load():   # one call per entry, `threads` in flight: a load's reader (persistent_loads.py)
                results = list(pool.map(lambda i: ops.read([keys[i]], [runs[i]], layout, "chat"), range(len(keys))))
                assert all(r.error is None for r in results), results[0]
            load()
            assert bytes(host[-1]) == payload
            ops_s = best_of(load, args.repeats, lambda: drop_caches(args.drop_caches))
            ops.close()
        row = {"run_blocks": run_blocks, "entries": len(keys), "threads": threads, "write_s": write_s,
               "lookup_s": lookup_s, "plain_gbs": total / plain_s / 1e9, "load_gbs": total / ops_s / 1e9,
               "load_s": ops_s}
        rows.append(row)
        print(f"  runs of {run_blocks:>2} ({len(keys)} entries), {threads} threads: look-up {lookup_s * 1e3:7.2f} ms; "
              f"plain reads {row['plain_gbs']:6.2f} GB/s; EntryOps.read {row['load_gbs']:6.2f} GB/s "
              f"({ops_s:.3f} s); written in {write_s:.2f} s", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, default=512)
    parser.add_argument("--block-mib", type=float, default=2.0)
    parser.add_argument("--run-blocks", default="1,16")
    parser.add_argument("--threads", default="1,2,8")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--drop-caches", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    layout = entry_format.EntryLayout(32, int(args.block_mib * (1 << 20)) // 64, "bfloat16")
    print(f"a prefix of {args.blocks} blocks of {layout.payload_bytes / (1 << 20):.2f} MiB "
          f"({'page cache dropped before each pass' if args.drop_caches else 'page cache warm'})")
    rows = []
    for run_blocks in (int(r) for r in args.run_blocks.split(",")):
        root = tempfile.mkdtemp(prefix="kv-load-rate-", dir=args.dir)
        try:
            rows += measure(root, layout, args, run_blocks)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"blocks": args.blocks, "block_bytes": layout.payload_bytes, "drop_caches": args.drop_caches,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
