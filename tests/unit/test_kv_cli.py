"""`deepinfer kv stats | gc | clear` against a real directory store and a real redis-server:
what stats reports (entries, bytes, per class, oldest/newest), gc dropping exactly what expired
(Redis: nothing to do, said so), clear asking for --yes, and errors as one line, never a traceback."""

from __future__ import annotations

import json
import time

import pytest

from deepinfer.cli.main import main
from deepinfer.config import parse_retention
from deepinfer.kv_cache.store import entry as entry_format
from deepinfer.kv_cache.store.dir import DirStore
from deepinfer.kv_cache.store.entry import EntryLayout
from tests.redis_server import redis_server  # noqa: F401  (a fixture)
from tests.unit.test_kv_store import DAY, RETENTION, Clock

LAYOUT = EntryLayout(1, 16, "bfloat16")


def fill(store, items: list[tuple[int, str, float]]) -> None:
    """Entries i, each written under its class at its time (unix seconds)."""
    for i, traffic_class, t in items:
        store.clock.t = t
        key = (b"g" * 16, i.to_bytes(16, "big"))
        store.put([(key, entry_format.encode(*key, LAYOUT, bytes(LAYOUT.payload_bytes), traffic_class, t),
                    traffic_class)])


def kv(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["kv", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def stats(capsys, url: str) -> dict:
    rc, out, _ = kv(capsys, "stats", "--kv-store", url, "--json")
    assert rc == 0
    return json.loads(out)


def test_dir_stats_gc_and_clear(tmp_path, capsys):
    now = time.time()
    store = DirStore(str(tmp_path), RETENTION, clock=Clock())
    # Two agent entries 4 days old (expired: 3 d), a chat one as old (alive: 7 d), two fresh ones.
    fill(store, [(0, "agent", now - 4 * DAY), (1, "agent", now - 4 * DAY), (2, "chat", now - 4 * DAY),
                 (3, "chat", now - 60), (4, "agent", now - 30)])
    url = f"dir://{tmp_path}"
    report = stats(capsys, url)
    assert report["entries"] == 5 and report["bytes"] == 5 * LAYOUT.entry_bytes(1)
    assert report["classes"] == {"agent": 3, "chat": 2} and report["basis"] == "use"
    assert report["oldest"] == pytest.approx(now - 4 * DAY, abs=1) and report["newest"] == pytest.approx(now - 30, abs=1)
    assert report["next_expiry"] == pytest.approx(now - DAY, abs=1)     # the expired agents: due a day ago
    rc, out, _ = kv(capsys, "stats", "--kv-store", url)
    assert rc == 0 and "entries      5" in out and "agent 3, chat 2" in out

    rc, out, _ = kv(capsys, "gc", "--kv-store", url)
    assert rc == 0 and "removed 2 expired entries" in out
    assert stats(capsys, url)["classes"] == {"agent": 1, "chat": 2}
    # A shorter retention, as an operator may run it: chat's 4-day-old entry goes too.
    rc, out, _ = kv(capsys, "gc", "--kv-store", url, "--kv-retention", "chat=2d,agent=3d")
    assert rc == 0 and "removed 1 expired entries" in out

    rc, _, err = kv(capsys, "clear", "--kv-store", url)
    assert rc == 2 and "pass --yes" in err and stats(capsys, url)["entries"] == 2
    rc, out, _ = kv(capsys, "clear", "--kv-store", url, "--yes")
    assert rc == 0 and "deleted 2 entries" in out
    assert stats(capsys, url) == {"url": url, "entries": 0, "bytes": 0, "classes": {}, "basis": "use",
                                  "oldest": None, "newest": None, "next_expiry": None}


def test_redis_stats_gc_and_clear(redis_server, capsys):  # noqa: F811
    import redis

    from deepinfer.kv_cache.store.redis import RedisStore

    now = time.time()
    store = RedisStore(redis_server.url, parse_retention("chat=7d,agent=3d"), clock=Clock())
    fill(store, [(0, "agent", now - DAY), (1, "chat", now - 2 * DAY), (2, "chat", now - 10)])
    client = redis.Redis.from_url(redis_server.url)
    client.set("someone-else", b"x")   # not ours: never counted, never cleared
    report = stats(capsys, redis_server.url)
    assert report["entries"] == 3 and report["bytes"] == 3 * LAYOUT.entry_bytes(1)
    assert report["classes"] == {"agent": 1, "chat": 2} and report["basis"] == "write"
    assert report["oldest"] == pytest.approx(now - 2 * DAY, abs=1) and report["newest"] == pytest.approx(now - 10, abs=1)
    assert report["next_expiry"] == pytest.approx(now + 2 * DAY, abs=5)   # the agent entry: 1 d + 3 d
    rc, out, _ = kv(capsys, "gc", "--kv-store", redis_server.url)
    assert rc == 0 and "nothing to collect" in out
    rc, out, _ = kv(capsys, "clear", "--kv-store", redis_server.url, "--yes")
    assert rc == 0 and "deleted 3 entries" in out
    assert stats(capsys, redis_server.url)["entries"] == 0 and client.get("someone-else") == b"x"


def test_errors_are_one_line(tmp_path, capsys, redis_server):  # noqa: F811
    redis_server.stop()
    for argv, message in ((["stats", "--kv-store", f"dir://{tmp_path / 'none'}"], "no KV store there"),
                          (["gc", "--kv-store", "s3://bucket"], "kv_store must be dir://PATH or redis://"),
                          (["stats", "--kv-store", redis_server.url], "Connection refused"),
                          (["gc", "--kv-store", f"dir://{tmp_path}", "--kv-retention", "chat=7x"],
                           "kv_retention")):
        rc, out, err = kv(capsys, *argv)
        assert rc == 2 and message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "none").exists()   # a look at a wrong path creates nothing
