"""The fixed strings of the DeepSeek-V4 / V4.1 prompt formats, and DSML spellings.

These are facts of the model's training format (observed in DeepSeek's release renderer and in
deepseek-recipe 0.2.0 output), kept apart from the rendering logic so both the encoder and the
output parser read the same spellings.
"""

from __future__ import annotations

from dataclasses import dataclass

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
SYSTEM = "<｜System｜>"  # V4.1 only; not in the published V4 tokenizer
LATEST_REMINDER = "<｜latest_reminder｜>"
THINK = "<think>"
END_THINK = "</think>"
DSML = "｜DSML｜"
IMAGE = "<｜image｜>"


@dataclass(frozen=True)
class DsmlNames:
    """Tag names after the `｜DSML｜` token; V4.1 writes them with a leading space."""

    calls: str
    invoke: str
    parameter: str


V4_DSML = DsmlNames(calls="tool_calls", invoke="invoke", parameter="parameter")
V41_DSML = DsmlNames(calls=" calls", invoke=" invoke", parameter=" parameter")

V4_EFFORT_HIGH = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to "
    "resolve the root cause, rigorously stress-testing your logic against all potential paths, "
    "edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, "
    "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left "
    "unchecked.\n\n"
)
V4_EFFORT_MAX = (
    "Reasoning Effort: Beyond maximum \u2014 exhaustive, relentless, and uncompromising.\n"
    "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: "
    "exhaustively decompose the problem into its most fundamental components, trace every causal "
    "chain to its root, and resolve the underlying cause rather than any surface symptom.\n"
    "Do not stop reasoning until you have independently verified the solution from multiple "
    "angles and are certain that no assumption remains unchecked and no error remains "
    "undiscovered.\n\n"
)


def v4_effort_text(effort: str | None) -> str:
    """V4-Flash-0731 semantics, as deepseek-recipe 0.2.0 renders them (see research B.4)."""
    if effort in ("low", "minimal"):
        return ""
    if effort == "max":
        return V4_EFFORT_MAX
    return V4_EFFORT_HIGH  # None, medium, high, xhigh


def v41_effort_text(effort: str | None) -> str:
    """V4.1 numeric effort, deepseek-recipe 0.2.0 mapping (low 50, default 75, max 100)."""
    level = {"low": 50, "minimal": 50, "max": 100}.get(effort or "", 75)
    return (
        f"Reasoning Effort: {level} (range 1-100, the higher the value, the more thorough the "
        "reasoning)\n\n"
    )


def tools_instructions(names: DsmlNames) -> str:
    """The tools preamble up to (not including) the schema lines. Contains DSML/think spellings
    that the encoder emits as control tokens; everything else is plain text."""
    d = DSML
    return (
        "## Tools\n\n"
        "You have access to a set of tools to help answer the user's question. You can invoke "
        f'tools by writing a "<{d}{names.calls}>" block like the following:\n\n'
        f"<{d}{names.calls}>\n"
        f'<{d}{names.invoke} name="$TOOL_NAME">\n'
        f'<{d}{names.parameter} name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE'
        f"</{d}{names.parameter}>\n"
        "...\n"
        f"</{d}{names.invoke}>\n"
        f'<{d}{names.invoke} name="$TOOL_NAME2">\n'
        "...\n"
        f"</{d}{names.invoke}>\n"
        f"</{d}{names.calls}>\n\n"
        'String parameters should be specified as is and set `string="true"`. For all other '
        "types (numbers, booleans, arrays, objects), pass the value in JSON format and set "
        '`string="false"`.\n\n'
        f"If thinking_mode is enabled (triggered by {THINK}), you MUST output your complete "
        f"reasoning inside {THINK}...{END_THINK} BEFORE any tool calls or final response.\n\n"
        f"Otherwise, output directly after {END_THINK} with tool calls or final response.\n\n"
        "### Available Tool Schemas\n\n"
    )


TOOLS_FOOTER = (
    "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke "
    "tool calls.\n"
)
RESPONSE_SCHEMA_HEADER = (
    "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
)
JSON_OBJECT_INSTRUCTIONS = (
    "You are a helpful assistant designed to output JSON.\n## Response Format:\n\n"
    "Reply with JSON object ONLY."
)
UNSUPPORTED_IMAGE = "[Unsupported Image]"
