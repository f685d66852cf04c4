"""The persistent KV store under faults a real deployment meets, with real components: an engine
process killed (SIGKILL) while its writer thread is writing into a dir:// store, then a later
engine on the same directory; damaged entries in a real Redis (a flipped bit, a truncated value,
a foreign format version). Each time the answers equal a cold run's greedy tokens, the counters
say what happened, and nothing waits past its timeout. (Damaged files in a directory, and Redis
stopped and restarted mid-run, are in test_kv_store_engine.py.)"""

from __future__ import annotations

import os
import random
import select
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.kv_cache.store import entry as entry_format
from tests.redis_server import redis_server  # noqa: F401  (a fixture)
from tests.unit.test_kv_store_engine import (  # noqa: F401  (long_expected: a fixture)
    BS,
    GREEDY,
    LONG_BS,
    LONG_FOLLOW_UP,
    compute_long,
    long_expected,
    make,
    make_long,
    run_key,
    worker_of,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPT_TOKENS = 100   # 6 full blocks of 16
CATCH_S = 8.0         # how long the kill test tries to land inside a write


def prompts(batch: int, n: int = 8) -> list[list[int]]:
    """n prompts of their own (no shared first block) for each batch number."""
    return [[random.Random(batch * 1000 + i).randrange(2, 500) for _ in range(PROMPT_TOKENS)] for i in range(n)]


# The engine that is killed: batch 0 written and flushed (said on stdout), then batches without
# end, so its writer thread is always writing when the signal comes.
WRITER = textwrap.dedent("""
    import sys
    from deepinfer import LLM, SamplingParams
    from tests.unit.test_kv_store_faults import prompts

    llm = LLM(sys.argv[1], dtype="float32", max_model_len=256, num_kv_blocks=256, kv_store=sys.argv[2])
    one = SamplingParams(temperature=0, max_tokens=1)
    llm.generate(prompts(0), one, use_tqdm=False)
    assert llm.engine.executor.runner.kv_connector.flush(60)
    print("flushed", flush=True)
    batch = 1
    while True:
        llm.generate(prompts(batch), one, use_tqdm=False)
        batch += 1
""")


def _entries(root: str) -> list[str]:
    return [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(root, "blocks")) for f in fs if f.endswith(".kv")]


def _writes_in_progress(root: str) -> list[str]:
    """Temp files (dir.py: <entry name>.tmp.<pid>.<thread>.<random>)."""
    return [f for _, _, fs in os.walk(os.path.join(root, "blocks")) for f in fs if ".kv.tmp." in f]


def _wait_stopped(pid: int, timeout_s: float = 1.0) -> None:
    """Until /proc says the process is stopped (state T), at most timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            # The state follows the command name, which is in parentheses and may hold spaces.
            if f.read().rpartition(")")[2].split()[0] in ("T", "t"):
                return
        time.sleep(0.0005)


def test_kill_9_during_writes_never_feeds_a_half_written_entry(tiny_llama, tmp_path):
    store = f"dir://{tmp_path}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.path.join(REPO, "recipe"),
                                                         os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen([sys.executable, "-c", WRITER, tiny_llama, store], cwd=REPO, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        ready, _, _ = select.select([child.stdout], [], [], 120)
        assert ready and child.stdout.readline().strip() == "flushed", "the writer engine did not start"
        flushed = len(_entries(str(tmp_path)))
        assert flushed == 8   # a prompt's 6 blocks: one run
        deadline = time.monotonic() + 60
        while len(_entries(str(tmp_path))) < flushed + 4:   # later batches are being written
            assert time.monotonic() < deadline and child.poll() is None, "the writer engine stopped writing"
            time.sleep(0.005)
        # Freeze it now and then until a write is caught half done (a temp file there), for at
        # most CATCH_S; then the kill, frozen. What follows holds either way.
        # SIGSTOP is delivered asynchronously: the directory is read only once the process is
        # seen stopped, else a write could finish (rename its temp file) after we looked.
        caught, until = False, time.monotonic() + CATCH_S
        while not caught and time.monotonic() < until:
            child.send_signal(signal.SIGSTOP)
            _wait_stopped(child.pid)
            caught = bool(_writes_in_progress(str(tmp_path)))
            if not caught:
                child.send_signal(signal.SIGCONT)
                time.sleep(random.random() * 0.002)
        child.send_signal(signal.SIGKILL)
        assert child.wait(10) == -signal.SIGKILL
        half_written = _writes_in_progress(str(tmp_path))   # what the kill really left
        print(f"killed {'in' if half_written else 'between'} writes")
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
    # Whatever the kill interrupted: every entry under its name is whole (os.replace of a
    # complete temp file); a write in progress can only have left a temp file, never read.
    for path in _entries(str(tmp_path)):
        data = open(path, "rb").read()
        header = entry_format.decode_header(data)
        assert entry_format.checksum(data[entry_format.HEADER_SIZE:]) == header.checksum
    # A later engine on the same store: batch 0 (flushed) and batch 1 (being written at the kill,
    # in part) give the tokens a cold engine gives.
    asked = prompts(0) + prompts(1)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    cold = LLM(tiny_llama, dtype="float32", max_model_len=256, num_kv_blocks=256)
    want = [o.outputs[0].token_ids for o in cold.generate(asked, greedy, use_tqdm=False)]
    cold.engine.shutdown()
    later = make(tiny_llama, store, num_kv_blocks=256)
    got = later.generate(asked, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == want
    tier, stats = later.engine.stats().kv_tier, worker_of(later).stats()
    assert tier["loaded_blocks"] >= 8 * (PROMPT_TOKENS // BS)   # batch 0 came from the store
    assert tier["failed_loads"] == 0 and stats.corrupt_entries == 0 and tier["corrupt_entries"] == 0
    assert all(o.num_cached_tokens >= PROMPT_TOKENS - BS for o in got[:8])
    later.engine.shutdown()
    # The half-written files are still just that: never renamed, never read, never removed
    # (they are younger than the sweep's age limit).
    assert set(half_written) <= set(_writes_in_progress(str(tmp_path)))


# ------------------------------------------------------------------------------ Redis entries
@pytest.mark.parametrize("fault", ["bit_flip", "truncate", "foreign_version"])
def test_a_damaged_redis_entry_is_recomputed_identically(tiny_llama, redis_server, long_expected, fault):  # noqa: F811
    """The long prefix's three runs in Redis, the middle one damaged: the run before it still
    loads, the rest is recomputed, and the damaged run is written again."""
    import redis

    from deepinfer.kv_cache.store.redis import RedisStore

    compute_long(tiny_llama, redis_server.url)
    client = redis.Redis.from_url(redis_server.url)
    assert len(list(client.scan_iter(match="deepinfer:kv:*"))) == 3
    b = make_long(tiny_llama, redis_server.url, kv_store_load_policy="always")
    victim = RedisStore.name(run_key(b, LONG_FOLLOW_UP, 31))   # the run [16, 32)
    data = client.get(victim)
    if fault == "bit_flip":
        client.setrange(victim, len(data) // 2, bytes([data[len(data) // 2] ^ 0x01]))
    elif fault == "truncate":
        client.set(victim, data[:len(data) // 2], keepttl=True)
    else:
        client.setrange(victim, 4, (7).to_bytes(2, "little"))
    out = b.generate([LONG_FOLLOW_UP], GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == long_expected
    assert out.num_cached_tokens == 16 * LONG_BS
    tier, stats = b.engine.stats().kv_tier, worker_of(b).stats()
    if fault == "truncate":   # found by the look-up (STRLEN): never read
        assert tier["corrupt_entries"] == 1 and tier["failed_loads"] == 0
    else:                     # found by the load's checks: the load fails, the request recomputes
        assert tier["failed_loads"] > 0
        assert stats.bad_entries["corrupt" if fault == "bit_flip" else "version"] == 1
    # The damaged entry was dropped and the recomputed block written again, whole.
    assert worker_of(b).flush(10)
    rewritten = client.get(victim)
    header = entry_format.decode_header(rewritten)
    assert header.num_blocks == 16 and entry_format.checksum(rewritten[entry_format.HEADER_SIZE:]) == header.checksum
    b.engine.shutdown()
