"""The vLLM `--tool-call-parser` and `--reasoning-parser` names deepinfer accepts.

By default the recipe parses the tool-call format of the chat format it renders: HF chat
templates call tools Hermes-style (`<tool_call>{json}</tool_call>`,
recipe/deepinfer_recipe/output/hermes_calls.py), DeepSeek-V4 in DSML; both reason in
`<think>...</think>` where the tokenizer has those tokens. A tool-call parser name maps to the
recipe's format (deepinfer_recipe.output.call_formats): "hermes" and "dsml" keep the chat
format's own; the others (Llama's JSON calls, Mistral's `[TOOL_CALLS]`, pythonic lists,
Qwen3-Coder's XML-ish calls) are read instead of it. Names of formats the recipe does not read
(deepseek_v3's `<｜tool▁calls▁begin｜>` calls, granite, ...) are refused rather than accepted
and ignored.
"""

from __future__ import annotations

# vLLM name -> the recipe's tool-call format.
TOOL_CALL_PARSERS: dict[str, str] = {
    "hermes": "hermes",         # Hermes, Qwen2.5 and Qwen3 checkpoints (vLLM docs use hermes for these)
    "deepseek_v32": "dsml",     # vLLM's DSML parser (DeepSeek-V3.2, the format V4 keeps)
    "deepseek_v4": "dsml",
    "llama3_json": "llama3_json",  # Llama 3.x JSON calls, optionally after <|python_tag|>
    "llama4_json": "llama3_json",  # vLLM registers the same parser under both names
    "mistral": "mistral",          # [TOOL_CALLS] then a JSON list, or name[ARGS]{...}
    "pythonic": "pythonic",        # [f(a=1), g()] (Llama 3.2, ToolACE)
    "qwen3_coder": "qwen3_coder",  # <tool_call><function=f><parameter=p>v</parameter></function></tool_call>
}

# vLLM name -> the recipe's reasoning format. All four read `<think>...</think>`; deepseek_r1's
# opening tag may sit in the prompt, which the recipe handles from the rendered prompt.
REASONING_PARSERS: dict[str, str] = {
    "deepseek_r1": "think",
    "deepseek_v3": "think",
    "deepseek_v4": "think",
    "qwen3": "think",
}
