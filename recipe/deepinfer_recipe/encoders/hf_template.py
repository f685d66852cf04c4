"""Any other model: its Hugging Face chat template (jinja2, sandboxed), made injection-safe.

A chat template renders one string, so the control tokens have to be found afterwards. We never
search the client's text for them: each client string (message text, reasoning, tool arguments
and results) is first replaced by a private-use sentinel, the template is rendered, and only
the text *between* sentinels — the template's own output — is scanned for added-token
spellings. The sentinels are then swapped back as plain text. If the template transformed a
client string (e.g. `| trim`) the swap would not reproduce the real render; we detect that and
fall back to scanning the real render while treating every occurrence of a client string as
plain. Either way a client string can never become a control token.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from ..conversation import Conversation
from ..errors import RecipeError, RequestError
from ..prompt import PromptBuilder, RenderedPrompt
from ..tokenize import SafeTokenizer
from ..tools.constraint import HermesTags, hermes_constraint, offered_tools, parallel_calls
from .base import Encoder, OutputMarkers, ParserStart
from .inline import inline_tool_messages, template_messages

_END_OF_TURN_CANDIDATES = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|end|>", "<|endoftext|>")
_SENTINEL = re.compile("\ue000(\\d+)\ue001")


def _raise(message: str):
    raise TemplateError(message)


def _tojson(value, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


class HFTemplateEncoder(Encoder):
    def __init__(self, tokenizer: SafeTokenizer, chat_template: str, bos_token: str | None = None,
                 eos_token: str | None = None, name: str = "hf"):
        self.name = name
        self.tokenizer = tokenizer
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self._template = env.from_string(chat_template)
        self.bos_token, self.eos_token = bos_token or "", eos_token or ""
        spellings = [s for s in tokenizer.full.get_added_tokens_decoder().values()]
        contents = sorted({t.content for t in spellings if t.content}, key=len, reverse=True)
        self._control_pattern = re.compile("|".join(re.escape(c) for c in contents)) if contents else None
        ends = tuple(s for s in (self.eos_token, *_END_OF_TURN_CANDIDATES) if s and tokenizer.has_control(s))
        think = tokenizer.has_control("<think>") and tokenizer.has_control("</think>")
        # Tool calls use the Hermes/Qwen convention; its tags are single tokens where the
        # tokenizer has them (then only those ids open and close a call), else plain text.
        self.call_tags = HermesTags(start_is_token=tokenizer.has_control(HermesTags.start),
                                    end_is_token=tokenizer.has_control(HermesTags.end))
        self.markers = OutputMarkers(end_of_turn=ends, think_start="<think>" if think else None,
                                     think_end="</think>" if think else None,
                                     tool_call_start=HermesTags.start, tool_call_end=HermesTags.end)
        self.renders_tools = self._template_renders_tools()

    @classmethod
    def from_directory(cls, path: str | Path, tokenizer_path: str | None = None) -> "HFTemplateEncoder":
        directory = Path(path)
        config_file = directory / "tokenizer_config.json"
        if not config_file.exists():
            raise RecipeError(f"{config_file} not found (hf:PATH needs tokenizer_config.json)")
        config = json.loads(config_file.read_text(encoding="utf-8"))
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: use "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja_file = directory / "chat_template.jinja"
        if template is None and jinja_file.exists():
            template = jinja_file.read_text(encoding="utf-8")
        if not template:
            raise RecipeError(f"no chat template in {directory}")
        tokenizer = SafeTokenizer.from_file(tokenizer_path or directory / "tokenizer.json")
        return cls(tokenizer, template, _token_text(config.get("bos_token")), _token_text(config.get("eos_token")),
                   name=f"hf:{directory}")

    @classmethod
    def from_tokenizer(cls, tokenizer: Tokenizer, chat_template: str, bos_token: str | None = None,
                       eos_token: str | None = None, name: str = "hf") -> "HFTemplateEncoder":
        """From a `tokenizers.Tokenizer` object and a template string, for models whose tokenizer
        exists only in memory (a GGUF file carries a vocabulary and a template, no tokenizer.json)."""
        if not chat_template:
            raise RecipeError(f"no chat template for {name}")
        return cls(SafeTokenizer.from_tokenizer(tokenizer), chat_template, bos_token, eos_token, name=name)

    # -- rendering -------------------------------------------------------------------------------
    def _template_renders_tools(self) -> bool:
        """Whether the template shows the model a tool list (SmolLM2's, Gemma 3's do not)."""
        probe = "deepinfer_probe_tool"
        tools = [{"type": "function", "function": {"name": probe, "description": "", "parameters": {"type": "object"}}}]
        try:
            text = self._template.render(messages=[{"role": "user", "content": "hi"}], tools=tools,
                                         add_generation_prompt=True, bos_token=self.bos_token, eos_token=self.eos_token)
        except Exception:  # noqa: BLE001 - a template that chokes on tools does not render them
            return False
        return probe in text

    def _template_inputs(self, conversation: Conversation, protect) -> dict:
        offered, _ = offered_tools(conversation)
        # A template without tool support gets tools, calls and results written into the
        # messages in the Hermes convention (inline.py); the parser reads calls back the same way.
        if self.renders_tools:
            messages = template_messages(conversation.messages, protect)
        else:
            messages = inline_tool_messages(conversation.messages, offered, protect)
        tools = None
        if offered and self.renders_tools:
            tools = [{"type": "function", "function": {"name": t.name, "description": t.description or "", "parameters": t.parameters or {}}}
                     for t in offered]
        last = conversation.messages[-1] if conversation.messages else None
        continuing = bool(last and last.role == "assistant" and last.prefix)
        inputs = {"messages": messages, "tools": tools, "add_generation_prompt": not continuing,
                  "bos_token": self.bos_token, "eos_token": self.eos_token}
        if conversation.thinking is not None or conversation.reasoning_effort == "none":
            inputs["enable_thinking"] = conversation.thinking_enabled(default=True)
        return inputs

    def tool_constraint(self, conversation: Conversation) -> dict | None:
        tools, forced = offered_tools(conversation)
        return hermes_constraint(tools, parallel_calls(conversation), self.call_tags) if forced else None

    def _render_text(self, inputs: dict) -> str:
        try:
            return self._template.render(**inputs)
        except TemplateError as exc:
            raise RequestError(f"the chat template rejected the conversation: {exc}") from None

    def render(self, conversation: Conversation) -> tuple[RenderedPrompt, ParserStart]:
        protected: list[str] = []

        def protect(value: str) -> str:
            protected.append(value)
            return f"\ue000{len(protected) - 1}\ue001"

        with_sentinels = self._render_text(self._template_inputs(conversation, protect))
        real = self._render_text(self._template_inputs(conversation, lambda v: v))
        swapped = _SENTINEL.sub(lambda m: protected[int(m.group(1))], with_sentinels)
        builder = PromptBuilder()
        tool_strings = _variants(self._tool_strings(conversation))
        if swapped == real and "\ue000" not in "".join(protected):
            cursor = 0
            for match in _SENTINEL.finditer(with_sentinels):
                self._emit_template_text(builder, with_sentinels[cursor : match.start()], tool_strings)
                builder.text(protected[int(match.group(1))])
                cursor = match.end()
            self._emit_template_text(builder, with_sentinels[cursor:], tool_strings)
        else:
            self._emit_template_text(builder, real, _variants(protected) + tool_strings)
        text = builder.build()
        if text.text != real:  # pragma: no cover - construction guarantees it
            raise RecipeError("internal error: rendered text changed while marking control tokens")
        offered, _ = offered_tools(conversation)
        return text, ParserStart("content", False, bool(offered))

    @staticmethod
    def _tool_strings(conversation: Conversation) -> list[str]:
        return [s for t in conversation.tools for s in (t.description, json.dumps(t.parameters, ensure_ascii=False)) if s]

    def _emit_template_text(self, builder: PromptBuilder, text: str, client_strings: list[str]) -> None:
        """Mark added-token spellings in template text as control, except inside client strings."""
        if self._control_pattern is None:
            builder.text(text)
            return
        plain_spans = []
        # Only client strings that spell a control token need masking; masking others (say a
        # one-letter description) would wrongly demote the template's own tokens.
        for value in (v for v in client_strings if self._control_pattern.search(v)):
            start = text.find(value)
            while start >= 0:
                plain_spans.append((start, start + len(value)))
                start = text.find(value, start + 1)
        cursor = 0
        for match in self._control_pattern.finditer(text):
            if any(a < match.end() and match.start() < b for a, b in plain_spans):
                continue
            builder.text(text[cursor : match.start()])
            builder.control(match.group())
            cursor = match.end()
        builder.text(text[cursor:])


def _variants(strings: list[str]) -> list[str]:
    """Each client string as it may appear in a render: raw, or JSON-escaped by `tojson`."""
    out = []
    for value in strings:
        if value:
            out.append(value)
            escaped = json.dumps(value, ensure_ascii=False)[1:-1]
            if escaped != value:
                out.append(escaped)
    return out
