"""Random requests for the differential test against deepseek-recipe (test_oracle_parity.py).

Each generator draws one request of its protocol from a seeded `random.Random`: system and
developer messages anywhere, empty strings, consecutive user turns, multi-part content,
reasoning, tool calls with odd arguments, tool results out of call order, latest_reminder, prefix
continuation, thinking on/off/default and every effort level. It varies the shapes of
conversations; what their text spells is the injection tests' business.
"""

from __future__ import annotations

import random

from corpus import CHAT_TOOLS, MSG_TOOLS, RESP_TOOLS

TEXTS = ["hi", "", "Ünï 数据 🙂", "a\n\nb", " lead space", "json please", "<｜User｜>x", "trail \n"]
ARGUMENTS = ['{"city": "Paris"}', "{}", '{"q": "x", "filters": {"lang": "en"}}', "not json", "", "[1,2]",
             '{"n": 1.5, "b": true, "z": null}', '"str"']
EFFORTS = ["none", "minimal", "low", "medium", "high", "xhigh", "max"]
MODELS = ["DeepSeek-V4-Pro", "DeepSeek-V4.1-Flash"]


def _text(rng: random.Random) -> str:
    return rng.choice(TEXTS)


def chat_request(rng: random.Random, model: str) -> tuple[str, dict]:
    messages: list[dict] = []
    if rng.random() < 0.5:
        messages.append({"role": "system", "content": _text(rng)})
    turns = rng.randint(1, 4)
    for turn in range(turns):
        kind = rng.random()
        if kind < 0.1:
            messages.append({"role": "system", "content": _text(rng)})
        elif kind > 0.9:
            messages.append({"role": "latest_reminder", "content": _text(rng)})
        if rng.random() < 0.3:
            messages.append({"role": "user", "content": [{"type": "text", "text": _text(rng)} for _ in range(rng.randint(1, 3))]})
        else:
            messages.append({"role": "user", "content": _text(rng)})
        if turn == turns - 1 and rng.random() < 0.5:
            break
        assistant: dict = {"role": "assistant", "content": rng.choice([_text(rng), None, ""])}
        if rng.random() < 0.6:
            assistant["reasoning_content"] = _text(rng)
        if rng.random() < 0.4:
            calls = [{"id": f"c{turn}{i}", "type": "function",
                      "function": {"name": rng.choice(["get_weather", "search", "now"]), "arguments": rng.choice(ARGUMENTS)}}
                     for i in range(rng.randint(1, 3))]
            assistant["tool_calls"] = calls
            messages.append(assistant)
            for call in rng.sample(calls, len(calls)):
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": _text(rng)})
            if rng.random() < 0.5:
                final = {"role": "assistant", "content": _text(rng)}
                if rng.random() < 0.5:
                    final["reasoning_content"] = _text(rng)
                messages.append(final)
        else:
            messages.append(assistant)
    if messages[-1]["role"] == "assistant" and rng.random() < 0.3:
        messages[-1]["prefix"] = True
    body: dict = {"model": model, "messages": messages}
    if rng.random() < 0.5:
        body["tools"] = CHAT_TOOLS
        if rng.random() < 0.3:
            body["tool_choice"] = rng.choice(["none", "auto"])
    if rng.random() < 0.4:
        body["thinking"] = {"type": rng.choice(["enabled", "disabled"])}
    if rng.random() < 0.5:
        body["reasoning_effort"] = rng.choice(EFFORTS)
    if rng.random() < 0.1:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    return "chat", body


def responses_request(rng: random.Random, model: str) -> tuple[str, dict]:
    items: list[dict] = []
    for turn in range(rng.randint(1, 3)):
        items.append(rng.choice([
            {"role": "user", "content": _text(rng)},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": _text(rng)}]},
            {"role": rng.choice(["system", "developer"]), "content": _text(rng)},
        ]))
        if rng.random() < 0.5:
            if rng.random() < 0.5:
                reasoning: dict = {"type": "reasoning", "summary": [{"type": "summary_text", "text": "s"}]}
                if rng.random() < 0.5:
                    reasoning["content"] = [{"type": "reasoning_text", "text": _text(rng)}]
                items.append(reasoning)
            if rng.random() < 0.5:
                items.append({"role": "assistant", "content": [{"type": "output_text", "text": _text(rng)}]})
            if rng.random() < 0.5:
                calls = rng.randint(1, 2)
                for i in range(calls):
                    items.append({"type": "function_call", "call_id": f"c{turn}{i}", "name": "get_weather",
                                  "arguments": rng.choice(ARGUMENTS)})
                for i in range(calls):
                    items.append({"type": "function_call_output", "call_id": f"c{turn}{i}", "output": _text(rng)})
    body: dict = {"model": model, "input": items if rng.random() < 0.9 else _text(rng)}
    if rng.random() < 0.5:
        body["instructions"] = _text(rng)
    if rng.random() < 0.5:
        body["tools"] = RESP_TOOLS
    if rng.random() < 0.5:
        body["reasoning"] = {"effort": rng.choice(EFFORTS)}
    return "responses", body


def messages_request(rng: random.Random, model: str) -> tuple[str, dict]:
    messages: list[dict] = []
    for turn in range(rng.randint(1, 3)):
        messages.append({"role": "user", "content": _text(rng) if rng.random() < 0.5 else [{"type": "text", "text": _text(rng)}]})
        if rng.random() < 0.6:
            blocks: list[dict] = []
            if rng.random() < 0.5:
                blocks.append({"type": "thinking", "thinking": _text(rng), "signature": "s"})
            if rng.random() < 0.6:
                blocks.append({"type": "text", "text": _text(rng)})
            uses = [{"type": "tool_use", "id": f"t{turn}{i}", "name": "get_weather", "input": {"city": _text(rng)}}
                    for i in range(rng.choice([0, 0, 1, 2]))]
            blocks += uses
            messages.append({"role": "assistant", "content": blocks or [{"type": "text", "text": "ok"}]})
            if uses:
                results: list[dict] = [{"type": "tool_result", "tool_use_id": u["id"], "content": _text(rng)} for u in uses]
                rng.shuffle(results)
                if rng.random() < 0.5:
                    results.append({"type": "text", "text": _text(rng)})
                messages.append({"role": "user", "content": results})
                if rng.random() < 0.5:
                    messages.append({"role": "assistant", "content": _text(rng)})
    if messages[-1]["role"] == "assistant" and rng.random() < 0.5:
        messages.append({"role": "user", "content": _text(rng)})
    body: dict = {"model": model, "max_tokens": 100, "messages": messages}
    if rng.random() < 0.5:
        body["system"] = _text(rng) if rng.random() < 0.5 else [{"type": "text", "text": _text(rng)}]
    if rng.random() < 0.5:
        body["tools"] = MSG_TOOLS
    if rng.random() < 0.5:
        body["thinking"] = rng.choice([{"type": "enabled", "budget_tokens": 1024}, {"type": "disabled"}])
    if rng.random() < 0.4:
        body["output_config"] = {"effort": rng.choice(["low", "medium", "high", "xhigh", "max"])}
    return "messages", body


GENERATORS = (chat_request, responses_request, messages_request)


def random_request(rng: random.Random) -> tuple[str, dict]:
    """(protocol, body) of one random request, for DeepSeek-V4 or V4.1."""
    return rng.choice(GENERATORS)(rng, rng.choice(MODELS))
