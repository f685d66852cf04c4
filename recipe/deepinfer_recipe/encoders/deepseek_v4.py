"""DeepSeek-V4 and V4.1 prompt rendering (research notes B.2–B.4; deepseek-recipe 0.2.0 output).

Shape of a prompt:
    BOS [<｜System｜> (V4.1)] [effort text] [system text] [\n\n tools] [\n\n response format]
    then each turn: <｜User｜>text | <｜latest_reminder｜>text | <｜System｜>text (V4.1 only)
                    <｜Assistant｜>(<think>reasoning</think> | </think>)content[DSML calls]EOS
    then the generation header <｜Assistant｜><think> (thinking) or <｜Assistant｜></think>.

Every string that came from the client (message text, reasoning, tool names, arguments, results,
schemas) goes through `PromptBuilder.text`, so it is plain text whatever it spells. Only the
template's own markers go through `PromptBuilder.control`. This is where we deliberately differ
from deepseek-recipe, which marks grounding-token spellings (`<｜ref｜>`, `<｜box｜>`, ...) found in
historical assistant content and reasoning as control tokens: a client can put any text into
assistant history, so that would let a client mint control ids.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from ..conversation import Conversation, Message, NamedToolChoice, TextPart, ToolDefinition
from ..errors import RequestError
from ..prompt import PromptBuilder, RenderedPrompt
from ..tokenize import SafeTokenizer, load_deepseek_v4_tokenizer
from ..tools.constraint import dsml_constraint, offered_tools, parallel_calls
from . import deepseek_text as T
from .base import Encoder, OutputMarkers, ParserStart

# Template text is trusted; these spellings inside it are emitted as control tokens.
_TEMPLATE_CONTROLS = re.compile("|".join(re.escape(s) for s in (T.DSML, T.END_THINK, T.THINK)))


def _emit_template(builder: PromptBuilder, template: str) -> None:
    cursor = 0
    for match in _TEMPLATE_CONTROLS.finditer(template):
        builder.text(template[cursor : match.start()])
        builder.control(match.group())
        cursor = match.end()
    builder.text(template[cursor:])


@dataclass
class _Turn:
    """A normalized turn. `body` holds (is_control, text) pieces for user-like turns."""

    kind: str  # "user" | "reminder" | "system" | "assistant"
    body: list[tuple[bool, str]] = field(default_factory=list)
    message: Message | None = None
    # For user turns: (tool_call_id or None, number of body pieces) per merged block, so tool
    # results can be put back into the calling order.
    blocks: list[tuple[str | None, int]] = field(default_factory=list)


def tool_schema_line(tool: ToolDefinition) -> str:
    return json.dumps(
        {"name": tool.name, "description": tool.description or "", "parameters": tool.parameters or {}},
        ensure_ascii=False,
    )


def tool_call_parameters(arguments: str) -> list[tuple[str, str, bool]]:
    """(name, value text, is_string) for each parameter of a historical call's arguments.

    A JSON object gives one parameter per key; anything else (invalid JSON, a non-object) is
    passed through as one string parameter named `arguments`, as DeepSeek's renderer does."""
    try:
        parsed = json.loads(arguments)
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        return [("arguments", arguments, True)]
    params = []
    for key, value in parsed.items():
        if isinstance(value, str):
            params.append((key, value, True))
        else:
            params.append((key, json.dumps(value, ensure_ascii=False), False))
    return params


class DeepSeekV4Encoder(Encoder):
    name = "deepseek-v4"
    dsml_names = T.V4_DSML
    has_system_token = False  # V4: system text is raw after BOS; mid-conversation systems hoisted
    image_placeholder = False  # V4: images become "[Unsupported Image]" text

    def __init__(self, tokenizer: SafeTokenizer | None = None, load_default_tokenizer: bool = True):
        if tokenizer is None and load_default_tokenizer:
            tokenizer = load_deepseek_v4_tokenizer()
        self.tokenizer = tokenizer
        self.markers = OutputMarkers(
            end_of_turn=(T.EOS,),
            think_start=T.THINK,
            think_end=T.END_THINK,
            dsml=T.DSML,
            dsml_calls=self.dsml_names.calls,
            dsml_invoke=self.dsml_names.invoke,
            dsml_parameter=self.dsml_names.parameter,
        )

    def effort_text(self, effort: str | None) -> str:
        return T.v4_effort_text(effort)

    def tool_constraint(self, conversation: Conversation) -> dict | None:
        tools, forced = offered_tools(conversation)
        if not forced:
            return None
        names = self.dsml_names
        return dsml_constraint(tools, parallel_calls(conversation), T.DSML, names.invoke, names.calls,
                               v41=names is T.V41_DSML)

    # -- conversation → turns ------------------------------------------------------------------
    def _content_pieces(self, message: Message) -> list[tuple[bool, str]]:
        """Content parts joined by a blank line; an image is a placeholder (V4.1) or text (V4)."""
        pieces: list[tuple[bool, str]] = []
        for index, part in enumerate(message.content):
            if index:
                pieces.append((False, "\n\n"))
            if isinstance(part, TextPart):
                pieces.append((False, part.text))
            elif self.image_placeholder:
                pieces.append((True, T.IMAGE))
            else:
                pieces.append((False, T.UNSUPPORTED_IMAGE))
        return pieces

    def _turns(self, messages: list[Message]) -> tuple[str, bool, list[_Turn]]:
        system_texts: list[str] = []
        turns: list[_Turn] = []
        leading = True
        if not self.has_system_token:
            messages = _merge_user_runs(messages)
        for message in messages:
            # V4 hoists every system message to the top. V4.1 puts only a first-message system
            # (or developer) there; later system and developer messages are `<｜System｜>` turns in
            # place. (The difference shows when an effort prefix opens the system block.)
            system_like = message.role == "system" or (message.role == "developer" and self.has_system_token)
            if (message.role == "system" and not self.has_system_token) or (system_like and leading):
                system_texts.append(message.text)
                leading = False
                continue
            leading = False
            if system_like:
                turns.append(_Turn("system", self._content_pieces(message)))
            elif message.role in ("user", "developer"):
                self._append_user(turns, self._content_pieces(message))
            elif message.role == "tool":
                result = [(False, "<tool_result>")] + self._content_pieces(message) + [(False, "</tool_result>")]
                self._append_user(turns, result, tool_call_id=message.tool_call_id)
            elif message.role == "latest_reminder":
                turns.append(_Turn("reminder", [(False, message.text)]))
            else:
                turns.append(_Turn("assistant", message=message))
        self._sort_tool_results(turns)
        # V4 joins the hoisted system texts, skipping empty ones. V4.1 has at most one leading
        # system message, and it opens a `<｜System｜>` block even when empty.
        texts = system_texts if self.has_system_token else [t for t in system_texts if t]
        return "\n\n".join(texts), bool(system_texts), turns

    @staticmethod
    def _append_user(turns: list[_Turn], pieces, tool_call_id: str | None = None) -> None:
        # Consecutive user-like messages (user text, tool results) form one user turn.
        if turns and turns[-1].kind == "user":
            turns[-1].body.append((False, "\n\n"))
            turns[-1].body.extend(pieces)
        else:
            turns.append(_Turn("user", list(pieces)))
        turns[-1].blocks.append((tool_call_id, len(pieces)))

    def _sort_tool_results(self, turns: list[_Turn]) -> None:
        """Tool results in a user turn are reordered to the preceding assistant's call order."""
        for index, turn in enumerate(turns):
            blocks = turn.blocks
            if turn.kind != "user" or not any(call_id for call_id, _ in blocks) or index == 0 or turns[index - 1].kind != "assistant":
                continue
            call_order = {call.id: n for n, call in enumerate(turns[index - 1].message.tool_calls)}
            # Split the body back into its blocks (each followed by a "\n\n" joiner except the last).
            chunks, cursor = [], 0
            for n, (call_id, size) in enumerate(blocks):
                chunks.append((call_id, turn.body[cursor : cursor + size]))
                cursor += size + (1 if n < len(blocks) - 1 else 0)
            results = [c for c in chunks if c[0] is not None]
            others = [c for c in chunks if c[0] is None]
            results.sort(key=lambda c: call_order.get(c[0], len(call_order)))
            body: list[tuple[bool, str]] = []
            for n, (_, pieces) in enumerate(results + others):
                if n:
                    body.append((False, "\n\n"))
                body.extend(pieces)
            turn.body = body

    # -- rendering -------------------------------------------------------------------------------
    def render(self, conversation: Conversation) -> tuple[RenderedPrompt, ParserStart]:
        thinking = conversation.thinking_enabled(default=True)
        choice = conversation.tool_choice
        forced = choice == "required" or isinstance(choice, NamedToolChoice)
        if forced and thinking:
            raise RequestError("thinking mode does not support a forced tool_choice", "tool_choice")
        tools = [] if choice == "none" else list(conversation.tools)
        if isinstance(choice, NamedToolChoice):
            tools = [t for t in tools if t.name == choice.name]
            if not tools:
                raise RequestError(f"tool_choice names an undefined tool {choice.name!r}", "tool_choice")
        if forced and not tools:
            raise RequestError("tool_choice requires tools", "tool_choice")
        fmt = conversation.response_format
        if fmt.type == "json_object" and not _mentions_json(conversation):
            raise RequestError(
                "the prompt must contain the word 'json' to use response_format json_object",
                "response_format",
            )

        system_text, has_system_message, turns = self._turns(conversation.messages)
        b = PromptBuilder().control(T.BOS)
        system_block = PromptBuilder()
        if thinking:
            system_block.text(self.effort_text(conversation.reasoning_effort))
        system_block.text(system_text)
        if tools:
            system_block.text("\n\n")
            _emit_template(system_block, T.tools_instructions(self.dsml_names))
            system_block.text("\n".join(tool_schema_line(t) for t in tools))
            system_block.text(T.TOOLS_FOOTER)
        if fmt.type == "json_schema" and fmt.schema is not None:
            system_block.text("\n\n" + T.RESPONSE_SCHEMA_HEADER + json.dumps(fmt.schema, ensure_ascii=False))
        elif fmt.type == "json_object" and self.has_system_token:
            # deepseek-recipe's V4.1 renders json_object as a schema line of {"type": "json_object"}.
            system_block.text("\n\n" + T.RESPONSE_SCHEMA_HEADER + json.dumps({"type": "json_object"}))
        elif fmt.type == "json_object":
            system_block.text("\n\n" + T.JSON_OBJECT_INSTRUCTIONS)
        system = system_block.build()
        if (system.text or has_system_message) and self.has_system_token:
            b.control(T.SYSTEM)
        _append_rendered(b, system)

        # With tools in play an agent loop keeps the reasoning of every turn. Without tools every
        # assistant turn of the request is history (a new turn follows it), so its reasoning is
        # dropped; only a prefix continuation keeps it (deepseek-recipe renders it that way).
        keep_all_reasoning = bool(tools)
        start = ParserStart("reasoning" if thinking else "content", False, bool(tools))
        for index, turn in enumerate(turns):
            if turn.kind == "user":
                b.control(T.USER)
            elif turn.kind == "reminder":
                b.control(T.LATEST_REMINDER)
            elif turn.kind == "system":
                b.control(T.SYSTEM)
            if turn.kind != "assistant":
                for is_control, text in turn.body:
                    b.control(text) if is_control else b.text(text)
                continue
            is_last = index == len(turns) - 1
            keep = thinking and (keep_all_reasoning or (turn.message.prefix and is_last))
            start = self._render_assistant(b, turn.message, keep, is_last, start)
            if turn.message.prefix and is_last:
                return b.build(), start
        if not conversation.add_generation_prompt:
            return b.build(), start
        b.control(T.ASSISTANT).control(T.THINK if thinking else T.END_THINK)
        if forced:
            b.text("\n\n<").control(T.DSML).text(self.dsml_names.calls + ">\n")
            start = ParserStart("tool_calls", False, True)
        return b.build(), start

    def _render_assistant(self, b: PromptBuilder, m: Message, keep: bool, is_last: bool, start: ParserStart):
        b.control(T.ASSISTANT).control(T.THINK if keep else T.END_THINK)
        prefix = m.prefix and is_last
        content = m.text
        if keep:
            b.text(m.reasoning or "")
            if prefix and not content and not m.tool_calls:
                return ParserStart("reasoning", True, start.parse_tool_calls)
            b.control(T.END_THINK)
        b.text(content)
        if m.tool_calls:
            self._render_tool_calls(b, m)
        if prefix:
            return ParserStart("content", True, start.parse_tool_calls)
        b.control(T.EOS)
        return start

    def _render_tool_calls(self, b: PromptBuilder, m: Message) -> None:
        names = self.dsml_names
        b.text("\n\n<").control(T.DSML).text(names.calls + ">\n")
        for n, call in enumerate(m.tool_calls):
            if n:
                b.text("\n")
            b.text("<").control(T.DSML).text(f'{names.invoke} name="').text(call.name).text('">\n')
            params = tool_call_parameters(call.arguments)
            for k, (key, value, is_string) in enumerate(params):
                if k and self.dsml_names is T.V41_DSML:
                    b.text("\n")
                b.text("<").control(T.DSML).text(f'{names.parameter} name="').text(key)
                b.text(f'" string="{"true" if is_string else "false"}">').text(value)
                b.text("</").control(T.DSML).text(names.parameter + ">")
                if self.dsml_names is T.V4_DSML:
                    b.text("\n")
            if self.dsml_names is T.V41_DSML:
                b.text("\n")
            b.text("</").control(T.DSML).text(names.invoke + ">")
        b.text("\n</").control(T.DSML).text(names.calls + ">")


class DeepSeekV41Encoder(DeepSeekV4Encoder):
    """V4.1: `<｜System｜>` token, in-place mid-conversation systems, numeric effort, image
    placeholders, DSML tag names with a leading space. Its tokenizer is not published, so
    `token_ids` is None unless a tokenizer.json is passed in."""

    name = "deepseek-v4.1"
    dsml_names = T.V41_DSML
    has_system_token = True
    image_placeholder = True

    def __init__(self, tokenizer: SafeTokenizer | None = None):
        super().__init__(tokenizer, load_default_tokenizer=False)

    def effort_text(self, effort: str | None) -> str:
        return T.v41_effort_text(effort)


def _is_empty(message: Message) -> bool:
    return all(isinstance(p, TextPart) and not p.text for p in message.content)


_USER_LIKE = ("user", "developer")  # V4 renders a developer message as a user turn


def _merge_user_runs(messages: list[Message]) -> list[Message]:
    """DeepSeek-V4 (as deepseek-recipe renders it): consecutive user messages, ignoring the system
    messages between them (those are hoisted), become one user message whose text joins the
    non-empty ones. An empty user message after another one therefore adds nothing, where V4.1
    keeps a blank block."""
    out: list[Message] = []
    previous: int | None = None  # index in `out` of the last non-system message
    for message in messages:
        if message.role == "system":
            out.append(message)
            continue
        if message.role in _USER_LIKE and previous is not None and out[previous].role in _USER_LIKE:
            if not _is_empty(message):
                before = out[previous]
                content = message.content if _is_empty(before) else before.content + message.content
                out[previous] = Message(before.role, list(content))
            continue
        out.append(message)
        previous = len(out) - 1
    return out


def _append_rendered(b: PromptBuilder, rendered: RenderedPrompt) -> None:
    for is_control, text in rendered.segments():
        b.control(text) if is_control else b.text(text)


def _mentions_json(conversation: Conversation) -> bool:
    return any("json" in m.text.lower() for m in conversation.messages)
