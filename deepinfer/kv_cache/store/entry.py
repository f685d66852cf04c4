"""One persisted KV block: the header format, encode/decode and integrity checks.

An entry is one block of one layer group, addressed by its TierKey (group key, block hash):

    header (HEADER_SIZE bytes, little-endian)
      magic            4s   b"DIKV"
      version          H    FORMAT_VERSION; any other is refused (foreign writer)
      header_size      H    HEADER_SIZE
      num_layers       I    layers of the group
      page_bytes       Q    one layer's K (or V) of one block
      payload_bytes    Q    num_layers * tensors * page_bytes (tensors: 2, K and V; 1 for a kind
                            whose K and V are one tensor, DeepSeek-V4's)
      dtype            16s  storage dtype name, e.g. "bfloat16", "float8_e4m3fn"
      traffic_class    16s  the retention class it was written under ("chat", "agent", ...)
      created          d    unix seconds at write
      group_key        16s  the TierKey, repeated: an entry under the wrong name is refused
      block_hash       16s
      payload_xxh3     16s  XXH3-128 of the payload
      header_crc       I    crc32 of every header byte before it
    payload            [layers, K/V (or the one tensor), page bytes], a staging slot's layout

Last use is not in the header (it changes on every hit): the dir backend keeps it as the file's
mtime, Redis as the key's expiry. decode() raises EntryError with a reason (one of REASONS):
truncated, version, corrupt, mismatch. A caller drops such an entry and counts it; its bytes
never reach a forward.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import xxhash

MAGIC = b"DIKV"
# 2: the payload checksum is XXH3-128 (1 was blake2b-128, which at 2 MiB entries held every load
# and save for seconds of CPU per 32k-token prefix; docs/benchmarks/design-measurements.md#kv-store-checksum).
# The checksum guards against corruption (bit flips, torn or truncated writes), not against a
# writer who means harm: no unkeyed hash would, anyone who can write the store can write a valid entry.
FORMAT_VERSION = 2
_FIXED = struct.Struct("<4sHHIQQ16s16sd16s16s16s")
_CRC = struct.Struct("<I")
HEADER_SIZE = _FIXED.size + _CRC.size
REASONS = ("truncated", "version", "corrupt", "mismatch")
# Where traffic_class and created lie in the header (a store's report reads just those bytes).
_CLASS_CREATED = struct.Struct("<16sd")
CLASS_CREATED_START = struct.calcsize("<4sHHIQQ16s")
CLASS_CREATED_END = CLASS_CREATED_START + _CLASS_CREATED.size


class EntryError(ValueError):
    """An entry that must not be loaded; `reason` is one of REASONS."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True)
class EntryLayout:
    """What an entry of one group must look like (the reader's expectation)."""

    num_layers: int
    page_bytes: int
    dtype: str
    tensors: int = 2    # per layer: K and V, or 1 where they are one tensor (shared_kv)

    @property
    def payload_bytes(self) -> int:
        return self.num_layers * self.tensors * self.page_bytes

    @property
    def entry_bytes(self) -> int:
        return HEADER_SIZE + self.payload_bytes


@dataclass(frozen=True)
class EntryHeader:
    version: int
    num_layers: int
    page_bytes: int
    payload_bytes: int
    dtype: str
    traffic_class: str
    created: float
    group_key: bytes
    block_hash: bytes
    checksum: bytes


def _pad(text: str, field: str) -> bytes:
    raw = text.encode()
    if len(raw) > 16:
        raise ValueError(f"{field} {text!r} is longer than 16 bytes")
    return raw


def checksum(payload: bytes | memoryview) -> bytes:
    return xxhash.xxh3_128_digest(payload)


def encode(group_key: bytes, block_hash: bytes, layout: EntryLayout, payload: bytes | memoryview,
           traffic_class: str, created: float) -> bytes:
    """Header + payload as one bytes object (what a backend writes under the key)."""
    payload = memoryview(payload).cast("B")
    if len(payload) != layout.payload_bytes:
        raise ValueError(f"payload of {len(payload)} bytes for a layout of {layout.payload_bytes}")
    fixed = _FIXED.pack(MAGIC, FORMAT_VERSION, HEADER_SIZE, layout.num_layers, layout.page_bytes,
                        layout.payload_bytes, _pad(layout.dtype, "dtype"), _pad(traffic_class, "traffic class"),
                        created, group_key, block_hash, checksum(payload))
    return b"".join((fixed, _CRC.pack(zlib.crc32(fixed)), payload))


def class_and_created(raw: bytes) -> tuple[str, float] | None:
    """traffic_class and created from header bytes [CLASS_CREATED_START, CLASS_CREATED_END)
    (None: too short or not text), unchecked: for reports, never for loading."""
    if len(raw) != _CLASS_CREATED.size:
        return None
    name, created = _CLASS_CREATED.unpack(raw)
    try:
        return name.rstrip(b"\0").decode(), created
    except UnicodeDecodeError:
        return None


def decode_header(data: bytes | memoryview) -> EntryHeader:
    """The header alone (checks magic, version and its crc; not the payload)."""
    data = memoryview(data)
    if len(data) < HEADER_SIZE:
        # A foreign writer's entry may be shorter than ours: check its magic and version first.
        if len(data) >= 8 and bytes(data[:4]) == MAGIC and struct.unpack_from("<H", data, 4)[0] != FORMAT_VERSION:
            raise EntryError("version", f"format version {struct.unpack_from('<H', data, 4)[0]}")
        raise EntryError("truncated", f"{len(data)} bytes, shorter than the header ({HEADER_SIZE})")
    (magic, version, header_size, num_layers, page_bytes, payload_bytes, dtype, traffic_class, created,
     group_key, block_hash, digest) = _FIXED.unpack_from(data)
    if magic != MAGIC:
        raise EntryError("corrupt", f"magic {magic!r}")
    if version != FORMAT_VERSION or header_size != HEADER_SIZE:
        raise EntryError("version", f"format version {version} (header {header_size} bytes); "
                                    f"this reader knows {FORMAT_VERSION}")
    (crc,) = _CRC.unpack_from(data, _FIXED.size)
    if crc != zlib.crc32(data[:_FIXED.size]):
        raise EntryError("corrupt", "header checksum")
    return EntryHeader(version, num_layers, page_bytes, payload_bytes, dtype.rstrip(b"\0").decode(),
                       traffic_class.rstrip(b"\0").decode(), created, group_key, block_hash, digest)


def decode(data: bytes | memoryview, group_key: bytes, block_hash: bytes, layout: EntryLayout
           ) -> tuple[EntryHeader, memoryview]:
    """Check an entry completely and return its header and payload (a view into `data`)."""
    data = memoryview(data)
    header = check(data[:HEADER_SIZE], data[HEADER_SIZE:], len(data), group_key, block_hash, layout)
    return header, data[HEADER_SIZE:]


def check(head: bytes | memoryview, payload: bytes | memoryview, length: int, group_key: bytes,
          block_hash: bytes, layout: EntryLayout) -> EntryHeader:
    """Check an entry read in two parts (a store read it straight into a staging slot): `head`,
    its first min(length, HEADER_SIZE) bytes; `payload`, what followed them; `length`, the whole
    entry's size in bytes."""
    header = decode_header(head)
    if (header.group_key, header.block_hash) != (group_key, block_hash):
        raise EntryError("mismatch", "the entry's key is not the one asked for")
    if (header.num_layers, header.page_bytes, header.dtype) != (layout.num_layers, layout.page_bytes, layout.dtype):
        raise EntryError("mismatch", f"entry of {header.num_layers} layers x {header.page_bytes} bytes "
                                     f"{header.dtype}, expected {layout}")
    if header.payload_bytes != layout.payload_bytes:
        raise EntryError("corrupt", f"payload size {header.payload_bytes} in the header, expected "
                                    f"{layout.payload_bytes}")
    if length != layout.entry_bytes:
        reason = "truncated" if length < layout.entry_bytes else "corrupt"
        raise EntryError(reason, f"{length} bytes, expected {layout.entry_bytes}")
    if checksum(payload) != header.checksum:
        raise EntryError("corrupt", "payload checksum")
    return header
