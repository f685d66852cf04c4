"""One persisted run of KV blocks: the header format, encode/decode and integrity checks.

An entry is a run of consecutive blocks of one layer group (runs.py: up to CHUNK_BLOCKS, aligned
to the run grid of the request's chain), addressed by its TierKey (group key, hash of the run's
LAST block: block hashes chain the whole prefix, so that one hash names every block before it):

    header (HEADER_SIZE bytes, little-endian)
      magic            4s   b"DIKV"
      version          H    FORMAT_VERSION; any other is refused (foreign or older writer)
      header_size      H    HEADER_SIZE
      num_layers       I    layers of the group
      page_bytes       Q    one layer's K (or V) of one block
      num_blocks       I    blocks in the run
      payload_bytes    Q    num_blocks * num_layers * tensors * page_bytes (tensors: 2, K and V;
                            1 for a kind whose K and V are one tensor, DeepSeek-V4's)
      dtype            16s  storage dtype name, e.g. "bfloat16", "float8_e4m3fn"
      traffic_class    16s  the retention class it was written under ("chat", "agent", ...)
      created          d    unix seconds at write
      group_key        16s  the TierKey, repeated: an entry under the wrong name is refused
      block_hash       16s  the run's last block
      payload_xxh3     16s  XXH3-128 of the payload
      header_crc       I    crc32 of every header byte before it
    payload            per block, in order: [layers, K/V (or the one tensor), page bytes], a
                       staging slot's layout, so that a run is read (readv) straight into one
                       slot per block and written (writev) straight from them

Last use is not in the header (it changes on every hit): the dir backend keeps it as the file's
mtime, Redis as the key's expiry. decode() raises EntryError with a reason (one of REASONS):
truncated, version, corrupt, mismatch. A caller drops such an entry and counts it; its bytes
never reach a forward.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

MAGIC = b"DIKV"
# 2: the payload checksum is XXH3-128 (1 was blake2b-128, which at 2 MiB entries held every load
# and save for seconds of CPU per 32k-token prefix; docs/benchmarks/design-measurements.md#kv-store-checksum).
# 3: an entry holds a run of blocks (num_blocks in the header), keyed by the run's last block: one
# file, one existence check and one read per run instead of per block
# (docs/benchmarks/design-measurements.md#kv-store-entries-of-many-blocks). A version-2 entry is
# one block under that block's hash: refused by its version (or its size, at a look-up), never read.
# The checksum guards against corruption (bit flips, torn or truncated writes), not against a
# writer who means harm: no unkeyed hash would, anyone who can write the store can write a valid entry.
FORMAT_VERSION = 3
_FIXED = struct.Struct("<4sHHIQIQ16s16sd16s16s16s")
_CRC = struct.Struct("<I")
HEADER_SIZE = _FIXED.size + _CRC.size
REASONS = ("truncated", "version", "corrupt", "mismatch")
# Where traffic_class and created lie in the header (a store's report reads just those bytes).
_CLASS_CREATED = struct.Struct("<16sd")
CLASS_CREATED_START = struct.calcsize("<4sHHIQIQ16s")
CLASS_CREATED_END = CLASS_CREATED_START + _CLASS_CREATED.size
# magic and version sit at the same offsets in every version: an older entry is told by them.
_MAGIC_VERSION = struct.Struct("<4sH")

Buffer = bytes | bytearray | memoryview


class EntryError(ValueError):
    """An entry that must not be loaded; `reason` is one of REASONS."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True)
class EntryLayout:
    """What one block of one group's entries must look like (the reader's expectation)."""

    num_layers: int
    page_bytes: int
    dtype: str
    tensors: int = 2    # per layer: K and V, or 1 where they are one tensor (shared_kv)

    @property
    def payload_bytes(self) -> int:
        """One block's payload (a staging slot's used bytes)."""
        return self.num_layers * self.tensors * self.page_bytes

    def entry_bytes(self, num_blocks: int) -> int:
        """An entry of `num_blocks` blocks, header included: what a look-up expects its size to be."""
        return HEADER_SIZE + num_blocks * self.payload_bytes


@dataclass(frozen=True)
class EntryHeader:
    version: int
    num_layers: int
    page_bytes: int
    num_blocks: int
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


def _parts(payload: Buffer | Sequence[Buffer]) -> list[memoryview]:
    if isinstance(payload, (bytes, bytearray, memoryview)):
        return [memoryview(payload).cast("B")]
    return [memoryview(p).cast("B") for p in payload]


def checksum(payload: Buffer | Sequence[Buffer]) -> bytes:
    """XXH3-128 of the payload: one buffer, or the blocks' buffers in order (streamed: the same
    digest as of their concatenation, without making it)."""
    parts = _parts(payload)
    if len(parts) == 1:
        return xxhash.xxh3_128_digest(parts[0])
    h = xxhash.xxh3_128()
    for part in parts:
        h.update(part)
    return h.digest()


def header(group_key: bytes, block_hash: bytes, layout: EntryLayout, payload: Buffer | Sequence[Buffer],
           traffic_class: str, created: float) -> bytes:
    """The header of an entry whose payload is `payload` (one buffer, or one per block: each
    exactly layout.payload_bytes long); the entry is the header followed by those bytes."""
    parts = _parts(payload)
    total = sum(len(p) for p in parts)
    if total % layout.payload_bytes or not total:
        raise ValueError(f"payload of {total} bytes is not whole blocks of {layout.payload_bytes}")
    fixed = _FIXED.pack(MAGIC, FORMAT_VERSION, HEADER_SIZE, layout.num_layers, layout.page_bytes,
                        total // layout.payload_bytes, total, _pad(layout.dtype, "dtype"),
                        _pad(traffic_class, "traffic class"), created, group_key, block_hash, checksum(parts))
    return fixed + _CRC.pack(zlib.crc32(fixed))


def encode(group_key: bytes, block_hash: bytes, layout: EntryLayout, payload: Buffer | Sequence[Buffer],
           traffic_class: str, created: float) -> bytes:
    """Header + payload as one bytes object (small entries, tools, tests; the store's writer
    hands the header and the slots' buffers to the backend without joining them)."""
    return b"".join((header(group_key, block_hash, layout, payload, traffic_class, created), *_parts(payload)))


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


def unpack_checked_header(data: memoryview, magic: bytes, version: int, fixed: struct.Struct) -> tuple:
    """The fields of a header laid out as `fixed` (starting magic 4s, version H, header size H)
    and followed by its crc32, once its framing is checked: a header of `magic` in another
    version, too few bytes, another magic, another header size or a wrong crc raise EntryError.
    KV entries and encoder outputs (multimodal/encoder_entry.py) share this framing."""
    header_size = fixed.size + _CRC.size
    if len(data) >= _MAGIC_VERSION.size:
        # Another version's header may be shorter or laid out otherwise: its magic and version
        # say so before anything else is read.
        found_magic, found_version = _MAGIC_VERSION.unpack_from(data)
        if found_magic == magic and found_version != version:
            raise EntryError("version", f"format version {found_version}; this reader knows {version}")
    if len(data) < header_size:
        raise EntryError("truncated", f"{len(data)} bytes, shorter than the header ({header_size})")
    fields = fixed.unpack_from(data)
    if fields[0] != magic:
        raise EntryError("corrupt", f"magic {fields[0]!r}, not {magic!r}")
    if fields[2] != header_size:
        raise EntryError("version", f"header of {fields[2]} bytes; this reader knows {header_size}")
    (crc,) = _CRC.unpack_from(data, fixed.size)
    if crc != zlib.crc32(data[:fixed.size]):
        raise EntryError("corrupt", "header checksum")
    return fields


def decode_header(data: Buffer) -> EntryHeader:
    """The header alone (checks magic, version and its crc; not the payload)."""
    (_, version, _, num_layers, page_bytes, num_blocks, payload_bytes, dtype, traffic_class, created,
     group_key, block_hash, digest) = unpack_checked_header(memoryview(data), MAGIC, FORMAT_VERSION, _FIXED)
    return EntryHeader(version, num_layers, page_bytes, num_blocks, payload_bytes, dtype.rstrip(b"\0").decode(),
                       traffic_class.rstrip(b"\0").decode(), created, group_key, block_hash, digest)


def decode(data: Buffer, group_key: bytes, block_hash: bytes, layout: EntryLayout, num_blocks: int
           ) -> tuple[EntryHeader, memoryview]:
    """Check an entry completely and return its header and payload (a view into `data`)."""
    data = memoryview(data)
    head = check(data[:HEADER_SIZE], data[HEADER_SIZE:], len(data), group_key, block_hash, layout, num_blocks)
    return head, data[HEADER_SIZE:]


def check(head: Buffer, payload: Buffer | Sequence[Buffer], length: int, group_key: bytes,
          block_hash: bytes, layout: EntryLayout, num_blocks: int) -> EntryHeader:
    """Check an entry read in parts (a store read it straight into staging slots): `head`, its
    first min(length, HEADER_SIZE) bytes; `payload`, what followed them (one buffer, or one per
    block); `length`, the whole entry's size in bytes; `num_blocks`, the run the reader expects."""
    found = decode_header(head)
    if (found.group_key, found.block_hash) != (group_key, block_hash):
        raise EntryError("mismatch", "the entry's key is not the one asked for")
    if (found.num_layers, found.page_bytes, found.dtype) != (layout.num_layers, layout.page_bytes, layout.dtype):
        raise EntryError("mismatch", f"entry of {found.num_layers} layers x {found.page_bytes} bytes "
                                     f"{found.dtype}, expected {layout}")
    if found.num_blocks != num_blocks:
        raise EntryError("mismatch", f"a run of {found.num_blocks} blocks, expected {num_blocks}")
    if found.payload_bytes != num_blocks * layout.payload_bytes:
        raise EntryError("corrupt", f"payload size {found.payload_bytes} in the header, expected "
                                    f"{num_blocks * layout.payload_bytes}")
    if length != layout.entry_bytes(num_blocks):
        reason = "truncated" if length < layout.entry_bytes(num_blocks) else "corrupt"
        raise EntryError(reason, f"{length} bytes, expected {layout.entry_bytes(num_blocks)}")
    if checksum(payload) != found.checksum:
        raise EntryError("corrupt", "payload checksum")
    return found
