"""Content hashes of full KV blocks, chained so that a hit implies the whole prefix matches.

hash(block i) = H(hash(block i-1), token ids of block i, extra). `extra` carries whatever else
changes the KV for the same tokens: the model id, a tenant's `cache_salt` (so tenants never
share blocks), and the LoRA adapter the request runs under (LoRARequest.cache_key: blocks
computed under one adapter are never another adapter's or the base model's). blake2b keeps
collisions out of reach of adversarial prompts, which Python's hash() would not.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

ROOT_HASH = b"deepinfer-kv-v2"


def hash_root(model: str, revision: str | None, block_size: int, kv_cache_dtype: str, tp_rank: int = 0) -> bytes:
    """The parent of every request's first block in one engine."""
    identity = f"{model}\x00{revision or ''}\x00bs={block_size}\x00kv={kv_cache_dtype}\x00tp={tp_rank}"
    return hashlib.blake2b(ROOT_HASH + identity.encode(), digest_size=16).digest()


def hash_block(parent: bytes, token_ids: Sequence[int], extra: bytes) -> bytes:
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array("q", token_ids).tobytes())
    h.update(extra)
    return h.digest()


def extra_key(model_id: str, cache_salt: str | None, lora_key: str | None = None) -> bytes:
    # Without an adapter the key is what it was before adapters existed, so blocks a KV store
    # kept from an older engine still hit.
    key = f"{model_id}\x00{cache_salt or ''}"
    return (key if lora_key is None else f"{key}\x00{lora_key}").encode()


def extend_block_hashes(hashes: list[bytes], token_ids: Sequence[int], block_size: int,
                        extra: bytes, root: bytes = ROOT_HASH) -> None:
    """Append the hashes of newly completed full blocks of `token_ids` to `hashes` in place."""
    parent = hashes[-1] if hashes else root
    first = len(hashes) * block_size
    num_blocks = (len(token_ids) - first) // block_size
    if num_blocks <= 0:
        return
    # One conversion of the new tokens to bytes, then a slice per block (hash_block's bytes).
    ids = array("q", token_ids[first:first + num_blocks * block_size])
    data, step = memoryview(ids.tobytes()), block_size * ids.itemsize
    for k in range(num_blocks):
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(data[k * step:(k + 1) * step])
        h.update(extra)
        parent = h.digest()
        hashes.append(parent)
