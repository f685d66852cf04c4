"""KV events over a real ZMQ socket (kv_cache/events.py): a subscriber sees BlockStored for the
blocks a request published (their hashes, parent, tokens), BlockRemoved when the pool evicts them,
AllBlocksCleared on a reset; the store tier's writes and evictions under medium DISK; the replay
socket hands back what a late subscriber missed; the payload decodes with vLLM's older 6-field
structs; bad endpoints are refused naming the field."""

from __future__ import annotations

import socket
import time
from typing import Any

import msgspec
import pytest
import zmq

from deepinfer import LLM, SamplingParams
from deepinfer.config import CacheConfig
from deepinfer.kv_cache.events import END_SEQ, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

BS = 16
PREFIX = [(5 * i + 3) % 500 + 2 for i in range(100)]            # 6 full blocks and 4 tokens
ONE = SamplingParams(temperature=0, max_tokens=1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Subscriber:
    def __init__(self, port: int, topic: bytes = b"") -> None:
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic)
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self.events: list[Any] = []
        self.seqs: list[int] = []
        time.sleep(0.5)   # ZMQ's slow joiner: the subscription reaches the publisher first

    def until(self, predicate, timeout_s: float = 10.0) -> list:
        deadline = time.monotonic() + timeout_s
        while not predicate(self.events):
            if time.monotonic() > deadline:
                raise AssertionError(f"no matching KV event within {timeout_s} s; got {self.events}")
            if self.sock.poll(100):
                topic, seq, payload = self.sock.recv_multipart()
                self.seqs.append(int.from_bytes(seq, "big"))
                self.events.extend(self.decoder.decode(payload).events)
        return self.events

    def close(self) -> None:
        self.sock.close()


def ints(hashes: list[bytes]) -> list[int]:
    return [int.from_bytes(h[:8], "big") for h in hashes]


def request_hashes(llm: LLM, tokens: list[int]) -> list[bytes]:
    from deepinfer.types.block_hashes import extend_block_hashes, extra_key

    out: list[bytes] = []
    extend_block_hashes(out, tokens, BS, extra_key(llm.model_id, None), llm.engine.kv_manager.hash_root)
    return out


def test_device_blocks_stored_removed_and_cleared(tiny_llama):
    port = free_port()
    llm = LLM(tiny_llama, dtype="float32", max_model_len=256, num_kv_blocks=24, kv_events_endpoint=f"tcp://*:{port}",
              kv_events_topic="kv")
    sub = Subscriber(port, b"kv")
    llm.generate([PREFIX], ONE, use_tqdm=False)
    expected = ints(request_hashes(llm, PREFIX))
    stored = [e for e in sub.until(lambda es: any(isinstance(e, BlockStored) for e in es))
              if isinstance(e, BlockStored)]
    assert len(stored) == 1
    event = stored[0]
    assert event.block_hashes == expected and event.parent_block_hash is None
    assert event.token_ids == PREFIX[:96] and event.block_size == BS and event.medium == "GPU"
    assert event.group_idx == 0 and event.kv_cache_spec_kind == "full"
    # Other prompts fill the pool of 23 blocks: the first request's cached blocks are evicted.
    for k in range(3):
        llm.generate([[7 + k] * 200], ONE, use_tqdm=False)
    removed = sub.until(lambda es: set(expected) <= {h for e in es if isinstance(e, BlockRemoved)
                                                     for h in e.block_hashes})
    assert all(e.medium == "GPU" for e in removed if isinstance(e, BlockRemoved))
    assert llm.engine.kv_manager.reset_prefix_cache()
    sub.until(lambda es: isinstance(es[-1], AllBlocksCleared))
    assert sub.seqs == list(range(len(sub.seqs)))   # one batch per step, numbered from 0
    # A follow-up continues the chain: its parent is the last block already announced.
    llm.generate([PREFIX + list(range(2, 30))], ONE, use_tqdm=False)
    follow = sub.until(lambda es: isinstance(es[-1], BlockStored) and len(es[-1].block_hashes) == 8)[-1]
    assert follow.parent_block_hash is None and follow.block_hashes[:6] == expected   # cleared: all anew
    sub.close()
    llm.engine.shutdown()


def test_store_writes_and_evictions_and_replay(tiny_llama, tmp_path):
    port, replay_port = free_port(), free_port()
    block_bytes = 16 * 1024   # one block of the tiny model (4 layers x K/V x 16 x 2 x 32 x 4 bytes)
    # Room for 14 blocks: the prefix's run of 6 blocks, then a run of 12 that pushes it out.
    llm = LLM(tiny_llama, dtype="float32", max_model_len=256, num_kv_blocks=64, kv_store=f"dir://{tmp_path}",
              kv_store_size=14 * block_bytes / 2**30, kv_events_endpoint=f"tcp://*:{port}",
              kv_events_replay_endpoint=f"tcp://*:{replay_port}")
    writer = llm.engine.executor.runner.kv_connector
    llm.generate([PREFIX], ONE, use_tqdm=False)
    assert writer.flush(10)
    expected = ints(request_hashes(llm, PREFIX))
    llm.generate([[9] * 200], ONE, use_tqdm=False)   # 12 more blocks: past kv_store_size, the oldest run goes
    assert writer.flush(10)
    time.sleep(0.3)   # the idle flush publishes what the writer thread reported

    # A subscriber that came late asks the replay socket for everything from sequence 0.
    # A DEALER socket (it takes the whole stream of replies; REQ's envelope, written out).
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://127.0.0.1:{replay_port}")
    dealer.send_multipart((b"", (0).to_bytes(8, "big")))
    decoder, events, seqs = msgspec.msgpack.Decoder(KVEventBatch), [], []
    while True:
        assert dealer.poll(5000), "the replay socket did not answer"
        empty, seq, payload = dealer.recv_multipart()
        if seq == END_SEQ:
            assert empty == payload == b""
            break
        seqs.append(int.from_bytes(seq, "big"))
        events.extend(decoder.decode(payload).events)
    dealer.close()
    assert seqs == list(range(len(seqs)))
    disk_stored = [h for e in events if isinstance(e, BlockStored) and e.medium == "DISK" for h in e.block_hashes]
    disk_removed = [h for e in events if isinstance(e, BlockRemoved) and e.medium == "DISK" for h in e.block_hashes]
    # Every block of a run written is reported; a run removed is named by its last block.
    assert set(expected) <= set(disk_stored) and len(disk_stored) == 18
    assert disk_removed == expected[-1:]
    assert writer.backend.counts().entries == 1
    llm.engine.shutdown()


def test_the_payload_reads_with_vllms_older_structs():
    class OldBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[Any]

    class OldEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
        pass

    class BlockStored(OldEvent):   # noqa: F811  (vLLM 0.9's fields, tagged by class name)
        block_hashes: list[int]
        parent_block_hash: int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None

    class BlockRemoved(OldEvent):   # noqa: F811
        block_hashes: list[int]
        medium: str | None

    class OldKVEventBatch(OldBatch):
        events: list[BlockStored | BlockRemoved]

    from deepinfer.kv_cache import events as ours

    batch = ours.KVEventBatch(1.5, [ours.BlockStored([1, 2], None, [5] * 32, 16, None, "GPU", None, None, 0, "full"),
                                    ours.BlockRemoved([1], "GPU", 0)], 0)
    old = msgspec.msgpack.decode(msgspec.msgpack.encode(batch), type=OldKVEventBatch)
    assert old.ts == 1.5 and old.events[0].block_hashes == [1, 2] and old.events[0].medium == "GPU"
    assert old.events[1].block_hashes == [1]


def test_bad_endpoints_are_refused_naming_the_field(tiny_llama):
    for bad in ("http://x:1", "tcp://", "5557"):
        with pytest.raises(ValueError, match="kv_events_endpoint must be a ZMQ endpoint"):
            CacheConfig(kv_events_endpoint=bad)
    with pytest.raises(ValueError, match="kv_events_replay_endpoint needs kv_events_endpoint"):
        CacheConfig(kv_events_replay_endpoint="tcp://*:1")
    port = free_port()
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", port))
        taken.listen()
        with pytest.raises(ValueError, match=f"kv_events_endpoint: cannot open tcp://\\*:{port}"):
            LLM(tiny_llama, dtype="float32", max_model_len=256, num_kv_blocks=24, kv_events_endpoint=f"tcp://*:{port}")
