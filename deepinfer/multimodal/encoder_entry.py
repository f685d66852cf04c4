"""One image's encoder output as a persistent store entry (E/P/D: an encode instance writes it, a
prefill, decode or colocated instance reads it instead of running the vision tower).

Sibling of kv_cache/store/entry.py's KV entry, with the same integrity checks: a header with
magic, version and a crc32 of itself, the payload's XXH3-128, the key repeated and compared, the
dtype and shape compared with what the reader expects. Its fixed part has the KV header's byte
layout (the same struct), so a store's reports read the traffic class and write time of either
kind at the same offsets (entry.CLASS_CREATED_START); the magic tells them apart:

    header (HEADER_SIZE bytes, little-endian)
      magic            4s   b"DIEN"
      version          H    FORMAT_VERSION; any other is refused
      header_size      H    HEADER_SIZE
      tokens           I    embeddings of the image (mm_tokens_per_image)
      hidden           Q    values per embedding (the language model's hidden size)
      ndim             I    2 (the payload is one [tokens, hidden] tensor)
      payload_bytes    Q    tokens * hidden * the dtype's size
      dtype            16s  torch dtype name, e.g. "bfloat16"
      traffic_class    16s  the retention class it was written under
      created          d    unix seconds at write
      group_key        16s  the model's encoder key (encoder_group_key), repeated
      image_hash       16s  the image's hash (image_processor.image_hash, as bytes), repeated
      payload_xxh3     16s  XXH3-128 of the payload
      header_crc       I    crc32 of every header byte before it
    payload            the tensor's bytes, row-major

The key (a TierKey, as KV entries have): (encoder_group_key(...), the image hash's 16 bytes). The
group key hashes the model's identity (name and revision: what roots KV block hashes), the output
dtype and shape and the image processor's settings, so an entry written for another model,
another revision, another dtype or other preprocessing has another name, and were one found under
this name anyway (a collision, a foreign writer), its repeated key or its shape refuses it.
"""

from __future__ import annotations

import struct
import zlib

import torch
import xxhash

from deepinfer.kv_cache.store.entry import EntryError, checksum, unpack_checked_header

MAGIC = b"DIEN"
FORMAT_VERSION = 1
# The KV entry's struct (kv_cache/store/entry.py), field for field: see the module docstring.
_FIXED = struct.Struct("<4sHHIQIQ16s16sd16s16s16s")
_CRC = struct.Struct("<I")
HEADER_SIZE = _FIXED.size + _CRC.size

DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.float16, torch.bfloat16)}
TRAFFIC_CLASS = "encoder"


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"encoder outputs are stored in {', '.join(DTYPES)}, not {name}")
    return name


def encoder_group_key(model: str, revision: str | None, dtype: torch.dtype, tokens: int, hidden: int,
                      processor_fingerprint: str) -> bytes:
    """The group half of every encoder entry's key for one model and processor (16 bytes)."""
    text = (f"deepinfer-encoder-output|v{FORMAT_VERSION}|model={model}|revision={revision or ''}|"
            f"dtype={dtype_name(dtype)}|shape={tokens}x{hidden}|processor={processor_fingerprint}")
    return xxhash.xxh3_128_digest(text.encode())


def image_key(group_key: bytes, image_hash: str) -> tuple[bytes, bytes]:
    """The TierKey of one image's entry."""
    raw = bytes.fromhex(image_hash)
    if len(raw) != 16:
        raise ValueError(f"image hash {image_hash!r} is not 128 bits of hex")
    return group_key, raw


def entry_bytes(tokens: int, hidden: int, dtype: torch.dtype) -> int:
    """An entry's whole size: what a look-up expects."""
    return HEADER_SIZE + tokens * hidden * torch.empty(0, dtype=dtype).element_size()


def _payload(embeds: torch.Tensor) -> memoryview:
    flat = embeds.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def encode(key: tuple[bytes, bytes], embeds: torch.Tensor, traffic_class: str = TRAFFIC_CLASS,
           created: float = 0.0) -> bytes:
    """Header + payload of one image's embeddings ([tokens, hidden])."""
    if embeds.dim() != 2:
        raise ValueError(f"an image's encoder output is [tokens, hidden], got {tuple(embeds.shape)}")
    payload = _payload(embeds)
    tokens, hidden = embeds.shape
    fixed = _FIXED.pack(MAGIC, FORMAT_VERSION, HEADER_SIZE, tokens, hidden, 2, len(payload),
                        dtype_name(embeds.dtype).encode(), traffic_class.encode()[:16], created, key[0], key[1],
                        checksum(payload))
    return fixed + _CRC.pack(zlib.crc32(fixed)) + bytes(payload)


def decode(data: bytes | bytearray | memoryview, key: tuple[bytes, bytes], tokens: int, hidden: int,
           dtype: torch.dtype) -> torch.Tensor:
    """The embeddings [tokens, hidden] of an entry, after every check (EntryError with one of
    entry.REASONS: truncated, version, corrupt, mismatch). A new tensor: `data` may be freed."""
    data = memoryview(data).cast("B")
    (_, _, _, found_tokens, found_hidden, ndim, payload_bytes, found_dtype, _, _, group_key, image_hash,
     digest) = unpack_checked_header(data, MAGIC, FORMAT_VERSION, _FIXED)
    if (group_key, image_hash) != key:
        raise EntryError("mismatch", "the entry's key is not the one asked for")
    want_dtype = dtype_name(dtype)
    found_name = found_dtype.rstrip(b"\0").decode(errors="replace")
    if (ndim, found_tokens, found_hidden, found_name) != (2, tokens, hidden, want_dtype):
        raise EntryError("mismatch", f"an encoder output of {found_tokens}x{found_hidden} {found_name}, expected "
                                     f"{tokens}x{hidden} {want_dtype}")
    expected = entry_bytes(tokens, hidden, dtype)
    if payload_bytes != expected - HEADER_SIZE:
        raise EntryError("corrupt", f"payload size {payload_bytes} in the header, expected {expected - HEADER_SIZE}")
    if len(data) != expected:
        raise EntryError("truncated" if len(data) < expected else "corrupt", f"{len(data)} bytes, expected {expected}")
    payload = data[HEADER_SIZE:]
    if checksum(payload) != digest:
        raise EntryError("corrupt", "payload checksum")
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(dtype).reshape(tokens, hidden)
