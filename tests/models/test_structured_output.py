"""Structured output with the embedded SmolLM2-135M-Instruct: every constrained output is valid.

One `LLM()` serves the module. Each test batches its prompts into a single `generate`/`chat`
call and mixes the sampling modes (greedy, temperature, top-p, top-k, n > 1), because the mask
must hold for all of them: a token outside the grammar must never be sampled.
"""

from __future__ import annotations

import json
import re
import time

import jsonschema
import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.sampling_params import StructuredOutputsParams
from deepinfer.types.request import Request, RequestStatus
from tests.models.structured_schemas import SCHEMAS

# Greedy, plain temperature, nucleus, top-k with n=2: cycled over the prompts.
MODES = [dict(temperature=0), dict(temperature=0.8, seed=1), dict(temperature=1.0, top_p=0.9, seed=2),
         dict(temperature=0.7, top_k=20, n=2, seed=3)]


@pytest.fixture(scope="module")
def llm():
    return LLM()


def _chat(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


def _params(i: int, max_tokens: int, **constraint) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(**constraint),
                          **MODES[i % len(MODES)])


def test_json_schemas_all_parse_and_validate(llm):
    conversations = [_chat(f"Reply with JSON describing {what}.") for what, _ in SCHEMAS]
    params = [_params(i, 200, json=schema) for i, (_, schema) in enumerate(SCHEMAS)]
    outputs = llm.chat(conversations, params, use_tqdm=False)
    checked = 0
    for (what, schema), out in zip(SCHEMAS, outputs):
        for completion in out.outputs:
            assert completion.finish_reason == "stop", (what, completion.text)
            value = json.loads(completion.text)
            jsonschema.validate(value, schema)
            checked += 1
    assert checked == len(SCHEMAS) + sum(1 for i in range(len(SCHEMAS)) if MODES[i % len(MODES)].get("n"))


def test_regex_choice_and_json_object(llm):
    patterns = [r"\d{3}-\d{3}-\d{4}", r"[A-Z][a-z]{2,8}", r"(yes|no), because [a-z ]{5,30}\.",
                r"#[0-9a-f]{6}", r"\d{4}-\d{2}-\d{2}", r"(red|green|blue)( and (red|green|blue))?"]
    choices = [["Paris", "London", "Rome"], ["positive", "negative"], ["A", "B", "C", "D"], ["true", "false"]]
    prompts = ([f"Write a phone number, a name, an answer, a color, a date or colors: {p}" for p in patterns]
               + ["Which city is the capital of France?", "Sentiment of 'great movie!'",
                  "Pick an answer.", "Is water wet?", 'A cat as JSON: {"name": "Tom", "age": 3}\nA dog as JSON:'])
    params = ([_params(i, 40, regex=p) for i, p in enumerate(patterns)]
              + [_params(i, 10, choice=c) for i, c in enumerate(choices)]
              + [_params(0, 120, json_object=True, disable_any_whitespace=True)])
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for pattern, out in zip(patterns, outputs):
        for completion in out.outputs:
            assert re.fullmatch(pattern, completion.text), (pattern, completion.text)
    for choice, out in zip(choices, outputs[len(patterns):]):
        for completion in out.outputs:
            assert completion.text in choice
    value = json.loads(outputs[-1].outputs[0].text)
    assert isinstance(value, dict)


# Arithmetic with parentheses (recursive); checked below by a recursive-descent parser of the
# same language. Operator chains are bounded so a small model's output ends within max_tokens.
ARITHMETIC = r'''
root ::= expr
expr ::= term (("+" | "-") term)? (("+" | "-") term)?
term ::= factor (("*" | "/") factor)?
factor ::= number | "(" expr ")"
number ::= [1-9] [0-9]? | "0"
'''
# A list of key=value settings, one per line.
SETTINGS = r'''
root ::= line line? line?
line ::= key "=" value "\n"
key ::= [a-z] [a-z_]{0,11}
value ::= [0-9]{1,5} | "true" | "false" | "\"" [a-zA-Z ]{0,20} "\""
'''


def _parse_arithmetic(text: str) -> None:
    pos = 0

    def expect(cond: bool) -> None:
        assert cond, f"not in the grammar at {pos}: {text!r}"

    def number() -> None:
        nonlocal pos
        m = re.match(r"0|[1-9][0-9]?", text[pos:])
        expect(m is not None)
        pos += m.end()

    def factor() -> None:
        nonlocal pos
        if text[pos:pos + 1] == "(":
            pos += 1
            expr()
            expect(text[pos:pos + 1] == ")")
            pos += 1
        else:
            number()

    def term() -> None:
        nonlocal pos
        factor()
        if text[pos:pos + 1] in ("*", "/") and pos < len(text):
            pos += 1
            factor()

    def expr() -> None:
        nonlocal pos
        term()
        for _ in range(2):
            if text[pos:pos + 1] in ("+", "-") and pos < len(text):
                pos += 1
                term()

    expr()
    expect(pos == len(text))


def test_ebnf_outputs_parse_with_the_grammar(llm):
    prompts = ["Write an arithmetic expression:", "Compute (3+4)*2 as an expression:",
               "Write settings for a web server:", "Config:"]
    params = [_params(0, 40, grammar=ARITHMETIC), _params(1, 40, grammar=ARITHMETIC),
              _params(2, 60, grammar=SETTINGS), _params(3, 60, grammar=SETTINGS)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for out in outputs[:2]:
        for completion in out.outputs:
            assert completion.finish_reason == "stop"
            _parse_arithmetic(completion.text)
    settings_line = re.compile(r'[a-z][a-z_]{0,11}=([0-9]{1,5}|true|false|"[a-zA-Z ]{0,20}")\n')
    for out in outputs[2:]:
        for completion in out.outputs:
            assert completion.finish_reason == "stop"
            lines = completion.text.splitlines(keepends=True)
            assert 1 <= len(lines) <= 3 and all(settings_line.fullmatch(line) for line in lines), completion.text


def test_invalid_constraints_are_rejected_with_the_reason(llm):
    bad = [({"json": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}, "missing"),
           ({"json": "{not json"}, "not valid JSON"),
           ({"regex": "a(b"}, "regex"),
           ({"grammar": "root ::= undefined_rule"}, "undefined_rule")]
    for constraint, reason in bad:
        with pytest.raises(ValueError, match=reason):
            llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputsParams(**constraint)),
                         use_tqdm=False)
    assert not llm.engine.has_unfinished()


def _slow_schema(num_properties: int) -> dict:
    """Bounded string repeats make xgrammar precompute large automata: seconds on 2 CPU cores."""
    return {"type": "object", "required": [f"k{i}" for i in range(num_properties)],
            "properties": {f"k{i}": {"type": "string", "pattern": f"[a-z]{{1,{60 + i}}}"}
                           for i in range(num_properties)}}


def _add(llm: LLM, prompt: str, params: SamplingParams) -> str:
    text, ids, params, images = llm._prepare(prompt, params)
    return llm._add_request(text, ids, params, 0, None, images=images)


def test_slow_compile_does_not_delay_others_and_timeout_fails_alone(llm):
    engine = llm.engine
    slow = _add(llm, "Fill the form:", SamplingParams(
        temperature=0, max_tokens=4, structured_outputs=StructuredOutputsParams(json=_slow_schema(40))))
    timed_out = _add(llm, "Fill the form:", SamplingParams(
        temperature=0, max_tokens=4,
        structured_outputs=StructuredOutputsParams(json=_slow_schema(41), compile_timeout_s=0.2)))
    free = _add(llm, "The capital of France is", SamplingParams(temperature=0, max_tokens=8))
    slow_request: Request = engine.scheduler.requests[slow]
    finished, slow_status_when_free_done = {}, None
    start = time.monotonic()
    while engine.has_unfinished():
        for out in llm._step():
            if out.finished:
                finished[out.request_id] = out
                if out.request_id == free:
                    slow_status_when_free_done = slow_request.status
        assert time.monotonic() - start < 120
    # The unconstrained request ran to completion while the slow grammar was still compiling.
    assert finished[free].outputs[0].finish_reason == "length"
    assert slow_status_when_free_done is RequestStatus.WAITING_FOR_GRAMMAR
    # The timed-out request failed alone, with a clear reason; the slow one then ran normally.
    assert finished[timed_out].outputs[0].finish_reason == "abort"
    assert "timed out after 0.2 s" in finished[timed_out].error
    assert finished[slow].error is None and finished[slow].outputs[0].finish_reason == "length"
    assert finished[slow].outputs[0].text.startswith('{"k0": "') or finished[slow].outputs[0].text.startswith('{')
