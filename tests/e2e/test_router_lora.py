"""cache_aware routing of LoRA requests over real replica processes on loopback: two replicas of the
tiny Llama, each serving adapters "a" and "b" (--enable-lora --lora-modules) and publishing KV events,
behind a cache_aware router.

The engine keys an adapter's blocks by its name and id, so the same prompt under the base model,
"a" or "b" shares no block. The router must agree: what it expected cached on the replica it chose
(deepinfer_router_expected_cached_tokens_total) equals what that replica then reports cached for
the request, so there is no false hit (an adapter's request sent after the base model's blocks) and
no missed one (a follow-up under the same adapter goes where its blocks are). The replicas number
the adapters in opposite orders, so an adapter's id, and its hashes, differ between them.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

pytest.importorskip("peft")

from tests.e2e.server_process import API_KEY, free_port, start_server, stop_server  # noqa: E402
from tests.e2e.test_router import LONG, Router, _replica_args  # noqa: E402
from tests.models.tiny_models import write_peft_adapter  # noqa: E402

GREEDY = {"temperature": 0, "max_tokens": 4}


@pytest.fixture(scope="module")
def replicas(tmp_path_factory, tiny_llama):
    root = tmp_path_factory.mktemp("router-lora")
    paths = {}
    for seed, name in enumerate(("a", "b"), start=1):
        paths[name] = str(root / name)
        write_peft_adapter(tiny_llama, paths[name], seed=seed)
    servers = []
    for i, order in enumerate((("a", "b"), ("b", "a"))):   # replica 0: a=1, b=2; replica 1: b=1, a=2
        port = free_port()
        lora = ("--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
                "--lora-modules", *[f"{name}={paths[name]}" for name in order])
        server = start_server(str(root / f"replica{i}.log"), *_replica_args(tiny_llama, port), *lora)
        server.events_port = port
        servers.append(server)
    yield servers
    for s in servers:
        stop_server(s)


@pytest.fixture(scope="module")
def router(tmp_path_factory, replicas):
    events = [f"tcp://127.0.0.1:{s.events_port}" for s in replicas]
    made = Router(str(tmp_path_factory.mktemp("router-lora-log") / "router.log"), replicas,
                  "--policy", "cache_aware", "--kv-events", *events)
    yield made
    made.stop()


def _expected_cached(router: Router) -> float:
    total = 0.0
    for line in httpx.get(router.url + "/metrics", timeout=5).text.splitlines():
        if line.startswith("deepinfer_router_expected_cached_tokens_total{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _indexed(router: Router) -> int:
    return sum(r["kv_blocks_indexed"] for r in router.replicas())


def _send(router: Router, model: str, prompt: str) -> tuple[str, int, float]:
    """(the replica that answered, the prompt tokens it found cached, the tokens the router
    expected cached there); waits until the replica's KV events of the request reached the router."""
    before_expected, before_indexed = _expected_cached(router), _indexed(router)
    response = httpx.post(router.url + "/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                          json={"model": model, "prompt": prompt, **GREEDY}, timeout=60)
    assert response.status_code == 200, response.text
    body = json.loads(response.text)
    cached = (body["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _indexed(router) == before_indexed:
        time.sleep(0.1)
    return response.headers["x-deepinfer-replica"], cached, _expected_cached(router) - before_expected


def test_adapters_route_by_their_own_blocks(replicas, router):
    base = httpx.get(replicas[0].base_url + "/v1/models", headers=replicas[0].headers).json()["data"][0]["id"]
    prompt = LONG + " w7"
    home_base, cached, expected = _send(router, base, prompt)
    assert (cached, expected) == (0, 0)
    # The same prompt under "a": the base model's blocks are no hit for it, and the router knows.
    home_a, cached, expected = _send(router, "a", prompt)
    assert (cached, expected) == (0, 0)
    # A follow-up under "a" goes where "a"'s blocks are, and finds them.
    again, cached, expected = _send(router, "a", LONG + " w8 w9")
    assert again == home_a and cached > 0 and expected == cached
    # "b": no hit on either replica's base or "a" blocks; then its own follow-up hits.
    home_b, cached, expected = _send(router, "b", prompt)
    assert (cached, expected) == (0, 0)
    again, cached, expected = _send(router, "b", LONG + " w10")
    assert again == home_b and cached > 0 and expected == cached
    # And the base model still follows its own prefix.
    again, cached, expected = _send(router, base, LONG + " w11")
    assert again == home_base and cached > 0 and expected == cached
