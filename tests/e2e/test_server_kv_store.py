"""The real server with a persistent KV store (`--kv-store dir://...`) and KV events: the request
field `traffic_class` through extra_body on every route and the X-Traffic-Class header (the body
wins; tools make "agent" the default; an unknown class is a 400 naming the field and the classes),
the store's entries written under each request's class, the kv_tier_* series on /metrics, and a
ZMQ subscriber seeing the blocks stored on the device and in the store.

The model is the tiny random Llama (tests/models/tiny_models.py: words w0..w511) with a plain
chat template, so the server starts and answers in seconds; what is checked is the plumbing."""

from __future__ import annotations

import os
import re
import time

import anthropic
import httpx
import msgspec
import openai
import pytest
import zmq

from deepinfer.kv_cache.events import BlockStored, KVEventBatch
from tests.e2e.server_process import free_port, start_server, stop_server

MODEL = "tiny"
TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
CLASSES = "chat=7d,agent=3d,batch=1h,cmpl=1h,resp=1h,msgs=1h,hdr=1h"
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_llama):
    root = tmp_path_factory.mktemp("kv")
    port = free_port()
    srv = start_server(str(root / "server.log"), "--model", tiny_llama, "--served-model-name", MODEL,
                       "--chat-template", TEMPLATE, "--max-model-len", "256", "--dtype", "float32",
                       "--kv-store", f"dir://{root / 'store'}", "--kv-retention", CLASSES,
                       "--kv-events-endpoint", f"tcp://*:{port}")
    srv.store = str(root / "store")
    srv.events_port = port
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def events(server):
    """A SUB socket on the server's KV events, connected before the first request of the module."""
    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(f"tcp://127.0.0.1:{server.events_port}")
    time.sleep(0.5)   # the subscription reaches the publisher before anything is published
    yield sock
    sock.close()


_STARTS: dict[str, int] = {}


def text(n: int, word: str) -> str:
    """n words of the tiny vocabulary that no other request's prompt starts with (one start per
    `word`): full blocks of their own."""
    start = _STARTS.setdefault(word, 37 * len(_STARTS))
    return " ".join(f"w{(start + 5 * i) % 500 + 2}" for i in range(n))


def index_classes(server) -> set[str]:
    return {name.split(".")[1] for name in os.listdir(os.path.join(server.store, "index"))}


def index_lines(server) -> dict[str, int]:
    """Entries listed per class in the store's index."""
    out: dict[str, int] = {}
    directory = os.path.join(server.store, "index")
    for name in os.listdir(directory):
        with open(os.path.join(directory, name)) as f:
            out[name.split(".")[1]] = out.get(name.split(".")[1], 0) + sum(1 for line in f if line.strip())
    return out


def wait_for_class(server, traffic_class: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while traffic_class not in index_classes(server):
        assert time.monotonic() < deadline, f"no store entry of class {traffic_class!r}: {index_classes(server)}"
        time.sleep(0.1)


def test_traffic_class_on_every_route(server, oai, claude, events):
    assert index_classes(server) == set()
    oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text(60, "batch")}],
                                max_tokens=1, extra_body={"traffic_class": "batch", **GREEDY})
    wait_for_class(server, "batch")
    oai.completions.create(model=MODEL, prompt=text(60, "cmpl"), max_tokens=1, extra_body={"traffic_class": "cmpl"})
    wait_for_class(server, "cmpl")
    oai.responses.create(model=MODEL, input=text(60, "resp"), max_output_tokens=1, extra_body={"traffic_class": "resp"})
    wait_for_class(server, "resp")
    claude.messages.create(model=MODEL, max_tokens=1, messages=[{"role": "user", "content": text(60, "msgs")}],
                           extra_body={"traffic_class": "msgs"})
    wait_for_class(server, "msgs")
    # The header, and the body winning over it.
    oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text(60, "hdr")}], max_tokens=1,
                                extra_headers={"X-Traffic-Class": "hdr"})
    wait_for_class(server, "hdr")
    httpx.post(f"{server.base_url}/v1/completions", headers={**server.headers, "X-Traffic-Class": "nonsense"},
               json={"model": MODEL, "prompt": text(60, "wins"), "max_tokens": 1, "traffic_class": "agent"},
               timeout=60).raise_for_status()
    wait_for_class(server, "agent")
    # Tools offered, no class named: agent (its own prompt, so its blocks are new entries).
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    before = index_lines(server)
    oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text(60, "tool")}], tools=tools,
                                max_tokens=1)
    deadline = time.monotonic() + 20
    while index_lines(server).get("agent") == before.get("agent"):
        assert time.monotonic() < deadline, "the request with tools wrote no agent entry"
        time.sleep(0.1)
    assert index_lines(server).get("chat") == before.get("chat")
    assert index_classes(server) == {"agent", "batch", "cmpl", "resp", "msgs", "hdr"}


def test_an_unknown_class_is_a_400_naming_the_field(server, oai, claude):
    allowed = "chat, agent, batch, cmpl, resp, msgs, hdr"
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                    extra_body={"traffic_class": "bulk"})
    assert f"traffic_class must be one of {allowed}" in err.value.message and err.value.body["param"] == "traffic_class"
    with pytest.raises(openai.BadRequestError, match="the X-Traffic-Class header must be one of"):
        oai.completions.create(model=MODEL, prompt="hi", max_tokens=1, extra_headers={"X-Traffic-Class": "bulk"})
    with pytest.raises(openai.BadRequestError, match="traffic_class must be one of"):
        oai.responses.create(model=MODEL, input="hi", max_output_tokens=1, extra_body={"traffic_class": ""})
    with pytest.raises(openai.BadRequestError, match="traffic_class: Input should be a valid string"):
        oai.responses.create(model=MODEL, input="hi", max_output_tokens=1, extra_body={"traffic_class": 7})
    with pytest.raises(anthropic.BadRequestError, match="traffic_class must be one of"):
        claude.messages.create(model=MODEL, max_tokens=1, messages=[{"role": "user", "content": "hi"}],
                               extra_body={"traffic_class": "bulk"})
    # Nothing was queued: the server serves on.
    assert oai.completions.create(model=MODEL, prompt="hi", max_tokens=1).choices


def metrics(server) -> str:
    return httpx.get(f"{server.base_url}/metrics", timeout=30).text


def sample(text_: str, name: str, **labels) -> float:
    for line in text_.splitlines():
        match = re.match(rf"^deepinfer:{name}{{([^}}]*)}} (\S+)$", line)
        if match and all(f'{k}="{v}"' in match.group(1) for k, v in labels.items()):
            return float(match.group(2))
    raise AssertionError(f"deepinfer:{name}{labels} not on /metrics")


def test_metrics_show_the_store_tier(server, oai):
    oai.completions.create(model=MODEL, prompt=text(60, "metrics"), max_tokens=1)
    deadline = time.monotonic() + 20
    while sample(metrics(server), "kv_tier_entries", tier="store") == 0:
        assert time.monotonic() < deadline, "kv_tier_entries stayed 0"
        time.sleep(0.2)
    body = metrics(server)
    assert sample(body, "kv_tier_bytes", tier="store") > 0
    assert sample(body, "kv_tier_writes_total", tier="store") > 0
    assert sample(body, "kv_tier_misses_total", tier="store") > 0
    assert sample(body, "kv_tier_hits_total", tier="store") >= 0
    for cause in ("lru", "retention"):
        assert sample(body, "kv_tier_evictions_total", tier="store", cause=cause) == 0
    assert sample(body, "kv_tier_corrupt_entries_total", tier="store", reason="corrupt") == 0
    assert sample(body, "kv_tier_store_latency_seconds_count", tier="store") > 0
    assert sample(body, "kv_tier_store_latency_seconds_bucket", tier="store", le="+Inf") > 0
    assert sample(body, "kv_tier_load_latency_seconds_count", tier="store") >= 0
    assert "# TYPE deepinfer:kv_tier_load_latency_seconds histogram" in body


def test_kv_events_from_the_server(server, oai, events):
    oai.completions.create(model=MODEL, prompt=text(60, "events"), max_tokens=1)
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    media: set[str] = set()
    deadline = time.monotonic() + 20
    while not {"GPU", "DISK"} <= media:
        assert time.monotonic() < deadline, f"KV events seen: {media}"
        if events.poll(100):
            _, _, payload = events.recv_multipart()
            media |= {e.medium for e in decoder.decode(payload).events if isinstance(e, BlockStored)}
