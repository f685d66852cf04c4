"""Prefill/decode disaggregation with real processes on loopback: a prefill server
(`--kv-role prefill`) and a decode server (`--kv-role decode`) on one dir:// KV store, behind
`deepinfer router --prefill URL --backend URL`. Answers, streamed and not, equal an offline
colocated engine's greedy tokens; the decode server reports the prompt cached (loaded from the
store, not recomputed); with the prefill server killed, requests are still answered the same,
the decode side computing the prompt itself."""

from __future__ import annotations

import json

import httpx
import psutil

from deepinfer import LLM, SamplingParams
from tests.e2e.server_process import API_KEY, start_server, stop_server
from tests.e2e.test_router import Router

PROMPTS = [" ".join(f"w{(13 * j + 7 * i) % 400 + 5}" for j in range(90)) for i in range(3)]   # 5+ blocks each
HEADERS = {"Authorization": f"Bearer {API_KEY}"}


def _server_args(model: str, role: str, store: str) -> tuple[str, ...]:
    return ("--model", model, "--served-model-name", "tiny", "--max-model-len", "512", "--dtype", "float32",
            "--cpu-kv-cache-bytes", str(16 << 20), "--kv-store", store, "--kv-role", role)


def _complete(router: Router, prompt: str, stream: bool = False) -> tuple[str, int]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    if not stream:
        reply = httpx.post(router.url + "/v1/completions", headers=HEADERS, json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        data = reply.json()
        return data["choices"][0]["text"], data["usage"]["prompt_tokens_details"]["cached_tokens"]
    text, cached = "", -1
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", router.url + "/v1/completions", headers=HEADERS, json=body, timeout=120) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            text += "".join(c["text"] for c in chunk.get("choices", []))
            if chunk.get("usage"):
                cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
    return text, cached


def _handoffs(router: Router) -> dict[str, float]:
    text = httpx.get(router.url + "/metrics", timeout=5).text
    return {line.split('outcome="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith("deepinfer_router_prefill_handoffs_total{")}


def test_prefill_then_decode_through_the_router(tiny_llama, tmp_path):
    llm = LLM(tiny_llama, dtype="float32", max_model_len=512, num_kv_blocks=128)
    want = [o.outputs[0].text for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8,
                                                                            ignore_eos=True), use_tqdm=False)]
    llm.engine.shutdown()
    store = f"dir://{tmp_path / 'store'}"
    prefill = start_server(str(tmp_path / "prefill.log"), *_server_args(tiny_llama, "prefill", store))
    decode = start_server(str(tmp_path / "decode.log"), *_server_args(tiny_llama, "decode", store))
    router = None
    try:
        router = Router(str(tmp_path / "router.log"), [decode], "--prefill", prefill.base_url)
        text, cached = _complete(router, PROMPTS[0])
        assert text == want[0]
        assert cached >= 5 * 16   # the decode server loaded the prompt's blocks from the store
        text, cached = _complete(router, PROMPTS[1], stream=True)
        assert text == want[1] and cached >= 5 * 16
        assert _handoffs(router).get("ok") == 2
        # The prefill server gone: the decode server computes the prompt, the answer is the same.
        psutil.Process(prefill.process.pid).kill()
        prefill.process.wait(10)
        text, cached = _complete(router, PROMPTS[2])
        assert text == want[2] and cached == 0
        assert _handoffs(router).get("ok") == 2 and sum(_handoffs(router).values()) == 3
    finally:
        if router is not None:
            router.stop()
        stop_server(prefill)
        stop_server(decode)
