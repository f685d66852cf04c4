"""Any other model: its Hugging Face chat template (jinja2, sandboxed), made injection-safe.

A chat template renders one string, so the control tokens have to be found afterwards. Every
client string (message text, reasoning, tool names, descriptions, schemas, arguments, results,
call ids) goes into the template through `protect`. The real render gives the text; another
render, with the client strings hidden behind placeholders (client_text.py), tells which
characters the template wrote: only there are added-token spellings control tokens. A client
string therefore never becomes a control token, and the template's own tokens always are,
whatever the client spelled: we never search the render for the client's strings. (Only a
template that acts on what the client spelled, e.g. splits content at a spelled "</think>", gets
a prompt that differs from its real render: it is rendered with those spellings as plain text.)
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from ..conversation import Conversation
from ..errors import RecipeError, RequestError
from ..prompt import RenderedPrompt
from ..tokenize import SafeTokenizer
from ..tools.constraint import HermesTags, hermes_constraint, offered_tools, parallel_calls
from .base import Encoder, OutputMarkers, ParserStart
from .client_text import ControlSpellings, HideAll, HideSpellings, mark_controls
from .inline import inline_tool_messages, protect_tree, template_messages

# <|eom_id|>: Llama 3.1 ends a turn that calls a tool with it ("end of message") instead of <|eot_id|>.
_END_OF_TURN_CANDIDATES = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<|endoftext|>")


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
        self._spellings = ControlSpellings(t.content for i, t in tokenizer.full.get_added_tokens_decoder().items()
                                           if i in tokenizer.control_ids)
        # Characters placeholders must not be: the template's own may end up in its output.
        self._template_chars = set(chat_template) | set(self.bos_token) | set(self.eos_token)
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
    def from_directory(cls, path: str | Path, tokenizer_path: str | None = None) -> HFTemplateEncoder:
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
                       eos_token: str | None = None, name: str = "hf") -> HFTemplateEncoder:
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
            tools = [{"type": "function", "function": {"name": protect(t.name), "description": protect(t.description or ""),
                                                       "parameters": protect_tree(t.parameters or {}, protect)}}
                     for t in offered]
        last = conversation.messages[-1] if conversation.messages else None
        continuing = bool(last and last.role == "assistant" and last.prefix)
        inputs = {"messages": messages, "tools": tools,
                  "add_generation_prompt": conversation.add_generation_prompt and not continuing,
                  "bos_token": self.bos_token, "eos_token": self.eos_token}
        if conversation.thinking is not None or conversation.reasoning_effort == "none":
            inputs["enable_thinking"] = conversation.thinking_enabled(default=True)
        for key, value in conversation.template_kwargs.items():
            if key in inputs:   # what the conversation itself says is not the client's to replace
                raise RequestError(f"chat_template_kwargs.{key} is set from the request itself; drop it",
                                   f"chat_template_kwargs.{key}")
            inputs[key] = protect_tree(value, protect)   # client text, like any other
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
        client: list[str] = []

        def collect(value: str) -> str:
            client.append(value)
            return value

        real = self._render_text(self._template_inputs(conversation, collect))
        offered, _ = offered_tools(conversation)
        rendered = self._mark_controls(conversation, real, client)
        last = conversation.messages[-1] if conversation.messages else None
        continuing = bool(last and last.role == "assistant" and last.prefix)
        if continuing:
            rendered = _cut_after(rendered, last.text)
        return rendered, ParserStart("content", continuing, bool(offered))

    def _mark_controls(self, conversation: Conversation, real: str, client: list[str]) -> RenderedPrompt:
        """The real render with the template's control tokens marked (see the module docstring)."""
        if self._spellings.pattern is None:
            return RenderedPrompt(real)
        client_chars = set().union(*client)
        taken = self._template_chars | client_chars
        fallback = None
        for make_hiding in (lambda: HideAll(client_chars, taken), lambda: HideSpellings(self._spellings, taken)):
            try:
                hiding = make_hiding()
            except RequestError:
                continue  # not enough placeholders to hide every character: try the other way
            hidden = self._render_hidden(conversation, hiding)
            if hidden is None:
                continue
            if hiding.restore(hidden) == real:
                return mark_controls(hidden, hiding.restore, self._spellings.pattern)
            fallback = hidden, hiding
        if fallback is None:
            raise RequestError("the chat template cannot render this conversation with its control-token spellings as text")
        # The template's output depends on what the client spelled (it looked for a spelled
        # control token, say splitting content at "</think>"). Use the render in which it saw
        # the spellings as the plain text they are; only there does it differ from the real one.
        hidden, hiding = fallback
        return mark_controls(hidden, hiding.restore, self._spellings.pattern)

    def _render_hidden(self, conversation: Conversation, hiding) -> str | None:
        """The render with every client string hidden; None if the template then fails (it
        inspected the strings and rejects what it saw, e.g. ids of the wrong shape)."""
        try:
            return self._template.render(**self._template_inputs(conversation, hiding.hide))
        except Exception:  # noqa: BLE001 - any failure means only "this hiding does not fit"
            return None


def _cut_after(rendered: RenderedPrompt, final: str) -> RenderedPrompt:
    """The prompt up to the end of the final message's text: a continued assistant turn
    (DeepSeek's `prefix`, vLLM's continue_final_message) must not be closed by the template's
    end-of-turn. As transformers does it: the last place the text (as the template may have
    trimmed it) appears in the render."""
    if not final.strip():
        raise RequestError("a continued final assistant message needs text to continue", "messages")
    at = rendered.text.rfind(final.strip())
    if at < 0:
        raise RequestError("the chat template does not show the final message's text, so it cannot be continued",
                           "messages")
    kept = final.lstrip() if rendered.text.startswith(final.lstrip(), at) else final.strip()
    end = at + len(kept)
    return RenderedPrompt(rendered.text[:end], [r for r in rendered.control_ranges if r[1] <= end])
