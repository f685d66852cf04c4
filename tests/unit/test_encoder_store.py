"""Encoder outputs as store entries (E/P/D, multimodal/encoder_entry.py and encoder_store.py), on a
real dir:// store and a real redis-server: a round trip gives the same tensor; a damaged entry,
one of another model or shape, or a truncated one is refused (never loaded), counted by reason
and dropped; an absent one is a counted miss; a store that is down is a miss, not an error."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kv_cache.store.entry import EntryError
from deepinfer.kv_cache.store.locations import open_store
from deepinfer.multimodal import encoder_entry
from deepinfer.multimodal.encoder_store import EncoderStore
from tests.redis_server import redis_server  # noqa: F401  (a fixture)

RETENTION = {"chat": 3600.0}
TOKENS, HIDDEN = 4, 8
IMAGE = "0123456789abcdef" * 2


def _store(url: str, model: str = "tiny", dtype=torch.bfloat16, tokens=TOKENS) -> EncoderStore:
    key = encoder_entry.encoder_group_key(model, None, dtype, tokens, HIDDEN, "processor-settings")
    return EncoderStore(open_store(url, RETENTION), key, tokens, HIDDEN, dtype)


@pytest.fixture(params=["dir", "redis"])
def store_url(request, tmp_path):
    if request.param == "dir":
        return f"dir://{tmp_path / 'store'}"
    return request.getfixturevalue("redis_server").url


def test_round_trip_and_misses(store_url):
    writer, reader = _store(store_url), _store(store_url)
    embeds = torch.randn(TOKENS, HIDDEN).to(torch.bfloat16)
    assert reader.load(IMAGE) is None and reader.misses == 1
    assert writer.save(IMAGE, embeds) and writer.has(IMAGE)
    loaded = reader.load(IMAGE)
    assert loaded is not None and loaded.dtype == torch.bfloat16 and torch.equal(loaded, embeds)
    assert reader.counters() == {"store_loaded": 1, "store_misses": 1, "store_written": 0, "store_errors": 0}


def test_another_model_or_shape_never_reads_it(store_url):
    _store(store_url).save(IMAGE, torch.ones(TOKENS, HIDDEN, dtype=torch.bfloat16))
    # Another model's (or dtype's) key names another entry: a plain miss.
    for other in (_store(store_url, model="other"), _store(store_url, dtype=torch.float32)):
        assert other.load(IMAGE) is None and other.misses == 1 and not other.invalid


def test_damaged_entries_are_refused_counted_and_dropped(store_url):
    store = _store(store_url)
    key = store.key(IMAGE)
    good = encoder_entry.encode(key, torch.randn(TOKENS, HIDDEN).to(torch.bfloat16))
    flipped = bytearray(good)
    flipped[-1] ^= 0xFF   # payload
    header = bytearray(good)
    header[10] ^= 0x01    # a header byte: its crc
    foreign_key = encoder_entry.encode((b"\x01" * 16, key[1]), torch.randn(TOKENS, HIDDEN).to(torch.bfloat16))
    for data, reason in ((bytes(flipped), "corrupt"), (bytes(header), "corrupt"), (foreign_key, "mismatch"),
                         (good[:-3], "size")):
        store.backend.put([(key, data, "chat")])
        assert store.load(IMAGE) is None
        assert store.invalid.get(reason), (reason, store.invalid)
        assert store.backend.get([key]) == [None]   # dropped: the next look-up is a plain miss
    assert store.loaded == 0


def test_decode_checks_shape_dtype_and_version():
    key = encoder_entry.image_key(b"\x02" * 16, IMAGE)
    embeds = torch.randn(TOKENS, HIDDEN)
    data = encoder_entry.encode(key, embeds)
    assert torch.equal(encoder_entry.decode(data, key, TOKENS, HIDDEN, torch.float32), embeds)
    with pytest.raises(EntryError) as info:
        encoder_entry.decode(data, key, TOKENS, HIDDEN, torch.bfloat16)
    assert info.value.reason == "mismatch"
    with pytest.raises(EntryError) as info:
        encoder_entry.decode(data, key, TOKENS + 1, HIDDEN, torch.float32)
    assert info.value.reason == "mismatch"
    newer = bytearray(data)
    newer[4] = 9   # the version field
    with pytest.raises(EntryError) as info:
        encoder_entry.decode(bytes(newer), key, TOKENS, HIDDEN, torch.float32)
    assert info.value.reason == "version"
    with pytest.raises(EntryError) as info:
        encoder_entry.decode(data[:20], key, TOKENS, HIDDEN, torch.float32)
    assert info.value.reason == "truncated"


def test_a_store_that_is_down_is_a_miss(tmp_path):
    from tests.redis_server import _free_port

    store = _store(f"redis://127.0.0.1:{_free_port()}/0")
    assert store.load(IMAGE) is None and store.misses == 1
    assert not store.save(IMAGE, torch.zeros(TOKENS, HIDDEN, dtype=torch.bfloat16))
    assert store.counters()["store_errors"] >= 1
