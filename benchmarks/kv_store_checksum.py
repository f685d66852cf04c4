"""KV store entries: what checking and building one costs, per candidate payload checksum and for
the store's own encode/decode (kv_cache/store/entry.py), and whether threads check in parallel.

    python benchmarks/kv_store_checksum.py [--entry-mib 2] [--repeats 50] [--threads 1,2]

An entry of Llama-3-8B's shape (32 layers, K and V, one 16-token block, bf16) is 2 MiB. Prints
GB/s of one thread per checksum (blake2b-128: the format's first checksum; XXH3-128: its current
one; crc32 for scale; a plain copy as the floor), the store's encode + decode per entry, and the
rate of decode over --threads threads (the I/O threads of entry_io.py: it scales only where the
checksum releases the interpreter).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import xxhash

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from deepinfer.kv_cache.store import entry as entry_format  # noqa: E402


def rate(fn, nbytes: int, repeats: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return nbytes * repeats / (time.perf_counter() - start) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--entry-mib", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--threads", default="1,2")
    args = parser.parse_args()
    page = int(args.entry_mib * (1 << 20)) // (32 * 2)
    layout = entry_format.EntryLayout(32, page, "bfloat16")
    payload = os.urandom(layout.payload_bytes)
    key = (b"g" * 16, b"h" * 16)
    candidates = {
        "blake2b-128": lambda: hashlib.blake2b(payload, digest_size=16).digest(),
        "xxh3-128": lambda: xxhash.xxh3_128_digest(payload),
        "crc32": lambda: zlib.crc32(payload),
        "copy": lambda: bytearray(payload),
    }
    print(f"entry payload {layout.payload_bytes / (1 << 20):.2f} MiB; format version {entry_format.FORMAT_VERSION}")
    for name, fn in candidates.items():
        print(f"  {name:>12}: {rate(fn, len(payload), args.repeats):6.2f} GB/s (one thread)")
    data = entry_format.encode(*key, layout, payload, "chat", 0.0)
    print(f"  {'encode':>12}: {rate(lambda: entry_format.encode(*key, layout, payload, 'chat', 0.0), len(payload), args.repeats):6.2f} GB/s")
    print(f"  {'decode':>12}: {rate(lambda: entry_format.decode(data, *key, layout, 1), len(payload), args.repeats):6.2f} GB/s")
    for threads in (int(t) for t in args.threads.split(",")):
        with ThreadPoolExecutor(threads) as pool:
            def batch():
                list(pool.map(lambda _: entry_format.decode(data, *key, layout, 1), range(threads * 4)))
            print(f"  decode, {threads} threads: {rate(batch, len(payload) * threads * 4, max(args.repeats // 4, 1)):6.2f} GB/s")


if __name__ == "__main__":
    main()
