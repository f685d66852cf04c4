"""Chats with images through a real `deepinfer serve` (issue 45's Show): TTFT with the encoder cache
on and off, and the decode streams' ITL while a burst of images arrives, at the encoder budgets given.

    python benchmarks/vision_serving.py [--model tiny|gemma3-4b|PATH] [--layers N]
        [--conversations 12] [--turns 3] [--reuse 0.5] [--rate 4] [--arrivals poisson|fixed]
        [--text-words 24] [--answer-tokens 16] [--image-size 64x48]
        [--decodes 4] [--decode-tokens 2048] [--burst 8] [--budgets default,unlimited]
        [--parts chat,burst] [--server-args "..."] [--seed 0] [--out vision.json]

How to run: on the CPU, the defaults serve the tiny random Gemma 3 vision model of the tests
(tests/models/tiny_models.tiny_vision_chat_model: SigLIP 32 px, 16 tokens an image) as a smoke run
of a minute or two. On the GPU, `--model gemma3-4b` serves Gemma-3-4B's shape with random weights
(`--load-format dummy`): the text model's 34 layers at hidden 2560, google/gemma-3-4b-it's vision
config (SigLIP 896 px, patch 14, 27 layers at hidden 1152, 256 tokens an image), behind a
word-level tokenizer that has Gemma 3's special ids (<start_of_image> 255999, <end_of_image> 256000,
<image_soft_token> 262144, turn markers, "\\n\\n" 108) and the tests' Gemma-style chat template;
`--layers N` cuts both stacks to N layers (a CPU check of that path). benchmarks/gpu_suite.sh
`vision` runs it. Each server is a real one on loopback, started as the e2e tests start theirs
(tests/e2e/server_process.py); one per setting, stopped before the next, and warmed up with a few image chats first.

chat: --conversations conversations of --turns turns, each turn resending the whole history (its
earlier images included) plus a new user message of --text-words words and one image: from the
second turn on, a --reuse share of turns send again an image the conversation sent before (a new
place in the prompt: the prefix cache cannot serve it, the encoder cache can), the others a fresh
one. Images are PIL-drawn JPEGs of --image-size pixels (smooth random fields, one per seed:
deterministic, distinct, small on the wire), resized by the server to the tower's size. Requests
arrive at --rate per second (Poisson or evenly spaced), in turn order; a turn whose previous answer
is not back yet waits for it (counted as `held`). Reported per setting (encoder cache on: the
server's default size; off: --encoder-cache-size 0): TTFT P50/P99 (to the first streamed token,
server queueing included), requests and output tokens per second, and from /metrics over the run:
images encoded, encoder cache hits, encode seconds, prefix-cache hit tokens.

burst: --decodes text-only streams (ignore_eos, --decode-tokens) run; once each has produced
tokens, --burst requests with one fresh image each arrive at once. Reported per encoder budget
(--max-num-encoder-input-tokens: `default` leaves it unset, which is max_num_batched_tokens,
`unlimited` is 2^30, a number is that budget): the decode streams' inter-token gaps that end during
the burst (from its send to the last burst request's first token) as P50/P99/max, the same before
the burst as a reference, and how long the burst took to start answering. Since image tokens also
spend the step's token budget, a budget at max_num_batched_tokens never binds: set a number below
it to see what the budget does (gpu_suite.sh passes one).

The JSON (--out) has the machine record, the arguments, and one entry per part and setting; it is
rewritten after each server, so a run cut short keeps what it finished.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import random
import re
import shlex
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import REPO, machine_info, percentile

sys.path.insert(0, REPO)   # tests/: the tiny vision model, its tokenizer, the server starter

SERVED_NAME = "bench"
UNLIMITED = 1 << 30
METRICS = {"encoder_images_encoded_total": "images_encoded", "encoder_cache_hits_total": "encoder_cache_hits",
           "encoder_encode_seconds_total": "encode_seconds", "prefix_cache_hits_total": "prefix_cache_hit_tokens",
           "prefix_cache_queries_total": "prefix_cache_query_tokens"}
_SAMPLE = re.compile(r"^deepinfer:(\w+)(?:\{[^}]*\})? (\S+)$")

# google/gemma-3-4b-it's config.json (text model's fields spelled out: the loader's defaults are
# Gemma 3's 2B-ish text model), weights random.
GEMMA3_4B = {
    "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "torch_dtype": "bfloat16",
    "boi_token_index": 255_999, "eoi_token_index": 256_000, "image_token_index": 262_144,
    "mm_tokens_per_image": 256, "bos_token_id": 2, "eos_token_id": [1, 106], "pad_token_id": 0,
    "text_config": {
        "model_type": "gemma3_text", "hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 34,
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "vocab_size": 262_208,
        "sliding_window": 1024, "sliding_window_pattern": 6, "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "query_pre_attn_scalar": 256, "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6,
        "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True,
        "final_logit_softcapping": None, "attn_logit_softcapping": None},
    "vision_config": {
        "model_type": "siglip_vision_model", "hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
        "num_attention_heads": 16, "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False,
        "layer_norm_eps": 1e-6, "hidden_act": "gelu_pytorch_tanh"},
}
# Gemma 3's ids of the tokens the chat template and the image text use.
GEMMA3_TOKENS = {"<bos>": 2, "<start_of_turn>": 105, "<end_of_turn>": 106, "<start_of_image>": 255_999,
                 "<end_of_image>": 256_000, "<image_soft_token>": 262_144}
GEMMA3_NEWLINES = (108, 107)   # "\n\n", "\n"


class Model:
    """A served model: its directory and flags, and the word ids its texts are drawn from."""

    def __init__(self, name: str, path: str, flags: list[str], words: tuple[int, int], max_model_len: int) -> None:
        self.name, self.path, self.flags, self.words, self.max_model_len = name, path, flags, words, max_model_len


def resolve_model(name: str, layers: int | None, workdir: str) -> Model:
    """tiny (the tests' checkpoint, float32) | gemma3-4b (the shape, random weights) | a directory."""
    if name == "tiny":
        from tests.models.tiny_models import tiny_vision_chat_model

        path = os.path.join(workdir, "tiny-vision")
        os.makedirs(path)
        tiny_vision_chat_model(path)
        # Words w12..w499: past the newline ids, before the special ones (500-505).
        return Model(name, path, ["--dtype", "float32"], (12, 500), 512)
    if name == "gemma3-4b":
        from tests.models.tiny_models import VISION_CHAT_TEMPLATE, write_vision_chat_tokenizer

        config = json.loads(json.dumps(GEMMA3_4B))
        if layers:
            config["text_config"]["num_hidden_layers"] = config["vision_config"]["num_hidden_layers"] = layers
        path = os.path.join(workdir, "gemma3-4b-shape")
        os.makedirs(path)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(config, f)
        write_vision_chat_tokenizer(path, config["text_config"]["vocab_size"], GEMMA3_TOKENS, GEMMA3_NEWLINES)
        with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
            json.dump({"eos_token": "<end_of_turn>", "bos_token": "<bos>", "chat_template": VISION_CHAT_TEMPLATE}, f)
        return Model(name, path, ["--load-format", "dummy"], (200, 255_000), 8192)
    return Model(os.path.basename(name.rstrip("/")), name, [], (200, 1000), 8192)


# ------------------------------------------------------------------------------------- images
def image_bytes(seed: int, size: tuple[int, int]) -> bytes:
    """A smooth random RGB field (an 8x6 grid of random colours, upscaled bicubic) as a JPEG: one
    distinct picture per seed, a few kB whatever the size (noise would be megabytes)."""
    import numpy as np
    from PIL import Image

    grid = np.random.default_rng(seed).integers(0, 256, (6, 8, 3), dtype=np.uint8)
    picture = Image.fromarray(grid).resize(size, Image.BICUBIC)
    buffer = io.BytesIO()
    picture.save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


class Images:
    """Data URLs by image seed, each encoded once."""

    def __init__(self, size: tuple[int, int]) -> None:
        self.size = size
        self.urls: dict[int, str] = {}

    def url(self, seed: int) -> str:
        if seed not in self.urls:
            self.urls[seed] = "data:image/jpeg;base64," + base64.b64encode(image_bytes(seed, self.size)).decode()
        return self.urls[seed]


def user_turn(text: str, image_url: str) -> dict:
    return {"role": "user", "content": [{"type": "text", "text": text},
                                        {"type": "image_url", "image_url": {"url": image_url}}]}


# --------------------------------------------------------------------------------- the server
def start(model: Model, args, workdir: str, label: str, *setting: str):
    from kv_store_serving import child_environment

    from tests.e2e.server_process import start_server

    child_environment()
    flags = ["--model", model.path, "--served-model-name", SERVED_NAME, "--max-model-len", str(model.max_model_len),
             "--max-request-body-bytes", str(256 << 20), *model.flags, *setting, *shlex.split(args.server_args)]
    began = time.perf_counter()
    server = start_server(os.path.join(workdir, f"server-{label}.log"), *flags)
    print(f"  [{label}] server up in {time.perf_counter() - began:.1f} s: {' '.join(setting) or '(defaults)'}",
          flush=True)
    return server


def counters(server) -> dict[str, float]:
    """The /metrics counters of METRICS, summed over their labels."""
    import httpx

    out = dict.fromkeys(METRICS.values(), 0.0)
    for line in httpx.get(f"{server.base_url}/metrics", timeout=30).text.splitlines():
        match = _SAMPLE.match(line)
        if match and match.group(1) in METRICS:
            out[METRICS[match.group(1)]] += float(match.group(2))
    return out


def session():
    import aiohttp

    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600))


def headers(server) -> dict:
    return {**server.headers, "Content-Type": "application/json"}


async def warm_up(server, args, images: Images) -> None:
    """A few image chats before anything is timed, so a server's first-request costs (lazy
    initialisation, kernel compilation for new shapes) land in no setting's figures; their
    images are none of the workload's."""
    from deepinfer.bench.serving.client import chat_body, stream_request

    low = args.words[0]
    async with session() as client:
        for n in (1, 2, 4):
            bodies = [chat_body(SERVED_NAME, [user_turn(f"w{low} w{low + 1}", images.url(90_000 + 10 * n + i))],
                                4, {"temperature": 0, "ignore_eos": True}) for i in range(n)]
            results = await asyncio.gather(*(stream_request(client, f"{server.base_url}/v1/chat/completions", body,
                                                            headers(server), 0) for body in bodies))
            failed = [r.error for r in results if not r.success]
            if failed:
                raise RuntimeError(f"warm-up failed: {failed[0]}\n{server.log()}")


# ------------------------------------------------------------------------------------ chat part
def plan_conversations(args, rng: random.Random) -> list[list[tuple[str, int, bool]]]:
    """Per conversation, per turn: (text, image seed, whether the image was sent before)."""
    low, high = args.words
    plans, fresh = [], 1000
    for _ in range(args.conversations):
        turns, seen = [], []
        for k in range(args.turns):
            text = " ".join(f"w{rng.randrange(low, high)}" for _ in range(args.text_words))
            if k > 0 and rng.random() < args.reuse:
                turns.append((text, rng.choice(seen), True))
            else:
                fresh += 1
                seen.append(fresh)
                turns.append((text, fresh, False))
        plans.append(turns)
    return plans


def arrival_times(n: int, rate: float, kind: str, rng: random.Random) -> list[float]:
    if kind == "fixed":
        return [i / rate for i in range(n)]
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


async def run_chat(server, args, images: Images) -> dict:
    from deepinfer.bench.serving.client import chat_body, stream_request

    rng = random.Random(args.seed)
    plans = plan_conversations(args, rng)
    turns = args.turns
    order = [(c, k) for k in range(turns) for c in range(len(plans))]   # turn-major: turn 1 of all first
    arrivals = arrival_times(len(order), args.rate, args.arrivals, rng)
    answers: dict[tuple[int, int], str] = {}
    done = {key: asyncio.Event() for key in order}
    results, held = [], 0
    url, hdrs = f"{server.base_url}/v1/chat/completions", headers(server)

    async def one(client, at: float, c: int, k: int, began: float) -> None:
        nonlocal held
        await asyncio.sleep(max(0.0, began + at - time.perf_counter()))
        if k > 0 and not done[(c, k - 1)].is_set():
            held += 1
            await done[(c, k - 1)].wait()
        messages = []
        for j in range(k):
            text, seed, _ = plans[c][j]
            messages += [user_turn(text, images.url(seed)), {"role": "assistant", "content": answers[(c, j)]}]
        text, seed, reused = plans[c][k]
        messages.append(user_turn(text, images.url(seed)))
        body = chat_body(SERVED_NAME, messages, args.answer_tokens, {"temperature": 0, "ignore_eos": True})
        result = await stream_request(client, url, body, hdrs, 0, keep_text=True)
        if not result.success:
            raise RuntimeError(f"chat {c} turn {k} failed: {result.error}\n{server.log()}")
        answers[(c, k)] = result.text
        results.append((k, reused, result))
        done[(c, k)].set()

    for c, k in order:   # data URLs made before the clock starts
        images.url(plans[c][k][1])
    before = counters(server)
    async with session() as client:
        began = time.perf_counter()
        await asyncio.gather(*(one(client, at, c, k, began) for at, (c, k) in zip(arrivals, order)))
        wall = time.perf_counter() - began
    after = counters(server)
    ttft = [r.ttft for _, _, r in results]
    out = {"requests": len(results), "wall_s": wall, "held_for_previous_turn": held,
           "ttft_p50_ms": 1e3 * percentile(ttft, 50), "ttft_p99_ms": 1e3 * percentile(ttft, 99),
           "ttft_reused_image_p50_ms": 1e3 * percentile([r.ttft for _, reused, r in results if reused], 50),
           "ttft_fresh_image_p50_ms": 1e3 * percentile([r.ttft for _, reused, r in results if not reused], 50),
           "requests_per_s": len(results) / wall,
           "output_tokens_per_s": sum(r.output_tokens for _, _, r in results) / wall,
           "prompt_tokens": sum(r.prompt_len for _, _, r in results),
           "cached_tokens": sum(r.cached_tokens for _, _, r in results),
           "turns_with_reused_image": sum(reused for _, reused, _ in results)}
    out.update({name: after[name] - before[name] for name in after})
    return out


# ----------------------------------------------------------------------------------- burst part
async def token_times(client, url: str, body: bytes, hdrs: dict, times: list[float]) -> None:
    """Stream one request, appending each token event's arrival time to `times` as it comes (so a
    stream cancelled midway keeps what it saw)."""
    from deepinfer.bench.serving.client import carries_choice

    async with client.post(url, data=body, headers=hdrs) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {(await response.text())[:500]}")
        tail = b""
        async for chunk in response.content.iter_any():
            now = time.perf_counter()
            events = (tail + chunk).replace(b"\r\n", b"\n").split(b"\n\n")
            tail = events.pop()
            times.extend(now for event in events if carries_choice(event))


def gaps_ending_in(streams: list[list[float]], lo: float, hi: float) -> list[float]:
    return [b - a for times in streams for a, b in zip(times, times[1:]) if lo <= b <= hi]


async def run_burst(server, args, images: Images) -> dict:
    from deepinfer.bench.serving.client import chat_body

    rng = random.Random(args.seed + 1)
    low, high = args.words
    url, hdrs = f"{server.base_url}/v1/chat/completions", headers(server)
    decode_times: list[list[float]] = [[] for _ in range(args.decodes)]
    burst_times: list[list[float]] = [[] for _ in range(args.burst)]
    bodies = [chat_body(SERVED_NAME, [user_turn(" ".join(f"w{rng.randrange(low, high)}" for _ in range(args.text_words)),
                                                images.url(50_000 + i))], args.answer_tokens,
                        {"temperature": 0, "ignore_eos": True}) for i in range(args.burst)]
    before = counters(server)
    async with session() as client:
        decodes = []
        for i in range(args.decodes):
            prompt = " ".join(f"w{rng.randrange(low, high)}" for _ in range(args.text_words))
            body = chat_body(SERVED_NAME, [{"role": "user", "content": prompt}], args.decode_tokens,
                             {"temperature": 0, "ignore_eos": True})
            decodes.append(asyncio.create_task(token_times(client, url, body, hdrs, decode_times[i])))
        deadline = time.perf_counter() + 600
        while min(len(t) for t in decode_times) < args.warm_tokens:   # every stream decoding steadily
            if time.perf_counter() > deadline or any(task.done() for task in decodes):
                raise RuntimeError(f"the decode streams did not start:\n{server.log()}")
            await asyncio.sleep(0.01)
        settle = time.perf_counter()
        await asyncio.sleep(args.before_s)
        sent = time.perf_counter()
        await asyncio.gather(*(token_times(client, url, body, hdrs, times)
                               for body, times in zip(bodies, burst_times)))
        answered = max(times[0] for times in burst_times)   # the last burst request's first token
        ended = min(times[-1] for times in decode_times)
        for task in decodes:
            task.cancel()
        await asyncio.gather(*decodes, return_exceptions=True)
    after = counters(server)
    during = gaps_ending_in(decode_times, sent, answered)
    reference = gaps_ending_in(decode_times, settle, sent)
    ttft = [times[0] - sent for times in burst_times]
    return {"decodes": args.decodes, "burst": args.burst, "burst_first_tokens_s": answered - sent,
            "decodes_ran_through_burst": ended >= answered, "itl_samples_during": len(during),
            "itl_during_p50_ms": 1e3 * percentile(during, 50), "itl_during_p99_ms": 1e3 * percentile(during, 99),
            "itl_during_max_ms": 1e3 * max(during, default=float("nan")),
            "itl_before_p50_ms": 1e3 * percentile(reference, 50), "itl_before_p99_ms": 1e3 * percentile(reference, 99),
            "burst_ttft_p50_ms": 1e3 * percentile(ttft, 50), "burst_ttft_max_ms": 1e3 * max(ttft),
            **{name: after[name] - before[name] for name in after}}


# ------------------------------------------------------------------------------------- the run
def settings(args) -> list[tuple[str, list[str], list[tuple[str, str]]]]:
    """One server per distinct setting: (label, its flags, the (part, mode) it measures)."""
    by_flags: dict[tuple[str, ...], tuple[str, list[tuple[str, str]]]] = {}

    def want(label: str, flags: list[str], part: str, mode: str) -> None:
        by_flags.setdefault(tuple(flags), (label, []))[1].append((part, mode))

    if "chat" in args.parts:
        want("cache-on", [], "chat", "encoder_cache_on")
        want("cache-off", ["--encoder-cache-size", "0"], "chat", "encoder_cache_off")
    if "burst" in args.parts:
        for budget in args.budgets:
            flags = [] if budget == "default" else \
                ["--max-num-encoder-input-tokens", str(UNLIMITED if budget == "unlimited" else int(budget))]
            want(f"budget-{budget}", flags, "burst", f"budget_{budget}")
    return [(label, list(flags), jobs) for flags, (label, jobs) in by_flags.items()]


def report(result: dict) -> None:
    for mode, r in result.get("chat", {}).items():
        print(f"chat {mode:18s} TTFT P50 {r['ttft_p50_ms']:8.1f} ms  P99 {r['ttft_p99_ms']:8.1f} ms  "
              f"(reused image P50 {r['ttft_reused_image_p50_ms']:.1f}, fresh {r['ttft_fresh_image_p50_ms']:.1f})  "
              f"{r['requests_per_s']:.2f} req/s  {r['output_tokens_per_s']:.1f} tok/s  encoded "
              f"{r['images_encoded']:.0f}  cache hits {r['encoder_cache_hits']:.0f}  encode "
              f"{r['encode_seconds']:.2f} s  prefix hits {r['prefix_cache_hit_tokens']:.0f} tok  held {r['held_for_previous_turn']}")
    for mode, r in result.get("burst", {}).items():
        print(f"burst {mode:17s} decode ITL during burst P50 {r['itl_during_p50_ms']:7.1f} ms  P99 "
              f"{r['itl_during_p99_ms']:7.1f} ms  max {r['itl_during_max_ms']:7.1f} ms ({r['itl_samples_during']} gaps)  "
              f"before P99 {r['itl_before_p99_ms']:6.1f} ms  burst answered in {r['burst_first_tokens_s']:.2f} s  "
              f"encoded {r['images_encoded']:.0f}" + ("" if r["decodes_ran_through_burst"] else "  (decodes ended early)"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="tiny | gemma3-4b (random weights of its shape) | a directory")
    p.add_argument("--layers", type=int, default=None, help="gemma3-4b: cut the text and vision stacks to N layers")
    p.add_argument("--parts", default="chat,burst")
    p.add_argument("--conversations", type=int, default=12)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--reuse", type=float, default=0.5, help="share of turns (from the 2nd) resending an earlier image")
    p.add_argument("--rate", type=float, default=4.0, help="requests per second")
    p.add_argument("--arrivals", choices=("poisson", "fixed"), default="poisson")
    p.add_argument("--text-words", type=int, default=24)
    p.add_argument("--answer-tokens", type=int, default=16)
    p.add_argument("--image-size", default="64x48", help="WxH of the drawn images (the server resizes them)")
    p.add_argument("--decodes", type=int, default=4)
    p.add_argument("--decode-tokens", type=int, default=2048, help="long enough to outlast the burst")
    p.add_argument("--warm-tokens", type=int, default=8, help="tokens each decode stream has before the burst")
    p.add_argument("--before-s", type=float, default=1.0, help="seconds of reference ITL before the burst")
    p.add_argument("--burst", type=int, default=8)
    p.add_argument("--budgets", default="default,unlimited", help="encoder budgets: default | unlimited | N, comma-separated")
    p.add_argument("--server-args", default="", help="more `deepinfer serve` flags for every server")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    args.parts = args.parts.split(",")
    args.budgets = args.budgets.split(",")
    width, height = (int(v) for v in args.image_size.lower().split("x"))
    workdir = tempfile.mkdtemp(prefix="vision-serving-", dir=args.workdir)
    model = resolve_model(args.model, args.layers, workdir)
    args.words = model.words
    # A decode's prompt is about --text-words tokens plus the template's; the rest of the context is its to run in.
    args.decode_tokens = min(args.decode_tokens, model.max_model_len - 2 * args.text_words - 16)
    images = Images((width, height))
    result = {"benchmark": "vision_serving", "machine": machine_info(),
              "args": {k: v for k, v in vars(args).items()}, "model": model.name}
    from kv_store_serving import stop

    for label, flags, jobs in settings(args):
        server = start(model, args, workdir, label, *flags)
        try:
            asyncio.run(warm_up(server, args, images))
            for part, mode in jobs:
                run = run_chat if part == "chat" else run_burst
                result.setdefault(part, {})[mode] = {"server_flags": flags, **asyncio.run(run(server, args, images))}
        finally:
            stop(server)
        report({part: {mode: result[part][mode]} for part, mode in jobs})
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    print(json.dumps({part: result.get(part) for part in ("chat", "burst")}, indent=1))


if __name__ == "__main__":
    main()
