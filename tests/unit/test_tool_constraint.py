"""The recipe's forced-tool-call constraints, compiled by xgrammar against real tokenizers.

The constraint must accept exactly what the output parser reads back as a call: the Hermes text
for HF templates, and for DeepSeek-V4/V4.1 the DSML invoke blocks as the encoder itself renders
them (so a model that writes calls the way its prompt shows them is inside the grammar). The
DeepSeek check runs at token level with the V4 tokenizer: the DSML marker the parser acts on is
a control token, and the grammar must let the model emit that id.
"""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr
from deepinfer_recipe import Message, TextPart, ToolCall, get_encoder, parse_request
from deepinfer_recipe.conversation import Conversation, NamedToolChoice, ToolDefinition
from deepinfer_recipe.encoders.inline import call_text
from deepinfer_recipe.tokenize import deepseek_v4_tokenizer_path
from deepinfer_recipe.tools.constraint import hermes_constraint

from deepinfer.sample.structured.backend import make_tokenizer_info
from deepinfer.tokenizer import Tokenizer

WEATHER = ToolDefinition("get_weather", "weather", {
    "type": "object", "required": ["city", "days"], "additionalProperties": False,
    "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 7}}})
TIME = ToolDefinition("get_time", "time", {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}})


def accepts(constraint: dict, text: str) -> bool:
    """Whether the grammar accepts all of `text` and may end there (character level)."""
    matcher = xgr.testing._get_matcher_from_grammar(xgr.Grammar.from_structural_tag(json.dumps(constraint)))
    return matcher.accept_string(text) and matcher.is_terminated()


def test_hermes_constraint_accepts_calls_and_only_valid_ones():
    constraint = hermes_constraint([WEATHER, TIME], parallel=True)
    paris = call_text("get_weather", '{"city": "Paris", "days": 2}')
    assert accepts(constraint, paris)
    assert accepts(constraint, paris + "\n" + call_text("get_time", '{"tz": "UTC"}'))
    assert not accepts(constraint, "")                                                 # a call is required
    assert not accepts(constraint, "Sure. " + paris)                                   # nothing else
    assert not accepts(constraint, call_text("get_weather", '{"city": "Paris"}'))     # required field
    assert not accepts(constraint, call_text("get_weather", '{"city": "Paris", "days": 9}'))  # maximum
    assert not accepts(constraint, call_text("get_news", '{"city": "Paris", "days": 2}'))     # no such tool
    single = hermes_constraint([WEATHER, TIME], parallel=False)
    assert accepts(single, paris) and not accepts(single, paris + "\n" + paris)


def dsml_call_text(encoder_format: str) -> tuple[str, str]:
    """(what the encoder renders for one historical call after `<DSML calls>\\n`, the DSML spelling)."""
    encoder = get_encoder(encoder_format)
    call = ToolCall("c1", "get_weather", json.dumps({"city": "Köln", "days": 3}))
    conversation = Conversation([Message("user", [TextPart("q")]), Message("assistant", [], tool_calls=[call]),
                                 Message("user", [TextPart("again")])], tools=[WEATHER], thinking=False)
    text = encoder.encode(conversation).rendered.text
    names = encoder.dsml_names
    opening = f"<｜DSML｜{names.calls}>\n"
    closing = f"</｜DSML｜{names.calls}>"
    start = text.index(opening, text.index("<｜User｜>q")) + len(opening)
    return text[start: text.index(closing, start) + len(closing)], opening


@pytest.mark.parametrize("encoder_format", ["deepseek-v4", "deepseek-v4.1"])
def test_dsml_constraint_accepts_what_the_encoder_renders(encoder_format):
    encoder = get_encoder(encoder_format)
    body = {"messages": [{"role": "user", "content": "weather?"}], "thinking": {"type": "disabled"},
            "tools": [{"type": "function", "function": {"name": WEATHER.name, "parameters": WEATHER.parameters}}],
            "tool_choice": "required"}
    encoding = encoder.encode(parse_request("chat", body))
    rendered, opening = dsml_call_text(encoder_format)
    assert encoding.rendered.text.endswith(opening)          # the forced prompt opened the block
    assert accepts(encoding.constraint, rendered)
    assert not accepts(encoding.constraint, rendered.replace("get_weather", "get_news"))
    assert not accepts(encoding.constraint, rendered.replace('string="false">3', 'string="false">"3"'))


def test_dsml_constraint_at_token_level_with_the_v4_tokenizer():
    encoder = get_encoder("deepseek-v4")
    tokenizer = Tokenizer.from_file(str(deepseek_v4_tokenizer_path()),
                                    tokenizer_config={"eos_token": "<｜end▁of▁sentence｜>"})
    info = make_tokenizer_info(tokenizer, tokenizer.backend.get_vocab_size())
    conversation = Conversation([Message("user", [TextPart("weather?")])], tools=[WEATHER],
                                tool_choice=NamedToolChoice("get_weather"), thinking=False)
    encoding = encoder.encode(conversation)
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_structural_tag(json.dumps(encoding.constraint)))
    rendered, _ = dsml_call_text("deepseek-v4")
    # The model's ids for the block: the DSML marker as its control id, the rest as plain text.
    dsml = encoder.tokenizer.control_id("｜DSML｜")
    pieces = rendered.split("｜DSML｜")
    ids = encoder.tokenizer.encode_plain(pieces[0])
    for piece in pieces[1:]:
        ids += [dsml] + encoder.tokenizer.encode_plain(piece)
    for token_id in ids:
        assert matcher.accept_token(token_id), encoder.tokenizer.decode([token_id])
    assert matcher.accept_token(next(iter(tokenizer.eos_token_ids))) and matcher.is_terminated()


def test_hermes_tag_tokens_at_token_level(tmp_path):
    """With `<tool_call>` / `</tool_call>` as tokens, the grammar admits the tag ids (which the
    parser acts on) and not the same tags spelled with ordinary tokens."""
    data = json.loads(deepseek_v4_tokenizer_path().read_text(encoding="utf-8"))
    for offset, content in enumerate(("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>")):
        data["added_tokens"].append({"id": 129280 + offset, "content": content, "single_word": False, "lstrip": False,
                                     "rstrip": False, "normalized": False, "special": True})
    (tmp_path / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages[0].content }}",
                                                                "eos_token": "<|im_end|>"}), encoding="utf-8")
    encoder = get_encoder(f"hf:{tmp_path}")
    constraint = encoder.tool_constraint(Conversation([Message("user", [TextPart("q")])], tools=[WEATHER, TIME],
                                                      tool_choice="required"))
    tokenizer = Tokenizer.from_file(str(tmp_path / "tokenizer.json"), tokenizer_config={"eos_token": "<|im_end|>"})
    compiled = xgr.GrammarCompiler(make_tokenizer_info(tokenizer, tokenizer.backend.get_vocab_size())).compile_structural_tag(
        json.dumps(constraint))
    body = call_text("get_weather", '{"city": "Paris", "days": 2}')[len("<tool_call>"):-len("</tool_call>")]
    ids = [129282] + encoder.tokenizer.encode_plain(body) + [129283, 129281]
    matcher = xgr.GrammarMatcher(compiled)
    assert all(matcher.accept_token(i) for i in ids) and matcher.is_terminated()
    spelled = xgr.GrammarMatcher(compiled)
    assert not all(spelled.accept_token(i) for i in encoder.tokenizer.encode_plain("<tool_call>"))


def test_structural_tag_kind_validates_and_keys_canonically():
    from deepinfer.sample.structured import validate
    from deepinfer.sample.structured.backend import cache_key
    from deepinfer.sampling_params import StructuredOutputsParams

    constraint = hermes_constraint([WEATHER], parallel=True)
    params = StructuredOutputsParams(structural_tag=constraint)
    assert params.kind == "structural_tag"
    validate(params)
    reordered = json.loads(json.dumps(constraint, sort_keys=True))
    assert cache_key(StructuredOutputsParams(structural_tag=json.dumps(reordered, indent=2))) == cache_key(params)
    broken = {"type": "structural_tag", "format": {"type": "json_schema",
                                                   "json_schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}
    with pytest.raises(ValueError, match="nowhere"):
        validate(StructuredOutputsParams(structural_tag=broken))
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(structural_tag=constraint, regex="a")
