"""The traffic class of a request (types/traffic_class.py) and the store retention it picks: the
resolution rules, LLM.generate/chat writing entries under the request's class, a class kv_retention
does not name refused before anything is queued, and retention counting from the last use under
the class of the request that last used the entry (a load, a save of a block the store had, a hit
on the device), in a directory (injected clock) and in a real Redis (its expiry)."""

from __future__ import annotations

import os

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.engine.admission import EngineFacts, child_requests
from deepinfer.kv_cache.store import entry as entry_format
from deepinfer.kv_cache.store.dir import DirStore
from deepinfer.types import traffic_class as traffic
from tests.redis_server import redis_server  # noqa: F401  (a fixture)
from tests.unit.test_kv_host_tier import BS, chain, full, random_caches
from tests.unit.test_kv_store import DAY, RETENTION, Clock, connector, load_all, settle

PREFIX = [(5 * i + 3) % 500 + 2 for i in range(100)]            # 6 full blocks and 4 tokens
ONE = SamplingParams(temperature=0, max_tokens=1)


def test_the_class_is_the_requests_or_the_default():
    classes = ("chat", "agent")
    assert traffic.resolve(None, classes) == "chat"
    assert traffic.resolve(None, classes, offers_tools=True) == "agent"
    assert traffic.resolve(None, ("chat", "batch"), offers_tools=True) == "chat"   # no agent class
    assert traffic.resolve("agent", classes) == "agent"
    for bad in ("batch", "", 3, "Chat"):
        with pytest.raises(ValueError, match=r"traffic_class must be one of chat, agent .*kv_retention"):
            traffic.resolve(bad, classes)
    facts = EngineFacts("m", 64, frozenset({2}), ("chat", "agent", "batch"))
    (message,) = child_requests("r", [1, 2, 3], SamplingParams(), facts, traffic_class="batch")
    assert message.traffic_class == "batch"
    (message,) = child_requests("r", [1, 2, 3], SamplingParams(), facts)
    assert message.traffic_class == "chat"
    with pytest.raises(ValueError, match="traffic_class"):
        child_requests("r", [1, 2, 3], SamplingParams(), facts, traffic_class="bulk")


def _classes_written(root: str) -> tuple[set[str], set[str]]:
    """(header classes of every entry, classes of the index buckets) under a dir store."""
    headers = set()
    for d, _, files in os.walk(os.path.join(root, "blocks")):
        for f in files:
            if f.endswith(".kv"):
                with open(os.path.join(d, f), "rb") as fh:
                    headers.add(entry_format.decode_header(fh.read()).traffic_class)
    return headers, {name.split(".")[1] for name in os.listdir(os.path.join(root, "index"))}


def _flush(llm: LLM) -> None:
    assert llm.engine.executor.runner.kv_connector.flush(10)


def test_generate_and_chat_write_under_the_requests_class(tiny_llama, tmp_path):
    llm = LLM(tiny_llama, dtype="float32", max_model_len=256, num_kv_blocks=64, kv_store=f"dir://{tmp_path / 'a'}",
              kv_retention="chat=7d,agent=3d,batch=1h")
    llm.generate([PREFIX], ONE, use_tqdm=False, traffic_class="batch")
    _flush(llm)
    assert _classes_written(str(tmp_path / "a")) == ({"batch"}, {"batch"})
    # A class kv_retention does not name: refused before anything is queued, the engine untouched.
    with pytest.raises(ValueError, match=r"traffic_class must be one of chat, agent, batch"):
        llm.generate([PREFIX + [7]], ONE, use_tqdm=False, traffic_class="bulk")
    assert not llm.engine.has_unfinished() and llm.engine.kv_manager.blocks_in_use() == {}
    llm.engine.shutdown()

    # chat(): "agent" when tools are offered, else "chat".
    template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    words = " ".join(f"w{i}" for i in range(60))
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for name, kwargs, expected in (("b", {}, "chat"), ("c", {"tools": tools}, "agent")):
        llm = LLM(tiny_llama, dtype="float32", max_model_len=256, num_kv_blocks=64,
                  kv_store=f"dir://{tmp_path / name}")
        llm.chat([{"role": "user", "content": words}], ONE, use_tqdm=False, chat_template=template, **kwargs)
        _flush(llm)
        assert _classes_written(str(tmp_path / name)) == ({expected}, {expected})
        llm.engine.shutdown()


def test_redis_retention_follows_the_class_of_the_last_use(tiny_llama, redis_server):  # noqa: F811
    import redis

    client = redis.Redis.from_url(redis_server.url)

    def ttls_days() -> set[int]:
        return {round(client.pttl(k) / 1000 / DAY) for k in client.scan_iter("deepinfer:kv:*")}

    def make() -> LLM:
        return LLM(tiny_llama, dtype="float32", max_model_len=256, num_kv_blocks=64, kv_store=redis_server.url)

    a = make()
    a.generate([PREFIX], ONE, use_tqdm=False, traffic_class="agent")
    _flush(a)
    assert ttls_days() == {3}
    a.engine.shutdown()
    b = make()   # loads the prefix as a chat request: the hit restarts it under chat
    out = b.generate([PREFIX + [9, 10]], ONE, use_tqdm=False)[0]
    assert out.num_cached_tokens >= 80 and b.engine.stats().kv_tier["loaded_blocks"] == 6
    assert ttls_days() == {7}
    # The same prefix again, by an agent request: a hit on the device, which is a use too.
    out = b.generate([PREFIX + [11]], ONE, use_tqdm=False, traffic_class="agent")[0]
    assert out.num_cached_tokens >= 80 and b.engine.stats().kv_tier["loaded_blocks"] == 6
    assert ttls_days() == {3}
    b.engine.shutdown()


def test_dir_retention_follows_the_class_of_the_last_use(tmp_path):
    groups = [full(0, (0,))]
    clock = Clock()
    store = DirStore(str(tmp_path), RETENTION, clock=clock)
    caches = random_caches(1, torch.bfloat16)
    hashes = chain(2)

    def alive() -> list[bool]:
        return [os.path.exists(store.path((sched._layouts[0][0], h))) for h in hashes]

    sched, worker = connector(store, groups)
    worker.register_kv_caches(caches, groups, BS)
    sched.save_blocks("w", 0, hashes[:1], [1], traffic_class="agent")   # block 0: written as agent
    sched.save_blocks("w", 0, hashes[1:], [2])                         # block 1: written as chat
    settle(sched, worker)
    worker.close()

    clock.t += 1 * DAY
    sched, worker = connector(store, groups)   # another instance: knows nothing of what the store has
    worker.register_kv_caches(caches, groups, BS)
    n, done = load_all(sched, worker, groups, hashes[:1], [3])   # block 0 read by a chat request
    assert n == 1 and done.loaded == ["reader"]
    # Block 1 computed again by an agent request: the store has it, so this save is a use.
    sched.save_blocks("again", 0, hashes[1:], [4], traffic_class="agent")
    settle(sched, worker)
    assert worker.stats().skipped_blocks == 1
    worker.close()

    clock.t += 3 * DAY + 3600        # day 4 + 1 h: agent's 3 d since the last use have passed
    assert store.gc() == 1 and alive() == [True, False]
    clock.t += 4 * DAY               # day 8 + 1 h: chat's 7 d too
    assert store.gc() == 1 and alive() == [False, False]
