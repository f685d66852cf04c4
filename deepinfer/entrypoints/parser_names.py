"""The vLLM `--tool-call-parser` and `--reasoning-parser` names deepinfer accepts.

deepinfer's recipe does not choose a parser by name: it parses the output format of the chat
format it renders. HF chat templates call tools Hermes-style (`<tool_call>{json}</tool_call>`,
recipe/deepinfer_recipe/output/hermes_calls.py) and reason in `<think>...</think>` where the
tokenizer has those tokens; DeepSeek-V4 calls tools in DSML and thinks in its own `<think>`
block. So a vLLM name is accepted when the format it parses in vLLM is one of these, and the
value says which; names of other formats (mistral, llama3_json, pythonic, deepseek_v3's
`<｜tool▁calls▁begin｜>` calls, ...) are refused rather than accepted and ignored.
"""

from __future__ import annotations

# vLLM name -> the recipe's tool-call format.
TOOL_CALL_PARSERS: dict[str, str] = {
    "hermes": "hermes",         # Hermes, Qwen2.5 and Qwen3 checkpoints (vLLM docs use hermes for these)
    "deepseek_v32": "dsml",     # vLLM's DSML parser (DeepSeek-V3.2, the format V4 keeps)
    "deepseek_v4": "dsml",
}

# vLLM name -> the recipe's reasoning format. All four read `<think>...</think>`; deepseek_r1's
# opening tag may sit in the prompt, which the recipe handles from the rendered prompt.
REASONING_PARSERS: dict[str, str] = {
    "deepseek_r1": "think",
    "deepseek_v3": "think",
    "deepseek_v4": "think",
    "qwen3": "think",
}
