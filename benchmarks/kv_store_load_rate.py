"""KV store loads without an engine: how fast the store's data path (kv_cache/store/entry_io.py's
EntryOps, what the I/O process runs) reads and checks entries into staging slots, beside the
plain file reads of the same entries.

    python benchmarks/kv_store_load_rate.py [--entries 512] [--entry-mib 2] [--threads 1,2,8]
        [--repeats 3] [--dir DIR] [--drop-caches]

Writes --entries entries of Llama-3-8B's block shape (2 MiB: 32 layers, K and V, 16 tokens, bf16)
into a dir:// store (a temp dir unless --dir), then per thread count: the plain reads (open and
read each file, the same thread pool), and EntryOps.read of all of them into a staging array
(reads, header and checksum checks, copies into the slots, the touch of a hit). GB/s of payload,
best of --repeats. The files are in the page cache unless --drop-caches (root: drops it before
each timed pass), so by default this is the path's CPU cost, not the disk's.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--entries", type=int, default=512)
    parser.add_argument("--entry-mib", type=float, default=2.0)
    parser.add_argument("--threads", default="1,2,8")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--drop-caches", action="store_true")
    args = parser.parse_args()

    layout = entry_format.EntryLayout(32, int(args.entry_mib * (1 << 20)) // 64, "bfloat16")
    root = tempfile.mkdtemp(prefix="kv-load-rate-", dir=args.dir)
    try:
        store = DirStore(root, parse_retention("chat=7d,agent=3d"))
        group = b"g" * 16
        keys = [(group, i.to_bytes(16, "little")) for i in range(args.entries)]
        payload = os.urandom(layout.payload_bytes)
        for j in range(0, len(keys), 64):
            store.put([(key, entry_format.encode(*key, layout, payload, "chat", store.clock()), "chat")
                       for key in keys[j:j + 64]])
        host = np.zeros((args.entries, layout.payload_bytes), dtype=np.uint8)
        slots = list(range(args.entries))
        total = args.entries * layout.payload_bytes
        print(f"{args.entries} entries of {layout.payload_bytes / (1 << 20):.2f} MiB in {root} "
              f"({'page cache dropped before each pass' if args.drop_caches else 'page cache warm'})")
        for threads in (int(t) for t in args.threads.split(",")):
            with ThreadPoolExecutor(threads) as pool:
                def plain():
                    def read(key):
                        with open(store.path(key), "rb") as f:
                            return len(f.read())
                    list(pool.map(read, keys))
                plain_s = best_of(plain, args.repeats, lambda: drop_caches(args.drop_caches))
            ops = EntryOps(DirStore(root, store.retention), host, threads)   # closed with it
            result = ops.read(keys, slots, layout, "chat")
            assert result.error is None and bytes(host[-1]) == payload, result
            ops_s = best_of(lambda: ops.read(keys, slots, layout, "chat"), args.repeats,
                            lambda: drop_caches(args.drop_caches))
            ops.close()
            print(f"  {threads} threads: plain reads {total / plain_s / 1e9:6.2f} GB/s; "
                  f"EntryOps.read {total / ops_s / 1e9:6.2f} GB/s ({ops_s * 1e3 / args.entries:.3f} ms an entry)")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
