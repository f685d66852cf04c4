"""The KV store's read path against the machine's own reads of the same files (issue 44: store
hits that pay need reads at the disk's or the page cache's bandwidth).

    python benchmarks/kv_store_read_path.py [--entry-mib 2] [--entries 512] [--run-blocks 16]
        [--threads 8] [--repeats 3] [--workdir DIR] [--out JSON]

A dir:// store (deepinfer/kv_cache/store/dir.py) is filled with --entries blocks of --entry-mib
MiB of payload (the Llama-3-8B shape's 16-token block is 2 MiB) in entries of --run-blocks blocks
(kv_cache/store/runs.py), written through the store's own data path (entry_io.EntryOps.write).
Then, with the files in the page cache (just written, and read once before timing), best of
--repeats:

  store    EntryOps.read: every entry opened, read straight into its blocks' staging slots
           (readv), its header and XXH3-128 checksum checked, on --threads threads, then touched
  raw      the same files read into the same slots on the same number of threads, os.readv and
           nothing else: what the machine does without the store's work
  checks   entry.check alone over entries already in memory, on the same threads: the checksum's
           and header's share

Each is reported as GB/s of payload and as the store's time over raw's (1.0: the store costs
nothing beyond the reads). A cold page cache is reported too where the machine lets this
process drop it (/proc/sys/vm/drop_caches, root): every file read from the disk.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import machine_info, print_table, write_json  # noqa: E402


def drop_page_cache() -> bool:
    """Write back and drop the page cache (root only); False where not allowed."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--entry-mib", type=float, default=2.0)
    parser.add_argument("--entries", type=int, default=512)
    parser.add_argument("--run-blocks", type=int, default=16)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", default=None, help="where the store goes (default: a temp dir)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import numpy as np

    from deepinfer.kv_cache.store import entry as entry_format
    from deepinfer.kv_cache.store.dir import DirStore, _read_fully
    from deepinfer.kv_cache.store.entry_io import EntryOps

    layers = 32
    page = int(args.entry_mib * (1 << 20)) // (2 * layers)
    layout = entry_format.EntryLayout(num_layers=layers, page_bytes=page, dtype="bfloat16")
    payload = layout.payload_bytes
    total = payload * args.entries
    root = args.workdir or tempfile.mkdtemp(prefix="kv-read-path-")
    store = DirStore(os.path.join(root, "store"), {"chat": 86400.0})
    host = np.random.default_rng(0).integers(0, 256, (args.entries, payload), dtype=np.uint8)
    ops = EntryOps(store, host, args.threads)
    group = bytes(16)
    slots = [list(range(j, min(j + args.run_blocks, args.entries))) for j in range(0, args.entries, args.run_blocks)]
    keys = [(group, run[-1].to_bytes(16, "little")) for run in slots]
    start = time.perf_counter()
    written = ops.write(keys, slots, layout, "chat")
    write_s = time.perf_counter() - start
    assert len(written.written) == len(keys), written
    paths = [store.path(key) for key in keys]

    def raw_read(part: range) -> None:
        for i in part:
            head = bytearray(entry_format.HEADER_SIZE)
            fd = os.open(paths[i], os.O_RDONLY)
            try:
                _read_fully(fd, [memoryview(head), *(memoryview(host[s]) for s in slots[i])], os.fstat(fd).st_size)
            finally:
                os.close(fd)

    pool = ThreadPoolExecutor(max_workers=args.threads)
    parts = [range(j, j + 1) for j in range(len(keys))]

    def raw() -> None:
        list(pool.map(raw_read, parts))

    def through_store() -> None:
        result = ops.read(keys, slots, layout, "chat")
        assert result.error is None, result.error

    heads = []
    for path in paths[: min(len(paths), 64)]:
        with open(path, "rb") as f:
            heads.append(f.read(entry_format.HEADER_SIZE))

    def checks() -> None:
        def check(part: range) -> None:
            for i in part:
                j = i % len(heads)
                blocks = len(slots[j])
                entry_format.check(heads[j], [host[s] for s in slots[j]], layout.entry_bytes(blocks), group,
                                   keys[j][1], layout, blocks)
        list(pool.map(check, parts))

    def best(fn, cold: bool = False) -> float | None:
        times = []
        for _ in range(args.repeats):
            if cold and not drop_page_cache():
                return None
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    raw()   # warm: the files in the page cache, the pool's threads started
    rows = []
    timings = {"store": best(through_store), "raw": best(raw), "checks": best(checks),
               "store_cold": best(through_store, cold=True), "raw_cold": best(raw, cold=True)}
    for name, seconds in timings.items():
        if seconds is not None:
            rows.append({"path": name, "seconds": seconds, "gb_s": total / seconds / 1e9})
    for row in rows:
        anchor = timings["raw_cold" if row["path"].endswith("_cold") else "raw"]
        row["over_raw"] = row["seconds"] / anchor if row["path"] != "checks" else None
    result = {"benchmark": "kv_store_read_path", "machine": machine_info(), "args": vars(args),
              "entry_bytes": layout.entry_bytes(args.run_blocks), "total_payload_bytes": total, "write_s": write_s,
              "cold_measured": timings["raw_cold"] is not None, "rows": rows}
    print(f"{args.entries} blocks in entries of {layout.entry_bytes(args.run_blocks) / 2**20:.2f} MiB "
          f"({total / 2**30:.2f} GiB), "
          f"{args.threads} threads; written through the store in {write_s:.2f} s", flush=True)
    print_table(rows, [("path", "path", ""), ("seconds", "seconds", ".3f"), ("gb_s", "GB/s", ".2f"),
                       ("over_raw", "time / raw", ".2f")])
    write_json(args.out, result)
    ops.close()


if __name__ == "__main__":
    main()
